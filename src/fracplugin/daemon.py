"""``fracplugin run``: build every part, start them, serve, stop them in order.

Start order (each part switchable, DESIGN.md section 3):

1. inventory: NVML, or ``SimulatedInventory`` with ``--simulate-node``;
2. ledger: ``<state-dir>/ledger.json``, loaded (warnings logged, a corrupt
   file moved aside by the ledger);
3. metrics (``--metrics-address``);
4. MPS supervisor for the configured compute modes (``NullMps`` with ``--no-mps``);
5. pod source for the device plugin: ``--pods-file`` (simulated API),
   else the API watch when in-cluster or ``--kubeconfig`` is given;
6. Kubernetes Events for refusals (events.py): an ``EventRecorder`` (one
   background thread) when API access is configured (in-cluster or
   ``--kubeconfig``; a ``--pods-file`` is not API access) and the NRI door is
   on, else a ``NullEventRecorder``; the NRI plugin hands it every refusal
   (door ``nri``). The device plugin door reports refusals only as a metrics
   code (no pod in hand), so it writes no Events;
7. NRI plugin + stub (``--no-nri`` to disable);
8. device plugin server + registration (``--no-device-plugin`` to disable);
   it reads kubelet's PodResources API (``--pod-resources-socket``) at start
   to rebuild the ledger for containers allocated before a restart;
9. health server (``/healthz``, ``/readyz``, ``/status``, and with
   ``--simulate-node`` only ``POST /simulate/xid``, which injects an XID into
   the simulated inventory: health.py); the bound addresses are logged and
   written to ``<state-dir>/endpoints.json``.

Stop order (SIGTERM/SIGINT), within ``--shutdown-timeout`` seconds in all:
health turns not-alive, the device plugin stops advertising (its socket goes,
kubelet sees the stream end), NRI disconnects, the event recorder sends what
is queued (bounded) and stops, the pod watch and metrics stop, MPS quits last. Every ledger change is persisted atomically when it happens
(ledger.py), so the file is consistent whatever point a stop reaches; nothing
is released from the ledger at shutdown: containers keep running, and the next
start reads the same tenancy back.

SIGHUP re-reads the configuration (file, env, the original flags) and applies
what can change at run time (``config.RELOADABLE``: log level, log format,
fail-open); it logs which settings it applied and which need a restart.

Concurrency model: the main thread owns the lifecycle: it starts the parts,
then sleeps on an event that the signal handlers set (handlers only set
flags; the work happens on the main thread). Each part runs its own threads
(stated in its module). Stops run on short-lived helper threads so that one
stuck part cannot eat the whole shutdown budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from . import __version__, logs
from . import config as configmod
from .config import Config, ConfigError
from .health import HealthServer
from .ledger import Ledger
from .model import ComputeMode, NodeInfo
from .mps.layout import MpsLayout
from .planner import PlannerConfig

log = logging.getLogger("fracplugin.daemon")

IN_CLUSTER_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class StartupError(RuntimeError):
    """A part could not start (bad inventory, address in use, ...): exit 1."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``fracplugin run`` (see ``config.add_arguments``)."""
    configmod.add_arguments(p)


# ---- the simulated API: a pods file ----------------------------------------
def read_pods_file(path: str) -> list[dict[str, Any]]:
    """Pod documents of a YAML file (``kind: Pod`` docs, or ``kind: List`` /
    ``PodList`` items). A missing or empty file is no pods. A pod whose shape
    the lookup cannot read (``podlookup.pod_problem``, e.g. ``containers: 'abc'``)
    is skipped with a warning naming the pod and the file. Raises ValueError
    for a file that cannot be read as YAML at all (invalid YAML, nesting too
    deep for the parser, not UTF-8, unreadable): never another exception."""
    from .kubelet.podlookup import describe_pod, pod_problem

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"pods file {path} cannot be read: {exc}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"pods file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ValueError(f"pods file {path} is nested too deeply to parse; rejected") from None
    except Exception as exc:  # the parser is not ours: any failure rejects the file, never the daemon
        raise ValueError(f"pods file {path} cannot be parsed: {type(exc).__name__}: {exc}") from None
    pods: list[dict[str, Any]] = []
    candidates: list[Any] = []
    for d in docs:
        if not isinstance(d, dict):
            log.warning("pods file %s: a document that is not an object (%s) skipped", path, type(d).__name__)
            continue
        if d.get("kind") in ("List", "PodList"):
            items = d.get("items") or []
            if not isinstance(items, list):
                log.warning("pods file %s: a %s whose items are not a list skipped", path, d.get("kind"))
                continue
            candidates.extend(items)
        elif d.get("kind", "Pod") == "Pod" and isinstance(d.get("metadata"), dict):
            candidates.append(d)
    for pod in candidates:
        problem = pod_problem(pod)
        if problem is not None:
            log.warning("pods file %s: pod %s skipped: %s", path, describe_pod(pod), problem,
                        extra={"path": path, "pod": describe_pod(pod)})
            continue
        pods.append(pod)
    return pods


class PodsFileWatcher:
    """Feeds an ``InMemoryPodSource`` from a YAML file, re-read when its
    (mtime, size) changes; pods that disappear from the file are deleted
    (like watch DELETED events).

    Concurrency: one daemon thread polling every ``poll_s`` seconds.
    """

    def __init__(self, path: str, source: Any, poll_s: float = 0.1) -> None:
        self.path = path
        self.source = source
        self.poll_s = poll_s
        self._seen: dict[str, dict[str, Any]] = {}
        self._stamp: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _key(pod: Mapping[str, Any]) -> str:
        md = pod.get("metadata") or {}
        return str(md.get("uid") or f"{md.get('namespace', 'default')}/{md.get('name', '')}")

    def sync(self) -> bool:
        """Re-read the file if it changed; returns True when it was read."""
        try:
            st = os.stat(self.path)
            stamp: tuple[float, int] | None = (st.st_mtime, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            pods = read_pods_file(self.path)
        except ValueError as exc:
            log.warning("%s; keeping the %d pods read before", exc, len(self._seen),
                        extra={"path": self.path})
            return False
        now = {self._key(p): p for p in pods}
        for key, pod in self._seen.items():
            if key not in now:
                self.source.delete(pod)
        for key, pod in now.items():
            if self._seen.get(key) != pod:
                self.source.add(pod)
        self._seen = now
        log.debug("pods file read", extra={"path": self.path, "pods": len(now)})
        return True

    def start(self) -> None:
        """Read the file once (a bad file is logged, never raised: the daemon
        starts with no pods) and start polling."""
        try:
            self.sync()
        except Exception as exc:  # pragma: no cover - sync handles what it knows
            log.warning("pods file %s not read: %s: %s", self.path, type(exc).__name__, exc)
        self._thread = threading.Thread(target=self._run, name="fracplugin-podsfile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sync()
            except Exception as exc:  # never let the watcher die
                log.warning("pods file watcher: %s: %s", type(exc).__name__, exc, extra={"path": self.path})

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


# ---- helpers -----------------------------------------------------------------
def _write_json_atomic(path: str, doc: Any) -> None:
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".endpoints.", dir=d)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _fmt_addr(host: str, port: int) -> str:
    host = host or "0.0.0.0"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _call_bounded(name: str, fn: Callable[[], Any], timeout_s: float) -> bool:
    """Run ``fn`` on a helper thread; wait at most ``timeout_s``. True when it
    finished in time without raising (a late one is logged and abandoned:
    helper threads are daemons)."""
    done = threading.Event()
    err: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            err.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=target, name=f"stop-{name}", daemon=True)
    t0 = time.monotonic()
    t.start()
    if not done.wait(max(timeout_s, 0.05)):
        log.error("stopping %s did not finish within %.1f s; continuing", name, timeout_s,
                  extra={"part": name})
        return False
    if err:
        log.error("stopping %s failed: %s", name, err[0], extra={"part": name})
        return False
    log.info("stopped %s", name, extra={"part": name, "elapsed_ms": round((time.monotonic() - t0) * 1000, 1)})
    return True


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(IN_CLUSTER_TOKEN)


# ---- the daemon ----------------------------------------------------------------
class Daemon:
    """All parts of the node daemon, with their lifecycle.

    Args:
        cfg: the effective configuration.
        sources: where each non-default setting came from (for the start log).
        reload: returns a freshly loaded (Config, sources) for SIGHUP; None
            disables reloading.

    ``start()`` raises StartupError (after stopping what had started);
    ``stop()`` is idempotent and bounded by ``cfg.shutdown_timeout_s``.
    """

    def __init__(self, cfg: Config, sources: Mapping[str, str] | None = None,
                 reload: Callable[[], tuple[Config, dict[str, str]]] | None = None) -> None:
        if cfg.role == "mps":  # the MPS role runs no door (ADR 0009)
            cfg = dataclasses.replace(cfg, no_nri=True, no_device_plugin=True)
        self.cfg = cfg
        self.sources = dict(sources or {})
        self._reload = reload
        self.started_at = time.time()
        self.inventory: Any = None
        self.node: NodeInfo | None = None
        self.node_name = ""
        self.ledger: Ledger | None = None
        self.metrics: Any = None
        self.mps: Any = None
        self.mps_api: Any = None
        self.pod_source: Any = None
        self.pods_watcher: PodsFileWatcher | None = None
        self.events: Any = None
        self.node_condition: Any = None
        self.nri_plugin: Any = None
        self.nri_stub: Any = None
        self.device_plugin: Any = None
        self.health: HealthServer | None = None
        self.endpoints: dict[str, str] = {}
        self.ledger_warnings: list[str] = []
        self.startup_ms: float | None = None
        self._stopping = threading.Event()
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.wake = threading.Event()
        self.pending_signals: list[int] = []

    # ---- construction ----------------------------------------------------
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

                self.inventory = SimulatedInventory(self.cfg.simulate_node)
            else:
                from .gpu.nvml import NvmlInventory

                self.inventory = NvmlInventory()
            self.node = self.inventory.node()
        except InventoryError as exc:
            raise StartupError(f"GPU inventory: {exc}") from None
        self.node_name = self.cfg.node_name or self.node.name
        log.info("inventory ready", extra={
            "node": self.node.name, "simulated": bool(self.cfg.simulate_node), "driver": self.node.driver_version,
            "gpus": [f"{g.index}:{g.uuid}:{g.memory_mib}MiB" for g in self.node.gpus]})

    def _build_ledger(self) -> None:
        assert self.node is not None
        try:
            os.makedirs(self.cfg.state_dir, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"state directory {self.cfg.state_dir}: {exc.strerror or exc}") from None
        from .ledger import state_dir_warning

        tmpfs_warning = state_dir_warning(self.cfg.state_dir)
        if tmpfs_warning:
            log.warning(tmpfs_warning, extra={"state_dir": self.cfg.state_dir})
        self.ledger = Ledger(self.node, self.cfg.ledger_path, max_clients_per_gpu=self.cfg.max_clients_per_gpu)
        self.ledger_warnings = self.ledger.load()  # the ledger logs each warning itself
        from .ledger import remove_crash_leftovers

        for msg in remove_crash_leftovers(self.cfg.ledger_path):  # temps of killed writes, old corrupt copies
            log.info(msg, extra={"path": self.cfg.ledger_path})
        log.info("ledger loaded", extra={"path": self.cfg.ledger_path, "tenancies": len(self.ledger.tenancies())})

    def _build_metrics(self) -> None:
        try:
            from .metrics import Metrics
        except ImportError as exc:
            log.warning("metrics unavailable: %s", exc)
            return
        self.metrics = Metrics(ledger=self.ledger, inventory=self.inventory, node=self.node)
        self.metrics.attach_state(self.metric_state)
        host, port = configmod.parse_address(self.cfg.metrics_address)
        try:
            bound = self.metrics.serve(self.cfg.metrics_address)
        except OSError as exc:
            raise StartupError(f"--metrics-address {self.cfg.metrics_address}: {exc.strerror or exc}") from None
        if isinstance(bound, tuple) and len(bound) >= 2:
            host, port = str(bound[0]), int(bound[1])
        elif isinstance(bound, int):
            port = bound
        self.endpoints["metrics"] = _fmt_addr(host, port)

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

            self.mps = RemoteMps(self.cfg.effective_mps_api_socket, layout, modes=modes)
            self.mps.start()
            if not self.mps.status().get("reachable"):
                log.warning("MPS role not reachable yet; MPS modes are down until it answers",
                            extra={"socket": self.cfg.effective_mps_api_socket, "reason": self.mps.status().get("error")})
            if self.metrics is not None:
                self.metrics.attach_mps(self.mps)
            return
        from .mps.supervisor import MpsSupervisor

        assert self.node is not None
        protocol = None if self.cfg.mps_protocol == "auto" else int(self.cfg.mps_protocol)
        exclusive = (tuple(g.uuid for g in self.node.gpus)
                     if self.cfg.exclusive_process and not self.cfg.simulate_node else ())
        self.mps = MpsSupervisor(layout, self.cfg.mps_control_binary, protocol, self.node.driver_version, modes,
                                 exclusive_process_gpus=exclusive, detached=self.cfg.role == "mps")
        try:
            self.mps.start()
        except Exception as exc:
            raise StartupError(f"MPS supervisor: {exc}") from None
        if self.cfg.role == "mps":
            from .mps.rpc import MpsApiServer

            self.mps_api = MpsApiServer(self.mps, self.cfg.effective_mps_api_socket)
            try:
                self.mps_api.start()
            except OSError as exc:
                raise StartupError(f"--mps-api-socket {self.cfg.effective_mps_api_socket}: {exc.strerror or exc}") from None
            self.endpoints["mps_api"] = self.cfg.effective_mps_api_socket
        if self.metrics is not None:
            self.metrics.attach_mps(self.mps)

    def _build_pod_source(self) -> None:
        if self.cfg.no_device_plugin:
            return
        from .kubelet.podlookup import InMemoryPodSource, KubernetesPodSource

        if self.cfg.pods_file:
            self.pod_source = InMemoryPodSource(self.node_name)
            self.pods_watcher = PodsFileWatcher(self.cfg.pods_file, self.pod_source)
            self.pods_watcher.start()
            log.info("simulated API: pods file", extra={"path": self.cfg.pods_file, "pods": len(self.pod_source)})
        elif self.cfg.kubeconfig or _in_cluster():
            api_client = None
            if self.cfg.kubeconfig:
                from kubernetes import config as kconfig

                try:
                    api_client = kconfig.new_client_from_config(config_file=self.cfg.kubeconfig)
                except Exception as exc:
                    raise StartupError(f"--kubeconfig {self.cfg.kubeconfig}: {exc}") from None
            self.pod_source = KubernetesPodSource(self.node_name, self.cfg.resource_name, api_client)
            self.pod_source.start()
            log.info("API watch started", extra={"node": self.node_name,
                                                  "via": "kubeconfig" if self.cfg.kubeconfig else "in-cluster"})
        else:
            log.warning("no API access (no --kubeconfig, not in a cluster, no --pods-file): the device plugin "
                        "door cannot find pods and answers Allocate with what is right for any pod")

    def _build_events(self) -> None:
        from .events import EventRecorder, NullEventRecorder

        if self.cfg.no_nri or not (self.cfg.kubeconfig or _in_cluster()):
            self.events = NullEventRecorder()
            return
        api_client = None  # in-cluster: the recorder loads the service account config on its thread
        if self.cfg.kubeconfig:
            from kubernetes import config as kconfig

            try:
                api_client = kconfig.new_client_from_config(config_file=self.cfg.kubeconfig)
            except Exception as exc:
                raise StartupError(f"--kubeconfig {self.cfg.kubeconfig}: {exc}") from None
        self.events = EventRecorder(api_client, self.node_name).start()
        log.info("refusals become Kubernetes Events", extra={
            "via": "kubeconfig" if self.cfg.kubeconfig else "in-cluster", "doors": "nri"})

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
        api_client = None  # in-cluster: loaded on the publisher's thread
        if self.cfg.kubeconfig:
            from kubernetes import config as kconfig

            try:
                api_client = kconfig.new_client_from_config(config_file=self.cfg.kubeconfig)
            except Exception as exc:
                raise StartupError(f"--kubeconfig {self.cfg.kubeconfig}: {exc}") from None
        self.node_condition = NodeConditionPublisher(
            api_client, self.node_name, lambda: condition_from_checks(self.checks()), types).start()
        log.info("publishing the node condition KAI gates on", extra={"types": list(types), "node": self.node_name})

    def _refused_nri(self, pod: Any, container: str, err: Any) -> None:
        """``FracNriPlugin.on_refusal``: queue the refusal's Event (never blocks)."""
        if self.events is not None:
            self.events.refused(pod, container, err, "nri")

    def _warned_nri(self, pod: Any, container: str, message: str) -> None:
        """``FracNriPlugin.on_warning``: queue an AnnotationNotApplied Event (never blocks)."""
        if self.events is not None:
            self.events.warned(pod, container, message, "nri")

    def _build_nri(self) -> None:
        if self.cfg.no_nri:
            return
        from .nri.plugin import FracNriPlugin
        from .nri.stub import NriStub

        assert self.node is not None and self.ledger is not None
        self.nri_plugin = FracNriPlugin(self.node, self.ledger, self.planner_config, mps=self.mps,
                                        metrics=self.metrics, fail_open=self.cfg.fail_open,
                                        on_refusal=self._refused_nri, on_warning=self._warned_nri,
                                        pod_lookup=getattr(self.pod_source, "get", None),
                                        unit_mib=self.cfg.device_unit_mib, resource_name=self.cfg.resource_name,
                                        gpu_health=self._gpu_health)
        on_bound = getattr(self.metrics, "nri_bound_exceeded", None)
        self.nri_stub = NriStub(self.nri_plugin, socket_path=self.cfg.nri_socket,
                                plugin_name=self.cfg.nri_plugin_name, plugin_idx=self.cfg.nri_plugin_idx,
                                on_bound=on_bound if callable(on_bound) else None)
        self.nri_stub.start()
        self.endpoints["nri_socket"] = self.cfg.nri_socket
        if getattr(self.nri_stub, "fd_mode", False):
            # Launched by the runtime with the NRI socket on fd 3 (nri-protocol.md 1.5): when that
            # connection ends the runtime will launch a new plugin, so this process must go.
            self.endpoints["nri_socket"] = f"fd {self.nri_stub.fd}"

            def watch_exit() -> None:
                self.nri_stub.wait_exit()
                if not self._stopping.is_set():
                    log.info("NRI connection on fd %s ended (runtime-launched plugin): shutting down", self.nri_stub.fd)
                    self.pending_signals.append(signal.SIGTERM)
                    self.wake.set()

            threading.Thread(target=watch_exit, name="nri-fd-exit", daemon=True).start()

    def _build_device_plugin(self) -> None:
        if self.cfg.no_device_plugin:
            return
        from .kubelet.deviceplugin import DevicePluginServer
        from .kubelet.devices import DeviceTableTooLarge

        assert self.node is not None
        try:
            self.device_plugin = DevicePluginServer(
                self.node, self.ledger, self.planner_config, self.inventory,
                pod_source=self.pod_source, resource_name=self.cfg.resource_name, unit_mib=self.cfg.device_unit_mib,
                plugin_dir=self.cfg.device_plugin_dir, kubelet_socket=self.cfg.effective_kubelet_socket,
                allocate_deadline_s=self.cfg.allocate_deadline_s, mps_health=None if self.cfg.no_mps else self.mps,
                podresources_interval_s=self.cfg.pod_resources_interval_s,
                metrics=self.metrics, podresources_socket=self.cfg.pod_resources_socket,
                ignored_xids=[int(x) for x in self.cfg.ignored_xids.split(",") if x.strip()],
                policy=self.cfg.allocation_policy, device_specs=self.cfg.device_specs, cdi_kind=self.cfg.cdi_kind,
                secure_pipe_mount=self.cfg.secure_pipe_mount)
        except DeviceTableTooLarge as exc:
            # Kubelet could never receive the device list (devices.py): refuse to start.
            raise StartupError(f"--device-unit-mib {self.cfg.device_unit_mib}: {exc}") from None
        try:
            self.device_plugin.start()
        except OSError as exc:
            raise StartupError(f"device plugin: {exc}") from None
        sock = getattr(self.device_plugin, "socket_path", None)
        if sock:
            self.endpoints["device_plugin_socket"] = str(sock)
        self.endpoints["kubelet_socket"] = self.cfg.effective_kubelet_socket

    def simulate_xid(self, gpu_uuid: str, xid: int) -> None:
        """``POST /simulate/xid``: queue XID ``xid`` on ``gpu_uuid`` in the
        simulated inventory (``SimulatedInventory.inject_xid``); the device
        plugin's health monitor then sees it as NVML would deliver it.
        Raises LookupError for a GPU this node does not have; RuntimeError
        when the inventory is not simulated (the route is never offered then)."""
        from .gpu.inventory import InventoryError

        inject = getattr(self.inventory, "inject_xid", None)
        if not self.cfg.simulate_node or not callable(inject):
            raise RuntimeError("XIDs can only be injected into a simulated node (--simulate-node)")
        assert self.node is not None
        if self.node.gpu_by_uuid(gpu_uuid) is None:
            raise LookupError(f"no GPU {gpu_uuid} on node {self.node.name} "
                              f"(GPUs: {', '.join(g.uuid for g in self.node.gpus)})")
        try:
            inject(gpu_uuid, xid)
        except InventoryError as exc:
            raise LookupError(str(exc)) from None

    def _gpu_health(self, uuid: str) -> Any:
        """The device plugin door's health of one GPU (XID + MPS); healthy
        when that door is not running (no monitor)."""
        monitor = getattr(self.device_plugin, "health", None)
        if monitor is not None and callable(getattr(monitor, "health", None)):
            return monitor.health(uuid)
        from .gpu.health import GpuHealth

        return GpuHealth(uuid, True)

    def _build_health(self) -> None:
        simulate = self.simulate_xid if self.cfg.simulate_node and callable(
            getattr(self.inventory, "inject_xid", None)) else None
        self.health = HealthServer(self.cfg.health_address, self.checks, self.status, alive=self.alive,
                                   simulate_xid=simulate)
        try:
            host, port = self.health.start()
        except OSError as exc:
            raise StartupError(f"--health-address {self.cfg.health_address}: {exc.strerror or exc}") from None
        self.endpoints["health"] = _fmt_addr(host, port)

    def start(self) -> None:
        """Build and start every enabled part, in order. Raises StartupError
        (having stopped whatever already started)."""
        t0 = time.monotonic()
        log.info("fracplugin %s starting", __version__, extra={
            "config": self.cfg.to_dict(), "sources": self.sources, "pid": os.getpid()})
        steps = [("inventory", self._build_inventory), ("ledger", self._build_ledger),
                 ("metrics", self._build_metrics), ("mps", self._build_mps),
                 ("pod source", self._build_pod_source), ("events", self._build_events),
                 ("nri", self._build_nri), ("device plugin", self._build_device_plugin),
                 ("health", self._build_health), ("node condition", self._build_node_condition)]
        if self.cfg.role == "mps":  # no ledger (the doors role owns it), no doors
            steps = [s for s in steps if s[0] in ("inventory", "metrics", "mps", "health")]
        for name, step in steps:
            try:
                step()
            except StartupError:
                self.stop()
                raise
            except Exception as exc:
                log.exception("starting %s failed", name)
                self.stop()
                raise StartupError(f"{name}: {exc}") from exc
        self.startup_ms = round((time.monotonic() - t0) * 1000, 1)
        doc = {**self.endpoints, "pid": os.getpid(), "node": self.node_name, "started_at": self.started_at,
               "startup_ms": self.startup_ms}
        _write_json_atomic(self.cfg.endpoints_path, doc)
        log.info("fracplugin started", extra={"endpoints": self.endpoints, "startup_ms": self.startup_ms,
                                               "endpoints_file": self.cfg.endpoints_path})

    # ---- state -------------------------------------------------------------
    def alive(self) -> str | None:
        """None while the daemon is live (``/healthz`` 200), else why not: it is
        shutting down, or the NRI stub's run thread ended on its own (it
        reconnects forever in external mode, so that is a bug worth a restart)."""
        if self._stopping.is_set():
            return "shutting down"
        if self.nri_stub is not None and getattr(self.nri_stub, "exited", False):
            return "the NRI plugin stub stopped"
        return None

    def checks(self) -> dict[str, dict[str, Any]]:
        """Readiness of each enabled part: {part: {"ready": bool, "detail": str}}."""
        out: dict[str, dict[str, Any]] = {}
        if self.nri_stub is not None:
            # readiness of the current runtime session (issue 13 item 5), not "ever synchronized"
            synced, connected = bool(_call(self.nri_stub, "ready")), bool(_call(self.nri_stub, "connected"))
            before = bool(_call(self.nri_stub, "ever_synchronized"))
            ready = synced and connected
            detail = ("synchronized with the runtime" if ready else
                      "connected, not synchronized yet" if connected else
                      f"not connected to {self.cfg.nri_socket}" + (" (was synchronized before)" if before else ""))
            out["nri"] = {"ready": ready, "detail": detail}
        elif not self.cfg.no_nri:
            out["nri"] = {"ready": False, "detail": "not started"}
        if self.device_plugin is not None:
            reg = bool(_call(self.device_plugin, "registered"))
            out["device_plugin"] = {"ready": reg, "detail": (f"registered with kubelet as {self.cfg.resource_name}"
                                                             if reg else f"not registered at {self.cfg.effective_kubelet_socket}")}
        elif not self.cfg.no_device_plugin:
            out["device_plugin"] = {"ready": False, "detail": "not started"}
        if not self.cfg.no_mps:
            ok = self.mps is not None and bool(_call(self.mps, "ready"))
            if self.mps is None:
                detail = "not started"
            else:
                st = self.mps.status()
                bad = [f"{d.get('mode', '?')} ({d.get('reason') or d.get('state') or 'unhealthy'})"
                       for d in (st.get("daemons") or []) if not d.get("healthy")]
                if st.get("reachable") is False:
                    detail = f"MPS role unreachable at {st.get('remote')}: {st.get('error')}"
                else:
                    detail = ("every daemon healthy" if ok else
                              ("unhealthy: " + "; ".join(bad) if bad else "starting"))
                if st.get("exposure"):
                    detail += f"; exposure: {st['exposure']}"
            out["mps"] = {"ready": ok, "detail": detail}
        if self._stopping.is_set():
            out["daemon"] = {"ready": False, "detail": "shutting down"}
        return out

    def metric_state(self) -> dict[str, Any]:
        """What ``Metrics.attach_state`` exports at scrape time: NRI connected /
        synchronized / unadjusted containers (None when the door is off or not
        started), device plugin registered (likewise), and per GPU whether the
        device plugin reports it Healthy (critical XID or its mode's MPS daemon
        down; without the device plugin door: its mode's MPS daemon)."""
        nri = None
        if self.nri_stub is not None:
            st = _call(self.nri_plugin, "status") if self.nri_plugin is not None else None
            nri = {"connected": bool(_call(self.nri_stub, "connected")),
                   "synchronized": bool(_call(self.nri_stub, "ready")),
                   "unadjusted": len(st.get("unadjusted") or ()) if isinstance(st, dict) else 0}
        dp = None if self.device_plugin is None else {"registered": bool(_call(self.device_plugin, "registered"))}
        healthy: dict[str, bool] = {}
        monitor = getattr(self.device_plugin, "health", None)
        if self.node is not None and self.ledger is not None:
            for g in self.node.gpus:
                if monitor is not None and callable(getattr(monitor, "health", None)):
                    healthy[g.uuid] = bool(monitor.health(g.uuid).healthy)
                else:
                    tenants = self.ledger.tenants(g.uuid)
                    mode = tenants[0].mode if tenants else None
                    try:
                        healthy[g.uuid] = (mode is None or self.cfg.no_mps or self.mps is None
                                           or bool(self.mps.healthy(mode)))
                    except Exception:
                        healthy[g.uuid] = False
        return {"nri": nri, "device_plugin": dp, "gpu_healthy": healthy}

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (see status.py for the rendering)."""
        checks = self.checks()
        gpus = []
        mps_health = {}
        if self.mps is not None:
            for mode in ComputeMode:
                try:
                    mps_health[mode] = bool(self.mps.healthy(mode)) if not self.cfg.no_mps else True
                except Exception:
                    mps_health[mode] = False
        monitor = getattr(self.device_plugin, "health", None)  # XID + MPS health of the device plugin door
        if self.node is not None and self.ledger is not None:
            for g in self.node.gpus:
                tenants = self.ledger.tenants(g.uuid)
                held = sum(t.request_mib for t in tenants)
                mode = tenants[0].mode if tenants else None
                if monitor is not None and callable(getattr(monitor, "health", None)):
                    h = monitor.health(g.uuid)
                    healthy, reasons = bool(h.healthy), list(h.reasons)
                else:
                    healthy = mps_health.get(mode, True) if mode else True
                    reasons = [] if healthy else ["mps down"]
                gpus.append({
                    "index": g.index, "uuid": g.uuid, "name": g.name, "memory_mib": g.memory_mib,
                    "held_mib": held, "free_mib": g.memory_mib - held, "mode": mode.value if mode else None,
                    "healthy": healthy, "unhealthy_reasons": reasons,
                    "tenants": [t.to_dict() for t in tenants],
                })
        dp_status = _call(self.device_plugin, "status") if self.device_plugin is not None else None
        return {
            "node": self.node_name,
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "ready": all(c["ready"] for c in checks.values()),
            "checks": checks,
            "doors": {"nri": not self.cfg.no_nri, "device_plugin": not self.cfg.no_device_plugin,
                      "mps": not self.cfg.no_mps},
            "fail_open": self.cfg.fail_open,
            "gpus": gpus,
            "mps": self.mps.status() if self.mps is not None else {"enabled": False, "daemons": []},
            "device_plugin": dp_status if isinstance(dp_status, dict) else None,
            "nri": self._nri_status(),
            "pod_source": (None if self.pod_source is None else
                           {"kind": type(self.pod_source).__name__, "ready": bool(_call(self.pod_source, "ready")),
                            "pods": len(self.pod_source)}),
            "events": self._events_status(),
            "node_condition": _call(self.node_condition, "status") if self.node_condition is not None else None,
            "endpoints": dict(self.endpoints),
            "ledger": {"path": self.cfg.ledger_path, "warnings": self.ledger_warnings},
            "config": self.cfg.to_dict(),
        }

    def _events_status(self) -> dict[str, Any] | None:
        """``{"enabled": bool, "queued", "sent", "failed", "dropped",
        "suppressed"}`` of the refusal event recorder (None before it exists)."""
        if self.events is None:
            return None
        from .events import NullEventRecorder

        stats = _call(self.events, "stats")
        return {"enabled": not isinstance(self.events, NullEventRecorder), **(stats if isinstance(stats, dict) else {})}

    def _nri_status(self) -> dict[str, Any] | None:
        """The NRI stub's and plugin's status merged (None when the door is off)."""
        if self.nri_stub is None:
            return None
        doc: dict[str, Any] = {}
        for part in (self.nri_stub, self.nri_plugin):
            st = _call(part, "status") if part is not None else None
            if isinstance(st, dict):
                doc.update(st)
        doc["ready"] = bool(_call(self.nri_stub, "ready")) and bool(_call(self.nri_stub, "connected"))
        return doc

    # ---- signals, reload ----------------------------------------------------
    def reload(self) -> dict[str, Any]:
        """Apply a SIGHUP: reload the configuration and apply what is
        reloadable. Returns {"applied": {...}, "needs_restart": [...]} (or
        {"error": ...} when the new configuration is invalid: nothing changes)."""
        if self._reload is None:
            return {"error": "reload not configured"}
        try:
            new, sources = self._reload()
        except ConfigError as exc:
            log.error("SIGHUP: configuration not reloaded: %s", exc)
            return {"error": str(exc)}
        applied, ignored = configmod.reloadable_changes(self.cfg, new)
        if "log_format" in applied or "log_level" in applied:
            logs.setup(new.log_format, new.log_level)
        if "fail_open" in applied:
            for part in (self.nri_plugin, self.device_plugin):
                if part is not None:
                    setter = getattr(part, "set_fail_open", None)
                    if callable(setter):
                        setter(new.fail_open)
                    elif hasattr(part, "fail_open"):
                        part.fail_open = new.fail_open
        kept = {k: getattr(self.cfg, k) for k in ignored}
        self.cfg = dataclasses.replace(new, **kept)
        self.sources.update({k: v for k, v in sources.items() if k in applied})
        log.info("SIGHUP: configuration reloaded", extra={
            "applied": {k: {"old": a, "new": b} for k, (a, b) in applied.items()},
            "needs_restart": ignored, "reloadable": list(configmod.RELOADABLE)})
        return {"applied": applied, "needs_restart": ignored}

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT -> stop; SIGHUP -> reload (main thread only)."""
        def handler(signum: int, _frame: Any) -> None:
            self.pending_signals.append(signum)
            self.wake.set()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, handler)

    def serve_forever(self) -> int:
        """Sleep until SIGTERM/SIGINT (handling SIGHUPs); returns the signal number."""
        while True:
            self.wake.wait()
            self.wake.clear()
            while self.pending_signals:
                sig = self.pending_signals.pop(0)
                if sig == signal.SIGHUP:
                    self.reload()
                else:
                    log.info("received %s: shutting down", signal.Signals(sig).name)
                    return sig

    # ---- stopping ------------------------------------------------------------
    def stop(self) -> None:
        """Stop every part in order within ``shutdown_timeout_s`` (idempotent)."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._stopping.set()
        t0 = time.monotonic()
        deadline = t0 + self.cfg.shutdown_timeout_s
        # MPS gets the biggest share at the end: it must quit its daemons.
        reserve_for_mps = min(self.cfg.shutdown_timeout_s * 0.4, 5.0) if self.mps is not None else 0.0

        def left(reserve: float = 0.0) -> float:
            return max(deadline - time.monotonic() - reserve, 0.05)

        def per_part(n_left: int) -> float:
            return left(reserve_for_mps) / max(n_left, 1)

        order: list[tuple[str, Callable[[], Any]]] = []
        if self.node_condition is not None:  # first: KAI stops placing pods here before the doors close
            order.append(("node condition", lambda: self.node_condition.stop(min(per_part(5), 2.0))))
        if self.device_plugin is not None:
            order.append(("device plugin", lambda: self.device_plugin.stop(per_part(4))))
        if self.nri_stub is not None:
            def stop_nri() -> None:
                self.nri_stub.stop(per_part(3))
                if self.nri_plugin is not None and callable(getattr(self.nri_plugin, "close", None)):
                    self.nri_plugin.close()  # background MPS namespace jobs
            order.append(("nri", stop_nri))
        from .events import NullEventRecorder

        if self.events is not None and not isinstance(self.events, NullEventRecorder):
            order.append(("events", lambda: self.events.stop(per_part(3))))
        if self.pods_watcher is not None:
            order.append(("pods file", lambda: self.pods_watcher.stop(per_part(3))))
        if self.pod_source is not None and hasattr(self.pod_source, "stop"):
            order.append(("pod watch", lambda: self.pod_source.stop(per_part(2))))
        if self.metrics is not None and hasattr(self.metrics, "stop"):
            order.append(("metrics", lambda: _call_stop(self.metrics, per_part(1))))
        for i, (name, fn) in enumerate(order):
            _call_bounded(name, fn, left(reserve_for_mps) / max(len(order) - i, 1) + 0.5)
        if self.mps_api is not None:
            _call_bounded("mps api", lambda: self.mps_api.stop(1.0), 2.0)
        if self.mps is not None and hasattr(self.mps, "stop"):
            # role all: quit the daemons; role mps: leave them running for the
            # next MPS role (ADR 0009); role doors: stop polling the MPS role.
            if not _call_bounded("mps", lambda: _call_stop(self.mps, left()), left() + 0.5) and self.cfg.role == "all":
                self._kill_mps_leftovers()
        if self.inventory is not None:
            _call_bounded("inventory", self.inventory.close, 1.0)
        if self.health is not None:
            self.health.stop()
        try:
            os.unlink(self.cfg.endpoints_path)
        except OSError:
            pass
        if self.ledger is not None:
            self.ledger.close()  # journal folded into the snapshot: a clean stop leaves one file
        problems = self.ledger.check_invariants() if self.ledger is not None else []
        log.info("fracplugin stopped", extra={
            "elapsed_ms": round((time.monotonic() - t0) * 1000, 1),
            "tenancies": len(self.ledger.tenancies()) if self.ledger is not None else 0,
            "ledger_consistent": not problems})


    def _kill_mps_leftovers(self) -> None:
        """Last resort when the MPS supervisor did not stop in time: SIGKILL the
        process group of every MPS control daemon it reported (each runs in its
        own session) and their servers, so that no MPS process outlives us."""
        try:
            daemons = self.mps.status().get("daemons") or []
        except Exception:
            log.exception("MPS status unavailable; cannot kill leftover MPS processes")
            return
        for d in daemons:
            for pid in [d.get("pid"), *(d.get("server_pids") or [])]:
                if not pid:
                    continue
                for kill in (os.killpg, os.kill):
                    try:
                        kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                log.error("MPS did not stop in time: killed pid %s", pid, extra={"mode": d.get("mode"), "pid": pid})


def _call(obj: Any, method: str) -> Any:
    """``obj.method()`` when it exists, else None; exceptions -> None (logged)."""
    fn = getattr(obj, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except Exception:
        log.exception("%s.%s() failed", type(obj).__name__, method)
        return None


def _call_stop(obj: Any, timeout_s: float) -> None:
    import inspect

    stop = obj.stop
    try:
        params = inspect.signature(stop).parameters
    except (TypeError, ValueError):  # pragma: no cover
        params = {}
    if "timeout_s" in params:
        stop(timeout_s=timeout_s)
    elif "timeout" in params:
        stop(timeout=timeout_s)
    else:
        stop()


def main(args: argparse.Namespace) -> int:
    """``fracplugin run``: exit 0 after an orderly stop, 1 when a part cannot
    start, 2 for a bad setting."""
    try:
        cfg, sources = configmod.load(args)
        configmod.check_paths(cfg, sources)
    except ConfigError as exc:
        print(f"fracplugin run: {exc}", file=sys.stderr)
        return 2
    logs.setup(cfg.log_format, cfg.log_level)
    from .limits import raise_nofile_limit

    raise_nofile_limit()  # soft -> hard: idle clients must not starve the ledger and MPS of descriptors
    if cfg.role == "mps" and os.environ.get(_KEEPER_ENV) != "1":
        return _keep_mps_role()
    daemon = Daemon(cfg, sources, reload=lambda: configmod.load(args))
    daemon.install_signal_handlers()
    try:
        daemon.start()
    except StartupError as exc:
        log.error("fracplugin could not start: %s", exc)
        print(f"fracplugin run: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"event": "started", **daemon.endpoints, "pid": os.getpid()}), flush=True)
    daemon.serve_forever()
    daemon.stop()
    return 0


_KEEPER_ENV = "FRACPLUGIN_MPS_ROLE_CHILD"


def _keep_mps_role() -> int:
    """``--role mps`` runs as a small keeper around the real process (ADR 0009).

    The MPS control daemons live in the container's cgroup: if the container
    ended because the fracplugin process crashed, every client would lose its
    server. So the container's main process is this keeper: it runs the same
    command as a child (``FRACPLUGIN_MPS_ROLE_CHILD=1``), restarts it 1 s after
    it dies of anything but our own stop (the new child adopts the running
    daemons), and on SIGTERM/SIGINT forwards the signal, waits for the child
    and exits with its status (pod deletion: MPS stops on purpose with the
    container). Returns the exit status."""
    import subprocess

    argv = [sys.executable, "-m", "fracplugin.cli", *sys.argv[1:]]
    env = {**os.environ, _KEEPER_ENV: "1"}
    stopping = threading.Event()
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.set()
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward if sig != signal.SIGHUP else
                      (lambda n, f: child[0].send_signal(n) if child and child[0].poll() is None else None))
    while True:
        proc = subprocess.Popen(argv, env=env)
        child[:] = [proc]
        rc = proc.wait()
        if stopping.is_set():
            return rc if rc >= 0 else 0
        if rc in (1, 2):  # a bad setting or a part that cannot start: let the pod report it
            return rc
        log.error("the MPS role process exited with status %s; restarting it in place (it adopts the running "
                  "MPS daemons)", rc)
        if stopping.wait(1.0):
            return 0
