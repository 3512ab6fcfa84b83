"""planner.plan on the seed pods and the four-GPU node (issue 2 'Done means')."""

from __future__ import annotations

import pytest

from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import ComputeMode, FractionError, PodRef
from fracplugin.mps.layout import MpsLayout, namespace_name
from fracplugin.planner import EmptyLedger, PlannerConfig
from tests.helpers import plan_container

UUIDS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]


@pytest.fixture
def node(node_file):
    return load_node(node_file)


def ref(pod):
    md = pod["metadata"]
    return PodRef(md["namespace"], md["name"], md["uid"])


def plan_seed(pod, node, ledger=None, container="app", config=PlannerConfig()):
    return plan_container(pod["metadata"]["annotations"], container, ref(pod), node,
                          ledger or EmptyLedger(), config)


def test_bound_inference_pod_gets_the_contract(seed_pods, node):
    p = plan_seed(seed_pods["inference-sm-sharing-4gpu.bound"], node)
    assert p.env == {
        "NVIDIA_VISIBLE_DEVICES": ",".join(UUIDS),
        "NVIDIA_GPU_MEMORY_REQUEST": "40960",
        "NVIDIA_GPU_MEMORY_LIMIT": "61440",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{u}=61440M" for u in UUIDS),  # UUID keys (issue 35)
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        # issue 12: the client sees only its GPUs, in plan order, so pinned ordinal i is UUIDS[i]
        "CUDA_VISIBLE_DEVICES": ",".join(UUIDS),
    }
    ns = namespace_name("6f1c2a0e-4b7d-4e59-9a51-0c7f3d2b9e11", "app")
    assert [(m.source, m.destination, m.read_only) for m in p.mounts] == [
        (MpsLayout().namespace_pipe_dir(ns), "/tmp/nvidia-mps", True)]
    assert p.mounts[0].options == ("rbind", "ro", "nosuid", "nodev")
    assert p.mps_namespace == ns and p.active_thread_percentage == 50
    assert not p.placed_by_node


def test_mps_namespace_name_and_pipe_directory_are_pinned_to_literals(seed_pods, node):
    """The namespace name is part of the host's state (MPS namespaces, pipe
    directories, the ledger) and outlives a rollout: a format change must be
    deliberate. ``fp_`` + 24 hex of sha256("<pod uid>/<container>") (mps/layout.py)."""
    assert namespace_name("6f1c2a0e-4b7d-4e59-9a51-0c7f3d2b9e11", "app") == "fp_3c21d1bd17f0535bc1c74a69"
    assert namespace_name("0b9d7e35-2f1a-4c88-8e0d-5a6b7c8d9e22", "app") == "fp_a5c3171f934d21e3985f1b8b"
    sm = plan_seed(seed_pods["inference-sm-sharing-4gpu.bound"], node)
    assert sm.mps_namespace == "fp_3c21d1bd17f0535bc1c74a69"
    assert sm.mounts[0].source == "/run/fracplugin/mps/sm/shared/fp_3c21d1bd17f0535bc1c74a69"
    ts = plan_seed(seed_pods["notebook-time-slicing-2gpu"], node)
    assert ts.mps_namespace == "fp_a5c3171f934d21e3985f1b8b"
    assert ts.mounts[0].source == "/run/fracplugin/mps/ts/shared/fp_a5c3171f934d21e3985f1b8b"


def test_unbound_inference_pod_is_placed_on_all_four(seed_pods, node):
    p = plan_seed(seed_pods["inference-sm-sharing-4gpu"], node)
    assert p.device_uuids == tuple(UUIDS)
    assert p.env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960" and p.env["NVIDIA_GPU_MEMORY_LIMIT"] == "61440"
    assert p.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == ",".join(f"{u}=61440M" for u in UUIDS)
    # no portion written: the one KAI's scheduler would hand its binder,
    # ceil(40960 / 81559 x 100) / 100 = 0.51, caps the sm-sharing namespace
    assert p.portion == 0.51 and p.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "51"
    assert p.active_thread_percentage == 51
    assert p.placed_by_node


def test_notebook_is_placed_on_two_gpus_time_slicing(seed_pods, node):
    p = plan_seed(seed_pods["notebook-time-slicing-2gpu"], node)
    assert len(p.devices) == 2 and p.compute_mode is ComputeMode.TIME_SLICING
    # KAI's binder reserve (1024 MiB) by default: floor((81559 - 1024) x 0.5),
    # floor(80535 x 0.8), exactly what KAI's NvFractions binder writes
    assert p.env["NVIDIA_GPU_MEMORY_REQUEST"] == "40267"
    assert p.env["NVIDIA_GPU_MEMORY_LIMIT"] == "64428"
    assert p.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{UUIDS[0]}=64428M,{UUIDS[1]}=64428M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in p.env  # time-slicing: no cap
    assert p.portion == 0.5
    # issue 12: its own namespace leaf on the time-slicing daemon, read-only; never <root>/ts itself
    ns = namespace_name(ref(seed_pods["notebook-time-slicing-2gpu"]).uid, "app")
    assert p.mps_namespace == ns
    assert p.mounts[0].source == MpsLayout().namespace_pipe_dir(ns, ComputeMode.TIME_SLICING) == \
        f"/run/fracplugin/mps/ts/shared/{ns}"
    assert p.mounts[0].read_only
    pinned = [kv.split("=")[0] for kv in p.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split(",")]
    visible = p.env["CUDA_VISIBLE_DEVICES"].split(",")
    assert visible == list(p.device_uuids) == pinned  # only its own GPUs, by UUID (issue 35)


def test_classic_mps_has_no_namespaces(seed_pods, node):
    p = plan_seed(seed_pods["inference-sm-sharing-4gpu.bound"], node, config=PlannerConfig(mps_namespaces=False))
    assert p.mps_namespace is None
    assert p.mounts[0].source == MpsLayout().pipe_dir(ComputeMode.SM_SHARING)
    assert p.mounts[0].read_only  # the shared v2 directory: tenants cannot unlink or replace the socket
    assert p.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_reserve_is_taken_off_before_the_fraction(seed_pods, node):
    p = plan_seed(seed_pods["notebook-time-slicing-2gpu"], node, config=PlannerConfig(reserve_mib=559))
    assert p.env["NVIDIA_GPU_MEMORY_REQUEST"] == "40500"  # floor((81559-559)*0.5)


def test_container_without_annotations_gets_nothing(seed_pods, node):
    assert plan_seed(seed_pods["inference-sm-sharing-4gpu.bound"], node, container="sidecar") is None
    # pod-level KAI forms go to the first container when the spec is known
    pod = seed_pods["notebook-time-slicing-2gpu"]
    assert plan_container(pod["metadata"]["annotations"], "sidecar", ref(pod), node, EmptyLedger(),
                          containers=["app", "sidecar"]) is None


def test_notebook_refused_while_inference_holds_every_gpu_in_sm_sharing(seed_pods, node):
    ledger = Ledger(node)
    ledger.admit(plan_seed(seed_pods["inference-sm-sharing-4gpu.bound"], node))
    with pytest.raises(FractionError) as ei:
        plan_seed(seed_pods["notebook-time-slicing-2gpu"], node, ledger)
    msg = str(ei.value)
    assert ei.value.key == "gpu-fraction" and ei.value.code == "no_fit"
    assert "GPU 0 (GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01) is in sm-sharing mode for default/inference/app" in msg
    ledger.release("6f1c2a0e-4b7d-4e59-9a51-0c7f3d2b9e11", "app")
    assert len(plan_seed(seed_pods["notebook-time-slicing-2gpu"], node, ledger).devices) == 2


def test_placement_prefers_fewest_tenants_then_lowest_index(node):
    ledger = Ledger(node)
    mk = lambda uid, extra={}: plan_container({"nvidia.com/container.app.gpu-memory.request": "1Gi", **extra},
                                              "app", PodRef("ns", uid, uid), node, ledger)
    first = mk("a")
    assert first.device_uuids == (UUIDS[0],)
    ledger.admit(first)
    assert mk("b").device_uuids == (UUIDS[1],)
    # a restarted container is planned as if its own hold were free
    assert mk("a").device_uuids == (UUIDS[0],)


def test_bound_devices_refused_when_mode_differs(seed_pods, node):
    ledger = Ledger(node)
    ledger.admit(plan_seed(seed_pods["notebook-time-slicing-2gpu"], node))
    with pytest.raises(FractionError) as ei:
        plan_seed(seed_pods["inference-sm-sharing-4gpu.bound"], node, ledger)
    assert ei.value.key == "nvidia.com/container.app.gpus.devices" and ei.value.code == "guard"
    assert "time-slicing mode for research/notebook/app" in ei.value.reason


@pytest.mark.parametrize("devices,fragment", [
    ("GPU-nope", "not a GPU of node gpu-node-1"),
    ("7", "not a GPU of node gpu-node-1"),
    ("0,1,2,3,0", "twice"),
    ("0,GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01", "twice"),
])
def test_devices_must_exist_once(node, devices, fragment):
    ann = {"nvidia.com/container.app.gpu-memory.request": "1Gi", "nvidia.com/container.app.gpus.devices": devices}
    with pytest.raises(FractionError) as ei:
        plan_container(ann, "app", PodRef("n", "p", "u"), node, EmptyLedger())
    assert fragment in ei.value.reason


def test_indices_and_cdi_names_resolve(node):
    ann = {"nvidia.com/container.app.gpu-memory.request": "1Gi",
           "nvidia.com/container.app.gpus.devices": f"2,k8s.device-plugin.nvidia.com/gpu={UUIDS[0]}"}
    p = plan_container(ann, "app", PodRef("n", "p", "u"), node, EmptyLedger())
    assert p.device_uuids == (UUIDS[2], UUIDS[0])


def test_more_devices_than_the_node_has(node):
    ann = {"nvidia.com/container.app.gpu-memory.request": "1Gi", "gpu-fraction-num-devices": "5"}
    with pytest.raises(FractionError) as ei:
        plan_container(ann, "app", PodRef("n", "p", "u"), node, EmptyLedger())
    assert ei.value.key == "gpu-fraction-num-devices"


def test_request_above_one_gpu_refused(node):
    ann = {"nvidia.com/container.app.gpu-memory.request": "80Gi"}
    with pytest.raises(FractionError) as ei:
        plan_container(ann, "app", PodRef("n", "p", "u"), node, EmptyLedger())
    assert ei.value.code == "too_large" and "81559 MiB" in ei.value.reason


def test_memory_guard_counts_other_tenants(node):
    ledger = Ledger(node)
    ann = {"nvidia.com/container.app.gpu-memory.request": "60Gi", "nvidia.com/container.app.gpus.devices": "0"}
    ledger.admit(plan_container(ann, "app", PodRef("n", "a", "a"), node, ledger))
    with pytest.raises(FractionError) as ei:
        plan_container(ann, "app", PodRef("n", "b", "b"), node, ledger)
    assert "MiB free" in ei.value.reason


def test_plan_is_pure(seed_pods, node):
    pod = seed_pods["notebook-time-slicing-2gpu"]
    assert plan_seed(pod, node) == plan_seed(pod, node)


@pytest.mark.parametrize("devices", ["²", "١", "０", "9" * 5000, "01", "+0"])
def test_device_indices_are_plain_ascii_numbers(node, devices):
    ann = {"nvidia.com/container.app.gpu-memory.request": "1Gi", "nvidia.com/container.app.gpus.devices": devices}
    with pytest.raises(FractionError) as ei:
        plan_container(ann, "app", PodRef("n", "p", "u"), node, EmptyLedger())
    assert ei.value.code == "device"
