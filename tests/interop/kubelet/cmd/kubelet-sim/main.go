// Command kubelet-sim plays kubelet's device manager against a device plugin,
// using the upstream API stubs k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1.
//
// What it does, following kubelet (reference docs/reference/kubelet-device-plugin.md A.5):
//   - serves Registration on <dir>/kubelet.sock (the directory is created
//     with mode 0750, stale sockets in it are removed first, as
//     CleanupPluginDirectory does);
//   - on Register: checks version "v1beta1", dials <dir>/<endpoint> over unix
//     with :authority "localhost", insecure, blocking, 10 s timeout; calls
//     GetDevicePluginOptions, starts ListAndWatch, and only then returns
//     from Register (a dial failure fails Register);
//   - keeps the latest full device list from ListAndWatch;
//   - runs the steps of a JSON script and prints one JSON object per line.
//
// Script: {"steps": [Step...]}, steps run in order after the first
// registration (and first ListAndWatch answer). Step "op" values:
//
//	{"op":"list"}                         the current device list (ids, health per GPU)
//	{"op":"preferred","size":N,"available":[..]|null,"must_include":[..]}
//	                                      GetPreferredAllocation; available defaults to
//	                                      the healthy devices not yet allocated
//	{"op":"allocate","size":N}            like kubelet admission: pick N devices
//	                                      (GetPreferredAllocation when the plugin offers
//	                                      it, else the first N free), then Allocate
//	{"op":"allocate","ids":[..]}          Allocate exactly these IDs
//	{"op":"restart","gap_ms":M}           kubelet restart: stop the Registration
//	                                      server, delete every socket in the dir, wait
//	                                      M ms, re-create kubelet.sock; measure until
//	                                      the plugin re-registered and its first
//	                                      ListAndWatch answer arrived
//	{"op":"pause","name":S}               print {"event":"pause"} and wait for a stdin line
//	{"op":"wait_health","gpu":UUID,"health":"Unhealthy","timeout_s":T}
//	                                      wait for a ListAndWatch update where every
//	                                      device of that GPU has that health
//	{"op":"wait_all_healthy","timeout_s":T}
//	                                      wait for a ListAndWatch list with every device
//	                                      Healthy (a plugin may start with devices
//	                                      Unhealthy until its GPU services are up)
//	{"op":"sleep","ms":M}
//
// Concurrency: the main goroutine runs the script; gRPC goroutines serve
// Register; one goroutine per plugin connection reads ListAndWatch and
// publishes each list under a mutex with a condition variable.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

var (
	outMu sync.Mutex
	stdin = bufio.NewReader(os.Stdin)
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

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kubelet-sim %s "+format+"\n", append([]any{time.Now().Format("15:04:05.000")}, args...)...)
}

func msSince(t time.Time) float64 { return float64(time.Since(t).Microseconds()) / 1000.0 }

func errStr(err error) any {
	if err == nil {
		return nil
	}
	return err.Error()
}

// gpuOf returns the GPU part of a device ID "<GPU-UUID>::<n>" (the whole ID
// when it has no "::").
func gpuOf(id string) string {
	if i := strings.LastIndex(id, "::"); i >= 0 {
		return id[:i]
	}
	return id
}

func byGPU(ids []string) map[string]int {
	m := map[string]int{}
	for _, id := range ids {
		m[gpuOf(id)]++
	}
	return m
}

// ---------- plugin endpoint (what kubelet's endpoint.go does) ----------

type endpoint struct {
	resource   string
	socket     string
	conn       *grpc.ClientConn
	client     pluginapi.DevicePluginClient
	options    *pluginapi.DevicePluginOptions
	registered time.Time
}

type kubelet struct {
	pluginapi.UnimplementedRegistrationServer
	dir    string
	srv    *grpc.Server
	mu     sync.Mutex
	cond   *sync.Cond
	ep     *endpoint
	regs   int // successful registrations
	lists  int // ListAndWatch messages received (all connections)
	devs   []*pluginapi.Device
	gen    int // bumps on every ListAndWatch message of the current endpoint
	alloc  map[string]bool
	start  time.Time
	verify bool
}

func (k *kubelet) sockPath() string { return filepath.Join(k.dir, "kubelet.sock") }

// Register implements Registration.Register the way kubelet does.
func (k *kubelet) Register(ctx context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	t0 := time.Now()
	ev := map[string]any{"event": "register", "version": req.Version, "endpoint": req.Endpoint,
		"resource_name": req.ResourceName, "options": req.Options, "t_ms": msSince(k.start)}
	if req.Version != pluginapi.Version {
		ev["ok"] = false
		ev["error"] = "unsupported version " + req.Version
		emit(ev)
		return nil, fmt.Errorf("invalid version %q, supported: %v", req.Version, pluginapi.SupportedVersions)
	}
	if req.ResourceName == "" || !strings.Contains(req.ResourceName, "/") || strings.HasPrefix(req.ResourceName, "kubernetes.io/") {
		ev["ok"] = false
		ev["error"] = "invalid extended resource name"
		emit(ev)
		return nil, fmt.Errorf("invalid extended resource name %q", req.ResourceName)
	}
	sock := filepath.Join(k.dir, req.Endpoint)
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	//nolint:staticcheck // kubelet dials exactly like this (blocking, 10 s)
	conn, err := grpc.DialContext(dctx, sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority("localhost"),
		grpc.WithBlock(), //nolint:staticcheck
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
	if err != nil {
		ev["ok"] = false
		ev["error"] = "dial plugin: " + err.Error()
		emit(ev)
		return nil, fmt.Errorf("failed to dial device plugin %s: %w", sock, err)
	}
	client := pluginapi.NewDevicePluginClient(conn)
	octx, ocancel := context.WithTimeout(context.Background(), 10*time.Second)
	opts, err := client.GetDevicePluginOptions(octx, &pluginapi.Empty{})
	ocancel()
	if err != nil {
		conn.Close()
		ev["ok"] = false
		ev["error"] = "GetDevicePluginOptions: " + err.Error()
		emit(ev)
		return nil, fmt.Errorf("GetDevicePluginOptions: %w", err)
	}
	ep := &endpoint{resource: req.ResourceName, socket: sock, conn: conn, client: client, options: opts, registered: time.Now()}
	k.mu.Lock()
	old := k.ep
	k.ep = ep
	k.gen = 0
	k.regs++
	n := k.regs
	k.mu.Unlock()
	if old != nil && old.conn != nil {
		old.conn.Close()
	}
	go k.listAndWatch(ep)
	ev["ok"] = true
	ev["n"] = n
	ev["plugin_options"] = map[string]bool{
		"pre_start_required":                 opts.PreStartRequired,
		"get_preferred_allocation_available": opts.GetPreferredAllocationAvailable,
	}
	ev["ms"] = msSince(t0)
	emit(ev)
	k.cond.Broadcast()
	return &pluginapi.Empty{}, nil
}

func summarize(devs []*pluginapi.Device) map[string]any {
	per := map[string]map[string]int{}
	healthy, unhealthy := 0, 0
	var ids []string
	for _, d := range devs {
		g := gpuOf(d.ID)
		if per[g] == nil {
			per[g] = map[string]int{"Healthy": 0, "Unhealthy": 0}
		}
		per[g][d.Health]++
		if d.Health == pluginapi.Healthy {
			healthy++
		} else {
			unhealthy++
		}
		ids = append(ids, d.ID)
	}
	maxLen := 0
	for _, id := range ids {
		if len(id) > maxLen {
			maxLen = len(id)
		}
	}
	return map[string]any{"count": len(devs), "healthy": healthy, "unhealthy": unhealthy, "by_gpu": per,
		"ids": ids, "max_id_len": maxLen, "unique": len(uniq(ids)) == len(ids)}
}

func uniq(ids []string) map[string]bool {
	m := map[string]bool{}
	for _, id := range ids {
		m[id] = true
	}
	return m
}

func (k *kubelet) listAndWatch(ep *endpoint) {
	stream, err := ep.client.ListAndWatch(context.Background(), &pluginapi.Empty{})
	if err != nil {
		emit(map[string]any{"event": "list_and_watch_error", "error": err.Error()})
		return
	}
	for {
		rsp, err := stream.Recv()
		if err != nil {
			emit(map[string]any{"event": "stream_end", "error": errStr(err), "t_ms": msSince(k.start)})
			return
		}
		k.mu.Lock()
		current := k.ep == ep
		if current {
			k.devs = rsp.Devices
			k.gen++
			k.lists++
		}
		gen := k.gen
		k.mu.Unlock()
		if current {
			s := summarize(rsp.Devices)
			delete(s, "ids")
			s["event"] = "list_and_watch"
			s["gen"] = gen
			s["t_ms"] = msSince(k.start)
			emit(s)
			k.cond.Broadcast()
		}
	}
}

// waitFor waits until pred (called with k.mu held) is true or the timeout passes.
func (k *kubelet) waitFor(timeout time.Duration, pred func() bool) bool {
	deadline := time.Now().Add(timeout)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				k.cond.Broadcast()
			}
		}
	}()
	k.mu.Lock()
	defer k.mu.Unlock()
	for !pred() {
		if time.Now().After(deadline) {
			return false
		}
		k.cond.Wait()
	}
	return true
}

// cleanupDir removes every socket file in the directory (kubelet's
// CleanupPluginDirectory keeps the checkpoint and non-socket files).
func cleanupDir(dir string) []string {
	var removed []string
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		fi, err := os.Lstat(p)
		if err != nil || fi.Mode()&os.ModeSocket == 0 || e.Name() == "kubelet_internal_checkpoint" {
			continue
		}
		if os.Remove(p) == nil {
			removed = append(removed, e.Name())
		}
	}
	sort.Strings(removed)
	return removed
}

func (k *kubelet) serve() {
	if err := os.MkdirAll(k.dir, 0o750); err != nil {
		fatal("mkdir %s: %v", k.dir, err)
	}
	l, err := net.Listen("unix", k.sockPath())
	if err != nil {
		fatal("listen %s: %v", k.sockPath(), err)
	}
	k.srv = grpc.NewServer()
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go func() { _ = k.srv.Serve(l) }()
}

// ---------- steps ----------

type step struct {
	Op          string   `json:"op"`
	Size        int      `json:"size"`
	IDs         []string `json:"ids"`
	Available   []string `json:"available"`
	MustInclude []string `json:"must_include"`
	GapMS       int      `json:"gap_ms"`
	Name        string   `json:"name"`
	GPU         string   `json:"gpu"`
	Health      string   `json:"health"`
	TimeoutS    float64  `json:"timeout_s"`
	MS          int      `json:"ms"`
	Label       string   `json:"label"`
}

func (k *kubelet) free() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var ids []string
	for _, d := range k.devs {
		if d.Health == pluginapi.Healthy && !k.alloc[d.ID] {
			ids = append(ids, d.ID)
		}
	}
	return ids
}

func (k *kubelet) current() *endpoint {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.ep
}

func (k *kubelet) preferred(s step) ([]string, error) {
	avail := s.Available
	if avail == nil {
		avail = k.free()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rsp, err := k.current().client.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
		ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
			AvailableDeviceIDs:   avail,
			MustIncludeDeviceIDs: s.MustInclude,
			AllocationSize:       int32(s.Size),
		}},
	})
	if err != nil {
		return nil, err
	}
	if len(rsp.ContainerResponses) != 1 {
		return nil, fmt.Errorf("expected 1 container response, got %d", len(rsp.ContainerResponses))
	}
	return rsp.ContainerResponses[0].DeviceIDs, nil
}

func (k *kubelet) run(s step) {
	t0 := time.Now()
	switch s.Op {
	case "list":
		k.mu.Lock()
		sum := summarize(k.devs)
		k.mu.Unlock()
		sum["event"] = "list"
		sum["label"] = s.Label
		emit(sum)
	case "preferred":
		ids, err := k.preferred(s)
		emit(map[string]any{"event": "preferred", "label": s.Label, "size": s.Size, "ids": ids, "by_gpu": byGPU(ids),
			"unique": len(uniq(ids)) == len(ids), "ok": err == nil, "error": errStr(err), "ms": msSince(t0)})
	case "allocate":
		ids := s.IDs
		ev := map[string]any{"event": "allocate", "label": s.Label, "size": s.Size}
		if ids == nil {
			ep := k.current()
			if ep.options.GetPreferredAllocationAvailable {
				p, err := k.preferred(s)
				if err != nil {
					ev["ok"] = false
					ev["error"] = "GetPreferredAllocation: " + err.Error()
					emit(ev)
					return
				}
				ids = p
				ev["used_preferred"] = true
			} else {
				free := k.free()
				if len(free) < s.Size {
					ev["ok"] = false
					ev["error"] = "not enough free devices"
					emit(ev)
					return
				}
				ids = free[:s.Size]
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		rsp, err := k.current().client.Allocate(ctx, &pluginapi.AllocateRequest{
			ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}},
		})
		cancel()
		ev["ids"] = ids
		ev["by_gpu"] = byGPU(ids)
		ev["ms"] = msSince(t0)
		ev["ok"] = err == nil
		ev["error"] = errStr(err)
		if err == nil {
			if len(rsp.ContainerResponses) == 0 {
				ev["ok"] = false
				ev["error"] = "empty container_responses (kubelet fails admission)"
			} else {
				c := rsp.ContainerResponses[0]
				ev["container_responses"] = len(rsp.ContainerResponses)
				ev["envs"] = c.Envs
				ev["mounts"] = c.Mounts
				ev["devices"] = c.Devices
				ev["annotations"] = c.Annotations
				var cdi []string
				for _, d := range c.CdiDevices {
					cdi = append(cdi, d.Name)
				}
				ev["cdi_devices"] = cdi
				k.mu.Lock()
				for _, id := range ids {
					k.alloc[id] = true
				}
				k.mu.Unlock()
			}
		}
		emit(ev)
	case "restart":
		k.mu.Lock()
		regsBefore := k.regs
		old := k.ep
		k.mu.Unlock()
		k.srv.Stop()
		if old != nil && old.conn != nil {
			old.conn.Close() // kubelet process exit closes its client connections
		}
		removed := cleanupDir(k.dir)
		time.Sleep(time.Duration(s.GapMS) * time.Millisecond)
		tRecreate := time.Now()
		k.serve()
		ok := k.waitFor(secs(s.TimeoutS, 10), func() bool { return k.regs > regsBefore })
		regMS := msSince(tRecreate)
		ok2 := ok && k.waitFor(secs(s.TimeoutS, 10), func() bool { return k.gen > 0 })
		ev := map[string]any{"event": "restart", "label": s.Label, "removed": removed, "ok": ok && ok2,
			"reregister_ms": regMS, "first_list_ms": msSince(tRecreate), "gap_ms": s.GapMS}
		if !ok {
			ev["error"] = "plugin did not re-register"
		} else if !ok2 {
			ev["error"] = "no ListAndWatch answer after re-registration"
		}
		emit(ev)
	case "pause":
		emit(map[string]any{"event": "pause", "name": s.Name})
		_, _ = stdin.ReadString('\n')
	case "wait_health":
		want := s.Health
		if want == "" {
			want = pluginapi.Unhealthy
		}
		var sum map[string]any
		ok := k.waitFor(secs(s.TimeoutS, 10), func() bool {
			n, match := 0, 0
			for _, d := range k.devs {
				if gpuOf(d.ID) == s.GPU {
					n++
					if d.Health == want {
						match++
					}
				}
			}
			if n > 0 && n == match {
				sum = summarize(k.devs)
				sum["gen"] = k.gen
				return true
			}
			return false
		})
		ev := map[string]any{"event": "health", "label": s.Label, "gpu": s.GPU, "health": want, "ok": ok, "ms": msSince(t0)}
		if sum != nil {
			delete(sum, "ids")
			ev["list"] = sum
		}
		emit(ev)
	case "wait_all_healthy":
		ok := k.waitFor(secs(s.TimeoutS, 10), func() bool {
			if len(k.devs) == 0 {
				return false
			}
			for _, d := range k.devs {
				if d.Health != pluginapi.Healthy {
					return false
				}
			}
			return true
		})
		emit(map[string]any{"event": "all_healthy", "label": s.Label, "ok": ok, "ms": msSince(t0)})
	case "sleep":
		time.Sleep(time.Duration(s.MS) * time.Millisecond)
	default:
		fatal("unknown step op %q", s.Op)
	}
}

func secs(v float64, def float64) time.Duration {
	if v <= 0 {
		v = def
	}
	return time.Duration(v * float64(time.Second))
}

func main() {
	var (
		dir         = flag.String("dir", "", "device plugin directory (kubelet.sock goes here)")
		scriptPath  = flag.String("script", "", "JSON script ('-' = stdin)")
		regTimeout  = flag.Duration("register-timeout", 30*time.Second, "how long to wait for the first registration")
		listTimeout = flag.Duration("list-timeout", 10*time.Second, "how long to wait for the first ListAndWatch answer")
	)
	flag.Parse()
	if *dir == "" {
		fatal("-dir is required")
	}
	var script struct {
		Steps []step `json:"steps"`
	}
	if *scriptPath != "" {
		var data []byte
		var err error
		if *scriptPath == "-" {
			data, err = readAllStdin()
		} else {
			data, err = os.ReadFile(*scriptPath)
		}
		if err != nil {
			fatal("read script: %v", err)
		}
		if err := json.Unmarshal(data, &script); err != nil {
			fatal("parse script: %v", err)
		}
	}
	k := &kubelet{dir: *dir, alloc: map[string]bool{}, start: time.Now()}
	k.cond = sync.NewCond(&k.mu)
	removed := cleanupDir(*dir)
	k.serve()
	emit(map[string]any{"event": "ready", "kubelet_socket": k.sockPath(), "removed": removed})
	if !k.waitFor(*regTimeout, func() bool { return k.regs > 0 }) {
		fatal("no plugin registered within %s", *regTimeout)
	}
	if !k.waitFor(*listTimeout, func() bool { return k.gen > 0 }) {
		fatal("no ListAndWatch answer within %s", *listTimeout)
	}
	for _, s := range script.Steps {
		k.run(s)
	}
	k.srv.Stop()
	if ep := k.current(); ep != nil && ep.conn != nil {
		ep.conn.Close()
	}
	emit(map[string]any{"event": "done"})
}

func readAllStdin() ([]byte, error) {
	var out []byte
	r := stdin
	buf := make([]byte, 65536)
	for {
		n, err := r.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			if err.Error() == "EOF" {
				return out, nil
			}
			return out, err
		}
	}
}
