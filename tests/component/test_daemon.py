"""``fracplugin run`` as a subprocess: start-up, readiness, status, SIGHUP,
orderly SIGTERM shutdown, with and without each door.

Peers are in-process fakes over real sockets: ``fake_kubelet.FakeKubelet``
(device plugin registration), ``nri_runtime.FakeNriRuntime`` (NRI), and the
fake ``nvidia-cuda-mps-control`` executable (MPS).
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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from fracplugin_demo.subproc import die_with_parent, with_fd_as_3
from tests.fakes.mps_client import fake_control_binary
from tests.helpers import scaled, wait_until

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
# the compiled client in front of the Python fake (when gcc is there): a control command (the
# supervisor's probe) starts in ~1 ms, not in a Python start that takes seconds on a loaded machine
FAKE_MPS = fake_control_binary()
GPU0 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01"


class DaemonProc:
    """One ``fracplugin run`` subprocess with its state dir and logs."""

    def __init__(self, root: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.root = root
        self.state = root / "state"
        self.log_path = root / "daemon.log"
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoints: dict[str, Any] = {}

    def start(self, wait: bool = True, fd3: int | None = None, **popen: Any) -> "DaemonProc":
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
               "--state-dir", str(self.state), "--health-address", "127.0.0.1:0",
               "--metrics-address", "127.0.0.1:0", "--log-format", "json", "--shutdown-timeout", "8",
               "--mps-root", str(self.root / "mps"), *self.args]
        self._log = open(self.log_path, "ab")
        cmd = die_with_parent(cmd)  # a killed pytest leaves no daemon behind
        if fd3 is not None:  # the child gets fd3 as its fd 3, as a runtime-launched plugin does
            cmd = with_fd_as_3(cmd, fd3)
            popen["pass_fds"] = (fd3,)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(self.root), **popen)
        if wait:
            ep = self.state / "endpoints.json"
            wait_until(lambda: ep.exists() or self.proc.poll() is not None, 30,
                       lambda: f"the daemon to write {ep} (or exit); log:\n{self.logs()}")
            assert self.proc.poll() is None, f"daemon did not start:\n{self.logs()}"
            self.endpoints = json.loads(ep.read_text())
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.logs().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def get(self, path: str) -> tuple[int, Any]:
        url = f"http://{self.endpoints['health']}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                code, body = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read().decode()
        try:
            return code, json.loads(body)
        except ValueError:
            return code, body

    def ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def terminate(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if hasattr(self, "_log"):
            self._log.close()


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fpd", dir="/tmp"))  # short: unix socket paths
    d.chmod(0o755)  # the MPS root must be reachable by other users (issue 12)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(root: Path) -> Iterator[Callable[..., DaemonProc]]:
    procs: list[DaemonProc] = []

    def make(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> DaemonProc:
        d = DaemonProc(root, list(args), env)
        procs.append(d)
        return d.start(wait)

    yield make
    for d in procs:
        d.kill()


def mps_processes(root: Path) -> list[int]:
    """PIDs of live processes whose command line mentions ``root`` (the fake
    MPS daemons get their pipe dir under it)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            envb = (p / "environ").read_bytes()
        except OSError:
            continue
        if "nvidia-cuda-mps-control" in cmd and str(root).encode() in envb:
            pids.append(int(p.name))
    return pids


# ---- no doors ------------------------------------------------------------------
def test_no_doors_start_ready_status_and_sigterm(daemon: Callable[..., DaemonProc], root: Path) -> None:
    d = daemon("--no-nri", "--no-device-plugin", "--no-mps")
    assert d.get("/healthz") == (200, "ok\n")
    code, body = d.get("/readyz")
    assert code == 200 and body == {"ready": True, "checks": {}}
    code, st = d.get("/status")
    assert code == 200
    assert st["node"] == "gpu-node-1" and st["ready"] is True
    assert st["doors"] == {"nri": False, "device_plugin": False, "mps": False}
    assert [g["uuid"] for g in st["gpus"]][0] == GPU0 and all(g["tenants"] == [] for g in st["gpus"])
    assert st["mps"]["enabled"] is False
    assert d.get("/nope")[0] == 404
    with urllib.request.urlopen(f"http://{d.endpoints['metrics']}/metrics", timeout=5) as r:
        assert 'fracplugin_ledger_entries{node="gpu-node-1"} 0.0' in r.read().decode()
    # the effective configuration is logged at start, with where each setting came from
    start = next(r for r in d.log_records() if r.get("msg", "").endswith("starting"))
    assert start["config"]["no_nri"] is True and start["sources"]["no_nri"] == "flag"
    assert start["config"]["state_dir"] == str(d.state)
    assert d.terminate() == 0
    assert not (d.state / "endpoints.json").exists()
    stopped = next(r for r in d.log_records() if r.get("msg") == "fracplugin stopped")
    assert stopped["ledger_consistent"] is True


def test_status_cli_table_and_json(daemon: Callable[..., DaemonProc]) -> None:
    d = daemon("--no-nri", "--no-device-plugin", "--no-mps")
    run = [sys.executable, "-m", "fracplugin.cli", "status", "--health-address", d.endpoints["health"]]
    out = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "node gpu-node-1" in out.stdout and "ready: yes" in out.stdout and GPU0 in out.stdout
    out = subprocess.run(run[:-2] + ["--state-dir", str(d.state), "-o", "json"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout)["node"] == "gpu-node-1"
    d.terminate()
    out = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "cannot reach the daemon" in out.stderr


def test_bad_setting_exits_2_naming_it(root: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--mps-protocol", "7"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--mps-protocol" in out.stderr and "'7'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--no-mps", "--no-nri",
                          "--no-device-plugin", "--state-dir", str(root), "--simulate-node", str(root / "none.yaml")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--simulate-node" in out.stderr and "not a readable file" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    # a file that is there but is no node: the inventory refuses it at start (exit 1)
    bad = root / "bad-node.yaml"
    bad.write_text("gpus: nope\n")
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--no-mps", "--no-nri",
                          "--no-device-plugin", "--state-dir", str(root), "--simulate-node", str(bad)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "inventory" in out.stderr and "'gpus' list" in out.stderr


def test_ledger_survives_restart_and_corrupt_file_is_moved_aside(daemon: Callable[..., DaemonProc], root: Path) -> None:
    state = root / "state"
    state.mkdir()
    t = {"pod_uid": "u1", "namespace": "default", "pod_name": "p", "container": "c", "gpu_uuid": GPU0,
         "request_mib": 1000, "limit_mib": 2000, "mode": "time-slicing", "container_id": "abc",
         "mps_namespace": None, "active_thread_percentage": None}
    doc = {"version": 1, "node": "gpu-node-1", "tenancies": [t]}
    (state / "ledger.json").write_text(json.dumps(doc))
    d = daemon("--no-nri", "--no-device-plugin", "--no-mps")
    st = d.get("/status")[1]
    assert st["gpus"][0]["tenants"][0]["pod_uid"] == "u1" and st["gpus"][0]["held_mib"] == 1000
    assert d.terminate() == 0
    assert json.loads((state / "ledger.json").read_text())["tenancies"] == [t]

    (state / "ledger.json").write_text("{not json")
    d2 = daemon("--no-nri", "--no-device-plugin", "--no-mps")
    st = d2.get("/status")[1]
    assert any("corrupt" in w for w in st["ledger"]["warnings"])
    assert all(g["tenants"] == [] for g in st["gpus"])
    assert list(state.glob("ledger.json.corrupt-*"))
    assert d2.terminate() == 0


def test_sighup_reloads_log_level_and_fail_open(daemon: Callable[..., DaemonProc], root: Path) -> None:
    cfg = root / "config.yaml"
    cfg.write_text("log_level: info\nfail_open: false\nreserve_mib: 0\n")
    d = daemon("--no-nri", "--no-device-plugin", "--no-mps", "--config", str(cfg))
    assert d.get("/status")[1]["fail_open"] is False
    cfg.write_text("log_level: debug\nfail_open: true\nreserve_mib: 512\n")
    d.signal(signal.SIGHUP)
    rec = wait_until(lambda: next((r for r in d.log_records() if r.get("msg") == "SIGHUP: configuration reloaded"),
                                  None), what=lambda: f"the reload log record; log:\n{d.logs()}")
    assert set(rec["applied"]) == {"log_level", "fail_open"} and rec["needs_restart"] == ["reserve_mib"]
    st = d.get("/status")[1]
    assert st["fail_open"] is True and st["config"]["log_level"] == "debug" and st["config"]["reserve_mib"] == 0
    cfg.write_text("log_level: loud\n")
    d.signal(signal.SIGHUP)
    assert wait_until(lambda: "configuration not reloaded" in d.logs())
    assert d.get("/status")[1]["fail_open"] is True
    assert d.terminate() == 0


def test_sighup_reaches_both_doors(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """A real SIGHUP with both doors on (no runtime, no kubelet attached): each
    door applies fail_open and reports the settings it cannot reload."""
    cfg = root / "config.yaml"
    (root / "dp").mkdir()
    base = (f"nri_socket: {root / 'nri.sock'}\ndevice_plugin_dir: {root / 'dp'}\n"
            f"pod_resources_socket: {root / 'pr.sock'}\n")
    cfg.write_text(base + "fail_open: false\n")
    d = daemon("--no-mps", "--config", str(cfg))
    before = d.get("/status")[1]
    assert before["nri"]["fail_open"] is False and before["device_plugin"]["fail_open"] is False
    cfg.write_text(base + "fail_open: true\nnri_plugin_idx: '60'\ndevice_unit_mib: 2048\n")
    d.signal(signal.SIGHUP)
    rec = wait_until(lambda: next((r for r in d.log_records() if r.get("msg") == "SIGHUP: configuration reloaded"),
                                  None))
    assert rec, d.logs()
    assert rec["parts"]["nri"] == {"applied": ["fail_open"], "needs_restart": ["device_unit_mib", "nri_plugin_idx"]}
    assert rec["parts"]["device plugin"] == {"applied": ["fail_open"], "needs_restart": ["device_unit_mib"]}
    st = d.get("/status")[1]
    assert st["fail_open"] is True and st["nri"]["fail_open"] is True
    assert st["device_plugin"]["fail_open"] is True  # read from the device plugin server itself
    assert st["config"]["nri_plugin_idx"] == "50" and st["device_plugin"]["unit_mib"] == 1024
    assert d.terminate() == 0


# ---- device plugin door ----------------------------------------------------------
def test_device_plugin_door_registers_and_stops_advertising(daemon: Callable[..., DaemonProc], root: Path) -> None:
    from fake_kubelet import FakeKubelet

    dp_dir = root / "dp"
    dp_dir.mkdir()
    kubelet = FakeKubelet(str(dp_dir)).start()
    try:
        d = daemon("--no-nri", "--no-mps", "--device-plugin-dir", str(dp_dir),
                   "--pod-resources-socket", str(root / "pr.sock"), "--cdi-kind", "nvidia.com/gpu",
                   "--device-unit-mib", "2048")
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        checks = d.get("/readyz")[1]["checks"]
        assert set(checks) == {"device_plugin"} and checks["device_plugin"]["ready"]
        rn = "fracplugin.io/gpu-memory"
        assert wait_until(lambda: len(kubelet.devices(rn)) == 4 * (81559 // 2048))
        # no API access: the fallback answer (devices and request-sized memory env), CDI names as configured
        r = kubelet.allocate(rn, [f"{GPU0}::0", f"{GPU0}::1"]).container_responses[0]
        assert r.envs["NVIDIA_VISIBLE_DEVICES"] == GPU0 and r.envs["NVIDIA_GPU_MEMORY_REQUEST"] == "4096"
        assert [c.name for c in r.cdi_devices] == [f"nvidia.com/gpu={GPU0}"]
        assert d.endpoints["device_plugin_socket"] == str(dp_dir / "fracplugin.sock")
        st = d.get("/status")[1]
        assert st["doors"]["device_plugin"] and st["device_plugin"]["registered"]
        assert d.terminate() == 0
        assert wait_until(lambda: not kubelet.stream_open(rn), 5)
        assert not (dp_dir / "fracplugin.sock").exists()
        names = [r.get("part") for r in d.log_records() if str(r.get("msg", "")).startswith("stopped ")]
        assert names.index("device plugin") < names.index("inventory")
    finally:
        kubelet.stop()


def test_simulated_xid_flips_one_gpu_through_the_health_endpoint(daemon: Callable[..., DaemonProc],
                                                                  root: Path) -> None:
    """POST /simulate/xid on a --simulate-node daemon reaches the inventory:
    every device of that GPU turns Unhealthy at kubelet (issue 4 item 3),
    /status says why; an application XID (13) queued before it changes
    nothing (events are consumed in order)."""
    from fake_kubelet import FakeKubelet

    dp_dir = root / "dp"
    dp_dir.mkdir()
    kubelet = FakeKubelet(str(dp_dir)).start()
    try:
        d = daemon("--no-nri", "--no-mps", "--device-plugin-dir", str(dp_dir),
                   "--pod-resources-socket", str(root / "pr.sock"))
        rn = "fracplugin.io/gpu-memory"
        assert wait_until(lambda: len(kubelet.devices(rn)) == 4 * (81559 // 1024))

        def post(body: Any) -> tuple[int, str]:
            req = urllib.request.Request(f"http://{d.endpoints['health']}/simulate/xid", method="POST",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        def unhealthy() -> set[str]:
            return {i.rpartition("::")[0] for i, h in kubelet.devices(rn).items() if h != "Healthy"}

        gpu1 = GPU0[:-1] + "2"
        # an application XID on another GPU, queued before the critical one: ignored
        assert post({"gpu_uuid": gpu1, "xid": 13}) == (202, json.dumps({"injected": {"gpu_uuid": gpu1, "xid": 13}},
                                                                        indent=1) + "\n")
        code, body = post({"gpu_uuid": "GPU-nope", "xid": 79})
        assert code == 404 and "no GPU GPU-nope on node" in body
        code, body = post({"gpu_uuid": GPU0, "xid": "79"})
        assert code == 400 and "xid must be an integer" in body
        assert post({"gpu_uuid": GPU0, "xid": 79})[0] == 202
        wait_until(lambda: unhealthy() == {GPU0}, what=lambda: f"GPU0 alone unhealthy: {kubelet.devices(rn)}")
        per_gpu = {g["uuid"]: g for g in d.get("/status")[1]["gpus"]}
        assert per_gpu[GPU0]["healthy"] is False and per_gpu[GPU0]["unhealthy_reasons"] == ["xid 79"]
        assert all(g["healthy"] for u, g in per_gpu.items() if u != GPU0)
        assert any(r.get("xid") == 79 and r.get("gpu_uuid") == GPU0 for r in d.log_records())
        assert d.terminate() == 0
    finally:
        kubelet.stop()


def test_device_plugin_door_not_ready_without_kubelet(daemon: Callable[..., DaemonProc], root: Path) -> None:
    dp_dir = root / "dp"
    dp_dir.mkdir()
    d = daemon("--no-nri", "--no-mps", "--device-plugin-dir", str(dp_dir),
               "--pod-resources-socket", str(root / "pr.sock"))
    code, body = d.get("/readyz")
    assert code == 503 and body["checks"]["device_plugin"]["ready"] is False
    assert "not registered" in body["checks"]["device_plugin"]["detail"]
    assert d.get("/healthz")[0] == 200
    assert d.terminate() == 0


# ---- NRI door ------------------------------------------------------------------------
INFERENCE = REPO / "examples" / "pods" / "inference-sm-sharing-4gpu.bound.yaml"


def test_nri_door_serves_and_disconnects_on_sigterm(daemon: Callable[..., DaemonProc], root: Path) -> None:
    from nri_runtime import FakeNriRuntime, effective_env, pod_from_manifest

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"),
                   "--nri-plugin-idx", "42", "--nri-plugin-name", "fp-test")
        info = rt.wait_registered(15)
        assert (info.name, info.idx) == ("fp-test", "42")
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        assert set(d.get("/readyz")[1]["checks"]) == {"nri"}
        pod, ctrs = pod_from_manifest(INFERENCE)
        adj = rt.create_container(pod, ctrs[0])
        env = effective_env(ctrs[0], adj)
        assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        st = d.get("/status")[1]
        assert all(g["mode"] == "sm-sharing" and g["held_mib"] == 40960 for g in st["gpus"])
        assert st["nri"]["connected"] is True and st["nri"]["plugin_idx"] == "42"
        out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(d.state)],
                             capture_output=True, text=True, timeout=30)
        assert "NRI plugin: 42-fp-test on" in out.stdout and "connected: yes" in out.stdout
        assert d.terminate() == 0
        assert rt.wait_disconnected(5) is not None
        # the ledger keeps what runs: consistent, and read back by the next start
        ledger = json.loads((d.state / "ledger.json").read_text())
        assert {t["gpu_uuid"] for t in ledger["tenancies"]} == {f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)}
    finally:
        rt.close()


def test_admissions_journaled_survive_sigkill(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """Issue 14: admissions after the first are appended to the ledger
    journal (the snapshot is not rewritten); a SIGKILL leaves snapshot +
    journal, and the next start replays them: every acknowledged admission
    is there. A clean stop then folds the journal into one snapshot."""
    import yaml

    from nri_runtime import FakeNriRuntime, pod_from_manifest

    from fracplugin.ledgerstore import RAMFS_MAGIC, TMPFS_MAGIC, filesystem_type

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"))
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        manifest = yaml.safe_load(INFERENCE.read_text())
        manifest["metadata"]["annotations"]["nvidia.com/container.app.gpu-memory.request"] = "10Gi"
        manifest["metadata"]["annotations"]["nvidia.com/container.app.gpu-memory.limit"] = "10Gi"
        manifest["metadata"]["annotations"]["nvidia.com/container.app.gpu-compute.portion"] = "0.1"
        uids = []
        for i in range(3):
            manifest["metadata"]["uid"] = f"6f1c2a0e-4b7d-4e59-9a51-0c7f3d2b9e2{i}"
            manifest["metadata"]["name"] = f"inference-{i}"
            pod, ctrs = pod_from_manifest(manifest)
            rt.create_container(pod, ctrs[0])
            uids.append(manifest["metadata"]["uid"])
        journal = (d.state / "ledger.json.journal").read_text().splitlines()
        assert len(journal) == 1 + 3  # header, then one line per admission
        assert json.loads((d.state / "ledger.json").read_text())["tenancies"] == []  # written at Synchronize
        d.proc.kill()
        d.proc.wait(10)
        ftype = filesystem_type(d.state)
        warned = any("not on tmpfs" in str(r.get("msg") or r.get("message") or "") for r in d.log_records())
        assert warned == (ftype is not None and ftype not in (TMPFS_MAGIC, RAMFS_MAGIC)), d.logs()[-2000:]
    finally:
        rt.close()
    (d.state / "endpoints.json").unlink()  # a SIGKILLed daemon leaves it: wait for the new one's
    d2 = daemon("--no-nri", "--no-device-plugin", "--no-mps")
    st = d2.get("/status")[1]
    assert st["ledger"]["warnings"] == []
    assert all(sorted(t["pod_uid"] for t in g["tenants"]) == uids for g in st["gpus"])
    assert d2.terminate() == 0
    doc = json.loads((d2.state / "ledger.json").read_text())
    assert len(doc["tenancies"]) == 12 and (d2.state / "ledger.json.journal").read_text().count("\n") == 1


def test_nri_door_not_ready_without_runtime(daemon: Callable[..., DaemonProc], root: Path) -> None:
    d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "absent.sock"))
    code, body = d.get("/readyz")
    assert code == 503 and "not connected" in body["checks"]["nri"]["detail"]
    assert d.terminate() == 0


# ---- MPS ---------------------------------------------------------------------------------
def test_mps_supervised_ready_and_quits_last(daemon: Callable[..., DaemonProc], root: Path) -> None:
    d = daemon("--no-nri", "--no-device-plugin", "--mps-control-binary", str(FAKE_MPS))
    wait_until(d.ready, 20, what=lambda: f"readiness: {d.get('/readyz')}")
    st = d.get("/status")[1]
    assert st["mps"]["enabled"] and st["mps"]["protocol"] == 3  # driver 615 -> v3
    pids = [x["pid"] for x in st["mps"]["daemons"]]
    assert {x["mode"] for x in st["mps"]["daemons"]} == {"time-slicing", "sm-sharing"} and all(pids)
    assert (root / "mps" / "ts" / "control").exists()
    assert d.terminate() == 0
    assert all(not Path(f"/proc/{p}").exists() or "Z" in Path(f"/proc/{p}/stat").read_text().split(")")[1][:3]
               for p in pids)
    assert not (root / "mps" / "ts" / "control").exists() and not (root / "mps" / "sm" / "control").exists()
    assert mps_processes(root) == []


def test_all_doors_ready_and_stop_in_order(daemon: Callable[..., DaemonProc], root: Path) -> None:
    from fake_kubelet import FakeKubelet
    from nri_runtime import FakeNriRuntime

    (root / "dp").mkdir()
    kubelet = FakeKubelet(str(root / "dp")).start()
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = daemon("--mps-control-binary", str(FAKE_MPS), "--nri-socket", str(root / "nri.sock"),
                   "--device-plugin-dir", str(root / "dp"), "--pod-resources-socket", str(root / "pr.sock"))
        wait_until(d.ready, 20, what=lambda: f"readiness: {d.get('/readyz')}")
        checks = d.get("/readyz")[1]["checks"]
        assert set(checks) == {"nri", "device_plugin", "mps"} and all(c["ready"] for c in checks.values())
        assert d.get("/status")[1]["doors"] == {"nri": True, "device_plugin": True, "mps": True}
        assert d.terminate() == 0
        names = [r.get("part") for r in d.log_records() if str(r.get("msg", "")).startswith("stopped ")]
        assert names.index("device plugin") < names.index("nri") < names.index("mps")
        assert mps_processes(root) == []
        assert not (root / "dp" / "fracplugin.sock").exists()
    finally:
        rt.close()
        kubelet.stop()


def test_shutdown_is_bounded_when_mps_hangs(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """A wedged MPS control daemon (ignores `quit`) is killed within the
    shutdown budget; the daemon still exits 0 and leaves no MPS process."""
    d = daemon("--no-nri", "--no-device-plugin", "--mps-control-binary", str(FAKE_MPS), "--shutdown-timeout", "2",
               "--mps-modes", "time-slicing", env={"FAKE_MPS_FAULTS": json.dumps({"hang": True})})
    assert wait_until(lambda: mps_processes(root), 10)
    code, body = d.get("/readyz")
    assert code == 503 and body["checks"]["mps"]["ready"] is False
    assert d.terminate(timeout_s=30) == 0
    assert wait_until(lambda: mps_processes(root) == [], 5)


def test_bad_kubeconfig_fails_start_naming_it(root: Path) -> None:
    bad = root / "kubeconfig"
    bad.write_text("not: [a kubeconfig\n")
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
                          "--no-nri", "--no-mps", "--state-dir", str(root / "s"), "--kubeconfig", str(bad),
                          "--device-plugin-dir", str(root / "dp"), "--health-address", "127.0.0.1:0",
                          "--metrics-address", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"--kubeconfig {bad}" in out.stderr
    assert not list((root / "dp").glob("*.sock"))


def test_runtime_launched_plugin_exits_when_its_fd_closes(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """NRI_PLUGIN_SOCKET=3 (the runtime launched us over a socketpair): the
    daemon serves on fd 3 and stops cleanly when the runtime closes its end."""
    import socket as socketmod

    from nri_runtime import FakeNriRuntime

    ours, theirs = socketmod.socketpair(socketmod.AF_UNIX, socketmod.SOCK_STREAM)
    rt = FakeNriRuntime(root / "unused.sock", listen=False, initial_sync=([], []))
    try:
        rt.adopt(ours)
        d = DaemonProc(root, ["--no-device-plugin", "--no-mps"],
                       env={"NRI_PLUGIN_SOCKET": "3", "NRI_PLUGIN_NAME": "fracplugin", "NRI_PLUGIN_IDX": "10"})
        try:  # the child gets the socket as fd 3, as a runtime-launched plugin does
            d.start(fd3=theirs.fileno())
        finally:
            theirs.close()
        try:
            assert rt.wait_registered(15).idx == "10"
            wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
            assert d.endpoints["nri_socket"] == "fd 3"
            rt.close()
            assert d.proc.wait(scaled(20)) == 0
            assert any("fd 3 ended" in str(r.get("msg")) for r in d.log_records())
        finally:
            d.kill()
    finally:
        rt.close()


def test_failed_start_stops_what_started(root: Path) -> None:
    """The health port is taken: exit 1 naming the setting, and the MPS
    daemons started before it are stopped (no process left)."""
    import socket as socketmod

    busy = socketmod.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
                              "--no-nri", "--no-device-plugin", "--mps-control-binary", str(FAKE_MPS),
                              "--mps-root", str(root / "mps"), "--state-dir", str(root / "s"),
                              "--metrics-address", "127.0.0.1:0", "--health-address", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
    finally:
        busy.close()
    assert out.returncode == 1 and f"--health-address 127.0.0.1:{port}" in out.stderr
    assert '"part":"mps"' in out.stderr  # the supervisor was started, then stopped
    assert wait_until(lambda: mps_processes(root) == [], 5)
    assert not (root / "s" / "endpoints.json").exists()


# ---- API access through a kubeconfig -------------------------------------------------
def serve_fake_api(handler: type, root: Path) -> tuple[Any, Path]:
    """Serve ``handler`` (a BaseHTTPRequestHandler standing in for the API
    server) on 127.0.0.1:0 in a thread; write a kubeconfig pointing at it.
    Returns (server, kubeconfig path); the caller shuts the server down."""
    import threading
    from http.server import ThreadingHTTPServer

    api = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    api.daemon_threads = True
    threading.Thread(target=api.serve_forever, daemon=True).start()
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{api.server_address[1]}"}}],
        "users": [{"name": "t", "user": {"token": "x"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    return api, kubeconfig


def test_kubeconfig_starts_the_pod_watch(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """--kubeconfig: the device plugin door's pod source lists and watches pods
    bound to this node through the API server named in the kubeconfig (a
    minimal fake API server here)."""
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import parse_qs, urlparse

    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "w", "namespace": "default", "uid": "u-1", "resourceVersion": "5"},
           "spec": {"nodeName": "gpu-node-1", "containers": [
               {"name": "c", "image": "x", "resources": {"limits": {"fracplugin.io/gpu-memory": "2"}}}]},
           "status": {"phase": "Pending"}}
    seen: list[dict[str, list[str]]] = []

    class Api(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            u = urlparse(self.path)
            q = parse_qs(u.query)
            seen.append(q)
            if u.path != "/api/v1/pods":
                self.send_response(404)
                self.end_headers()
                return
            if q.get("watch") in (["true"], ["True"], ["1"]):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                time.sleep(0.3)  # an empty watch window; the client re-lists
                return
            body = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
                               "items": [pod]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    api, kubeconfig = serve_fake_api(Api, root)
    try:
        (root / "dp").mkdir()
        d = daemon("--no-nri", "--no-mps", "--kubeconfig", str(kubeconfig), "--device-plugin-dir", str(root / "dp"),
                   "--pod-resources-socket", str(root / "pr.sock"))
        wait_until(lambda: (d.get("/status")[1].get("pod_source") or {}).get("pods") == 1, 15,
                   lambda: f"one pod in the pod source: {d.get('/status')[1].get('pod_source')}")
        st = d.get("/status")[1]["pod_source"]
        assert st["kind"] == "KubernetesPodSource" and st["ready"] is True
        assert any(q.get("fieldSelector") == ["spec.nodeName=gpu-node-1"] for q in seen)
        assert d.terminate() == 0
    finally:
        api.shutdown()
        api.server_close()


def test_nri_refusal_becomes_a_kubernetes_event(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """With --kubeconfig, a refused CreateContainer (limit below request) is
    written as a Warning FractionRefused Event on the pod, through the API
    server the kubeconfig names (a minimal fake here); the recorder stops
    after NRI at shutdown."""
    import copy

    from nri_runtime import FakeNriRuntime, pod_from_manifest
    from tests.peers.posts_api import Api

    api = Api(root)
    posted = api.posted
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"),
                   "--kubeconfig", str(api.kubeconfig))
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        pod, ctrs = pod_from_manifest(INFERENCE)
        pod = copy.deepcopy(pod)
        pod.annotations["nvidia.com/container.app.gpu-memory.limit"] = "30Gi"  # request is 40Gi
        err = rt.create_container(pod, ctrs[0])
        assert getattr(err, "code", None) is not None and "gpu-memory.limit" in err.message, err
        wait_until(lambda: posted, 10, "an Event posted")
        path, ev = posted[0]
        assert path == f"/api/v1/namespaces/{pod.namespace}/events"
        assert ev["type"] == "Warning" and ev["reason"] == "FractionRefused" and ev["action"] == "CreateContainer"
        assert "nvidia.com/container.app.gpu-memory.limit" in ev["message"]
        assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                                        "name": pod.name, "uid": pod.uid, "fieldPath": "spec.containers{app}"}
        assert ev["source"] == {"component": "fracplugin", "host": "gpu-node-1"}
        assert wait_until(lambda: (d.get("/status")[1].get("events") or {}).get("sent") == 1, 5)
        assert d.get("/status")[1]["events"]["enabled"] is True
        assert d.terminate() == 0
        names = [r.get("part") for r in d.log_records() if str(r.get("msg", "")).startswith("stopped ")]
        assert names.index("nri") < names.index("events"), names
    finally:
        rt.close()
        api.close()


def test_no_api_access_no_events(daemon: Callable[..., DaemonProc], root: Path) -> None:
    d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "absent.sock"))
    assert d.get("/status")[1]["events"] == {"enabled": False, "queued": 0, "sent": 0, "failed": 0,
                                             "dropped": 0, "suppressed": 0}
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(d.state)],
                         capture_output=True, text=True, timeout=30)
    assert "Kubernetes Events for refusals: off" in out.stdout, out.stdout
    assert d.terminate() == 0


def test_events_are_built_on_a_device_plugin_only_node(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """The event recorder is a node service (builders._build_events): with
    API access and only the device plugin door on, /status says Events are
    enabled (over-limit Events need it there too; issue 35, ADR 0035)."""
    from fake_kubelet import FakeKubelet

    from tests.peers.posts_api import Api

    api = Api(root)
    dp_dir = root / "dp"
    dp_dir.mkdir()
    kubelet = FakeKubelet(str(dp_dir)).start()
    try:
        d = daemon("--no-nri", "--no-mps", "--device-plugin-dir", str(dp_dir), "--pod-resources-socket",
                   str(root / "pr.sock"), "--kubeconfig", str(api.kubeconfig), "--node-condition-types", "")
        assert d.get("/status")[1]["events"]["enabled"] is True
        assert d.terminate() == 0
    finally:
        kubelet.stop()
        api.close()
