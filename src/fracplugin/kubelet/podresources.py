"""PodResources v1 client: which devices kubelet gave which container.

kubelet-device-plugin.md A.7: service ``v1.PodResourcesLister`` on
``/var/lib/kubelet/pod-resources/kubelet.sock`` with ``List`` (GA 1.28) and
``Get`` (1.27+, feature gate ``KubeletPodResourcesGet``; older kubelets answer
UNIMPLEMENTED, then we fall back to ``List``). PodResources carries pod name
and namespace but no pod UID.

Uses: the NRI door confirms at CreateContainer which device IDs kubelet gave a
container (``devices_for``); the device plugin rebuilds its ledger at startup
for containers allocated before a restart (kubelet never re-Allocates, A.5).

Concurrency model: a ``PodResourcesClient`` holds one grpclib channel (ADR
0018), used only on an event loop thread (``aio.LoopThread``: the door's,
passed as ``loop``, or a private one started on first use and stopped by
``close``); the synchronous methods hand each call to that loop and wait for
it, so one client may be shared by threads. A method called from the loop
thread itself raises RuntimeError (it would wait for itself). Every call has
a deadline (``timeout_s``). The socket is dialled lazily, so a kubelet
restart (new socket file) is picked up on the next call after a failure.
"""

from __future__ import annotations

import builtins
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._proto import podresources_pb2 as pb
from . import grpcwire
from .aio import LoopStopped, LoopThread
from ..rpcstatus import StatusCode

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

    def container(self, name: str) -> ContainerDevices | None:
        for c in self.containers:
            if c.name == name:
                return c
        return None


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
        loop: the event loop thread the calls run on (the device plugin
            door's); None: the client starts its own on first use and
            stops it in ``close``.
    """

    _LIST = "/v1.PodResourcesLister/List"
    _GET = "/v1.PodResourcesLister/Get"

    def __init__(self, socket_path: str = DEFAULT_PODRESOURCES_SOCKET, timeout_s: float = 2.0,
                 loop: LoopThread | None = None) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._loop = loop
        self._own_loop: LoopThread | None = None
        self._channel: Any = None  # grpclib Channel, created and used on the loop only
        self._get_unimplemented = False

    def _loop_thread(self) -> LoopThread:
        with self._lock:
            if self._loop is not None:
                return self._loop
            if self._own_loop is None:
                self._own_loop = LoopThread("fracplugin-podresources", workers=1).start()
            return self._own_loop

    async def _call(self, method: str, request: Any, reply_type: type) -> Any:
        if self._channel is None:
            self._channel = grpcwire.channel(self.socket_path)
        try:
            return await grpcwire.unary(self._channel, self.socket_path, method, request, reply_type, self.timeout_s)
        except grpcwire.RpcError as e:
            if e.code not in (StatusCode.UNIMPLEMENTED, StatusCode.NOT_FOUND):
                self._drop_channel()  # dial again next time (kubelet restarted: a new socket)
            raise

    def _drop_channel(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()

    def _run(self, method: str, request: Any, reply_type: type) -> Any:
        """One call on the loop. Raises grpcwire.RpcError; RuntimeError from the loop thread."""
        try:
            return self._loop_thread().call(self._call(method, request, reply_type), self.timeout_s + 1.0)
        except TimeoutError as e:
            raise grpcwire.RpcError(StatusCode.DEADLINE_EXCEEDED, str(e)) from None
        except LoopStopped as e:
            raise grpcwire.RpcError(StatusCode.UNAVAILABLE, str(e)) from None

    def list(self) -> list[PodDevices]:
        """Every pod kubelet knows with its containers' devices. Raises PodResourcesError."""
        try:
            resp = self._run(self._LIST, pb.ListPodResourcesRequest(), pb.ListPodResourcesResponse)
        except grpcwire.RpcError as e:
            raise PodResourcesError(
                f"PodResources List on {self.socket_path} failed: {e.code.name}: {e.message}"
            ) from None
        return [_convert(p) for p in resp.pod_resources]

    def get(self, namespace: str, name: str) -> PodDevices | None:
        """One pod (``Get``; falls back to ``List`` on kubelets without ``Get``).
        None when kubelet does not know the pod. Raises PodResourcesError."""
        if not self._get_unimplemented:
            try:
                resp = self._run(self._GET, pb.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace),
                                 pb.GetPodResourcesResponse)
                return _convert(resp.pod_resources)
            except grpcwire.RpcError as e:
                code = e.code
                if code == StatusCode.UNIMPLEMENTED:
                    self._get_unimplemented = True
                elif code == StatusCode.NOT_FOUND or "not found" in (e.message or "").lower():
                    return None
                else:
                    raise PodResourcesError(
                        f"PodResources Get {namespace}/{name} on {self.socket_path} failed: "
                        f"{code.name}: {e.message}"
                    ) from None
        for p in self.list():
            if p.namespace == namespace and p.name == name:
                return p
        return None

    def devices_for(self, pod_namespace: str, pod_name: str, container: str, resource_name: str) -> builtins.list[str]:
        """Device IDs of ``resource_name`` kubelet gave one container ([] when
        none or unknown). Raises PodResourcesError when kubelet cannot be asked."""
        pod = self.get(pod_namespace, pod_name)
        if pod is None:
            return []
        c = pod.container(container)
        if c is None:
            return []
        return list(c.devices.get(resource_name, ()))

    def close(self) -> None:
        """Close the channel; stop the client's own loop thread if it started one."""
        with self._lock:
            loop = self._loop or self._own_loop
            own, self._own_loop = self._own_loop, None
        if loop is not None and loop.running() and not loop.in_loop_thread():
            async def drop() -> None:
                self._drop_channel()
            try:
                loop.call(drop(), 2.0)
            except (RuntimeError, TimeoutError):
                pass
        if own is not None:
            own.stop()


def devices_for(
    pod_namespace: str,
    pod_name: str,
    container: str,
    resource_name: str,
    *,
    socket_path: str = DEFAULT_PODRESOURCES_SOCKET,
    timeout_s: float = 2.0,
) -> list[str]:
    """One-shot form of ``PodResourcesClient.devices_for`` (opens and closes a
    channel). Raises PodResourcesError."""
    client = PodResourcesClient(socket_path, timeout_s)
    try:
        return client.devices_for(pod_namespace, pod_name, container, resource_name)
    finally:
        client.close()
