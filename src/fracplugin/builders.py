"""How ``fracplugin run`` builds its parts: ``Builder`` runs the build steps
in order from the configuration (``Builder.build``), registers and starts
each part in the daemon's ``parts``, and holds what it built for the
daemon's read side (``Daemon.checks``, ``Daemon.status``). What the built
parts call back into the daemon comes in as ``Hooks``. Also the small
helpers the steps share (``StartupError``, API client, addresses).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .config import Config
from .ledger import Ledger
from .model import ComputeMode, NodeInfo
from .mps.layout import MpsLayout
from .parts import (
    DevicePluginPart,
    InventoryPart,
    LedgerPart,
    MetricsPart,
    MpsPart,
    NriDoor,
    Part,
    PartBase,
    PodSourcePart,
    ServicePart,
)
from .planner import PlannerConfig
from .podsfile import PodsFileWatcher

if TYPE_CHECKING:
    from .cdi import CdiRegistry
    from .enforce.wiring import MemoryLimits
    from .events import EventRecorder
    from .gpu.inventory import Inventory
    from .gpu.simulated import SimulatedInventory
    from .kubelet.deviceplugin import DevicePluginServer
    from .kubelet.podlookup import PodSource
    from .metrics import Metrics
    from .mps.api import MpsApi
    from .noderules import NodeRules
    from .overlimit import OverLimitWatch
    from .restart import Restarter

log = logging.getLogger("fracplugin.daemon")  # the daemon's log, as before the split

POD_SOURCE_MISSING = ("the pod watch cannot run, so the doors do not know pods' containers: the device plugin door "
                      "answers Allocate with what is right for any pod, and the NRI door applies pod-level KAI forms "
                      "(gpu-fraction, gpu-memory, gpu-fraction-num-devices) to every container that asks, sidecars "
                      "included; give --kubeconfig or run in the cluster")
"""Why the doors work blind without API access (log line and ``/readyz`` detail; issue 25 item 1)."""

IN_CLUSTER_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class StartupError(RuntimeError):
    """A part could not start (bad inventory, address in use, ...): exit 1."""


def _fmt_addr(host: str, port: int) -> str:
    host = host or "0.0.0.0"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(IN_CLUSTER_TOKEN)


def _api_client(cfg: Config) -> Any:
    """A kubernetes ``ApiClient`` from ``--kubeconfig``; None in-cluster (each
    user loads the service account config on its own thread). Raises StartupError."""
    if not cfg.kubeconfig:
        return None
    from kubernetes import config as kconfig

    try:
        return kconfig.new_client_from_config(config_file=cfg.kubeconfig)
    except Exception as exc:
        raise StartupError(f"--kubeconfig {cfg.kubeconfig}: {exc}") from None


_P = TypeVar("_P", bound=PartBase)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What the built parts call back into the daemon: the health server's
    ``checks``, ``status`` and ``alive``, the node condition's ``checks``,
    the metrics' ``metric_state``, and ``request_stop(why)`` (stop as at
    SIGTERM; the NRI stub's fd-3 connection ended)."""

    checks: Callable[[], dict[str, dict[str, Any]]]
    status: Callable[[], dict[str, Any]]
    alive: Callable[[], str | None]
    metric_state: Callable[[], dict[str, Any]]
    request_stop: Callable[[str], None]


class Builder:
    """Builds the daemon's parts from ``cfg`` (``build``), registering and
    starting each in ``parts`` (a failed start then stops what started), and
    keeps what it built; ``None`` for what is off or not built yet."""

    def __init__(self, cfg: Config, parts: dict[str, Part], hooks: Hooks) -> None:
        self.cfg = cfg
        self.parts = parts
        self.hooks = hooks
        self.inventory: Inventory | None = None
        self.simulated: SimulatedInventory | None = None
        self.node: NodeInfo | None = None
        self.node_name = ""
        self.ledger: Ledger | None = None
        self.ledger_warnings: list[str] = []
        self.metrics: Metrics | None = None
        self.mps: MpsApi | None = None
        self.pod_source: PodSource | None = None
        self.events: EventRecorder | None = None
        self.restarter: Restarter | None = None  # the one pod evicter (ADR 0035), with API access
        self.rules: NodeRules | None = None  # the node's rules, every door admits through them (issue 33)
        self.nri: NriDoor | None = None
        self.device_plugin: DevicePluginServer | None = None
        self.over_limit: OverLimitWatch | None = None  # checks every usage poll (issue 35 item 3)
        self.memory_limits: MemoryLimits | None = None  # enforce.wiring.MemoryLimits (issue 23), None with --memory-limits off
        self.cdi: CdiRegistry | None = None  # once a door needs it (ADR 0025b)
        self.endpoints: dict[str, str] = {}

    def build(self) -> None:
        """Build and start every enabled part, in order. Raises StartupError
        (the caller stops what already started)."""
        steps = [("inventory", self._build_inventory), ("ledger", self._build_ledger),
                 ("metrics", self._build_metrics), ("mps", self._build_mps),
                 ("pod source", self._build_pod_source), ("events", self._build_events),
                 ("rules", self._build_rules), ("over limit", self._build_over_limit), ("nri", self._build_nri),
                 ("device plugin", self._build_device_plugin),
                 ("dra", self._build_dra), ("health", self._build_health),
                 ("node condition", self._build_node_condition)]
        if self.cfg.role == "mps":  # no ledger (the doors role owns it), no doors, no rules
            steps = [s for s in steps if s[0] in ("inventory", "metrics", "mps", "health")]
        elif not self.cfg.no_device_plugin:
            # the door's gRPC library (grpcio, ADR 0021) loads before any part starts a
            # thread or a child process; without the door it never loads (ADR 0016)
            from .kubelet import deviceplugin  # noqa: F401
        if self.cfg.dra and self.cfg.role != "mps":
            from .dra import server  # noqa: F401  (grpcio, as above)
        for name, step in steps:
            try:
                step()
            except StartupError:
                raise
            except Exception as exc:
                log.exception("starting %s failed", name)
                raise StartupError(f"{name}: {exc}") from exc

    def _add(self, part: _P) -> _P:
        """Register ``part`` (so that a failed start stops it) and start it."""
        self.parts[part.name] = part
        part.start()
        return part

    @property
    def planner_config(self) -> PlannerConfig:
        """Planner settings; per-container MPS namespaces only with MPS v3
        (classic v2 has none: sm-sharing containers share the daemon's pipe
        directory, ADR 0001)."""
        from .mps.control import choose_protocol

        override = None if self.cfg.mps_protocol == "auto" else int(self.cfg.mps_protocol)
        driver = self.node.driver_version if self.node is not None else ""
        return PlannerConfig(reserve_mib=self.cfg.reserve_mib, max_clients_per_gpu=self.cfg.max_clients_per_gpu,
                             layout=MpsLayout(self.cfg.mps_root), annotation_prefix=self.cfg.annotation_prefix,
                             mps_namespaces=choose_protocol(driver, override) >= 3,
                             cdi_devices=not self.cfg.no_cdi_devices)

    def _build_inventory(self) -> None:
        from .gpu.inventory import InventoryError

        try:
            if self.cfg.simulate_node:
                from .gpu.simulated import SimulatedInventory

                self.simulated = SimulatedInventory(self.cfg.simulate_node)
                self.inventory = self.simulated
            else:
                from .gpu.nvml import NvmlInventory

                self.inventory = NvmlInventory()
            node = self.node = self.inventory.node()
        except InventoryError as exc:
            raise StartupError(f"GPU inventory: {exc}") from None
        self._add(InventoryPart(self.cfg, self.inventory))
        self.node_name = self.cfg.node_name or node.name
        log.info("inventory ready", extra={
            "node": node.name, "simulated": bool(self.cfg.simulate_node), "driver": node.driver_version,
            "gpus": [f"{g.index}:{g.uuid}:{g.memory_mib}MiB" for g in node.gpus]})

    def _build_ledger(self) -> None:
        assert self.node is not None
        try:
            os.makedirs(self.cfg.state_dir, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"state directory {self.cfg.state_dir}: {exc.strerror or exc}") from None
        from .ledgerstore import remove_crash_leftovers, state_dir_warning

        tmpfs_warning = state_dir_warning(self.cfg.state_dir)
        if tmpfs_warning:
            log.warning(tmpfs_warning, extra={"state_dir": self.cfg.state_dir})
        ledger = self.ledger = Ledger(self.node, self.cfg.ledger_path, max_clients_per_gpu=self.cfg.max_clients_per_gpu)
        self.ledger_warnings = ledger.load()  # the ledger logs each warning itself
        for msg in remove_crash_leftovers(self.cfg.ledger_path):  # temps of killed writes, old corrupt copies
            log.info(msg, extra={"path": self.cfg.ledger_path})
        self._add(LedgerPart(self.cfg, ledger, self.ledger_warnings))
        log.info("ledger loaded", extra={"path": self.cfg.ledger_path, "tenancies": len(ledger.tenancies())})

    def _build_metrics(self) -> None:
        try:
            from .metrics import Metrics
        except ImportError as exc:
            log.warning("metrics unavailable: %s", exc)
            return
        metrics = self.metrics = Metrics(ledger=self.ledger, inventory=self.inventory, node=self.node,
                                         node_name=self.node_name, proc_root=self.cfg.proc_root)
        metrics.attach_state(self.hooks.metric_state)
        try:
            part = self._add(MetricsPart(self.cfg, metrics))
        except OSError as exc:
            raise StartupError(f"--metrics-address {self.cfg.metrics_address}: {exc.strerror or exc}") from None
        assert part.bound is not None
        self.endpoints["metrics"] = _fmt_addr(*part.bound)

    def _build_mps(self) -> None:
        from .mps.api import NullMps

        layout = MpsLayout(self.cfg.mps_root)
        if self.cfg.no_mps:
            self.mps = NullMps(layout)
            return
        modes = tuple(ComputeMode(m) for m in self.cfg.mps_modes)
        if self.cfg.role == "doors":
            # MPS lives in the MPS role (ADR 0009): talk to it, never start it.
            from .mps.rpc import RemoteMps

            self.mps = RemoteMps(self.cfg.effective_mps_api_socket, modes=modes)
            self._add(MpsPart(self.cfg, self.mps))
            st = self.mps.status()
            if not st.get("reachable"):
                log.warning("MPS role not reachable yet; MPS modes are down until it answers",
                            extra={"socket": self.cfg.effective_mps_api_socket, "reason": st.get("error")})
        else:
            self._build_supervisor(layout, modes)
        if self.metrics is not None:
            self.metrics.attach_mps(self.mps)

    def _build_supervisor(self, layout: MpsLayout, modes: tuple[ComputeMode, ...]) -> None:
        from .mps.supervisor import MpsSupervisor

        assert self.node is not None
        protocol = None if self.cfg.mps_protocol == "auto" else int(self.cfg.mps_protocol)
        exclusive = (tuple(g.uuid for g in self.node.gpus)
                     if self.cfg.exclusive_process and not self.cfg.simulate_node else ())
        sup = MpsSupervisor(layout, self.cfg.mps_control_binary, protocol, self.node.driver_version, modes,
                            exclusive_process_gpus=exclusive, detached=self.cfg.role == "mps",
                            probe_timeout_s=self.cfg.mps_probe_timeout_s,
                            probe_failure_threshold=self.cfg.mps_probe_failure_threshold)
        self.mps = sup
        try:
            self._add(MpsPart(self.cfg, sup))
        except Exception as exc:
            raise StartupError(f"MPS supervisor: {exc}") from None
        if self.cfg.role == "mps":
            from .mps.rpc import MpsApiServer

            try:
                self._add(ServicePart(self.cfg, "mps api", {"mps_api_socket", "mps_root"},
                                      MpsApiServer(sup, self.cfg.effective_mps_api_socket)))
            except OSError as exc:
                raise StartupError(f"--mps-api-socket {self.cfg.effective_mps_api_socket}: {exc.strerror or exc}") from None
            self.endpoints["mps_api"] = self.cfg.effective_mps_api_socket

    def _build_pod_source(self) -> None:
        # both doors read the pod's spec: the NRI door for pod-level KAI forms
        # (first or named app container), also with --no-device-plugin (issue 25 item 1)
        if self.cfg.no_device_plugin and self.cfg.no_nri:
            return
        from .kubelet.podlookup import InMemoryPodSource, KubernetesPodSource

        if self.cfg.pods_file:
            mem = InMemoryPodSource(self.node_name)
            watcher = PodsFileWatcher(self.cfg.pods_file, mem)
            self.pod_source = mem
            self._add(PodSourcePart(self.cfg, mem, watcher.start, watcher.stop))
            log.info("simulated API: pods file", extra={"path": self.cfg.pods_file, "pods": len(mem)})
        elif self.cfg.kubeconfig or _in_cluster():
            watch = KubernetesPodSource(self.node_name, self.cfg.resource_name, _api_client(self.cfg))
            self.pod_source = watch
            self._add(PodSourcePart(self.cfg, watch, watch.start, watch.stop))
            log.info("API watch started", extra={"node": self.node_name,
                                                  "via": "kubeconfig" if self.cfg.kubeconfig else "in-cluster"})
        else:
            log.warning("no API access (no --kubeconfig, not in a cluster, no --pods-file): " + POD_SOURCE_MISSING)

    def _build_events(self) -> None:
        """With API access, whichever doors are on: the event recorder and the
        one ``restart.Restarter`` (ADR 0035); else a null recorder, no restarter."""
        from .events import EventRecorder, NullEventRecorder
        from .restart import Restarter

        if not (self.cfg.kubeconfig or _in_cluster()):
            self.events = NullEventRecorder()
            return
        recorder = EventRecorder(_api_client(self.cfg), self.node_name)
        self.events = recorder
        self.restarter = Restarter(_api_client(self.cfg))
        self._add(ServicePart(self.cfg, "events", {"kubeconfig"}, recorder,
                              lambda: {"enabled": True, **recorder.stats()}))
        log.info("refusals and warnings become Kubernetes Events",
                 extra={"via": "kubeconfig" if self.cfg.kubeconfig else "in-cluster"})

    def _build_node_condition(self) -> None:
        """KAI's readiness gate: publish ``--node-condition-types`` from
        readiness when there is API access (ADR 0005)."""
        from .nodecondition import NodeConditionPublisher, condition_from_checks

        types = self.cfg.node_condition_types
        if not types:
            return
        if not (self.cfg.kubeconfig or _in_cluster()) or not self.node_name:
            log.info("node condition not published (no API access or no node name)", extra={"types": list(types)})
            return
        publisher = NodeConditionPublisher(
            _api_client(self.cfg), self.node_name, lambda: condition_from_checks(self.hooks.checks()), types)
        self._add(ServicePart(self.cfg, "node condition", {"node_condition_types", "kubeconfig", "node_name"},
                              publisher, publisher.status))
        log.info("publishing the node condition KAI gates on", extra={"types": list(types), "node": self.node_name})

    def _build_memory_limits(self) -> MemoryLimits | None:
        """CUDA memory limits per container (issue 23, ADR 0025): None with
        ``--memory-limits off``, else the ``enforce.wiring.MemoryLimits`` the
        NRI door calls (a part: readiness check ``memory_limits``)."""
        if self.cfg.memory_limits == "off" or self.node is None:
            return None
        from .enforce.memlimits import NvmlLimits
        from .enforce.wiring import MemoryLimits, MemoryLimitsPart

        if self.cfg.memory_limits == "auto" and self.cfg.simulate_node and not NvmlLimits.loadable():
            # A simulated node with no NVML library has nothing to set or read limits with:
            # auto means off there (ADR 0025); apply/verify chosen explicitly still run.
            log.info("memory limits: off (auto on a simulated node without NVML)")
            return None

        registry = self._cdi()

        def hook_of(uuid: str) -> bool:
            """The gate's CDI input: does the CDI spec for this GPU carry the toolkit's
            memory-limit hook (False where no spec lists the GPU: nothing would run it)."""
            dev = registry.device_for(uuid) if registry is not None else None
            return dev is not None and dev.has_memory_limit_hook

        ml = self.memory_limits = MemoryLimits.build(
            self.cfg, self.node, mps_protocol=lambda: self.mps.protocol if self.mps is not None else None,
            hook_of=hook_of if registry is not None else None,
            on_not_enforced=lambda pod, c, msg: self.events.limit_not_enforced(pod, c, msg) if self.events else None)
        if self.metrics is not None:
            ml.attach_metrics(self.metrics.registry, self.metrics.node_name())
        self._add(MemoryLimitsPart(self.cfg, ml))
        return ml

    def _cdi(self) -> CdiRegistry | None:
        """The node's CDI specs (``cdi.CdiRegistry`` over ``--cdi-spec-dirs``,
        ADR 0025b), built once; None without spec directories."""
        if self.cdi is None and self.cfg.cdi_spec_dirs and self.node is not None:
            from .cdi import CdiRegistry

            self.cdi = CdiRegistry(self.cfg.cdi_spec_dirs, self.node.gpus, kind=self.cfg.cdi_kind)
            # read now, then re-read in the background: no request path parses a spec (issue 34 item 5)
            self._add(ServicePart(self.cfg, "cdi", {"cdi_spec_dirs", "cdi_kind"}, self.cdi))
        return self.cdi

    def _build_rules(self) -> None:
        """The node's rules (``noderules.NodeRules``, issue 33): the one GPU
        health monitor (XIDs from the inventory, MPS health per mode, the
        cordon annotation read from the API: ``cordon.CordonWatch``), the
        memory-limit gate and the ledger, built once whichever doors are on;
        every door admits through them."""
        from .gpu.health import HealthMonitor
        from .noderules import NodeRules

        assert self.node is not None and self.ledger is not None
        monitor = HealthMonitor(self.inventory, [g.uuid for g in self.node.gpus],
                                ignored_xids=[int(x) for x in self.cfg.ignored_xids.split(",") if x.strip()],
                                mps_health=None if self.cfg.no_mps else self.mps, mode_of=self.ledger.mode, poll_s=0.1)
        self._add(ServicePart(self.cfg, "gpu health", {"ignored_xids", "simulate_node"}, monitor))
        any_door = not (self.cfg.no_nri and self.cfg.no_device_plugin) or self.cfg.dra
        limits = self._build_memory_limits() if any_door else None
        self.rules = NodeRules(self.node, self.ledger, self.planner_config, health=monitor,
                               limits=limits.nri if limits is not None else None)
        if (self.cfg.kubeconfig or _in_cluster()) and self.node_name:  # the cordon annotation (issue 36 item 6)
            from .cordon import CordonWatch

            watch = CordonWatch(_api_client(self.cfg), self.node, self.node_name, monitor,
                                poll_s=self.cfg.node_poll_interval_s)
            self._add(ServicePart(self.cfg, "cordon", {"kubeconfig", "node_name", "node_poll_interval_s"},
                                  watch, watch.status))

    def _build_over_limit(self) -> None:
        """The over-limit watch the usage poll feeds (issue 35 item 3, ADR
        0035): Events through the event recorder; with ``--over-limit
        restart`` pod evictions through the API client (restart.py)."""
        from .overlimit import OverLimitWatch

        if self.metrics is None:
            return
        self._restart_warning("over_limit", "containers above their GPU memory limit")
        ml = self.memory_limits
        self.over_limit = self.metrics.watch = OverLimitWatch(
            self.cfg.over_limit, self.events, self.restarter if self.cfg.over_limit == "restart" else None,
            dmem_used=ml.dmem_used if ml is not None else None)

    def _restart_warning(self, setting: str, what: str) -> None:
        """Log that ``--<setting> restart`` only reports ``what`` without API access."""
        if getattr(self.cfg, setting) == "restart" and self.restarter is None:
            log.warning(f"--{setting.replace('_', '-')} restart without API access (no --kubeconfig, not in a "
                        f"cluster): {what} are reported, not restarted")

    def _build_nri(self) -> None:
        if self.cfg.no_nri:
            return
        from .nri.plugin import FracNriPlugin
        from .nri.reconcile import Unfenced
        from .nri.stub import NriStub

        assert self.rules is not None and self.events is not None
        self._restart_warning("unfenced_containers", "fractional containers found running unfenced")
        events = self.events  # refusals and warnings queue an Event (never blocks)
        plugin = FracNriPlugin(self.rules, mps=self.mps,
                               metrics=self.metrics, fail_open=self.cfg.fail_open,
                               on_refusal=lambda pod, c, err: events.refused(pod, c, err, "nri"),
                               on_warning=lambda pod, c, message: events.warned(pod, c, message, "nri"),
                               pod_lookup=self.pod_source.get if self.pod_source is not None else None,
                               pod_ready=self.pod_source.ready if self.pod_source is not None else None,
                               unit_mib=self.cfg.device_unit_mib, resource_name=self.cfg.resource_name,
                               cdi=None if self.cfg.no_cdi_devices else self._cdi(),
                               start_wait_s=self.cfg.nri_start_wait_s,
                               unfenced=Unfenced(self.cfg.unfenced_containers, self.restarter, events))
        stub = NriStub(plugin, socket_path=self.cfg.nri_socket,
                       plugin_name=self.cfg.nri_plugin_name, plugin_idx=self.cfg.nri_plugin_idx,
                       on_bound=self.metrics.nri_bound_exceeded if self.metrics is not None else None)
        self.nri = self._add(NriDoor(self.cfg, stub, plugin))
        self.endpoints["nri_socket"] = self.cfg.nri_socket
        if stub.fd_mode:
            # Launched by the runtime with the NRI socket on fd 3 (docs/reference/nri-protocol.md 1.5): when that
            # connection ends the runtime will launch a new plugin, so this process must go.
            self.endpoints["nri_socket"] = f"fd {stub.fd}"

            def watch_exit() -> None:
                stub.wait_exit()
                self.hooks.request_stop(f"NRI connection on fd {stub.fd} ended (runtime-launched plugin)")

            threading.Thread(target=watch_exit, name="nri-fd-exit", daemon=True).start()

    def _build_device_plugin(self) -> None:
        if self.cfg.no_device_plugin:
            return
        from .kubelet.deviceplugin import DevicePluginServer
        from .kubelet.devices import DeviceTableTooLarge

        assert self.rules is not None
        try:
            server = DevicePluginServer(
                self.rules, pod_source=self.pod_source, resource_name=self.cfg.resource_name, unit_mib=self.cfg.device_unit_mib,
                plugin_dir=self.cfg.device_plugin_dir, kubelet_socket=self.cfg.effective_kubelet_socket,
                allocate_deadline_s=self.cfg.allocate_deadline_s,
                podresources_interval_s=self.cfg.pod_resources_interval_s,
                metrics=self.metrics, podresources_socket=self.cfg.pod_resources_socket,
                policy=self.cfg.allocation_policy, device_specs=self.cfg.device_specs, cdi_kind=self.cfg.cdi_kind,
                cdi=self._cdi(), fail_open=self.cfg.fail_open)
        except DeviceTableTooLarge as exc:
            # Kubelet could never receive the device list (devices.py): refuse to start.
            raise StartupError(f"--device-unit-mib {self.cfg.device_unit_mib}: {exc}") from None
        self.device_plugin = server
        try:
            self._add(DevicePluginPart(self.cfg, server))
        except OSError as exc:
            raise StartupError(f"device plugin: {exc}") from None
        self.endpoints["device_plugin_socket"] = server.socket_path
        self.endpoints["kubelet_socket"] = self.cfg.effective_kubelet_socket

    def _build_dra(self) -> None:
        """The DRA door (``--dra``, issue 29, ADR 0031): the Prepare logic
        over the one ledger, its gRPC servers, and the ResourceSlice publisher
        (unless ``--no-dra-slices``). Needs API access (claims are read from
        it): in-cluster or ``--kubeconfig``; a node name is needed for slices."""
        if not self.cfg.dra:
            return
        from .dra.claims import ApiClaims
        from .dra.prepare import Preparer
        from .dra.server import DraServer
        from .dra.slices import SlicePublisher
        from .parts import DraDoor

        assert self.node is not None and self.ledger is not None
        if not (self.cfg.kubeconfig or _in_cluster()):
            raise StartupError("--dra: the DRA door reads ResourceClaims from the API server; give --kubeconfig "
                               "or run in a pod (in-cluster config)")
        api = _api_client(self.cfg)
        # The pool and the slice's nodeName are the Kubernetes node's name (NODE_NAME / --node-name),
        # which a simulated node file or NVML's host name need not match.
        node = dataclasses.replace(self.node, name=self.node_name or self.node.name)
        assert self.rules is not None and self.rules.health is not None
        health = self.rules.health
        preparer = Preparer(self.rules, ApiClaims(api), self.cfg.dra_cdi_dir, node=node,
                            mps=None if self.cfg.no_mps else self.mps,
                            cdi=None if self.cfg.no_cdi_devices else self._cdi())
        server = DraServer(preparer, self.cfg.dra_plugins_dir, self.cfg.dra_registry_dir)
        slices = None
        if not self.cfg.no_dra_slices:
            ledger = self.ledger
            slices = SlicePublisher(api, node, reserve_mib=self.cfg.reserve_mib,
                                    healthy=lambda: {g.uuid: health.health(g.uuid).healthy for g in node.gpus},
                                    # each GPU's computeMode: the ledger's mode of its tenants, all doors
                                    modes=lambda: {g.uuid: ledger.mode(g.uuid) for g in node.gpus})
            ledger.subscribe(slices.poke)  # a hold taken or freed is published at once, not at the poll
            health.subscribe(slices.poke)  # so is a GPU's health
        try:
            self._add(DraDoor(self.cfg, server, slices))
        except OSError as exc:
            raise StartupError(f"dra: {exc}") from None
        self.endpoints["dra_socket"] = server.socket_path
        self.endpoints["dra_registration_socket"] = server.registration_path

    def simulate_xid(self, gpu_uuid: str, xid: int) -> None:
        """``POST /simulate/xid``: queue XID ``xid`` on ``gpu_uuid`` in the
        simulated inventory (``SimulatedInventory.inject_xid``); the node's
        health monitor (``NodeRules.health``) then sees it as NVML would deliver it.
        Raises LookupError for a GPU this node does not have; RuntimeError
        when the inventory is not simulated (the route is never offered then)."""
        from .gpu.inventory import InventoryError

        if self.simulated is None:
            raise RuntimeError("XIDs can only be injected into a simulated node (--simulate-node)")
        assert self.node is not None
        if self.node.gpu_by_uuid(gpu_uuid) is None:
            raise LookupError(f"no GPU {gpu_uuid} on node {self.node.name} "
                              f"(GPUs: {', '.join(g.uuid for g in self.node.gpus)})")
        try:
            self.simulated.inject_xid(gpu_uuid, xid)
        except InventoryError as exc:
            raise LookupError(str(exc)) from None

    def _build_health(self) -> None:
        from .health import HealthServer

        server = HealthServer(self.cfg.health_address, self.hooks.checks, self.hooks.status, alive=self.hooks.alive,
                              simulate_xid=self.simulate_xid if self.simulated is not None else None)
        try:
            self._add(ServicePart(self.cfg, "health", {"health_address"}, server))
        except OSError as exc:
            raise StartupError(f"--health-address {self.cfg.health_address}: {exc.strerror or exc}") from None
        self.endpoints["health"] = _fmt_addr(*server.bound)

