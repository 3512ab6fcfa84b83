"""Sans-I/O NRI mux framing: splits, garbage, frame size limits."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fracplugin.nri.mux import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    MAX_WRITE_FRAME,
    MuxDecoder,
    MuxError,
    encode_frames,
)

conn_ids = st.sampled_from([1, 2])
messages = st.lists(st.tuples(conn_ids, st.binary(min_size=1, max_size=9000)), max_size=6)


def _raw_frame(conn_id: int, payload: bytes) -> bytes:
    return struct.pack(">II", conn_id, len(payload)) + payload


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(data[prev:p])
        prev = p
    out.append(data[prev:])
    return out


def _reassemble(frames: list[tuple[int, bytes]]) -> dict[int, bytes]:
    per_conn: dict[int, bytearray] = {}
    for conn_id, payload in frames:
        per_conn.setdefault(conn_id, bytearray()).extend(payload)
    return {k: bytes(v) for k, v in per_conn.items()}


def test_header_layout_is_conn_then_length_big_endian():
    assert encode_frames(2, b"abc") == b"\x00\x00\x00\x02\x00\x00\x00\x03abc"
    assert MuxDecoder().receive_data(b"\x00\x00\x00\x01\x00\x00\x00\x02hi") == [(1, b"hi")]


@given(messages)
def test_written_frames_are_at_most_4096_bytes_and_reassemble_per_conn(msgs):
    stream = b"".join(encode_frames(c, p) for c, p in msgs)
    # Walk the raw stream: every frame fits the Go peer's 4096-byte read buffer.
    pos = 0
    while pos < len(stream):
        _, length = struct.unpack_from(">II", stream, pos)
        assert 0 < HEADER_SIZE + length <= MAX_WRITE_FRAME
        pos += HEADER_SIZE + length
    assert pos == len(stream)
    expected: dict[int, bytes] = {}
    for c, p in msgs:
        expected[c] = expected.get(c, b"") + p
    assert _reassemble(MuxDecoder().receive_data(stream)) == expected


@given(messages, st.lists(st.integers(min_value=0, max_value=10**6), max_size=12))
def test_any_split_decodes_to_the_same_frames(msgs, cuts):
    stream = b"".join(encode_frames(c, p) for c, p in msgs)
    whole = MuxDecoder().receive_data(stream)
    dec = MuxDecoder()
    pieces: list[tuple[int, bytes]] = []
    for chunk in _split(stream, cuts):
        pieces.extend(dec.receive_data(chunk))
    dec.receive_eof()
    assert pieces == whole


def test_reads_accept_frames_larger_than_4096():
    # The Go runtime sends frames of 16 KB and more (docs/reference/nri-protocol.md 1.2).
    payload = bytes(range(256)) * 80  # 20 480 bytes
    frames = MuxDecoder().receive_data(_raw_frame(1, payload))
    assert frames == [(1, payload)]


def test_unknown_conn_ids_are_dropped_silently():
    dec = MuxDecoder()
    data = _raw_frame(0, b"reserved") + _raw_frame(7, b"other") + _raw_frame(2, b"ok")
    assert dec.receive_data(data) == [(2, b"ok")]


def test_oversized_length_is_a_protocol_error_and_closes():
    dec = MuxDecoder()
    with pytest.raises(MuxError):
        dec.receive_data(struct.pack(">II", 1, MAX_PAYLOAD + 1))
    with pytest.raises(MuxError):
        dec.receive_data(_raw_frame(1, b"x"))


def test_max_payload_is_accepted():
    header = struct.pack(">II", 1, MAX_PAYLOAD)
    dec = MuxDecoder()
    assert dec.receive_data(header + b"\0" * 1000) == []
    frames = dec.receive_data(b"\0" * (MAX_PAYLOAD - 1000))
    assert len(frames) == 1 and len(frames[0][1]) == MAX_PAYLOAD


def test_truncated_frame_at_eof_is_a_protocol_error():
    dec = MuxDecoder()
    assert dec.receive_data(_raw_frame(1, b"hello")[:-2]) == []
    with pytest.raises(MuxError):
        dec.receive_eof()


def test_clean_eof_is_fine():
    """EOF right after a complete frame: the frame was delivered, nothing is
    pending, ``receive_eof`` raises nothing and closes the decoder (a later
    ``receive_data`` is refused). Control: the same EOF one byte into the next
    frame is a truncated stream."""
    dec = MuxDecoder()
    assert dec.receive_data(_raw_frame(1, b"hello")) == [(1, b"hello")]
    dec.receive_eof()
    with pytest.raises(MuxError, match="closed"):
        dec.receive_data(_raw_frame(1, b"late"))
    cut = MuxDecoder()
    assert cut.receive_data(_raw_frame(1, b"hello") + _raw_frame(2, b"x")[:1]) == [(1, b"hello")]
    with pytest.raises(MuxError, match="1 bytes pending"):
        cut.receive_eof()


def test_encode_rejects_bad_conn_id_and_empty_data_gives_no_frames():
    with pytest.raises(ValueError):
        encode_frames(0, b"x")
    assert encode_frames(1, b"") == b""


def _reference_frames(data: bytes) -> tuple[list[tuple[int, bytes]], int, str]:
    """The stream read by the rules alone (docs/reference/nri-protocol.md 1.2: conn id u32,
    length u32, big-endian; frames of unknown conn ids are dropped): (frames of
    conns 1 and 2, frames dropped, "clean" | "truncated" | "too large")."""
    frames, dropped, pos = [], 0, 0
    while len(data) - pos >= HEADER_SIZE:
        conn_id, length = struct.unpack_from(">II", data, pos)
        if length > MAX_PAYLOAD:
            return frames, dropped, "too large"
        if pos + HEADER_SIZE + length > len(data):
            break
        if conn_id in (1, 2):
            frames.append((conn_id, data[pos + HEADER_SIZE : pos + HEADER_SIZE + length]))
        else:
            dropped += 1
        pos += HEADER_SIZE + length
    return frames, dropped, "clean" if pos == len(data) else "truncated"


# Garbage with plausible headers: frames of conns 0-3, any small length (the
# last one often truncated), then junk.
_junk_frames = st.tuples(
    st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=30)), max_size=6).map(
        lambda fs: b"".join(_raw_frame(c, b) for c, b in fs)),
    st.binary(max_size=20),
).map(lambda t: t[0] + t[1])


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=200), _junk_frames),
       st.lists(st.integers(min_value=0, max_value=400), max_size=5))
def test_garbage_decodes_as_the_framing_rules_say_or_raises_only_mux_error(data, cuts):
    """Any split of any input yields exactly the frames the framing rules
    give (unknown conns dropped), or MuxError for a header above
    the payload limit (after a prefix of those frames); EOF inside a frame is
    a MuxError; a decoder that raised stays closed."""
    want, _, end = _reference_frames(data)
    dec = MuxDecoder()
    got: list[tuple[int, bytes]] = []
    try:
        for chunk in _split(data, cuts):
            got.extend(dec.receive_data(chunk))
    except MuxError:
        assert end == "too large" and got == want[: len(got)]
        with pytest.raises(MuxError):
            dec.receive_data(b"")
        return
    assert end != "too large" and got == want
    if end == "truncated":
        with pytest.raises(MuxError):
            dec.receive_eof()
    else:
        dec.receive_eof()
