"""The tests' NRI runtime (``tests/peers/nri_runtime.py``) holds a plugin to
the runtime's rules, checked here with a plugin written byte by byte (no
product code on either side): stream id rules, RegisterPlugin name and index
checks, the order RegisterPlugin answer -> Configure, the event mask check, a
mux frame above the Go reader's 4096 bytes."""

from __future__ import annotations

import socket

import pytest

from fracplugin._proto import nri_pb2
from nri_runtime import Code, FakeNriRuntime
from tests.peers import ttrpc_wire as w

RUNTIME = "nri.pkg.api.v1alpha1.Runtime"


class HandPlugin:
    """The plugin end of a socketpair, driven by hand with ``ttrpc_wire``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(10)
        self.mux = w.MuxReader()
        self.readers = {1: w.TtrpcReader(), 2: w.TtrpcReader()}
        self.inbox: list[tuple[int, w.TtrpcMessage]] = []

    def send(self, conn: int, stream: int, msg_type: int, body: bytes, max_frame: int = 4096) -> None:
        self.sock.sendall(w.mux_frames(conn, w.ttrpc_frame(stream, msg_type, body), max_frame))

    def call(self, stream: int, method: str, msg: object) -> None:
        self.send(2, stream, w.REQUEST, w.encode_request(w.Request(RUNTIME, method, msg.SerializeToString())))

    def next(self) -> tuple[int, w.TtrpcMessage]:
        """The next ttrpc message from the runtime (socket timeout 10 s: raises socket.timeout)."""
        while not self.inbox:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the runtime closed the connection")
            for conn, payload in self.mux.feed(data):
                self.inbox += [(conn, m) for m in self.readers[conn].feed(payload)]
        return self.inbox.pop(0)

    def eof(self) -> bool:
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except OSError:
            return True


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    rt = FakeNriRuntime("/nonexistent/nri.sock", listen=False, nri_version="v0.12.2")
    rt.adopt(ours)
    plugin = HandPlugin(theirs)
    yield rt, plugin
    rt.close()
    theirs.close()


def _register(plugin: HandPlugin, stream: int = 1, name: str = "hand", idx: str = "42") -> None:
    plugin.call(stream, "RegisterPlugin", nri_pb2.RegisterPluginRequest(plugin_name=name, plugin_idx=idx))


def test_register_answer_then_configure_then_ready(pair) -> None:
    rt, plugin = pair
    _register(plugin)
    conn, answer = plugin.next()
    assert (conn, answer.stream_id, answer.msg_type, answer.data) == (2, 1, w.RESPONSE, b"")  # Go's empty OK
    conn, configure = plugin.next()
    req = w.decode_request(configure.data)
    assert (conn, configure.stream_id, req.method) == (1, 1, "Configure")
    assert req.timeout_nano == 2_000_000_000
    conf = nri_pb2.ConfigureRequest.FromString(req.payload)
    assert (conf.request_timeout, conf.registration_timeout, conf.NRI_version) == (2000, 5000, "v0.12.2")
    plugin.send(1, 1, w.RESPONSE, w.encode_response(w.Response(
        payload=nri_pb2.ConfigureResponse(events=0x608).SerializeToString())))
    info = rt.wait_registered(10)
    assert (info.name, info.idx, info.events) == ("hand", "42", 0x608)


@pytest.mark.parametrize("name,idx,message", [
    ("hand", "7", "invalid plugin index '7', must be 2 digits"),
    ("has space", "10", "invalid plugin name 'has space'"),
])
def test_bad_names_and_indexes_are_refused(pair, name: str, idx: str, message: str) -> None:
    rt, plugin = pair
    _register(plugin, name=name, idx=idx)
    _, answer = plugin.next()
    resp = w.decode_response(answer.data)
    assert (resp.code, resp.message) == (Code.UNKNOWN, message)
    assert rt.register_refusals == [message] and rt.plugin is None


def test_stream_ids_must_be_odd_and_increase(pair) -> None:
    _, plugin = pair
    _register(plugin, stream=2)
    _, answer = plugin.next()
    assert w.decode_response(answer.data).message == "StreamID must be odd for client initiated streams"
    _register(plugin, stream=5)
    assert plugin.next()[1].stream_id == 5  # answered
    plugin.next()  # Configure
    plugin.call(3, "UpdateContainers", nri_pb2.UpdateContainersRequest())
    _, answer = plugin.next()
    resp = w.decode_response(answer.data)
    assert (answer.stream_id, resp.code, resp.message) == (
        3, Code.INVALID_ARGUMENT, "StreamID cannot be re-used and must increment")


def test_unknown_service_and_method_are_unimplemented(pair) -> None:
    _, plugin = pair
    plugin.send(2, 1, w.REQUEST, w.encode_request(w.Request("x.Other", "RegisterPlugin")))
    plugin.send(2, 3, w.REQUEST, w.encode_request(w.Request(RUNTIME, "Frobnicate")))
    got = [w.decode_response(plugin.next()[1].data) for _ in range(2)]
    assert [(r.code, r.message) for r in got] == [(Code.UNIMPLEMENTED, "service x.Other"),
                                                  (Code.UNIMPLEMENTED, "method Frobnicate")]


def test_events_outside_valid_events_close_the_connection() -> None:
    ours, theirs = socket.socketpair()
    rt = FakeNriRuntime("/nonexistent/nri.sock", listen=False, nri_version="v0.8.0")
    try:
        rt.adopt(ours)
        plugin = HandPlugin(theirs)
        _register(plugin)
        plugin.next()
        plugin.next()  # Configure
        plugin.send(1, 1, w.RESPONSE, w.encode_response(w.Response(
            payload=nri_pb2.ConfigureResponse(events=0x3FFF).SerializeToString())))
        assert plugin.eof()
        assert rt.wait_disconnected(10) == "plugin setup failed: INVALID_ARGUMENT: invalid plugin events: 0x3800"
    finally:
        rt.close()
        theirs.close()


def test_a_mux_frame_above_4096_bytes_drops_the_plugin(pair) -> None:
    rt, plugin = pair
    body = w.encode_request(w.Request(RUNTIME, "RegisterPlugin", nri_pb2.RegisterPluginRequest(
        plugin_name="hand", plugin_idx="42", NRI_version="x" * 5000).SerializeToString()))
    plugin.send(2, 1, w.REQUEST, body, max_frame=8192)
    assert plugin.eof()
    assert "exceeds the reader's buffer of 4096 bytes" in rt.wait_disconnected(10)


def test_a_register_that_does_not_decode_is_invalid_argument(pair) -> None:
    rt, plugin = pair
    plugin.send(2, 1, w.REQUEST, w.encode_request(w.Request(RUNTIME, "RegisterPlugin", b"\xff\xff\xff")))
    resp = w.decode_response(plugin.next()[1].data)
    assert resp.code == Code.INVALID_ARGUMENT and "unmarshal RegisterPluginRequest" in resp.message
    assert rt.transport is not None and not rt.transport.closed.is_set()
