// Command fake-deviceplugin is a minimal device plugin used only to prove
// the kubelet-sim harness (tests/interop/test_harness_selftest.py); it is not
// a model of fracplugin. It advertises -per-gpu devices "<GPU>::<n>" for each
// GPU of -gpus, serves on <dir>/<name>.sock, registers on <dir>/kubelet.sock,
// re-registers when kubelet.sock is re-created or its own socket vanishes
// (polled every 20 ms), marks every device of the first GPU Unhealthy on
// SIGUSR1 and Healthy again on SIGUSR2, prefers devices of one GPU, and
// answers Allocate with env FAKE_DEVICES=<ids>.
//
// Concurrency: gRPC goroutines serve the API; one watcher goroutine handles
// re-registration; health changes are broadcast to ListAndWatch streams
// through a channel per stream, under a mutex.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	mu      sync.Mutex
	gpus    []string
	perGPU  int
	bad     map[string]bool
	watches map[chan struct{}]bool
}

func (p *plugin) devices() []*pluginapi.Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*pluginapi.Device
	for _, g := range p.gpus {
		h := pluginapi.Healthy
		if p.bad[g] {
			h = pluginapi.Unhealthy
		}
		for i := 0; i < p.perGPU; i++ {
			out = append(out, &pluginapi.Device{ID: fmt.Sprintf("%s::%d", g, i), Health: h})
		}
	}
	return out
}

func (p *plugin) notify() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.watches {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	c := make(chan struct{}, 1)
	p.mu.Lock()
	p.watches[c] = true
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.watches, c)
		p.mu.Unlock()
	}()
	for {
		if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices()}); err != nil {
			return err
		}
		select {
		case <-c:
		case <-s.Context().Done():
			return nil
		}
	}
}

func (p *plugin) GetPreferredAllocation(_ context.Context, r *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	rsp := &pluginapi.PreferredAllocationResponse{}
	for _, cr := range r.ContainerRequests {
		groups := map[string][]string{}
		for _, id := range cr.AvailableDeviceIDs {
			g := id[:strings.LastIndex(id, "::")]
			groups[g] = append(groups[g], id)
		}
		var keys []string
		for g := range groups {
			keys = append(keys, g)
		}
		sort.Strings(keys)
		chosen := append([]string{}, cr.MustIncludeDeviceIDs...)
		taken := map[string]bool{}
		for _, id := range chosen {
			taken[id] = true
		}
		for _, g := range keys {
			if len(groups[g]) >= int(cr.AllocationSize)-len(chosen) {
				for _, id := range groups[g] {
					if len(chosen) >= int(cr.AllocationSize) {
						break
					}
					if !taken[id] {
						chosen = append(chosen, id)
						taken[id] = true
					}
				}
				break
			}
		}
		rsp.ContainerResponses = append(rsp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: chosen})
	}
	return rsp, nil
}

func (p *plugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	rsp := &pluginapi.AllocateResponse{}
	for _, cr := range r.ContainerRequests {
		rsp.ContainerResponses = append(rsp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"FAKE_DEVICES": strings.Join(cr.DevicesIds, ",")},
		})
	}
	return rsp, nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "fake-deviceplugin %s "+format+"\n", append([]any{time.Now().Format("15:04:05.000")}, args...)...)
}

func inode(path string) uint64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}

func main() {
	var (
		dir      = flag.String("dir", "", "device plugin directory")
		name     = flag.String("name", "fake", "socket base name")
		resource = flag.String("resource", "example.com/fake-gpu-memory", "extended resource name")
		gpus     = flag.String("gpus", "GPU-a,GPU-b", "comma list of GPU UUIDs")
		perGPU   = flag.Int("per-gpu", 4, "devices per GPU")
	)
	flag.Parse()
	p := &plugin{gpus: strings.Split(*gpus, ","), perGPU: *perGPU, bad: map[string]bool{}, watches: map[chan struct{}]bool{}}
	sock := filepath.Join(*dir, *name+".sock")
	kubeletSock := filepath.Join(*dir, "kubelet.sock")

	var srv *grpc.Server
	serve := func() {
		if srv != nil {
			srv.Stop()
		}
		os.Remove(sock)
		l, err := net.Listen("unix", sock)
		if err != nil {
			logf("listen: %v", err)
			os.Exit(1)
		}
		srv = grpc.NewServer()
		pluginapi.RegisterDevicePluginServer(srv, p)
		go func() { _ = srv.Serve(l) }()
	}
	register := func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := grpc.NewClient("unix://"+kubeletSock, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithAuthority("localhost"))
		if err != nil {
			return false
		}
		defer conn.Close()
		_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
			Version: pluginapi.Version, Endpoint: filepath.Base(sock), ResourceName: *resource,
			Options: &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
		})
		if err != nil {
			logf("register: %v", err)
			return false
		}
		logf("registered")
		return true
	}

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGTERM, syscall.SIGINT)
	serve()
	var lastIno uint64
	registered := false
	tick := time.NewTicker(20 * time.Millisecond)
	for {
		select {
		case s := <-sigs:
			switch s {
			case syscall.SIGUSR1, syscall.SIGUSR2:
				p.mu.Lock()
				p.bad[p.gpus[0]] = s == syscall.SIGUSR1
				p.mu.Unlock()
				p.notify()
			default:
				srv.Stop()
				os.Remove(sock)
				return
			}
		case <-tick.C:
			ino := inode(kubeletSock)
			if _, err := os.Stat(sock); err != nil {
				serve() // kubelet removed our socket: serve again
				registered = false
			}
			if ino != 0 && (ino != lastIno || !registered) {
				registered = register()
				if registered {
					lastIno = ino
				}
			}
		}
	}
}
