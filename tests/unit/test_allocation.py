"""The pure core of the one allocation model (ADR 0007): reservation keys,
kubelet's allocation plus what annotations may add, the one plan -> ledger
entries conversion and one hold per reservation in the ledger."""

from __future__ import annotations

import pytest

from fracplugin import allocation as al
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.ledger import Ledger
from fracplugin.model import ComputeMode, FractionError, PodRef
from fracplugin.planner import PlannerConfig, plan, plan_from_tenancies

P = "nvidia.com/container."


@pytest.fixture
def node(node_file):
    return SimulatedInventory(node_file).node()


def test_reservation_key_is_canonical_and_round_trips():
    key = al.reservation_key({"GPU-b": [3, 1, 2, 7], "GPU-a": [0]})
    assert key == "GPU-a::0;GPU-b::1-3,7"
    assert al.parse_reservation_key(key) == {"GPU-a": [0], "GPU-b": [1, 2, 3, 7]}
    assert al.overlaps(key, "GPU-b::7-9") and not al.overlaps(key, "GPU-b::4-6")


@pytest.mark.parametrize("bad", ["", "GPU-a", "GPU-a::", "GPU-a::3-1", "GPU-a::01", "GPU-a::1,2", "GPU-b::0;GPU-a::0",
                                 "x" * 5000])
def test_non_canonical_keys_are_refused(bad):
    with pytest.raises(al.ReservationKeyError):
        al.parse_reservation_key(bad)


def test_kubelet_request_keeps_devices_and_units_and_names_what_is_ignored():
    parsed = al.parse_for_kubelet({P + "app.gpu-memory.request": "70Gi", P + "app.gpus.devices": "GPU-z",
                                   P + "app.gpu-memory.limit": "80Gi", P + "app.gpu-compute.mode": "sm-sharing"},
                                  "app", 1024, prefix=P)
    req, ignored = al.kubelet_request("app", ["GPU-a"], 1024, 1, parsed, "resources.limits[r]", gpu_memory_mib=81559)
    assert req.devices == ("GPU-a",) and req.request.mib == 1024 and req.limit.mib == 81920
    assert req.compute_mode is ComputeMode.SM_SHARING
    assert {i.key for i in ignored} == {P + "app.gpu-memory.request", P + "app.gpus.devices"}


def test_limit_below_kubelets_request_is_not_applied():
    parsed = al.parse_for_kubelet({P + "app.gpu-memory.limit": "4Gi"}, "app", 8192, prefix=P)
    req, ignored = al.kubelet_request("app", ["GPU-a"], 8192, 8, parsed, "r", gpu_memory_mib=81559)
    assert req.limit.mib == 8192 and [i.key for i in ignored] == [P + "app.gpu-memory.limit"]


def test_fraction_limit_resolves_against_the_gpu():
    parsed = al.parse_for_kubelet({"gpu-fraction": "0.1", "gpu-fraction.limit": "0.5"}, "app", 8192, prefix=P,
                                  containers=["app"])
    req, ignored = al.kubelet_request("app", ["GPU-a"], 8192, 8, parsed, "r", gpu_memory_mib=81559)
    assert req.limit.resolve_mib(81559) == 40779
    assert [i.key for i in ignored] == ["gpu-fraction"]  # 8155 MiB is not the 8 units kubelet charged


def test_no_annotations_is_request_sized_time_slicing():
    req, ignored = al.kubelet_request("app", ["GPU-a", "GPU-b"], 2048, 4, None, "r", gpu_memory_mib=81559)
    assert (req.request.mib, req.limit.mib, req.compute_mode, req.num_devices, ignored) == \
        (2048, 2048, ComputeMode.TIME_SLICING, 2, [])


def test_one_hold_per_reservation_and_the_one_conversion(node):
    ledger = Ledger(node)
    cfg = PlannerConfig()
    key = al.reservation_key({node.gpus[0].uuid: range(40)})
    pod = PodRef("default", "p", "uid-p")
    init_req, _ = al.kubelet_request("setup", [node.gpus[0].uuid], 40960, 40, None, "r", gpu_memory_mib=81559)
    p1 = plan(init_req, pod, node, ledger, cfg, reservation=key)
    ledger.admit(p1, door=al.DOOR_ALLOCATE, reservation=key, bound=False)
    assert [t.pod_uid for t in ledger.tenancies()] == [""]
    parsed = al.parse_for_kubelet({P + "app.gpu-compute.mode": "sm-sharing"}, "app", 40960, prefix=P)
    app_req, _ = al.kubelet_request("app", [node.gpus[0].uuid], 40960, 40, parsed, "r", gpu_memory_mib=81559)
    p2 = plan(app_req, pod, node, ledger, cfg, reservation=key)  # not refused: 40599 MiB free is not the rule
    got = ledger.admit(p2, "cid", door=al.DOOR_ALLOCATE, reservation=key)
    assert got == al.to_tenancies(p2, "cid", door=al.DOOR_ALLOCATE, reservation=key)
    (t,) = ledger.tenancies()
    assert (t.pod_uid, t.container, t.mode, t.request_mib) == ("uid-p", "app", ComputeMode.SM_SHARING, 40960)
    again = plan_from_tenancies(ledger.reservation(key), node, cfg)
    assert dict(again.env) == dict(p2.env) and again.mounts == p2.mounts
    # A stopped container is unbound from the reservation, which stays with the pod.
    assert ledger.release_stopped("cid") == []
    (t,) = ledger.tenancies()
    assert (t.pod_uid, t.container_id) == ("uid-p", "")
    # Another pod cannot take the GPU's remaining memory with a third 40 GiB.
    other, _ = al.kubelet_request("app", [node.gpus[0].uuid], 40960, 40, None, "r", gpu_memory_mib=81559)
    with pytest.raises(FractionError, match="one compute mode per GPU"):
        plan(other, PodRef("default", "q", "uid-q"), node, ledger, cfg, reservation="GPU-x::0")
