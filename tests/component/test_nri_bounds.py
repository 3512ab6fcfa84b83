"""Issue 13 item 5: what a runtime can make the NRI stub hold is bounded, over
real unix sockets (the fake runtime, or a hand-driven runtime end).

- Synchronize parts with ``more = true``: at most ``MAX_SYNC_PARTS`` parts and
  ``MAX_SYNC_BYTES`` bytes are held; past either the Synchronize is answered
  RESOURCE_EXHAUSTED naming the bound, the parts are dropped and the bound is
  counted; the next Synchronize works;
- answers the runtime never reads: past ``MAX_UNANSWERED`` the connection is
  closed and counted (the stub reconnects), also when the stub serves the
  calls on its reader thread (its answers never block it);
- a CreateContainer with an empty container id is refused INVALID_ARGUMENT
  (the handler never sees it: nothing could release it);
- readiness is per runtime session: a reconnection that never synchronized is
  connected but not ready.
"""

from __future__ import annotations

import socket
import threading

import pytest


from tests.helpers import scaled, wait_for

from fracplugin._proto import nri_pb2
from fracplugin.nri import dispatch
from fracplugin.nri.dispatch import MAX_SYNC_PARTS, MAX_UNANSWERED, PLUGIN_SERVICE
from fracplugin.nri.stub import NriStub

from nri_runtime import Code, FakeNriRuntime, make_container, make_pod
from tests.peers.nri_runtime import PeerConnection


class Plugin:
    """A handler that records what reaches it and answers CreateContainer with
    an adjustment of about ``answer_bytes`` bytes."""

    def __init__(self, answer_bytes: int = 0) -> None:
        self.synced: list[tuple[int, int]] = []
        self.created: list[str] = []
        self.answer_bytes = answer_bytes

    def synchronize(self, pods, containers, ctx):
        self.synced.append((len(pods), len(containers)))
        return []

    def create_container(self, pod, container, ctx):
        self.created.append(container.id)
        adj = nri_pb2.ContainerAdjustment()
        if self.answer_bytes:
            adj.env.add(key="PADDING", value="x" * self.answer_bytes)
        return adj




def _stub(handler, path, cleanup, **kw) -> NriStub:
    stub = NriStub(handler, socket_path=path, env={}, reconnect_initial_s=0.02, reconnect_max_s=0.2, **kw)
    cleanup(stub)
    return stub.start()


def _sync_part(n_pods: int, more: bool, pad: int = 0) -> bytes:
    pods = [make_pod(f"p{i}", annotations={"pad": "y" * pad} if pad else None) for i in range(n_pods)]
    return nri_pb2.SynchronizeRequest(pods=pods, more=more).SerializeToString()


def test_synchronize_parts_beyond_the_bound_are_refused_counted_and_dropped(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath, initial_sync=None)
    cleanup(rt)
    hits: list[str] = []
    plugin = Plugin()
    stub = _stub(plugin, sockpath, cleanup, on_bound=hits.append)
    rt.wait_registered()
    for _ in range(MAX_SYNC_PARTS):  # the default bound: every part up to it is held
        resp = rt.call_raw(PLUGIN_SERVICE, "Synchronize", _sync_part(1, more=True))
        assert resp.ok and nri_pb2.SynchronizeResponse.FromString(resp.payload).more
    resp = rt.call_raw(PLUGIN_SERVICE, "Synchronize", _sync_part(1, more=True))
    assert resp.code == Code.RESOURCE_EXHAUSTED
    assert f"{MAX_SYNC_PARTS + 1} parts" in resp.message and f"bound of {MAX_SYNC_PARTS} parts" in resp.message
    assert hits == ["sync_parts"] and stub.bounds_exceeded["sync_parts"] == 1
    assert plugin.synced == [] and not stub.ready()
    # the held parts were dropped: a fresh Synchronize sees only its own pods
    assert rt.synchronize([make_pod("a"), make_pod("b")], [], parts=2) == []
    assert plugin.synced == [(2, 0)] and stub.ready()
    assert stub.status()["bounds_exceeded"] == {"sync_parts": 1, "sync_bytes": 0, "unanswered": 0}


def test_synchronize_bytes_beyond_the_bound_are_refused(sockpath, cleanup, monkeypatch):
    rt = FakeNriRuntime(sockpath, initial_sync=None)
    cleanup(rt)
    hits: list[str] = []
    plugin = Plugin()
    monkeypatch.setattr(dispatch, "MAX_SYNC_BYTES", 100_000)
    stub = _stub(plugin, sockpath, cleanup, on_bound=hits.append)
    rt.wait_registered()
    codes = []
    for _ in range(5):  # 5 parts of ~30 kB: the fourth crosses 100 kB
        codes.append(rt.call_raw(PLUGIN_SERVICE, "Synchronize", _sync_part(1, more=True, pad=30_000)))
    assert [r.code for r in codes] == [Code.OK, Code.OK, Code.OK, Code.RESOURCE_EXHAUSTED, Code.OK]
    assert "bound of 64 parts / 100000 bytes" in codes[3].message
    assert hits == ["sync_bytes"] and plugin.synced == []


def test_empty_container_id_is_refused_before_the_handler(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath)
    cleanup(rt)
    plugin = Plugin()
    _stub(plugin, sockpath, cleanup)
    rt.wait_registered()
    pod = make_pod("web", "prod")
    ctr = make_container(pod, "app\nFORGED")
    ctr.id = ""
    err = rt.create_container(pod, ctr)
    assert err.code == Code.INVALID_ARGUMENT
    assert "empty container id" in err.message and '"app\\nFORGED"' in err.message and "\n" not in err.message
    assert plugin.created == []
    adj = rt.create_container(pod, make_container(pod, "app", container_id="c1"))  # a real id is served
    assert isinstance(adj, nri_pb2.ContainerAdjustment) and plugin.created == ["c1"]


def test_readiness_is_per_runtime_session(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath, initial_sync=([], []))
    cleanup(rt)
    stub = _stub(Plugin(), sockpath, cleanup)
    rt.wait_registered()
    wait_for(stub.ready, what="first session synchronized")
    rt.initial_sync = None  # the next connection registers and is configured, never synchronized
    rt.disconnect()
    # the second session complete on both ends: the runtime's own registration
    # (RegisterPlugin answered, Configure returned) and the stub's view; only
    # then may the runtime synchronize it
    wait_for(lambda: len(rt.registrations) >= 2 and rt.plugin is not None and stub.connected(),
             what="reconnection")
    assert stub.connected() and not stub.ready() and stub.ever_synchronized()
    rt.synchronize([], [])
    assert stub.ready()


class SilentRuntime:
    """A runtime end that answers RegisterPlugin, then never reads again (its
    reader thread is parked inside ``on_request``), and sends requests."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.park = threading.Event()
        self.transport: PeerConnection | None = None
        self.accepted = threading.Event()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.transport is not None:  # later connections: registered and left alone
                sock.close()
                continue
            t = PeerConnection(sock, on_request=self._on_request, on_closed=lambda conn, reason: None,
                               max_read_frame=None, label="silent-runtime")
            self.transport = t
            t.start()

    def _on_request(self, conn, stream_id, req) -> None:
        conn.respond(stream_id, b"")
        if req.method == "RegisterPlugin":
            self.accepted.set()
            self.park.wait()  # never read another byte

    def close(self) -> None:
        self.park.set()
        self.listener.close()
        if self.transport is not None:
            self.transport.close("test over")


class InlinePlugin(Plugin):
    """Nothing of it waits: the stub serves it on its reader thread, which
    must still never block on a runtime that does not read."""

    def may_block(self, method):
        return False


@pytest.mark.parametrize("plugin_cls", [Plugin, InlinePlugin])
def test_answers_the_runtime_never_reads_are_bounded(plugin_cls, sockpath, cleanup):
    rt = SilentRuntime(sockpath)
    cleanup(rt)
    hits: list[str] = []
    plugin = plugin_cls(answer_bytes=4096)
    stub = _stub(plugin, sockpath, cleanup, on_bound=hits.append)
    assert rt.accepted.wait(scaled(10))
    assert rt.transport is not None
    pod = make_pod("web")
    for i in range(MAX_UNANSWERED + 200):
        req = nri_pb2.CreateContainerRequest(pod=pod, container=make_container(pod, "app", container_id=f"c{i}"))
        try:
            rt.transport.call_async(PLUGIN_SERVICE, "CreateContainer", req.SerializeToString())
        except ConnectionError:
            break  # the plugin closed the connection
        if stub.bounds_exceeded["unanswered"]:
            break
    wait_for(lambda: hits == ["unanswered"], what="the unanswered bound")
    assert stub.bounds_exceeded["unanswered"] == 1
    wait_for(lambda: rt.connections >= 2, what="the stub reconnecting")
