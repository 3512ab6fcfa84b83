// Command nri-runtime plays the container runtime's side of NRI for interop
// tests: it embeds github.com/containerd/nri/pkg/adaptation (the code that
// containerd and CRI-O embed) at the NRI line of the Go module it is built in
// (tests/interop/nri-v012 or tests/interop/nri-v08; this file is shared by a
// symlink, the per-line differences live in events.go next to it).
//
// It listens on a temporary NRI socket (external plugins) and/or launches
// pre-installed plugins from a plugin directory (socketpair on fd 3), waits
// for the plugins to register and be synchronized, then drives the pod and
// container lifecycle described by a JSON scenario and prints one JSON object
// per line on stdout (adaptation log lines go to stderr).
//
// Concurrency: main goroutine drives the scenario; the adaptation runs its own
// goroutines (accept loop, ttrpc). In bench mode worker goroutines call
// CreateContainer concurrently; the adaptation itself serialises them with its
// own mutex, exactly as containerd does.
//
// Scenario JSON (all fields optional):
//
//	{"sync": [Pod...],            // pre-existing pods+containers reported in Synchronize
//	 "pods": [Pod...],            // lifecycle: RunPodSandbox, Create/Start each container
//	 "keep": false,               // true: leave them running (no Stop/Remove at the end)
//	 "after_reconnect": [Pod...]} // -reconnect: run after the runtime came back; the
//	                              // "pods" keep running across the restart and are
//	                              // stopped/removed at the end with these
//	Pod = {"name","namespace","uid","id","labels":{},"annotations":{},
//	       "containers":[{"name","id","env":["K=V"],"annotations":{},
//	                      "mounts":[{"destination","source","type","options":[]}]}]}
//
// Output events (field "event"): ready, synchronized, plugin_order,
// daemon_ready (-ready-endpoints), run_pod, create, retry, start, stop,
// remove, stop_pod, remove_pod, restart, bench, churn, checkpoint, done, fatal.
//
// Like kubelet, the scenario retries a CreateContainer or StartContainer that
// a plugin answered with UNAVAILABLE (-retries, -retry-interval); each retry
// is a "retry" event and is listed in the create/start event's "retries"
// (with "attempts"), so the caller can report it. Bench and churn modes do
// not retry (they measure single calls).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/nri/pkg/adaptation"
	nrilog "github.com/containerd/nri/pkg/log"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// ---------- output ----------

var (
	outMu       sync.Mutex
	stdinReader = bufio.NewReader(os.Stdin)
)

func emit(ev map[string]any) {
	b, err := json.Marshal(ev)
	if err != nil {
		b = []byte(fmt.Sprintf(`{"event":"fatal","error":%q}`, err.Error()))
	}
	outMu.Lock()
	os.Stdout.Write(append(b, '\n'))
	outMu.Unlock()
}

func fatal(format string, args ...any) {
	emit(map[string]any{"event": "fatal", "error": fmt.Sprintf(format, args...)})
	os.Exit(2)
}

func protoToAny(m proto.Message) any {
	if m == nil {
		return nil
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	if err != nil {
		return map[string]any{"marshal_error": err.Error()}
	}
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return map[string]any{"marshal_error": err.Error()}
	}
	return v
}

// ---------- logger capturing the adaptation's invocation order ----------

var orderLine = regexp.MustCompile(`^\s*#(\d+): "([^"]*)" \(([^)]*)\)`)

type capLogger struct {
	mu    sync.Mutex
	order []string // qualified names, latest "plugin invocation order" block
	next  []string
}

func (l *capLogger) line(level, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	fmt.Fprintf(os.Stderr, "nri-runtime %s [%s] %s\n", time.Now().Format("15:04:05.000"), level, msg)
	l.mu.Lock()
	defer l.mu.Unlock()
	if msg == "plugin invocation order" {
		l.next = []string{}
		return
	}
	if m := orderLine.FindStringSubmatch(msg); m != nil && l.next != nil {
		l.next = append(l.next, m[3])
		l.order = append([]string{}, l.next...)
	}
}
func (l *capLogger) Debugf(_ context.Context, f string, a ...any) {
	if verbose {
		l.line("debug", f, a...)
	}
}
func (l *capLogger) Infof(_ context.Context, f string, a ...any)  { l.line("info", f, a...) }
func (l *capLogger) Warnf(_ context.Context, f string, a ...any)  { l.line("warn", f, a...) }
func (l *capLogger) Errorf(_ context.Context, f string, a ...any) { l.line("error", f, a...) }
func (l *capLogger) Order() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string{}, l.order...)
}

var (
	logger  = &capLogger{}
	verbose bool
)

// ---------- scenario ----------

type mountSpec struct {
	Destination string   `json:"destination"`
	Source      string   `json:"source"`
	Type        string   `json:"type"`
	Options     []string `json:"options"`
}

type ctrSpec struct {
	Name        string            `json:"name"`
	ID          string            `json:"id"`
	Env         []string          `json:"env"`
	Annotations map[string]string `json:"annotations"`
	Labels      map[string]string `json:"labels"`
	Mounts      []mountSpec       `json:"mounts"`
	Args        []string          `json:"args"`
}

type podSpec struct {
	Name        string            `json:"name"`
	Namespace   string            `json:"namespace"`
	UID         string            `json:"uid"`
	ID          string            `json:"id"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
	Containers  []ctrSpec         `json:"containers"`
}

type scenario struct {
	Sync           []podSpec `json:"sync"`
	Pods           []podSpec `json:"pods"`
	Keep           bool      `json:"keep"`
	AfterReconnect []podSpec `json:"after_reconnect"`
}

// ---------- runtime state (what Synchronize reports) ----------

type state struct {
	mu         sync.Mutex
	pods       map[string]*adaptation.PodSandbox
	containers map[string]*adaptation.Container
}

func newState() *state {
	return &state{pods: map[string]*adaptation.PodSandbox{}, containers: map[string]*adaptation.Container{}}
}

func (s *state) snapshot() ([]*adaptation.PodSandbox, []*adaptation.Container) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var pods []*adaptation.PodSandbox
	var ctrs []*adaptation.Container
	for _, p := range s.pods {
		pods = append(pods, proto.Clone(p).(*adaptation.PodSandbox))
	}
	for _, c := range s.containers {
		ctrs = append(ctrs, proto.Clone(c).(*adaptation.Container))
	}
	sort.Slice(pods, func(i, j int) bool { return pods[i].Id < pods[j].Id })
	sort.Slice(ctrs, func(i, j int) bool { return ctrs[i].Id < ctrs[j].Id })
	return pods, ctrs
}

func (s *state) putPod(p *adaptation.PodSandbox) {
	s.mu.Lock()
	s.pods[p.Id] = p
	s.mu.Unlock()
}
func (s *state) delPod(id string) {
	s.mu.Lock()
	delete(s.pods, id)
	s.mu.Unlock()
}
func (s *state) putCtr(c *adaptation.Container) {
	s.mu.Lock()
	s.containers[c.Id] = c
	s.mu.Unlock()
}
func (s *state) delCtr(id string) {
	s.mu.Lock()
	delete(s.containers, id)
	s.mu.Unlock()
}

func podID(p podSpec) string {
	if p.Namespace == "" {
		p.Namespace = "default"
	}
	if p.ID != "" {
		return p.ID
	}
	return "pod-" + p.Namespace + "-" + p.Name
}

func ctrID(p podSpec, c ctrSpec, round int) string {
	if c.ID != "" {
		return c.ID
	}
	if p.Namespace == "" {
		p.Namespace = "default"
	}
	return fmt.Sprintf("ctr-%s-%s-%s-r%d", p.Namespace, p.Name, c.Name, round)
}

// makePod builds the PodSandbox the way containerd fills it: the pod's
// annotations plus containerd's own io.kubernetes.cri.* keys
// (reference docs/reference/nri-protocol.md 1.11, observed with containerd 2.1.9).
func makePod(p podSpec) *adaptation.PodSandbox {
	if p.Namespace == "" {
		p.Namespace = "default"
	}
	id := podID(p)
	ann := map[string]string{}
	for k, v := range p.Annotations {
		ann[k] = v
	}
	ann["io.kubernetes.cri.sandbox-id"] = id
	ann["io.kubernetes.cri.sandbox-name"] = p.Name
	ann["io.kubernetes.cri.sandbox-namespace"] = p.Namespace
	ann["io.kubernetes.cri.sandbox-uid"] = p.UID
	ann["io.kubernetes.cri.container-type"] = "sandbox"
	labels := map[string]string{
		"io.kubernetes.pod.name":      p.Name,
		"io.kubernetes.pod.namespace": p.Namespace,
		"io.kubernetes.pod.uid":       p.UID,
	}
	for k, v := range p.Labels {
		labels[k] = v
	}
	return &adaptation.PodSandbox{
		Id:          id,
		Name:        p.Name,
		Uid:         p.UID,
		Namespace:   p.Namespace,
		Labels:      labels,
		Annotations: ann,
		Linux: &adaptation.LinuxPodSandbox{
			CgroupParent: "/kubepods/besteffort/pod" + p.UID,
		},
	}
}

func makeCtr(pod *adaptation.PodSandbox, c ctrSpec, id string) *adaptation.Container {
	ann := map[string]string{
		"io.kubernetes.cri.container-name": c.Name,
		"io.kubernetes.cri.container-type": "container",
		"io.kubernetes.cri.sandbox-id":     pod.Id,
		"io.kubernetes.cri.image-name":     "nvcr.io/nvidia/cuda:13.0.2-base-ubuntu24.04",
	}
	for k, v := range c.Annotations {
		ann[k] = v
	}
	labels := map[string]string{
		"io.kubernetes.container.name": c.Name,
		"io.kubernetes.pod.name":       pod.Name,
		"io.kubernetes.pod.namespace":  pod.Namespace,
		"io.kubernetes.pod.uid":        pod.Uid,
	}
	for k, v := range c.Labels {
		labels[k] = v
	}
	env := append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, c.Env...)
	var mounts []*adaptation.Mount
	for _, m := range c.Mounts {
		mounts = append(mounts, &adaptation.Mount{Destination: m.Destination, Source: m.Source, Type: m.Type, Options: m.Options})
	}
	args := c.Args
	if len(args) == 0 {
		args = []string{"sleep", "infinity"}
	}
	return &adaptation.Container{
		Id:           id,
		PodSandboxId: pod.Id,
		Name:         c.Name,
		Labels:       labels,
		Annotations:  ann,
		Args:         args,
		Env:          env,
		Mounts:       mounts,
		Linux: &adaptation.LinuxContainer{
			CgroupsPath: "kubepods-besteffort-pod" + pod.Uid + ":cri-containerd:" + id,
		},
	}
}

// ---------- the runtime ----------

type runtime struct {
	a          *adaptation.Adaptation
	st         *state
	round      int
	syncMu     sync.Mutex
	syncCount  int // successful plugin synchronizations in the current round
	syncCond   *sync.Cond
	starting   atomic.Bool // inside Adaptation.Start: the sync is the pre-installed plugins' batch
	socketPath string
	pluginDir  string
	configDir  string
	external   bool
	// kubelet-style retries of a CreateContainer/StartContainer that a plugin
	// answered with UNAVAILABLE (-retries extra tries, -retry-interval apart)
	retries       int
	retryInterval time.Duration
}

func (r *runtime) syncFn(ctx context.Context, cb adaptation.SyncCB) error {
	pods, ctrs := r.st.snapshot()
	start := time.Now()
	updates, err := cb(ctx, pods, ctrs)
	ev := map[string]any{
		"event": "synchronized", "round": r.round, "pods": len(pods), "containers": len(ctrs),
		"ms": msSince(start), "ok": err == nil, "preinstalled": r.starting.Load(),
	}
	var ids []string
	for _, c := range ctrs {
		ids = append(ids, c.Id)
	}
	ev["container_ids"] = ids
	if err != nil {
		ev["error"] = err.Error()
	}
	var us []any
	for _, u := range updates {
		us = append(us, protoToAny(u))
	}
	ev["updates"] = us
	emit(ev)
	if err == nil && r.a != nil && !r.starting.Load() {
		a := r.a
		// The plugin is appended to the adaptation's list only after this
		// function returns and the sync lock is released; BlockPluginSync
		// waits for exactly that (takes the read side of the same lock).
		go func() {
			a.BlockPluginSync().Unblock()
			r.syncMu.Lock()
			r.syncCount++
			r.syncMu.Unlock()
			r.syncCond.Broadcast()
		}()
	}
	return err
}

func (r *runtime) updateFn(_ context.Context, updates []*adaptation.ContainerUpdate) ([]*adaptation.ContainerUpdate, error) {
	var us []any
	for _, u := range updates {
		us = append(us, protoToAny(u))
	}
	emit(map[string]any{"event": "unsolicited_update", "updates": us})
	return nil, nil
}

func (r *runtime) start() {
	r.syncMu.Lock()
	r.syncCount = 0
	r.syncMu.Unlock()
	opts := []adaptation.Option{
		adaptation.WithPluginPath(r.pluginDir),
		adaptation.WithPluginConfigPath(r.configDir),
	}
	if r.external {
		opts = append(opts, adaptation.WithSocketPath(r.socketPath))
	} else {
		opts = append(opts, adaptation.WithDisabledExternalConnections())
	}
	a, err := adaptation.New("containerd", runtimeVersion, r.syncFn, r.updateFn, opts...)
	if err != nil {
		fatal("adaptation.New: %v", err)
	}
	r.a = a
	start := time.Now()
	r.starting.Store(true)
	err = a.Start()
	r.starting.Store(false)
	if err != nil {
		fatal("adaptation.Start: %v", err)
	}
	emit(map[string]any{"event": "ready", "round": r.round, "nri": nriLine, "socket": r.socketPath,
		"plugin_dir": r.pluginDir, "start_ms": msSince(start)})
}

// waitPlugins waits until n external plugins were synchronized in this round.
func (r *runtime) waitPlugins(n int, timeout time.Duration) bool {
	if n <= 0 {
		return true
	}
	deadline := time.Now().Add(timeout)
	go func() {
		time.Sleep(timeout)
		r.syncCond.Broadcast()
	}()
	r.syncMu.Lock()
	defer r.syncMu.Unlock()
	for r.syncCount < n {
		if time.Now().After(deadline) {
			return false
		}
		r.syncCond.Wait()
	}
	return true
}

func msSince(t time.Time) float64 {
	return float64(time.Since(t).Microseconds()) / 1000.0
}

func errStr(err error) any {
	if err == nil {
		return nil
	}
	return err.Error()
}

func envMap(adj *adaptation.ContainerAdjustment) map[string]string {
	m := map[string]string{}
	if adj == nil {
		return m
	}
	for _, kv := range adj.Env {
		m[kv.Key] = kv.Value
	}
	return m
}

// isUnavailable reports whether a plugin answered with ttrpc/gRPC code
// UNAVAILABLE (the adaptation may wrap the status error with %w).
func isUnavailable(err error) bool {
	if err == nil {
		return false
	}
	if st, ok := status.FromError(err); ok && st.Code() == codes.Unavailable {
		return true
	}
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) && se.GRPCStatus().Code() == codes.Unavailable {
		return true
	}
	return false
}

// withRetries calls f until it succeeds, fails with anything but
// UNAVAILABLE, or r.retries extra tries are used up, sleeping
// r.retryInterval between tries, as kubelet retries a container whose
// create/start failed (with a back-off; a fixed interval here). Each retry is
// emitted as a "retry" event and listed in the returned slice, so a test can
// report it instead of absorbing it silently.
func (r *runtime) withRetries(op string, pod *adaptation.PodSandbox, ctr *adaptation.Container, f func() error) ([]any, error) {
	var retries []any
	for attempt := 1; ; attempt++ {
		start := time.Now()
		err := f()
		if err == nil || !isUnavailable(err) || attempt > r.retries {
			return retries, err
		}
		rec := map[string]any{"attempt": attempt, "error": err.Error(), "ms": msSince(start),
			"wait_ms": float64(r.retryInterval.Microseconds()) / 1000.0}
		retries = append(retries, rec)
		ev := map[string]any{"event": "retry", "op": op, "round": r.round, "pod": pod.Namespace + "/" + pod.Name,
			"container": ctr.Name, "id": ctr.Id}
		for k, v := range rec {
			ev[k] = v
		}
		emit(ev)
		time.Sleep(r.retryInterval)
	}
}

// createOne issues CreateContainer (retried on UNAVAILABLE) and emits its result.
func (r *runtime) createOne(ctx context.Context, pod *adaptation.PodSandbox, ctr *adaptation.Container) bool {
	req := &adaptation.CreateContainerRequest{Pod: pod, Container: ctr}
	var rsp *adaptation.CreateContainerResponse
	start := time.Now()
	retries, err := r.withRetries("create", pod, ctr, func() error {
		var err error
		rsp, err = r.a.CreateContainer(ctx, req)
		return err
	})
	ev := map[string]any{
		"event": "create", "round": r.round, "pod": pod.Namespace + "/" + pod.Name, "pod_uid": pod.Uid,
		"container": ctr.Name, "id": ctr.Id, "ms": msSince(start), "ok": err == nil, "error": errStr(err),
		"attempts": len(retries) + 1, "retries": retries,
	}
	if err == nil {
		var adj *adaptation.ContainerAdjustment
		if rsp != nil {
			adj = rsp.Adjust
			ev["update_count"] = len(rsp.Update)
			ev["evict_count"] = len(rsp.Evict)
		}
		ev["adjust"] = protoToAny(adj)
		ev["env"] = envMap(adj)
		if adj != nil {
			ev["adjust_bytes"] = proto.Size(adj)
		}
	}
	emit(ev)
	return err == nil
}

// startOne issues StartContainer (retried on UNAVAILABLE) and emits its result.
func (r *runtime) startOne(ctx context.Context, pod *adaptation.PodSandbox, ctr *adaptation.Container) bool {
	start := time.Now()
	retries, err := r.withRetries("start", pod, ctr, func() error { return evStart(ctx, r.a, pod, ctr) })
	emit(map[string]any{"event": "start", "round": r.round, "pod": pod.Namespace + "/" + pod.Name,
		"container": ctr.Name, "id": ctr.Id, "ms": msSince(start), "ok": err == nil, "error": errStr(err),
		"attempts": len(retries) + 1, "retries": retries})
	return err == nil
}

// waitDaemonReady waits until the plugin daemon reports overall readiness:
// its health address is read from endpointsPath (the "health" key of the
// JSON the daemon writes once started), then GET /readyz is polled until it
// answers 200, the way a DaemonSet rollout waits for the readiness probe.
// Emits "daemon_ready"; fatal after timeout with the last answer.
func (r *runtime) waitDaemonReady(endpointsPath string, timeout time.Duration) {
	if endpointsPath == "" {
		return
	}
	start := time.Now()
	deadline := start.Add(timeout)
	client := &http.Client{Timeout: 2 * time.Second}
	last := "endpoints file not written yet"
	polls := 0
	for time.Now().Before(deadline) {
		var ep struct {
			Health string `json:"health"`
		}
		if b, err := os.ReadFile(endpointsPath); err == nil && json.Unmarshal(b, &ep) == nil && ep.Health != "" {
			polls++
			rsp, err := client.Get("http://" + ep.Health + "/readyz")
			if err != nil {
				last = err.Error()
			} else {
				body, _ := io.ReadAll(io.LimitReader(rsp.Body, 64<<10))
				rsp.Body.Close()
				last = fmt.Sprintf("%d %s", rsp.StatusCode, strings.TrimSpace(string(body)))
				if rsp.StatusCode == http.StatusOK {
					emit(map[string]any{"event": "daemon_ready", "round": r.round, "ms": msSince(start), "polls": polls})
					return
				}
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	fatal("daemon not ready within %s (%s): %s", timeout, endpointsPath, last)
}

func (r *runtime) simple(op string, pod *adaptation.PodSandbox, ctr *adaptation.Container, f func() error) {
	start := time.Now()
	err := f()
	ev := map[string]any{"event": op, "round": r.round, "pod": pod.Namespace + "/" + pod.Name, "ms": msSince(start),
		"ok": err == nil, "error": errStr(err)}
	if ctr != nil {
		ev["container"] = ctr.Name
		ev["id"] = ctr.Id
	}
	emit(ev)
}

type created struct {
	pod  *adaptation.PodSandbox
	ctrs []*adaptation.Container
}

func (r *runtime) runPods(ctx context.Context, pods []podSpec) []created {
	var out []created
	for _, ps := range pods {
		pod := makePod(ps)
		r.simple("run_pod", pod, nil, func() error { return evRunPod(ctx, r.a, pod) })
		r.st.putPod(pod)
		cr := created{pod: pod}
		for _, cs := range ps.Containers {
			ctr := makeCtr(pod, cs, ctrID(ps, cs, r.round))
			if !r.createOne(ctx, pod, ctr) {
				continue
			}
			ctr.State = adaptation.ContainerState_CONTAINER_CREATED
			r.st.putCtr(ctr)
			_ = evPostCreate(ctx, r.a, pod, ctr)
			r.startOne(ctx, pod, ctr)
			ctr.State = adaptation.ContainerState_CONTAINER_RUNNING
			_ = evPostStart(ctx, r.a, pod, ctr)
			cr.ctrs = append(cr.ctrs, ctr)
		}
		out = append(out, cr)
	}
	return out
}

func (r *runtime) teardown(ctx context.Context, cs []created) {
	for _, c := range cs {
		for _, ctr := range c.ctrs {
			ctr := ctr
			r.simple("stop", c.pod, ctr, func() error {
				_, err := r.a.StopContainer(ctx, &adaptation.StopContainerRequest{Pod: c.pod, Container: ctr})
				return err
			})
			ctr.State = adaptation.ContainerState_CONTAINER_STOPPED
			r.simple("remove", c.pod, ctr, func() error { return evRemoveContainer(ctx, r.a, c.pod, ctr) })
			r.st.delCtr(ctr.Id)
		}
		r.simple("stop_pod", c.pod, nil, func() error { return evStopPod(ctx, r.a, c.pod) })
		r.simple("remove_pod", c.pod, nil, func() error { return evRemovePod(ctx, r.a, c.pod) })
		r.st.delPod(c.pod.Id)
	}
}

// ---------- bench ----------

func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	// nearest-rank
	k := int(float64(len(sorted))*p/100.0+0.999999) - 1
	if k < 0 {
		k = 0
	}
	if k >= len(sorted) {
		k = len(sorted) - 1
	}
	return sorted[k]
}

func (r *runtime) bench(ctx context.Context, pods []podSpec, levels []int, calls int, warmup int) {
	if len(pods) == 0 || len(pods[0].Containers) == 0 {
		fatal("bench needs at least one pod with one container in the scenario")
	}
	sbx := make([]*adaptation.PodSandbox, len(pods))
	for i, ps := range pods {
		sbx[i] = makePod(ps)
		if err := evRunPod(ctx, r.a, sbx[i]); err != nil {
			fatal("bench RunPodSandbox: %v", err)
		}
	}
	seq := 0
	var seqMu sync.Mutex
	nextID := func(w int) string {
		seqMu.Lock()
		defer seqMu.Unlock()
		seq++
		return fmt.Sprintf("bench-w%d-%d", w, seq)
	}
	for _, c := range levels {
		total := calls
		if total < c {
			total = c
		}
		var (
			mu       sync.Mutex
			lat      []float64
			errs     int
			firstErr string
			ids      []struct {
				pod *adaptation.PodSandbox
				ctr *adaptation.Container
			}
		)
		// warm-up (not measured)
		for i := 0; i < warmup; i++ {
			pod := sbx[i%len(sbx)]
			ctr := makeCtr(pod, pods[i%len(pods)].Containers[0], nextID(-1))
			if _, err := r.a.CreateContainer(ctx, &adaptation.CreateContainerRequest{Pod: pod, Container: ctr}); err == nil {
				_ = evRemoveContainer(ctx, r.a, pod, ctr)
			}
		}
		work := make(chan int, total)
		for i := 0; i < total; i++ {
			work <- i
		}
		close(work)
		var wg sync.WaitGroup
		levelStart := time.Now()
		for w := 0; w < c; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				pi := w % len(sbx)
				pod := sbx[pi]
				spec := pods[pi].Containers[0]
				for range work {
					ctr := makeCtr(pod, spec, nextID(w))
					t0 := time.Now()
					_, err := r.a.CreateContainer(ctx, &adaptation.CreateContainerRequest{Pod: pod, Container: ctr})
					d := msSince(t0)
					mu.Lock()
					lat = append(lat, d)
					if err != nil {
						errs++
						if firstErr == "" {
							firstErr = err.Error()
						}
					} else {
						ids = append(ids, struct {
							pod *adaptation.PodSandbox
							ctr *adaptation.Container
						}{pod, ctr})
					}
					mu.Unlock()
				}
			}(w)
		}
		wg.Wait()
		wall := msSince(levelStart)
		for _, x := range ids {
			_ = evRemoveContainer(ctx, r.a, x.pod, x.ctr)
		}
		sort.Float64s(lat)
		sum := 0.0
		for _, v := range lat {
			sum += v
		}
		emit(map[string]any{
			"event": "bench", "concurrency": c, "calls": len(lat), "errors": errs, "first_error": firstErr,
			"p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
			"max_ms": lat[len(lat)-1], "mean_ms": sum / float64(len(lat)), "wall_ms": wall,
			"per_call_ms": wall / float64(len(lat)), // adaptation serialises calls: ~service time
		})
	}
	for _, pod := range sbx {
		_ = evStopPod(ctx, r.a, pod)
		_ = evRemovePod(ctx, r.a, pod)
	}
}

// churn: n sequential create+remove pairs; every `every` pairs a checkpoint
// event is printed and, when pause is set, a line is read from stdin before
// continuing (so the caller can sample the plugin's RSS).
func (r *runtime) churn(ctx context.Context, pods []podSpec, n, every int, pause bool) {
	sbx := make([]*adaptation.PodSandbox, len(pods))
	for i, ps := range pods {
		sbx[i] = makePod(ps)
		_ = evRunPod(ctx, r.a, sbx[i])
	}
	in := stdinReader
	errs := 0
	firstErr := ""
	start := time.Now()
	for i := 1; i <= n; i++ {
		pi := i % len(sbx)
		pod := sbx[pi]
		ctr := makeCtr(pod, pods[pi].Containers[0], fmt.Sprintf("churn-%d", i))
		if _, err := r.a.CreateContainer(ctx, &adaptation.CreateContainerRequest{Pod: pod, Container: ctr}); err != nil {
			errs++
			if firstErr == "" {
				firstErr = err.Error()
			}
		}
		_ = evRemoveContainer(ctx, r.a, pod, ctr)
		if every > 0 && i%every == 0 {
			emit(map[string]any{"event": "checkpoint", "done": i, "errors": errs, "first_error": firstErr, "ms": msSince(start)})
			if pause {
				if _, err := in.ReadString('\n'); err != nil {
					pause = false
				}
			}
		}
	}
	emit(map[string]any{"event": "churn", "done": n, "errors": errs, "first_error": firstErr, "ms": msSince(start)})
	for _, pod := range sbx {
		_ = evStopPod(ctx, r.a, pod)
		_ = evRemovePod(ctx, r.a, pod)
	}
}

// ---------- main ----------

func parseLevels(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			fatal("bad -bench-levels entry %q", f)
		}
		out = append(out, n)
	}
	return out
}

func main() {
	var (
		socketPath   = flag.String("socket", "", "NRI socket to listen on for external plugins (empty: external connections disabled)")
		pluginDir    = flag.String("plugin-dir", "", "directory of pre-installed plugins NN-name (empty: a fresh empty directory)")
		configDir    = flag.String("plugin-config-dir", "", "directory of pre-installed plugin configs (empty: a fresh empty directory)")
		scenarioPath = flag.String("scenario", "", "scenario JSON file ('-' = stdin)")
		waitN        = flag.Int("wait-plugins", 1, "external plugins to wait for before running the scenario")
		waitTimeout  = flag.Duration("wait-timeout", 30*time.Second, "how long to wait for plugins")
		regTimeout   = flag.Duration("registration-timeout", adaptation.DefaultPluginRegistrationTimeout, "plugin registration timeout (containerd default 5s)")
		reqTimeout   = flag.Duration("request-timeout", adaptation.DefaultPluginRequestTimeout, "plugin request timeout (containerd default 2s)")
		reconnect    = flag.Bool("reconnect", false, "after the scenario, stop the runtime side, wait -restart-gap, start it again and wait for re-registration + Synchronize")
		gap          = flag.Duration("restart-gap", 300*time.Millisecond, "time the runtime stays away in -reconnect mode")
		benchMode    = flag.Bool("bench", false, "bench mode: concurrent CreateContainer latency for the scenario's pods")
		levels       = flag.String("bench-levels", "1,16,64", "concurrency levels")
		calls        = flag.Int("bench-calls", 1000, "CreateContainer calls per level")
		warmup       = flag.Int("bench-warmup", 50, "unmeasured calls before each level")
		churnN       = flag.Int("churn", 0, "churn mode: this many sequential create+remove pairs")
		every        = flag.Int("checkpoint-every", 1000, "churn: checkpoint period")
		pause        = flag.Bool("pause", false, "churn: wait for a stdin line at each checkpoint")
		holdAfter    = flag.Bool("hold", false, "after everything, wait for stdin EOF before stopping the runtime")
		gate         = flag.Bool("gate", false, "after the plugins registered, print a gate event and wait for a stdin line")
		readyFile    = flag.String("ready-endpoints", "", "the plugin daemon's endpoints.json: before the scenario (and after a reconnect) wait until GET http://<health>/readyz answers 200")
		readyTimeout = flag.Duration("ready-timeout", 60*time.Second, "how long to wait for -ready-endpoints readiness")
		retries      = flag.Int("retries", 5, "kubelet-style extra tries of a CreateContainer/StartContainer answered UNAVAILABLE (0 = none)")
		retryIvl     = flag.Duration("retry-interval", time.Second, "pause between those tries")
	)
	flag.BoolVar(&verbose, "v", false, "log adaptation debug lines")
	flag.Parse()
	nrilog.Set(logger)
	adaptation.SetPluginRegistrationTimeout(*regTimeout)
	adaptation.SetPluginRequestTimeout(*reqTimeout)

	var sc scenario
	if *scenarioPath != "" {
		var data []byte
		var err error
		if *scenarioPath == "-" {
			data, err = io.ReadAll(stdinReader)
		} else {
			data, err = os.ReadFile(*scenarioPath)
		}
		if err != nil {
			fatal("read scenario: %v", err)
		}
		if err := json.Unmarshal(data, &sc); err != nil {
			fatal("parse scenario: %v", err)
		}
	}

	tmp, err := os.MkdirTemp("", "nrirt")
	if err != nil {
		fatal("mkdtemp: %v", err)
	}
	defer os.RemoveAll(tmp)
	if *pluginDir == "" {
		*pluginDir = filepath.Join(tmp, "plugins")
		_ = os.MkdirAll(*pluginDir, 0o755)
	}
	if *configDir == "" {
		*configDir = filepath.Join(tmp, "conf.d")
		_ = os.MkdirAll(*configDir, 0o755)
	}

	r := &runtime{st: newState(), socketPath: *socketPath, pluginDir: *pluginDir, configDir: *configDir,
		external: *socketPath != "", round: 1, retries: *retries, retryInterval: *retryIvl}
	r.syncCond = sync.NewCond(&r.syncMu)
	for _, ps := range sc.Sync {
		pod := makePod(ps)
		r.st.putPod(pod)
		for _, cs := range ps.Containers {
			ctr := makeCtr(pod, cs, ctrID(ps, cs, 0))
			ctr.State = adaptation.ContainerState_CONTAINER_RUNNING
			r.st.putCtr(ctr)
		}
	}

	ctx := context.Background()
	r.start()
	if r.external && !r.waitPlugins(*waitN, *waitTimeout) {
		fatal("timeout: %d of %d plugins registered within %s", r.syncCount, *waitN, *waitTimeout)
	}
	emit(map[string]any{"event": "plugin_order", "round": r.round, "plugins": logger.Order()})
	r.waitDaemonReady(*readyFile, *readyTimeout)
	if *gate {
		emit(map[string]any{"event": "gate"})
		_, _ = stdinReader.ReadString('\n')
	}

	switch {
	case *benchMode:
		r.bench(ctx, sc.Pods, parseLevels(*levels), *calls, *warmup)
	case *churnN > 0:
		r.churn(ctx, sc.Pods, *churnN, *every, *pause)
	default:
		cs := r.runPods(ctx, sc.Pods)
		if *reconnect {
			t0 := time.Now()
			r.a.Stop()
			// Adaptation.Stop closes the listener but not the connections of
			// external plugins (a real runtime exits, which closes them);
			// shut them down so the plugins see EOF, as after a restart.
			n := shutdownConns(r.socketPath)
			emit(map[string]any{"event": "runtime_stopped", "round": r.round, "closed_connections": n})
			time.Sleep(*gap)
			r.round++
			r.start()
			ok := r.waitPlugins(*waitN, *waitTimeout)
			emit(map[string]any{"event": "restart", "round": r.round, "ok": ok, "reconnect_ms": msSince(t0),
				"gap_ms": float64(gap.Microseconds()) / 1000.0})
			if !ok {
				fatal("timeout: plugin did not come back after the runtime restarted")
			}
			emit(map[string]any{"event": "plugin_order", "round": r.round, "plugins": logger.Order()})
			r.waitDaemonReady(*readyFile, *readyTimeout)
			cs = append(cs, r.runPods(ctx, sc.AfterReconnect)...)
		}
		if !sc.Keep {
			r.teardown(ctx, cs)
		}
	}
	if *holdAfter {
		_, _ = io.ReadAll(stdinReader)
	}
	r.a.Stop()
	emit(map[string]any{"event": "done", "round": r.round})
}

// shutdownConns shuts down (both directions) every unix socket of this
// process whose local address is path, i.e. the accepted plugin connections.
// Returns how many it shut down.
func shutdownConns(path string) int {
	if path == "" {
		return 0
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0
	}
	n := 0
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		sa, err := syscall.Getsockname(fd)
		if err != nil {
			continue
		}
		if ua, ok := sa.(*syscall.SockaddrUnix); ok && ua.Name == path {
			if syscall.Shutdown(fd, syscall.SHUT_RDWR) == nil {
				n++
			}
		}
	}
	return n
}
