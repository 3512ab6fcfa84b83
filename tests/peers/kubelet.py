"""An in-process kubelet for the device plugin tests: its own gRPC servers
(grpcio) and registration handling, nothing from ``fracplugin.kubelet`` or
``fracplugin_demo``, so a registration bug in the product cannot be mirrored
here and pass.

What it copies from kubelet (docs/reference/kubelet-device-plugin.md A.5, A.8; and what a
real kubelet v1.35.4 / v1.37.2 did in issue 11, ``docs/e2e.md``):

* ``Registration`` on ``<dir>/kubelet.sock``: ``Register`` checks the version
  (``v1beta1``) and the resource name (an extended resource: has a ``/`` and
  is not ``kubernetes.io/``), dials ``<dir>/<endpoint>`` with ``:authority``
  ``localhost`` (blocking, ``dial_timeout_s``, kubelet: 10 s), calls
  ``GetDevicePluginOptions``, answers, and only then (D5) consumes
  ``ListAndWatch`` on a thread. Errors are gRPC ``UNKNOWN`` (D3: kubelet
  returns plain Go errors).
* ``semantics="1.37"`` (default): endpoints are kept per socket path; a
  Register on a path whose connection is still open is refused ("device
  plugin already connected: <path>") and that path stays refused until a
  restart (D2: kubelet 1.37 drops its client of the live connection on the
  failed attempt, so the disconnect that would free the path never comes).
  ``semantics="1.35"``: a Register replaces the resource's endpoint.
* ``ListAndWatch``: every message is the full list; when a stream ends and no
  other open endpoint serves the resource, every device turns Unhealthy (D7).
* ``restart()``: the plugin directory at kubelet start (every socket but the
  checkpoint removed, streams dropped, a new kubelet.sock);
  ``stop(leave_socket=True)`` leaves a dead kubelet.sock as SIGTERM does (D4).
* a client of the plugin, one ``ContainerAllocateRequest`` per list, as
  kubelet sends it (``allocate``, ``preferred``, ``options``).

``FakePodResources``: the PodResources v1 ``List``/``Get`` server
(docs/reference/kubelet-device-plugin.md A.7).

Concurrency model: grpc thread pools serve Registration and PodResources; one
thread consumes each ListAndWatch stream; shared state sits under one
condition variable (``wait_for``). Client calls run on the caller's thread.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import deviceplugin_pb2_grpc as pb_grpc
from fracplugin._proto import podresources_pb2 as prpb
from fracplugin._proto import podresources_pb2_grpc as prpb_grpc
from tests.helpers import scaled

__all__ = ["CHECKPOINT", "FakeKubelet", "FakePodResources", "Registration"]

CHECKPOINT = "kubelet_internal_checkpoint"
API_VERSION = "v1beta1"


def _listen(path: str, register: Callable[[grpc.Server], None], workers: int) -> grpc.Server:
    """A started grpc server on unix socket ``path`` (parent created, stale
    file removed). Raises OSError when it cannot bind."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    register(server)
    if server.add_insecure_port(f"unix:{path}") == 0:
        raise OSError(f"grpc cannot listen on {path}")
    server.start()
    return server


def _shutdown(server: grpc.Server | None, path: str) -> None:
    if server is not None:
        server.stop(grace=0).wait(2)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass
class Registration:
    """One Register call kubelet accepted (``at``: time.monotonic(), seconds)."""

    resource_name: str
    endpoint: str
    options: pb.DevicePluginOptions
    at: float


@dataclass(eq=False)
class _Plugin:
    """One registered plugin endpoint: its channel and stub, ListAndWatch
    stream, last device list (ID -> health), every list in order, count,
    whether the stream is open."""

    resource_name: str
    path: str
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    stream: Any = None
    devices: dict[str, str] = field(default_factory=dict)
    history: list[dict[str, str]] = field(default_factory=list)
    updates: int = 0
    open: bool = True

    def drop(self) -> None:
        self.open = False
        if self.stream is not None:
            self.stream.cancel()
        self.channel.close()


class _RegistrationService(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: "FakeKubelet") -> None:
        self.kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:  # noqa: N802
        return self.kubelet._register(request, context)


class FakeKubelet:
    """An in-process kubelet (see the module docstring).

    Args:
        plugin_dir: the device plugin directory; ``kubelet.sock`` is created in it.
        dial_timeout_s: how long Register waits to reach the plugin, seconds (kubelet: 10).
        semantics: ``"1.37"`` or ``"1.35"`` (registration semantics, D2).
    Raises ValueError for another ``semantics``.
    """

    def __init__(self, plugin_dir: str, dial_timeout_s: float = 10.0, semantics: str = "1.37") -> None:
        if semantics not in ("1.37", "1.35"):
            raise ValueError(f"semantics {semantics!r}: must be '1.37' or '1.35'")
        self.plugin_dir = plugin_dir
        self.socket_path = os.path.join(plugin_dir, "kubelet.sock")
        self.dial_timeout_s = dial_timeout_s
        self.semantics = semantics
        self.refuse: str | None = None
        """Set to make every Register fail with this message."""
        self.registrations: list[Registration] = []
        """Every accepted Register, in order."""
        self.refusals: list[str] = []
        """The message of every refused Register, in order."""
        self.restarted_at = 0.0
        self._cond = threading.Condition()
        self._by_resource: dict[str, _Plugin] = {}
        self._by_path: dict[str, _Plugin] = {}
        self._poisoned: set[str] = set()
        self._server: grpc.Server | None = None

    # ---- lifecycle
    def start(self) -> "FakeKubelet":
        """Serve Registration on kubelet.sock (a stale file is removed). Raises OSError."""
        service = _RegistrationService(self)
        self._server = _listen(self.socket_path,
                               lambda s: pb_grpc.add_RegistrationServicer_to_server(service, s), 4)
        return self

    def stop(self, leave_socket: bool = False) -> None:
        """Stop serving, drop every plugin stream, remove kubelet.sock
        (``leave_socket``: a dead kubelet.sock file stays, D4). A later
        ``start`` knows no plugin (a new kubelet process)."""
        with self._cond:
            plugins = set(self._by_resource.values()) | set(self._by_path.values())
            self._by_resource.clear()
            self._by_path.clear()
            self._poisoned.clear()
            self._cond.notify_all()
        for p in plugins:
            p.drop()
        server, self._server = self._server, None
        _shutdown(server, self.socket_path)
        if leave_socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind(self.socket_path)  # the file exists; nobody listens
            finally:
                s.close()

    def restart(self, downtime_s: float = 0.0, leave_socket: bool = False) -> float:
        """A kubelet restart: stop (``leave_socket``: the dead kubelet.sock
        stays during ``downtime_s`` seconds, D4), wait, remove every socket in
        the plugin dir except the checkpoint (CleanupPluginDirectory), serve a
        new kubelet.sock. Returns time.monotonic() once it exists."""
        self.stop(leave_socket=leave_socket)
        if downtime_s:
            time.sleep(downtime_s)  # the simulated downtime itself, not a synchronisation
        for name in os.listdir(self.plugin_dir):
            path = os.path.join(self.plugin_dir, name)
            try:
                if name != CHECKPOINT and stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self.start()
        self.restarted_at = time.monotonic()
        return self.restarted_at

    # ---- Registration
    def _fail(self, context: grpc.ServicerContext, message: str) -> None:
        with self._cond:
            self.refusals.append(message)
            self._cond.notify_all()
        context.abort(grpc.StatusCode.UNKNOWN, message)  # raises

    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if self.refuse:
            self._fail(context, self.refuse)
        if request.version != API_VERSION:
            self._fail(context, f"requested API version {request.version!r} is not supported by kubelet. "
                                f"Supported versions are ['{API_VERSION}']")
        name = request.resource_name
        if "/" not in name or name.startswith("kubernetes.io/"):
            self._fail(context, f"the ResourceName {name!r} is invalid")
        path = os.path.join(self.plugin_dir, request.endpoint)
        channel = grpc.insecure_channel(f"unix:{path}", options=[("grpc.default_authority", "localhost")])
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout_s)
            stub = pb_grpc.DevicePluginStub(channel)
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            self._fail(context, f"failed to dial device plugin: cannot reach the plugin at {path}: {exc}")
        plugin = _Plugin(name, path, channel, stub)
        replaced: _Plugin | None = None
        with self._cond:
            refused = self.semantics == "1.37" and (path in self._by_path or path in self._poisoned)
            if refused:
                self._poisoned.add(path)
            else:
                if self.semantics == "1.35":
                    replaced = self._by_resource.get(name)
                self._by_resource[name] = plugin
                self._by_path[path] = plugin
                self.registrations.append(Registration(name, request.endpoint, options, time.monotonic()))
                self._cond.notify_all()
        if refused:
            channel.close()
            self._fail(context, f"device plugin already connected: {path}")
        # D5: ListAndWatch only once the answer is on its way.
        context.add_callback(lambda: threading.Thread(target=self._watch, args=(plugin,), name="fake-kubelet-lw",
                                                      daemon=True).start())
        if replaced is not None and replaced is not plugin:
            replaced.drop()
        return pb.Empty()

    def _watch(self, plugin: _Plugin) -> None:
        try:
            if plugin.open:
                plugin.stream = plugin.stub.ListAndWatch(pb.Empty())
                for resp in plugin.stream:
                    with self._cond:
                        plugin.devices = {d.ID: d.health for d in resp.devices}
                        plugin.history.append(plugin.devices)
                        plugin.updates += 1
                        self._cond.notify_all()
        except (grpc.RpcError, ValueError):
            pass  # stream cancelled or the plugin went away
        finally:
            with self._cond:
                plugin.open = False
                if self._by_path.get(plugin.path) is plugin and plugin.path not in self._poisoned:
                    del self._by_path[plugin.path]
                serving = [p for p in self._by_path.values() if p.resource_name == plugin.resource_name and p.open]
                if not serving and plugin.devices:  # D7
                    plugin.devices = dict.fromkeys(plugin.devices, "Unhealthy")
                    plugin.history.append(plugin.devices)
                self._cond.notify_all()

    # ---- observing
    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait until ``predicate()`` (evaluated under the lock) is true;
        False after ``timeout_s`` seconds (scaled: ``tests.helpers.scaled``)."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout=scaled(timeout_s))

    def endpoint(self, resource_name: str) -> _Plugin | None:
        """The current endpoint of ``resource_name`` (None when not registered)."""
        with self._cond:
            return self._by_resource.get(resource_name)

    def drop_stream(self, resource_name: str) -> None:
        """Cancel the resource's ListAndWatch stream (kubelet dropping the
        plugin) without restarting."""
        p = self.endpoint(resource_name)
        if p is not None and p.stream is not None:
            p.stream.cancel()

    def devices(self, resource_name: str) -> dict[str, str]:
        """The last ListAndWatch list: device ID -> health."""
        p = self.endpoint(resource_name)
        with self._cond:
            return dict(p.devices) if p else {}

    def history(self, resource_name: str) -> list[dict[str, str]]:
        """Every ListAndWatch list of the current endpoint, oldest first."""
        p = self.endpoint(resource_name)
        with self._cond:
            return list(p.history) if p else []

    def updates(self, resource_name: str) -> int:
        """ListAndWatch messages received from the current endpoint."""
        p = self.endpoint(resource_name)
        return p.updates if p else 0

    def stream_open(self, resource_name: str) -> bool:
        p = self.endpoint(resource_name)
        return bool(p and p.open)

    # ---- calls kubelet makes
    def _stub(self, resource_name: str) -> pb_grpc.DevicePluginStub:
        p = self.endpoint(resource_name)
        if p is None:
            raise LookupError(f"{resource_name} is not registered")
        return p.stub

    def options(self, resource_name: str) -> pb.DevicePluginOptions:
        return self._stub(resource_name).GetDevicePluginOptions(pb.Empty(), timeout=5)

    def allocate(self, resource_name: str, *device_lists: list[str], timeout_s: float = 10.0) -> pb.AllocateResponse:
        """Allocate with one ContainerAllocateRequest per list (kubelet sends one).
        Raises grpc.RpcError (refused), LookupError (not registered)."""
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)
                                                     for ids in device_lists])
        return self._stub(resource_name).Allocate(req, timeout=timeout_s)

    def preferred(self, resource_name: str, available: list[str], must_include: list[str], size: int) -> list[str]:
        """GetPreferredAllocation for one container: the preferred device IDs."""
        req = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size)])
        resp = self._stub(resource_name).GetPreferredAllocation(req, timeout=5)
        return list(resp.container_responses[0].deviceIDs)


class FakePodResources(prpb_grpc.PodResourcesListerServicer):
    """PodResources v1 server answering from ``self.pods``:
    ``{(namespace, name): {container: {resource: [device ids]}}}``;
    ``get_implemented = False`` answers Get UNIMPLEMENTED (the feature gate off);
    ``lists`` counts the List calls answered (a test waits for a whole
    reconcile pass after a change)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        self.get_implemented = True
        self.lists = 0
        self._server: grpc.Server | None = None

    def start(self) -> "FakePodResources":
        self._server = _listen(self.socket_path, lambda s: prpb_grpc.add_PodResourcesListerServicer_to_server(self, s),
                               2)
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        _shutdown(server, self.socket_path)

    def _pod(self, ns: str, name: str) -> prpb.PodResources:
        return prpb.PodResources(name=name, namespace=ns, containers=[
            prpb.ContainerResources(name=cname, devices=[prpb.ContainerDevices(resource_name=r, device_ids=ids)
                                                         for r, ids in res.items()])
            for cname, res in self.pods[(ns, name)].items()])

    def List(self, request: prpb.ListPodResourcesRequest, context: grpc.ServicerContext) -> prpb.ListPodResourcesResponse:  # noqa: N802
        resp = prpb.ListPodResourcesResponse(pod_resources=[self._pod(ns, n) for ns, n in self.pods])
        self.lists += 1
        return resp

    def Get(self, request: prpb.GetPodResourcesRequest, context: grpc.ServicerContext) -> prpb.GetPodResourcesResponse:  # noqa: N802
        if not self.get_implemented:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Get is not enabled (KubeletPodResourcesGet)")
        key = (request.pod_namespace, request.pod_name)
        if key not in self.pods:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {key[0]}/{key[1]} not found")
        return prpb.GetPodResourcesResponse(pod_resources=self._pod(*key))
