"""The kubelet side of the device plugin API, small and reusable: what
``fracplugin demo`` uses to act as kubelet towards the daemon.

``KubeletSim`` serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` and,
on ``Register``, does what kubelet does before answering
(kubelet-device-plugin.md A.5): checks the version, dials
``<dir>/<endpoint>`` with ``:authority`` ``localhost`` (A.8), calls
``GetDevicePluginOptions`` and starts consuming ``ListAndWatch``. Then the
caller can ``allocate(n)``: pick ``n`` healthy device IDs (asking
``GetPreferredAllocation`` when the plugin offers it) and call ``Allocate``
with one container request, as kubelet does per container.

A driver for demos and tests, not kubelet: no checkpoint, no pod admission.

Concurrency model: grpc's thread pool serves Registration; one thread
consumes the ListAndWatch stream; shared state sits under one condition
variable. ``allocate`` runs on the caller's thread.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from typing import Any

import grpc

from .._proto import deviceplugin_pb2 as pb
from .._proto import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

VERSION = "v1beta1"
HEALTHY = "Healthy"


class KubeletSim(pb_grpc.RegistrationServicer):
    """Registration server + device plugin client for one resource.

    Args:
        plugin_dir: the device plugin directory; ``kubelet.sock`` is created there.
        dial_timeout_s: how long Register waits to reach the plugin (kubelet: 10 s).
    """

    def __init__(self, plugin_dir: str, dial_timeout_s: float = 10.0) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = os.path.join(plugin_dir, "kubelet.sock")
        self.dial_timeout_s = dial_timeout_s
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.DevicePluginStub | None = None
        self._stream: Any = None
        self.resource_name: str | None = None
        self.options: pb.DevicePluginOptions | None = None
        self.devices: dict[str, str] = {}  # device ID -> health
        self.updates = 0
        self.stream_open = False
        self.allocated: set[str] = set()

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> "KubeletSim":
        """Serve Registration on ``kubelet.sock`` (a stale file is removed)."""
        os.makedirs(self.plugin_dir, exist_ok=True)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Stop serving, end the stream, close the channel, remove kubelet.sock."""
        if self._stream is not None:
            self._stream.cancel()
        if self._channel is not None:
            self._channel.close()
        if self._server is not None:
            self._server.stop(0).wait(2)
            self._server = None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    # ---- Registration service ------------------------------------------------------
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:  # noqa: N802
        if request.version != VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported API version {request.version!r}")
        target = os.path.join(self.plugin_dir, request.endpoint)
        channel = grpc.insecure_channel(f"unix://{target}", options=[("grpc.default_authority", "localhost")])
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout_s)
            stub = pb_grpc.DevicePluginStub(channel)
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the plugin at {target}: {exc}")
        old = self._channel
        stream = stub.ListAndWatch(pb.Empty())
        with self._cond:
            self._channel, self._stub, self._stream = channel, stub, stream
            self.resource_name, self.options = request.resource_name, options
            self.stream_open = True
            self._cond.notify_all()
        if old is not None:
            old.close()
        threading.Thread(target=self._consume, args=(stream,), name="kubelet-sim-lw", daemon=True).start()
        return pb.Empty()

    def _consume(self, stream: Any) -> None:
        try:
            for resp in stream:
                with self._cond:
                    self.devices = {d.ID: d.health for d in resp.devices}
                    self.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        with self._cond:
            if self._stream is stream:
                self.stream_open = False
                self.devices = {}
            self._cond.notify_all()

    # ---- client ----------------------------------------------------------------------
    def wait_registered(self, timeout_s: float = 10.0) -> str:
        """Block until a plugin registered and sent its device list; returns the
        resource name. Raises TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.stream_open and self.updates > 0, timeout_s):
                raise TimeoutError(f"no device plugin registered on {self.socket_path} within {timeout_s} s")
            assert self.resource_name is not None
            return self.resource_name

    def pick(self, n: int) -> list[str]:
        """``n`` healthy, unallocated device IDs, as kubelet chooses them: the
        plugin's preference when it offers GetPreferredAllocation, else the first
        ``n`` in order. Raises ValueError when fewer than ``n`` are free."""
        with self._cond:
            free = sorted(d for d, h in self.devices.items() if h == HEALTHY and d not in self.allocated)
            stub, options = self._stub, self.options
        if len(free) < n:
            raise ValueError(f"{n} devices requested, {len(free)} healthy and free")
        if stub is not None and options is not None and options.get_preferred_allocation_available:
            req = pb.PreferredAllocationRequest(container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=free, allocation_size=n)])
            resp = stub.GetPreferredAllocation(req, timeout=5)
            ids = list(resp.container_responses[0].deviceIDs) if resp.container_responses else []
            if len(ids) == n and set(ids) <= set(free):
                return ids
        return free[:n]

    def allocate(self, device_ids: list[str], timeout_s: float = 10.0) -> pb.ContainerAllocateResponse:
        """``Allocate`` with one container request (as kubelet sends it).
        Returns the container response; raises ``grpc.RpcError`` on refusal."""
        if self._stub is None:
            raise ConnectionError("no device plugin registered")
        resp = self._stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)]),
            timeout=timeout_s)
        if not resp.container_responses:
            raise ValueError("Allocate answered no container response (kubelet treats this as an error)")
        with self._cond:
            self.allocated.update(device_ids)
        return resp.container_responses[0]

    def release(self, device_ids: list[str]) -> None:
        """Forget an allocation (the pod is gone)."""
        with self._cond:
            self.allocated.difference_update(device_ids)
