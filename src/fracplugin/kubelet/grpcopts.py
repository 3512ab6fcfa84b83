"""grpcio's settings for the kubelet door, in one place (ADR 0021).

The device plugin server (``deviceplugin.py``), the Registration client
(``registration.py``) and the PodResources client (``podresources.py``) speak
gRPC through grpcio. Everything below is passed from here; nothing else in the
door names a ``grpc.*`` channel argument. Where grpcio's default is what we
want it is not repeated, except for the receive limit, which the door's
contract names (tests and ``devices.DeviceTableTooLarge`` rely on it).

What grpcio's C core already does for the door by default (oversized
messages, induced frames, ping floods, rapid reset) is ADR 0021's list.

Channel argument names: ``include/grpc/impl/channel_arg_names.h`` in
grpc/grpc (the ``GRPC_ARG_*`` constants).
"""

from __future__ import annotations

import contextlib
import os
from concurrent import futures
from typing import Callable, Final

import grpc

from ..rpcstatus import StatusCode

MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
"""The largest gRPC message (bytes) the door receives, as a server and as a
client (ADR 0021 decision 3); a larger one is RESOURCE_EXHAUSTED before it is read."""

MAX_CONCURRENT_STREAMS: Final = 16
"""HTTP/2 streams one connection may hold open at once on the device plugin
server (``grpc.max_concurrent_streams``, ADR 0021 decision 3)."""

MAX_CONNECTIONS: Final = 64
"""Connections a door's server accepts at once (``grpc.max_allowed_incoming_connections``;
grpcio's default is unlimited): a connection past it is closed before its
handshake. kubelet holds one or two per server (issue 34 item 6: 10,000 idle
connections grew the daemon by ~250 MiB, never returned)."""

MAX_CONNECTION_IDLE_MS: Final = 120_000
"""A connection with no RPC for this long is closed with GOAWAY
(``grpc.max_connection_idle_ms``; grpcio's default is never). An open
ListAndWatch stream is an RPC, so kubelet's device plugin connection stays;
its clients (grpc-go) dial again on their next call."""

RECONNECT_BACKOFF_MS: Final = (100, 1000)
"""(first, largest) pause between connection attempts of the door's clients,
ms (``grpc.initial_reconnect_backoff_ms`` / ``grpc.max_reconnect_backoff_ms``, ADR 0021 decision 3)."""


def server_options() -> list[tuple[str, int]]:
    """Channel arguments of the device plugin server (``grpc.server(options=...)``):
    the constants, and ``grpc.so_reuseport`` 0 (a clash on our temporary socket
    name fails instead of sharing; ADR 0021 decision 3)."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
    ]


def client_options() -> list[tuple[str, int | str]]:
    """Channel arguments of every client channel the door opens (kubelet.sock,
    its own socket for the probe, PodResources): ``grpc.default_authority``
    ``localhost`` (what kubelet itself sends, D.9), ``grpc.use_local_subchannel_pool``
    1 (no backoff inherited from a channel that failed while kubelet was down),
    the reconnect backoff and the receive limit (ADR 0021 decision 3)."""
    first, largest = RECONNECT_BACKOFF_MS
    return [
        ("grpc.default_authority", "localhost"),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", largest),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


def serve_unix(path: str, add: Callable[[grpc.Server], None], max_workers: int,
               thread_name_prefix: str) -> tuple[grpc.Server, futures.ThreadPoolExecutor]:
    """A started grpcio server on unix socket ``path`` with the door's
    options (``server_options``), ``max_workers`` handler threads named
    ``thread_name_prefix`` and at most that many concurrent RPCs; ``add``
    registers its servicers. Used by the device plugin door and the DRA door.
    Returns (server, its thread pool). Raises OSError when the socket cannot
    be bound (grpcio raises RuntimeError or returns port 0: both become
    OSError naming ``path``); nothing is left running then."""
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
    server = grpc.server(pool, options=server_options(), maximum_concurrent_rpcs=max_workers)
    add(server)
    try:
        bound = server.add_insecure_port("unix:" + path)
    except RuntimeError as e:  # grpcio raises where older versions returned 0
        bound, why = 0, str(e)
    else:
        why = "grpc could not bind it"
    if bound == 0:
        server.stop(grace=0)
        pool.shutdown(wait=False)
        raise OSError(f"cannot listen on {path}: {why}")
    server.start()
    return server, pool


def serve_unix_renamed(path: str, add: Callable[[grpc.Server], None], max_workers: int,
                       thread_name_prefix: str) -> tuple[grpc.Server, futures.ThreadPoolExecutor]:
    """``serve_unix`` for a socket that kubelet watches (device plugin and
    DRA sockets, plugin registration sockets): a stale socket at ``path`` (an
    earlier run's) is removed, the server is bound under a temporary name in
    the same directory (created if missing) and renamed onto ``path`` once it
    listens, so kubelet's watcher never sees a socket nobody serves yet.
    grpcio's core unlinks the path it bound when its server stops; with the
    rename that is the temporary name, so stopping an old server can never
    delete a newer socket at ``path`` (issue 11). Returns and raises as
    ``serve_unix`` (OSError also when the rename fails; nothing is left
    running then)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    for stale in (path, tmp):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    server, pool = serve_unix(tmp, add, max_workers, thread_name_prefix)
    try:
        os.rename(tmp, path)
    except OSError:
        server.stop(grace=0)  # nothing is left serving under the temporary name
        pool.shutdown(wait=False)
        raise
    return server, pool


def unix_channel(path: str) -> grpc.Channel:
    """An insecure grpcio channel to the unix socket ``path`` with
    ``client_options``. Connects lazily (the first call dials); close it
    with ``close()``."""
    return grpc.insecure_channel("unix:" + path, options=client_options())


def grpc_code(code: StatusCode) -> grpc.StatusCode:
    """Our ``rpcstatus.StatusCode`` as grpcio's enum (same canonical names and numbers)."""
    return grpc.StatusCode[code.name]


def failure(e: grpc.RpcError) -> tuple[StatusCode, str]:
    """(code, details) of a failed grpcio call as our ``rpcstatus.StatusCode``;
    an error that is not a call (grpcio raises none such from a unary call, but
    the type allows it), or a call that has not ended (code None), is UNKNOWN."""
    if isinstance(e, grpc.Call):
        code = e.code()
        return (StatusCode.UNKNOWN if code is None else StatusCode[code.name]), e.details() or ""
    return StatusCode.UNKNOWN, str(e)
