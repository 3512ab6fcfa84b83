"""The lifecycle contract of the daemon's parts, and the typed ports between them.

Every part ``fracplugin run`` composes is driven through one contract,
``Part`` (ADR 0014, which gives the rules). The adapters here are thin, typed
against their component (no reflection), and hold the config keys each one reads.

Ports (what one part needs of another): ``MpsApi`` (mps/api.py, null object
``NullMps``), ``HookMetrics`` (ports.py, null object ``NoMetrics``),
``gpu.inventory.Inventory``, ``kubelet.podlookup.PodSource``, ``ledger.Ledger``
and ``Clock``.

Concurrency: ``start``/``stop``/``reload`` are called from the daemon's main
thread (``stop`` on a helper thread); ``readiness``/``status`` from health
server threads at any time, so they only read.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from . import logs
from .ports import Clock

if TYPE_CHECKING:
    from .config import Config
    from .gpu.inventory import Inventory
    from .dra.server import DraServer
    from .dra.slices import SlicePublisher
    from .kubelet.deviceplugin import DevicePluginServer
    from .kubelet.podlookup import InMemoryPodSource, KubernetesPodSource
    from .ledger import Ledger
    from .metrics import Metrics
    from .mps.api import MpsApi
    from .nri.plugin import FracNriPlugin
    from .nri.stub import NriStub

log = logging.getLogger("fracplugin.daemon")


@dataclass(frozen=True)
class Readiness:
    """A part's readiness: ``ok`` and why (the ``detail`` of a ``/readyz`` check)."""

    ok: bool
    reason: str


@dataclass(frozen=True)
class Reloaded:
    """What ``Part.reload`` did: settings applied now, and settings it reads
    that changed but take effect only after a restart (config keys, sorted)."""

    applied: tuple[str, ...] = ()
    needs_restart: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, list[str]]:
        return {"applied": list(self.applied), "needs_restart": list(self.needs_restart)}


class Part(Protocol):
    """The lifecycle contract (module docstring)."""

    name: str
    """Label in logs (``stopped <name>``) and the key of ``Daemon.reload``'s per-part report."""
    check: str | None
    """Key of this part's ``/readyz`` check, or None when it gates nothing."""
    reads: frozenset[str]
    """Config keys (``config.Config`` fields) this part reads."""
    reloads: frozenset[str]
    """The subset of ``reads`` it applies on ``reload`` (each in ``config.RELOADABLE``)."""

    def start(self) -> None: ...

    def stop(self, timeout_s: float) -> None: ...

    def readiness(self) -> Readiness: ...

    def status(self) -> dict[str, Any]: ...

    def reload(self, cfg: Config) -> Reloaded: ...


PLANNER_KEYS = frozenset({"reserve_mib", "max_clients_per_gpu", "mps_root", "annotation_prefix", "mps_protocol",
                          "no_cdi_devices"})
"""Config keys of ``builders.Builder.planner_config`` (read by both doors at start)."""


class Service(Protocol):
    """A component a part starts and stops."""

    def start(self) -> object: ...

    def stop(self, timeout_s: float) -> object: ...


class PartBase:
    """Defaults of the contract: start and stop ``service`` (when set),
    always ready, empty status; ``reload`` diffs ``reads`` and hands the
    changed ``reloads`` keys to ``_apply``."""

    name = "part"
    check: str | None = None
    reads: frozenset[str] = frozenset()
    reloads: frozenset[str] = frozenset()
    service: Service | None = None

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def start(self) -> None:
        if self.service is not None:
            self.service.start()

    def stop(self, timeout_s: float) -> None:
        if self.service is not None:
            self.service.stop(timeout_s)

    def readiness(self) -> Readiness:
        return Readiness(True, "running")

    def status(self) -> dict[str, Any]:
        return {}

    def reload(self, cfg: Config) -> Reloaded:
        """Compare ``cfg`` with the configuration this part runs with: the
        changed keys in ``reloads`` are applied (``_apply``), the other changed
        keys in ``reads`` are reported ``needs_restart`` (and keep their old
        value here)."""
        changed = sorted(k for k in self.reads if getattr(self.cfg, k) != getattr(cfg, k))
        applied = tuple(k for k in changed if k in self.reloads)
        if applied:
            self._apply(cfg, applied)
            self.cfg = dataclasses.replace(self.cfg, **{k: getattr(cfg, k) for k in applied})
        return Reloaded(applied, tuple(k for k in changed if k not in self.reloads))

    def _apply(self, cfg: Config, keys: Iterable[str]) -> None:
        return None


class LogsPart(PartBase):
    """The process's logging (``logs.setup``): reloads the level and format."""

    name = "logs"
    reads = reloads = frozenset({"log_level", "log_format"})

    def _apply(self, cfg: Config, keys: Iterable[str]) -> None:
        logs.setup(cfg.log_format, cfg.log_level)


class ServicePart(PartBase):
    """A part that only starts and stops one component (``service``: the MPS
    role's API socket, refusal Events, the node condition KAI gates on, the
    CDI registry, the GPU health monitor, ``/healthz`` and ``/status``), named ``name``, reading the config
    keys ``reads``; its ``status`` is ``status_of()`` ({} when not given)."""

    def __init__(self, cfg: Config, name: str, reads: Iterable[str], service: Service,
                 status_of: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__(cfg)
        self.name, self.reads, self.service, self._status_of = name, frozenset(reads), service, status_of

    def status(self) -> dict[str, Any]:
        return self._status_of() if self._status_of is not None else {}


class InventoryPart(PartBase):
    """The GPU inventory (NVML or simulated): opened at construction, closed at stop."""

    name = "inventory"
    reads = frozenset({"simulate_node", "exclusive_process"})

    def __init__(self, cfg: Config, inventory: Inventory) -> None:
        super().__init__(cfg)
        self.inventory = inventory

    def stop(self, timeout_s: float) -> None:
        self.inventory.close()

    def status(self) -> dict[str, Any]:
        return {"kind": type(self.inventory).__name__}


class LedgerPart(PartBase):
    """The ledger: loaded before the doors start, folded into one file at stop."""

    name = "ledger"
    reads = frozenset({"state_dir", "max_clients_per_gpu"})

    def __init__(self, cfg: Config, ledger: Ledger, warnings: list[str]) -> None:
        super().__init__(cfg)
        self.ledger = ledger
        self.warnings = warnings

    def stop(self, timeout_s: float) -> None:
        self.ledger.close()

    def readiness(self) -> Readiness:
        problems = self.ledger.check_invariants()
        return Readiness(not problems, "; ".join(problems) or "consistent")

    def status(self) -> dict[str, Any]:
        return {"path": self.cfg.ledger_path, "warnings": self.warnings}


class MetricsPart(PartBase):
    """The Prometheus endpoint."""

    name = "metrics"
    reads = frozenset({"metrics_address", "usage_poll_interval_s", "proc_root"})

    def __init__(self, cfg: Config, metrics: Metrics) -> None:
        super().__init__(cfg)
        self.metrics = metrics
        self.bound: tuple[str, int] | None = None

    def start(self) -> None:
        """Serve on ``metrics_address``; ``bound`` is the (host, port) bound;
        with a ledger, poll usage every ``usage_poll_interval_s``. Raises OSError."""
        self.bound = self.metrics.serve(self.cfg.metrics_address).bound
        if self.metrics.ledger is not None:
            self.metrics.start_polling(self.cfg.usage_poll_interval_s)

    def stop(self, timeout_s: float) -> None:
        self.metrics.stop(timeout_s)


class MpsPart(PartBase):
    """The MPS layer of this role: the supervisor (roles all, mps) or the
    MPS role's client (role doors). Its readiness is the ``mps`` check. Stop:
    role all quits the daemons, role mps leaves them running for the next
    MPS role (ADR 0009), role doors stops polling the MPS role."""

    name = "mps"
    check = "mps"
    reads = frozenset({"mps_modes", "mps_control_binary", "mps_root", "mps_protocol", "exclusive_process",
                       "mps_api_socket", "no_mps", "role", "mps_probe_timeout_s", "mps_probe_failure_threshold"})

    def __init__(self, cfg: Config, mps: MpsApi) -> None:
        super().__init__(cfg)
        self.mps = self.service = mps

    def readiness(self) -> Readiness:
        ok = bool(self.mps.ready())
        st = self.mps.status()
        bad = [f"{d.get('mode', '?')} ({d.get('reason') or d.get('state') or 'unhealthy'})"
               for d in (st.get("daemons") or []) if not d.get("healthy")]
        # ADR 0034: not ready while a namespace may be uncapped (a timed-out one being finished, an orphan)
        open_ = [f"{d.get('mode', '?')} namespace {n} {why}" for d in (st.get("daemons") or [])
                 for n, why in [(n, "being finished") for n in d.get("repairing") or ()]
                 + [(o.get("name"), "uncapped, owned by no tenant") for o in d.get("orphans") or ()
                    if not o.get("capped")]]
        if st.get("reachable") is False:
            detail = f"MPS role unreachable at {st.get('remote')}: {st.get('error')}"
        elif open_:
            ok, detail = False, "; ".join(open_)
        else:
            detail = "every daemon healthy" if ok else ("unhealthy: " + "; ".join(bad) if bad else "starting")
        if st.get("exposure"):
            detail += f"; exposure: {st['exposure']}"
        return Readiness(ok, detail)

    def status(self) -> dict[str, Any]:
        return self.mps.status()


class PodSourcePart(PartBase):
    """The pods the device plugin door looks up: a ``--pods-file`` watched
    into an ``InMemoryPodSource``, or the API watch (``KubernetesPodSource``)."""

    name = "pod source"
    reads = frozenset({"pods_file", "kubeconfig", "node_name", "resource_name"})

    def __init__(self, cfg: Config, source: InMemoryPodSource | KubernetesPodSource,
                 start: Callable[[], None], stop: Callable[[float], None]) -> None:
        super().__init__(cfg)
        self.source = source
        self._start = start
        self._stop = stop

    def start(self) -> None:
        self._start()

    def stop(self, timeout_s: float) -> None:
        self._stop(timeout_s)

    def readiness(self) -> Readiness:
        ok = bool(self.source.ready())
        return Readiness(ok, "synced" if ok else "not synced")

    def status(self) -> dict[str, Any]:
        return {"kind": type(self.source).__name__, "ready": bool(self.source.ready()), "pods": len(self.source)}


class NriDoor(PartBase):
    """The NRI door: the stub (connection, ttrpc) and the plugin (handlers).
    Readiness: synchronized with the current runtime session. Reloads
    ``fail_open`` (refusals and MPS failures leave the container unadjusted)."""

    name = "nri"
    check = "nri"
    reads = PLANNER_KEYS | {"nri_socket", "nri_plugin_name", "nri_plugin_idx", "fail_open", "device_unit_mib",
                            "resource_name", "nri_start_wait_s", "unfenced_containers"}
    reloads = frozenset({"fail_open"})

    def __init__(self, cfg: Config, stub: NriStub, plugin: FracNriPlugin) -> None:
        super().__init__(cfg)
        self.stub = self.service = stub
        self.plugin = plugin

    def stop(self, timeout_s: float) -> None:
        self.stub.stop(timeout_s)
        self.plugin.close()  # background MPS namespace jobs

    def readiness(self) -> Readiness:
        # readiness of the current runtime session (issue 13 item 5), not "ever synchronized"
        synced, connected = self.stub.ready(), self.stub.connected()
        renewing = self.plugin.namespaces.renewing()  # running containers' namespaces re-ensured (ADR 0034)
        if synced and connected and renewing:
            return Readiness(False, f"re-ensuring the MPS namespaces of {renewing} running container(s)")
        ready = synced and connected
        before = self.stub.ever_synchronized()
        return Readiness(ready, "synchronized with the runtime" if ready else
                         "connected, not synchronized yet" if connected else
                         f"not connected to {self.cfg.nri_socket}" + (" (was synchronized before)" if before else ""))

    def status(self) -> dict[str, Any]:
        """The stub's and the plugin's status merged, plus ``ready``."""
        doc: dict[str, Any] = {}
        doc.update(self.stub.status())
        doc.update(self.plugin.status())
        doc["ready"] = self.stub.ready() and self.stub.connected()
        return doc

    def _apply(self, cfg: Config, keys: Iterable[str]) -> None:
        self.plugin.settings.fail_open = cfg.fail_open


class DevicePluginPart(PartBase):
    """The kubelet device plugin door. Readiness: registered with kubelet.
    Reloads ``fail_open`` (``DevicePluginServer.fail_open``)."""

    name = "device plugin"
    check = "device_plugin"
    reads = PLANNER_KEYS | {"resource_name", "device_unit_mib", "device_plugin_dir", "kubelet_socket",
                            "allocate_deadline_s", "pod_resources_interval_s", "pod_resources_socket",
                            "allocation_policy", "device_specs", "cdi_kind", "fail_open"}
    reloads = frozenset({"fail_open"})

    def __init__(self, cfg: Config, server: DevicePluginServer) -> None:
        super().__init__(cfg)
        self.server = self.service = server

    def readiness(self) -> Readiness:
        reg = self.server.registered()
        return Readiness(reg, f"registered with kubelet as {self.cfg.resource_name}" if reg
                         else f"not registered at {self.cfg.effective_kubelet_socket}")

    def status(self) -> dict[str, Any]:
        return self.server.status()

    def _apply(self, cfg: Config, keys: Iterable[str]) -> None:
        self.server.fail_open = cfg.fail_open


class DraDoor(PartBase):
    """The DRA door (issue 29, ADR 0031): its gRPC servers and, when given,
    the ResourceSlice publisher. Readiness: kubelet said the plugin is
    registered. Stop: the servers first (kubelet deregisters), then the
    publisher (deleting the slice with ``--dra-delete-slices-on-stop``)."""

    name = "dra"
    check = "dra"
    reads = PLANNER_KEYS | {"dra", "dra_plugins_dir", "dra_registry_dir", "dra_cdi_dir", "no_dra_slices",
                            "dra_delete_slices_on_stop", "kubeconfig", "node_name", "cdi_spec_dirs"}

    def __init__(self, cfg: Config, server: DraServer, slices: SlicePublisher | None) -> None:
        super().__init__(cfg)
        self.server = server
        self.slices = slices

    def start(self) -> None:
        self.server.start()
        if self.slices is not None:
            self.slices.start()

    def stop(self, timeout_s: float) -> None:
        self.server.stop(timeout_s / 2)
        if self.slices is not None:
            self.slices.stop(timeout_s / 2, delete=self.cfg.dra_delete_slices_on_stop)

    def readiness(self) -> Readiness:
        ok, why = self.server.readiness()
        return Readiness(ok, why)

    def status(self) -> dict[str, Any]:
        return {**self.server.status(), "slices": None if self.slices is None else self.slices.status()}


def bounded(name: str, fn: Callable[[], Any], timeout_s: float, clock: Clock = time.monotonic) -> bool:
    """Run ``fn`` on a helper (daemon) thread; wait at most ``timeout_s``
    seconds (at least 0.05). True when it finished in time without raising;
    a late one is logged and abandoned, an exception logged."""
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
    t0 = clock()
    t.start()
    if not done.wait(max(timeout_s, 0.05)):
        log.error("stopping %s did not finish within %.1f s; continuing", name, timeout_s, extra={"part": name})
        return False
    if err:
        log.error("stopping %s failed: %s", name, err[0], extra={"part": name})
        return False
    log.info("stopped %s", name, extra={"part": name, "elapsed_ms": round((clock() - t0) * 1000, 1)})
    return True
