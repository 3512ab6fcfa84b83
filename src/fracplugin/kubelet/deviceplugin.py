"""The kubelet device plugin door: GPU memory as an extended resource.

What kubelet sees (docs/reference/kubelet-device-plugin.md A): one extended resource (default
``fracplugin.io/gpu-memory``), one device per ``unit_mib`` MiB of one GPU, IDs
``<GPU-UUID>::<n>`` (see ``devices.py``), served over gRPC (grpcio, ADR
0021; its options in ``grpcopts``) on a unix socket in the device plugin
directory and registered on ``kubelet.sock`` (``registration.py``).

Concurrency model: grpcio's synchronous server with a thread pool
(``max_workers`` threads ``fracplugin-dp_<n>``, default 16) and at most
``max_workers`` RPCs at once (more are answered RESOURCE_EXHAUSTED at once,
not queued behind streams that never end). Each open ListAndWatch stream
holds one worker while it is open: its generator waits on a condition
variable, woken when the device list changes, the server stops or is
replaced, or the RPC ends (``context.add_callback``). Allocate and
GetPreferredAllocation run on workers; the part of Allocate that chooses a
pod and writes the ledger runs under one lock (kubelet may call it
concurrently, A.5); waiting for the watch cache happens outside that lock.
Helper threads: the registrar (``registration.Registrar``), the health
monitor (``gpu.health.HealthMonitor``), the PodResources reconciler and,
when the daemon passes one, the pod watch (owned by the pod source).

What this module decides: nothing about GPUs. The gRPC server, the
registrar and ListAndWatch (device health from ``gpu.health.HealthMonitor``)
live here; Allocate, GetPreferredAllocation and the PodResources
reconciliation are decided by ``allocator.Allocator`` (ADR 0007: one
allocation for both doors), whose answer this module turns into an
``AllocateResponse``: env (including ``FRACPLUGIN_RESERVATION``, the
reservation key the NRI door binds at CreateContainer), mounts, optional
DeviceSpecs / CDI devices, and annotations ``fracplugin.io/allocate``
(``planned`` | ``reserved`` | ``fallback``) and ``fracplugin.io/reservation``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from typing import Any, Iterable, Iterator, Mapping, Sequence

import grpc

from .. import allocation as al
from .. import mountflags
from .. import planner as planner_mod
from .._proto import deviceplugin_pb2 as pb
from .._proto import deviceplugin_pb2_grpc as pb_grpc
from ..cdi import CdiRegistry
from ..gpu.health import DEFAULT_IGNORED_XIDS, DEFAULT_XID_RECOVERY_S, HealthMonitor
from ..gpu.inventory import Inventory
from ..ledger import Ledger
from ..mps.api import MpsApi
from ..ports import HookMetrics
from ..model import ComputeMode, NodeInfo
from . import podlookup
from .devices import (
    DEFAULT_RESOURCE_NAME,
    DEFAULT_UNIT_MIB,
    POLICIES,
    DeviceTable,
    validate_resource_name,
)
from . import grpcopts
from .allocator import Allocator, Refusal  # noqa: F401 (Refusal: re-exported)
from ..rpcstatus import StatusCode
from .podresources import DEFAULT_PODRESOURCES_SOCKET, PodResourcesClient, PodResourcesError
from .registration import DEFAULT_PLUGIN_DIR, KUBELET_SOCKET_NAME, Registrar, socket_identity

log = logging.getLogger(__name__)

DEFAULT_SOCKET_NAME = "fracplugin.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
ANNOTATION_ALLOCATE = "fracplugin.io/allocate"
ALLOCATE_UNADJUSTED = "unadjusted"
"""``fracplugin.io/allocate`` of a refusal answered under ``fail_open``."""
_NEVER_FAIL_OPEN = ("invalid", "internal")  # kubelet's request is malformed, or a bug of ours: refused either way


class _Servicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service's handlers, run on grpcio's worker threads;
    all state lives in the DevicePluginServer."""

    def __init__(self, owner: "DevicePluginServer") -> None:
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


class DevicePluginServer:
    """The device plugin: gRPC server, registration, health, Allocate.

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
        mps_health: the MPS port whose ``healthy(mode)`` marks GPUs Unhealthy
            (``gpu.health.MpsHealth``; None: not supervised).
        metrics: optional ``ports.HookMetrics``: ``observe_hook(door, seconds)`` (doors
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
            ``<cdi_kind>=<GPU-UUID>`` for GPUs ``cdi`` has no device for.
        cdi: the node's CDI specs (``cdi.CdiRegistry``): Allocate answers each
            allocated GPU's CDI device from them (ADR 0025b). None: only
            ``cdi_kind``.
        podresources_socket: kubelet's PodResources socket, read at ``start``
            to rebuild the ledger and then every ``podresources_interval_s``
            seconds to reconcile it (``Allocator.reconcile``; None: skip).
        max_workers: grpcio worker threads, and the most RPCs served at once
            (each open ListAndWatch stream holds one; at least 2: one stream
            and one call). An RPC over the limit is answered RESOURCE_EXHAUSTED.
        poll_s: registrar and health polling period in seconds.
        secure_pipe_mount: at ``start``, make the MPS root (the layout's
            ``root``) a ``nosuid,nodev`` mount when its filesystem lacks the
            flags (``fracplugin.mountflags``), undone at ``stop``. Kubelet's
            bind mount of the pipe directory from Allocate inherits the
            source mount's flags; the API has no mount options (issue 11, D9).
            Needs CAP_SYS_ADMIN in the host mount namespace: a daemon run on
            the host, never the chart's DaemonSet (no SYS_ADMIN, no
            Bidirectional propagation; ADR 0008). Off: only a startup warning
            when the flags are missing.
        fail_open: an Allocate refused for the pod's fraction (a contract or
            node guard refusal, an Unhealthy GPU) is answered with an
            unadjusted container (no env, no mounts, annotation
            ``fracplugin.io/allocate: unadjusted``; nothing recorded in the
            ledger) instead of the gRPC error, with a warning; the refusal is
            still counted. A malformed request (``invalid``) or an internal
            error is refused either way. The NRI door's ``fail_open`` does the
            same at CreateContainer (``nri.plugin``). Reloadable: the daemon
            sets the attribute on SIGHUP.

    Raises:
        ValueError: bad resource name, unit, policy, ``max_workers`` < 2, or a
            device ID over 63 chars;
        devices.DeviceTableTooLarge (a ValueError): the ListAndWatch response
            would exceed 3.5 MiB (kubelet's gRPC receive limit is 4 MiB), naming
            the unit, the device count and the smallest unit that fits.
    """

    def __init__(
        self,
        node: NodeInfo,
        ledger: Ledger,
        planner_config: planner_mod.PlannerConfig | None = None,
        inventory: Inventory | None = None,
        pod_source: podlookup.PodSource | None = None,
        resource_name: str = DEFAULT_RESOURCE_NAME,
        unit_mib: int = DEFAULT_UNIT_MIB,
        plugin_dir: str = DEFAULT_PLUGIN_DIR,
        socket_name: str = DEFAULT_SOCKET_NAME,
        kubelet_socket: str | None = None,
        allocate_deadline_s: float = 5.0,
        mps_health: MpsApi | None = None,
        metrics: HookMetrics | None = None,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        *,
        xid_recovery_s: float | None = DEFAULT_XID_RECOVERY_S,
        policy: str = "pack",
        device_specs: bool = False,
        cdi_kind: str | None = None,
        cdi: CdiRegistry | None = None,
        podresources_socket: str | None = DEFAULT_PODRESOURCES_SOCKET,
        podresources_interval_s: float = 10.0,
        max_workers: int = 16,
        poll_s: float = 0.1,
        secure_pipe_mount: bool = False,
        fail_open: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"allocation policy {policy!r} must be one of {', '.join(POLICIES)}")
        if max_workers < 2:
            raise ValueError(f"max_workers {max_workers} must be at least 2 (one ListAndWatch stream and one call)")
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
        self.socket_name = socket_name
        self.socket_path = os.path.join(plugin_dir, socket_name)
        self._name_gen = 0
        self._bound_path = ""
        self.kubelet_socket = kubelet_socket or os.path.join(plugin_dir, KUBELET_SOCKET_NAME)
        self.allocate_deadline_s = allocate_deadline_s
        self.metrics = metrics
        self.policy = policy
        self.device_specs = device_specs
        self.cdi_kind = cdi_kind
        self.cdi = cdi
        self.podresources_socket = podresources_socket
        self.podresources_interval_s = podresources_interval_s
        self._reconciler: threading.Thread | None = None
        self._reconcile_stop = threading.Event()
        self.max_workers = max_workers
        self.secure_pipe_mount = secure_pipe_mount
        self.fail_open = fail_open
        self._secured_root: str | None = None
        self.health = HealthMonitor(inventory, [g.uuid for g in node.gpus], ignored_xids=ignored_xids,
                                    xid_recovery_s=xid_recovery_s, mps_health=mps_health, mode_of=self._mode_of,
                                    poll_s=max(poll_s, 0.05))
        self.health.subscribe(self._devices_changed)
        self.registrar = Registrar(
            self, self.kubelet_socket, self.resource_name, poll_s=poll_s, on_registered=self._on_registered,
        )
        self._init_serving()
        self.allocator = Allocator(
            node, ledger, self.planner_config, self.table, self.resource_name, pod_source, allocate_deadline_s,
            self.health.unhealthy, policy=policy,
        )
        self.counters = self.allocator.counters
        self.reregister_ms: list[float] = []
        self.startup_warnings: list[str] = []

    def _init_serving(self) -> None:
        """The ListAndWatch condition and the gRPC server slots (nothing served yet)."""
        self._cond = threading.Condition()
        self._version = 0
        self._response = self._build_response()
        self._stopping = False
        self._gen = 0
        self._streams = 0
        self._last_stream_end = 0.0
        self._server: _Served | None = None
        self._socket_id: tuple[int, int] | None = None
        self._server_lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        """Health first, then serve on the socket, rebuild the ledger from
        PodResources (best effort), then register (in the background, with
        retries; ``registered()`` turns True when kubelet accepted us).
        Raises OSError / RuntimeError when the socket cannot be served."""
        self._stopping = False
        self._check_pipe_mount()
        self.health.start()
        self._devices_changed()
        self._serve()
        if self.podresources_socket and os.path.exists(self.podresources_socket):
            client = PodResourcesClient(self.podresources_socket)
            try:
                self.startup_warnings.extend(self.rebuild_from_podresources(client))
            except PodResourcesError as e:
                self.startup_warnings.append(str(e))
                log.warning("ledger rebuild from PodResources skipped: %s", e)
            finally:
                client.close()
        if self.podresources_socket:
            self._reconcile_stop.clear()
            self._reconciler = threading.Thread(target=self._reconcile_loop, name="fracplugin-podresources",
                                                daemon=True)
            self._reconciler.start()
        self.registrar.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop advertising first (end every ListAndWatch stream, so kubelet
        sees the resource go away), then stop registering, stop the gRPC server
        (in-flight calls get what is left of ``timeout_s``, then are cancelled
        and their connections closed), remove our socket and stop the health
        monitor."""
        deadline = time.monotonic() + timeout_s
        self._reconcile_stop.set()
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
            self._close_server(server, max(deadline - time.monotonic(), 0.1))
        rec, self._reconciler = self._reconciler, None
        if rec is not None:
            rec.join(max(deadline - time.monotonic(), 0.1))
        if sid is not None and socket_identity(self._bound_path) == sid:
            try:
                os.unlink(self._bound_path)
            except FileNotFoundError:
                pass
        self.health.stop(max(deadline - time.monotonic(), 0.1))
        if self._secured_root is not None:
            mountflags.release(self._secured_root)
            self._secured_root = None

    def _check_pipe_mount(self) -> None:
        """See ``secure_pipe_mount``: a failure to secure is a startup
        warning; flags missing while not asked to secure are logged. The
        remedy each message names is one that can work where the flag failed:
        mount(2) needs CAP_SYS_ADMIN in the host mount namespace, and a mount
        made inside a pod reaches the host's kubelet only through
        Bidirectional mount propagation, neither of which the chart's
        DaemonSet has (ADR 0008), so ``--secure-pipe-mount`` is for a daemon
        run on the host; in the DaemonSet the MPS root's filesystem itself
        must be nosuid,nodev (``/run`` on systemd hosts is)."""
        root = self.planner_config.layout.root
        remedy = ("mount the MPS root's host filesystem nosuid,nodev (a tmpfs such as /run on systemd hosts is), or "
                  "choose an MPS root on one")
        try:
            if self.secure_pipe_mount:
                if mountflags.secure(root):
                    self._secured_root = root
                    log.info("MPS root %s is now a nosuid,nodev bind mount (for Allocate's pipe mount)", root)
                return
            if os.path.isdir(root) and not {"nosuid", "nodev"} <= mountflags.flags(root):
                log.warning("MPS root %s is on a filesystem without nosuid,nodev: the pipe directory kubelet mounts "
                            "from Allocate inherits that (the NRI door's copy sets them); %s (--secure-pipe-mount "
                            "works only for a daemon run on the host with CAP_SYS_ADMIN, not in the chart's "
                            "DaemonSet)", root, remedy)
        except OSError as e:
            if self.secure_pipe_mount:
                msg = (f"MPS root {root}: --secure-pipe-mount could not make it a nosuid,nodev mount: {e}; the pipe "
                       "directory kubelet mounts from Allocate is then not nosuid,nodev (the NRI door's copy is). "
                       "mount(2) needs CAP_SYS_ADMIN in the host mount namespace, and from a pod the host's kubelet "
                       "sees the mount only with Bidirectional mount propagation; the chart's DaemonSet has neither, "
                       f"so drop --secure-pipe-mount there and {remedy}")
            else:
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
            "fail_open": self.fail_open,
            "pod_source": None if self.pod_source is None else ("ready" if self.pod_source.ready() else "not ready"),
            "allocations": c.allocations,
            "preferred": c.preferred,
            "planned": c.planned,
            "reserved": c.reserved,
            "fallbacks": c.fallbacks,
            "refusals": c.refusals,
            "last_fallback": c.last_fallback,
            "last_refusal": c.last_refusal,
            "startup_warnings": list(self.startup_warnings),
        }

    def clear_xid(self, gpu_uuid: str) -> bool:
        """Operator action: forget an XID mark on a GPU (Healthy again unless MPS is down)."""
        return self.health.clear(gpu_uuid)

    # ---- gRPC server (RegistrationTarget) ------------------------------------
    def _close_server(self, server: "_Served", budget_s: float) -> None:
        """Stop ``server`` within ``budget_s`` seconds: stop listening, let
        in-flight calls finish for three quarters of it, then cancel them and
        close every connection (grpcio's ``stop(grace)``), and wait for that
        at most to the end of the budget; then let its worker threads go.
        (A call whose request a peer never finishes sending counts as in
        flight until it is cancelled.)"""
        budget_s = max(budget_s, 0.0)
        done = server.server.stop(grace=budget_s * 0.75)
        if not done.wait(budget_s):
            log.warning("device plugin server: calls still being cancelled %.1f s after stop", budget_s)
        server.pool.shutdown(wait=False, cancel_futures=True)

    def _serve(self) -> None:
        """Serve on ``self.socket_path``: bind a temporary name in the same
        directory, then rename it into place. grpcio's core unlinks the path
        it bound when its server stops; with the rename that is the temporary name, so
        stopping an old server can never delete a newer socket at the public
        path (issue 11: the socket deleted again right after it was re-created
        left the plugin serving on no file). Raises OSError when the socket
        cannot be bound."""
        os.makedirs(self.plugin_dir, exist_ok=True)
        with self._server_lock:
            old, self._server = self._server, None
            old_id, old_path = self._socket_id, self._bound_path
        if old is not None:
            self._close_server(old, 2.0)
        if old_path and old_path != self.socket_path and old_id is not None and socket_identity(old_path) == old_id:
            try:
                os.unlink(old_path)  # our previous name; kubelet dials the new one
            except FileNotFoundError:
                pass
        try:
            os.unlink(self.socket_path)  # a stale socket from an earlier run (A.8)
        except FileNotFoundError:
            pass
        tmp = os.path.join(self.plugin_dir, f".{os.path.basename(self.socket_path)}.{os.getpid()}.tmp")
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        server = self._listen(tmp)
        os.rename(tmp, self.socket_path)
        # (-1, -1) when the file is already gone again: never equal to a real
        # identity, so the registrar serves anew.
        sid = socket_identity(self.socket_path) or (-1, -1)
        with self._server_lock:
            self._server = server
            self._socket_id = sid
            self._bound_path = self.socket_path
        with self._cond:
            self._gen += 1
            self._cond.notify_all()
        log.info("device plugin serving %s on %s", self.resource_name, self.socket_path)

    def _listen(self, path: str) -> "_Served":
        """A started grpcio server for the DevicePlugin service on unix socket
        ``path`` (options: ``grpcopts.server_options``). Raises OSError when
        the socket cannot be bound."""
        pool = futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="fracplugin-dp")
        server = grpc.server(pool, options=grpcopts.server_options(), maximum_concurrent_rpcs=self.max_workers)
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        try:
            bound = server.add_insecure_port("unix:" + path)
        except RuntimeError as e:  # grpcio raises where older versions returned 0
            bound, why = 0, str(e)
        else:
            why = "grpc could not bind it"
        if bound == 0:
            server.stop(grace=0)
            pool.shutdown(wait=False)
            raise OSError(f"cannot listen on {path}: {why}")
        server.start()
        return _Served(server, pool)

    def socket_identity(self) -> tuple[int, int] | None:
        return self._socket_id

    def rebind(self) -> None:
        """Serve on a fresh socket (kubelet wiped ours on restart)."""
        if self._stopping:
            raise RuntimeError("device plugin is stopping")
        self._serve()

    def rebind_as_new(self) -> None:
        """Serve on a socket with a new file name ``<stem>-<n>.sock`` (the same
        kubelet may hold, or be stuck on, the old path: kubelet 1.37 refuses a
        second Register on a path it considers connected)."""
        if self._stopping:
            raise RuntimeError("device plugin is stopping")
        self._name_gen += 1
        stem, ext = os.path.splitext(self.socket_name)
        self.socket_path = os.path.join(self.plugin_dir, f"{stem}-{self._name_gen}{ext}")
        self._serve()

    def reset_name(self) -> None:
        """The next ``rebind`` uses the configured socket name (a new kubelet)."""
        self._name_gen = 0
        self.socket_path = os.path.join(self.plugin_dir, self.socket_name)

    def ready(self) -> bool:
        """True when every device can be served Healthy (no GPU Unhealthy:
        MPS daemons up, no XID) and Allocate can find pods (the pod source,
        when configured, is synced): the registrar waits for this before the
        first Register, so kubelet is not first told every device is
        Unhealthy (issue 11, D7) and its first Allocates are not answered
        with the fallback ("pod source not ready", seen with a real kubelet)."""
        if self.health.unhealthy():
            return False
        return self.pod_source is None or bool(self.pod_source.ready())

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

    def _reconcile_loop(self) -> None:
        """Every ``podresources_interval_s``: ``Allocator.reconcile`` with
        kubelet's PodResources List (whole GPUs of other plugins, reservations
        kubelet freed or that were never bound). Errors are logged, never fatal."""
        client: PodResourcesClient | None = None
        try:
            while not self._reconcile_stop.wait(self.podresources_interval_s):
                if not self.podresources_socket or not os.path.exists(self.podresources_socket):
                    continue
                try:
                    client = client or PodResourcesClient(self.podresources_socket)
                    for w in self.allocator.reconcile(client.list()):
                        log.info("PodResources reconcile: %s", w)
                except PodResourcesError as e:
                    if self._reconcile_stop.is_set():
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

    # ---- restart recovery ----------------------------------------------------
    def rebuild_from_podresources(self, client: PodResourcesClient) -> list[str]:
        """Make the ledger agree with kubelet's PodResources List at start
        (``Allocator.reconcile(initial=True)``: kubelet never calls Allocate
        again for running containers, A.5). Returns warnings. Raises
        PodResourcesError when kubelet cannot be asked."""
        return self.allocator.reconcile(client.list(), initial=True)


class _Served:
    """One running grpcio server of the door and the worker pool it owns."""

    __slots__ = ("server", "pool")

    def __init__(self, server: grpc.Server, pool: futures.ThreadPoolExecutor) -> None:
        self.server = server
        self.pool = pool
