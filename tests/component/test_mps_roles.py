"""The two-role layout (issue 12, ADR 0009): ``fracplugin run --role mps`` and
``--role doors`` as two real processes, each in its own session / process
group (as in two DaemonSets), with the fake MPS control binary and a fake
NRI runtime on the doors' real socket.

What must hold: either role can be stopped (SIGTERM), killed (SIGKILL) and
started again while the MPS control daemons and their servers keep running
with the same PIDs, the tenants' namespaces keep their caps, the next
CreateContainer works and the ledger counts nobody twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers import wait_for

from fracplugin._proto import nri_pb2
from fracplugin.mps.layout import namespace_name

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
FAST_PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
P = "nvidia.com/container."
STARTED: list["Role"] = []  # every Role a test started; the root fixture kills and reaps them


class Role:
    """One ``fracplugin run --role ROLE`` in its own session."""

    def __init__(self, root: Path, role: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.root, self.role, self.args = root, role, list(args)
        self.env = {**os.environ, "PATH": FAST_PATH, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.health = ""

    @property
    def endpoints_file(self) -> Path:
        return self.root / f"{self.role}-state" / ("endpoints-mps.json" if self.role == "mps" else "endpoints.json")

    def endpoints(self) -> dict[str, Any] | None:
        """The role's endpoints file now, or None while there is none: a role
        process that stops removes it (``daemon.py``), so it may go between
        any two reads."""
        try:
            return json.loads(self.endpoints_file.read_text())  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def restarted_since(self, child: int) -> bool:
        """True once a role process other than ``child`` has written the endpoints file."""
        ep = self.endpoints()
        return ep is not None and ep["pid"] != child

    def start(self) -> "Role":
        STARTED.append(self)
        try:
            self.endpoints_file.unlink()
        except FileNotFoundError:
            pass
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--role", self.role, "--simulate-node", str(NODE),
               "--state-dir", str(self.root / f"{self.role}-state"), "--mps-root", str(self.root / "mps"),
               "--mps-control-binary", str(FAKE), "--health-address", "127.0.0.1:0",
               "--metrics-address", "127.0.0.1:0", "--log-format", "json", "--shutdown-timeout", "5", *self.args]
        log = open(self.root / f"{self.role}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(self.root),
                                     start_new_session=True)  # its own process group, like its own pod
        log.close()
        wait_for(lambda: self.endpoints_file.exists() or self.proc.poll() is not None, timeout_s=30,
                 what=f"{self.role} role endpoints")
        assert self.proc.poll() is None, self.logs()
        self.health = json.loads(self.endpoints_file.read_text())["health"]
        return self

    def logs(self) -> str:
        p = self.root / f"{self.role}.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://{self.health}{path}", timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def stop(self, sig: int = signal.SIGTERM, group: bool = True) -> int:
        """``sig`` to the whole process group (``group``), or to the main
        process alone (what a container runtime does with a container stop's
        SIGTERM: the container's main process, here the MPS role's keeper)."""
        assert self.proc is not None
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        return self.proc.wait(30)


def control(root: Path, mode_dir: str, *args: str) -> str:
    env = {**os.environ, "PATH": FAST_PATH, "CUDA_MPS_PIPE_DIRECTORY": str(root / "mps" / mode_dir)}
    env.pop("CUDA_MPS_PROTOCOL_VERSION", None)
    p = subprocess.run([str(FAKE), *args], capture_output=True, text=True, env=env, timeout=20)
    assert p.returncode == 0, p.stderr
    return p.stdout


def fake_state(root: Path, mode_dir: str) -> dict[str, Any]:
    return json.loads(control(root, mode_dir, "fake-state"))


def mps_pids(root: Path) -> dict[str, Any]:
    """Control daemon PID and server PIDs of each mode, from the daemons themselves."""
    out = {}
    for d in ("ts", "sm"):
        st = fake_state(root, d)
        rows = control(root, d, "server", "list", "--format=csv,noheader").split()
        out[d] = (st["pid"], sorted(r.split(",")[2] for r in rows))
    return out


def caps(root: Path) -> dict[str, Any]:
    return {d: fake_state(root, d)["namespaces"] for d in ("ts", "sm")}


def leftover_mps(root: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if str(root).encode() in (p / "environ").read_bytes():
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fpr", dir="/tmp"))
    d.chmod(0o755)
    (d / "bin").mkdir()
    shutil.copy(shutil.which("sleep"), d / "bin" / "nvidia-cuda-mps-server")  # what the fake spawns as a server
    STARTED.clear()
    yield d
    # every role process the test started is killed and reaped (a killed child never waited for stays a
    # zombie child of the test run, which the next tests' leftover checks would then find)
    for r in STARTED:
        if r.proc is not None:
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait(30)
    STARTED.clear()
    for pid in leftover_mps(d):  # the MPS daemons outlive both roles by design
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(d, ignore_errors=True)


def mps_role(root: Path) -> Role:
    return Role(root, "mps", env={"FAKE_MPS_SERVER_BIN": str(root / "bin" / "nvidia-cuda-mps-server")})


def doors_role(root: Path) -> Role:
    return Role(root, "doors", "--no-device-plugin", "--nri-socket", str(root / "nri.sock"))


def start(rt: Any, pod: Any, ctr: Any) -> Any:
    """StartContainer as kubelet drives it: UNAVAILABLE (an MPS daemon down
    for a moment) is retried, anything else is the answer. A namespace still
    being made does not refuse the start (ADR 0028): callers wait for it."""
    for _ in range(5):
        err = rt.start_container(pod, ctr)
        if err is None or "UNAVAILABLE" not in str(err):
            return err
    return err


def sm_pod(nri_runtime: Any, name: str) -> Any:
    return nri_runtime.make_pod(name, uid=f"uid-{name}", annotations={
        P + "app.gpu-memory.request": "10Gi", P + "app.gpu-memory.limit": "12Gi",
        P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": "0.3",
        P + "app.gpus.devices": "0"})


def ts_pod(nri_runtime: Any, name: str) -> Any:
    return nri_runtime.make_pod(name, uid=f"uid-{name}", annotations={
        P + "app.gpu-memory.request": "8Gi", P + "app.gpu-memory.limit": "10Gi", P + "app.gpus.devices": "1"})


def test_doors_role_restart_and_kill_keep_mps_and_its_tenants(root: Path) -> None:
    import nri_runtime as nr

    mps = mps_role(root).start()
    wait_for(mps.ready, timeout_s=30, what="MPS role ready")
    rt = nr.FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        doors = doors_role(root).start()
        rt.wait_registered(15)
        wait_for(doors.ready, timeout_s=30, what="doors role ready")
        running = []
        pods = []
        for pod in (sm_pod(nr, "sm1"), ts_pod(nr, "ts1")):
            ctr = nr.make_container(pod, "app")
            adj = rt.create_container(pod, ctr)
            assert not isinstance(adj, nr.RpcError), adj
            assert start(rt, pod, ctr) is None
            env = nr.effective_env(ctr, adj)
            running.append(nr.make_container(pod, "app", container_id=ctr.id, env=env,
                                             state=nri_pb2.CONTAINER_RUNNING))
            pods.append(pod)
            # its own namespace leaf, read-only, in both modes
            mode_dir = "sm" if pod.name == "sm1" else "ts"
            assert [(m.source, list(m.options)) for m in adj.mounts] == [
                (str(root / "mps" / mode_dir / "shared" / namespace_name(pod.uid, "app")),
                 ["rbind", "ro", "nosuid", "nodev"])]
        sm_ns = f"shared/{namespace_name('uid-sm1', 'app')}"
        ts_ns = f"shared/{namespace_name('uid-ts1', 'app')}"
        # the containers may start before their namespaces exist (ADR 0028): wait for both, capped
        wait_for(lambda: all(c.get("pinned_memory_limit") for c in (caps(root)["sm"].get(sm_ns, {}),
                                                                   caps(root)["ts"].get(ts_ns, {}))),
                 timeout_s=30, what="both namespaces made and capped")
        pids = mps_pids(root)
        assert all(p[1] and "-" not in p[1] for p in pids.values()), pids  # servers running
        before = caps(root)
        assert before["sm"][sm_ns]["active_thread_percentage"] == 30
        assert before["sm"][sm_ns]["pinned_memory_limit"] == "12288M"  # the container's limit per GPU
        assert before["ts"][ts_ns]["pinned_memory_limit"] == "10240M"
        held = {g["index"]: g["held_mib"] for g in doors.get("/status")[1]["gpus"]}
        assert held == {0: 10240, 1: 8192, 2: 0, 3: 0}

        rt.initial_sync = (pods, running)  # what containerd reports to a (re)connecting plugin
        # 1. SIGTERM (a rollout), 2. SIGKILL (a crash): MPS keeps running, same PIDs, same caps
        for sig in (signal.SIGTERM, signal.SIGKILL):
            rc = doors.stop(sig)
            assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            assert mps_pids(root) == pids and caps(root) == before
            assert mps.ready()
            doors = doors_role(root).start()
            wait_for(doors.ready, timeout_s=30, what="doors role ready again")
            assert mps_pids(root) == pids and caps(root) == before
            st = doors.get("/status")[1]
            assert {g["index"]: g["held_mib"] for g in st["gpus"]} == held  # nothing double-counted
            assert sum(len(g["tenants"]) for g in st["gpus"]) == 2

        # the next CreateContainer works (a second time-slicing tenant next to the first)
        pod = ts_pod(nr, "ts2")
        ctr = nr.make_container(pod, "app")
        adj = rt.create_container(pod, ctr)
        assert not isinstance(adj, nr.RpcError), adj
        assert start(rt, pod, ctr) is None
        wait_for(lambda: f"shared/{namespace_name('uid-ts2', 'app')}" in caps(root)["ts"], timeout_s=30,
                 what="the new tenant's namespace")
        assert {g["index"]: g["held_mib"] for g in doors.get("/status")[1]["gpus"]}[1] == 2 * 8192
        assert mps_pids(root) == pids
        doors.stop()
    finally:
        rt.close()
    mps.stop()


def test_a_slow_namespace_create_does_not_refuse_the_start(root: Path) -> None:
    """ADR 0028 with the fake MPS binary made slow (its fault file: every
    ``namespace create`` answered after 2 s, far past the doors' 0.1 s start
    wait): StartContainer answers OK, the doors log says the wait was spent,
    and the namespace is made with its caps afterwards (and logged)."""
    import nri_runtime as nr

    mps = mps_role(root).start()
    wait_for(mps.ready, timeout_s=30, what="MPS role ready")
    (root / "mps" / "sm" / "fake-control.json").write_text(json.dumps({"slow": {"namespace create": 2.0}}))
    rt = nr.FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        doors = Role(root, "doors", "--no-device-plugin", "--nri-socket", str(root / "nri.sock"),
                     "--nri-start-wait-s", "0.1").start()
        rt.wait_registered(15)
        wait_for(doors.ready, timeout_s=30, what="doors role ready")
        pod = sm_pod(nr, "slow1")
        ctr = nr.make_container(pod, "app")
        assert not isinstance(rt.create_container(pod, ctr), nr.RpcError)
        assert rt.start_container(pod, ctr) is None  # not refused, not retried
        assert "StartContainer wait spent" in doors.logs()
        ns = f"shared/{namespace_name('uid-slow1', 'app')}"
        wait_for(lambda: caps(root)["sm"].get(ns, {}).get("active_thread_percentage") == 30, timeout_s=30,
                 what="the slow namespace made and capped")
        wait_for(lambda: "namespace ready after its container started" in doors.logs(), timeout_s=30,
                 what="the late namespace logged")
        doors.stop()
    finally:
        rt.close()
    mps.stop()


def test_mps_role_restart_and_kill_adopt_the_running_daemons(root: Path) -> None:
    mps = mps_role(root).start()
    wait_for(mps.ready, timeout_s=30, what="MPS role ready")
    pids = mps_pids(root)
    st = mps.get("/status")[1]["mps"]
    assert st["detached"] is True and {d["pid"] for d in st["daemons"]} == {p[0] for p in pids.values()}
    # a crash of the fracplugin process alone: its keeper (the container's main process) restarts it in place
    child = mps.endpoints()["pid"]
    assert child != mps.proc.pid
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: mps.restarted_since(child), timeout_s=30, what="the MPS role process restarted in place")
    mps.health = mps.endpoints()["health"]
    wait_for(mps.ready, timeout_s=30, what="MPS role ready after the in-place restart")
    assert mps.proc.poll() is None and mps_pids(root) == pids
    assert all(d["adopted"] for d in mps.get("/status")[1]["mps"]["daemons"])
    # SIGTERM / SIGKILL of the role process alone: a restart in place (above). SIGKILL of every process of the
    # role (its keeper too): the daemons outlive it here (their own session, no parent-death signal; in a
    # container the runtime's cgroup kill would end them). SIGTERM of the keeper: the next test.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if sig == signal.SIGTERM:
            child = mps.endpoints()["pid"]
            os.kill(child, sig)
            wait_for(lambda: mps.restarted_since(child), timeout_s=30,
                     what="the MPS role process restarted in place after its SIGTERM")
            mps.health = mps.endpoints()["health"]
            wait_for(mps.ready, timeout_s=30, what="MPS role ready after the SIGTERM of its process")
            assert mps.proc.poll() is None and mps_pids(root) == pids
            continue
        mps.stop(sig)
        assert mps_pids(root) == pids  # the daemons outlive the role (their own session, no parent-death signal)
        mps = mps_role(root).start()
        wait_for(mps.ready, timeout_s=30, what="MPS role ready again")
        assert mps_pids(root) == pids
        daemons = mps.get("/status")[1]["mps"]["daemons"]
        assert all(d["adopted"] and d["restarts"] == 0 for d in daemons)
        assert {d["pid"] for d in daemons} == {p[0] for p in pids.values()}
    # stopping MPS on purpose is explicit (uninstall)
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "mps-quit", "--mps-root", str(root / "mps")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": FAST_PATH})
    assert out.returncode == 0, out.stderr
    wait_for(lambda: not any(Path(f"/proc/{p[0]}").exists() for p in pids.values()), what="daemons quit")
    mps.stop()


def test_a_sigterm_of_the_keeper_stops_mps_on_purpose(root: Path) -> None:
    """Pod deletion (kubectl delete pod, a drain, a GPU Operator driver
    upgrade's affinity flip): the runtime sends SIGTERM to the container's
    main process, the keeper, and kills what is left in the cgroup after it
    exits. The keeper first quits every control daemon through the API
    socket (ADR 0008 decision 13, ADR 0009): the daemons exit through their
    own ``quit`` path (the fake logs it and removes its pid file and socket),
    their servers end, the role's log says so, and the keeper exits 0."""
    mps = mps_role(root).start()
    wait_for(mps.ready, timeout_s=30, what="MPS role ready")
    pids = mps_pids(root)
    servers = [int(s) for _, srv in pids.values() for s in srv]
    assert servers, pids
    assert mps.stop(signal.SIGTERM, group=False) == 0, mps.logs()
    log = mps.logs()
    assert "MPS stopped on purpose: every MPS control daemon quit" in log, log
    for mode_dir in ("ts", "sm"):
        control_log = (root / "mps" / "log" / mode_dir / "control.log").read_text()
        assert control_log.rstrip().endswith("Exiting control daemon (fake)"), (mode_dir, control_log[-500:])
        assert not (root / "mps" / mode_dir / "control").exists()
        assert not (root / "mps" / mode_dir / "nvidia-cuda-mps-control.pid").exists()
    gone = [p for p in [d for d, _ in pids.values()] + servers if Path(f"/proc/{p}").exists()]
    wait_for(lambda: not [p for p in gone if Path(f"/proc/{p}").exists()], timeout_s=10,
             what=f"MPS daemons and servers {gone} gone")


def test_a_new_mps_role_gets_every_running_containers_namespace_before_ready(root: Path) -> None:
    """Issue 35 input 5 (ADR 0034): four running containers with MPS clients; SIGTERM of the MPS
    role's keeper stops MPS on purpose (every namespace gone) and a new MPS role starts fresh daemons
    that know none. The doors re-ensure every running container's namespace, with its caps, at once
    (their MPS health callback, off the request path) and say ready only after."""
    import nri_runtime as nr

    mps = mps_role(root).start()
    wait_for(mps.ready, timeout_s=30, what="MPS role ready")
    rt = nr.FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    clients: list[subprocess.Popen[bytes]] = []
    try:
        doors = doors_role(root).start()
        rt.wait_registered(15)
        wait_for(doors.ready, timeout_s=30, what="doors role ready")
        want = {}
        for pod in (sm_pod(nr, "sm1"), sm_pod(nr, "sm2"), ts_pod(nr, "ts1"), ts_pod(nr, "ts2")):
            ctr = nr.make_container(pod, "app")
            assert not isinstance(rt.create_container(pod, ctr), nr.RpcError)
            assert start(rt, pod, ctr) is None
            mode_dir = "sm" if pod.name.startswith("sm") else "ts"
            ns = namespace_name(pod.uid, "app")
            want[(mode_dir, f"shared/{ns}")] = (30, "12288M") if mode_dir == "sm" else (None, "10240M")

        def capped() -> bool:
            now = caps(root)
            return all((now[m].get(k, {}).get("active_thread_percentage"), now[m].get(k, {}).get(
                "pinned_memory_limit")) == v for (m, k), v in want.items())

        wait_for(capped, timeout_s=30, what="the four namespaces made and capped")
        for (mode_dir, key) in want:  # a CUDA client attached to each namespace
            clients.append(subprocess.Popen(["sleep", "600"]))
            control(root, mode_dir, "fake-client", "add", str(clients[-1].pid), "--server=shared",
                    f"--namespace={key.split('/')[1]}")
        assert mps.stop(signal.SIGTERM, group=False) == 0, mps.logs()  # pod deletion: MPS stopped on purpose
        wait_for(lambda: not doors.ready(), timeout_s=30, what="the doors not ready while MPS is gone")
        mps = mps_role(root).start()  # a new MPS role: fresh daemons, no namespace
        wait_for(doors.ready, timeout_s=60, what=lambda: f"doors ready again: {doors.get('/readyz')}")
        assert capped(), caps(root)  # every running container's namespace back with its caps before ready
        doors.stop()
    finally:
        for c in clients:
            c.kill()
            c.wait()
        rt.close()
    mps.stop()
