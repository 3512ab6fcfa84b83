"""DevicePlugin service details over the real socket (docs/reference/kubelet-device-plugin.md
D.1): concurrent ListAndWatch streams, streams that end, metrics hooks,
PreStartContainer, preferred allocation with must_include, any :authority."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import grpc
import pytest

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import deviceplugin_pb2_grpc as pb_grpc
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.kubelet.deviceplugin import DevicePluginServer
from fracplugin.kubelet.podlookup import InMemoryPodSource
from fracplugin.kubelet.devices import parse_device_id
from fracplugin.ledger import Ledger
from fracplugin.planner import PlannerConfig
from tests.helpers import node_rules, scaled, wait_until

R = "fracplugin.io/gpu-memory"


class Recorder:
    def __init__(self) -> None:
        self.hooks: list[tuple[str, float]] = []
        self.refusals: list[str] = []

    def observe_hook(self, door: str, seconds: float) -> None:
        self.hooks.append((door, seconds))

    def refusal(self, code: str) -> None:
        self.refusals.append(code)


@pytest.fixture
def plugin(node_file):
    d = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    inv = SimulatedInventory(node_file)
    node = inv.node()
    metrics = Recorder()
    src = InMemoryPodSource(node.name)
    s = DevicePluginServer(node_rules(node, Ledger(node), PlannerConfig(), inv), pod_source=src, plugin_dir=d,
                           podresources_socket=None, metrics=metrics, allocate_deadline_s=0.2)
    s.start()  # no kubelet: serves, keeps trying to register in the background
    yield s, inv, metrics, src
    s.stop(2.0)
    shutil.rmtree(d, ignore_errors=True)


def channel(path: str, authority: str | None = "localhost", own_connection: bool = False) -> grpc.Channel:
    """A grpcio channel to ``path``; ``own_connection``: not shared with other
    channels to the same path (grpcio shares one connection by default)."""
    opts: list[tuple[str, str | int]] = [("grpc.default_authority", authority)] if authority else []
    if own_connection:
        opts.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.insecure_channel("unix:" + path, options=opts)


class Stream:
    """A ListAndWatch consumer on its own channel and thread."""

    def __init__(self, path: str, authority: str | None = "localhost", own_connection: bool = False) -> None:
        self.ch = channel(path, authority, own_connection)
        self.call = pb_grpc.DevicePluginStub(self.ch).ListAndWatch(pb.Empty())
        self.lists: list[dict[str, str]] = []
        self.ended = threading.Event()
        self.end_code: grpc.StatusCode | None = None
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for resp in self.call:
                with self.cond:
                    self.lists.append({d.ID: d.health for d in resp.devices})
                    self.cond.notify_all()
            self.end_code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.end_code = e.code()
        finally:
            self.ended.set()

    def wait(self, pred, timeout_s: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.lists), timeout=scaled(timeout_s))

    def close(self) -> None:
        self.call.cancel()
        self.ch.close()


def test_two_concurrent_streams_both_get_every_change_and_end_on_stop(plugin):
    s, inv, _, _ = plugin
    # Any :authority is accepted: "localhost" (kubelet >= 1.26), the socket
    # path (older kubelets, docs/reference/kubelet-device-plugin.md D.9), grpcio's default.
    a, b = Stream(s.socket_path), Stream(s.socket_path, authority=s.socket_path)
    c = Stream(s.socket_path, authority=None)
    try:
        assert all(st.wait(lambda ls: len(ls) >= 1) for st in (a, b, c))
        c.close()
        assert wait_until(lambda: s.devices.active_streams() == 2)
        inv.inject_xid(s.node.gpus[3].uuid, 48)
        for st in (a, b):
            assert st.wait(lambda ls: len(ls) >= 2)
            assert sum(h == "Unhealthy" for h in st.lists[-1].values()) == 79
        s.stop(3.0)
        assert a.ended.wait(scaled(5)) and b.ended.wait(scaled(5))
        assert (a.end_code, b.end_code) == (grpc.StatusCode.OK, grpc.StatusCode.OK)  # ended, not reset
        assert s.devices.active_streams() == 0
    finally:
        for st in (a, b, c):
            st.close()


def test_a_cancelled_stream_frees_its_worker(plugin):
    s, _, _, _ = plugin
    streams = [Stream(s.socket_path) for _ in range(3)]
    try:
        assert all(st.wait(lambda ls: len(ls) >= 1) for st in streams)
        assert wait_until(lambda: s.devices.active_streams() == 3)
        for st in streams:
            st.close()
        assert wait_until(lambda: s.devices.active_streams() == 0)
    finally:
        for st in streams:
            st.close()
    # More streams than the pool would hold if cancelled ones stayed pinned.
    more = [Stream(s.socket_path) for _ in range(s.max_workers - 2)]
    try:
        assert all(st.wait(lambda ls: len(ls) >= 1) for st in more)
        with channel(s.socket_path) as ch:
            assert pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb.Empty(), timeout=5).get_preferred_allocation_available
    finally:
        for st in more:
            st.close()


def test_metrics_hooks_and_refusal_codes(plugin):
    s, _, metrics, src = plugin
    with channel(s.socket_path) as ch:
        stub = pb_grpc.DevicePluginStub(ch)
        with pytest.raises(grpc.RpcError):
            stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x::1"])]), timeout=5)
        ids = [f"{s.node.gpus[0].uuid}::{i}" for i in range(2)]
        stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=5)
        stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=1)]
            ),
            timeout=5,
        )
    assert metrics.refusals == ["invalid"]
    assert [d for d, _ in metrics.hooks] == ["allocate", "allocate", "preferred"]
    assert all(sec >= 0 for _, sec in metrics.hooks)


def test_prestart_and_preferred_with_must_include_over_grpc(plugin):
    s, _, _, _ = plugin
    g2 = s.node.gpus[2].uuid
    with channel(s.socket_path) as ch:
        stub = pb_grpc.DevicePluginStub(ch)
        assert stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[f"{g2}::0"]), timeout=5) == pb.PreStartContainerResponse()
        resp = stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=list(s.table.lookup), must_include_deviceIDs=[f"{g2}::7"], allocation_size=4
                    )
                ]
            ),
            timeout=5,
        )
    got = list(resp.container_responses[0].deviceIDs)
    assert got[0] == f"{g2}::7" and len(set(got)) == 4
    assert {parse_device_id(d)[0] for d in got} == {g2}


def test_unregistered_plugin_reports_why(plugin):
    s, _, _, _ = plugin
    assert not s.registered()
    st = s.status()
    assert st["registered"] is False
    assert wait_until(lambda: "does not exist" in s.status()["last_registration_error"])
    assert st["devices"] == 316 and st["healthy_devices"] == 316
    assert os.path.exists(s.socket_path)


def test_refusals_reach_a_grpcio_client_with_their_code_and_message(plugin):
    """A Refusal's ``rpcstatus.StatusCode`` and message reach the client as
    grpc-status / grpc-message (grpcio here, grpc-go in kubelet)."""
    s, inv, _, _ = plugin
    with channel(s.socket_path) as ch:
        stub = pb_grpc.DevicePluginStub(ch)
        with pytest.raises(grpc.RpcError) as bad:
            stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x::1"])]),
                          timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x::1" in bad.value.details()
        g3 = s.node.gpus[3].uuid
        inv.inject_xid(g3, 79)
        assert wait_until(lambda: g3 in s.health.unhealthy())
        with pytest.raises(grpc.RpcError) as sick:
            stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[f"{g3}::0"])]), timeout=5)
        assert sick.value.code() == grpc.StatusCode.UNAVAILABLE and "xid 79" in sick.value.details()  # may recover
        with pytest.raises(grpc.RpcError) as neg:
            stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=[f"{g3}::0"], allocation_size=-1)]),
                timeout=5)
        assert neg.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "negative" in neg.value.details()


def test_calls_over_the_worker_limit_are_refused_at_once_not_queued(plugin):
    """Each open ListAndWatch stream holds one of the door's ``max_workers``
    threads. With every worker held, another call is answered
    RESOURCE_EXHAUSTED at once (grpcio's ``maximum_concurrent_rpcs``) instead
    of waiting behind streams that may never end; once a stream ends, calls
    are served again. (Each on its own connection: one connection holds at
    most ``grpcopts.MAX_CONCURRENT_STREAMS`` streams, the rest wait there.)"""
    s, _, _, _ = plugin
    streams = [Stream(s.socket_path, own_connection=True) for _ in range(s.max_workers)]
    try:
        assert all(st.wait(lambda ls: len(ls) >= 1) for st in streams)
        assert wait_until(lambda: s.devices.active_streams() == s.max_workers)
        with channel(s.socket_path, own_connection=True) as ch:
            with pytest.raises(grpc.RpcError) as full:
                pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb.Empty(), timeout=60)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        streams[0].close()

        def served() -> bool:
            with channel(s.socket_path, own_connection=True) as ch:
                try:
                    return pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(
                        pb.Empty(), timeout=60).get_preferred_allocation_available
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    return False

        assert wait_until(served, what="a call to be served once a stream ended")
    finally:
        for st in streams:
            st.close()


def test_stop_ends_the_worker_threads_and_closes_connections(plugin):
    """After ``stop`` nothing of the door's transport runs: its worker
    threads end, and a channel that was connected sees the server go away."""
    s, _, _, _ = plugin
    with channel(s.socket_path) as ch:
        stub = pb_grpc.DevicePluginStub(ch)
        assert stub.GetDevicePluginOptions(pb.Empty(), timeout=60).get_preferred_allocation_available
        assert any(t.name.startswith("fracplugin-dp") for t in threading.enumerate())
        s.stop(3.0)
        assert wait_until(lambda: not any(t.name.startswith("fracplugin-dp") for t in threading.enumerate()),
                          what="the door's worker threads to end")
        with pytest.raises(grpc.RpcError) as gone:
            stub.GetDevicePluginOptions(pb.Empty(), timeout=2)
        assert gone.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
