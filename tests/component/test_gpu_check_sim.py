"""``make gpu-check``'s daemon-facing parts against the real daemon on the
simulated node with the fake ``nvidia-cuda-mps-control``: the check starts
the daemon as it does on a GPU machine (tests/gpu/gpu_check.py ``Daemon``),
plans both containers through the real NRI door (``Nri``: RunPodSandbox,
CreateContainer, StartContainer), builds each client's env from the plan
(``client_env``), asks the control daemon for its clients
(``mps_client_pids``), kills and awaits the MPS restart (``restart_check``)
and stops the daemon with nothing left behind (``shutdown``); then the whole
check rehearsed end to end with a stand-in libcuda (tests/gpu/fake_libcuda.c).

The parts run on a driver r580 node (classic MPS v2: sm-sharing containers
share the daemon's pipe directory), what the lent H200 runs; the rehearsal
also on r615 (MPS v3: a namespace leaf per sm-sharing container)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fakes.mps_client import fake_control_binary
from tests.gpu import gpu_check as gc
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = str(fake_control_binary())  # compiled client: probes answer in ms on a loaded machine too


def _node(tmp_path: Path, driver: str) -> tuple[str, dict]:
    doc = yaml.safe_load(NODE.read_text())
    doc["driver_version"] = driver
    p = tmp_path / f"node-{driver}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p), doc


@pytest.fixture(params=["580.159.03"])  # the r615 (MPS v3) shape is rehearsed below
def running(request, tmp_path):
    from fracplugin.gpu.simulated import SimulatedInventory
    from fracplugin.mps.control import choose_protocol

    node_file, doc = _node(tmp_path, request.param)
    work = Path(os.path.realpath("/tmp")) / f"fpgct{os.getpid()}{request.param[:3]}"
    work.mkdir()
    check = gc.GpuCheck(tmp_path / "gpu-check.json", sys.executable, [str(REPO / "src")], FAKE_MPS)
    check.work.rmdir()
    check.work = work
    check.node = SimulatedInventory(node_file).node()
    check.gpu = check.node.gpus[0]
    check.protocol = choose_protocol(request.param)
    check.nri = gc.Nri(work / "nri.sock")
    check.daemon = gc.Daemon(work, sys.executable, [str(REPO / "src")], FAKE_MPS, simulate_node=node_file)
    check.mps_before = gc.mps_pids()
    check.daemon.start(60)
    wait_until(lambda: check.daemon.get("/readyz")[0] == 200, 60, lambda: f"readiness; log:\n{check.daemon.log_tail()}")
    check.nri.server.wait_registered(10)
    yield check
    for c in check.clients:
        c.kill()
    check.daemon.stop(20)
    check.nri.close()
    shutil.rmtree(work, ignore_errors=True)


def test_plans_through_the_nri_door_become_client_envs(running):
    check = running
    gpu = check.gpu.uuid
    ds = check.daemon.mps_daemons()
    assert {"time-slicing", "sm-sharing"} <= set(ds)

    ts = check._plan(3, gc.pod_manifest("gpucheck-ts", "time-slicing", gc.TS_LIMIT_MIB, gpu), gc.TS_LIMIT_MIB, None)
    assert ts is not None, [f.__dict__ for f in check.report.figures]
    assert ts.env["NVIDIA_VISIBLE_DEVICES"] == gpu
    assert ts.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu}=2048M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in ts.env
    env, _ = gc.client_env(ts.env, ts.mounts, {"PATH": "/usr/bin", "CUDA_MPS_PIPE_DIRECTORY": "/stale"},
                           len(check.node.gpus))
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.isdir(pipe) and pipe.startswith(str(check.work / "mps"))
    assert os.path.exists(os.path.join(pipe, "control"))  # the client reaches a control socket there
    assert env["CUDA_VISIBLE_DEVICES"] == gpu  # four GPUs on the node, one planned
    assert [f.status for f in check.report.figures] == ["pass"]

    # the control daemon's client list, as the check reads it to prove a client went through MPS
    from fracplugin.mps.control import MpsControl

    ctl = MpsControl(FAKE_MPS, ds["time-slicing"]["pipe_dir"], check.protocol)
    ctl.run(["fake-client", "add", str(os.getpid())], 10)
    assert os.getpid() in (gc.mps_client_pids(FAKE_MPS, ds["time-slicing"]["pipe_dir"], check.protocol) or [])
    ctl.run(["fake-client", "remove", str(os.getpid())], 10)
    assert gc.mps_client_pids(FAKE_MPS, str(check.work / "nowhere"), check.protocol) is None

    check.nri.remove(ts)
    check.restart_check()
    restart = [f for f in check.report.figures if f.name == "MPS daemon restarted after SIGKILL"]
    assert [f.status for f in restart] == ["pass"], restart

    atp = 25
    sm = check._plan(3, gc.pod_manifest("gpucheck-sm", "sm-sharing", gc.SM_LIMIT_MIB, gpu, gc.SM_PORTION),
                     gc.SM_LIMIT_MIB, atp)
    assert sm is not None, [f.__dict__ for f in check.report.figures]
    assert sm.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert sm.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu}=4096M"
    env, _ = gc.client_env(sm.env, sm.mounts, {}, len(check.node.gpus))
    sm_pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.isdir(sm_pipe)
    namespaces = [n["name"] for n in check.daemon.mps_daemons()["sm-sharing"]["namespaces"]]
    assert check.protocol == 2 and namespaces == []
    assert sm_pipe == ds["sm-sharing"]["pipe_dir"]  # classic MPS: the daemon's own pipe directory
    check.nri.remove(sm)

    # the refusal path: a second mode on the GPU is refused and reported as a failure, not a crash
    check.nri.create(gc.pod_manifest("gpucheck-ts2", "time-slicing", 1024, gpu))
    assert check._plan(3, gc.pod_manifest("gpucheck-sm2", "sm-sharing", 1024, gpu, "0.5"), 1024, 50) is None
    assert check.report.figures[-1].status == "fail" and "RpcError" in str(check.report.figures[-1].observed)


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build tests/gpu/fake_libcuda.c (the rehearsal only; the parts run above)")
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(gc.HERE / "fake_libcuda.c")], check=True,
                   timeout=120)
    return str(out)


@pytest.mark.parametrize("driver", ["615.71.09", "580.159.03"])
def test_rehearsal_runs_every_step_and_writes_the_report(tmp_path, fake_libcuda, driver):
    """The whole check (steps 1-7) on the simulated node, the fake MPS binary
    and a stand-in libcuda: every step runs and reports, in order; what only a
    GPU can show fails or is skipped for the right reason, never passes."""
    node_file, _ = _node(tmp_path, driver)
    cg_root = tmp_path / "cgroup"
    cg_root.mkdir()
    (cg_root / "cgroup.controllers").write_text("")
    out = tmp_path / "gpu-check.json"
    check = gc.GpuCheck(out, sys.executable, [str(REPO / "src")], FAKE_MPS, simulate_node=node_file,
                        cuda_lib=fake_libcuda, cgroup_root=str(cg_root), artifacts=str(tmp_path / "art"),
                        metric_wait_s=1.0)
    rc = check.run()
    doc = json.loads(out.read_text())
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    figs = {(s["step"], f["name"]): f for s in doc["steps"] for f in s["figures"]}
    status = {k: f["status"] for k, f in figs.items()}
    must_pass = [
        (1, "GPUs"), (1, "MPS protocol chosen"), (2, "/readyz"), (2, "MPS protocol in use"),
        (2, "MPS time-slicing daemon probed healthy"), (2, "MPS sm-sharing daemon probed healthy"),
        (2, "MPS daemon restarted after SIGKILL"),
        (3, "gpucheck-ts: planned through NRI"), (3, "gpucheck-sm: planned through NRI"),
        (3, "time-slicing: pinned device memory limit"), (3, "sm-sharing: pinned device memory limit"),
        (3, "time-slicing: devices seen"), (3, "time-slicing: the GPU seen is the planned one"),
        (3, "time-slicing: active thread percentage"), (3, "sm-sharing: active thread percentage"),
        (4, "each process capped"), (4, "what the container got in all"),
        (6, "sm-sharing client SIGKILLed"), (6, "next client of that container"),
        (6, "sm-sharing MPS daemon after the kill"), (6, "daemon stopped by SIGTERM"), (6, "no MPS process left"),
        (6, "no MPS socket left"), (7, "wall time"),
    ]
    assert {k: status.get(k) for k in must_pass} == {k: "pass" for k in must_pass}, doc
    # only a GPU shows these: the fake MPS has no real clients, the simulated node no NVML processes
    for label in ("time-slicing", "sm-sharing"):
        f = figs[(3, f"{label}: went through MPS")]
        assert f["status"] == "fail" and f["observed"]["mps_enabled"] == 1  # the pipe dir was reached ...
        assert "is not among the control daemon's clients []" in f["reason"]  # ... but no real MPS client
    assert status[(5, "time-slicing: used bytes")] == "fail"
    assert status[(6, "compute mode unchanged")] == "skipped"  # NVML only on a GPU machine
    # CUDA memory limits (issue 23 item 7): only a real GPU shows them, never a pass here
    f = figs[(8, "CUDA memory limits")]
    assert f["status"] == "skipped" and "real GPU" in f["reason"]
    assert [s["status"] for s in doc["steps"] if s["step"] == 8] == ["skipped"]
    f = figs[(9, "the field's cases")]  # issue 35 item 6: only a real GPU shows them
    assert f["status"] == "skipped" and "real GPU" in f["reason"]
    if driver.startswith("580"):
        f = figs[(3, "sm-sharing: own MPS namespace")]
        assert f["status"] == "skipped" and "MPS v3 (driver r615+)" in f["reason"]
    else:
        assert status[(3, "sm-sharing: own MPS namespace")] == "pass"
    assert figs[(4, "what the container got in all")]["observed"]["total_mib"] == 2 * 1536  # per process
    assert doc["result"] == "fail" and rc == 1
    assert (tmp_path / "art" / "daemon.log").stat().st_size > 0
    # every client joined its container's cgroup leaf (a real cgroupfs takes the PID; here a file keeps it)
    leaves = sorted(cg_root.glob("fracplugin-gpu-check-*/cri-containerd-*.scope"))
    assert len(leaves) == 2 and all((leaf / "cgroup.procs").read_text().isdigit() for leaf in leaves)
    assert not check.work.exists()


def _cgroup2_mount() -> str | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        f = line.split()
        if f[2] == "cgroup2" and os.access(f[1], os.W_OK):
            return f[1]
    return None


def test_step9_reservations_rehearsed_on_the_fake_nvml_and_a_real_cgroup_v2(tmp_path, monkeypatch):
    """Step 9's reservation case (issue 35 item 6) as it runs on a GPU machine, with the fake
    ``libnvidia-ml.so.1`` (tests/fakes/nvml: NVIDIA's parent bookkeeping modelled) for the daemon and the
    check, on this machine's real cgroup v2 hierarchy: without the repair a deleted leaf's 64 MiB stays on
    both parents (and NVML soft 0 on the parent does not take it back, in the model); with it, the daemon
    zeroes the soft limit when the leaf's holder process dies, before the leaf is deleted, and nothing stays."""
    import ctypes

    from tests.fakes import nvml as fake

    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip("no writable cgroup v2 hierarchy on this machine")
    lib = fake.build_fake_nvml()
    ctypes.CDLL(str(lib / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)  # the check's own pynvml finds it
    import pynvml
    for _ in range(64):  # an earlier test of this process may have left NVML open on another node file
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            break
    node_file, doc = _node(tmp_path, "615.71.09")
    for k, v in fake.env(lib, fake.node_file(tmp_path / "nvml-node", doc), tmp_path / "limits").items():
        monkeypatch.setenv(k, v)
    from fracplugin.gpu.simulated import SimulatedInventory
    from fracplugin.mps.control import choose_protocol

    work = Path(os.path.realpath("/tmp")) / f"fpgc9{os.getpid()}"
    work.mkdir()
    check = gc.GpuCheck(tmp_path / "gpu-check.json", sys.executable, [str(REPO / "src")], FAKE_MPS,
                        simulate_node=node_file, cgroup_root=mount)
    check.work.rmdir()
    check.work = work
    check.node = SimulatedInventory(node_file).node()
    check.gpu = check.node.gpus[0]
    check.protocol = choose_protocol("615.71.09")
    check.nri = gc.Nri(work / "nri.sock")
    check.daemon = gc.Daemon(work, sys.executable, [str(REPO / "src")], FAKE_MPS, node_file, mount)
    check.cgroups = gc.Cgroups(mount)
    try:
        check.daemon.start(60)
        wait_until(lambda: check.daemon.get("/readyz")[0] == 200, 60, lambda: check.daemon.log_tail())
        check.nri.server.wait_registered(10)
        check._reservations()
        figs = {f.name: f for f in check.report.figures}
        assert all(f.status == "pass" for f in figs.values()), [f.__dict__ for f in figs.values()]
        base, soft = str(check.cgroups.base), gc.RES_SOFT_MIB << 20
        without = figs["without the repair: parents' reservation after the leaf's deletion"].observed
        assert list(without["leftover_bytes"].values()) == [soft, soft] and base in without["leftover_bytes"]
        assert list(figs["after the fact: NVML soft 0 on the parent"].observed["leftover_bytes"].values()) == \
            [soft, soft]
        assert figs["with the repair (the daemon zeroes at populated 0): soft limit zeroed before the leaf went"] \
            .observed == 0
        with_ = figs["with the repair (the daemon zeroes at populated 0): parents' reservation after the leaf's "
                     "deletion"].observed
        assert list(with_["leftover_bytes"].values()) == [0, 0], with_
        assert with_["daemon_soft_zeroing"] == {"zeroed": 1, "leaf_gone": 0, "failed": 0}, with_
    finally:
        check.daemon.stop(20)
        check.nri.close()
        check.cgroups.cleanup()
        shutil.rmtree(work, ignore_errors=True)
