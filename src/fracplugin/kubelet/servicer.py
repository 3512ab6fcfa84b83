"""The kubelet device plugin door's gRPC answers: the DevicePlugin servicer
on grpcio's worker threads, the ListAndWatch stream (the device list and its
health), and GetPreferredAllocation / Allocate turned into responses
(decisions: ``allocator.Allocator``), with refusals and call times counted.

Split out of ``kubelet/deviceplugin.py`` (issue 26, ADR 0023), moved as it
was: the module docstring of ``kubelet/deviceplugin.py`` describes the door
and its concurrency model; ``DevicePluginServer`` is the one class to use.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Mapping, Sequence

import grpc

from .. import allocation as al
from .._proto import deviceplugin_pb2 as pb
from .._proto import deviceplugin_pb2_grpc as pb_grpc
from ..model import ComputeMode
from ..rpcstatus import StatusCode
from . import grpcopts
from .allocbase import Refusal
from .doorbase import _DoorState

log = logging.getLogger("fracplugin.kubelet.deviceplugin")  # the door's log, as before the split

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
ANNOTATION_ALLOCATE = "fracplugin.io/allocate"
ALLOCATE_UNADJUSTED = "unadjusted"
"""``fracplugin.io/allocate`` of a refusal answered under ``fail_open``."""
_NEVER_FAIL_OPEN = ("invalid", "internal")  # kubelet's request is malformed, or a bug of ours: refused either way


class _Servicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service's handlers, run on grpcio's worker threads;
    all state lives in the DevicePluginServer."""

    def __init__(self, owner: "_DoorAnswers") -> None:
        self._o = owner

    def GetDevicePluginOptions(  # noqa: N802 (the service's method names)
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return self._o.options()

    def ListAndWatch(  # noqa: N802
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        yield from self._o._list_and_watch(context)

    def GetPreferredAllocation(  # noqa: N802
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        try:
            return self._o.preferred(request)
        except Refusal as r:
            context.abort(grpcopts.grpc_code(r.code), r.message)
        except Exception as e:  # never crash the plugin on bad input
            log.exception("GetPreferredAllocation failed")
            context.abort(grpc.StatusCode.INTERNAL, f"GetPreferredAllocation failed: {e}")
        raise AssertionError("unreachable: context.abort raises")

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:  # noqa: N802
        t0 = time.monotonic()
        try:
            return self._o.allocate(request)
        except Refusal as r:
            self._o._refused(r)
            context.abort(grpcopts.grpc_code(r.code), r.message)
        except Exception as e:
            log.exception("Allocate failed")
            self._o._refused(Refusal(StatusCode.INTERNAL, str(e), "internal"))
            context.abort(grpc.StatusCode.INTERNAL, f"Allocate failed: {e}")
        finally:
            self._o._observe("allocate", time.monotonic() - t0)
        raise AssertionError("unreachable: context.abort raises")

    def PreStartContainer(  # noqa: N802
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class _DoorAnswers(_DoorState):
    """ListAndWatch, GetPreferredAllocation and Allocate (a mixin of
    ``DevicePluginServer``)."""

    def options(self) -> pb.DevicePluginOptions:
        """Same answer in RegisterRequest.options and GetDevicePluginOptions (A.5)."""
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    # ---- ListAndWatch ------------------------------------------------------
    def _mode_of(self, uuid: str) -> ComputeMode | None:
        try:
            return self.ledger.mode(uuid)
        except Exception:
            return None

    def _build_response(self) -> pb.ListAndWatchResponse:
        devices = []
        for gpu in self.node.gpus:
            health = HEALTHY if self.health.healthy(gpu.uuid) else UNHEALTHY
            topo = None
            if gpu.numa_node is not None and gpu.numa_node >= 0:
                topo = pb.TopologyInfo(nodes=[pb.NUMANode(ID=gpu.numa_node)])
            for dev_id in self.table.ids(gpu.uuid):
                d = pb.Device(ID=dev_id, health=health)
                if topo is not None:
                    d.topology.CopyFrom(topo)
                devices.append(d)
        return pb.ListAndWatchResponse(devices=devices)

    def _devices_changed(self) -> None:
        resp = self._build_response()
        with self._cond:
            self._response = resp
            self._version += 1
            self._cond.notify_all()

    def current_devices(self) -> pb.ListAndWatchResponse:
        """The list ListAndWatch sends now."""
        with self._cond:
            return self._response

    def _list_and_watch(self, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        """Serve one ListAndWatch stream on a worker: the current list at once,
        then every change, until the server stops (the stream ends with OK),
        is replaced (``_gen``) or kubelet cancels it (the RPC ends: its
        callback wakes the wait)."""
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
                    cond.wait_for(lambda: self._version != sent or self._stopping or self._gen != gen
                                  or not context.is_active())
                    if self._stopping or self._gen != gen or not context.is_active():
                        return
                    version, resp = self._version, self._response
                sent = version
                yield resp
        finally:
            with cond:
                self._streams -= 1
                if not self._stopping and self._gen == gen:
                    self._last_stream_end = time.monotonic()
                cond.notify_all()

    # ---- GetPreferredAllocation / Allocate (decisions: allocator.py) -----------
    def preferred(self, request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
        """Answer GetPreferredAllocation (``Allocator.preferred``). Raises Refusal."""
        t0 = time.monotonic()
        out = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = self.allocator.preferred(list(creq.available_deviceIDs), list(creq.must_include_deviceIDs),
                                           int(creq.allocation_size))
            out.container_responses.add(deviceIDs=ids)
        self._observe("preferred", time.monotonic() - t0)
        return out

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        """Answer Allocate (``Allocator.allocate``). Raises Refusal; with
        ``fail_open``, a refusal of the pod's fraction is counted, logged and
        answered with an unadjusted container instead (``fail_open``)."""
        try:
            a = self.allocator.allocate([list(c.devices_ids) for c in request.container_requests])
        except Refusal as r:
            if not self.fail_open or r.label in _NEVER_FAIL_OPEN:
                raise
            self._refused(r)
            log.warning("Allocate fail-open: the container runs unadjusted (no GPU env, no MPS): %s", r.message)
            resp = pb.AllocateResponse()
            resp.container_responses.add().annotations[ANNOTATION_ALLOCATE] = ALLOCATE_UNADJUSTED
            return resp
        return self._response_for(a.env, a.mounts, a.uuids, a.kind, a.key)

    def _response_for(
        self, env: Mapping[str, str], mounts: Sequence[Any], uuids: Sequence[str], kind: str, key: str
    ) -> pb.AllocateResponse:
        resp = pb.AllocateResponse()
        c = resp.container_responses.add()
        c.envs.update(env)
        c.envs[al.ENV_RESERVATION] = key
        for m in mounts:
            c.mounts.add(container_path=m.destination, host_path=m.source, read_only=m.read_only)
        if self.device_specs:
            paths = [f"/dev/nvidia{self.node.gpu_by_uuid(u).minor}" for u in uuids]  # type: ignore[union-attr]
            for p in paths + ["/dev/nvidiactl", "/dev/nvidia-uvm"]:
                c.devices.add(container_path=p, host_path=p, permissions="rw")
        for u in uuids:  # the node's CDI device of each GPU (ADR 0025b), else the operator's kind
            dev = self.cdi.device_for(u) if self.cdi is not None else None
            if dev is not None:
                c.cdi_devices.add(name=dev.name)
            elif self.cdi_kind:
                c.cdi_devices.add(name=f"{self.cdi_kind}={u}")
        c.annotations[ANNOTATION_ALLOCATE] = kind
        c.annotations[al.ANNOTATION_RESERVATION] = key
        return resp

    # ---- bookkeeping ---------------------------------------------------------
    def _refused(self, r: Refusal) -> None:
        self.allocator.refused(r.message)
        log.warning("Allocate refused (%s): %s", r.code.name, r.message)
        if self.metrics is not None:
            try:
                self.metrics.refusal(r.label)
            except Exception:
                log.exception("metrics.refusal failed")

    def _observe(self, door: str, seconds: float) -> None:
        if self.metrics is not None:
            try:
                self.metrics.observe_hook(door, seconds)
            except Exception:
                log.exception("metrics.observe_hook failed")
