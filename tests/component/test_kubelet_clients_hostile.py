"""The door's gRPC clients (PodResources, Registration) against a broken
kubelet (review of the grpclib transport, ADR 0018): a server that answers
too much, answers bytes that are not HTTP/2, closes at once, or never
answers. Each call ends with a clear error within its own deadline, and the
client works again once the server does."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin.kubelet import grpcwire
from fracplugin.kubelet.aio import LoopThread
from fracplugin.kubelet.podresources import PodResourcesClient, PodResourcesError
from fracplugin.kubelet.registration import RegistrationError, register
from tests.peers.kubelet import FakePodResources


@pytest.fixture
def loop():
    lt = LoopThread("test-grpc", workers=1).start()
    yield lt
    lt.stop()


class RawServer:
    """A unix socket server that does ``behaviour`` with each connection:
    ``garbage`` (writes bytes that are not HTTP/2), ``close`` (closes at
    once) or ``silent`` (reads and never answers)."""

    def __init__(self, path: str, behaviour: str) -> None:
        self.path = path
        self.behaviour = behaviour
        self.accepted = 0
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(16)
        self.conns: list[socket.socket] = []
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.behaviour == "garbage":
                try:
                    c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" + os.urandom(256))
                except OSError:
                    pass
                c.close()
            elif self.behaviour == "close":
                c.close()
            else:
                self.conns.append(c)

    def close(self) -> None:
        self.done.set()
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("behaviour,codes", [
    ("garbage", ("UNAVAILABLE", "INTERNAL")),
    ("close", ("UNAVAILABLE",)),
    ("silent", ("DEADLINE_EXCEEDED",)),
])
def test_podresources_on_a_broken_server_fails_clearly_then_recovers(sockdir, loop, behaviour, codes):
    path = os.path.join(sockdir, "kubelet.sock")
    srv = RawServer(path, behaviour)
    client = PodResourcesClient(path, timeout_s=0.5, loop=loop)
    try:
        with pytest.raises(PodResourcesError) as e:
            client.list()
        assert path in str(e.value)
        assert any(f"failed: {c}:" in str(e.value) for c in codes), str(e.value)
        assert srv.accepted >= 1
        # kubelet comes back on the same path: the next call dials anew.
        srv.close()
        os.unlink(path)
        good = FakePodResources(path).start()
        try:
            good.pods[("ns", "p")] = {"c": {"r": ["a"]}}
            assert [p.name for p in client.list()] == ["p"]
        finally:
            good.stop()
    finally:
        srv.close()
        client.close()


def test_podresources_reply_over_the_size_limit_is_refused(sockdir, loop):
    """grpcio's client refused a reply over 4 MiB (RESOURCE_EXHAUSTED); the
    grpclib one read any size into memory."""
    path = os.path.join(sockdir, "kubelet.sock")
    good = FakePodResources(path).start()
    client = PodResourcesClient(path, timeout_s=5.0, loop=loop)
    try:
        good.pods[("ns", "big")] = {"c": {"r": ["x" * 1000] * (5 * 1024)}}  # ~5 MiB
        with pytest.raises(PodResourcesError) as e:
            client.list()
        assert "RESOURCE_EXHAUSTED" in str(e.value) and f"vs. {grpcwire.MAX_MESSAGE_BYTES}" in str(e.value)
        del good.pods[("ns", "big")]
        good.pods[("ns", "small")] = {"c": {"r": ["a"]}}
        assert [p.name for p in client.list()] == ["small"]
    finally:
        client.close()
        good.stop()


@pytest.mark.parametrize("behaviour", ["silent", "close", "garbage"])
def test_register_on_a_broken_kubelet_socket_fails_within_its_deadline(sockdir, loop, behaviour):
    path = os.path.join(sockdir, "kubelet.sock")
    srv = RawServer(path, behaviour)
    try:
        with pytest.raises(RegistrationError) as e:
            register(path, "fracplugin.sock", "fracplugin.io/gpu-memory", pb.DevicePluginOptions(), timeout_s=0.5,
                     loop=loop)
        assert path in str(e.value)
        if behaviour == "silent":
            assert "DEADLINE_EXCEEDED" in str(e.value) or "no answer within" in str(e.value)
    finally:
        srv.close()


def test_stop_abandons_a_register_that_kubelet_never_answers(sockdir, node_file):
    """kubelet.sock accepts and never answers Register: stopping the door
    cancels the call instead of waiting for its deadline (60 s here), so the
    daemon's shutdown budget is not spent on a wedged kubelet."""
    from fracplugin.gpu.simulated import SimulatedInventory
    from fracplugin.kubelet import DevicePluginServer
    from fracplugin.ledger import Ledger
    from fracplugin.planner import PlannerConfig
    from tests.helpers import wait_until

    srv = RawServer(os.path.join(sockdir, "kubelet.sock"), "silent")
    inv = SimulatedInventory(node_file)
    node = inv.node()
    s = DevicePluginServer(node, Ledger(node), PlannerConfig(), inv, plugin_dir=sockdir, podresources_socket=None)
    s.registrar.register_timeout_s = 60.0
    try:
        s.start()
        wait_until(lambda: srv.accepted >= 1, what="the Register call to reach kubelet.sock")
        t = s.registrar._thread
        assert t is not None and t.is_alive()
        s.registrar.stop(5.0)  # bounds the test only: the call is cancelled at once
        assert not t.is_alive(), "the registrar still waits for a Register kubelet never answers"
        assert not s.registered()
    finally:
        s.stop(2.0)
        srv.close()


def test_reconcile_against_a_podresources_that_refuses_list_leaks_no_connection(sockdir, node_file, caplog):
    """A PodResources server that answers List UNIMPLEMENTED (no real kubelet
    does; a broken one or a stand-in may) makes every reconcile round fail;
    each round must close its connection, not leave it open (one more file
    descriptor every ``podresources_interval_s`` until the daemon hits its
    limit)."""
    import logging

    import grpc

    from fracplugin.gpu.simulated import SimulatedInventory
    from fracplugin.kubelet import DevicePluginServer
    from fracplugin.ledger import Ledger
    from fracplugin.planner import PlannerConfig
    from tests.helpers import wait_until

    class Refusing(FakePodResources):
        def List(self, request, context):  # noqa: N802
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "List is switched off here")

    pr = os.path.join(sockdir, "pr.sock")
    good = Refusing(pr).start()
    inv = SimulatedInventory(node_file)
    node = inv.node()
    s = DevicePluginServer(node, Ledger(node), PlannerConfig(), inv, plugin_dir=sockdir, podresources_socket=pr,
                           podresources_interval_s=0.01)
    caplog.set_level(logging.WARNING, logger="fracplugin.kubelet.deviceplugin")

    def rounds() -> int:
        return sum("PodResources reconcile skipped" in r.getMessage() for r in caplog.records)

    try:
        s.start()
        wait_until(lambda: rounds() >= 5)
        fds = len(os.listdir("/proc/self/fd"))
        n = rounds()
        wait_until(lambda: rounds() >= n + 40)
        assert "UNIMPLEMENTED" in caplog.text
        assert len(os.listdir("/proc/self/fd")) - fds < 20, "every failed reconcile round left its connection open"
    finally:
        s.stop(2.0)
        good.stop()


def test_a_reply_that_never_comes_after_its_headers_ends_at_the_deadline(sockdir, loop):
    """The server sends its response headers and then nothing: the bounded
    read of the reply (``grpcwire.unary``) still ends at the call's deadline
    (grpclib's deadline wrapper), as DEADLINE_EXCEEDED."""
    import asyncio

    from fracplugin._proto import podresources_pb2 as prpb

    path = os.path.join(sockdir, "pr.sock")
    release = asyncio.Event()

    async def hang(stream):
        await grpcwire.recv_request(stream)
        await stream.send_initial_metadata()
        await release.wait()

    mapping = {"/v1.PodResourcesLister/List": grpcwire.handler(hang, grpcwire.UNARY_UNARY,
                                                               prpb.ListPodResourcesRequest,
                                                               prpb.ListPodResourcesResponse)}

    async def listen():
        srv = grpcwire.UnixServer(mapping)
        await srv.start(path=path)
        return srv

    srv = loop.call(listen(), 5.0)
    try:
        with pytest.raises(grpcwire.RpcError) as e:  # 30 s: only bounds a read that would never end
            loop.call(grpcwire.unary(None, path, "/v1.PodResourcesLister/List", prpb.ListPodResourcesRequest(),
                                     prpb.ListPodResourcesResponse, 0.3), 30.0)
        assert e.value.code.name == "DEADLINE_EXCEEDED"
    finally:
        async def close():
            release.set()
            srv.close()
            await srv.wait_closed()
        loop.call(close(), 5.0)
