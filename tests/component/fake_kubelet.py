"""An in-process kubelet for device plugin tests and the demo.

Plays the parts of kubelet the device plugin talks to
(kubelet-device-plugin.md A.5), over real unix sockets:

* the ``Registration`` server on ``<dir>/kubelet.sock``: on Register it checks
  the version, dials ``<dir>/<endpoint>`` with ``:authority`` ``localhost``
  (blocking, 10 s), calls GetDevicePluginOptions, starts consuming
  ListAndWatch in a thread, and only then answers;
* a client of the plugin (``allocate``, ``preferred``, ``options``);
* ``restart()``: what a kubelet restart does to the directory (every socket
  removed except the checkpoint file, plugin streams dropped, a new
  kubelet.sock);
* ``FakePodResources``: the PodResources v1 ``List``/``Get`` server.

Concurrency: grpc thread pools for the servers, one thread per ListAndWatch
stream; shared state under one condition variable (``wait_for``).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import grpc

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import deviceplugin_pb2_grpc as pb_grpc
from fracplugin._proto import podresources_pb2 as prpb
from fracplugin._proto import podresources_pb2_grpc as prpb_grpc

CHECKPOINT = "kubelet_internal_checkpoint"


@dataclass
class Registration:
    """One Register call kubelet accepted (``at``: time.monotonic())."""

    resource_name: str
    endpoint: str
    options: pb.DevicePluginOptions
    at: float


@dataclass
class _Endpoint:
    resource_name: str
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    stream: object = None
    devices: dict[str, str] = field(default_factory=dict)
    history: list[dict[str, str]] = field(default_factory=list)  # every list received, in order
    updates: int = 0
    open: bool = True


class FakeKubelet(pb_grpc.RegistrationServicer):
    """An in-process kubelet.

    Args:
        plugin_dir: the device plugin directory (kubelet.sock is created in it).
        dial_timeout_s: how long Register waits to reach the plugin (kubelet: 10 s).
    """

    def __init__(self, plugin_dir: str, dial_timeout_s: float = 10.0) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = os.path.join(plugin_dir, "kubelet.sock")
        self.dial_timeout_s = dial_timeout_s
        self.registrations: list[Registration] = []
        self.refuse: str | None = None  # set to make Register fail with this message
        self._cond = threading.Condition()
        self._endpoints: dict[str, _Endpoint] = {}
        self._server: grpc.Server | None = None
        self.restarted_at = 0.0

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> "FakeKubelet":
        os.makedirs(self.plugin_dir, exist_ok=True)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        if server.add_insecure_port("unix:" + self.socket_path) == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        server.start()
        self._server = server
        return self

    def _drop_endpoints(self) -> None:
        with self._cond:
            eps = list(self._endpoints.values())
            self._endpoints.clear()
            self._cond.notify_all()
        for ep in eps:
            ep.open = False
            if ep.stream is not None:
                ep.stream.cancel()  # type: ignore[attr-defined]
            ep.channel.close()

    def stop(self) -> None:
        """Stop serving, drop every plugin connection, remove kubelet.sock."""
        self._drop_endpoints()
        if self._server is not None:
            self._server.stop(grace=0).wait(2)
            self._server = None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def restart(self, downtime_s: float = 0.0) -> float:
        """Simulate a kubelet restart: stop, remove every socket in the plugin
        dir except the checkpoint (CleanupPluginDirectory), wait
        ``downtime_s``, re-create kubelet.sock. Returns time.monotonic() at the
        moment the new kubelet.sock exists."""
        self.stop()
        for name in os.listdir(self.plugin_dir):
            if name == CHECKPOINT:
                continue
            path = os.path.join(self.plugin_dir, name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        if downtime_s:
            time.sleep(downtime_s)
        self.start()
        self.restarted_at = time.monotonic()
        return self.restarted_at

    # ---- Registration service ---------------------------------------------
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if self.refuse:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
        if "/" not in request.resource_name or request.resource_name.startswith("kubernetes.io/"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid resource name {request.resource_name!r}")
        path = os.path.join(self.plugin_dir, request.endpoint)
        channel = grpc.insecure_channel("unix:" + path, options=[("grpc.default_authority", "localhost")])
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout_s)
            stub = pb_grpc.DevicePluginStub(channel)
            opts = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError) as e:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot dial plugin at {path}: {e}")
        ep = _Endpoint(request.resource_name, channel, stub)
        with self._cond:
            old = self._endpoints.get(request.resource_name)
            self._endpoints[request.resource_name] = ep
        with self._cond:
            self.registrations.append(Registration(request.resource_name, request.endpoint, opts, time.monotonic()))
            self._cond.notify_all()
        stream = stub.ListAndWatch(pb.Empty())
        ep.stream = stream
        threading.Thread(target=self._consume, args=(ep, stream), daemon=True).start()
        if old is not None:  # re-registration replaces the endpoint (A.5)
            old.open = False
            if old.stream is not None:
                old.stream.cancel()  # type: ignore[attr-defined]
            old.channel.close()
        return pb.Empty()

    def _consume(self, ep: _Endpoint, stream: object) -> None:
        try:
            for resp in stream:  # type: ignore[attr-defined]
                with self._cond:
                    ep.devices = {d.ID: d.health for d in resp.devices}
                    ep.history.append(ep.devices)
                    ep.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        finally:
            with self._cond:
                ep.open = False
                self._cond.notify_all()

    def drop_stream(self, resource_name: str) -> None:
        """Cancel the ListAndWatch stream of a resource (as kubelet does when it
        drops a plugin) without restarting."""
        ep = self.endpoint(resource_name)
        if ep is not None and ep.stream is not None:
            ep.stream.cancel()  # type: ignore[attr-defined]

    # ---- observing ---------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait until ``predicate()`` (evaluated under the lock) is true."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout=timeout_s)

    def endpoint(self, resource_name: str) -> _Endpoint | None:
        with self._cond:
            return self._endpoints.get(resource_name)

    def devices(self, resource_name: str) -> dict[str, str]:
        """The last ListAndWatch list: device ID -> health."""
        ep = self.endpoint(resource_name)
        return dict(ep.devices) if ep else {}

    def history(self, resource_name: str) -> list[dict[str, str]]:
        """Every ListAndWatch list of the current endpoint, oldest first."""
        ep = self.endpoint(resource_name)
        with self._cond:
            return list(ep.history) if ep else []

    def updates(self, resource_name: str) -> int:
        ep = self.endpoint(resource_name)
        return ep.updates if ep else 0

    def stream_open(self, resource_name: str) -> bool:
        ep = self.endpoint(resource_name)
        return bool(ep and ep.open)

    # ---- calls kubelet makes -------------------------------------------------
    def _stub(self, resource_name: str) -> pb_grpc.DevicePluginStub:
        ep = self.endpoint(resource_name)
        if ep is None:
            raise LookupError(f"{resource_name} is not registered")
        return ep.stub

    def options(self, resource_name: str) -> pb.DevicePluginOptions:
        return self._stub(resource_name).GetDevicePluginOptions(pb.Empty(), timeout=5)

    def allocate(self, resource_name: str, *device_lists: list[str], timeout_s: float = 10.0) -> pb.AllocateResponse:
        """Allocate with one ContainerAllocateRequest per list (kubelet sends one)."""
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in device_lists])
        return self._stub(resource_name).Allocate(req, timeout=timeout_s)

    def preferred(
        self, resource_name: str, available: list[str], must_include: list[str], size: int
    ) -> list[str]:
        req = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
                )
            ]
        )
        resp = self._stub(resource_name).GetPreferredAllocation(req, timeout=5)
        return list(resp.container_responses[0].deviceIDs)


class FakePodResources(prpb_grpc.PodResourcesListerServicer):
    """PodResources v1 server answering from ``self.pods``:
    ``{(namespace, name): {container: {resource: [device ids]}}}``."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        self.get_implemented = True
        self._server: grpc.Server | None = None

    def start(self) -> "FakePodResources":
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        prpb_grpc.add_PodResourcesListerServicer_to_server(self, server)
        if server.add_insecure_port("unix:" + self.socket_path) == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait(2)
            self._server = None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def _pod(self, ns: str, name: str) -> prpb.PodResources:
        conts = []
        for cname, res in self.pods[(ns, name)].items():
            conts.append(
                prpb.ContainerResources(
                    name=cname,
                    devices=[prpb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in res.items()],
                )
            )
        return prpb.PodResources(name=name, namespace=ns, containers=conts)

    def List(self, request: prpb.ListPodResourcesRequest, context: grpc.ServicerContext) -> prpb.ListPodResourcesResponse:
        return prpb.ListPodResourcesResponse(pod_resources=[self._pod(ns, n) for ns, n in self.pods])

    def Get(self, request: prpb.GetPodResourcesRequest, context: grpc.ServicerContext) -> prpb.GetPodResourcesResponse:
        if not self.get_implemented:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Get is not enabled (KubeletPodResourcesGet)")
        key = (request.pod_namespace, request.pod_name)
        if key not in self.pods:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {key[0]}/{key[1]} not found")
        return prpb.GetPodResourcesResponse(pod_resources=self._pod(*key))
