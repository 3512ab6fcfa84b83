"""``NriTransport.answer_nowait``, the reader thread's answer (issue 14): it
never blocks. The whole answer goes out when the socket takes it (SENT);
when the peer does not read, the rest is handed to ``finish`` with the write
lock still held (SPILLED), so another answer meanwhile is refused without
touching the socket (BUSY); the bytes on the wire are one well-formed ttrpc
response either way. A socketpair stands in for the runtime."""

from __future__ import annotations

import socket
import threading
from typing import Callable

import pytest

from fracplugin.nri.mux import MuxDecoder, encode_frames
from fracplugin.nri.transport import BUSY, SENT, SPILLED, NriTransport
from fracplugin.nri.ttrpc import RequestReceived, ResponseReceived, Role, TtrpcConnection


class Peer:
    """The runtime end: sends requests on conn 1 and decodes the answers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.client = TtrpcConnection(Role.CLIENT)
        self.mux = MuxDecoder((1,))

    def request(self) -> int:
        sid = self.client.send_request("svc", "M", b"")
        self.sock.sendall(encode_frames(1, self.client.data_to_send()))
        return sid

    def read_answers(self, n: int) -> list[ResponseReceived]:
        got: list[ResponseReceived] = []
        while len(got) < n:
            data = self.sock.recv(1 << 20)
            assert data, "transport closed"
            for frame in self.mux.receive_data(data):
                got += [e for e in self.client.receive_data(frame.payload) if isinstance(e, ResponseReceived)]
        return got


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    requests: list[RequestReceived] = []
    arrived = threading.Condition()

    def on_request(ev: RequestReceived) -> None:
        with arrived:
            requests.append(ev)
            arrived.notify_all()

    transport = NriTransport(ours, serve_conn=1, call_conn=2, on_request=on_request, label="nowait-test").start()
    peer = Peer(theirs)

    def wait_requests(n: int) -> list[RequestReceived]:
        with arrived:
            assert arrived.wait_for(lambda: len(requests) >= n, timeout=10)
            return list(requests)

    yield transport, peer, wait_requests
    transport.close("test over")
    theirs.close()


def test_a_small_answer_is_sent_whole(pair) -> None:
    transport, peer, wait_requests = pair
    sid = peer.request()
    (ev,) = wait_requests(1)
    finished: list[Callable[[], None]] = []
    assert transport.answer_nowait(ev.stream_id, b"ok", None, "", finish=finished.append) == SENT
    assert finished == []
    (resp,) = peer.read_answers(1)
    assert (resp.stream_id, resp.code, resp.payload) == (sid, 0, b"ok")


def test_an_answer_the_peer_does_not_read_is_finished_elsewhere_and_blocks_no_one(pair) -> None:
    transport, peer, wait_requests = pair
    first, second = peer.request(), peer.request()
    evs = wait_requests(2)
    big = bytes(range(256)) * 4096  # 1 MiB: far more than the socket buffers hold
    finished: list[Callable[[], None]] = []
    assert transport.answer_nowait(evs[0].stream_id, big, None, "", finish=finished.append) == SPILLED
    assert len(finished) == 1  # the rest of the write, for a thread that may block
    # The write lock is still held by that unfinished write: another answer is not attempted.
    assert transport.answer_nowait(evs[1].stream_id, b"", 14, "later", finish=finished.append) == BUSY
    writer = threading.Thread(target=finished[0])
    writer.start()
    (resp,) = peer.read_answers(1)  # reading lets the writer finish
    writer.join(10)
    assert (resp.stream_id, resp.code, resp.payload) == (first, 0, big)
    # The lock was handed back: the second answer goes out whole now.
    assert transport.answer_nowait(evs[1].stream_id, b"", 14, "later", finish=finished.append) == SENT
    (resp,) = peer.read_answers(1)
    assert (resp.stream_id, resp.code, resp.message) == (second, 14, "later")
    assert len(finished) == 1 and not transport.closed.is_set()


def test_a_spill_nobody_can_finish_closes_the_connection(pair) -> None:
    transport, peer, wait_requests = pair
    peer.request()
    (ev,) = wait_requests(1)

    def no_thread_left(_rest: Callable[[], None]) -> None:
        raise RuntimeError("handler pool is shut down")

    with pytest.raises(ConnectionError):
        transport.answer_nowait(ev.stream_id, b"x" * (1 << 20), None, "", finish=no_thread_left)
    assert transport.closed.is_set() and "half written" in (transport.close_reason or "")
