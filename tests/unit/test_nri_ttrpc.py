"""Sans-I/O ttrpc connection: framing, stream ids, limits, status handling."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fracplugin._proto import ttrpc_pb2
from fracplugin.nri.ttrpc import (
    MAX_MESSAGE,
    Code,
    MessageIgnored,
    MessageTooLarge,
    MessageType,
    RequestReceived,
    RequestRejected,
    ResponseReceived,
    Role,
    RpcError,
    TtrpcConnection,
    TtrpcError,
)
from tests.peers.ttrpc_wire import ttrpc_frame as encode_message

SVC = "nri.pkg.api.v1alpha1.Plugin"


def _frames(data: bytes) -> list[tuple[int, int, int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        length, sid, mtype, flags = struct.unpack_from(">IIBB", data, pos)
        out.append((length, sid, mtype, flags, data[pos + 10 : pos + 10 + length]))
        pos += 10 + length
    assert pos == len(data)
    return out


def _request(sid: int, method: str = "Configure", payload: bytes = b"p", service: str = SVC) -> bytes:
    body = ttrpc_pb2.Request(service=service, method=method, payload=payload, timeout_nano=2_000_000_000)
    return encode_message(sid, MessageType.REQUEST, body.SerializeToString())


def _status(data: bytes) -> tuple[int, str]:
    ((_, _, mtype, _, body),) = _frames(data)
    assert mtype == MessageType.RESPONSE
    resp = ttrpc_pb2.Response.FromString(body)
    return resp.status.code, resp.status.message


def test_client_request_header_and_odd_increasing_ids():
    c = TtrpcConnection(Role.CLIENT)
    assert [c.send_request(SVC, "M", b"x") for _ in range(3)] == [1, 3, 5]
    frames = _frames(c.data_to_send())
    assert [(f[1], f[2], f[3]) for f in frames] == [(1, 1, 0), (3, 1, 0), (5, 1, 0)]
    req = ttrpc_pb2.Request.FromString(frames[0][4])
    assert (req.service, req.method, req.payload) == (SVC, "M", b"x")
    assert frames[0][0] == len(frames[0][4])


def test_server_roundtrip_and_absent_status_is_ok():
    server, client = TtrpcConnection(Role.SERVER), TtrpcConnection(Role.CLIENT)
    sid = client.send_request(SVC, "Configure", b"req", timeout_nano=123)
    (ev,) = server.receive_data(client.data_to_send())
    assert ev == RequestReceived(sid, SVC, "Configure", b"req", 123)
    server.send_response(sid, b"")
    wire = server.data_to_send()
    assert _frames(wire)[0][0] == 0  # empty Response: status omitted, payload omitted
    (resp,) = client.receive_data(wire)
    assert resp == ResponseReceived(sid, Code.OK, "", b"")
    assert resp.code == Code.OK and resp.raise_for_status() == b""
    assert client._in_flight == set()


def test_error_response_carries_status_and_raises():
    server, client = TtrpcConnection(Role.SERVER), TtrpcConnection(Role.CLIENT)
    sid = client.send_request(SVC, "CreateContainer", b"")
    server.receive_data(client.data_to_send())
    server.send_error(sid, Code.INVALID_ARGUMENT, "bad key")
    (resp,) = client.receive_data(server.data_to_send())
    assert (resp.code, resp.message, resp.payload) == (Code.INVALID_ARGUMENT, "bad key", b"")
    with pytest.raises(RpcError) as exc:
        resp.raise_for_status()
    assert exc.value.code == Code.INVALID_ARGUMENT and exc.value.message == "bad key"


def test_explicit_status_zero_is_ok():
    client = TtrpcConnection(Role.CLIENT)
    sid = client.send_request(SVC, "X", b"")
    body = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=0), payload=b"pl").SerializeToString()
    (resp,) = client.receive_data(encode_message(sid, MessageType.RESPONSE, body))
    assert resp.code == Code.OK and resp.payload == b"pl"


def test_even_stream_id_rejected_with_invalid_argument():
    server = TtrpcConnection(Role.SERVER)
    (ev,) = server.receive_data(_request(2))
    assert isinstance(ev, RequestRejected) and ev.code == Code.INVALID_ARGUMENT
    assert _status(server.data_to_send()) == (Code.INVALID_ARGUMENT, "StreamID must be odd for client initiated streams")


def test_reused_or_decreasing_stream_id_rejected():
    server = TtrpcConnection(Role.SERVER)
    assert isinstance(server.receive_data(_request(5))[0], RequestReceived)
    for sid in (5, 3):
        (ev,) = server.receive_data(_request(sid))
        assert isinstance(ev, RequestRejected)
        assert _status(server.data_to_send()) == (
            Code.INVALID_ARGUMENT,
            "StreamID cannot be re-used and must increment",
        )
    assert isinstance(server.receive_data(_request(7))[0], RequestReceived)


def test_oversized_request_is_discarded_and_answered_resource_exhausted():
    server = TtrpcConnection(Role.SERVER)
    length = MAX_MESSAGE + 1
    header = struct.pack(">IIBB", length, 1, MessageType.REQUEST, 0)
    # Fed in pieces: the body is skipped, not buffered.
    assert server.receive_data(header + b"\xff" * 1000) == []
    assert server.receive_data(b"\xff" * (length - 1000 - 5)) == []
    events = server.receive_data(b"\xff" * 5 + _request(3))
    assert isinstance(events[0], RequestRejected) and events[0].code == Code.RESOURCE_EXHAUSTED
    assert isinstance(events[1], RequestReceived) and events[1].stream_id == 3
    code, msg = _status(server.data_to_send())
    assert code == Code.RESOURCE_EXHAUSTED and str(MAX_MESSAGE) in msg


def test_request_of_exactly_4_mib_is_accepted():
    server = TtrpcConnection(Role.SERVER)
    body = ttrpc_pb2.Request(service=SVC, method="M", payload=b"a" * (MAX_MESSAGE - 100)).SerializeToString()
    overhead = len(body) - (MAX_MESSAGE - 100)
    body = ttrpc_pb2.Request(service=SVC, method="M", payload=b"a" * (MAX_MESSAGE - overhead)).SerializeToString()
    assert len(body) == MAX_MESSAGE
    (ev,) = server.receive_data(encode_message(1, MessageType.REQUEST, body))
    assert isinstance(ev, RequestReceived)


def test_oversized_response_to_client_fails_that_call():
    client = TtrpcConnection(Role.CLIENT)
    sid = client.send_request(SVC, "X", b"")
    header = struct.pack(">IIBB", MAX_MESSAGE + 10, sid, MessageType.RESPONSE, 0)
    (ev,) = client.receive_data(header + b"\0" * (MAX_MESSAGE + 10))
    assert isinstance(ev, ResponseReceived) and ev.code == Code.RESOURCE_EXHAUSTED


def test_outgoing_oversized_response_becomes_resource_exhausted():
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(_request(1))
    assert server.send_response(1, b"x" * (MAX_MESSAGE + 1)) is False
    assert _status(server.data_to_send())[0] == Code.RESOURCE_EXHAUSTED


def test_outgoing_oversized_request_raises_and_does_not_consume_an_id():
    client = TtrpcConnection(Role.CLIENT)
    with pytest.raises(MessageTooLarge):
        client.send_request(SVC, "X", b"x" * (MAX_MESSAGE + 1))
    assert client.data_to_send() == b""
    assert client.send_request(SVC, "X", b"") == 1


def test_garbage_length_is_a_protocol_error():
    server = TtrpcConnection(Role.SERVER)
    with pytest.raises(TtrpcError):
        server.receive_data(b"\x41\x42\x43\x44" + b"\0" * 6)
    with pytest.raises(TtrpcError):
        server.receive_data(_request(1))


def test_undecodable_request_answered_invalid_argument():
    server = TtrpcConnection(Role.SERVER)
    (ev,) = server.receive_data(encode_message(1, MessageType.REQUEST, b"\xff\xff\xff"))
    assert isinstance(ev, RequestRejected) and ev.code == Code.INVALID_ARGUMENT
    assert _status(server.data_to_send())[0] == Code.INVALID_ARGUMENT


def test_frames_without_meaning_are_ignored():
    server = TtrpcConnection(Role.SERVER)
    (ev,) = server.receive_data(encode_message(1, MessageType.RESPONSE, b""))
    assert isinstance(ev, MessageIgnored)
    client = TtrpcConnection(Role.CLIENT)
    (ev,) = client.receive_data(encode_message(9, MessageType.RESPONSE, b""))
    assert isinstance(ev, MessageIgnored)
    (ev,) = client.receive_data(encode_message(1, MessageType.DATA, b""))
    assert isinstance(ev, MessageIgnored)


def test_response_only_once_per_stream():
    server = TtrpcConnection(Role.SERVER)
    server.receive_data(_request(1))
    server.send_response(1, b"")
    with pytest.raises(ValueError):
        server.send_error(1, Code.INTERNAL, "again")


def test_truncated_message_at_eof_raises():
    server = TtrpcConnection(Role.SERVER)
    assert server.receive_data(_request(1)[:-1]) == []
    with pytest.raises(TtrpcError):
        server.receive_eof()


req_specs = st.lists(
    st.tuples(st.sampled_from(["Configure", "CreateContainer", "X" * 50]), st.binary(max_size=6000)),
    min_size=1,
    max_size=5,
)


@given(req_specs, st.lists(st.integers(min_value=0, max_value=10**5), max_size=10))
def test_any_split_decodes_to_the_same_messages(specs, cuts):
    client = TtrpcConnection(Role.CLIENT)
    for method, payload in specs:
        client.send_request(SVC, method, payload)
    stream = client.data_to_send()
    whole = TtrpcConnection(Role.SERVER).receive_data(stream)
    assert [(e.method, e.payload) for e in whole] == specs
    server = TtrpcConnection(Role.SERVER)
    got = []
    points = sorted({c % (len(stream) + 1) for c in cuts})
    prev = 0
    for p in points + [len(stream)]:
        got.extend(server.receive_data(stream[prev:p]))
        prev = p
    server.receive_eof()
    assert got == whole


# Garbage that gets past the header: frames with small lengths, any stream id,
# message type and flags, junk bodies (a junk protobuf often decodes), then junk.
_junk_frames = st.tuples(
    st.lists(st.tuples(st.integers(0, 12), st.integers(0, 4), st.integers(0, 255), st.binary(max_size=40)),
             max_size=6).map(lambda fs: b"".join(struct.pack(">IIBB", len(b), sid, t, f) + b for sid, t, f, b in fs)),
    st.binary(max_size=60),
).map(lambda t: t[0] + t[1])


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=300), _junk_frames), st.sampled_from([Role.SERVER, Role.CLIENT]))
def test_garbage_raises_only_ttrpc_error_and_keeps_the_connection_consistent(data, role):
    """Any input ends in events or a TtrpcError (then the connection stays
    closed); every request rejected is answered with exactly one error
    response of the same stream and code; a server accepts only odd,
    increasing stream ids and awaits an answer for each; a client sees each of
    its requests answered at most once and queues nothing of its own."""
    conn = TtrpcConnection(role)
    sent = set()
    if role is Role.CLIENT:
        for _ in range(3):
            sent.add(conn.send_request(SVC, "M", b""))
        conn.data_to_send()
    try:
        events = conn.receive_data(data)
    except TtrpcError:
        with pytest.raises(TtrpcError):
            conn.receive_data(b"")
        return
    out = _frames(conn.data_to_send())
    if role is Role.SERVER:
        assert all(isinstance(e, (RequestReceived, RequestRejected, MessageIgnored)) for e in events), events
        received = [e.stream_id for e in events if isinstance(e, RequestReceived)]
        assert all(sid % 2 == 1 for sid in received) and received == sorted(set(received))
        assert conn._awaiting == set(received)
        rejected = [(e.stream_id, e.code) for e in events if isinstance(e, RequestRejected)]
        answers = []
        for _length, sid, mtype, _flags, body in out:
            assert mtype == MessageType.RESPONSE
            answers.append((sid, ttrpc_pb2.Response.FromString(body).status.code))
        assert answers == rejected
    else:
        assert all(isinstance(e, (ResponseReceived, MessageIgnored)) for e in events), events
        answered = [e.stream_id for e in events if isinstance(e, ResponseReceived)]
        assert len(answered) == len(set(answered)) and set(answered) <= sent
        assert conn._in_flight == sent - set(answered)
        assert out == []
    try:
        conn.receive_eof()
    except TtrpcError:
        pass
    with pytest.raises(TtrpcError):
        conn.receive_data(b"")
