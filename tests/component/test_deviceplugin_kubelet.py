"""The device plugin against an in-process kubelet over real unix sockets.

Cases of issue 4 item 7 (pure-Python side): registration; device count and IDs
for gpu-node-1; a 20-device request lands on one GPU; Allocate env for a pod
with a limit and sm-sharing annotations; kubelet restart -> re-registration;
an injected XID flips all fractions of one GPU in one update; a plugin restart
with running pods loses nothing. Plus the registration edge cases of
docs/reference/kubelet-device-plugin.md D.7-D.9.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import threading

import grpc
import pytest

from fake_kubelet import FakeKubelet, FakePodResources
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.kubelet.deviceplugin import DevicePluginServer
from fracplugin.kubelet.podlookup import InMemoryPodSource
from fracplugin.kubelet.devices import MAX_DEVICE_ID_LEN, parse_device_id
from fracplugin.kubelet.podresources import PodResourcesClient, PodResourcesError
from fracplugin.ledger import Ledger
from fracplugin.mps.api import NullMps
from fracplugin.planner import PlannerConfig
from tests.helpers import node_rules, wait_until

R = "fracplugin.io/gpu-memory"
WAIT = 10.0  # generous upper bound for events on a loaded 2-core CI box


def with_devices(pod: dict, count: int, container: str = "app") -> dict:
    """A seed pod as the API server shows it once bound and requesting ``count`` devices."""
    p = copy.deepcopy(pod)
    p.setdefault("metadata", {}).setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
    p["spec"]["nodeName"] = "gpu-node-1"
    for c in p["spec"]["containers"]:
        if c["name"] == container:
            c["resources"] = {"limits": {R: str(count)}, "requests": {R: str(count)}}
    p["status"] = {"phase": "Pending"}
    return p


class Rig:
    """One plugin directory with a fake kubelet, a simulated node and the plugin."""

    def __init__(self, node_file) -> None:
        self.dir = tempfile.mkdtemp(prefix="fp", dir="/tmp")
        self.plugin_dir = os.path.join(self.dir, "dp")
        os.makedirs(self.plugin_dir)
        self.kubelet = FakeKubelet(self.plugin_dir)
        self.inv = SimulatedInventory(node_file)
        self.node = self.inv.node()
        self.src = InMemoryPodSource(self.node.name)
        self.ledger_path = os.path.join(self.dir, "ledger.json")
        self.podresources: FakePodResources | None = None
        self.servers: list[DevicePluginServer] = []

    def server(self, mps_health=None, config=None, **kw) -> DevicePluginServer:
        ledger = Ledger(self.node, self.ledger_path)
        ledger.load()
        kw.setdefault("pod_source", self.src)
        kw.setdefault("podresources_socket", None)
        rules = node_rules(self.node, ledger, config, self.inv, mps_health=mps_health)
        s = DevicePluginServer(rules, plugin_dir=self.plugin_dir, allocate_deadline_s=1.0, **kw)
        self.servers.append(s)
        return s

    def close(self) -> None:
        for s in self.servers:
            s.stop(2.0)
            s.health.stop(2.0)
        self.kubelet.stop()
        if self.podresources:
            self.podresources.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def rig(node_file):
    r = Rig(node_file)
    yield r
    r.close()


@pytest.fixture
def running(rig):
    """Kubelet up, plugin started and registered with its first device list."""
    rig.kubelet.start()
    s = rig.server()
    s.start()
    assert rig.kubelet.wait_for(lambda: rig.kubelet.updates(R) >= 1, WAIT)
    return rig, s


def all_healthy(devs: dict[str, str]) -> bool:
    return bool(devs) and all(h == "Healthy" for h in devs.values())


class EventMps(NullMps):
    """The MPS port whose every daemon is up while ``up`` is set."""

    def __init__(self, up: threading.Event) -> None:
        super().__init__()
        self.up = up

    def healthy(self, mode: object) -> bool:
        return self.up.is_set()


# ---- registration and the device list ------------------------------------------


def test_registration(running):
    rig, s = running
    (reg,) = rig.kubelet.registrations
    assert reg.resource_name == R
    assert reg.endpoint == "fracplugin.sock"
    assert reg.options.get_preferred_allocation_available is True
    assert reg.options.pre_start_required is False
    assert wait_until(s.registered)
    assert rig.kubelet.options(R).get_preferred_allocation_available is True
    st = s.status()
    assert st["registered"] and st["registrations"] == 1 and st["list_and_watch_streams"] == 1


def test_device_count_and_ids_for_gpu_node_1(running):
    rig, _ = running
    devs = rig.kubelet.devices(R)
    assert len(devs) == 4 * 79  # 81559 MiB per GPU, 1 GiB per device
    assert all_healthy(devs)
    per_gpu: dict[str, list[int]] = {}
    for d in devs:
        assert len(d) <= MAX_DEVICE_ID_LEN
        uuid, n = parse_device_id(d)
        per_gpu.setdefault(uuid, []).append(n)
    assert sorted(per_gpu) == sorted(g.uuid for g in rig.node.gpus)
    assert all(sorted(v) == list(range(79)) for v in per_gpu.values())


def test_twenty_device_request_lands_on_one_gpu(running):
    rig, _ = running
    devs = list(rig.kubelet.devices(R))
    got = rig.kubelet.preferred(R, devs, [], 20)
    assert len(got) == len(set(got)) == 20
    assert len({parse_device_id(d)[0] for d in got}) == 1
    rig.src.add(with_devices({"metadata": {"name": "p20", "namespace": "default", "uid": "u20"},
                              "spec": {"containers": [{"name": "app"}]}}, 20))
    resp = rig.kubelet.allocate(R, got)
    env = dict(resp.container_responses[0].envs)
    assert env["NVIDIA_VISIBLE_DEVICES"] == parse_device_id(got[0])[0]
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "20480"


def test_allocate_env_for_limit_and_sm_sharing(running, seed_pods):
    rig, s = running
    pod = with_devices(seed_pods["inference-sm-sharing-4gpu.bound"], 160)  # 40 GiB on each of 4 GPUs
    rig.src.add(pod)
    got = rig.kubelet.preferred(R, list(rig.kubelet.devices(R)), [], 160)
    per = {}
    for d in got:
        per[parse_device_id(d)[0]] = per.get(parse_device_id(d)[0], 0) + 1
    assert sorted(per.values()) == [40, 40, 40, 40]
    resp = rig.kubelet.allocate(R, got)
    c = resp.container_responses[0]
    env = dict(c.envs)
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in rig.node.gpus)
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960"
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "61440"  # 60Gi
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == ",".join(f"{g.uuid}=61440M" for g in rig.node.gpus)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    # MPS v3 (issue 12): no pipe-directory mount from this door; the NRI door mounts the container's own leaf
    assert list(c.mounts) == []
    # Recorded under kubelet's device IDs; the holder is bound later, from evidence (ADR 0007).
    assert len(s.ledger.reservation(c.envs["FRACPLUGIN_RESERVATION"])) == 4
    assert c.annotations["fracplugin.io/reservation"] == c.envs["FRACPLUGIN_RESERVATION"]


def test_bad_allocate_is_a_grpc_error_and_the_plugin_keeps_serving(running):
    rig, s = running
    with pytest.raises(grpc.RpcError) as e:
        rig.kubelet.allocate(R, ["GPU-not-here::3"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-not-here::3" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        rig.kubelet.allocate(R, [])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        rig.kubelet.allocate(R, ["a::1"], ["b::2"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert s.status()["refusals"] == 3
    # Still serving, still registered.
    assert rig.kubelet.options(R).get_preferred_allocation_available
    assert wait_until(s.registered)


# ---- kubelet restarts ---------------------------------------------------------


def test_kubelet_restart_leads_to_reregistration(running):
    rig, s = running
    rig.kubelet.restart()  # our socket is wiped, kubelet.sock re-created, streams dropped
    assert rig.kubelet.wait_for(lambda: len(rig.kubelet.registrations) >= 2 and rig.kubelet.updates(R) >= 1, WAIT)
    assert rig.kubelet.registrations[-1].at >= rig.kubelet.restarted_at
    assert os.path.exists(s.socket_path)
    assert len(rig.kubelet.devices(R)) == 316
    assert wait_until(lambda: s.registrar.stats.count == 2)
    assert s.status()["last_registration_trigger"] in ("kubelet.sock re-created", "own socket deleted")


def test_kubelet_down_then_up_registers_when_the_socket_appears(rig):
    s = rig.server()
    s.start()
    assert not s.registered()
    rig.kubelet.start()
    assert rig.kubelet.wait_for(lambda: rig.kubelet.updates(R) >= 1, WAIT)
    assert wait_until(s.registered)


def test_register_refused_is_retried(rig):
    rig.kubelet.refuse = "kubelet is busy"
    rig.kubelet.start()
    s = rig.server()
    s.start()
    wait_until(lambda: "kubelet is busy" in (s.status()["last_registration_error"] or ""),
               what="the refusal to reach the plugin")
    assert not s.registered()
    rig.kubelet.refuse = None
    assert rig.kubelet.wait_for(lambda: rig.kubelet.updates(R) >= 1, WAIT)
    assert wait_until(s.registered)


def test_own_socket_deleted_is_served_again_and_reregistered(running):
    rig, s = running
    os.unlink(s.socket_path)
    assert rig.kubelet.wait_for(lambda: len(rig.kubelet.registrations) >= 2, WAIT)
    assert rig.kubelet.wait_for(lambda: rig.kubelet.stream_open(R) and rig.kubelet.updates(R) >= 1, WAIT)
    assert os.path.exists(s.socket_path)
    assert rig.kubelet.options(R).get_preferred_allocation_available


def test_stream_dropped_by_kubelet_leads_to_reregistration(running):
    rig, s = running
    rig.kubelet.drop_stream(R)
    assert rig.kubelet.wait_for(lambda: len(rig.kubelet.registrations) >= 2, WAIT)
    assert wait_until(lambda: s.registrar.stats.count == 2)
    assert s.status()["last_registration_trigger"] == "ListAndWatch closed"
    # The dropped stream freed its worker: one stream open, the new one.
    assert rig.kubelet.wait_for(lambda: rig.kubelet.stream_open(R), WAIT)
    assert wait_until(lambda: s.devices.active_streams() == 1)


def test_stop_ends_the_stream_first_and_removes_the_socket(running):
    rig, s = running
    s.stop(3.0)
    assert rig.kubelet.wait_for(lambda: not rig.kubelet.stream_open(R), WAIT)
    assert not os.path.exists(s.socket_path)
    assert not s.registered()
    assert s.devices.active_streams() == 0


# ---- health -------------------------------------------------------------------


def test_injected_xid_flips_all_fractions_of_one_gpu_in_one_update(running):
    rig, s = running
    sick = rig.node.gpus[1].uuid
    rig.inv.inject_xid(sick, 79)
    assert rig.kubelet.wait_for(lambda: any(h == "Unhealthy" for h in rig.kubelet.devices(R).values()), WAIT)
    for snapshot in rig.kubelet.history(R):
        unhealthy = {d for d, h in snapshot.items() if h == "Unhealthy"}
        assert unhealthy in (set(), {d for d in snapshot if d.startswith(sick + "::")}), "no partial flip"
    devs = rig.kubelet.devices(R)
    assert sum(1 for d, h in devs.items() if h == "Unhealthy") == 79
    assert all(h == "Healthy" for d, h in devs.items() if not d.startswith(sick))
    # Recovery: an operator clear puts the GPU back in one update.
    assert s.health.clear(sick)
    assert rig.kubelet.wait_for(lambda: all_healthy(rig.kubelet.devices(R)), WAIT)


def test_ignored_xid_changes_nothing(running):
    rig, s = running
    rig.inv.inject_xid(rig.node.gpus[0].uuid, 13)
    assert wait_until(lambda: s.health.events_seen >= 1)
    assert all_healthy(rig.kubelet.devices(R))
    assert rig.kubelet.updates(R) == 1


def test_mps_down_makes_every_gpu_unhealthy_until_it_is_back(rig):
    up = threading.Event()
    up.set()
    rig.kubelet.start()
    s = rig.server(mps_health=EventMps(up))
    s.start()
    assert rig.kubelet.wait_for(lambda: all_healthy(rig.kubelet.devices(R)), WAIT)
    up.clear()
    assert rig.kubelet.wait_for(
        lambda: rig.kubelet.devices(R) and all(h == "Unhealthy" for h in rig.kubelet.devices(R).values()), WAIT
    )
    up.set()
    assert rig.kubelet.wait_for(lambda: all_healthy(rig.kubelet.devices(R)), WAIT)


# ---- plugin restart with running pods -------------------------------------------------


def _allocate_two_pods(rig, seed_pods) -> list[tuple[dict, list[str]]]:
    inf = with_devices(seed_pods["inference-sm-sharing-4gpu.bound"], 160)
    small = with_devices(
        {
            "metadata": {
                "name": "small",
                "namespace": "team",
                "uid": "uid-small",
                "creationTimestamp": "2026-01-02T00:00:00Z",
                "annotations": {"nvidia.com/container.main.gpu-compute.mode": "sm-sharing",
                                "nvidia.com/container.main.gpu-memory.limit": "30Gi"},
            },
            "spec": {"containers": [{"name": "main"}]},
        },
        20,
        container="main",
    )
    out = []
    for p in (inf, small):
        rig.src.add(p)
        avail = [d for d in rig.kubelet.devices(R) if not any(d in ids for _, ids in out)]
        size = int(p["spec"]["containers"][0]["resources"]["limits"][R])
        ids = rig.kubelet.preferred(R, avail, [], size)
        rig.kubelet.allocate(R, ids)
        out.append((p, ids))
    return out


def _tenancy_set(ledger):
    return {(t.reservation, t.gpu_uuid, t.request_mib, t.limit_mib, t.mode) for t in ledger.tenancies()}


@pytest.mark.parametrize("ledger_file_survives", [True, False])
def test_plugin_restart_with_running_pods_loses_nothing(running, seed_pods, ledger_file_survives):
    rig, s = running
    allocated = _allocate_two_pods(rig, seed_pods)
    before = _tenancy_set(s.ledger)
    assert len(before) == 5
    devices_before = rig.kubelet.devices(R)
    # kubelet's view of who holds what, for PodResources.
    rig.podresources = FakePodResources(os.path.join(rig.dir, "pr", "kubelet.sock")).start()
    for p, ids in allocated:
        md = p["metadata"]
        rig.podresources.pods[(md["namespace"], md["name"])] = {p["spec"]["containers"][0]["name"]: {R: ids}}
    # The pods now run: their containers have ids.
    for p, _ in allocated:
        p = copy.deepcopy(p)
        p["status"] = {"phase": "Running",
                       "containerStatuses": [{"name": p["spec"]["containers"][0]["name"], "containerID": "containerd://x"}]}
        rig.src.add(p)

    s.stop(3.0)
    assert rig.kubelet.wait_for(lambda: not rig.kubelet.stream_open(R), WAIT)
    if not ledger_file_survives:
        os.unlink(rig.ledger_path)

    s2 = rig.server(podresources_socket=rig.podresources.socket_path)
    s2.start()
    assert rig.kubelet.wait_for(lambda: rig.kubelet.stream_open(R) and len(rig.kubelet.registrations) >= 2, WAIT)
    assert rig.kubelet.wait_for(lambda: rig.kubelet.devices(R) == devices_before, WAIT)
    assert _tenancy_set(s2.ledger) == before
    # PodResources names the holders the Allocates could not know.
    assert {(t.pod_uid, t.container) for t in s2.ledger.tenancies()} == {
        (p["metadata"]["uid"], p["spec"]["containers"][0]["name"]) for p, _ in allocated}
    assert s2.status()["startup_warnings"] == []


# ---- PodResources client ---------------------------------------------------------------


@pytest.fixture
def podresources(rig):
    rig.podresources = FakePodResources(os.path.join(rig.dir, "pr", "kubelet.sock")).start()
    rig.podresources.pods[("ns", "p")] = {"app": {R: ["GPU-a::1", "GPU-a::2"], "other/res": ["x"]}, "side": {}}
    return rig.podresources


def test_podresources_list(podresources):
    c = PodResourcesClient(podresources.socket_path)
    try:
        (p,) = c.list()
        assert (p.namespace, p.name) == ("ns", "p")
        assert {x.name: dict(x.devices) for x in p.containers} == {
            "app": {R: ("GPU-a::1", "GPU-a::2"), "other/res": ("x",)}, "side": {}}
    finally:
        c.close()


def test_podresources_unreachable_is_a_clear_error(rig):
    c = PodResourcesClient(os.path.join(rig.dir, "absent.sock"), timeout_s=0.5)
    with pytest.raises(PodResourcesError, match="absent.sock"):
        c.list()
    c.close()
