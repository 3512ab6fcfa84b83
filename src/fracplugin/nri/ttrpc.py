"""Sans-I/O ttrpc (containerd/ttrpc) for unary calls, one object per connection.

Concurrency model: none. ``TtrpcConnection`` is a plain state machine in the
style of h2 (bytes in through ``receive_data``, events out; ``send_*`` queue
bytes that ``data_to_send`` drains); the caller serialises access.

Wire format (docs/reference/nri-protocol.md section 1.3, from containerd/ttrpc
``PROTOCOL.md`` / ``channel.go`` / ``server.go``): a 10-byte big-endian header
(data length ``u32``, stream id ``u32``, message type ``u8``: 1 request,
2 response, 3 data; flags ``u8``), then a ``ttrpc.Request`` or
``ttrpc.Response`` protobuf. Rules implemented here:

- data over 4 MiB (``MAX_MESSAGE``) is discarded unbuffered and such a request
  answered ``RESOURCE_EXHAUSTED`` (as the Go receiver does); a length of
  16 MiB or more (a "reserved" first byte not 0) comes from no ttrpc peer and
  is a protocol error (discarding gigabytes would hang the connection);
- a client uses odd, strictly increasing stream ids; a server answers an even
  or non-increasing id ``INVALID_ARGUMENT`` with the Go messages (below);
- a response without ``status`` (or with code 0) is OK; a request that does
  not decode is answered ``INVALID_ARGUMENT``;
- an outgoing response over 4 MiB is replaced by a ``RESOURCE_EXHAUSTED``
  error; an outgoing request that large raises ``MessageTooLarge``.

Any malformed input surfaces only as ``TtrpcError`` (drop the connection) or
as an event; nothing else is raised by ``receive_data``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import NamedTuple, Union

from .._proto import ttrpc_pb2
from ..rpcstatus import StatusCode

HEADER_SIZE = 10
MAX_MESSAGE = 4 << 20
"""Largest ttrpc data length, bytes (ttrpc ``messageLengthMax``)."""

_DISCARD_LIMIT = (1 << 24) - 1
"""Largest length we are willing to skip; beyond it the stream is garbage."""

_HEADER = struct.Struct(">IIBB")


class MessageType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


Code = StatusCode
"""gRPC status codes used on the wire (google.rpc.Code): the one ``rpcstatus.StatusCode``."""


class Role(enum.Enum):
    """Our role on one ttrpc connection: CLIENT sends requests, SERVER answers."""

    CLIENT = "client"
    SERVER = "server"


class TtrpcError(Exception):
    """The ttrpc byte stream is broken (garbage header, truncated message at
    EOF, stream id space exhausted). The connection must be dropped."""


class MessageTooLarge(ValueError):
    """An outgoing request would exceed ``MAX_MESSAGE`` bytes."""


class RpcError(Exception):
    """An error status of one call: raised by handlers to answer with
    ``code``/``message``, and used by callers to report an error response."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{_code_name(code)}: {message}")
        self.code = int(code)
        self.message = message


def _code_name(code: int) -> str:
    try:
        return Code(code).name
    except ValueError:
        return f"code {code}"


class RequestReceived(NamedTuple):
    """A complete, valid request (server role). Answer it exactly once with
    ``send_response`` or ``send_error``. ``timeout_nano`` is the caller's time
    left in nanoseconds (0 = none); request metadata is not kept (NRI sends
    none, docs/reference/nri-protocol.md 1.3)."""

    stream_id: int
    service: str
    method: str
    payload: bytes
    timeout_nano: int = 0


class ResponseReceived(NamedTuple):
    """The answer to one of our requests (client role). ``code`` 0 = OK."""

    stream_id: int
    code: int
    message: str
    payload: bytes

    def raise_for_status(self) -> bytes:
        """Return the payload, or raise ``RpcError`` for an error status."""
        if self.code != Code.OK:
            raise RpcError(self.code, self.message)
        return self.payload


class RequestRejected(NamedTuple):
    """A request we answered ourselves with an error (bad stream id,
    undecodable, oversized). Informational: the reply is already queued."""

    stream_id: int
    code: int
    message: str


class MessageIgnored(NamedTuple):
    """A frame that has no meaning for our role (a response to an unknown
    stream, a data frame, an unknown type, an oversized response)."""

    stream_id: int
    msg_type: int
    reason: str


Event = Union[RequestReceived, ResponseReceived, RequestRejected, MessageIgnored]


@dataclass
class _Discard:
    stream_id: int
    msg_type: int
    length: int
    remaining: int


class TtrpcConnection:
    """One ttrpc connection (for NRI: one mux conn) seen from one side.

    ``role`` SERVER: ``receive_data`` yields ``RequestReceived`` (plus
    ``RequestRejected`` / ``MessageIgnored``); answer with ``send_response`` /
    ``send_error``. ``role`` CLIENT: ``send_request`` returns the new stream id;
    ``receive_data`` yields ``ResponseReceived`` for streams in flight.

    The data-length limit is ``MAX_MESSAGE`` (4 MiB).
    """

    def __init__(self, role: Role) -> None:
        self.role = role
        self._in = bytearray()
        self._out = bytearray()
        self._discard: _Discard | None = None
        self._closed = False
        # client state
        self._next_stream_id = 1
        self._in_flight: set[int] = set()
        # server state
        self._last_stream_id = 0
        self._awaiting: set[int] = set()

    def data_to_send(self) -> bytes:
        """Drain and return the bytes queued by ``send_*`` and by automatic
        error replies."""
        out = bytes(self._out)
        self._out.clear()
        return out

    # ---------------------------------------------------------------- receive

    def receive_data(self, data: bytes) -> list[Event]:
        """Consume ``data`` (any split of the stream) and return the events it
        completes. Raises ``TtrpcError`` on a garbage header; the connection is
        closed afterwards and every later call raises ``TtrpcError``."""
        if self._closed:
            raise TtrpcError("ttrpc connection is closed")
        events: list[Event] = []
        view = memoryview(data)
        if self._discard is not None:
            view = self._skip(view, events)
        if len(view):
            self._in += view
        buf = self._in
        pos = 0
        while self._discard is None and len(buf) - pos >= HEADER_SIZE:
            length, stream_id, mtype, flags = _HEADER.unpack_from(buf, pos)
            if length > _DISCARD_LIMIT:
                self._closed = True
                self._in = bytearray()
                raise TtrpcError(
                    f"ttrpc header announces {length} bytes on stream {stream_id}: not a ttrpc stream"
                )
            if length > MAX_MESSAGE:
                pos += HEADER_SIZE
                self._discard = _Discard(stream_id, mtype, length, length)
                tail = memoryview(bytes(buf[pos:]))
                del buf[:]
                pos = 0
                rest = self._skip(tail, events)
                buf += rest
                continue
            end = pos + HEADER_SIZE + length
            if end > len(buf):
                break
            body = bytes(buf[pos + HEADER_SIZE : end])
            pos = end
            self._dispatch(stream_id, mtype, flags, body, events)
        if pos:
            del buf[:pos]
        return events

    def receive_eof(self) -> None:
        """Mark the end of the stream; raises ``TtrpcError`` when a message was
        cut short."""
        self._closed = True
        pending = len(self._in) + (self._discard.remaining if self._discard else 0)
        self._in = bytearray()
        if pending:
            raise TtrpcError(f"connection closed inside a ttrpc message ({pending} bytes missing or pending)")

    def _skip(self, view: memoryview, events: list[Event]) -> memoryview:
        d = self._discard
        assert d is not None
        n = min(d.remaining, len(view))
        d.remaining -= n
        if d.remaining == 0:
            self._discard = None
            self._oversized(d, events)
        return view[n:]

    def _oversized(self, d: _Discard, events: list[Event]) -> None:
        reason = f"message length {d.length} exceeds maximum message size of {MAX_MESSAGE}"
        if self.role is Role.SERVER and d.msg_type == MessageType.REQUEST:
            if self._accept_stream_id(d.stream_id, events):
                self._reject(d.stream_id, Code.RESOURCE_EXHAUSTED, reason, events)
        elif self.role is Role.CLIENT and d.msg_type == MessageType.RESPONSE and d.stream_id in self._in_flight:
            self._in_flight.discard(d.stream_id)
            events.append(ResponseReceived(d.stream_id, Code.RESOURCE_EXHAUSTED, reason, b""))
        else:
            events.append(MessageIgnored(d.stream_id, d.msg_type, reason))

    def _dispatch(self, stream_id: int, mtype: int, flags: int, body: bytes, events: list[Event]) -> None:
        if self.role is Role.SERVER:
            if mtype != MessageType.REQUEST:
                events.append(MessageIgnored(stream_id, mtype, "only requests are served on this connection"))
                return
            if not self._accept_stream_id(stream_id, events):
                return
            try:
                req = ttrpc_pb2.Request.FromString(body)
                event = RequestReceived(stream_id, req.service, req.method, bytes(req.payload), int(req.timeout_nano))
            except Exception as exc:  # protobuf DecodeError and friends: garbage payload
                self._reject(stream_id, Code.INVALID_ARGUMENT, f"unmarshal request error: {exc}", events)
                return
            self._awaiting.add(stream_id)
            events.append(event)
            return
        # client role
        if mtype != MessageType.RESPONSE:
            events.append(MessageIgnored(stream_id, mtype, "only responses are expected on this connection"))
            return
        if stream_id not in self._in_flight:
            events.append(MessageIgnored(stream_id, mtype, "response for a stream not in flight"))
            return
        self._in_flight.discard(stream_id)
        try:
            resp = ttrpc_pb2.Response.FromString(body)
            if resp.HasField("status"):
                code, message = int(resp.status.code), resp.status.message
            else:
                code, message = Code.OK, ""
            events.append(ResponseReceived(stream_id, code, message, bytes(resp.payload)))
        except Exception as exc:
            events.append(ResponseReceived(stream_id, Code.INTERNAL, f"unmarshal response error: {exc}", b""))

    def _accept_stream_id(self, stream_id: int, events: list[Event]) -> bool:
        if stream_id % 2 != 1:
            msg = "StreamID must be odd for client initiated streams"
        elif stream_id <= self._last_stream_id:
            msg = "StreamID cannot be re-used and must increment"
        else:
            self._last_stream_id = stream_id
            return True
        self._reject(stream_id, Code.INVALID_ARGUMENT, msg, events)
        return False

    def _reject(self, stream_id: int, code: int, message: str, events: list[Event]) -> None:
        """Answer a request with an error ourselves and say so (``RequestRejected``)."""
        self._queue_error(stream_id, code, message)
        events.append(RequestRejected(stream_id, code, message))

    # ------------------------------------------------------------------- send

    def send_request(self, service: str, method: str, payload: bytes, *, timeout_nano: int = 0) -> int:
        """Client: queue a unary request and return its stream id (odd,
        increasing). Raises ``MessageTooLarge`` above ``MAX_MESSAGE`` bytes,
        ``TtrpcError`` when the stream id space is exhausted and ValueError
        in the SERVER role."""
        if self.role is not Role.CLIENT:
            raise ValueError("send_request needs the CLIENT role")
        stream_id = self._next_stream_id
        if stream_id >= 2**32:
            raise TtrpcError("ttrpc stream ids exhausted on this connection")
        body = ttrpc_pb2.Request(service=service, method=method, payload=payload,
                                 timeout_nano=timeout_nano).SerializeToString()
        if len(body) > MAX_MESSAGE:
            raise MessageTooLarge(f"request of {len(body)} bytes exceeds the ttrpc limit {MAX_MESSAGE}")
        self._next_stream_id += 2
        self._in_flight.add(stream_id)
        self._frame(stream_id, MessageType.REQUEST, body)
        return stream_id

    def send_response(self, stream_id: int, payload: bytes = b"") -> bool:
        """Server: queue the OK answer of ``stream_id`` (status left unset, as
        the Go server does). Returns False when the response exceeded
        ``MAX_MESSAGE`` and a ``RESOURCE_EXHAUSTED`` error was sent instead.
        Raises ValueError for a stream id that is not awaiting an answer."""
        self._take(stream_id)
        body = ttrpc_pb2.Response(payload=payload).SerializeToString() if payload else b""
        if len(body) > MAX_MESSAGE:
            self._queue_error(
                stream_id,
                Code.RESOURCE_EXHAUSTED,
                f"response of {len(body)} bytes exceeds maximum message size of {MAX_MESSAGE}",
            )
            return False
        self._frame(stream_id, MessageType.RESPONSE, body)
        return True

    def send_error(self, stream_id: int, code: int, message: str) -> None:
        """Server: queue an error answer (status set, no payload) for
        ``stream_id``. Raises ValueError for a stream id not awaiting one."""
        self._take(stream_id)
        self._queue_error(stream_id, code, message)

    def _take(self, stream_id: int) -> None:
        if self.role is not Role.SERVER:
            raise ValueError("responses need the SERVER role")
        if stream_id not in self._awaiting:
            raise ValueError(f"stream {stream_id} is not awaiting a response")
        self._awaiting.discard(stream_id)

    def _queue_error(self, stream_id: int, code: int, message: str) -> None:
        # Keep the error reply itself under the limit whatever the message.
        message = message[:65536]
        body = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=int(code), message=message)).SerializeToString()
        self._frame(stream_id, MessageType.RESPONSE, body)

    def _frame(self, stream_id: int, mtype: int, body: bytes) -> None:
        self._out += _HEADER.pack(len(body), stream_id, mtype, 0)
        self._out += body

