"""The door's gRPC clients (PodResources, Registration) against a broken
kubelet: a server that answers too much, answers bytes that are not HTTP/2,
closes at once, or never answers. Black-box (ADR 0021: grpcio clients with
the options of ``kubelet.grpcopts``): each call ends with a clear error
within its own deadline, and the client works again once the server does."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin.kubelet import grpcopts
from fracplugin.kubelet.podresources import PodResourcesClient, PodResourcesError
from fracplugin.kubelet.registration import RegistrationError, register
from tests.peers.kubelet import FakePodResources
from tests.helpers import node_rules


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
def test_podresources_on_a_broken_server_fails_clearly_then_recovers(sockdir, behaviour, codes):
    path = os.path.join(sockdir, "kubelet.sock")
    srv = RawServer(path, behaviour)
    client = PodResourcesClient(path, timeout_s=0.5)
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


def test_podresources_reply_over_the_size_limit_is_refused(sockdir):
    """A reply over 4 MiB is RESOURCE_EXHAUSTED naming both sizes (the
    grpclib client had read any size into memory); the next, smaller one is
    read."""
    path = os.path.join(sockdir, "kubelet.sock")
    good = FakePodResources(path).start()
    client = PodResourcesClient(path, timeout_s=30.0)  # 30 s: only bounds a call that would never end
    try:
        good.pods[("ns", "big")] = {"c": {"r": ["x" * 1000] * (5 * 1024)}}  # ~5 MiB
        with pytest.raises(PodResourcesError) as e:
            client.list()
        assert "RESOURCE_EXHAUSTED" in str(e.value) and f"vs. {grpcopts.MAX_MESSAGE_BYTES}" in str(e.value)
        del good.pods[("ns", "big")]
        good.pods[("ns", "small")] = {"c": {"r": ["a"]}}
        assert [p.name for p in client.list()] == ["small"]
    finally:
        client.close()
        good.stop()


@pytest.mark.parametrize("behaviour", ["silent", "close", "garbage"])
def test_register_on_a_broken_kubelet_socket_fails_within_its_deadline(sockdir, behaviour):
    path = os.path.join(sockdir, "kubelet.sock")
    srv = RawServer(path, behaviour)
    try:
        with pytest.raises(RegistrationError) as e:
            register(path, "fracplugin.sock", "fracplugin.io/gpu-memory", pb.DevicePluginOptions(), timeout_s=0.5)
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
    from fracplugin.kubelet.deviceplugin import DevicePluginServer
    from fracplugin.ledger import Ledger
    from fracplugin.planner import PlannerConfig
    from tests.helpers import wait_until

    srv = RawServer(os.path.join(sockdir, "kubelet.sock"), "silent")
    inv = SimulatedInventory(node_file)
    node = inv.node()
    s = DevicePluginServer(node_rules(node), plugin_dir=sockdir, podresources_socket=None)
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
    from fracplugin.kubelet.deviceplugin import DevicePluginServer
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
    s = DevicePluginServer(node_rules(node), plugin_dir=sockdir, podresources_socket=pr,
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


def test_a_reply_that_never_comes_after_its_headers_ends_at_the_deadline(sockdir):
    """The server sends its response headers and then nothing: the call still
    ends at its deadline, DEADLINE_EXCEEDED, and the client works again once
    the server answers."""
    from concurrent import futures

    import grpc

    from fracplugin._proto import podresources_pb2 as prpb
    from fracplugin._proto import podresources_pb2_grpc as prpb_grpc

    release = threading.Event()
    answered: list[bool] = []

    class Hanging(prpb_grpc.PodResourcesListerServicer):
        def List(self, request, context):  # noqa: N802
            if not answered:  # the first call: headers, then nothing until released
                answered.append(False)
                context.send_initial_metadata(())
                release.wait()
            return prpb.ListPodResourcesResponse()

    path = os.path.join(sockdir, "pr.sock")
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    prpb_grpc.add_PodResourcesListerServicer_to_server(Hanging(), srv)
    assert srv.add_insecure_port("unix:" + path)
    srv.start()
    client = PodResourcesClient(path, timeout_s=0.3)
    try:
        with pytest.raises(PodResourcesError) as e:
            client.list()
        assert "failed: DEADLINE_EXCEEDED:" in str(e.value)
        release.set()
        assert client.list() == []
    finally:
        release.set()
        client.close()
        srv.stop(grace=0).wait(5)
