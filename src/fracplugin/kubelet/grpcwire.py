"""The kubelet door's gRPC transport: grpclib (asyncio + h2) on unix sockets.

ADR 0018: the device plugin server, the Registration client and the
PodResources client speak gRPC through grpclib instead of grpcio, whose core
alone was about 12 MiB of the daemon's resident memory. Everything here runs
on the door's event loop (``aio.LoopThread``); the synchronous callers go
through ``LoopThread.call``.

What this module adds to grpclib:

* ``RpcError``: one error type for every failed call (a ``grpc-status`` from
  the peer, a connection that could not be made or broke, a deadline), with
  our own ``rpcstatus.StatusCode`` and the message, so callers never import
  grpclib to handle errors;
* ``unary``: one unary call with a deadline on a fresh or given channel;
  connection failures are retried until the deadline when ``wait_for_ready``
  (grpcio's ``wait_for_ready=True``, which ``registration.probe`` used);
* ``UnixServer``: a grpclib server on a unix socket that stops reading a
  peer that does not read (HTTP/2 control-frame floods) and closes its
  accepted connections at ``close`` (grpcio's ``stop(grace=0)`` did; asyncio's
  ``Server.close`` before Python 3.13 leaves them open, and a peer would keep
  calling a server that was replaced);
* ``handler``: a ``grpclib.const.Handler`` for a ``__mapping__`` entry;
* ``recv_request`` and the replies ``unary`` reads: at most
  ``MAX_MESSAGE_BYTES`` (4 MiB) per message, refused with RESOURCE_EXHAUSTED
  before it is read, as grpcio and grpc-go do by default (grpclib has no
  limit: it read whatever length a peer announced into memory); a message
  that does not decode is INTERNAL naming its type (grpcio's answer; grpclib
  answered UNKNOWN "Internal Server Error" and logged a traceback).

Facts of the wire (checked against grpcio peers in the component tests and
a real kubelet in ``make kubelet-e2e``): grpclib's client sends
``:authority`` ``127.0.0.1:50051`` on a unix socket (grpc-go, kubelet's
server, does not check it; grpcio >= 1.57 sent the %-encoded path); the
``grpc-timeout`` header carries each call's deadline; a refusal is
``grpc-status`` + ``grpc-message`` trailers (percent-encoded, decoded by
every gRPC client).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Coroutine, Mapping, Type, TypeVar

from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.protocol import H2Protocol
from grpclib.server import Server

from ..rpcstatus import StatusCode

Req = TypeVar("Req")
Rep = TypeVar("Rep")

_CONNECT_RETRY_S = 0.05

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""The largest gRPC message (bytes, after the 5-byte prefix) the door receives,
as a server and as a client: grpcio's default ``grpc.max_receive_message_length``
(the door's limit before ADR 0018) and grpc-go's default server receive limit
(kubelet's side). Our own largest message, a ListAndWatch answer, is kept
under 3.5 MiB (``devices.DeviceTableTooLarge``)."""


class RpcError(Exception):
    """A gRPC call that did not succeed.

    Attributes:
        code: ``rpcstatus.StatusCode`` (UNAVAILABLE for a connection that could not
            be made or broke, DEADLINE_EXCEEDED for a deadline, else the peer's
            ``grpc-status``).
        message: the peer's ``grpc-message`` or what went wrong locally.
    """

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def grpc_error(code: StatusCode, message: str) -> GRPCError:
    """The exception a grpclib handler raises to answer ``code`` and ``message``."""
    return GRPCError(Status(int(code)), message)


def channel(path: str) -> Channel:
    """A grpclib channel to the unix socket ``path`` (no TLS). Must be called
    on the event loop that will use it (grpclib binds the current loop)."""
    return Channel(path=path)


async def unary(
    ch: Channel | None,
    path: str,
    method: str,
    request: Any,
    reply_type: Type[Rep],
    timeout_s: float,
    *,
    wait_for_ready: bool = False,
) -> Rep:
    """One unary call ``method`` (``/package.Service/Method``) with a deadline
    of ``timeout_s`` seconds (sent as ``grpc-timeout``). ``ch`` None: a channel
    to ``path`` for this call only, closed after it. ``wait_for_ready``:
    retry a connection that cannot be made (socket missing or refusing)
    every 50 ms until the deadline.

    Raises:
        RpcError: the peer answered an error, the connection failed or broke,
            or the deadline passed.
    """
    own = ch is None
    c = channel(path) if ch is None else ch
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RpcError(StatusCode.DEADLINE_EXCEEDED, f"{method} on {path}: no answer within {timeout_s} s")
            try:
                # grpclib's UnaryUnaryMethod.__call__, with a bounded read of the reply
                async with c.request(method, Cardinality.UNARY_UNARY, type(request), reply_type,
                                     timeout=left) as st:
                    await st.send_message(request, end=True)
                    await st.recv_initial_metadata()  # raises GRPCError for a trailers-only refusal
                    with st._wrapper:  # the call's deadline (grpclib's recv_message does the same)
                        reply = await _read_message(st._stream, st._codec, reply_type, f"{method} reply")
                if reply is None:
                    raise RpcError(StatusCode.INTERNAL, f"{method} on {path}: the server answered no message")
                return reply
            except GRPCError as e:
                raise RpcError(StatusCode(e.status.value), e.message or "") from None
            except (asyncio.TimeoutError, TimeoutError):
                raise RpcError(StatusCode.DEADLINE_EXCEEDED,
                               f"{method} on {path}: no answer within {timeout_s} s") from None
            except (ConnectionError, FileNotFoundError, OSError) as e:
                if not wait_for_ready or deadline - time.monotonic() <= _CONNECT_RETRY_S:
                    raise RpcError(StatusCode.UNAVAILABLE, f"{method} on {path}: {e}") from None
                if not own:
                    c.close()
                await asyncio.sleep(_CONNECT_RETRY_S)
            except (StreamTerminatedError, ProtocolError) as e:
                raise RpcError(StatusCode.UNAVAILABLE, f"{method} on {path}: {e}") from None
            except AttributeError as e:
                # grpclib 0.4.9: a peer that closes the connection (e.g. after
                # answering bytes that are not HTTP/2) between the connect and
                # the new stream leaves Connection without its _transport
                raise RpcError(StatusCode.UNAVAILABLE,
                               f"{method} on {path}: the connection closed before the call was sent ({e})") from None
    finally:
        if own:
            c.close()


async def _read_message(raw: Any, codec: Any, message_type: Type[Rep], what: str,
                        max_bytes: int = MAX_MESSAGE_BYTES) -> Rep | None:
    """Read one length-prefixed gRPC message from grpclib's h2 stream ``raw``
    (``grpclib.stream.recv_message`` plus the size rule of gRPC: the 5-byte
    prefix is read first and a length over ``max_bytes`` is refused before
    any of the message is read). None: the peer ended the stream instead.

    Raises:
        GRPCError: RESOURCE_EXHAUSTED (over ``max_bytes``, naming both sizes,
            grpc-go's and grpcio's wording), INTERNAL (compressed flag without
            an agreed encoding, truncated, or not a ``message_type``).
    """
    try:
        prefix = await raw.recv_data(5)
        if not prefix:
            return None
        if prefix[0] != 0:
            raise GRPCError(Status.INTERNAL, f"{what}: compressed flag {prefix[0]} set but no grpc-encoding "
                                             "is supported (identity only)")
        n = int.from_bytes(prefix[1:5], "big")
        if n > max_bytes:
            raise GRPCError(Status.RESOURCE_EXHAUSTED,
                            f"{what}: received message larger than max ({n} vs. {max_bytes})")
        data = await raw.recv_data(n)
    except AssertionError:  # grpclib's Buffer: the stream ended inside the message
        raise GRPCError(Status.INTERNAL, f"{what}: the stream ended inside a message") from None
    try:
        return codec.decode(data, message_type)  # type: ignore[no-any-return]
    except Exception as e:  # protobuf DecodeError: a peer's bytes are never our bug
        raise GRPCError(Status.INTERNAL, f"{what}: cannot decode {message_type.__name__}: {e}") from None


async def recv_request(stream: Any) -> Any:
    """The request of a unary or server-streaming call, for a handler
    (``grpclib.server.Stream``), read under ``MAX_MESSAGE_BYTES``
    (``_read_message``; grpclib's own ``recv_message`` has no limit).

    Raises:
        GRPCError: RESOURCE_EXHAUSTED / INTERNAL as ``_read_message``, or
            INTERNAL when the client sent no message; grpclib answers it as
            the call's status.
    """
    name = getattr(stream._recv_type, "__name__", "request")
    msg = await _read_message(stream._stream, stream._codec, stream._recv_type, name)
    if msg is None:
        raise GRPCError(Status.INTERNAL, f"{name}: the client sent no request message")
    return msg


def handler(fn: Callable[[Any], Coroutine[Any, Any, None]], cardinality: Cardinality,
            request_type: type, reply_type: type) -> Handler:
    """A ``__mapping__`` entry: ``fn(stream)`` serves one call."""
    return Handler(fn, cardinality, request_type, reply_type)


UNARY_UNARY = Cardinality.UNARY_UNARY
UNARY_STREAM = Cardinality.UNARY_STREAM


class _Servable:
    def __init__(self, mapping: Mapping[str, Handler]) -> None:
        self._mapping = dict(mapping)

    def __mapping__(self) -> Mapping[str, Handler]:
        return self._mapping


class _BackpressuredProtocol(H2Protocol):
    """grpclib's server connection, plus: stop reading from the peer while
    writes to it are paused (asyncio's transport buffer over its high-water
    mark, 64 KiB), read again once it drained.

    Why: h2 answers some frames by itself (PING, SETTINGS, and the window
    updates of data it reads); grpclib writes those answers whatever the
    buffer holds. A peer that floods such frames and never reads grew the
    daemon's memory one byte per byte it sent (32 MiB of PINGs: +35 MiB RSS),
    the HTTP/2 "ping flood" / "settings flood" (CVE-2019-9512, CVE-2019-9515);
    grpcio's core refused them (ping strikes, GOAWAY). A peer that reads,
    as kubelet does, never reaches the mark. Streams' DATA already waits for
    the buffer (grpclib's ``write_ready``)."""

    _fp_transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self._fp_transport = transport
        super().connection_made(transport)

    def pause_writing(self) -> None:
        super().pause_writing()
        t = self._fp_transport
        if t is not None and not t.is_closing():
            t.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        t = self._fp_transport
        if t is not None and not t.is_closing():
            t.resume_reading()


class UnixServer(Server):
    """A grpclib server for ``mapping`` (``/package.Service/Method`` ->
    ``Handler``) that remembers its connections and closes them at ``close``,
    and stops reading a connection whose peer does not read its answers
    (``_BackpressuredProtocol``). Construct and use it on its event loop."""

    def __init__(self, mapping: Mapping[str, Handler]) -> None:
        super().__init__([_Servable(mapping)])
        self._protocols: list[Any] = []

    def connection_stats(self) -> list[dict[str, Any]]:
        """Per open connection: ``write_buffer_bytes`` (answers not yet taken
        by the peer), ``reading`` (False while the peer does not read, see
        ``_BackpressuredProtocol``), ``open_streams`` (streams the connection
        still holds), ``streams_started`` and ``streams_reset`` (counted since
        it opened). For tests and diagnostics; call it on the event loop."""
        out = []
        for p in self._protocols:
            t = p._fp_transport
            if t is None or t.is_closing():
                continue
            processor = getattr(p, "processor", None)
            out.append({
                "write_buffer_bytes": t.get_write_buffer_size(),
                "reading": t.is_reading(),
                "open_streams": len(processor.streams) if processor is not None else 0,
                "streams_started": p.connection.streams_started,
                "streams_reset": p.connection.streams_failed,
            })
        return out

    def _protocol_factory(self) -> Any:  # grpclib.server.Server's hook for each accepted connection
        base = super()._protocol_factory()  # registers the connection's handler with the server
        _release_when_done(base.handler)
        proto = _BackpressuredProtocol(base.handler, base.config, base.h2_config)
        self._protocols = [p for p in self._protocols if _alive(p)]
        self._protocols.append(proto)
        return proto

    def close(self) -> None:
        """Stop listening, cancel running handlers, close every connection."""
        super().close()
        for p in self._protocols:
            proc = getattr(p, "processor", None)  # set once the connection was made
            if proc is not None and _alive(p):
                proc.close("server closed")  # closes the transport, cancels the connection's handlers
        self._protocols = []


def _release_when_done(handler: Any) -> None:
    """Make a connection's ``grpclib.server.Handler`` release each stream
    when the stream's task ends, however it ends.

    grpclib releases a stream (drops it from the connection's table) in the
    ``finally`` of its request handler. A stream reset by the peer before
    that task first ran has its task cancelled before it starts, and a
    coroutine cancelled before it starts runs no ``finally``: the stream
    stayed in the table for the life of the connection. HEADERS + RST_STREAM
    in a loop (HTTP/2 "rapid reset", CVE-2023-44487) grew the daemon by
    ~7.5 KiB per stream (50 000: +377 MiB). The release runs at most once."""
    accept = handler.accept

    def accept_and_release(stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        released = False

        def release_once() -> None:
            nonlocal released
            if not released:
                released = True
                release_stream()

        accept(stream, headers, release_once)
        task = handler._tasks.get(stream)
        if task is not None:
            task.add_done_callback(lambda _t: release_once())

    handler.accept = accept_and_release


def _alive(proto: Any) -> bool:
    conn = getattr(proto, "connection", None)
    return conn is None or not conn.is_closing()
