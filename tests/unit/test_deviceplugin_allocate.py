"""Allocate and GetPreferredAllocation logic of DevicePluginServer, called
directly (no sockets; the server is never started)."""

from __future__ import annotations

import threading

import pytest

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin.gpu.inventory import XidEvent
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.rpcstatus import StatusCode
from fracplugin.kubelet.allocbase import Refusal
from fracplugin.kubelet.deviceplugin import ANNOTATION_ALLOCATE, DevicePluginServer
from fracplugin.kubelet.devices import parse_device_id
from fracplugin.kubelet.podlookup import InMemoryPodSource
from fracplugin.kubelet.podresources import ContainerDevices, PodDevices
from fracplugin.ledger import Ledger
from fracplugin.model import ComputeMode
from fracplugin.planner import PlannerConfig

from tests.helpers import node_rules, wait_until

R = "fracplugin.io/gpu-memory"
P = "nvidia.com/container."


def pod(name, count, annotations=None, created="2026-01-01T00:00:00Z", container="app", init=None, uid=None):
    spec = {"nodeName": "gpu-node-1", "containers": [{"name": container, "resources": {"limits": {R: str(count)}}}]}
    if init:
        spec["initContainers"] = [{"name": init[0], "resources": {"limits": {R: str(init[1])}}}]
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid or f"uid-{name}",
            "creationTimestamp": created,
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


@pytest.fixture
def inv(node_file):
    return SimulatedInventory(node_file)


@pytest.fixture
def node(inv):
    return inv.node()


@pytest.fixture
def src():
    return InMemoryPodSource("gpu-node-1")


@pytest.fixture
def make(inv, node, src, tmp_path):
    def _make(**kw):
        kw.setdefault("pod_source", src)
        kw.setdefault("allocate_deadline_s", 0.3)
        ledger = kw.pop("ledger", None) or Ledger(node)
        config = kw.pop("planner_config", None) or PlannerConfig()
        return DevicePluginServer(node_rules(node, ledger, config), plugin_dir=str(tmp_path),
                                  podresources_socket=None, **kw)

    return _make


def ids(node, gpu_index, n, start=0):
    return [f"{node.gpus[gpu_index].uuid}::{i}" for i in range(start, start + n)]


def areq(*lists):
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=x) for x in lists])


def env_of(resp):
    return dict(resp.container_responses[0].envs)


def refusal(fn, *a) -> Refusal:
    with pytest.raises(Refusal) as e:
        fn(*a)
    return e.value


# ---- bad input -------------------------------------------------------------


def test_bad_requests_get_invalid_argument_naming_the_rule(make, node):
    s = make()
    r = refusal(s.allocate, areq())
    assert r.code == StatusCode.INVALID_ARGUMENT and "0 container requests" in r.message
    r = refusal(s.allocate, areq(ids(node, 0, 1), ids(node, 1, 1)))
    assert r.code == StatusCode.INVALID_ARGUMENT and "2 container requests" in r.message
    r = refusal(s.allocate, areq([]))
    assert r.code == StatusCode.INVALID_ARGUMENT and "no device IDs" in r.message
    r = refusal(s.allocate, areq(["GPU-nope::1"]))
    assert r.code == StatusCode.INVALID_ARGUMENT and "GPU-nope::1" in r.message
    r = refusal(s.allocate, areq([ids(node, 0, 1)[0]] * 2))
    assert r.code == StatusCode.INVALID_ARGUMENT and "twice" in r.message
    r = refusal(s.allocate, areq(ids(node, 0, 2) + ids(node, 1, 1)))
    assert r.code == StatusCode.INVALID_ARGUMENT and "same number of devices" in r.message
    r = refusal(s.allocate, areq([f"{node.gpus[0].uuid}::79"]))
    assert "0..78" in r.message


@pytest.mark.parametrize("ids_of", [
    lambda u: [f"{u}::\u00b2"],  # used to reach int(): INTERNAL
    lambda u: [f"{u}::1", f"{u}::01", f"{u}::\u0661"],  # one device three times: passed as three
    lambda u: [f"{u}::" + "9" * 5000],
])
def test_non_canonical_device_ids_are_invalid_argument_naming_the_id(make, node, ids_of):
    s = make()
    u = node.gpus[0].uuid
    r = refusal(s.allocate, areq(ids_of(u)))
    assert r.code == StatusCode.INVALID_ARGUMENT, r.message
    assert u in r.message and len(r.message) < 1000
    assert s.ledger.tenancies() == []


def test_table_too_large_for_kubelet_is_refused_at_construction(make):
    from fracplugin.kubelet.devices import DeviceTableTooLarge

    with pytest.raises(DeviceTableTooLarge, match="device unit 1 MiB makes 326236 devices"):
        make(unit_mib=1)


def test_devices_of_an_unhealthy_gpu_are_refused(make, node):
    s = make()
    s.health.record_xid(XidEvent(node.gpus[0].uuid, 79))
    r = refusal(s.allocate, areq(ids(node, 0, 2)))
    # an Unhealthy GPU may recover: UNAVAILABLE at every door (noderules.status_of, issue 33)
    assert r.code == StatusCode.UNAVAILABLE and "xid 79" in r.message


# ---- planned answers ---------------------------------------------------------


def test_limit_and_sm_sharing_annotations_shape_the_env(make, node, src):
    src.add(
        pod(
            "inf",
            20,
            {
                P + "app.gpu-memory.limit": "30Gi",
                P + "app.gpu-compute.mode": "sm-sharing",
                P + "app.gpu-compute.portion": "0.25",
            },
        )
    )
    s = make()
    resp = s.allocate(areq(ids(node, 1, 20)))
    env = env_of(resp)
    assert env["NVIDIA_VISIBLE_DEVICES"] == node.gpus[1].uuid
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "20480"
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "30720"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{node.gpus[1].uuid}=30720M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    # MPS v3 (issue 12): no pipe-directory mount from this door; the NRI door mounts the container's own leaf
    assert list(resp.container_responses[0].mounts) == []
    assert resp.container_responses[0].annotations[ANNOTATION_ALLOCATE] == "planned"
    # Recorded under the device IDs, holder not named (Allocate does not know the pod: ADR 0007).
    (t,) = s.ledger.tenancies()
    assert (t.gpu_uuid, t.request_mib, t.limit_mib, t.mode) == (node.gpus[1].uuid, 20480, 30720, ComputeMode.SM_SHARING)
    assert (t.pod_uid, t.door, t.reservation) == ("", "allocate", f"{node.gpus[1].uuid}::0-19")
    assert env["FRACPLUGIN_RESERVATION"] == t.reservation


def test_without_annotations_limit_is_the_device_request(make, node, src):
    src.add(pod("plain", 3))
    env = env_of(make().allocate(areq(ids(node, 0, 3))))
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == env["NVIDIA_GPU_MEMORY_REQUEST"] == "3072"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_mode_annotation_alone_still_counts(make, node, src):
    src.add(pod("sm", 2, {P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": "0.5"}))
    s = make()
    env = env_of(s.allocate(areq(ids(node, 0, 2))))
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert s.ledger.mode(node.gpus[0].uuid) is ComputeMode.SM_SHARING


def test_multi_gpu_request_gets_one_entry_per_gpu(make, node, src):
    src.add(pod("wide", 80, {P + "app.gpu-memory.limit": "60Gi"}))
    env = env_of(make().allocate(areq(ids(node, 0, 40) + ids(node, 2, 40))))
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{node.gpus[0].uuid},{node.gpus[2].uuid}"
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{node.gpus[0].uuid}=61440M,{node.gpus[2].uuid}=61440M"


def test_init_container_then_app_container(make, node, src):
    src.add(pod("two", 4, init=("setup", 4)))
    s = make()
    s.allocate(areq(ids(node, 0, 4)))
    s.allocate(areq(ids(node, 0, 4)))  # kubelet hands the app the init container's devices
    # One reservation for both (the same device IDs), not two.
    assert [(t.reservation, t.request_mib) for t in s.ledger.tenancies()] == [(f"{node.gpus[0].uuid}::0-3", 4096)]


V2 = PlannerConfig(mps_namespaces=False)  # classic MPS: time-slicing pods share one pipe directory


def test_oldest_pod_served_first_then_the_next(make, node, src):
    src.add(pod("b", 2, created="2026-01-02T00:00:00Z"))
    src.add(pod("a", 2, created="2026-01-01T00:00:00Z"))
    s = make(planner_config=V2)
    s.allocate(areq(ids(node, 0, 2)))
    s.allocate(areq(ids(node, 0, 2, start=2)))
    # Two reservations; neither names a pod (NRI binds them).
    assert [(t.pod_name, t.reservation) for t in s.ledger.tenancies()] == [
        ("", f"{node.gpus[0].uuid}::0-1"), ("", f"{node.gpus[0].uuid}::2-3")]


def test_bad_annotation_is_invalid_argument_naming_pod_and_key(make, node, src):
    src.add(pod("typo", 2, {P + "app.gpu-compute.mode": "fast"}))
    s = make()
    r = refusal(s.allocate, areq(ids(node, 0, 2)))
    assert r.code == StatusCode.INVALID_ARGUMENT
    assert "default/typo" in r.message and P + "app.gpu-compute.mode" in r.message
    assert s.status()["refusals"] == 0  # counted by the grpc handler, not here


def test_limit_below_device_request_is_not_applied(make, node, src):
    """kubelet's allocation wins: a limit annotation below it is ignored (the
    NRI door raises the Warning Event), the limit is the request."""
    src.add(pod("small", 8, {P + "app.gpu-memory.limit": "4Gi"}))
    env = env_of(make().allocate(areq(ids(node, 0, 8))))
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == env["NVIDIA_GPU_MEMORY_LIMIT"] == "8192"


def test_ledger_guard_is_failed_precondition(make, node, src):
    src.add(pod("ts", 2, created="2026-01-01T00:00:00Z"))
    src.add(pod("sm", 3, {P + "app.gpu-compute.mode": "sm-sharing"}, created="2026-01-02T00:00:00Z"))
    s = make()
    s.allocate(areq(ids(node, 0, 2)))
    r = refusal(s.allocate, areq(ids(node, 0, 3, start=2)))
    assert r.code == StatusCode.FAILED_PRECONDITION and "one compute mode per GPU" in r.message


# ---- fallbacks -----------------------------------------------------------------


def test_no_api_access_answers_the_fallback(make, node):
    s = make(pod_source=None)
    resp = s.allocate(areq(ids(node, 3, 5)))
    env = env_of(resp)
    assert env["NVIDIA_VISIBLE_DEVICES"] == node.gpus[3].uuid
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == env["NVIDIA_GPU_MEMORY_LIMIT"] == "5120"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{node.gpus[3].uuid}=5120M"
    assert env["CUDA_VISIBLE_DEVICES"] == node.gpus[3].uuid  # ordinal 0 is that GPU
    # issue 12: never a daemon's pipe directory (its control socket) under MPS v3; NRI mounts the leaf
    assert len(resp.container_responses[0].mounts) == 0 and env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert resp.container_responses[0].annotations[ANNOTATION_ALLOCATE] == "fallback"
    # A fallback is recorded too (after the guards), holder unknown.
    assert [(t.pod_uid, t.gpu_uuid, t.request_mib) for t in s.ledger.tenancies()] == [("", node.gpus[3].uuid, 5120)]
    assert "no API access" in s.status()["last_fallback"]


def test_two_pods_with_different_settings_get_only_the_common_answer(make, node, src):
    src.add(pod("x", 4, {P + "app.gpu-memory.limit": "8Gi"}, created="2026-01-01T00:00:00Z"))
    src.add(pod("y", 4, {P + "app.gpu-memory.limit": "6Gi"}, created="2026-01-02T00:00:00Z"))
    s = make()
    env = env_of(s.allocate(areq(ids(node, 0, 4))))
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"  # request-sized, right for both
    assert [(t.pod_uid, t.request_mib) for t in s.ledger.tenancies()] == [("", 4096)]
    assert "different settings" in s.status()["last_fallback"]


def test_ambiguous_sm_sharing_pods_get_no_pipe_directory_mount(make, node, src):
    # same settings: one planned answer, right for both, with no namespace leaf of either (issue 12)
    for n in ("x", "y"):
        src.add(pod(n, 4, {P + "app.gpu-compute.mode": "sm-sharing"}))
    resp = make().allocate(areq(ids(node, 0, 4)))
    assert len(resp.container_responses[0].mounts) == 0
    assert resp.container_responses[0].annotations["fracplugin.io/allocate"] == "planned"


def test_v2_allocate_mounts_the_shared_directory_read_only(make, node, src):
    src.add(pod("x", 4))
    resp = make(planner_config=PlannerConfig(mps_namespaces=False)).allocate(areq(ids(node, 0, 4)))
    (m,) = resp.container_responses[0].mounts
    assert m.host_path.endswith("/ts") and m.read_only


def test_two_pods_with_identical_settings_take_the_oldest(make, node, src):
    src.add(pod("late", 4, created="2026-01-02T00:00:00Z"))
    src.add(pod("early", 4, created="2026-01-01T00:00:00Z"))
    s = make()
    assert env_of(s.allocate(areq(ids(node, 0, 4))))["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"
    assert [t.pod_name for t in s.ledger.tenancies()] == [""]  # right for both; no guess recorded


def test_missing_pod_falls_back_after_the_deadline(make, node, src):
    s = make(allocate_deadline_s=0.2)
    env = env_of(s.allocate(areq(ids(node, 0, 1))))
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "1024"
    assert "within 0.2 s" in s.status()["last_fallback"]


def test_pod_arriving_while_allocate_waits_is_found(make, node, src):
    s = make(allocate_deadline_s=30.0)
    answers: list[object] = []
    call = threading.Thread(target=lambda: answers.append(s.allocate(areq(ids(node, 0, 6)))))
    call.start()
    # The pod arrives once Allocate has looked, found nothing and waits on the
    # pod source (a timer could add it before Allocate even looked).
    wait_until(lambda: len(src._store._cond._waiters) == 1, what="Allocate to wait for its pod")  # type: ignore[attr-defined]
    src.add(pod("late-watch", 6, {P + "app.gpu-memory.limit": "7Gi"}))
    call.join(10)
    assert not call.is_alive() and len(answers) == 1
    assert env_of(answers[0])["NVIDIA_GPU_MEMORY_LIMIT"] == "7168"


def test_api_down_falls_back_at_once(make, node, src):
    src.set_ready(False)
    s = make(allocate_deadline_s=30.0)
    env = env_of(s.allocate(areq(ids(node, 0, 1))))
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "1024"
    assert "not ready" in s.status()["last_fallback"]


def test_deleted_pod_releases_allocate_door_tenancies(make, node, src):
    p = pod("gone", 2)
    src.add(p)
    s = make()
    s.allocate(areq(ids(node, 0, 2)))
    assert s.ledger.tenancies()
    src.delete(p)  # the only pod the reservation could be for is gone: kubelet frees it
    assert s.ledger.tenancies() == []


def test_device_specs_and_cdi_devices_when_configured(make, node, src):
    src.add(pod("dev", 1))
    resp = make(device_specs=True, cdi_kind="nvidia.com/gpu").allocate(areq(ids(node, 2, 1)))
    c = resp.container_responses[0]
    assert [d.container_path for d in c.devices] == ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert all(d.permissions == "rw" for d in c.devices)
    assert [d.name for d in c.cdi_devices] == [f"nvidia.com/gpu={node.gpus[2].uuid}"]


# ---- GetPreferredAllocation --------------------------------------------------------


def preq(available, must, size):
    return pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
        ]
    )


def test_preferred_follows_the_pending_pods_mode(make, node, src):
    s = make()
    # GPU 0 holds a time-slicing tenant, GPU 2 an sm-sharing one.
    src.add(pod("ts", 1, created="2026-01-01T00:00:00Z"))
    src.add(pod("sm", 2, {P + "app.gpu-compute.mode": "sm-sharing"}, created="2026-01-01T00:00:01Z"))
    s.allocate(areq(ids(node, 0, 1)))
    s.allocate(areq(ids(node, 2, 2)))
    src.add(pod("new-sm", 5, {P + "app.gpu-compute.mode": "sm-sharing"}, created="2026-01-03T00:00:00Z"))
    avail = [d for d in list(s.table.lookup) if d not in ids(node, 0, 1) + ids(node, 2, 2)]
    got = list(s.preferred(preq(avail, [], 5)).container_responses[0].deviceIDs)
    assert {parse_device_id(d)[0] for d in got} == {node.gpus[2].uuid}


def test_preferred_refuses_negative_size(make):
    s = make()
    r = refusal(s.preferred, preq([], [], -1))
    assert r.code == StatusCode.INVALID_ARGUMENT


# ---- restart recovery ---------------------------------------------------------------


class FakePodResourcesClient:
    def __init__(self, pods):
        self.pods = pods

    def list(self):
        return self.pods


def test_rebuild_from_podresources_plans_known_pods_and_keeps_unknown_ones(make, node, src):
    src.add(pod("known", 4, {P + "app.gpu-memory.limit": "6Gi"}))
    s = make()
    pr = FakePodResourcesClient(
        [
            PodDevices("default", "known", (ContainerDevices("app", {R: tuple(ids(node, 1, 4))}),)),
            PodDevices("other", "unknown", (ContainerDevices("c", {R: tuple(ids(node, 3, 2)), "x/y": ("1",)}),)),
            PodDevices("default", "cpu-only", (ContainerDevices("c", {}),)),
        ]
    )
    warnings = s.podresources.rebuild(pr)
    assert warnings == []
    by = {(t.pod_name, t.container): t for t in s.ledger.tenancies()}
    assert by[("known", "app")].limit_mib == 6144 and by[("known", "app")].pod_uid == "uid-known"
    assert by[("unknown", "c")].request_mib == 2048
    assert by[("unknown", "c")].pod_uid == "podresources:other/unknown"
    # Served: a new Allocate of 4 devices does not pick the running pod again.
    s2 = s.allocate(areq(ids(node, 0, 4)))
    assert env_of(s2)["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"
    assert "within" in s.status()["last_fallback"]


def test_rebuild_releases_allocate_door_entries_kubelet_no_longer_lists(make, node, src):
    src.add(pod("old", 2))
    s = make()
    s.allocate(areq(ids(node, 0, 2)))
    warnings = s.podresources.rebuild(FakePodResourcesClient([]))
    assert s.ledger.tenancies() == []
    assert "released" in warnings[0]


def test_deleted_pods_allocate_is_not_answered_with_another_pods_settings(make, node, src):
    """kubelet may still admit a pod the API already deleted (issue 10 item 2):
    while that is possible, the only pending pod's settings are not the answer
    when they differ from the deleted pod's."""
    a = pod("a", 4, {P + "app.gpu-memory.limit": "12Gi"}, created="2026-01-01T00:00:00Z")
    b = pod("b", 4, {P + "app.gpu-memory.limit": "6Gi"}, created="2026-01-02T00:00:00Z")
    src.add(a)
    src.add(b)
    s = make()
    src.delete(a)
    resp = s.allocate(areq(ids(node, 0, 4)))
    assert resp.container_responses[0].annotations[ANNOTATION_ALLOCATE] == "fallback"
    assert env_of(resp)["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"  # neither 12Gi (a) nor 6Gi (b)
    assert [(t.pod_uid, t.request_mib) for t in s.ledger.tenancies()] == [("", 4096)]
