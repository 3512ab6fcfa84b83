"""ListAndWatch of the kubelet device plugin door: the advertised device list
(one ``Device`` per ``devices.DeviceTable`` ID, Healthy or Unhealthy by the
node's ``gpu.health.HealthMonitor``, with its NUMA node) and the streams that
send it.

``DeviceList`` is a member of ``deviceplugin.DevicePluginServer``, whose
module docstring describes the door and its concurrency model. Each open
stream holds one grpcio worker while it waits on the condition variable here.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import grpc

from .._proto import deviceplugin_pb2 as pb
from ..gpu.health import HealthMonitor
from ..model import NodeInfo
from .devices import DeviceTable

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class DeviceList:
    """The device list ListAndWatch sends, and its open streams.

    A stream ends when the door stops (``stop``), when the server it runs on
    is replaced (``new_server``), or when kubelet cancels it."""

    def __init__(self, node: NodeInfo, table: DeviceTable, health: HealthMonitor) -> None:
        self._node = node
        self._table = table
        self._health = health
        self._cond = threading.Condition()
        self._version = 0
        self._response = self._build()
        self.stopping = False
        self._gen = 0
        self._streams = 0
        self._last_stream_end = 0.0

    def _build(self) -> pb.ListAndWatchResponse:
        devices = []
        for gpu in self._node.gpus:
            health = HEALTHY if self._health.healthy(gpu.uuid) else UNHEALTHY
            topo = None
            if gpu.numa_node is not None and gpu.numa_node >= 0:
                topo = pb.TopologyInfo(nodes=[pb.NUMANode(ID=gpu.numa_node)])
            for dev_id in self._table.ids(gpu.uuid):
                d = pb.Device(ID=dev_id, health=health)
                if topo is not None:
                    d.topology.CopyFrom(topo)
                devices.append(d)
        return pb.ListAndWatchResponse(devices=devices)

    def changed(self) -> None:
        """Rebuild the list (a GPU's health changed) and wake every stream."""
        resp = self._build()
        with self._cond:
            self._response = resp
            self._version += 1
            self._cond.notify_all()

    def current(self) -> pb.ListAndWatchResponse:
        """The list ListAndWatch sends now."""
        with self._cond:
            return self._response

    def stream(self, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        """Serve one ListAndWatch stream on a worker: the current list at once,
        then every change, until the door stops (the stream ends with OK),
        its server is replaced (``new_server``) or kubelet cancels it (the RPC
        ends: its callback wakes the wait)."""
        cond = self._cond

        def wake() -> None:
            with cond:
                cond.notify_all()

        with cond:
            gen = self._gen
            self._streams += 1
        sent = -1
        try:
            if not context.add_callback(wake):  # the RPC has already ended
                return
            while True:
                with cond:
                    cond.wait_for(lambda: self._version != sent or self.stopping or self._gen != gen
                                  or not context.is_active())
                    if self.stopping or self._gen != gen or not context.is_active():
                        return
                    version, resp = self._version, self._response
                sent = version
                yield resp
        finally:
            with cond:
                self._streams -= 1
                if not self.stopping and self._gen == gen:
                    self._last_stream_end = time.monotonic()
                cond.notify_all()

    def new_server(self) -> None:
        """A new gRPC server serves the door: the streams of the old one end."""
        with self._cond:
            self._gen += 1
            self._cond.notify_all()

    def start(self) -> None:
        self.stopping = False

    def stop(self, timeout_s: float) -> None:
        """End every stream (kubelet sees the resource go away), waiting at
        most ``timeout_s`` for them to close."""
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._streams == 0, timeout=max(timeout_s, 0.0))

    def active_streams(self) -> int:
        """Open ListAndWatch streams."""
        return self._streams

    def last_stream_end(self) -> float:
        """time.monotonic() when the last stream of the current server ended (0.0 never)."""
        return self._last_stream_end
