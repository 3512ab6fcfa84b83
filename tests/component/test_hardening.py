"""Issue 13: the daemon attacked as a hostile pod and a careless operator would,
through its real sockets (``fracplugin run`` as a subprocess).

- 2,000 idle connections on the metrics port, the daemon under a 1024
  open-file limit (``prlimit --nofile=1024:1024``, so it cannot raise it):
  CreateContainer (NRI), ``/healthz``, ``/metrics`` and MPS keep working,
  and no MPS restart budget is spent;
- ``/status`` (every tenant's namespace, pod, UID, container ID) is not
  served on a pod-network address, only to loopback clients;
- the soft open-file limit is raised to the hard one at start.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from fracplugin_demo.subproc import die_with_parent
from test_daemon import FAKE_MPS, INFERENCE, NODE, DaemonProc, root  # noqa: F401 (root: fixture)
from tests.helpers import wait_until

IDLE_CONNECTIONS = 2000
FD_LIMIT = 1024


class LimitedDaemon(DaemonProc):
    """``DaemonProc`` started under ``prlimit --nofile=SOFT:HARD``."""

    def __init__(self, root: Path, args: list[str], nofile: tuple[int, int]) -> None:
        super().__init__(root, args)
        self.nofile = nofile

    def start(self, wait: bool = True, fd3: int | None = None, **popen: Any) -> "LimitedDaemon":
        cmd = ["prlimit", f"--nofile={self.nofile[0]}:{self.nofile[1]}", "--",
               sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
               "--state-dir", str(self.state), "--health-address", "127.0.0.1:0",
               "--log-format", "json", "--shutdown-timeout", "8",
               "--mps-root", str(self.root / "mps"), *self.args]
        if "--metrics-address" not in self.args:
            cmd += ["--metrics-address", "127.0.0.1:0"]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(die_with_parent(cmd), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=str(self.root))
        ep = self.state / "endpoints.json"
        wait_until(lambda: ep.exists() or self.proc.poll() is not None, 60,
                   lambda: f"the daemon to write {ep} (or exit); log:\n{self.logs()}")
        assert self.proc.poll() is None, f"daemon did not start:\n{self.logs()}"
        self.endpoints = json.loads(ep.read_text())
        return self

    def nofile_soft(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
        raise AssertionError("no 'Max open files' line")

    def open_fds(self) -> int:
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


@pytest.fixture
def limited(root: Path) -> Iterator[Callable[..., LimitedDaemon]]:
    procs: list[LimitedDaemon] = []

    def make(*args: str, nofile: tuple[int, int] = (FD_LIMIT, FD_LIMIT)) -> LimitedDaemon:
        d = LimitedDaemon(root, list(args), nofile)
        procs.append(d)
        return d.start()

    yield make
    for d in procs:
        d.kill()


@pytest.fixture
def many_fds() -> Iterator[None]:
    """This test process may hold a few thousand sockets (the attacker's side)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 3 * IDLE_CONNECTIONS) if hard != resource.RLIM_INFINITY else 3 * IDLE_CONNECTIONS
    if want < IDLE_CONNECTIONS + 200:
        pytest.fail(f"the test needs an open-file hard limit >= {IDLE_CONNECTIONS + 200}, have {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_idle(host: str, port: int, n: int) -> list[socket.socket]:
    """Open ``n`` TCP connections that never send a byte (each connect waits
    at most 5 s: with the daemon's listen backlog full the kernel retries)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_idle_metrics_connections_leave_create_health_and_mps_working(
        limited: Callable[..., LimitedDaemon], root: Path, many_fds: None) -> None:
    from nri_runtime import FakeNriRuntime, effective_env, pod_from_manifest

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    socks: list[socket.socket] = []
    try:
        d = limited("--no-device-plugin", "--mps-control-binary", str(FAKE_MPS),
                    "--nri-socket", str(root / "nri.sock"))
        assert d.nofile_soft() == FD_LIMIT  # hard 1024: nothing to raise
        wait_until(d.ready, 30, what=lambda: f"readiness: {d.get('/readyz')}")
        host, port = d.endpoints["metrics"].rsplit(":", 1)
        socks = open_idle(host, int(port), IDLE_CONNECTIONS)
        assert len(socks) >= IDLE_CONNECTIONS * 0.9, len(socks)
        # the daemon holds a bounded number of descriptors, far below its limit
        assert d.open_fds() < 300, d.open_fds()
        # CreateContainer through NRI: planned, persisted to the ledger (a file write)
        pod, ctrs = pod_from_manifest(INFERENCE)
        adj = rt.create_container(pod, ctrs[0])
        env = effective_env(ctrs[0], adj)
        assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960", adj
        assert d.get("/healthz") == (200, "ok\n")
        code, body = http_get(f"http://{host}:{port}/metrics")
        assert code == 200 and 'fracplugin_ledger_entries{node="gpu-node-1"} 4.0' in body
        st = d.get("/status")[1]
        assert [m["healthy"] for m in st["mps"]["daemons"]] == [True, True], st["mps"]
        assert all(m["restart_budget_used"] == 0 and m["resource_errors"] == 0 for m in st["mps"]["daemons"])
        assert d.ready()
        records = d.log_records()
        assert not [r for r in records if r.get("level") in ("error", "critical")], records[-5:]
        assert d.terminate() == 0
    finally:
        for s in socks:
            s.close()
        rt.close()


def _pod_address() -> str | None:
    """A non-loopback IPv4 address of this machine (what other pods reach)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_status_is_not_served_on_the_pod_address(limited: Callable[..., LimitedDaemon], root: Path) -> None:
    addr = _pod_address()
    if addr is None:
        pytest.fail("this machine has no non-loopback IPv4 address to stand for the pod network")
    d = limited("--no-nri", "--no-device-plugin", "--no-mps", "--health-address", "0.0.0.0:0",
                "--metrics-address", "0.0.0.0:0")
    port = int(d.endpoints["health"].rsplit(":", 1)[1])
    mport = int(d.endpoints["metrics"].rsplit(":", 1)[1])
    # the pod network: probes and metrics, nothing that names a tenant
    assert http_get(f"http://{addr}:{port}/healthz") == (200, "ok\n")
    assert http_get(f"http://{addr}:{port}/readyz")[0] == 200
    assert http_get(f"http://{addr}:{mport}/metrics")[0] == 200
    code, body = http_get(f"http://{addr}:{port}/status")
    assert code == 404 and "loopback" in body and "namespace" not in body
    # inside the pod (loopback): the status document and `fracplugin status`
    code, body = http_get(f"http://127.0.0.1:{port}/status")
    assert code == 200 and json.loads(body)["doors"]["nri"] is False
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(d.state)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "ready: yes" in out.stdout, out.stderr
    assert d.terminate() == 0


def test_open_file_limit_is_raised_soft_to_hard(limited: Callable[..., LimitedDaemon]) -> None:
    d = limited("--no-nri", "--no-device-plugin", "--no-mps", nofile=(256, 4096))
    assert d.nofile_soft() == 4096
    assert any("open-file limit raised from 256 to 4096" in str(r.get("msg")) for r in d.log_records())
    assert d.terminate() == 0


_MPS_EMFILE_SCRIPT = r'''
import errno, json, os, resource, signal, sys, time
from fracplugin.model import ComputeMode
from fracplugin.mps.layout import MpsLayout
from fracplugin.mps.supervisor import MpsSupervisor

root, fake, path = sys.argv[1:4]
TS = ComputeMode.TIME_SLICING
sup = MpsSupervisor(MpsLayout(root + "/mps"), fake, None, "615.71.09", {TS}, probe_interval_s=0.2,
                    probe_timeout_s=5.0, backoff_base_s=0.05, max_restarts=1, env={"PATH": path})


def daemon():
    return sup.status()["daemons"][0]


def wait(pred, what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}: {daemon()}")
        time.sleep(0.05)


sup.start()
wait(lambda: sup.healthy(TS), "the daemon to be healthy")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
held = []


def exhaust():
    """Take every free descriptor; again on each wait turn: a probe in flight when the limit was reached
    frees its pipes when it ends, and the next probe would run on them (seen under load)."""
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE, exc
    return True


exhaust()
# 1. probes cannot run: neither a probe failure nor a restart
wait(lambda: exhaust() and daemon()["resource_errors"] >= 3, "probes hitting EMFILE")
# a drain that cannot run its commands is incomplete, never a wedge (no hard restart)
dr = sup.drain("c" * 64, 2.0)
drain = {"wedged": dr.wedged, "restarted": [m.value for m in dr.restarted], "errors": list(dr.errors)}
probing = daemon()
# 2. the daemon dies while descriptors are exhausted: its starts fail with EMFILE
os.kill(probing["pid"], signal.SIGKILL)
n = probing["resource_errors"]
wait(lambda: exhaust() and daemon()["resource_errors"] >= n + 3, "starts hitting EMFILE")
starving = daemon()
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
wait(lambda: sup.healthy(TS), "the daemon to recover")
recovered = daemon()
sup.stop(10)
print(json.dumps({"probing": probing, "starving": starving, "recovered": recovered, "drain": drain}))
'''


def test_emfile_never_burns_the_mps_restart_budget(root: Path) -> None:
    """The supervisor's own process out of descriptors: probes and starts that
    cannot run are retried without spending the budget (max_restarts=1 here:
    before the fix the second failed start left the daemon failed for good)."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    out = subprocess.run(die_with_parent([sys.executable, "-c", _MPS_EMFILE_SCRIPT, str(root), str(FAKE_MPS), path]),
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    probing, starving, recovered = doc["probing"], doc["starving"], doc["recovered"]
    assert doc["drain"]["wedged"] is False and doc["drain"]["restarted"] == [], doc["drain"]
    assert any("Too many open files" in e for e in doc["drain"]["errors"]), doc["drain"]
    assert probing["restarts"] == 0 and probing["restart_budget_used"] == 0 and probing["healthy"]
    assert probing["wedges"] == 0
    assert "probe not run" in probing["last_error"]
    assert starving["state"] == "backoff" and starving["restart_budget_used"] == 1  # the crash, not the EMFILEs
    assert "Too many open files" in starving["last_error"]
    assert recovered["healthy"] and recovered["state"] == "ready" and recovered["restarts"] == 1


def test_crash_leftovers_removed_at_start_newest_corrupt_copy_kept(
        limited: Callable[..., LimitedDaemon], root: Path) -> None:
    state = root / "state"
    state.mkdir()
    temps = [state / f".ledger.json.tmp{i:02d}" for i in range(12)] + [state / ".endpoints.abc123"]
    for t in temps:
        t.write_text('{"version": 1, "tenan')  # a write killed before its rename
    corrupt = [state / f"ledger.json.corrupt-{s}" for s in (1700000100, 1700000300, 1700000200)]
    for c in corrupt:
        c.write_text("garbage")
    (state / "unrelated.txt").write_text("not ours")
    d = limited("--no-nri", "--no-device-plugin", "--no-mps")
    left = sorted(p.name for p in state.iterdir())
    assert left == ["endpoints.json", "ledger.json.corrupt-1700000300", "unrelated.txt"], left
    msgs = [str(r.get("msg")) for r in d.log_records()]
    assert any(m.endswith("kept the newest corrupt ledger copy " + str(corrupt[1])) for m in msgs), msgs
    assert sum(m.startswith("removed crash leftover") for m in msgs) == len(temps) + 2
    assert d.terminate() == 0


def test_control_characters_never_forge_log_lines_or_refusal_lines(
        limited: Callable[..., LimitedDaemon], root: Path) -> None:
    from nri_runtime import FakeNriRuntime, make_container, make_pod

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = limited("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"),
                    "--log-format", "text")
        rt.wait_registered(20)
        forged = "20Gi\n2026-01-01T00:00:00.000Z INFO    fracplugin: FORGED admitted\x1b[2J"
        pod = make_pod("evil", "ns", annotations={"nvidia.com/container.app.gpu-memory.request": forged})
        err = rt.create_container(pod, make_container(pod, "app", container_id="c" * 64))
        assert err.code == 3  # INVALID_ARGUMENT: what kubectl describe shows
        assert "\n" not in err.message and "\x1b" not in err.message
        assert '"20Gi\\n2026-01-01T00:00:00.000Z INFO    fracplugin: FORGED admitted\\x1b[2J"' in err.message
        assert d.terminate() == 0
        lines = d.logs().splitlines()
        assert not [ln for ln in lines if ln.startswith("2026-01-01T00:00:00.000Z")], lines
        refused = [ln for ln in lines if "nri container refused pod=ns/evil" in ln]
        assert len(refused) == 1 and "FORGED admitted\\u001b[2J" in refused[0], refused  # JSON-quoted value
        assert not any("\x1b" in ln for ln in lines)
    finally:
        rt.close()


def test_readyz_is_per_runtime_session(limited: Callable[..., LimitedDaemon], root: Path) -> None:
    from nri_runtime import FakeNriRuntime

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = limited("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"))
        rt.wait_registered(20)
        assert wait_until(d.ready, 20)
        rt.initial_sync = None  # the runtime comes back and never synchronizes
        rt.disconnect()
        # the plugin's second session is complete on both ends: the runtime's
        # own registration (RegisterPlugin answered, Configure returned) and the
        # daemon's view; only then may the runtime synchronize it
        assert wait_until(lambda: len(rt.registrations) >= 2 and rt.plugin is not None
                          and d.get("/status")[1]["nri"]["connected"], 20)
        code, body = d.get("/readyz")
        nri = body["checks"]["nri"]  # the detail goes on to say the pod watch cannot run (no API access here)
        assert code == 503 and nri["ready"] is False and nri["detail"].startswith("connected, not synchronized yet;")
        rt.synchronize([], [])
        assert wait_until(d.ready, 20)
        assert d.terminate() == 0
    finally:
        rt.close()


def test_runtime_bounds_through_the_daemon(limited: Callable[..., LimitedDaemon], root: Path) -> None:
    """Through the daemon's NRI door: a Synchronize split beyond the part bound
    is refused and counted in /metrics; an empty container id is refused and
    never reaches the ledger."""
    from fracplugin._proto import nri_pb2
    from fracplugin.nri.dispatch import MAX_SYNC_PARTS, PLUGIN_SERVICE
    from nri_runtime import FakeNriRuntime, make_pod, pod_from_manifest

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = limited("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"))
        rt.wait_registered(20)
        part = nri_pb2.SynchronizeRequest(pods=[make_pod("p")], more=True).SerializeToString()
        codes = [rt.call_raw(PLUGIN_SERVICE, "Synchronize", part).code for _ in range(MAX_SYNC_PARTS + 1)]
        assert codes == [0] * MAX_SYNC_PARTS + [8]  # RESOURCE_EXHAUSTED
        code, body = http_get(f"http://{d.endpoints['metrics']}/metrics")
        assert code == 200 and 'fracplugin_nri_bounds_exceeded_total{bound="sync_parts",node="gpu-node-1"} 1.0' in body
        assert d.get("/status")[1]["nri"]["bounds_exceeded"]["sync_parts"] == 1
        pod, ctrs = pod_from_manifest(INFERENCE)
        ctrs[0].id = ""
        err = rt.create_container(pod, ctrs[0])
        assert err.code == 3 and "empty container id" in err.message
        assert all(g["tenants"] == [] for g in d.get("/status")[1]["gpus"])  # nothing admitted
        assert d.terminate() == 0
    finally:
        rt.close()
