"""The kubelet device plugin door: GPU memory as an extended resource.

What kubelet sees (kubelet-device-plugin.md A): one extended resource (default
``fracplugin.io/gpu-memory``), one device per ``unit_mib`` MiB of one GPU, IDs
``<GPU-UUID>::<n>`` (see ``devices.py``), served over grpcio on a unix socket
in the device plugin directory and registered on ``kubelet.sock``
(``registration.py``).

Concurrency model: grpc's synchronous server with a thread pool
(``max_workers``, default 16). Each open ListAndWatch stream holds one worker
while it is open, but never for good: the generator waits on a condition
variable with a 0.5 s timeout, re-checks ``context.is_active()`` and the stop
flag, and a ``context.add_callback`` wakes it when the RPC ends. Allocate and
GetPreferredAllocation run on workers; the part of Allocate that chooses a pod
and writes the ledger runs under one lock (kubelet may call it concurrently,
A.5); waiting for the watch cache happens outside that lock. Three helper
threads: the registrar (``registration.Registrar``), the health monitor
(``gpu.health.HealthMonitor``) and, when the daemon passes one, the pod watch
(owned by the pod source).

Allocate rules (issue 4 item 5, DESIGN.md section 2):

* exactly one container request (kubelet sends one, A.5), at least one
  device ID, no duplicates, every ID ours exactly as advertised (canonical
  ``<uuid>::<n>``, ASCII digits, no leading zero: ``devices.py``) -> else
  INVALID_ARGUMENT naming the devices and the rule;
* the devices of one request spread over k GPUs with the same count on each
  (the env carries one limit for every ordinal) -> else INVALID_ARGUMENT; a
  GPU that is Unhealthy now -> FAILED_PRECONDITION;
* the request per GPU is count x ``unit_mib`` MiB; the pod is found in the
  watch cache (``podlookup``); its annotations give the limit, compute mode
  and portion; the planner makes the plan; the ledger admits it;
* several candidates whose plans are identical (same env and mounts): the
  oldest is recorded; the answer is right for any of them;
* refusals for bad annotations -> INVALID_ARGUMENT; node guards (one compute
  mode per GPU, free memory, MPS client count; planner or ledger) ->
  FAILED_PRECONDITION; messages name pod, container, key, value and rule. A
  refused container counts as served (kubelet fails the pod);
* fallback (logged, counted): no pod source configured, no matching pod
  within ``allocate_deadline_s`` (pod deleted, API slow), the source is down,
  or two candidate pods would get different settings. The answer is then what
  is right for every candidate: the devices (``NVIDIA_VISIBLE_DEVICES``),
  request-sized memory env (request = limit = count x unit per GPU) and, only
  when every candidate is time-slicing (or none is known), the time-slicing
  MPS pipe directory; the NRI door then sets the rest at CreateContainer.
  Nothing is recorded in the ledger for a fallback answer.

Ledger entries written here carry no container id; they are released when the
pod leaves the watch cache (the NRI door records, and releases, its own entries
with container ids). Known limit: kubelet's rare re-Allocate of a container it
already allocated (A.5, ``GetDeviceRunContainerOptions``) finds no unserved
candidate and gets the fallback answer after the deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import grpc

from .. import annotations as ann
from .. import planner as planner_mod
from .._proto import deviceplugin_pb2 as pb
from .._proto import deviceplugin_pb2_grpc as pb_grpc
from ..gpu.health import DEFAULT_IGNORED_XIDS, DEFAULT_XID_RECOVERY_S, HealthMonitor
from ..model import (
    ComputeMode,
    ContainerPlan,
    FractionError,
    FractionRequest,
    MemorySpec,
    Mount,
    NodeInfo,
    PodRef,
    Tenancy,
)
from ..mps.layout import CONTAINER_PIPE_DIR
from . import podlookup
from .devices import (
    DEFAULT_RESOURCE_NAME,
    DEFAULT_UNIT_MIB,
    POLICIES,
    DeviceIdError,
    DeviceTable,
    preferred_allocation,
    validate_resource_name,
)
from .podresources import DEFAULT_PODRESOURCES_SOCKET, PodResourcesClient, PodResourcesError
from .registration import DEFAULT_PLUGIN_DIR, KUBELET_SOCKET_NAME, Registrar, socket_identity

log = logging.getLogger(__name__)

DEFAULT_SOCKET_NAME = "fracplugin.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
ANNOTATION_ALLOCATE = "fracplugin.io/allocate"
_STREAM_WAIT_S = 0.5


class Refusal(Exception):
    """An Allocate / GetPreferredAllocation answered with a gRPC error.

    ``code`` is the grpc.StatusCode kubelet gets, ``message`` the text kubelet
    shows as the pod's admission error, ``label`` the metrics reason."""

    def __init__(self, code: grpc.StatusCode, message: str, label: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.label = label


@dataclass
class _Counters:
    allocations: int = 0
    planned: int = 0
    fallbacks: int = 0
    refusals: int = 0
    preferred: int = 0
    last_fallback: str = ""
    last_refusal: str = ""


class _Servicer(pb_grpc.DevicePluginServicer):
    """grpc handlers; all state lives in the DevicePluginServer."""

    def __init__(self, owner: "DevicePluginServer") -> None:
        self._o = owner

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return self._o.options()

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterable[pb.ListAndWatchResponse]:
        yield from self._o._list_and_watch(context)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        try:
            return self._o.preferred(request)
        except Refusal as r:
            context.abort(r.code, r.message)
        except Exception as e:  # never crash the plugin on bad input
            log.exception("GetPreferredAllocation failed")
            context.abort(grpc.StatusCode.INTERNAL, f"GetPreferredAllocation failed: {e}")
        raise AssertionError("unreachable")

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        t0 = time.monotonic()
        try:
            return self._o.allocate(request)
        except Refusal as r:
            self._o._refused(r)
            context.abort(r.code, r.message)
        except Exception as e:
            log.exception("Allocate failed")
            self._o._refused(Refusal(grpc.StatusCode.INTERNAL, str(e), "internal"))
            context.abort(grpc.StatusCode.INTERNAL, f"Allocate failed: {e}")
        finally:
            self._o._observe("allocate", time.monotonic() - t0)
        raise AssertionError("unreachable")

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class DevicePluginServer:
    """The device plugin: grpc server, registration, health, Allocate.

    Args:
        node: the node and its GPUs.
        ledger: the shared ``fracplugin.ledger.Ledger``.
        planner_config: ``fracplugin.planner.PlannerConfig`` (layout, prefix, reserve).
        inventory: the GPU backend; its ``events`` feed XID health (None: no XIDs).
        pod_source: a ``podlookup.PodSource`` (watch cache); None = no API access
            (every Allocate answers the fallback).
        resource_name: the extended resource (validated: kubelet's rule, A.3).
        unit_mib: MiB per device (default 1024).
        plugin_dir: kubelet's device plugin directory.
        socket_name: our socket's file name in ``plugin_dir``.
        kubelet_socket: kubelet's registration socket (default ``<plugin_dir>/kubelet.sock``).
        allocate_deadline_s: the longest an Allocate may wait for the watch cache.
        mps_health: see ``gpu.health.MpsHealth`` (None: not supervised).
        metrics: optional object with ``observe_hook(door, seconds)`` (doors
            ``allocate`` and ``preferred``) and ``refusal(code)`` (every gRPC
            error Allocate answers, labelled with the FractionError code or
            ``invalid`` / ``unhealthy`` / ``internal``).
        ignored_xids: XIDs that do not make a GPU Unhealthy.
        xid_recovery_s: quiet seconds before an XID-marked GPU is Healthy again
            (None: only ``clear_xid``).
        policy: GetPreferredAllocation policy, ``pack`` (default) or ``spread``.
        device_specs: also answer DeviceSpecs for ``/dev/nvidia<minor>``,
            ``/dev/nvidiactl`` and ``/dev/nvidia-uvm``.
        cdi_kind: when set (e.g. ``nvidia.com/gpu``), answer CDI devices
            ``<cdi_kind>=<GPU-UUID>``.
        podresources_socket: kubelet's PodResources socket, read at ``start``
            to rebuild the ledger (None: skip).
        max_workers: grpc thread pool size.
        poll_s: registrar and health polling period in seconds.

    Raises:
        ValueError: bad resource name, unit, policy, or a device ID over 63 chars;
        devices.DeviceTableTooLarge (a ValueError): the ListAndWatch response
            would exceed 3.5 MiB (kubelet's gRPC receive limit is 4 MiB), naming
            the unit, the device count and the smallest unit that fits.
    """

    def __init__(
        self,
        node: NodeInfo,
        ledger: Any,
        planner_config: planner_mod.PlannerConfig | None = None,
        inventory: Any = None,
        pod_source: podlookup.PodSource | None = None,
        resource_name: str = DEFAULT_RESOURCE_NAME,
        unit_mib: int = DEFAULT_UNIT_MIB,
        plugin_dir: str = DEFAULT_PLUGIN_DIR,
        socket_name: str = DEFAULT_SOCKET_NAME,
        kubelet_socket: str | None = None,
        allocate_deadline_s: float = 5.0,
        mps_health: Any = None,
        metrics: Any = None,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        *,
        xid_recovery_s: float | None = DEFAULT_XID_RECOVERY_S,
        policy: str = "pack",
        device_specs: bool = False,
        cdi_kind: str | None = None,
        podresources_socket: str | None = DEFAULT_PODRESOURCES_SOCKET,
        max_workers: int = 16,
        poll_s: float = 0.1,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"allocation policy {policy!r} must be one of {', '.join(POLICIES)}")
        if "/" in socket_name:
            raise ValueError(f"socket name {socket_name!r} must be a file name (kubelet joins it with its dir)")
        self.node = node
        self.ledger = ledger
        self.planner_config = planner_config or planner_mod.PlannerConfig()
        self.inventory = inventory
        self.pod_source = pod_source
        self.resource_name = validate_resource_name(resource_name)
        self.unit_mib = unit_mib
        self.table = DeviceTable.build(node, unit_mib)
        self.plugin_dir = plugin_dir
        self.socket_path = os.path.join(plugin_dir, socket_name)
        self.kubelet_socket = kubelet_socket or os.path.join(plugin_dir, KUBELET_SOCKET_NAME)
        self.allocate_deadline_s = allocate_deadline_s
        self.metrics = metrics
        self.policy = policy
        self.device_specs = device_specs
        self.cdi_kind = cdi_kind
        self.podresources_socket = podresources_socket
        self.max_workers = max_workers
        self.health = HealthMonitor(
            inventory,
            [g.uuid for g in node.gpus],
            ignored_xids=ignored_xids,
            xid_recovery_s=xid_recovery_s,
            mps_health=mps_health,
            mode_of=self._mode_of,
            poll_s=max(poll_s, 0.05),
        )
        self.health.subscribe(self._devices_changed)
        self.registrar = Registrar(
            self, self.kubelet_socket, self.resource_name, poll_s=poll_s, on_registered=self._on_registered
        )
        self._cond = threading.Condition()
        self._version = 0
        self._response = self._build_response()
        self._stopping = False
        self._gen = 0
        self._streams = 0
        self._last_stream_end = 0.0
        self._server: grpc.Server | None = None
        self._socket_id: tuple[int, int] | None = None
        self._server_lock = threading.Lock()
        self._alloc_lock = threading.Lock()
        self._served: set[tuple[str, str]] = set()
        self.counters = _Counters()
        self._count_lock = threading.Lock()
        self.reregister_ms: list[float] = []
        self.startup_warnings: list[str] = []
        sub = getattr(pod_source, "subscribe_deleted", None)
        if callable(sub):
            sub(self._pod_deleted)

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        """Health first, then serve on the socket, rebuild the ledger from
        PodResources (best effort), then register (in the background, with
        retries; ``registered()`` turns True when kubelet accepted us).
        Raises OSError / RuntimeError when the socket cannot be served."""
        self._stopping = False
        self.health.start()
        self._devices_changed()
        self._serve()
        if self.podresources_socket and os.path.exists(self.podresources_socket):
            try:
                self.startup_warnings.extend(self.rebuild_from_podresources(PodResourcesClient(self.podresources_socket)))
            except PodResourcesError as e:
                self.startup_warnings.append(str(e))
                log.warning("ledger rebuild from PodResources skipped: %s", e)
        self.registrar.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop advertising first (end every ListAndWatch stream, so kubelet
        sees the resource go away), then stop registering, stop the grpc server
        (in-flight calls get ``timeout_s / 2``), remove our socket and stop the
        health monitor."""
        deadline = time.monotonic() + timeout_s
        self.registrar.signal_stop()  # no re-registration while we wind down
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._streams == 0, timeout=max(timeout_s / 2, 0.0))
        self.registrar.stop(max(deadline - time.monotonic(), 0.1))
        with self._server_lock:
            server, self._server = self._server, None
            sid, self._socket_id = self._socket_id, None
        if server is not None:
            server.stop(grace=max(deadline - time.monotonic(), 0.0)).wait(max(deadline - time.monotonic(), 0.1))
        if sid is not None and socket_identity(self.socket_path) == sid:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        self.health.stop(max(deadline - time.monotonic(), 0.1))

    def registered(self) -> bool:
        """True while kubelet has us registered (as far as we can tell)."""
        return self.registrar.registered()

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``fracplugin status`` and logs."""
        unhealthy = self.health.unhealthy()
        c = self.counters
        return {
            "resource_name": self.resource_name,
            "unit_mib": self.unit_mib,
            "socket": self.socket_path,
            "kubelet_socket": self.kubelet_socket,
            "registered": self.registered(),
            "registrations": self.registrar.stats.count,
            "last_registration_ms": round(self.registrar.stats.last_s * 1000, 1),
            "last_registration_trigger": self.registrar.stats.last_trigger,
            "last_registration_error": self.registrar.stats.last_error,
            "list_and_watch_streams": self._streams,
            "devices": len(self.table),
            "devices_per_gpu": dict(self.table.per_gpu),
            "healthy_devices": sum(n for u, n in self.table.per_gpu.items() if u not in unhealthy),
            "unhealthy_gpus": unhealthy,
            "policy": self.policy,
            "pod_source": None if self.pod_source is None else ("ready" if self.pod_source.ready() else "not ready"),
            "allocations": c.allocations,
            "planned": c.planned,
            "fallbacks": c.fallbacks,
            "refusals": c.refusals,
            "last_fallback": c.last_fallback,
            "last_refusal": c.last_refusal,
            "startup_warnings": list(self.startup_warnings),
        }

    def clear_xid(self, gpu_uuid: str) -> bool:
        """Operator action: forget an XID mark on a GPU (Healthy again unless MPS is down)."""
        return self.health.clear(gpu_uuid)

    # ---- grpc server (RegistrationTarget) ------------------------------------
    def _serve(self) -> None:
        os.makedirs(self.plugin_dir, exist_ok=True)
        with self._server_lock:
            old, self._server = self._server, None
        if old is not None:
            # grpc core unlinks a unix socket when its server stops: stop the old
            # server before binding the new one, or it would delete the new file.
            old.stop(grace=0).wait(2.0)
        try:
            os.unlink(self.socket_path)  # a stale socket from an earlier run (A.8)
        except FileNotFoundError:
            pass
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="fracplugin-dp"),
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        if server.add_insecure_port("unix:" + self.socket_path) == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        server.start()
        with self._server_lock:
            self._server = server
            self._socket_id = socket_identity(self.socket_path)
        with self._cond:
            self._gen += 1
            self._cond.notify_all()
        log.info("device plugin serving %s on %s", self.resource_name, self.socket_path)

    def socket_identity(self) -> tuple[int, int] | None:
        return self._socket_id

    def rebind(self) -> None:
        """Serve on a fresh socket (kubelet wiped ours on restart)."""
        if self._stopping:
            raise RuntimeError("device plugin is stopping")
        self._serve()

    def active_streams(self) -> int:
        return self._streams

    def last_stream_end(self) -> float:
        return self._last_stream_end

    def options(self) -> pb.DevicePluginOptions:
        """Same answer in RegisterRequest.options and GetDevicePluginOptions (A.5)."""
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def _on_registered(self, seconds: float) -> None:
        self.reregister_ms.append(seconds * 1000.0)
        del self.reregister_ms[:-100]

    # ---- ListAndWatch ------------------------------------------------------
    def _mode_of(self, uuid: str) -> ComputeMode | None:
        try:
            return self.ledger.mode(uuid)
        except Exception:
            return None

    def _free_mib_of(self, uuid: str) -> int | None:
        gpu = self.node.gpu_by_uuid(uuid)
        try:
            return None if gpu is None else gpu.memory_mib - int(self.ledger.held_mib(uuid))
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

    def _list_and_watch(self, context: grpc.ServicerContext) -> Iterable[pb.ListAndWatchResponse]:
        cond = self._cond

        def wake() -> None:
            with cond:
                cond.notify_all()

        context.add_callback(wake)
        with cond:
            gen = self._gen
            self._streams += 1
        sent = -1
        try:
            while True:
                with cond:
                    cond.wait_for(
                        lambda: self._version != sent or self._stopping or self._gen != gen or not context.is_active(),
                        timeout=_STREAM_WAIT_S,
                    )
                    if self._stopping or self._gen != gen or not context.is_active():
                        return
                    version, resp = self._version, self._response
                if version != sent:
                    sent = version
                    yield resp
        finally:
            with cond:
                self._streams -= 1
                if not self._stopping and self._gen == gen:
                    self._last_stream_end = time.monotonic()
                cond.notify_all()

    # ---- GetPreferredAllocation ----------------------------------------------
    def preferred(self, request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
        """Answer GetPreferredAllocation (rules in ``devices.preferred_allocation``).
        The pod's compute mode is the one every unserved candidate pod of this
        size agrees on (None when none or they differ)."""
        t0 = time.monotonic()
        out = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            size = int(creq.allocation_size)
            if size < 0:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"allocation_size {size} is negative", "invalid")
            mode = self._pod_mode_for(size)
            ids = preferred_allocation(
                self.table,
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                size,
                mode_of=self._mode_of,
                pod_mode=mode,
                policy=self.policy,
                free_mib_of=self._free_mib_of,
            )
            out.container_responses.add(deviceIDs=ids)
        self._bump("preferred")
        self._observe("preferred", time.monotonic() - t0)
        return out

    def _pod_mode_for(self, count: int) -> ComputeMode | None:
        if self.pod_source is None:
            return None
        modes: set[ComputeMode] = set()
        for c in self._candidates(count):
            try:
                req = self._parse(c, with_request_mib=self.unit_mib)
            except FractionError:
                continue
            if req is not None:
                modes.add(req.compute_mode)
        return modes.pop() if len(modes) == 1 else None

    # ---- Allocate ------------------------------------------------------------
    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        """Answer Allocate (rules in the module docstring). Raises Refusal."""
        n = len(request.container_requests)
        if n != 1:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"AllocateRequest has {n} container requests; kubelet sends exactly one per call "
                "(deviceplugin v1beta1, devicemanager) and fracplugin allocates one container at a time",
                "invalid",
            )
        ids = list(request.container_requests[0].devices_ids)
        if not ids:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Allocate of {self.resource_name} names no device IDs; at least one is needed",
                "invalid",
            )
        try:
            by_gpu = self.table.group(ids)
        except DeviceIdError as e:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Allocate of {self.resource_name}: {e} (devices are <GPU-UUID>::<n> of node {self.node.name})",
                "invalid",
            ) from None
        counts = {u: len(v) for u, v in by_gpu.items()}
        if len(set(counts.values())) != 1:
            detail = ", ".join(f"{u}: {c}" for u, c in counts.items())
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Allocate of {self.resource_name} spans GPUs with different device counts ({detail}); "
                "a container gets the same memory on every GPU, so each GPU must hold the same number of devices",
                "invalid",
            )
        sick = {u: r for u, r in self.health.unhealthy().items() if u in by_gpu}
        if sick:
            detail = "; ".join(f"{u} ({', '.join(r)})" for u, r in sick.items())
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Allocate of {self.resource_name}: devices on Unhealthy GPU(s) {detail}",
                "unhealthy",
            )
        per_gpu = next(iter(counts.values()))
        uuids = tuple(by_gpu)
        request_mib = per_gpu * self.unit_mib
        self._bump("allocations")
        if self.pod_source is None:
            return self._fallback(uuids, request_mib, True, "no API access configured (no pod source)")
        deadline = time.monotonic() + self.allocate_deadline_s
        while True:
            with self._alloc_lock:
                cands = self._candidates(len(ids))
                if cands:
                    return self._allocate_for(cands, uuids, request_mib, len(ids))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self._fallback(
                    uuids,
                    request_mib,
                    True,
                    f"no pending pod on node {self.node.name} requests {len(ids)} {self.resource_name} "
                    f"within {self.allocate_deadline_s:.1f} s (pod deleted or API slow)",
                )
            if not self.pod_source.ready():
                return self._fallback(
                    uuids, request_mib, True, "pod source not ready (API server unreachable or not synced)"
                )
            self.pod_source.wait(min(remaining, 0.1))

    def _served_owners(self) -> set[tuple[str, str]]:
        owners = {t.owner for t in self.ledger.tenancies()}
        return owners | self._served

    def _candidates(self, count: int) -> list[podlookup.Candidate]:
        assert self.pod_source is not None
        owners = self._served_owners()
        pods = self.pod_source.candidates(self.resource_name, count)
        return podlookup.select_candidates(pods, self.resource_name, count, lambda u, c: (u, c) in owners)

    def _parse(self, cand: podlookup.Candidate, with_request_mib: int | None = None) -> FractionRequest | None:
        """The pod's annotations for this container (raises FractionError).

        ``with_request_mib``: when the container has no memory annotation
        (parse would answer None), parse again with a synthetic request of that
        many MiB, so the compute mode and portion annotations still count."""
        md = cand.pod.get("metadata") or {}
        annotations = dict(md.get("annotations") or {})
        apps = [str(c.get("name")) for c in (cand.pod.get("spec") or {}).get("containers") or ()]
        prefix = self.planner_config.annotation_prefix
        parsed = ann.parse(annotations, cand.container, prefix=prefix, containers=apps)
        if parsed is None and with_request_mib is not None:
            annotations[ann.container_key(prefix, cand.container, ann.SUFFIX_REQUEST)] = f"{with_request_mib}Mi"
            parsed = ann.parse(annotations, cand.container, prefix=prefix, containers=apps)
            if parsed is not None:
                parsed = dataclasses.replace(parsed, keys={k: v for k, v in parsed.keys.items() if k in ("mode", "portion")})
        return parsed

    def _request_for(self, cand: podlookup.Candidate, uuids: Sequence[str], request_mib: int, count: int) -> FractionRequest:
        """The FractionRequest of the device plugin door: request = devices x
        unit per GPU, GPUs = the devices' GPUs; limit, mode and portion from
        the annotations (an annotation limit only when written explicitly)."""
        parsed = self._parse(cand)
        explicit = parsed is not None
        if parsed is None:
            parsed = self._parse(cand, with_request_mib=request_mib)
        rkey = f"resources.limits[{self.resource_name}]"
        request = MemorySpec(rkey, f"{count} x {self.unit_mib}Mi over {len(uuids)} GPU(s)", mib=request_mib)
        limit = request
        mode = ComputeMode.TIME_SLICING
        portion = None
        keys: dict[str, str] = {"request": rkey, "devices": rkey}
        if parsed is not None:
            mode, portion = parsed.compute_mode, parsed.portion
            keys.update({k: v for k, v in parsed.keys.items() if k in ("mode", "portion")})
            if explicit and _explicit_limit(parsed):
                limit = parsed.limit
                keys["limit"] = parsed.limit.key
            if parsed.devices and set(parsed.devices) != set(uuids):
                log.info(
                    "pod %s container %s names devices %s; kubelet gave %s (the device plugin door uses kubelet's)",
                    podlookup.pod_key(cand.pod), cand.container, ",".join(parsed.devices), ",".join(uuids),
                )
        return FractionRequest(
            container=cand.container,
            request=request,
            limit=limit,
            compute_mode=mode,
            portion=portion,
            devices=tuple(uuids),
            num_devices=len(uuids),
            keys=keys,
        )

    def _plan(self, cand: podlookup.Candidate, uuids: Sequence[str], request_mib: int, count: int) -> ContainerPlan:
        md = cand.pod.get("metadata") or {}
        pod = PodRef(str(md.get("namespace") or "default"), str(md.get("name") or ""), cand.uid)
        req = self._request_for(cand, uuids, request_mib, count)
        return planner_mod.plan(req, pod, self.node, self.ledger, self.planner_config)

    def _allocate_for(
        self, cands: list[podlookup.Candidate], uuids: tuple[str, ...], request_mib: int, count: int
    ) -> pb.AllocateResponse:
        """Called under _alloc_lock with at least one candidate."""
        outcomes: list[ContainerPlan | FractionError] = []
        for c in cands:
            try:
                outcomes.append(self._plan(c, uuids, request_mib, count))
            except FractionError as e:
                outcomes.append(e)

        def settings(o: ContainerPlan | FractionError) -> Any:
            if isinstance(o, FractionError):
                return ("error", o.key, o.reason)
            return (tuple(sorted(o.env.items())), tuple(o.mounts))

        first = settings(outcomes[0])
        if len(cands) > 1 and any(settings(o) != first for o in outcomes[1:]):
            names = ", ".join(f"{podlookup.pod_key(c.pod)}/{c.container}" for c in cands[:5])
            all_ts = all(
                isinstance(o, ContainerPlan) and o.compute_mode is ComputeMode.TIME_SLICING for o in outcomes
            )
            return self._fallback(
                uuids,
                request_mib,
                all_ts,
                f"{len(cands)} pending pods request {count} {self.resource_name} and would get different "
                f"settings ({names}); answering what is right for all, NRI sets the rest",
            )
        cand, outcome = cands[0], outcomes[0]
        who = f"pod {podlookup.pod_key(cand.pod)} container {cand.container}"
        self._served.add(cand.key)
        if isinstance(outcome, FractionError):
            # Guards of the node (mode, free memory, clients) are preconditions;
            # everything else is the pod's input.
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if outcome.code in ("guard", "no_fit")
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            raise Refusal(code, f"{who}: {outcome.message}", outcome.code)
        try:
            self.ledger.admit(outcome)
        except FractionError as e:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"{who}: {e.message}", e.code) from None
        except OSError as e:
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE, f"{who}: cannot persist the ledger: {e}", "ledger_io"
            ) from None
        self._bump("planned")
        log.info(
            "Allocate %s: %s on %s, request %d MiB, limit %d MiB, %s",
            self.resource_name, who, ",".join(uuids), outcome.request_mib, outcome.limit_mib, outcome.compute_mode,
        )
        return self._response_for(outcome.env, outcome.mounts, uuids, "planned")

    def _fallback(self, uuids: Sequence[str], request_mib: int, pipe_dir: bool, reason: str) -> pb.AllocateResponse:
        """The answer that is right for every candidate (module docstring).
        ``pipe_dir``: every candidate is time-slicing, or none is known (the
        default mode), so the time-slicing pipe directory is right for all."""
        self._bump("fallbacks", last_fallback=reason)
        log.warning("Allocate fallback for %s on %s: %s", self.resource_name, ",".join(uuids), reason)
        env = {
            planner_mod.ENV_VISIBLE_DEVICES: ",".join(uuids),
            planner_mod.ENV_MEMORY_REQUEST: str(request_mib),
            planner_mod.ENV_MEMORY_LIMIT: str(request_mib),
            planner_mod.ENV_PINNED_LIMIT: ",".join(f"{i}={request_mib}M" for i in range(len(uuids))),
        }
        mounts: tuple[Mount, ...] = ()
        if pipe_dir:
            env[planner_mod.ENV_PIPE_DIRECTORY] = CONTAINER_PIPE_DIR
            mounts = (
                Mount(
                    source=self.planner_config.layout.pipe_dir(ComputeMode.TIME_SLICING),
                    destination=CONTAINER_PIPE_DIR,
                ),
            )
        return self._response_for(env, mounts, uuids, "fallback")

    def _response_for(
        self, env: Mapping[str, str], mounts: Sequence[Any], uuids: Sequence[str], kind: str
    ) -> pb.AllocateResponse:
        resp = pb.AllocateResponse()
        c = resp.container_responses.add()
        c.envs.update(env)
        for m in mounts:
            c.mounts.add(container_path=m.destination, host_path=m.source, read_only=m.read_only)
        if self.device_specs:
            paths = [f"/dev/nvidia{self.node.gpu_by_uuid(u).minor}" for u in uuids]  # type: ignore[union-attr]
            for p in paths + ["/dev/nvidiactl", "/dev/nvidia-uvm"]:
                c.devices.add(container_path=p, host_path=p, permissions="rw")
        if self.cdi_kind:
            for u in uuids:
                c.cdi_devices.add(name=f"{self.cdi_kind}={u}")
        c.annotations[ANNOTATION_ALLOCATE] = kind
        return resp

    # ---- bookkeeping ---------------------------------------------------------
    def _pod_deleted(self, pod: Mapping[str, Any]) -> None:
        uid = podlookup.pod_uid(pod)
        with self._alloc_lock:
            self._served = {k for k in self._served if k[0] != uid}
        # Tenancies of the Allocate door carry no container id; the NRI door
        # records (and releases) its own. A deleted pod holds nothing.
        for t in self.ledger.tenancies():
            if t.pod_uid == uid and not t.container_id:
                self.ledger.release(t.pod_uid, t.container)

    def _refused(self, r: Refusal) -> None:
        self._bump("refusals", last_refusal=r.message)
        log.warning("Allocate refused (%s): %s", r.code.name, r.message)
        if self.metrics is not None:
            try:
                self.metrics.refusal(r.label)
            except Exception:
                log.exception("metrics.refusal failed")

    def _bump(self, counter: str, **last: str) -> None:
        with self._count_lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)
            for k, v in last.items():
                setattr(self.counters, k, v)

    def _observe(self, door: str, seconds: float) -> None:
        if self.metrics is not None:
            try:
                self.metrics.observe_hook(door, seconds)
            except Exception:
                log.exception("metrics.observe_hook failed")

    # ---- restart recovery ----------------------------------------------------
    def rebuild_from_podresources(self, client: PodResourcesClient) -> list[str]:
        """Rebuild ledger entries for containers kubelet allocated our devices
        to before a restart (kubelet never calls Allocate again, A.5).

        For each container PodResources lists with devices of our resource and
        no ledger entry (matched by namespace, pod name and container): plan it
        from the pod (pod source) and admit; when the pod is unknown, record a
        request-sized tenancy (uid ``podresources:<ns>/<name>``, the GPU's
        current mode or time-slicing) with ``replace_all`` (never refused: the
        container already runs). Allocate-door entries (no container id) that
        PodResources no longer lists are released. Returns warnings.
        Raises PodResourcesError when kubelet cannot be asked.
        """
        pods = client.list()
        warnings: list[str] = []
        have = {(t.namespace, t.pod_name, t.container) for t in self.ledger.tenancies()}
        listed: set[tuple[str, str, str]] = set()
        extra: list[Tenancy] = []
        for p in pods:
            for c in p.containers:
                ids = list(c.devices.get(self.resource_name, ()))
                if not ids:
                    continue
                listed.add((p.namespace, p.name, c.name))
                if (p.namespace, p.name, c.name) in have:
                    continue
                try:
                    by_gpu = self.table.group(ids)
                except DeviceIdError as e:
                    warnings.append(f"PodResources lists {p.namespace}/{p.name}/{c.name} with {e}; skipped")
                    continue
                per = max(len(v) for v in by_gpu.values())
                uuids = tuple(by_gpu)
                pod = self.pod_source.get(p.namespace, p.name) if self.pod_source is not None else None
                if pod is not None:
                    cand = podlookup.Candidate(pod, c.name, False, ("", 0, 0, ""))
                    try:
                        plan = self._plan(cand, uuids, per * self.unit_mib, len(ids))
                        self.ledger.replace_all(self.ledger.tenancies() + _tenancies(plan))
                        self._served.add(cand.key)
                        continue
                    except FractionError as e:
                        warnings.append(f"{p.namespace}/{p.name}/{c.name}: {e.message}; recorded request-sized")
                uid = podlookup.pod_uid(pod) if pod is not None else f"podresources:{p.namespace}/{p.name}"
                for u in uuids:
                    extra.append(
                        Tenancy(
                            pod_uid=uid, namespace=p.namespace, pod_name=p.name, container=c.name, gpu_uuid=u,
                            request_mib=per * self.unit_mib, limit_mib=per * self.unit_mib,
                            mode=self._mode_of(u) or ComputeMode.TIME_SLICING,
                        )
                    )
                self._served.add((uid, c.name))
        current = self.ledger.tenancies()
        stale = [
            t for t in current
            if not t.container_id and (t.namespace, t.pod_name, t.container) not in listed
        ]
        if extra or stale:
            drop = {id(t) for t in stale}
            self.ledger.replace_all([t for t in current if id(t) not in drop] + extra)
        for t in stale:
            warnings.append(
                f"ledger entry {t.namespace}/{t.pod_name}/{t.container} on {t.gpu_uuid} is not in PodResources; released"
            )
        if extra:
            log.info("rebuilt %d ledger entries from PodResources", len(extra))
        return warnings


def _tenancies(plan: ContainerPlan) -> list[Tenancy]:
    return [
        Tenancy(
            pod_uid=plan.pod.uid, namespace=plan.pod.namespace, pod_name=plan.pod.name, container=plan.container,
            gpu_uuid=g.uuid, request_mib=plan.request_mib, limit_mib=plan.limit_mib, mode=plan.compute_mode,
            mps_namespace=plan.mps.namespace, active_thread_percentage=plan.active_thread_percentage,
        )
        for g in plan.devices
    ]


def _explicit_limit(parsed: FractionRequest) -> bool:
    """True when the pod wrote a memory limit (not the parser's default of
    limit = request)."""
    if parsed.limit.key != parsed.request.key:
        return True
    key = parsed.limit.key
    return not (key.endswith(ann.SUFFIX_REQUEST) or key in (ann.KEY_GPU_FRACTION, ann.KEY_GPU_MEMORY))
