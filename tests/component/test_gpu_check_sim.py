"""``make gpu-check``'s daemon-facing parts against the real daemon on the
simulated node with the fake ``nvidia-cuda-mps-control``: the check starts
the daemon as it does on a GPU machine (tests/gpu/gpu_check.py ``Daemon``),
plans both containers through the real NRI door (``Nri``: RunPodSandbox,
CreateContainer, StartContainer), builds each client's env from the plan
(``client_env``), asks the control daemon for its clients
(``mps_client_pids``), kills and awaits the MPS restart (``restart_check``)
and stops the daemon with nothing left behind (``shutdown``).

Run on a driver r615 node (MPS v3: sm-sharing containers get their own
namespace leaf) and a driver r580 node (classic MPS v2: shared pipe
directory; the namespace figure is skipped there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.gpu import gpu_check as gc

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = str(REPO / "tests" / "fakes" / "nvidia-cuda-mps-control")


def _node(tmp_path: Path, driver: str) -> tuple[str, dict]:
    doc = yaml.safe_load(NODE.read_text())
    doc["driver_version"] = driver
    p = tmp_path / f"node-{driver}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p), doc


@pytest.fixture(params=["615.71.09", "580.159.03"])
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
    assert gc.wait_until(lambda: check.daemon.get("/readyz")[0] == 200, 60), check.daemon.log_tail()
    check.nri.server.wait_registered(10)
    yield check
    for c in check.clients:
        c.kill()
    check.daemon.stop(20)
    check.nri.close()
    import shutil

    shutil.rmtree(work, ignore_errors=True)


def test_plans_through_the_nri_door_become_client_envs(running):
    check = running
    gpu = check.gpu.uuid
    ds = check.daemon.mps_daemons()
    assert {"time-slicing", "sm-sharing"} <= set(ds)

    ts = check._plan(3, gc.pod_manifest("gpucheck-ts", "time-slicing", gc.TS_LIMIT_MIB, gpu), gc.TS_LIMIT_MIB, None)
    assert ts is not None, [f.__dict__ for f in check.report.figures]
    assert ts.env["NVIDIA_VISIBLE_DEVICES"] == gpu
    assert ts.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
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
    assert sm.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    env, _ = gc.client_env(sm.env, sm.mounts, {}, len(check.node.gpus))
    sm_pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.isdir(sm_pipe)
    namespaces = [n["name"] for n in check.daemon.mps_daemons()["sm-sharing"]["namespaces"]]
    if check.protocol >= 3:
        assert gc.mps_namespace_skip(3) == ""
        assert os.path.basename(sm_pipe) in namespaces and sm_pipe != ds["sm-sharing"]["pipe_dir"]
    else:
        assert gc.mps_namespace_skip(2) and namespaces == []
        assert sm_pipe == ds["sm-sharing"]["pipe_dir"]  # classic MPS: the daemon's own pipe directory
    check.nri.remove(sm)

    # the refusal path: a second mode on the GPU is refused and reported as a failure, not a crash
    check.nri.create(gc.pod_manifest("gpucheck-ts2", "time-slicing", 1024, gpu))
    assert check._plan(3, gc.pod_manifest("gpucheck-sm2", "sm-sharing", 1024, gpu, "0.5"), 1024, 50) is None
    assert check.report.figures[-1].status == "fail" and "RpcError" in str(check.report.figures[-1].observed)


def test_shutdown_stops_the_daemon_and_finds_no_mps_left(running):
    check = running
    check.shutdown()
    figs = {f.name: f for f in check.report.figures}
    assert figs["daemon stopped by SIGTERM"].status == "pass", check.daemon.log_tail()
    assert figs["no MPS process left"].status == "pass"
    assert figs["no MPS socket left"].status == "pass"
