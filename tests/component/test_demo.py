"""``fracplugin demo`` end to end: the contract values it prints, the refusal
with its reason, exit 0, and nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import scaled

REPO = Path(__file__).resolve().parents[2]
UUIDS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]


def _sections(out: str) -> dict[str, str]:
    parts = re.split(r"^== ", out, flags=re.M)
    return {p.splitlines()[0]: p for p in parts[1:]}


def _procs_mentioning(needle: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            blob = (p / "cmdline").read_bytes() + (p / "environ").read_bytes()
        except OSError:
            continue
        if needle.encode() in blob:
            pids.append(int(p.name))
    return pids


@pytest.fixture(scope="module")
def demo_run() -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "fracplugin.cli", "demo"], capture_output=True, text=True,
                          timeout=scaled(110), env=env, cwd=str(REPO))  # bounds a hang only


def test_demo_exits_0_and_leaves_nothing(demo_run: subprocess.CompletedProcess[str]) -> None:
    out = demo_run.stdout
    assert demo_run.returncode == 0, out + demo_run.stderr
    assert "no process or socket left behind" in out and "demo finished" in out
    work = re.search(r"work directory (/tmp/fpdemo\S+)", out).group(1)
    assert not Path(work).exists()
    assert _procs_mentioning(work) == []


def test_demo_inference_pod_gets_the_contract(demo_run: subprocess.CompletedProcess[str]) -> None:
    secs = _sections(demo_run.stdout)
    inf = next(v for k, v in secs.items() if k.startswith("NRI CreateContainer default/inference"))
    assert "container default/inference/app: PLACED" in inf
    assert f"NVIDIA_VISIBLE_DEVICES={','.join(UUIDS)}" in inf
    assert "NVIDIA_GPU_MEMORY_REQUEST=40960" in inf and "NVIDIA_GPU_MEMORY_LIMIT=61440" in inf
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(f"{u}=61440M" for u in UUIDS) in inf
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in inf
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in inf
    # one mount: the container's own sm-sharing namespace directory, nothing else
    mounts = re.findall(r"^\s+(/\S+) -> (\S+) \(", inf, flags=re.M)
    assert len(mounts) == 1 and re.search(r"/mps/sm/shared/fp_[0-9a-f]{24}$", mounts[0][0])
    assert mounts[0][1] == "/tmp/nvidia-mps"
    # the tenancy table: four GPUs held in sm-sharing
    assert inf.count("sm-sharing  40960/81559") == 4


def test_demo_notebook_refused_then_placed(demo_run: subprocess.CompletedProcess[str]) -> None:
    out = demo_run.stdout
    nb = [m.start() for m in re.finditer(r"^== NRI CreateContainer research/notebook", out, flags=re.M)]
    rm = out.index("== NRI StopContainer + RemoveContainer + RemovePodSandbox default/inference")
    assert len(nb) == 2 and nb[0] < rm < nb[1]
    first, second = out[nb[0]:rm], out[nb[1]:]
    assert "container research/notebook/app: REFUSED (FAILED_PRECONDITION)" in first  # a node guard
    reason = re.search(r"reason: (.*)", first).group(1)
    assert f"GPU 0 ({UUIDS[0]}) is in sm-sharing mode for default/inference/app" in reason
    assert "this container wants time-slicing" in reason
    assert "container research/notebook/app: PLACED" in second
    # KAI's binder reserve (1024 MiB per GPU) by default, as KAI writes them
    assert "NVIDIA_GPU_MEMORY_REQUEST=40267" in second  # floor((81559 - 1024) * 0.5)
    assert "NVIDIA_GPU_MEMORY_LIMIT=64428" in second  # floor((81559 - 1024) * 0.8)
    assert f"NVIDIA_VISIBLE_DEVICES={UUIDS[0]},{UUIDS[1]}" in second
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={UUIDS[0]}=64428M,{UUIDS[1]}=64428M" in second
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in second.split("GPU tenancy")[0]
    # its own namespace leaf on the time-slicing daemon (issue 12), never the daemon's pipe directory
    assert re.search(r"/mps/ts/shared/fp_[0-9a-f]{24} -> /tmp/nvidia-mps", second)
    assert not re.search(r"/mps/ts -> /tmp/nvidia-mps", second)


def test_demo_limit_below_request_refused(demo_run: subprocess.CompletedProcess[str]) -> None:
    sec = next(v for k, v in _sections(demo_run.stdout).items() if k.startswith("NRI CreateContainer default/tight"))
    assert "REFUSED (INVALID_ARGUMENT)" in sec
    assert 'nvidia.com/container.app.gpu-memory.limit="10Gi"' in sec and "limit must be >= the request" in sec


def test_demo_device_plugin_door(demo_run: subprocess.CompletedProcess[str]) -> None:
    sec = next(v for k, v in _sections(demo_run.stdout).items() if k.startswith("device plugin Allocate"))
    assert "container default/embeddings/worker: ALLOCATED" in sec
    assert "NVIDIA_GPU_MEMORY_REQUEST=8192" in sec
    dev = re.search(r"NVIDIA_VISIBLE_DEVICES=(\S+)", sec).group(1)
    assert dev in UUIDS
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={dev}=8192M" in sec
    # Allocate records the reservation under the device IDs; NRI names the holder.
    assert "(holder not known yet): request 8192 MiB" in sec and "door allocate" in sec


def test_demo_metrics(demo_run: subprocess.CompletedProcess[str]) -> None:
    sec = next(v for k, v in _sections(demo_run.stdout).items() if k.startswith("a few metrics"))
    assert 'fracplugin_refusals_total{reason="no_fit",node="gpu-node-1"} 1.0' in sec
    assert 'fracplugin_refusals_total{reason="limit_below_request",node="gpu-node-1"} 1.0' in sec
    assert 'fracplugin_mps_daemon_up{mode="sm-sharing",node="gpu-node-1"} 1.0' in sec
    assert 'fracplugin_ledger_entries{node="gpu-node-1"} 3.0' in sec  # notebook on two GPUs + embeddings on one


def test_demo_nri_binds_the_device_plugin_reservation(demo_run: subprocess.CompletedProcess[str]) -> None:
    sec = next(v for k, v in _sections(demo_run.stdout).items()
               if k.startswith("NRI CreateContainer default/embeddings"))
    assert "container default/embeddings/worker: PLACED" in sec
    assert "NVIDIA_GPU_MEMORY_REQUEST=8192" in sec and "NVIDIA_GPU_MEMORY_LIMIT=8192" in sec
    assert re.search(r"default/embeddings/worker: request 8192 MiB, limit 8192 MiB, time-slicing  id \w+  "
                     r"door allocate  reservation GPU-\S+::0-7", sec), sec


def test_demo_mps_namespace_follows_the_inference_pod(demo_run: subprocess.CompletedProcess[str]) -> None:
    secs = _sections(demo_run.stdout)
    inf = next(v for k, v in secs.items() if k.startswith("NRI CreateContainer default/inference"))
    assert "StartContainer: started (its MPS namespace is in place)" in inf
    assert re.search(r"MPS sm-sharing daemon \(healthy\): namespace fp_[0-9a-f]{24} for app \(ATP 50\)", inf)
    rm = next(v for k, v in secs.items() if k.startswith("NRI StopContainer"))
    assert "MPS sm-sharing daemon (healthy): no namespaces" in rm
