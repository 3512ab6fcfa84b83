"""An in-process kubelet for device plugin tests, built on the product's
``fracplugin.kubelet.kubelet_client.Kubelet`` (what the demo uses).

Plays the parts of kubelet the device plugin talks to
(kubelet-device-plugin.md A.5), over real unix sockets:

* the ``Registration`` server on ``<dir>/kubelet.sock``: on Register it checks
  the version, dials ``<dir>/<endpoint>`` with ``:authority`` ``localhost``
  (blocking, 10 s), calls GetDevicePluginOptions, starts consuming
  ListAndWatch in a thread, and only then answers;
* a client of the plugin (``allocate``, ``preferred``, ``options``);
* ``restart()``: what a kubelet restart does to the directory (every socket
  removed except the checkpoint file, plugin streams dropped, a new
  kubelet.sock; ``leave_socket=True``: the old kubelet.sock stays while kubelet
  is down, as after SIGTERM);
* the real kubelet's registration semantics (``semantics="1.37"`` default or
  ``"1.35"``; D2-D7 in ``fracplugin.kubelet.kubelet_client``);
* ``FakePodResources``: the PodResources v1 ``List``/``Get`` server.

Concurrency: grpc thread pools for the servers, one thread per ListAndWatch
stream; shared state under one condition variable (``wait_for``).
"""

from __future__ import annotations

import os
import stat
import time

import grpc

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import podresources_pb2 as prpb
from fracplugin._proto import podresources_pb2_grpc as prpb_grpc
from fracplugin.kubelet.kubelet_client import Kubelet, Registration, serve_unix, stop_unix

__all__ = ["CHECKPOINT", "FakeKubelet", "FakePodResources", "Registration"]

CHECKPOINT = "kubelet_internal_checkpoint"


class FakeKubelet(Kubelet):
    """An in-process kubelet: the product's ``Kubelet`` (Registration server,
    dialing, ListAndWatch consumption) plus refusals, restarts, dropped
    streams and per-resource client calls for tests.

    Args:
        plugin_dir: the device plugin directory (kubelet.sock is created in it).
        dial_timeout_s: how long Register waits to reach the plugin (kubelet: 10 s).
    """

    def __init__(self, plugin_dir: str, dial_timeout_s: float = 10.0, semantics: str = "1.37") -> None:
        super().__init__(plugin_dir, dial_timeout_s, semantics)
        self.refuse: str | None = None  # set to make Register fail with this message
        self.restarted_at = 0.0

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> "FakeKubelet":
        super().start()
        return self

    def restart(self, downtime_s: float = 0.0, leave_socket: bool = False) -> float:
        """Simulate a kubelet restart: stop (``leave_socket``: the dead
        kubelet.sock stays during ``downtime_s``, D4), wait ``downtime_s``,
        remove every socket in the plugin dir except the checkpoint
        (CleanupPluginDirectory, at kubelet start), re-create kubelet.sock.
        Returns time.monotonic() at the moment the new kubelet.sock exists."""
        self.stop(leave_socket=leave_socket)
        if downtime_s:
            time.sleep(downtime_s)
        for name in os.listdir(self.plugin_dir):
            if name == CHECKPOINT:
                continue
            path = os.path.join(self.plugin_dir, name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self.start()
        self.restarted_at = time.monotonic()
        return self.restarted_at

    # ---- Registration service ---------------------------------------------
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if self.refuse:
            self._refuse(context, self.refuse)
        return super().Register(request, context)

    def drop_stream(self, resource_name: str) -> None:
        """Cancel the ListAndWatch stream of a resource (as kubelet does when it
        drops a plugin) without restarting."""
        ep = self.endpoint(resource_name)
        if ep is not None and ep.stream is not None:
            ep.stream.cancel()

    # ---- observing ---------------------------------------------------------
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
        self._server = serve_unix(self.socket_path, prpb_grpc.add_PodResourcesListerServicer_to_server, self, 2)
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        stop_unix(server, self.socket_path)

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
