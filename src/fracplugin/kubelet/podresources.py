"""PodResources v1 client: which devices kubelet gave which container.

docs/reference/kubelet-device-plugin.md A.7: service ``v1.PodResourcesLister`` on
``/var/lib/kubelet/pod-resources/kubelet.sock``; we call ``List`` (GA 1.28).
PodResources carries pod name and namespace but no pod UID.

Use: ``Reconciler`` (a member of ``deviceplugin.DevicePluginServer``) rebuilds
the ledger at start (kubelet never re-Allocates, A.5), then reconciles it on
thread ``fracplugin-podresources``.

Concurrency model: a ``PodResourcesClient`` holds one thread-safe grpcio
channel (``grpcopts``), dialled lazily and dropped after a failure
(``list``); calls run on the caller's thread, each with a deadline.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import grpc

from .._proto import podresources_pb2 as pb
from .._proto import podresources_pb2_grpc as pb_grpc
from . import grpcopts
from ..rpcstatus import StatusCode

if TYPE_CHECKING:
    from .allocator import Allocator

log = logging.getLogger("fracplugin.kubelet.deviceplugin")  # the door's log (the reconciler is the door's)

DEFAULT_PODRESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodResourcesError(RuntimeError):
    """The PodResources API could not be reached or answered with an error."""


@dataclass(frozen=True)
class ContainerDevices:
    """One container's devices: resource name -> device IDs."""

    name: str
    devices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class PodDevices:
    """One pod of the PodResources answer (no UID: the API has none)."""

    namespace: str
    name: str
    containers: tuple[ContainerDevices, ...]


def _convert(p: pb.PodResources) -> PodDevices:
    conts = []
    for c in p.containers:
        devs: dict[str, list[str]] = {}
        for d in c.devices:
            devs.setdefault(d.resource_name, []).extend(d.device_ids)
        conts.append(ContainerDevices(c.name, {k: tuple(v) for k, v in devs.items()}))
    return PodDevices(p.namespace, p.name, tuple(conts))


class PodResourcesClient:
    """Client of kubelet's PodResources v1 API.

    Args:
        socket_path: the unix socket (default ``/var/lib/kubelet/pod-resources/kubelet.sock``).
        timeout_s: deadline of each call in seconds.
    """

    def __init__(self, socket_path: str = DEFAULT_PODRESOURCES_SOCKET, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.PodResourcesListerStub | None = None

    def _get_stub(self) -> pb_grpc.PodResourcesListerStub:
        with self._lock:
            if self._stub is None:
                self._channel = grpcopts.unix_channel(self.socket_path)
                self._stub = pb_grpc.PodResourcesListerStub(self._channel)
            return self._stub

    def close(self) -> None:
        """Close the channel (a later call dials again)."""
        with self._lock:
            ch, self._channel, self._stub = self._channel, None, None
        if ch is not None:
            ch.close()

    def list(self) -> list[PodDevices]:
        """Every pod kubelet knows with its containers' devices. Raises
        PodResourcesError; the channel is dropped unless the answer was
        UNIMPLEMENTED / NOT_FOUND (dial again next time: kubelet restarted on
        a new socket)."""
        try:
            resp = self._get_stub().List(pb.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            code, details = grpcopts.failure(e)
            if code not in (StatusCode.UNIMPLEMENTED, StatusCode.NOT_FOUND):
                self.close()
            raise PodResourcesError(f"PodResources List on {self.socket_path} failed: {code.name}: {details}") from None
        return [_convert(p) for p in resp.pod_resources]


class Reconciler:
    """The device plugin door's PodResources upkeep: at start the ledger is
    rebuilt from kubelet's List (``rebuild``), then ``Allocator.reconcile``
    runs every ``interval_s`` seconds on a thread. ``socket`` None: neither.
    Errors are logged, never fatal."""

    def __init__(self, allocator: Allocator, socket: str | None, interval_s: float) -> None:
        self._allocator = allocator
        self.socket = socket
        self.interval_s = interval_s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def rebuild(self, client: PodResourcesClient) -> list[str]:
        """Make the ledger agree with kubelet's PodResources List at start
        (``Allocator.reconcile(initial=True)``: kubelet never calls Allocate
        again for running containers, A.5). Returns warnings. Raises
        PodResourcesError when kubelet cannot be asked."""
        return self._allocator.reconcile(client.list(), initial=True)

    def start(self, warnings: list[str]) -> None:
        """Rebuild from the socket when it is there (best effort: what went
        wrong is appended to ``warnings``), then start the periodic thread."""
        if self.socket and os.path.exists(self.socket):
            client = PodResourcesClient(self.socket)
            try:
                warnings.extend(self.rebuild(client))
            except PodResourcesError as e:
                warnings.append(str(e))
                log.warning("ledger rebuild from PodResources skipped: %s", e)
            finally:
                client.close()
        if self.socket:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="fracplugin-podresources", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Signal the thread to end (``join`` waits for it)."""
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)

    def _loop(self) -> None:
        client: PodResourcesClient | None = None
        try:
            while not self._stop.wait(self.interval_s):
                if not self.socket or not os.path.exists(self.socket):
                    continue
                try:
                    client = client or PodResourcesClient(self.socket)
                    for w in self._allocator.reconcile(client.list()):
                        log.info("PodResources reconcile: %s", w)
                except PodResourcesError as e:
                    if self._stop.is_set():
                        break
                    log.warning("PodResources reconcile skipped: %s", e)
                    # a fresh client next round; this one's connection is closed, not
                    # left open (an error such as UNIMPLEMENTED keeps the channel)
                    if client is not None:
                        client.close()
                    client = None
                except Exception:
                    log.exception("PodResources reconcile failed")
        finally:
            if client is not None:
                client.close()
