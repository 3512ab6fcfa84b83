"""The container env block and the plan -> ledger conversion each exist once
in ``src/`` (issue 15): both doors answer the block ``planner`` built for the
plan, and only ``allocation.to_tenancies`` turns a plan into ledger entries.

The doors are driven directly (no sockets): the device plugin door's
``DevicePluginServer.allocate`` and the NRI door's
``FracNriPlugin.create_container`` on the container that carries Allocate's
reservation key, as kubelet and the runtime would pass it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fracplugin.reservations import ENV_RESERVATION_PROOF
from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import nri_pb2
from fracplugin.allocation import ENV_RESERVATION
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.kubelet.deviceplugin import DevicePluginServer
from fracplugin.kubelet.podlookup import InMemoryPodSource
from fracplugin.ledger import Ledger
from fracplugin.model import PodRef
from fracplugin.nri.plugin import FracNriPlugin, build_adjustment
from fracplugin.planner import ENFORCED_ENV_KEYS, PlannerConfig
from tests.helpers import plan_container
from tests.helpers import node_rules

SRC = Path(__file__).resolve().parents[2] / "src" / "fracplugin"
R = "fracplugin.io/gpu-memory"
P = "nvidia.com/container.app."
ANNOTATIONS = {P + "gpu-memory.limit": "12Gi", P + "gpu-compute.mode": "sm-sharing", P + "gpu-compute.portion": "0.25"}


def _adjusted_env(adjustment: nri_pb2.ContainerAdjustment) -> dict[str, str]:
    """KEY=value of a ContainerAdjustment's env (the ``-KEY`` entries remove a pod-authored value first)."""
    return {kv.key: kv.value for kv in adjustment.env if not kv.key.startswith("-")}


def test_both_doors_answer_the_same_env_block_for_one_allocation(node_file: Path, tmp_path: Path) -> None:
    inv = SimulatedInventory(node_file)
    node = inv.node()
    ledger, config = Ledger(node), PlannerConfig()
    gpu = node.gpus[1].uuid
    pods = InMemoryPodSource("gpu-node-1")
    pods.add({"metadata": {"name": "inf", "namespace": "default", "uid": "uid-inf", "annotations": ANNOTATIONS,
                           "creationTimestamp": "2026-01-01T00:00:00Z"},
              "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "app", "resources": {"limits": {R: "8"}}}]},
              "status": {"phase": "Pending"}})
    server = DevicePluginServer(node_rules(node, ledger, config), plugin_dir=str(tmp_path), podresources_socket=None,
                                pod_source=pods, allocate_deadline_s=0.3)
    resp = server.allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[f"{gpu}::{n}" for n in range(8)])]))
    allocate_env = dict(resp.container_responses[0].envs)
    key = allocate_env.pop(ENV_RESERVATION)
    proof = allocate_env.pop(ENV_RESERVATION_PROOF)  # kubelet passes Allocate's whole env on (ADR 0024)

    nri = FracNriPlugin(node_rules(node, ledger, config))
    sandbox = nri_pb2.PodSandbox(id="sandbox-inf", name="inf", namespace="default", uid="uid-inf",
                                 annotations=ANNOTATIONS)
    container = nri_pb2.Container(id="ctr-app", pod_sandbox_id="sandbox-inf", name="app",
                                  env=[f"{ENV_RESERVATION}={key}", f"{ENV_RESERVATION_PROOF}={proof}",
                                       "NVIDIA_VISIBLE_DEVICES=all"])
    nri_env = _adjusted_env(nri.create_container(sandbox, container).adjust)
    assert nri_env.pop(ENV_RESERVATION_PROOF) == ""  # checked, then blanked in the container's env (ADR 0033)

    expected = {
        "NVIDIA_VISIBLE_DEVICES": gpu,
        "CUDA_VISIBLE_DEVICES": gpu,
        "NVIDIA_GPU_MEMORY_REQUEST": "8192",  # kubelet's 8 devices of 1 GiB
        "NVIDIA_GPU_MEMORY_LIMIT": "12288",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{gpu}=12288M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
    }
    assert allocate_env == nri_env == expected
    assert set(expected) == set(ENFORCED_ENV_KEYS)  # every key fracplugin owns, each from the one block
    (t,) = ledger.tenancies()  # one reservation, now bound to the container the NRI door saw
    assert (t.pod_uid, t.container, t.container_id, t.reservation) == ("uid-inf", "app", "ctr-app", key)


def test_the_nri_adjustment_carries_the_plans_env_block_verbatim(node_file: Path) -> None:
    node = SimulatedInventory(node_file).node()
    plan = plan_container(ANNOTATIONS | {P + "gpu-memory.request": "8Gi"}, "app", PodRef("default", "inf", "u"),
                          node, Ledger(node))
    assert plan is not None
    adj = build_adjustment(plan)
    assert _adjusted_env(adj) == plan.env
    # each key is first removed (a pod-authored value never survives), then set, in plan order
    assert [kv.key for kv in adj.env] == [k for key in plan.env for k in ("-" + key, key)]


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def test_only_to_tenancies_turns_a_plan_into_ledger_entries() -> None:
    """Outside ``allocation.py`` a Tenancy is built only for a whole-GPU hold
    (another plugin's GPU, a container fracplugin did not adjust): door
    ``other-plugin`` or ``sync``, never from a plan."""
    elsewhere = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "allocation.py" or "_proto" in path.parts:
            continue
        for call in _calls(ast.parse(path.read_text()), "Tenancy"):
            door = next((k.value for k in call.keywords if k.arg == "door"), None)
            elsewhere.append((path.relative_to(SRC).as_posix(), getattr(door, "attr", None)))
    assert elsewhere and all(d in ("DOOR_OTHER_PLUGIN", "DOOR_SYNC") for _p, d in elsewhere), elsewhere


# Modules that spell these names for another purpose than a container's
# answer: the MPS supervision sets its own daemons' CUDA_MPS_PIPE_DIRECTORY
# (the demo, which reads the doors' answers, lives outside src/fracplugin).
NOT_ANSWERS = ("mps/",)


@pytest.mark.parametrize("key", [*ENFORCED_ENV_KEYS, ENV_RESERVATION])
def test_each_env_key_is_spelled_in_exactly_one_src_module(key: str) -> None:
    """The block has one home: every env key fracplugin sets in a container
    appears as a string literal in one module of ``src/`` (the planner; the
    reservation key in allocation); the doors use the constants."""
    homes = sorted(
        rel for path in SRC.rglob("*.py")
        if "_proto" not in path.parts and not (rel := path.relative_to(SRC).as_posix()).startswith(NOT_ANSWERS)
        and any(isinstance(n, ast.Constant) and n.value == key for n in ast.walk(ast.parse(path.read_text())))
    )
    assert homes == (["allocation.py"] if key == ENV_RESERVATION else ["planner.py"]), homes
