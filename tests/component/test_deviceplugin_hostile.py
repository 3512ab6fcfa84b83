"""The device plugin socket against a hostile or broken peer (review of the
grpclib transport, ADR 0018): bytes that are not gRPC, a wrong content-type,
an unknown method, a corrupt or oversize message. Each time the peer gets a
clear refusal and the door keeps serving kubelet.

The oversize rule: gRPC's receive limit, 4 MiB by default in grpcio (which
served the door before ADR 0018) and grpc-go (kubelet): a larger message is
refused with RESOURCE_EXHAUSTED before it is read, so a peer cannot make the
daemon buffer it (grpclib alone has no limit: it read a 256 MiB message into
memory)."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import deviceplugin_pb2_grpc as pb_grpc
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.kubelet import DevicePluginServer, InMemoryPodSource
from fracplugin.kubelet import grpcwire
from fracplugin.ledger import Ledger
from fracplugin.planner import PlannerConfig
from tests.helpers import wait_until

MiB = 1024 * 1024
_GUARD_S = 10.0  # only bounds a test that would otherwise hang on a silent server


@pytest.fixture
def plugin(node_file):
    d = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    inv = SimulatedInventory(node_file)
    node = inv.node()
    s = DevicePluginServer(node, Ledger(node), PlannerConfig(), inv, pod_source=InMemoryPodSource(node.name),
                           plugin_dir=d, podresources_socket=None, allocate_deadline_s=0.2)
    s.start()
    yield s
    s.stop(2.0)
    shutil.rmtree(d, ignore_errors=True)


def serves(s: DevicePluginServer) -> bool:
    with grpc.insecure_channel("unix:" + s.socket_path) as ch:
        return pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb.Empty(), timeout=5).get_preferred_allocation_available


class RawH2:
    """An HTTP/2 client on the plugin's socket that writes exactly what the test says."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(_GUARD_S)
        self.sock.connect(path)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.flush()
        self.headers: list[dict[bytes, bytes]] = []
        self.ended = False

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def open(self, path: str, content_type: str = "application/grpc") -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                     (":authority", "localhost"), ("content-type", content_type), ("te", "trailers")])
        self.flush()
        return sid

    def pump(self) -> bool:
        """Read once from the server; False when it closed the connection."""
        data = self.sock.recv(65536)
        if not data:
            return False
        for e in self.conn.receive_data(data):
            if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                self.headers.append(dict(e.headers))
            if isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)):
                self.ended = True
        self.flush()
        return True

    def status(self) -> tuple[int, str]:
        """The (grpc-status, grpc-message) the server answered, waiting for the stream's end."""
        while not self.ended and self.pump():
            pass
        merged: dict[bytes, bytes] = {}
        for h in self.headers:
            merged.update(h)
        return int(merged[b"grpc-status"]), merged.get(b"grpc-message", b"").decode()

    def close(self) -> None:
        self.sock.close()


def test_bytes_that_are_not_grpc_close_that_connection_only(plugin):
    s = plugin
    for junk in (os.urandom(4096), b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"):
        c = socket.socket(socket.AF_UNIX)
        c.settimeout(_GUARD_S)
        c.connect(s.socket_path)
        c.sendall(junk)
        while c.recv(65536):  # the server closes the connection (a socket timeout fails the test)
            pass
        c.close()
        assert serves(s)


def test_wrong_content_type_and_unknown_method_are_refused(plugin):
    s = plugin
    c = RawH2(s.socket_path)
    try:
        sid = c.open("/v1beta1.DevicePlugin/GetDevicePluginOptions", content_type="text/html")
        c.conn.send_data(sid, b"\0\0\0\0\0", end_stream=True)
        c.flush()
        code, _ = c.status()
        assert code == grpc.StatusCode.UNKNOWN.value[0]
        assert c.headers[0][b":status"] == b"415"
    finally:
        c.close()
    with grpc.insecure_channel("unix:" + s.socket_path) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/v1beta1.DevicePlugin/Nope")(b"", timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert serves(s)


def test_oversize_request_is_refused_before_it_is_read(plugin):
    """A message announced as 64 MiB: RESOURCE_EXHAUSTED naming both sizes,
    and the server lets the peer send no more than its flow-control windows
    (a few MiB), instead of reading 64 MiB into the daemon."""
    s = plugin
    c = RawH2(s.socket_path)
    announced = 64 * MiB
    sent = 0
    try:
        sid = c.open("/v1beta1.DevicePlugin/Allocate")
        c.conn.send_data(sid, b"\0" + struct.pack(">I", announced))
        c.flush()
        chunk = b"\x01" * c.conn.max_outbound_frame_size
        while sent < announced and not c.ended:
            window = min(c.conn.local_flow_control_window(sid), c.conn.max_outbound_frame_size)
            if window <= 0:
                if not c.pump():
                    break
                continue
            c.conn.send_data(sid, chunk[:window])
            c.flush()
            sent += window
        code, message = c.status()
    finally:
        c.close()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message
    assert f"{announced} vs. {grpcwire.MAX_MESSAGE_BYTES}" in message
    assert sent <= 16 * MiB, f"the server accepted {sent / MiB:.1f} MiB of a message over its limit"
    assert serves(s)


def test_grpcio_client_sees_the_size_limit_of_grpcio(plugin):
    s = plugin
    ids = [f"{s.node.gpus[0].uuid}::0"] * (5 * MiB // 50)  # > 4 MiB on the wire
    with grpc.insecure_channel("unix:" + s.socket_path) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.DevicePluginStub(ch).Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details()
    # A request just under the limit is read and decided (refused for its IDs, not its size).
    ids = [f"{s.node.gpus[0].uuid}::0"] * (3 * MiB // 50)
    with grpc.insecure_channel("unix:" + s.socket_path) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.DevicePluginStub(ch).Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=10)
    assert e.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED


def test_corrupt_request_is_refused_with_what_could_not_be_read(plugin):
    s = plugin
    with grpc.insecure_channel("unix:" + s.socket_path) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/v1beta1.DevicePlugin/Allocate")(b"\x01" * 64, timeout=5)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "AllocateRequest" in e.value.details()
    assert serves(s)


@pytest.mark.parametrize("frame", [
    b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678",  # PING: h2 answers each with a PING ACK
    b"\x00\x00\x00\x04\x00\x00\x00\x00\x00",  # empty SETTINGS: answered with a SETTINGS ACK
], ids=["ping", "settings"])
def test_a_flood_of_frames_whose_answers_are_never_read_is_not_buffered(plugin, frame):
    """HTTP/2 ping / settings flood (CVE-2019-9512, -9515): the peer sends
    32 MiB of frames h2 must answer and never reads. The server stops reading
    that connection once its unread answers pass the buffer's high-water mark,
    so the peer cannot send them all, and the daemon holds well under 1 MiB
    of answers (grpclib alone kept reading: 32 MiB of PINGs, +35 MiB RSS)."""
    s = plugin
    c = socket.socket(socket.AF_UNIX)
    c.connect(s.socket_path)
    c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    total = (32 * MiB // len(frame)) * len(frame)
    batch = frame * 4096
    progress = {"sent": 0, "error": None}
    enough = threading.Event()

    def flood() -> None:
        try:
            while progress["sent"] < total and not enough.is_set():
                c.sendall(batch)
                progress["sent"] += len(batch)
        except OSError as e:
            progress["error"] = e

    t = threading.Thread(target=flood, daemon=True)
    t.start()

    async def stats() -> list[dict[str, int]]:
        return s._server.connection_stats()

    def paused() -> list[dict[str, int]]:
        return [st for st in s.loop.call(stats(), 5.0) if not st["reading"]]

    try:
        held = wait_until(lambda: paused() or not t.is_alive(), 30, what="the server to stop reading the flood")
        assert t.is_alive(), f"the server read all {progress['sent'] / MiB:.1f} MiB of the flood ({progress['error']})"
        assert all(st["write_buffer_bytes"] < 1 * MiB for st in held), held
        assert progress["sent"] < total
        assert serves(s)  # another connection is served meanwhile
        # the peer reads again: the server drains its answers and reads the
        # rest of the flood (a kubelet that fell behind once is not cut off)
        drainer = threading.Thread(target=_drain, args=(c,), daemon=True)
        drainer.start()
        sent_when_paused = progress["sent"]
        wait_until(lambda: progress["sent"] > sent_when_paused + 4 * MiB, 60,
                   what=lambda: f"more of the flood to be read ({progress}, {sent_when_paused} when paused)")
        enough.set()
        t.join(10)
        assert progress["error"] is None
        wait_until(lambda: not paused(), 10, what="the connection to be read again")
    finally:
        c.shutdown(socket.SHUT_RDWR)  # wakes the flood thread blocked in send
        c.close()
        t.join(10)


def _drain(c: socket.socket) -> None:
    """Read and discard what the server sends on ``c`` until it closes."""
    try:
        while c.recv(1 << 20):
            pass
    except OSError:
        pass


def test_streams_reset_before_their_handler_ran_are_released(plugin):
    """HTTP/2 rapid reset (CVE-2023-44487): HEADERS then RST_STREAM at once,
    thousands of times on one connection. grpclib cancels the handler's task
    before it ran, so the task's ``finally`` that releases the stream never
    ran either: every stream stayed in the connection's table for the life
    of the connection (50 000 resets: 48 -> 425 MiB RSS). Now each one is
    released when its task ends, however it ends."""
    import h2.errors

    s = plugin
    c = RawH2(s.socket_path)
    n = 3000
    drained = threading.Event()

    def drain() -> None:  # read (and discard) the answers, so this is not the flood case
        try:
            while c.sock.recv(1 << 20):
                pass
        except OSError:
            pass
        drained.set()

    threading.Thread(target=drain, daemon=True).start()

    async def stats() -> list[dict[str, int]]:
        return s._server.connection_stats()

    try:
        for i in range(n):
            sid = c.conn.get_next_available_stream_id()
            c.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"),
                                      (":path", "/v1beta1.DevicePlugin/ListAndWatch"), (":authority", "localhost"),
                                      ("content-type", "application/grpc"), ("te", "trailers")])
            c.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            if i % 100 == 99:
                c.flush()
        c.flush()
        # every stream the peer opened was seen (the server's stream table or
        # its counters show the last one), and none is held after its reset
        wait_until(lambda: any(st["streams_reset"] >= n for st in s.loop.call(stats(), 5.0)),
                   what="the server to read every HEADERS + RST_STREAM")
        held = wait_until(lambda: [st for st in s.loop.call(stats(), 5.0) if st["streams_reset"] >= n]
                          if all(st["open_streams"] < 10 for st in s.loop.call(stats(), 5.0)) else None,
                          what=lambda: f"the reset streams to be released: {s.loop.call(stats(), 5.0)}")
        assert held
        assert serves(s)
    finally:
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
