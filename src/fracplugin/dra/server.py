"""The DRA door's gRPC servers (grpcio, as the device plugin door: ADR 0021).

Two unix sockets (docs/reference/kubelet-dra.md §1, §2; ADR 0031 item 1):
the DRA service, ``<plugins dir>/gpu-memory.fracplugin.io/dra.sock``, v1 and
v1beta1 (v1beta1 has no ``share_id``), each claim handed to
``prepare.Preparer``; and the registration socket,
``<plugins_registry>/gpu-memory.fracplugin.io-reg.sock``, whose
``NotifyRegistrationStatus`` makes the door ready. Both are bound under a
temporary name and renamed into place (``grpcopts.serve_unix_renamed``);
``stop`` removes both (the registration socket going is how kubelet learns
the plugin left).

Concurrency: grpcio's thread pool serves calls; each Prepare/Unprepare call
handles its claims one after another (kubelet sends one pod's claims per
call); the registration state and the call counts sit under one lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent import futures
from typing import Any, Callable

import grpc

from .._proto import dra_v1_pb2 as v1
from .._proto import dra_v1_pb2_grpc as v1_grpc
from .._proto import dra_v1beta1_pb2 as v1beta1
from .._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from .._proto import pluginregistration_pb2 as reg
from .._proto import pluginregistration_pb2_grpc as reg_grpc
from ..kubelet import grpcopts
from . import DRIVER_NAME
from .prepare import Prepared, Preparer

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""The services we serve, as kubelet's registration expects them (dra/v1 and
dra/v1beta1 ``DRAPluginService``)."""
SOCKET_NAME = "dra.sock"
MAX_WORKERS = 8  # grpcio worker threads per server


class _Dra:
    """The DRAPlugin service of one API version: ``pb`` its messages
    (``dra_v1_pb2`` with ``share_id``, ``dra_v1beta1_pb2`` without), each
    claim handed to the door's ``Preparer``."""

    def __init__(self, door: "DraServer", pb: Any, with_share_id: bool) -> None:
        self.door = door
        self.pb = pb
        self.with_share_id = with_share_id

    def _answer(self, p: Prepared) -> Any:
        if p.error:
            return self.pb.NodePrepareResourceResponse(error=p.error)
        devices = []
        for d in p.devices:
            dev = self.pb.Device(request_names=list(d.request_names), pool_name=d.pool, device_name=d.device,
                                 cdi_device_ids=list(d.cdi_device_ids))
            if self.with_share_id and d.share_id is not None:
                dev.share_id = d.share_id
            devices.append(dev)
        return self.pb.NodePrepareResourceResponse(devices=devices)

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (gRPC name)
        self.door.count("prepare")
        out = self.pb.NodePrepareResourcesResponse()
        for c in request.claims:
            out.claims[c.uid].CopyFrom(self._answer(self.door.preparer.prepare(c.namespace, c.name, c.uid)))
        return out

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.door.count("unprepare")
        out = self.pb.NodeUnprepareResourcesResponse()
        for c in request.claims:
            out.claims[c.uid].CopyFrom(self.pb.NodeUnprepareResourceResponse(
                error=self.door.preparer.unprepare(c.namespace, c.name, c.uid)))
        return out


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, door: "DraServer") -> None:
        self.door = door

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:  # noqa: N802
        self.door.count("get_info")
        return reg.PluginInfo(type=PLUGIN_TYPE, name=DRIVER_NAME, endpoint=self.door.socket_path,
                              supported_versions=list(SUPPORTED_VERSIONS))

    def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,  # noqa: N802
                                 context: grpc.ServicerContext) -> reg.RegistrationStatusResponse:
        self.door.registered(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


class DraServer:
    """The DRA door's two servers (module docstring).

    Args:
        preparer: the decisions (``prepare.Preparer``).
        plugins_dir: kubelet's plugins directory (the DRA socket goes in
            ``<dir>/<driver>/dra.sock``).
        registry_dir: kubelet's ``plugins_registry`` directory.

    ``start`` raises OSError when a socket cannot be bound; ``stop`` is
    bounded and idempotent.
    """

    def __init__(self, preparer: Preparer, plugins_dir: str, registry_dir: str) -> None:
        self.preparer = preparer
        self.socket_path = os.path.join(plugins_dir, DRIVER_NAME, SOCKET_NAME)
        self.registration_path = os.path.join(registry_dir, f"{DRIVER_NAME}-reg.sock")
        self._lock = threading.Lock()
        self._servers: list[tuple[grpc.Server, futures.ThreadPoolExecutor]] = []
        self._registered = False
        self._registration_error = ""
        self._registered_at: float | None = None
        self.calls = {"prepare": 0, "unprepare": 0, "get_info": 0}

    # ---- lifecycle ----------------------------------------------------------
    def start(self) -> "DraServer":
        """Serve the DRA service, then the registration socket (kubelet may
        dial the DRA socket as soon as it reads GetInfo). Raises OSError."""
        def dra(server: grpc.Server) -> None:
            v1_grpc.add_DRAPluginServicer_to_server(_Dra(self, v1, True), server)
            v1beta1_grpc.add_DRAPluginServicer_to_server(_Dra(self, v1beta1, False), server)

        self._serve(self.socket_path, dra, "fracplugin-dra")
        self._serve(self.registration_path,
                    lambda s: reg_grpc.add_RegistrationServicer_to_server(_Registration(self), s), "fracplugin-reg")
        log.info("dra door serving", extra={"socket": self.socket_path, "registration": self.registration_path,
                                            "driver": DRIVER_NAME})
        return self

    def _serve(self, path: str, add: Callable[[grpc.Server], None], prefix: str) -> None:
        server, pool = grpcopts.serve_unix_renamed(path, add, MAX_WORKERS, prefix)
        with self._lock:
            self._servers.append((server, pool))

    def stop(self, timeout_s: float = 2.0) -> None:
        """Remove the registration socket first (kubelet deregisters the
        plugin), then stop both servers within ``timeout_s`` and remove the
        DRA socket."""
        with self._lock:
            servers, self._servers = self._servers, []
            self._registered = False
        for path in (self.registration_path, self.socket_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for server, pool in reversed(servers):
            server.stop(grace=max(timeout_s, 0.0) * 0.5).wait(max(timeout_s, 0.0))
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- registration -------------------------------------------------------
    def count(self, call: str) -> None:
        """One more ``call`` served (``status``'s ``calls``)."""
        with self._lock:
            self.calls[call] += 1

    def registered(self, ok: bool, error: str) -> None:
        """kubelet's NotifyRegistrationStatus: remember the verdict."""
        with self._lock:
            self._registered = ok
            self._registration_error = error
            self._registered_at = time.time() if ok else None
        if ok:
            log.info("dra door registered with kubelet", extra={"driver": DRIVER_NAME})
        else:
            log.warning("kubelet refused the dra door's registration", extra={"driver": DRIVER_NAME,
                                                                              "reason": error})

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): ready once kubelet said the plugin is registered."""
        with self._lock:
            if not self._servers:
                return False, "not serving"
            if self._registered:
                return True, f"registered with kubelet as {DRIVER_NAME}"
            if self._registration_error:
                return False, f"kubelet refused the registration: {self._registration_error}"
            return False, f"waiting for kubelet to dial {self.registration_path}"

    def status(self) -> dict[str, Any]:
        """Sockets, registration, call counts and the preparer's counters."""
        with self._lock:
            reg_state = {"registered": self._registered, "error": self._registration_error,
                         "registered_at": self._registered_at, "calls": dict(self.calls)}
        return {"driver": DRIVER_NAME, "socket": self.socket_path,
                "registration_socket": self.registration_path, **reg_state, "claims": self.preparer.status()}
