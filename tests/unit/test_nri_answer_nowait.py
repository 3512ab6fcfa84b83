"""``NriTransport.answer_nowait``, the reader thread's answer (issue 14): it
never blocks. The whole answer goes out when the socket takes it (SENT);
when the peer does not read, the rest is handed to ``finish`` with the write
lock still held (SPILLED), so another answer meanwhile is refused without
touching the socket (BUSY); the bytes on the wire are one well-formed ttrpc
response either way. A socketpair stands in for the runtime, whose framing
is the tests' own (``tests.peers.ttrpc_wire``)."""

from __future__ import annotations

import socket
import threading
from typing import Callable

import pytest

from fracplugin.nri.transport import BUSY, SENT, SPILLED, NriTransport
from fracplugin.nri.ttrpc import RequestReceived
from tests.peers.ttrpc_wire import (REQUEST, RESPONSE, MuxReader, Request, Response, TtrpcReader, decode_response,
                                    encode_request, mux_frames, ttrpc_frame)


class Peer:
    """The runtime end, on the tests' own wire code (``tests.peers.ttrpc_wire``):
    sends requests on conn 1 and decodes the answers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.next_id = 1
        self.mux = MuxReader()
        self.ttrpc = TtrpcReader()

    def request(self) -> int:
        sid, self.next_id = self.next_id, self.next_id + 2
        self.sock.sendall(mux_frames(1, ttrpc_frame(sid, REQUEST, encode_request(Request("svc", "M")))))
        return sid

    def read_answers(self, n: int) -> list[tuple[int, Response]]:
        got: list[tuple[int, Response]] = []
        while len(got) < n:
            data = self.sock.recv(1 << 20)
            assert data, "transport closed"
            for conn, payload in self.mux.feed(data):
                assert conn == 1
                for msg in self.ttrpc.feed(payload):
                    assert msg.msg_type == RESPONSE and msg.data is not None
                    got.append((msg.stream_id, decode_response(msg.data)))
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
    ((got_sid, resp),) = peer.read_answers(1)
    assert (got_sid, resp.code, resp.payload) == (sid, 0, b"ok")


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
    ((got_sid, resp),) = peer.read_answers(1)  # reading lets the writer finish
    writer.join(10)
    assert (got_sid, resp.code, resp.payload) == (first, 0, big)
    # The lock was handed back: the second answer goes out whole now.
    assert transport.answer_nowait(evs[1].stream_id, b"", 14, "later", finish=finished.append) == SENT
    ((got_sid, resp),) = peer.read_answers(1)
    assert (got_sid, resp.code, resp.message) == (second, 14, "later")
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
