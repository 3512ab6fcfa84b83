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
Helper threads: the registrar (``registration.Registrar``), the
PodResources reconciler and,
when the daemon passes one, the pod watch (owned by the pod source).

What this module decides: nothing about GPUs. The gRPC server, the
registrar and ListAndWatch (device health from the node's ``gpu.health.HealthMonitor``)
live here; Allocate, GetPreferredAllocation and the PodResources
reconciliation are decided by ``allocator.Allocator`` (ADR 0007: one
allocation for both doors), whose answer this module turns into an
``AllocateResponse``: env (including ``FRACPLUGIN_RESERVATION``, the
reservation key the NRI door binds at CreateContainer), mounts, optional
DeviceSpecs / CDI devices, and annotations ``fracplugin.io/allocate``
(``planned`` | ``reserved`` | ``fallback``) and ``fracplugin.io/reservation``.

Where the parts are (issue 26, ADR 0023: one public class, its methods in
mixins by responsibility): this module holds ``DevicePluginServer``'s
construction, ``start`` / ``stop``, status and readiness, and the
PodResources upkeep; ``servicer.py`` the gRPC servicer, ListAndWatch and
the Allocate / GetPreferredAllocation responses; ``doorserver.py`` the gRPC
server, its socket and the registrar's target methods; ``doorbase.py`` the
state they share.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from .. import mountflags
from ..cdi import CdiRegistry
from ..gpu.health import HealthMonitor
from ..noderules import NodeRules
from ..ports import HookMetrics
from . import podlookup
from .devices import (
    DEFAULT_RESOURCE_NAME,
    DEFAULT_UNIT_MIB,
    POLICIES,
    DeviceTable,
    validate_resource_name,
)
from .allocator import Allocator, Refusal
from .doorserver import _DoorServing
from .podresources import DEFAULT_PODRESOURCES_SOCKET, PodResourcesClient, PodResourcesError
from .registration import DEFAULT_PLUGIN_DIR, KUBELET_SOCKET_NAME, Registrar, socket_identity
from .servicer import ALLOCATE_UNADJUSTED, ANNOTATION_ALLOCATE, HEALTHY, UNHEALTHY

__all__ = [
    "ALLOCATE_UNADJUSTED", "ANNOTATION_ALLOCATE", "DEFAULT_SOCKET_NAME", "HEALTHY", "UNHEALTHY",
    "DevicePluginServer", "Refusal",
]

log = logging.getLogger(__name__)

DEFAULT_SOCKET_NAME = "fracplugin.sock"


class DevicePluginServer(_DoorServing):
    """The device plugin: gRPC server, registration, health, Allocate.

    Args:
        rules: the node's rules (``noderules.NodeRules``: GPUs, the shared
            ledger, planner settings, the node's health monitor, the memory-limit
            gate); Allocate admits through them.
        pod_source: a ``podlookup.PodSource`` (watch cache); None = no API access
            (every Allocate answers the fallback).
        resource_name: the extended resource (validated: kubelet's rule, A.3).
        unit_mib: MiB per device (default 1024).
        plugin_dir: kubelet's device plugin directory.
        socket_name: our socket's file name in ``plugin_dir``.
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
        max_workers: grpcio worker threads, and the most RPCs served at once
            (each open ListAndWatch stream holds one; at least 2: one stream
            and one call). An RPC over the limit is answered RESOURCE_EXHAUSTED.
        poll_s: registrar polling period in seconds.
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
        rules: NodeRules,
        pod_source: podlookup.PodSource | None = None,
        resource_name: str = DEFAULT_RESOURCE_NAME,
        unit_mib: int = DEFAULT_UNIT_MIB,
        plugin_dir: str = DEFAULT_PLUGIN_DIR,
        socket_name: str = DEFAULT_SOCKET_NAME,
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
        max_workers: int = 16,
        poll_s: float = 0.1,
        fail_open: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"allocation policy {policy!r} must be one of {', '.join(POLICIES)}")
        if max_workers < 2:
            raise ValueError(f"max_workers {max_workers} must be at least 2 (one ListAndWatch stream and one call)")
        if "/" in socket_name:
            raise ValueError(f"socket name {socket_name!r} must be a file name (kubelet joins it with its dir)")
        node = self.node = rules.node
        self.ledger = rules.ledger
        self.planner_config = rules.config
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
        self.fail_open = fail_open
        # the node's health monitor (started by the daemon, issue 33); without one nothing is Unhealthy
        self.health = rules.health or HealthMonitor(None, [g.uuid for g in node.gpus])
        self.health.subscribe(self._devices_changed)
        self.registrar = Registrar(
            self, self.kubelet_socket, self.resource_name, poll_s=poll_s, on_registered=self._on_registered,
        )
        self._init_serving()
        self.allocator = Allocator(rules, self.table, self.resource_name, pod_source, allocate_deadline_s,
                                   self.health.unhealthy, policy=policy)
        self.counters = self.allocator.counters
        self.reregister_ms: list[float] = []
        self.startup_warnings: list[str] = []

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        """Serve on the socket, rebuild the ledger from
        PodResources (best effort), then register (in the background, with
        retries; ``registered()`` turns True when kubelet accepted us).
        Raises OSError / RuntimeError when the socket cannot be served."""
        self._stopping = False
        self._check_pipe_mount()
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
        and their connections closed), remove our socket (the node's health monitor is the daemon's)."""
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

    def _check_pipe_mount(self) -> None:
        """Warn when the MPS root's filesystem lacks nosuid,nodev: kubelet's
        bind mount of the pipe directory from Allocate inherits the source
        mount's flags, the device plugin API has no mount options (issue 11,
        D9); the NRI door's copy sets them itself. The remedy is the host
        filesystem's (``/run`` on systemd hosts is nosuid,nodev): the chart's
        DaemonSet can mount nothing on the host (no CAP_SYS_ADMIN, no
        Bidirectional propagation; ADR 0008)."""
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
