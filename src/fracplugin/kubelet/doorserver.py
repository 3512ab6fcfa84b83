"""The kubelet device plugin door's gRPC server: serve on the socket in
kubelet's device plugin directory (bind a temporary name, rename it into
place), close a server within a budget, and what the registrar asks of its
target (``registration.RegistrationTarget``: the socket's identity, rebind
on a fresh socket or under a new name, the stream counters).

``DoorServer`` is a member of ``deviceplugin.DevicePluginServer`` and the
target its ``registration.Registrar`` drives; the module docstring of
``kubelet/deviceplugin.py`` describes the door and its concurrency model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent import futures
from typing import Callable

import grpc

from .._proto import deviceplugin_pb2 as pb
from .._proto import deviceplugin_pb2_grpc as pb_grpc
from . import grpcopts
from .devicelist import DeviceList
from .registration import socket_identity

log = logging.getLogger("fracplugin.kubelet.deviceplugin")  # the door's log


_Served = tuple[grpc.Server, futures.ThreadPoolExecutor]
"""One running grpcio server of the door and the worker pool it owns."""


class DoorServer:
    """The gRPC server of the door and its socket ``<plugin_dir>/<socket_name>``
    (``socket_path``: the name served now).

    Args:
        plugin_dir: kubelet's device plugin directory.
        socket_name: our socket's file name in it.
        max_workers: grpcio worker threads, and the most RPCs served at once.
        resource_name: the extended resource (for the log).
        servicer: the DevicePlugin service's handlers.
        devices: the ListAndWatch list (its streams end when a new server
            serves; none is served while it is stopping).
        ready: ``() -> bool``, the registrar waits for it before the first Register.
    """

    def __init__(self, plugin_dir: str, socket_name: str, max_workers: int, resource_name: str,
                 servicer: pb_grpc.DevicePluginServicer, devices: DeviceList, ready: Callable[[], bool]) -> None:
        self.plugin_dir = plugin_dir
        self.socket_name = socket_name
        self.socket_path = os.path.join(plugin_dir, socket_name)
        self.max_workers = max_workers
        self._resource_name = resource_name
        self._servicer = servicer
        self._devices = devices
        self.ready = ready
        self._name_gen = 0
        self._bound_path = ""
        self._server: _Served | None = None
        self._socket_id: tuple[int, int] | None = None
        self._server_lock = threading.Lock()

    @staticmethod
    def _close_server(server: _Served, budget_s: float) -> None:
        """Stop ``server`` within ``budget_s`` seconds: stop listening, let
        in-flight calls finish for three quarters of it, then cancel them and
        close every connection (grpcio's ``stop(grace)``), and wait for that
        at most to the end of the budget; then let its worker threads go.
        (A call whose request a peer never finishes sending counts as in
        flight until it is cancelled.)"""
        budget_s = max(budget_s, 0.0)
        grpc_server, pool = server
        done = grpc_server.stop(grace=budget_s * 0.75)
        if not done.wait(budget_s):
            log.warning("device plugin server: calls still being cancelled %.1f s after stop", budget_s)
        pool.shutdown(wait=False, cancel_futures=True)

    def serve(self) -> None:
        """Serve on ``self.socket_path`` (``grpcopts.serve_unix_renamed``: stopping
        the old server can never delete the new socket, ADR 0011 decision 3),
        after stopping the server before it. Raises OSError when the socket
        cannot be bound."""
        with self._server_lock:
            old, self._server = self._server, None
            old_id, old_path = self._socket_id, self._bound_path
        if old is not None:
            self._close_server(old, 2.0)
        if old_path and old_path != self.socket_path and old_id is not None and socket_identity(old_path) == old_id:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old_path)  # our previous name; kubelet dials the new one
        server = grpcopts.serve_unix_renamed(  # a stale socket of an earlier run goes first (A.8)
            self.socket_path, lambda s: pb_grpc.add_DevicePluginServicer_to_server(self._servicer, s),
            self.max_workers, "fracplugin-dp")
        # (-1, -1) when the file is already gone again: never equal to a real
        # identity, so the registrar serves anew.
        sid = socket_identity(self.socket_path) or (-1, -1)
        with self._server_lock:
            self._server = server
            self._socket_id = sid
            self._bound_path = self.socket_path
        self._devices.new_server()
        log.info("device plugin serving %s on %s", self._resource_name, self.socket_path)

    def close(self, budget_s: float) -> None:
        """Stop the server (in-flight calls get ``budget_s``) and remove our
        socket if it is still the one we bound."""
        with self._server_lock:
            server, self._server = self._server, None
            sid, self._socket_id = self._socket_id, None
        if server is not None:
            self._close_server(server, budget_s)
        if sid is not None and socket_identity(self._bound_path) == sid:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._bound_path)

    # ---- registration.RegistrationTarget -------------------------------------
    def socket_identity(self) -> tuple[int, int] | None:
        return self._socket_id

    def rebind(self, new_name: bool) -> None:
        """Serve on a fresh socket (kubelet wiped ours on restart) under the
        configured name (a new kubelet), or with ``new_name`` under a new file
        name ``<stem>-<n>.sock`` (the same kubelet may hold, or be stuck on, the
        old path: kubelet 1.37 refuses a second Register on a path it considers connected)."""
        if self._devices.stopping:
            raise RuntimeError("device plugin is stopping")
        self._name_gen = self._name_gen + 1 if new_name else 0
        stem, ext = os.path.splitext(self.socket_name)
        name = f"{stem}-{self._name_gen}{ext}" if new_name else self.socket_name
        self.socket_path = os.path.join(self.plugin_dir, name)
        self.serve()

    def active_streams(self) -> int:
        return self._devices.active_streams()

    def last_stream_end(self) -> float:
        return self._devices.last_stream_end()

    @staticmethod
    def options() -> pb.DevicePluginOptions:
        """Same answer in RegisterRequest.options and GetDevicePluginOptions (A.5)."""
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
