"""NRI wire format for the test peers, written from the protocol references
(not from ``fracplugin.nri``): the NRI multiplexer frame, the ttrpc frame and
the ttrpc ``Request`` / ``Response`` protobuf envelopes.

Facts used (with their sources):

* NRI multiplexer (containerd/nri ``pkg/net/multiplex/mux.go``): every frame
  is an 8-byte header -- conn id ``uint32`` big-endian, payload length
  ``uint32`` big-endian -- then the payload. Conn id 0 is reserved;
  1 = ``PluginServiceConn`` (the runtime is the ttrpc client, the plugin
  serves ``Plugin``), 2 = ``RuntimeServiceConn`` (the plugin is the client,
  the runtime serves ``Runtime``). No handshake: both sides just use ids 1
  and 2. The largest payload of one frame is 10 + 4 MiB (since NRI v0.8.0).
  A Go peer reads one mux frame per ``Read`` into ttrpc's 4096-byte
  ``bufio`` buffer and fails on a bigger frame (ENOMEM): a well-behaved
  writer sends frames of at most 4096 bytes, header included, and one ttrpc
  message may span several frames (each conn is a byte stream).
* ttrpc (containerd/ttrpc ``PROTOCOL.md``, ``channel.go``): a 10-byte
  big-endian header -- data length ``uint32`` (payload only), stream id
  ``uint32``, message type ``uint8`` (1 request, 2 response, 3 data), flags
  ``uint8`` (0 for unary calls, all NRI uses) -- then the data. The data
  length is at most ``4 << 20`` bytes; a receiver discards a bigger message
  and answers ``RESOURCE_EXHAUSTED``. Client streams use odd, strictly
  increasing ids (1, 3, 5, ...); a server answers an even id with
  ``INVALID_ARGUMENT`` "StreamID must be odd for client initiated streams" and
  a reused one with "StreamID cannot be re-used and must increment".
* Envelopes (containerd/ttrpc ``request.proto``, package ``ttrpc``):
  ``Request{service=1 string, method=2 string, payload=3 bytes,
  timeout_nano=4 int64, metadata=5 repeated KeyValue{key=1, value=2}}``,
  ``Response{status=1 google.rpc.Status{code=1 int32, message=2 string},
  payload=2 bytes}``. ``service`` is the full proto service name
  (``nri.pkg.api.v1alpha1.Plugin``), ``method`` the bare RPC name. A Go server
  leaves ``status`` unset on success (the RegisterPlugin reply is a
  zero-length ``Response``); an absent status or code 0 means OK; an error
  carries the status and no payload; unknown service / method answer
  ``UNIMPLEMENTED`` "service <name>" / "method <name>".

All of it is in docs/reference/nri-protocol.md sections 1.1-1.3 of the project's reference
notes. The envelopes are encoded here by hand (proto3 rules: fields in
field-number order, default values omitted, varints little-endian base 128,
negative int32/int64 as 10-byte two's complement), which is what Go's
protobuf runtime writes; ``tests/unit/test_peer_wire.py`` checks this module
against the recorded Go transcripts byte for byte.

Concurrency model: none. Pure functions and two small incremental splitters
(``MuxReader``, ``TtrpcReader``) that one thread feeds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

__all__ = [
    "DATA",
    "MUX_HEADER_SIZE",
    "MUX_MAX_PAYLOAD",
    "PLUGIN_SERVICE_CONN",
    "REQUEST",
    "RESPONSE",
    "RUNTIME_SERVICE_CONN",
    "TTRPC_HEADER_SIZE",
    "TTRPC_MAX_DATA",
    "WireError",
    "MuxReader",
    "TtrpcMessage",
    "TtrpcReader",
    "Request",
    "Response",
    "mux_frames",
    "ttrpc_frame",
    "encode_request",
    "decode_request",
    "encode_response",
    "decode_response",
]

MUX_HEADER_SIZE = 8
"""Bytes in a mux frame header: conn id u32 BE + payload length u32 BE."""
MUX_MAX_PAYLOAD = 10 + (4 << 20)
"""Largest mux frame payload a Go mux accepts since NRI v0.8.0, bytes."""
PLUGIN_SERVICE_CONN = 1
"""Mux conn of the ``Plugin`` service: the runtime calls, the plugin serves."""
RUNTIME_SERVICE_CONN = 2
"""Mux conn of the ``Runtime`` service: the plugin calls, the runtime serves."""

TTRPC_HEADER_SIZE = 10
"""Bytes in a ttrpc frame header: length u32, stream id u32, type u8, flags u8 (BE)."""
TTRPC_MAX_DATA = 4 << 20
"""Largest ttrpc data length, bytes (ttrpc ``messageLengthMax``)."""
REQUEST, RESPONSE, DATA = 1, 2, 3
"""ttrpc message types."""

_MUX = struct.Struct(">II")
_TTRPC = struct.Struct(">IIBB")


class WireError(Exception):
    """The byte stream breaks the framing rules (the connection must be dropped)."""


# ---------------------------------------------------------------- framing


def mux_frames(conn_id: int, data: bytes, max_frame: int = 4096) -> bytes:
    """``data`` for mux conn ``conn_id`` as frames of at most ``max_frame``
    bytes each, header included, concatenated. Empty ``data`` is no frame.
    Raises ValueError for a conn id outside 1..2**32-1 or a ``max_frame`` of
    8 bytes or less."""
    if not 0 < conn_id < 2**32:
        raise ValueError(f"mux conn id {conn_id} is outside 1..2**32-1")
    room = min(max_frame - MUX_HEADER_SIZE, MUX_MAX_PAYLOAD)
    if room <= 0:
        raise ValueError(f"max_frame {max_frame} leaves no room after the {MUX_HEADER_SIZE}-byte header")
    out = bytearray()
    for i in range(0, len(data), room):
        chunk = data[i : i + room]
        out += _MUX.pack(conn_id, len(chunk)) + chunk
    return bytes(out)


class MuxReader:
    """Splits the bytes read from an NRI socket into ``(conn_id, payload)``
    mux frames.

    Args:
        max_frame: the largest frame (header included, bytes) this reader
            accepts, as a Go peer reading into a 4096-byte buffer; None: up to
            the mux limit (``MUX_MAX_PAYLOAD`` + 8).
    ``feed`` raises ``WireError`` for a frame above the limit.
    """

    def __init__(self, max_frame: int | None = None) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes held that are not a complete frame yet."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Consume ``data``; return the frames it completes, in order."""
        self._buf += data
        frames: list[tuple[int, bytes]] = []
        pos = 0
        while len(self._buf) - pos >= MUX_HEADER_SIZE:
            conn_id, length = _MUX.unpack_from(self._buf, pos)
            size = MUX_HEADER_SIZE + length
            if length > MUX_MAX_PAYLOAD or (self.max_frame is not None and size > self.max_frame):
                limit = self.max_frame if self.max_frame is not None else MUX_MAX_PAYLOAD + MUX_HEADER_SIZE
                raise WireError(f"mux frame of {size} bytes on conn {conn_id} exceeds the reader's buffer "
                                f"of {limit} bytes")
            if len(self._buf) - pos < size:
                break
            frames.append((conn_id, bytes(self._buf[pos + MUX_HEADER_SIZE : pos + size])))
            pos += size
        del self._buf[:pos]
        return frames


def ttrpc_frame(stream_id: int, msg_type: int, data: bytes, flags: int = 0) -> bytes:
    """One ttrpc message: the 10-byte header, then ``data`` (no size check:
    tests use it to send oversized or malformed messages)."""
    return _TTRPC.pack(len(data), stream_id, msg_type, flags) + data


@dataclass(frozen=True)
class TtrpcMessage:
    """One ttrpc message read from a conn. ``data`` is None when the message
    was longer than ``TTRPC_MAX_DATA`` (its bytes were discarded) and
    ``length`` holds the announced size."""

    stream_id: int
    msg_type: int
    flags: int
    data: bytes | None
    length: int


class TtrpcReader:
    """Splits one mux conn's byte stream into ttrpc messages.

    A message longer than ``TTRPC_MAX_DATA`` is discarded (yielded with
    ``data=None``), as the Go receiver does; an announced length of 16 MiB or
    more (the "reserved" first byte not 0) cannot come from a ttrpc peer and
    raises ``WireError``.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skip = 0
        self._skipped: TtrpcMessage | None = None

    @property
    def pending(self) -> int:
        """Bytes of an incomplete message held or still to discard."""
        return len(self._buf) + self._skip

    def feed(self, data: bytes) -> list[TtrpcMessage]:
        """Consume ``data``; return the messages it completes, in order."""
        out: list[TtrpcMessage] = []
        if self._skip:
            n = min(self._skip, len(data))
            self._skip -= n
            data = data[n:]
            if self._skip == 0 and self._skipped is not None:
                out.append(self._skipped)
                self._skipped = None
        self._buf += data
        pos = 0
        while len(self._buf) - pos >= TTRPC_HEADER_SIZE and not self._skip:
            length, stream_id, msg_type, flags = _TTRPC.unpack_from(self._buf, pos)
            if length >= 1 << 24:
                raise WireError(f"ttrpc header announces {length} bytes on stream {stream_id}: not a ttrpc stream")
            if length > TTRPC_MAX_DATA:
                body = len(self._buf) - pos - TTRPC_HEADER_SIZE
                msg = TtrpcMessage(stream_id, msg_type, flags, None, length)
                if body >= length:
                    pos += TTRPC_HEADER_SIZE + length
                    out.append(msg)
                    continue
                self._skip, self._skipped = length - body, msg
                pos = len(self._buf)
                break
            end = pos + TTRPC_HEADER_SIZE + length
            if end > len(self._buf):
                break
            out.append(TtrpcMessage(stream_id, msg_type, flags, bytes(self._buf[pos + TTRPC_HEADER_SIZE : end]),
                                    length))
            pos = end
        del self._buf[:pos]
        return out


# ------------------------------------------------------- protobuf envelopes

_VARINT, _LEN = 0, 2


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int32/int64 negatives: 10-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(num: int, wire: int) -> bytes:
    return _varint(num << 3 | wire)


def _len_field(num: int, data: bytes) -> bytes:
    return _key(num, _LEN) + _varint(len(data)) + data if data else b""


def _varint_field(num: int, n: int) -> bytes:
    return _key(num, _VARINT) + _varint(n) if n else b""


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("protobuf varint runs past the end of the message")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7
        if shift >= 70:
            raise WireError("protobuf varint longer than 10 bytes")


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of a protobuf message: int for varints,
    bytes for length-delimited fields; fixed32/64 are skipped. Raises
    WireError for a truncated message or a group / unknown wire type."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        num, wire = key >> 3, key & 7
        if num == 0:
            raise WireError("protobuf field number 0")
        if wire == _VARINT:
            v, pos = _read_varint(buf, pos)
            out.append((num, v))
        elif wire == _LEN:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise WireError(f"protobuf field {num} announces {n} bytes, {len(buf) - pos} left")
            out.append((num, bytes(buf[pos : pos + n])))
            pos += n
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > len(buf):
                raise WireError(f"protobuf field {num} is truncated")
        else:
            raise WireError(f"protobuf wire type {wire} (field {num}) is not used by ttrpc envelopes")
    return out


def _signed(n: int, bits: int) -> int:
    n &= (1 << 64) - 1
    if n >= 1 << 63:
        n -= 1 << 64
    return n if bits == 64 else ((n + (1 << 31)) % (1 << 32)) - (1 << 31)


@dataclass(frozen=True)
class Request:
    """A ttrpc ``Request`` envelope. ``timeout_nano``: the caller's time left,
    nanoseconds (0: none); ``metadata``: (key, value) pairs in wire order."""

    service: str
    method: str
    payload: bytes = b""
    timeout_nano: int = 0
    metadata: tuple[tuple[str, str], ...] = field(default=())


@dataclass(frozen=True)
class Response:
    """A ttrpc ``Response`` envelope. ``code`` 0 (or no status) is OK.
    ``has_status`` / ``has_payload``: the field was on the wire although empty
    (a Go server omits both on an empty success; other peers may not), so a
    decoded message re-encodes to the same bytes."""

    code: int = 0
    message: str = ""
    payload: bytes = b""
    has_status: bool = False
    has_payload: bool = False

    @property
    def ok(self) -> bool:
        return self.code == 0


def encode_request(req: Request) -> bytes:
    """The protobuf bytes of ``req`` (fields 1-5 in order, defaults omitted)."""
    md = b""
    for k, v in req.metadata:
        kv = _len_field(1, k.encode()) + _len_field(2, v.encode())
        md += _key(5, _LEN) + _varint(len(kv)) + kv  # a repeated message entry is written even when empty
    return (_len_field(1, req.service.encode()) + _len_field(2, req.method.encode()) + _len_field(3, req.payload)
            + _varint_field(4, req.timeout_nano) + md)


def decode_request(data: bytes) -> Request:
    """A ``Request`` from its protobuf bytes. Raises WireError when they do
    not parse or a field has the wrong wire type."""
    service = method = ""
    payload = b""
    timeout = 0
    md: list[tuple[str, str]] = []
    try:
        for num, v in _fields(data):
            if num == 1 and isinstance(v, bytes):
                service = v.decode()
            elif num == 2 and isinstance(v, bytes):
                method = v.decode()
            elif num == 3 and isinstance(v, bytes):
                payload = v
            elif num == 4 and isinstance(v, int):
                timeout = _signed(v, 64)
            elif num == 5 and isinstance(v, bytes):
                kv = dict(_fields(v))
                k, val = kv.get(1, b""), kv.get(2, b"")
                if not isinstance(k, bytes) or not isinstance(val, bytes):
                    raise WireError("metadata KeyValue with a non-string field")
                md.append((k.decode(), val.decode()))
            elif num in (1, 2, 3, 4, 5):
                raise WireError(f"ttrpc Request field {num} has the wrong wire type")
    except UnicodeDecodeError as exc:
        raise WireError(f"ttrpc Request string is not UTF-8: {exc}") from None
    return Request(service, method, payload, timeout, tuple(md))


def encode_response(resp: Response) -> bytes:
    """The protobuf bytes of ``resp``: no status for OK (as the Go server),
    else ``Status{code, message}``; then the payload."""
    status = b""
    if resp.code or resp.has_status:
        inner = _varint_field(1, resp.code) + _len_field(2, resp.message.encode())
        status = _key(1, _LEN) + _varint(len(inner)) + inner
    payload = _key(2, _LEN) + _varint(len(resp.payload)) + resp.payload if resp.payload or resp.has_payload else b""
    return status + payload


def decode_response(data: bytes) -> Response:
    """A ``Response`` from its protobuf bytes. Raises WireError when they do
    not parse."""
    code, message, payload, has_status, has_payload = 0, "", b"", False, False
    try:
        for num, v in _fields(data):
            if num == 1 and isinstance(v, bytes):
                has_status = True
                for snum, sv in _fields(v):
                    if snum == 1 and isinstance(sv, int):
                        code = _signed(sv, 32)
                    elif snum == 2 and isinstance(sv, bytes):
                        message = sv.decode()
            elif num == 2 and isinstance(v, bytes):
                payload, has_payload = v, True
            elif num in (1, 2):
                raise WireError(f"ttrpc Response field {num} has the wrong wire type")
    except UnicodeDecodeError as exc:
        raise WireError(f"ttrpc Response status message is not UTF-8: {exc}") from None
    return Response(code, message, payload, has_status, has_payload)
