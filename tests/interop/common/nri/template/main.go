// Command template-plugin is the harness's stand-in for containerd/nri's
// stock `plugins/template` sample: a plain NRI plugin built on the stock
// github.com/containerd/nri/pkg/stub of the module's NRI line (v0.12 or
// v0.8). The sample itself lives in a separate Go module
// (github.com/containerd/nri/plugins/template) with a `replace ../..`
// directive, which the Go module proxy does not serve, so it cannot be built
// from the module cache; this program behaves like it (subscribes to the
// events it implements, answers every CreateContainer with an empty
// adjustment) and adds test knobs:
//
//	-env K=V     add K=V to every created container's env (repeatable), so a
//	             test can see this plugin's adjustment merged next to another
//	-mount SRC:DST[:OPTS]
//	             add a bind mount of SRC at DST (OPTS: comma-separated mount
//	             options, e.g. rbind,ro) to every created container
//	             (repeatable; SRC and DST cannot contain ':'), so a benchmark
//	             can make this plugin answer as much as another one does
//	-reconnect   on connection loss, reconnect (with 100 ms retries) instead
//	             of exiting, like a well-behaved external plugin
//	-socket P    NRI socket (default: the stub's default, or fd 3 when the
//	             runtime launched us: NRI_PLUGIN_SOCKET)
//	-unavailable-creates N, -unavailable-starts N
//	             answer the first N CreateContainer / StartContainer calls
//	             with code UNAVAILABLE (to self-test the runtime harness's
//	             kubelet-style retries)
//
// Concurrency: the stub's ttrpc goroutines call the handlers; the handlers
// share no mutable state except atomic counters.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type listFlag []string

func (e *listFlag) String() string     { return strings.Join(*e, ",") }
func (e *listFlag) Set(v string) error { *e = append(*e, v); return nil }

// parseMount turns SRC:DST[:OPTS] into a bind mount.
func parseMount(v string) (*api.Mount, error) {
	parts := strings.SplitN(v, ":", 3)
	if len(parts) < 2 || parts[0] == "" || parts[1] == "" {
		return nil, fmt.Errorf("-mount %q: want SRC:DST[:OPTS]", v)
	}
	m := &api.Mount{Source: parts[0], Destination: parts[1], Type: "bind"}
	if len(parts) == 3 && parts[2] != "" {
		m.Options = strings.Split(parts[2], ",")
	}
	return m, nil
}

type plugin struct {
	env     []*api.KeyValue
	mounts  []*api.Mount
	creates atomic.Int64
	starts  atomic.Int64
	// the first unavailCreates/unavailStarts calls answer UNAVAILABLE
	unavailCreates int64
	unavailStarts  int64
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "template-plugin %s "+format+"\n", append([]any{time.Now().Format("15:04:05.000")}, args...)...)
}

func (p *plugin) Configure(_ context.Context, config, runtime, version string) (stub.EventMask, error) {
	logf("configured by %s/%s (config %d bytes)", runtime, version, len(config))
	return 0, nil // 0: the stub subscribes to the events we implement
}

func (p *plugin) Synchronize(_ context.Context, pods []*api.PodSandbox, ctrs []*api.Container) ([]*api.ContainerUpdate, error) {
	logf("synchronized: %d pods, %d containers", len(pods), len(ctrs))
	return nil, nil
}

func (p *plugin) Shutdown(_ context.Context) {
	logf("shutdown")
}

func (p *plugin) CreateContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	if n := p.creates.Add(1); n <= p.unavailCreates {
		return nil, nil, status.Errorf(codes.Unavailable, "template-plugin: create %d of %s answered unavailable", n, ctr.Name)
	}
	adj := &api.ContainerAdjustment{}
	for _, kv := range p.env {
		adj.AddEnv(kv.Key, kv.Value)
	}
	for _, m := range p.mounts {
		adj.AddMount(&api.Mount{Source: m.Source, Destination: m.Destination, Type: m.Type,
			Options: append([]string(nil), m.Options...)})
	}
	return adj, nil, nil
}

func (p *plugin) StartContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	if n := p.starts.Add(1); n <= p.unavailStarts {
		return status.Errorf(codes.Unavailable, "template-plugin: start %d of %s answered unavailable", n, ctr.Name)
	}
	return nil
}

func (p *plugin) StopContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) ([]*api.ContainerUpdate, error) {
	return nil, nil
}

func (p *plugin) RemoveContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	return nil
}

func main() {
	var (
		name      = flag.String("name", "", "plugin name (default: NRI_PLUGIN_NAME or the stub's default)")
		idx       = flag.String("idx", "", "plugin index, two digits (default: NRI_PLUGIN_IDX)")
		socket    = flag.String("socket", "", "NRI socket path")
		reconnect = flag.Bool("reconnect", false, "reconnect after the runtime goes away instead of exiting")
		unCreates = flag.Int64("unavailable-creates", 0, "answer the first N CreateContainer calls with UNAVAILABLE")
		unStarts  = flag.Int64("unavailable-starts", 0, "answer the first N StartContainer calls with UNAVAILABLE")
		env       listFlag
		mounts    listFlag
	)
	flag.Var(&env, "env", "K=V to add to every created container (repeatable)")
	flag.Var(&mounts, "mount", "SRC:DST[:OPTS] bind mount to add to every created container (repeatable)")
	flag.Parse()

	p := &plugin{unavailCreates: *unCreates, unavailStarts: *unStarts}
	for _, e := range env {
		k, v, _ := strings.Cut(e, "=")
		p.env = append(p.env, &api.KeyValue{Key: k, Value: v})
	}
	for _, v := range mounts {
		m, err := parseMount(v)
		if err != nil {
			logf("%v", err)
			os.Exit(2)
		}
		p.mounts = append(p.mounts, m)
	}
	ctx := context.Background()
	for attempt := 0; ; attempt++ {
		closed := make(chan struct{})
		opts := []stub.Option{stub.WithOnClose(func() { close(closed) })}
		if *name != "" {
			opts = append(opts, stub.WithPluginName(*name))
		}
		if *idx != "" {
			opts = append(opts, stub.WithPluginIdx(*idx))
		}
		if *socket != "" {
			opts = append(opts, stub.WithSocketPath(*socket))
		}
		s, err := stub.New(p, opts...)
		if err != nil {
			logf("stub.New: %v", err)
			os.Exit(1)
		}
		if err := s.Start(ctx); err != nil {
			if *reconnect && *socket != "" {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			logf("start: %v", err)
			os.Exit(1)
		}
		logf("registered (attempt %d)", attempt)
		<-closed
		s.Stop()
		logf("connection to the runtime lost after %d creates", p.creates.Load())
		if !*reconnect || *socket == "" {
			os.Exit(0)
		}
	}
}
