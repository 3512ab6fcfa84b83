"""KAI Scheduler NvFractions defaults on the node (issue #18, ADR 0005).

- the per-GPU reserve is KAI's binder reserve (1024 MiB) by default;
- a container without ``.gpu-compute.portion`` gets the portion KAI would
  write (two decimals, from the fraction or from the memory request);
- the pod-level ``kai.scheduler/gpu-compute-sharing-mode`` annotation is
  read, and the per-container key wins;
- devices written as CDI names are passed on as CDI devices.

Each expected value below is worked out by hand from KAI's code (cited in
planner.kai_compute_portion and DEFAULT_RESERVE_MIB), not from our output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fracplugin import explain as explain_mod
from fracplugin.annotations import KEY_POD_COMPUTE_MODE, parse
from fracplugin.config import DEFAULTS
from fracplugin.gpu.simulated import load_node
from fracplugin.model import ComputeMode, FractionError, PodRef
from fracplugin.nri.plugin import build_adjustment
from fracplugin.planner import (
    DEFAULT_RESERVE_MIB,
    EmptyLedger,
    PlannerConfig,
    is_cdi_name,
)
from tests.helpers import plan_container

P = "nvidia.com/container.app."
POD = PodRef("default", "p", "uid-1")
UUID0 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01"
UUID1 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a02"


@pytest.fixture(scope="module")
def node(node_file: Path):
    return load_node(str(node_file))


def plan(ann, node, config=PlannerConfig()):
    return plan_container(ann, "app", POD, node, EmptyLedger(), config, containers=["app"])


def test_default_reserve_is_kais_binder_reserve() -> None:
    assert DEFAULT_RESERVE_MIB == 1024
    assert PlannerConfig().reserve_mib == 1024
    assert DEFAULTS.reserve_mib == 1024


def test_explain_seed_notebook_default_flags(examples: Path, node_file: Path, capsys) -> None:
    """Done-when of issue #18: default flags give KAI's 40267 / 64428."""
    args = _explain_args(examples / "pods" / "notebook-time-slicing-2gpu.yaml", node_file)
    assert explain_mod.main(args) == 0
    out = capsys.readouterr().out
    assert "40267 MiB request / 64428 MiB limit per GPU" in out
    assert ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01=64428M,"
            "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a02=64428M") in out


def test_explain_seed_notebook_reserve_zero(examples: Path, node_file: Path, capsys) -> None:
    args = _explain_args(examples / "pods" / "notebook-time-slicing-2gpu.yaml", node_file, reserve_mib=0)
    assert explain_mod.main(args) == 0
    out = capsys.readouterr().out
    assert "40779 MiB request / 65247 MiB limit per GPU" in out
    assert ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01=65247M,"
            "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a02=65247M") in out


def _explain_args(pod: Path, node: Path, reserve_mib: int | None = None):
    import argparse

    p = argparse.ArgumentParser()
    explain_mod.add_arguments(p)
    argv = [str(pod), "--node", str(node)]
    if reserve_mib is not None:
        argv += ["--reserve-mib", str(reserve_mib)]
    return p.parse_args(argv)


# ---- compute portion, as KAI derives it ---------------------------------------------
@pytest.mark.parametrize("ann,portion,atp", [
    # gpu-fraction: the scheduler's "%.2f" of the fraction
    ({"gpu-fraction": "0.5"}, 0.5, 50),
    ({"gpu-fraction": "0.333"}, 0.33, 33),
    # 0.125 is exact in binary: Go's and Python's %.2f both round half to even
    ({"gpu-fraction": "0.125"}, 0.12, 12),
    # absolute request: ceil(MiB / 81559 x 100) / 100
    ({P + "gpu-memory.request": "40Gi"}, 0.51, 51),       # 40960 / 81559 = 0.5022
    ({P + "gpu-memory.request": "8Gi"}, 0.11, 11),        # 8192 / 81559 = 0.1004
    ({"gpu-memory": "20480"}, 0.26, 26),                  # 20480 / 81559 = 0.2511
    ({P + "gpu-memory.request": "81559Mi"}, 1.0, 100),    # the whole GPU
    # "%.2f" of 0.004 is 0.00: the binder falls back to request / (GPU - reserve)
    # = floor(80535 x 0.004) / 80535 = 322 / 80535; the cap is at least 1 %
    ({"gpu-fraction": "0.004"}, 322 / 80535, 1),
])
def test_portion_without_annotation_is_kais(node, ann, portion, atp) -> None:
    p = plan({**ann, P + "gpu-compute.mode": "sm-sharing"}, node)
    assert p.portion == portion
    assert p.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(atp)
    assert p.active_thread_percentage == atp


def test_written_portion_wins_over_the_derived_one(node) -> None:
    p = plan({P + "gpu-memory.request": "40Gi", P + "gpu-compute.mode": "sm-sharing",
              P + "gpu-compute.portion": "0.25"}, node)
    assert p.portion == 0.25 and p.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_time_slicing_gets_no_cap_from_the_derived_portion(node) -> None:
    p = plan({P + "gpu-memory.request": "40Gi"}, node)
    assert p.portion == 0.51 and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in p.env
    assert p.active_thread_percentage is None


# ---- pod-level compute mode -------------------------------------------------------
def test_pod_level_compute_mode_is_read(node) -> None:
    p = plan({"gpu-fraction": "0.5", KEY_POD_COMPUTE_MODE: "sm-sharing"}, node)
    assert p.compute_mode is ComputeMode.SM_SHARING and p.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    r = parse({"gpu-fraction": "0.5", KEY_POD_COMPUTE_MODE: "sm-sharing"}, "app")
    assert r is not None and r.keys["mode"] == KEY_POD_COMPUTE_MODE


def test_per_container_mode_wins_over_pod_level(node) -> None:
    p = plan({"gpu-fraction": "0.5", KEY_POD_COMPUTE_MODE: "sm-sharing",
              P + "gpu-compute.mode": "time-slicing"}, node)
    assert p.compute_mode is ComputeMode.TIME_SLICING


@pytest.mark.parametrize("raw", ["", "mps", "SM-sharing", " sm-sharing"])
def test_bad_pod_level_mode_is_refused_naming_the_key(raw: str) -> None:
    with pytest.raises(FractionError) as e:
        parse({"gpu-fraction": "0.5", KEY_POD_COMPUTE_MODE: raw}, "app")
    assert e.value.key == KEY_POD_COMPUTE_MODE and e.value.value == raw
    assert "time-slicing" in e.value.reason


def test_bad_pod_level_mode_is_ignored_when_the_container_key_is_set() -> None:
    r = parse({"gpu-fraction": "0.5", KEY_POD_COMPUTE_MODE: "bogus", P + "gpu-compute.mode": "sm-sharing"}, "app")
    assert r is not None and r.compute_mode is ComputeMode.SM_SHARING


# ---- CDI device names ----------------------------------------------------------------
@pytest.mark.parametrize("entry,yes", [
    ("k8s.device-plugin.nvidia.com/gpu=" + UUID0, True), ("nvidia.com/gpu=0", True),
    (UUID0, False), ("0", False), ("=x", False), ("nvidia.com/=0", False), ("nvidia.com/gpu=", False),
])
def test_is_cdi_name(entry: str, yes: bool) -> None:
    assert is_cdi_name(entry) is yes


def test_cdi_names_become_cdi_devices_of_the_adjustment(node) -> None:
    names = [f"k8s.device-plugin.nvidia.com/gpu={u}" for u in (UUID0, UUID1)]
    p = plan({P + "gpu-memory.request": "10Gi", P + "gpus.devices": ",".join(names)}, node)
    assert p.env["NVIDIA_VISIBLE_DEVICES"] == f"{UUID0},{UUID1}"  # the env names the GPUs by UUID
    assert p.cdi_devices == tuple(names)
    adj = build_adjustment(p)
    assert [d.name for d in adj.CDI_devices] == names


def test_uuid_devices_get_no_cdi_devices(node) -> None:
    p = plan({P + "gpu-memory.request": "10Gi", P + "gpus.devices": f"{UUID0},{UUID1}"}, node)
    assert p.cdi_devices == ()
    assert len(build_adjustment(p).CDI_devices) == 0


def test_cdi_devices_can_be_turned_off(node) -> None:
    p = plan({P + "gpu-memory.request": "10Gi", P + "gpus.devices": "k8s.device-plugin.nvidia.com/gpu=" + UUID0},
             node, PlannerConfig(cdi_devices=False))
    assert p.cdi_devices == () and p.env["NVIDIA_VISIBLE_DEVICES"] == UUID0
