"""The kubelet device plugin door: GPU memory as an extended resource.

What kubelet sees (docs/reference/kubelet-device-plugin.md A): one extended resource (default
``fracplugin.io/gpu-memory``), one device per ``unit_mib`` MiB of one GPU, IDs
``<GPU-UUID>::<n>`` (see ``devices.py``), served over gRPC (grpcio, ADR
0021; its options in ``grpcopts``) on a unix socket in the device plugin
directory and registered on ``kubelet.sock`` (``registration.py``).

Concurrency model: grpcio's synchronous server, ``MAX_WORKERS`` threads
``fracplugin-dp_<n>``, each open ListAndWatch stream holding one (ADR 0021
decision 2). Allocate and GetPreferredAllocation run on workers; the part of
Allocate that chooses a pod and writes the ledger runs under one lock (kubelet
may call it concurrently, A.5); waiting for the watch cache happens outside it.
Helper threads: the registrar (``registration.Registrar``), the
PodResources reconciler (``podresources.Reconciler``) and,
when the daemon passes one, the pod watch (owned by the pod source).

What this module decides: nothing about GPUs (ADR 0007 decision 10). Its parts:
``devices`` (ListAndWatch), ``serving`` (the gRPC server), ``podresources`` and
``allocator`` (the decisions), whose answer ``_response_for`` turns into an
``AllocateResponse``: env (with ``FRACPLUGIN_RESERVATION``), mounts, optional
DeviceSpecs / CDI devices, and annotations ``fracplugin.io/allocate``
(``planned`` | ``reserved`` | ``fallback`` | ``pending``) and ``fracplugin.io/reservation``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Iterator

import grpc

from .. import allocation as al
from .. import mountflags
from .._proto import deviceplugin_pb2 as pb
from .._proto import deviceplugin_pb2_grpc as pb_grpc
from ..cdi import CdiRegistry
from ..gpu.health import HealthMonitor
from ..noderules import NodeRules
from ..ports import HookMetrics
from ..rpcstatus import StatusCode
from . import grpcopts, podlookup
from .devices import (
    DEFAULT_RESOURCE_NAME,
    DEFAULT_UNIT_MIB,
    POLICIES,
    DeviceTable,
    validate_resource_name,
)
from .allocator import Allocator
from .allocbase import Answer, Refusal
from .devicelist import DeviceList
from .doorserver import DoorServer
from .podresources import DEFAULT_PODRESOURCES_SOCKET, Reconciler
from .registration import DEFAULT_PLUGIN_DIR, KUBELET_SOCKET_NAME, Registrar
from ..logs import guarded

log = logging.getLogger(__name__)

DEFAULT_SOCKET_NAME = "fracplugin.sock"
MAX_WORKERS = 16
"""grpcio worker threads, and the most RPCs served at once (each open
ListAndWatch stream holds one); an RPC over the limit is answered RESOURCE_EXHAUSTED."""
ANNOTATION_ALLOCATE = "fracplugin.io/allocate"
ALLOCATE_UNADJUSTED = "unadjusted"
"""``fracplugin.io/allocate`` of a refusal answered under ``fail_open``."""
_NEVER_FAIL_OPEN = ("invalid", "internal")  # kubelet's request is malformed, or a bug of ours: refused either way


class _Servicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service's handlers, run on grpcio's worker threads;
    they only move bytes to and from the door."""

    def __init__(self, door: DevicePluginServer) -> None:
        self._door = door

    def GetDevicePluginOptions(  # noqa: N802 (the service's method names)
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return DoorServer.options()

    def ListAndWatch(  # noqa: N802
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        yield from self._door.devices.stream(context)

    def GetPreferredAllocation(  # noqa: N802
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        try:
            return self._door.preferred(request)
        except Refusal as r:
            context.abort(grpcopts.grpc_code(r.code), r.message)
        except Exception as e:  # never crash the plugin on bad input
            log.exception("GetPreferredAllocation failed")
            context.abort(grpc.StatusCode.INTERNAL, f"GetPreferredAllocation failed: {e}")
        raise AssertionError("unreachable: context.abort raises")

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:  # noqa: N802
        t0 = time.monotonic()
        try:
            return self._door.allocate(request)
        except Refusal as r:
            self._door._refused(r)
            context.abort(grpcopts.grpc_code(r.code), r.message)
        except Exception as e:
            log.exception("Allocate failed")
            self._door._refused(Refusal(StatusCode.INTERNAL, str(e), "internal"))
            context.abort(grpc.StatusCode.INTERNAL, f"Allocate failed: {e}")
        finally:
            self._door._observe("allocate", time.monotonic() - t0)
        raise AssertionError("unreachable: context.abort raises")

    def PreStartContainer(  # noqa: N802
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class DevicePluginServer:
    """The device plugin: gRPC server, registration, health, Allocate.

    Args:
        rules: the node's rules (``noderules.NodeRules``: GPUs, the shared
            ledger, planner settings, the node's health monitor, the memory-limit
            gate); Allocate admits through them.
        pod_source: a ``podlookup.PodSource`` (watch cache); None = no API access
            (every Allocate answers the fallback).
        resource_name: the extended resource (validated: kubelet's rule, A.3).
        unit_mib: MiB per device (default 1024).
        plugin_dir: kubelet's device plugin directory (our socket: ``DEFAULT_SOCKET_NAME`` in it).
        kubelet_socket: kubelet's registration socket (default ``<plugin_dir>/kubelet.sock``).
        allocate_deadline_s: the longest an Allocate may wait for the watch cache.
        metrics: optional ``ports.HookMetrics``: ``observe_hook(door, seconds)`` (doors
            ``allocate`` and ``preferred``) and ``refusal(code)`` (every gRPC
            error Allocate answers, labelled with the FractionError code or
            ``invalid`` / ``unhealthy`` / ``internal``).
        policy: GetPreferredAllocation policy, ``pack`` (default) or ``spread``.
        device_specs: also answer DeviceSpecs for ``/dev/nvidia<minor>``,
            ``/dev/nvidiactl`` and ``/dev/nvidia-uvm``.
        cdi_kind: when set (e.g. ``nvidia.com/gpu``), answer CDI devices
            ``<cdi_kind>=<GPU-UUID>`` for GPUs ``cdi`` has no device for.
        cdi: the node's CDI specs (``cdi.CdiRegistry``): Allocate answers each
            allocated GPU's CDI device from them (ADR 0025b). None: only
            ``cdi_kind``.
        podresources_socket: kubelet's PodResources socket, read at ``start``
            to rebuild the ledger and then every ``podresources_interval_s``
            seconds to reconcile it (``Allocator.reconcile``; None: skip).
        fail_open: an Allocate refused for the pod's fraction (a contract or
            node guard refusal, an Unhealthy GPU) is answered with an
            unadjusted container (no env, no mounts, annotation
            ``fracplugin.io/allocate: unadjusted``, nothing in the ledger) and a
            warning, the refusal still counted; a malformed request or an
            internal error is refused either way. Reloadable (SIGHUP).

    Raises:
        ValueError: bad resource name, unit, policy, or a device ID over 63 chars;
        devices.DeviceTableTooLarge (a ValueError): the ListAndWatch response
            would not fit kubelet's 4 MiB receive limit.
    """

    def __init__(
        self,
        rules: NodeRules,
        pod_source: podlookup.PodSource | None = None,
        resource_name: str = DEFAULT_RESOURCE_NAME,
        unit_mib: int = DEFAULT_UNIT_MIB,
        plugin_dir: str = DEFAULT_PLUGIN_DIR,
        kubelet_socket: str | None = None,
        allocate_deadline_s: float = 5.0,
        metrics: HookMetrics | None = None,
        *,
        policy: str = "pack",
        device_specs: bool = False,
        cdi_kind: str | None = None,
        cdi: CdiRegistry | None = None,
        podresources_socket: str | None = DEFAULT_PODRESOURCES_SOCKET,
        podresources_interval_s: float = 10.0,
        fail_open: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"allocation policy {policy!r} must be one of {', '.join(POLICIES)}")
        node = self.node = rules.node
        self.ledger = rules.ledger
        self.planner_config = rules.config
        self.pod_source = pod_source
        self.resource_name = validate_resource_name(resource_name)
        self.unit_mib = unit_mib
        self.table = DeviceTable.build(node, unit_mib)
        self.kubelet_socket = kubelet_socket or os.path.join(plugin_dir, KUBELET_SOCKET_NAME)
        self.allocate_deadline_s = allocate_deadline_s
        self.metrics = metrics
        self.policy = policy
        self.device_specs = device_specs
        self.cdi_kind = cdi_kind
        self.cdi = cdi
        self.max_workers = MAX_WORKERS
        self.fail_open = fail_open
        # the node's health monitor (started by the daemon, issue 33); without one nothing is Unhealthy
        self.health = rules.health or HealthMonitor(None, [g.uuid for g in node.gpus])
        self.devices = DeviceList(node, self.table, self.health)
        self.health.subscribe(self.devices.changed)
        self.serving = DoorServer(plugin_dir, DEFAULT_SOCKET_NAME, MAX_WORKERS, self.resource_name, _Servicer(self),
                                  self.devices, self.ready)
        self.registrar = Registrar(self.serving, self.kubelet_socket, self.resource_name, self._on_registered)
        self.allocator = Allocator(rules, self.table, self.resource_name, pod_source, allocate_deadline_s,
                                   self.health.unhealthy, policy=policy)
        self.podresources = Reconciler(self.allocator, podresources_socket, podresources_interval_s)
        self.counters = self.allocator.counters
        self.reregister_ms: list[float] = []
        self.startup_warnings: list[str] = []

    @property
    def socket_path(self) -> str:
        """The socket served now (``<plugin_dir>/<socket_name>``, or a new name
        after kubelet refused the old one: ``DoorServer.rebind``)."""
        return self.serving.socket_path

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        """Serve on the socket, rebuild the ledger from
        PodResources (best effort), then register (in the background, with
        retries; ``registered()`` turns True when kubelet accepted us).
        Raises OSError / RuntimeError when the socket cannot be served."""
        self.devices.start()
        self._check_pipe_mount()
        self.devices.changed()
        self.serving.serve()
        self.podresources.start(self.startup_warnings)
        self.registrar.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop advertising first (end every ListAndWatch stream, so kubelet
        sees the resource go away), then stop registering, stop the gRPC server
        (in-flight calls get what is left of ``timeout_s``, then are cancelled
        and their connections closed), remove our socket (the node's health monitor is the daemon's)."""
        deadline = time.monotonic() + timeout_s
        self.podresources.stop()
        self.registrar.signal_stop()  # no re-registration while we wind down
        self.devices.stop(timeout_s / 2)
        self.registrar.stop(max(deadline - time.monotonic(), 0.1))
        self.serving.close(max(deadline - time.monotonic(), 0.1))
        self.podresources.join(max(deadline - time.monotonic(), 0.1))

    def _check_pipe_mount(self) -> None:
        """Warn when the MPS root's filesystem lacks nosuid,nodev: kubelet's
        bind mount of the pipe directory from Allocate inherits them (ADR 0011
        decision 6, D9); the remedy is the host filesystem's (ADR 0008)."""
        root = self.planner_config.layout.root
        remedy = ("mount the MPS root's host filesystem nosuid,nodev (a tmpfs such as /run on systemd hosts is), or "
                  "choose an MPS root on one")
        try:
            if os.path.isdir(root) and not {"nosuid", "nodev"} <= mountflags.flags(root):
                log.warning("MPS root %s is on a filesystem without nosuid,nodev: the pipe directory kubelet mounts "
                            "from Allocate inherits that (the NRI door's copy sets them); %s", root, remedy)
        except OSError as e:
            msg = (f"MPS root {root}: {e}; the pipe directory kubelet mounts from Allocate is then not "
                   f"nosuid,nodev (the NRI door's copy is); {remedy}")
            self.startup_warnings.append(msg)
            log.warning("%s", msg)

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
            "socket": self.serving.socket_path,
            "kubelet_socket": self.kubelet_socket,
            "registered": self.registered(),
            "registrations": self.registrar.stats.count,
            "last_registration_ms": round(self.registrar.stats.last_s * 1000, 1),
            "last_registration_trigger": self.registrar.stats.last_trigger,
            "last_registration_error": self.registrar.stats.last_error,
            "list_and_watch_streams": self.devices.active_streams(),
            "devices": len(self.table),
            "devices_per_gpu": dict(self.table.per_gpu),
            "healthy_devices": sum(n for u, n in self.table.per_gpu.items() if u not in unhealthy),
            "unhealthy_gpus": unhealthy,
            "policy": self.policy,
            "fail_open": self.fail_open,
            "pod_source": None if self.pod_source is None else ("ready" if self.pod_source.ready() else "not ready"),
            **{f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "_lock"},
            "startup_warnings": list(self.startup_warnings),
        }

    def ready(self) -> bool:
        """True when no GPU is Unhealthy and the pod source, when configured, is
        synced: the registrar waits for this before the first Register (ADR 0011
        decision 4), so kubelet's first Allocates are not answered the fallback."""
        if self.health.unhealthy():
            return False
        return self.pod_source is None or bool(self.pod_source.ready())

    def _on_registered(self, seconds: float) -> None:
        self.reregister_ms.append(seconds * 1000.0)
        del self.reregister_ms[:-100]

    # ---- GetPreferredAllocation / Allocate (decisions: allocator.py) -----------
    def preferred(self, request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
        """Answer GetPreferredAllocation (``Allocator.preferred``). Raises Refusal."""
        t0 = time.monotonic()
        out = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = self.allocator.preferred.devices(list(creq.available_deviceIDs),
                                                   list(creq.must_include_deviceIDs), int(creq.allocation_size))
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
        return self._response_for(a)

    def _response_for(self, a: Answer) -> pb.AllocateResponse:
        resp = pb.AllocateResponse()
        c = resp.container_responses.add()
        c.envs.update(a.env)
        c.envs[al.ENV_RESERVATION] = a.key
        for m in a.mounts:
            c.mounts.add(container_path=m.destination, host_path=m.source, read_only=m.read_only)
        if self.device_specs:
            paths = [f"/dev/nvidia{self.node.gpu_by_uuid(u).minor}" for u in a.uuids]  # type: ignore[union-attr]
            for p in paths + ["/dev/nvidiactl", "/dev/nvidia-uvm"]:
                c.devices.add(container_path=p, host_path=p, permissions="rw")
        for u in a.uuids:  # the node's CDI device of each GPU (ADR 0025b), else the operator's kind
            dev = self.cdi.device_for(u) if self.cdi is not None else None
            if dev is not None:
                c.cdi_devices.add(name=dev.name)
            elif self.cdi_kind:
                c.cdi_devices.add(name=f"{self.cdi_kind}={u}")
        c.annotations[ANNOTATION_ALLOCATE] = a.kind
        c.annotations[al.ANNOTATION_RESERVATION] = a.key
        return resp

    # ---- bookkeeping ---------------------------------------------------------
    def _refused(self, r: Refusal) -> None:
        self.counters.bump("refusals", last_refusal=r.message)
        log.warning("Allocate refused (%s): %s", r.code.name, r.message)
        if self.metrics is not None:
            guarded(log, "metrics.refusal", self.metrics.refusal, r.label)

    def _observe(self, door: str, seconds: float) -> None:
        if self.metrics is not None:
            guarded(log, "metrics.observe_hook", self.metrics.observe_hook, door, seconds)
