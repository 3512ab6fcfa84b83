"""The kubelet door's gRPC transport: grpclib (asyncio + h2) on unix sockets.

ADR 0018: the device plugin server, the Registration client and the
PodResources client speak gRPC through grpclib instead of grpcio, whose core
alone was about 12 MiB of the daemon's resident memory. Everything here runs
on the door's event loop (``aio.LoopThread``); the synchronous callers go
through ``LoopThread.call``.

What this module adds to grpclib:

* ``RpcError``: one error type for every failed call (a ``grpc-status`` from
  the peer, a connection that could not be made or broke, a deadline), with
  our own ``codes.StatusCode`` and the message, so callers never import
  grpclib to handle errors;
* ``unary``: one unary call with a deadline on a fresh or given channel;
  connection failures are retried until the deadline when ``wait_for_ready``
  (grpcio's ``wait_for_ready=True``, which ``registration.probe`` used);
* ``UnixServer``: a grpclib server on a unix socket that also closes its
  accepted connections at ``close`` (grpcio's ``stop(grace=0)`` did; asyncio's
  ``Server.close`` before Python 3.13 leaves them open, and a peer would keep
  calling a server that was replaced);
* ``handler``: a ``grpclib.const.Handler`` for a ``__mapping__`` entry.

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

from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.server import Server

from .codes import StatusCode

Req = TypeVar("Req")
Rep = TypeVar("Rep")

_CONNECT_RETRY_S = 0.05


class RpcError(Exception):
    """A gRPC call that did not succeed.

    Attributes:
        code: ``codes.StatusCode`` (UNAVAILABLE for a connection that could not
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
                call: UnaryUnaryMethod[Any, Rep] = UnaryUnaryMethod(c, method, type(request), reply_type)
                return await call(request, timeout=left)
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
    finally:
        if own:
            c.close()


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


class UnixServer(Server):
    """A grpclib server for ``mapping`` (``/package.Service/Method`` ->
    ``Handler``) that remembers its connections and closes them at ``close``.
    Construct and use it on its event loop."""

    def __init__(self, mapping: Mapping[str, Handler]) -> None:
        super().__init__([_Servable(mapping)])
        self._protocols: list[Any] = []

    def _protocol_factory(self) -> Any:  # grpclib.server.Server's hook for each accepted connection
        proto = super()._protocol_factory()
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


def _alive(proto: Any) -> bool:
    conn = getattr(proto, "connection", None)
    return conn is None or not conn.is_closing()
