"""The kubelet device plugin door's gRPC server: serve on the socket in
kubelet's device plugin directory (bind a temporary name, rename it into
place), close a server within a budget, and what the registrar asks of its
target (``registration.RegistrationTarget``: the socket's identity, rebind
on a fresh socket or under a new name, the stream counters).

Split out of ``kubelet/deviceplugin.py`` (issue 26, ADR 0023), moved as it
was: the module docstring of ``kubelet/deviceplugin.py`` describes the door
and its concurrency model; ``DevicePluginServer`` is the one class to use.
"""

from __future__ import annotations

import logging
import os
import threading


from .._proto import deviceplugin_pb2_grpc as pb_grpc
from . import grpcopts
from .doorbase import _Served
from .registration import socket_identity
from .servicer import _DoorAnswers, _Servicer

log = logging.getLogger("fracplugin.kubelet.deviceplugin")  # the door's log, as before the split


class _DoorServing(_DoorAnswers):
    """The gRPC server and its socket (a mixin of ``DevicePluginServer``)."""

    def _init_serving(self) -> None:
        """The ListAndWatch condition and the gRPC server slots (nothing served yet)."""
        self._cond = threading.Condition()
        self._version = 0
        self._response = self._build_response()
        self._stopping = False
        self._gen = 0
        self._streams = 0
        self._last_stream_end = 0.0
        self._server: _Served | None = None
        self._socket_id: tuple[int, int] | None = None
        self._server_lock = threading.Lock()

    # ---- gRPC server (RegistrationTarget) ------------------------------------
    def _close_server(self, server: "_Served", budget_s: float) -> None:
        """Stop ``server`` within ``budget_s`` seconds: stop listening, let
        in-flight calls finish for three quarters of it, then cancel them and
        close every connection (grpcio's ``stop(grace)``), and wait for that
        at most to the end of the budget; then let its worker threads go.
        (A call whose request a peer never finishes sending counts as in
        flight until it is cancelled.)"""
        budget_s = max(budget_s, 0.0)
        done = server.server.stop(grace=budget_s * 0.75)
        if not done.wait(budget_s):
            log.warning("device plugin server: calls still being cancelled %.1f s after stop", budget_s)
        server.pool.shutdown(wait=False, cancel_futures=True)

    def _serve(self) -> None:
        """Serve on ``self.socket_path`` (``grpcopts.serve_unix_renamed``: bound
        under a temporary name, renamed into place, so stopping the old server
        can never delete the new socket; issue 11: the socket deleted again
        right after it was re-created left the plugin serving on no file),
        after stopping the server before it. Raises OSError when the socket
        cannot be bound."""
        with self._server_lock:
            old, self._server = self._server, None
            old_id, old_path = self._socket_id, self._bound_path
        if old is not None:
            self._close_server(old, 2.0)
        if old_path and old_path != self.socket_path and old_id is not None and socket_identity(old_path) == old_id:
            try:
                os.unlink(old_path)  # our previous name; kubelet dials the new one
            except FileNotFoundError:
                pass
        server = _Served(*grpcopts.serve_unix_renamed(  # a stale socket of an earlier run goes first (A.8)
            self.socket_path, lambda s: pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self), s),
            self.max_workers, "fracplugin-dp"))
        # (-1, -1) when the file is already gone again: never equal to a real
        # identity, so the registrar serves anew.
        sid = socket_identity(self.socket_path) or (-1, -1)
        with self._server_lock:
            self._server = server
            self._socket_id = sid
            self._bound_path = self.socket_path
        with self._cond:
            self._gen += 1
            self._cond.notify_all()
        log.info("device plugin serving %s on %s", self.resource_name, self.socket_path)

    def socket_identity(self) -> tuple[int, int] | None:
        return self._socket_id

    def rebind(self) -> None:
        """Serve on a fresh socket (kubelet wiped ours on restart)."""
        if self._stopping:
            raise RuntimeError("device plugin is stopping")
        self._serve()

    def rebind_as_new(self) -> None:
        """Serve on a socket with a new file name ``<stem>-<n>.sock`` (the same
        kubelet may hold, or be stuck on, the old path: kubelet 1.37 refuses a
        second Register on a path it considers connected)."""
        if self._stopping:
            raise RuntimeError("device plugin is stopping")
        self._name_gen += 1
        stem, ext = os.path.splitext(self.socket_name)
        self.socket_path = os.path.join(self.plugin_dir, f"{stem}-{self._name_gen}{ext}")
        self._serve()

    def reset_name(self) -> None:
        """The next ``rebind`` uses the configured socket name (a new kubelet)."""
        self._name_gen = 0
        self.socket_path = os.path.join(self.plugin_dir, self.socket_name)

    def active_streams(self) -> int:
        return self._streams

    def last_stream_end(self) -> float:
        return self._last_stream_end

    def _on_registered(self, seconds: float) -> None:
        self.reregister_ms.append(seconds * 1000.0)
        del self.reregister_ms[:-100]
