"""Prometheus metrics: per container and GPU, per GPU, per MPS daemon, per door.

Concurrency: ``observe_hook`` and ``refusal`` are called from any thread
(prometheus-client metrics are thread-safe). Per-process usage is sampled by
the usage poll (``poll``: every ``--usage-poll-interval`` seconds on its own
thread, ``start_polling``; it also hands each sample to the over-limit watch,
overlimit.py) and scrapes serve the last poll's; without a poll thread a
scrape samples itself. Everything else is computed at scrape time, on the
HTTP server's request thread (``serve``), by a custom collector that reads the
ledger, the inventory and the MPS supervisor's ``status()`` (all thread-safe);
a scrape holds no lock of its own. Own ``CollectorRegistry`` (no global
default registry, no process/GC metrics).

Metrics: names, types, labels and meaning are the contract, listed in
docs/operator-guide.md "## Metrics" (``tests/unit/test_metrics_readme.py`` checks that
table against a capture of ``/metrics``). Every series carries ``node``
(``NODE_LABEL``, added by ``render``); per-GPU series carry dcgm-exporter's
``DCGM_GPU_LABELS`` and, until they go, ``DEPRECATED_GPU_LABELS``. The door
and GPU health series need ``attach_state``, the over-limit ones a watch.

Attribution (docs/reference/mps-nvml.md sections 4.3, 4.6): each ``ProcessSample`` PID is
joined to a container through ``/proc/<pid>/cgroup`` (procfs.py, cached per
scrape), then to a ledger tenancy on the same GPU by container id, or, for
tenancies recorded without one (device-plugin door), by pod UID when exactly
one container of that pod holds the GPU. The MPS server's own PID
(``/proc/<pid>/exe`` basename ``nvidia-cuda-mps-server``) is never a tenant.
When the NVML query fails the usage series are missing until a sample succeeds (request
/limit/GPU series stay) and the failure counter grows; a scrape never raises.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from .health import REQUEST_DEADLINE_S, BoundedHandler, BoundedHTTPServer, serve
from . import __version__
from .model import GpuInfo, NodeInfo, Tenancy
from .procfs import CachedProcFs, ContainerRef, container_id_matches
from .logs import guarded

log = logging.getLogger(__name__)

MIB = 1 << 20
DCGM_GPU_LABELS = ("UUID", "gpu", "modelName", "Hostname")
"""dcgm-exporter's label names of a GPU (its ``UUID``, index ``gpu``, product
name ``modelName`` and the node's ``Hostname``), on every per-GPU series so
they join with ``DCGM_FI_*`` series (``on(UUID)``). Issue 27 item 3."""
DEPRECATED_GPU_LABELS = ("gpu_uuid", "gpu_index")
"""Our first names of ``UUID`` and ``gpu``: still emitted in 0.2.x, removed in
the release after (CHANGELOG.md)."""
CONTAINER_LABELS = ("namespace", "pod", "pod_uid", "container", *DEPRECATED_GPU_LABELS, *DCGM_GPU_LABELS)
GPU_LABELS = (*DEPRECATED_GPU_LABELS, *DCGM_GPU_LABELS)
GPU_INFO_LABELS = (*DCGM_GPU_LABELS, "device", "pci_bus_id")
NODE_LABEL = "node"
"""Added by ``Metrics.render`` to every series (the node's name, as kubelet
knows it): the dashboard and the alerts key on it, and no scrape config has to
relabel for it."""
HOOK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SERVER_EXE = "nvidia-cuda-mps-server"
MAX_HANDLERS = 8
"""Most concurrent handler threads of the /metrics server (a scrape takes
milliseconds; Prometheus scrapes one target at a time)."""


class Metrics:
    """fracplugin's metrics registry.

    Args:
        ledger: the ``Ledger`` (or anything with ``tenancies()``); None = no
            tenancy series.
        inventory: the ``Inventory`` (``node()``, ``processes()``); None = no usage.
        node: the node (default: ``inventory.node()`` on first scrape).
        mps: the MPS supervisor (anything with ``status()``); may be attached later.
        proc_root: proc filesystem for PID -> container (tests pass a temp dir).
        node_name: the node's name as kubelet knows it (the daemon's
            ``--node-name``): the ``node`` label of every series and the
            ``Hostname`` label of the GPU series. Default: ``node().name``;
            no ``node`` label while neither is known.
    """

    def __init__(
        self,
        ledger: Any = None,
        inventory: Any = None,
        node: NodeInfo | None = None,
        mps: Any = None,
        *,
        proc_root: str = "/proc",
        node_name: str | None = None,
    ) -> None:
        self.ledger = ledger
        self.inventory = inventory
        self._node = node
        self.mps = mps
        self._node_name = node_name or None
        self.state: Callable[[], Mapping[str, Any]] | None = None
        self.procfs = CachedProcFs(proc_root)  # PID -> container, kept while the PID's start time holds
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self._hook = Histogram(
            "fracplugin_hook_duration_seconds", "Time spent answering a door's request (NRI CreateContainer, Allocate).",
            ["door"], buckets=HOOK_BUCKETS, registry=self.registry,
        )
        # The labelled children the doors observe on every call (issue 14:
        # ``labels()`` validates and looks the label set up under a lock each time).
        self._hook_doors = {door: self._hook.labels(door=door) for door in ("nri", "allocate")}
        self._refusals = Counter(
            "fracplugin_refusals_total", "Fraction requests refused, by reason (FractionError.code).",
            ["reason"], registry=self.registry,
        )
        self._nri_bounds = Counter(
            "fracplugin_nri_bounds_exceeded_total",
            "Times a runtime connection hit a bound of what the NRI plugin holds, by bound "
            "(sync_parts, sync_bytes, unanswered).", ["bound"], registry=self.registry,
        )
        for bound in ("sync_parts", "sync_bytes", "unanswered"):
            self._nri_bounds.labels(bound=bound)
        self._nvml_failures = 0  # exposed by the collector, counted during the same scrape
        self.watch: Any = None  # overlimit.OverLimitWatch: checks every poll's usage
        self._polled: dict[tuple[str, str, str], _Usage] | None = None  # the last poll's usage
        self._poller: threading.Thread | None = None
        self._stop_poll = threading.Event()
        self._collector = _Collector(self)
        self.registry.register(self._collector)
        self._servers: list[BoundedHTTPServer] = []

    # -- events from the doors --------------------------------------------------
    def observe_hook(self, door: str, seconds: float) -> None:
        """Record one request of ``door`` (``nri``, ``allocate``) that took ``seconds``."""
        child = self._hook_doors.get(door)
        if child is None:
            child = self._hook.labels(door=door)
        child.observe(max(0.0, float(seconds)))

    def refusal(self, reason: str) -> None:
        """Count one refusal with label ``reason`` (a FractionError.code)."""
        self._refusals.labels(reason=str(reason) or "unknown").inc()

    def nri_bound_exceeded(self, bound: str) -> None:
        """Count one hit of NRI bound ``bound`` (``sync_parts``, ``sync_bytes``,
        ``unanswered``: nri/stub.py) in ``fracplugin_nri_bounds_exceeded_total``."""
        self._nri_bounds.labels(bound=str(bound) or "unknown").inc()

    def attach_mps(self, mps: Any) -> None:
        """Set the MPS supervisor whose ``status()`` feeds the daemon series."""
        self.mps = mps

    def attach_state(self, state: Callable[[], Mapping[str, Any]]) -> None:
        """Set the source of the door and GPU health series, called at scrape time.

        ``state()`` returns ``{"nri": {"connected": bool, "synchronized": bool,
        "unadjusted": int} | None, "device_plugin": {"registered": bool} | None,
        "gpu_healthy": {gpu_uuid: bool}}``; a None door emits no series (door
        off). An exception skips these series for that scrape only."""
        self.state = state

    # -- the usage poll (issue 35 item 3) ----------------------------------------------
    def poll(self) -> dict[tuple[str, str, str], _Usage] | None:
        """One usage poll: NVML's per-process usage attributed to the ledger's
        tenancies (module docstring, Attribution), kept for the scrapes, then
        handed to ``watch.check``. Returns ``{(pod UID, container, GPU UUID):
        usage}`` (``used`` bytes, ``sm`` percent), None when NVML failed.
        Never raises (a failing watch is logged)."""
        tenancies = self._collector.tenancies()
        usage = self._collector._usage(tenancies, _server_pids(self._collector._mps_status()))
        with self._lock:
            self._polled = usage
        if self.watch is not None:
            guarded(log, "metrics: over-limit check", self.watch.check, tenancies, usage)
        return usage

    def start_polling(self, interval_s: float) -> None:
        """Poll now and then every ``interval_s`` seconds on a daemon thread
        until ``stop``; scrapes then serve the last poll's usage."""
        def run() -> None:
            while True:
                guarded(log, "metrics: usage poll", self.poll)  # never lets the thread die
                if self._stop_poll.wait(interval_s):
                    return

        self._poller = threading.Thread(target=run, name="fracplugin-usage-poll", daemon=True)
        self._poller.start()

    def polled(self) -> dict[tuple[str, str, str], _Usage] | None:
        """The last poll's usage (None before the first or when NVML failed)."""
        with self._lock:
            return self._polled

    # -- exposition ------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition format 0.0.4 (what ``/metrics`` answers).

        Written by ``render_text`` (same format as prometheus-client's
        ``generate_latest``, without the ``*_created`` series) because the
        library's generic formatter dominated the scrape time of a full node
        (8 GPUs x 48 clients: see ``metrics.scrape_ms`` in build/bench.json)."""
        name = self.node_name()
        return render_text(self.registry, {NODE_LABEL: name} if name else None)

    def node_name(self) -> str:
        """The ``node`` label's value: ``node_name`` given at construction,
        else the inventory node's name; "" when neither is known."""
        if self._node_name:
            return self._node_name
        node = self.node()
        return node.name if node is not None else ""

    def serve(self, address: str = ":2112") -> BoundedHTTPServer:
        """Serve the metrics (any path, ``/metrics`` by convention; ``GET`` and
        ``HEAD``) on ``HOST:PORT`` (``:PORT`` = all interfaces; port 0 = any free
        port) from a serving thread in the background, bounded as health.py's
        ``BoundedHTTPServer`` (``MAX_HANDLERS`` handler threads, ``REQUEST_DEADLINE_S``
        per request). Returns the running server (``bound``: the (host, port)
        bound). Raises OSError (address in use) and ValueError (bad address)."""
        outer = self

        class Handler(BoundedHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                if self.path.split("?", 1)[0] == "/favicon.ico":
                    code, ctype, body = 404, "text/plain", b"not found\n"
                else:
                    code, ctype, body = 200, CONTENT_TYPE_LATEST, outer.render()
                try:
                    self.send_body(code, body, ctype)
                except OSError as exc:  # the scraper went away
                    log.debug("metrics http: client gone before the reply: %s", exc)
                    self.close_connection = True

            do_HEAD = do_GET

        server = serve(address, Handler, max_handlers=MAX_HANDLERS, request_deadline_s=REQUEST_DEADLINE_S,
                       label="metrics http", thread_name="fracplugin-metrics")
        with self._lock:
            self._servers.append(server)
        return server

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the usage poll and close every server started by ``serve``."""
        self._stop_poll.set()
        if self._poller is not None:
            self._poller.join(timeout_s)
        with self._lock:
            servers, self._servers = self._servers, []
        for s in servers:
            guarded(log, "metrics server close", s.close, timeout_s)

    # -- for the collector -----------------------------------------------------------
    def node(self) -> NodeInfo | None:
        if self._node is None and self.inventory is not None:
            try:
                self._node = self.inventory.node()
            except Exception as e:
                log.warning("metrics: inventory node() failed: %s", e)
        return self._node

    def nvml_failed(self) -> None:
        with self._lock:
            self._nvml_failures += 1

    @property
    def nvml_failures(self) -> int:
        """Scrapes whose NVML process query failed so far."""
        with self._lock:
            return self._nvml_failures


_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary"}


def _fmt_value(v: float) -> str:
    if v != v:
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _esc_label(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


_LABELS_CACHE: dict[tuple[tuple[str, Any], ...], str] = {}
"""Rendered ``k="v",...`` of each label set seen (issue 14: the same series
are rendered on every scrape); cleared past ``_LABELS_CACHE_MAX`` entries."""
_LABELS_CACHE_MAX = 50_000


def render_text(registry: CollectorRegistry, const_labels: Mapping[str, str] | None = None) -> bytes:
    """Text exposition format 0.0.4 of every family in ``registry``: ``# HELP`` /
    ``# TYPE`` then one line per sample (``name{label="value",...} value``).
    Counters are named ``<name>_total`` in HELP/TYPE as prometheus-client does;
    ``*_created`` samples are left out. Types other than counter, gauge,
    histogram and summary are written as ``untyped``.

    ``const_labels`` ({name: value}) are appended to every sample's labels,
    after its own (the ``node`` label: issue 27 item 3), except where the
    sample already has a label of that name."""
    const = {k: v for k, v in (const_labels or {}).items() if v}
    suffix = ",".join(f'{k}="{_esc_label(str(v))}"' for k, v in const.items())
    out: list[str] = []
    labels_cache = _LABELS_CACHE
    if len(labels_cache) > _LABELS_CACHE_MAX:
        labels_cache.clear()
    for fam in registry.collect():
        mtype = _TYPES.get(fam.type, "untyped")
        mname = fam.name + "_total" if fam.type == "counter" else fam.name
        doc = fam.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {mname} {doc}\n# TYPE {mname} {mtype}\n")
        for smp in fam.samples:
            if smp.name.endswith("_created"):
                continue
            if smp.labels:
                lbl = getattr(smp.labels, "text", None)  # _Labels: rendered once per series
                if lbl is None:
                    key = tuple(smp.labels.items())
                    lbl = labels_cache.get(key)
                    if lbl is None:
                        lbl = labels_cache[key] = ",".join(f'{k}="{_esc_label(str(v))}"' for k, v in key)
                if suffix and not any(k in smp.labels for k in const):
                    lbl = f"{lbl},{suffix}"
                out.append(f"{smp.name}{{{lbl}}} {_fmt_value(smp.value)}\n")
            elif suffix:
                out.append(f"{smp.name}{{{suffix}}} {_fmt_value(smp.value)}\n")
            else:
                out.append(f"{smp.name} {_fmt_value(smp.value)}\n")
    return "".join(out).encode("utf-8")


class _Usage:
    __slots__ = ("used", "sm")

    def __init__(self) -> None:
        self.used = 0
        self.sm = 0.0


class _Labels(dict):  # type: ignore[type-arg]
    """A series' label dict with its rendered ``k="v",...`` text kept beside
    it (``render_text`` reads ``text``): cached per tenancy by the collector,
    so a scrape neither rebuilds nor re-renders labels of series that did not
    change (issue 14). Never mutated once made."""

    __slots__ = ("text",)

    def __init__(self, names: tuple[str, ...], values: Sequence[str]) -> None:
        super().__init__(zip(names, values))
        self.text = ",".join(f'{k}="{_esc_label(str(v))}"' for k, v in self.items())


class _Collector(Collector):
    """Reads ledger + inventory + supervisor at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self._labels: dict[tuple[Tenancy, GpuInfo | None, str], _Labels] = {}  # (tenancy, GPU, host) -> labels

    def _tenancy_labels(self, t: Tenancy, gpu: GpuInfo | None, hostname: str) -> _Labels:
        key = (t, gpu, hostname)
        lab = self._labels.get(key)
        if lab is None:
            lab = self._labels[key] = _Labels(CONTAINER_LABELS, (t.namespace, t.pod_name, t.pod_uid, t.container,
                                                                  *gpu_label_values(t.gpu_uuid, gpu, hostname)))
        return lab

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: series come and go with tenancies

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._collect()
        except Exception:  # a scrape never fails because of one bad source
            log.exception("metrics collection failed")

    def _collect(self) -> Iterator[Metric]:
        """Every family of one scrape, in the exposition order tests pin
        (tests/fixtures/metrics capture): container series, GPU series, door
        state, ledger entries, NVML failures, MPS daemons."""
        m = self.m
        node = m.node()
        tenancies = self.tenancies()
        status = self._mps_status()
        usage = m.polled() if m._poller is not None else self._usage(tenancies, _server_pids(status))
        host = m.node_name()
        yield from self._containers(node, tenancies, usage, host)
        yield from self._gpus(node, tenancies, host)
        yield from self._identity(node, host)
        yield from self._state(node, host)

        entries = GaugeMetricFamily("fracplugin_ledger_entries", "Tenancies recorded in the ledger.")
        entries.add_metric([], float(len(tenancies)))
        yield entries

        fails = CounterMetricFamily("fracplugin_nvml_failures",
                                    "Usage samples whose NVML per-process query failed (usage series missing).")
        fails.add_metric([], float(m.nvml_failures))
        yield fails
        if m.watch is not None:
            yield CounterMetricFamily("fracplugin_gpu_memory_over_limit_episodes",
                                      "Episodes of a container above its GPU memory limit.", value=m.watch.episodes)

        yield from self._daemons(status)

    def tenancies(self) -> list[Tenancy]:
        """The ledger's tenancies ([] without a ledger or when it fails)."""
        try:
            return list(self.m.ledger.tenancies()) if self.m.ledger is not None else []
        except Exception as e:
            log.warning("metrics: ledger read failed: %s", e)
            return []

    def _mps_status(self) -> dict[str, Any]:
        """The MPS supervisor's ``status()`` ({} without one or when it fails)."""
        if self.m.mps is None:
            return {}
        try:
            return dict(self.m.mps.status() or {})
        except Exception as e:
            log.warning("metrics: mps status failed: %s", e)
            return {}

    def _containers(self, node: NodeInfo | None, tenancies: list[Tenancy],
                    usage: dict[tuple[str, str, str], _Usage] | None, host: str) -> Iterator[Metric]:
        """Per container and GPU: used, request, limit, SM % and SM share %
        (bytes, percent 0-100), over limit (0/1, with a watch); no usage series
        when ``usage`` is None (NVML failed)."""
        gpus = {g.uuid: g for g in node.gpus} if node is not None else {}
        used = GaugeMetricFamily("fracplugin_container_gpu_memory_used_bytes",
                                 "GPU memory used by the container's processes on this GPU (NVML).", labels=CONTAINER_LABELS)
        req = GaugeMetricFamily("fracplugin_container_gpu_memory_request_bytes",
                                "GPU memory requested by the container on this GPU.", labels=CONTAINER_LABELS)
        lim = GaugeMetricFamily("fracplugin_container_gpu_memory_limit_bytes",
                                "GPU memory limit of the container on this GPU.", labels=CONTAINER_LABELS)
        sm = GaugeMetricFamily("fracplugin_container_sm_utilization_percent",
                               "SM utilisation of the container's processes on this GPU since the last sample (0-100).",
                               labels=CONTAINER_LABELS)
        share = GaugeMetricFamily("fracplugin_container_sm_utilization_share_percent",
                                  "SM utilisation relative to the container's share of the GPU (0-100).",
                                  labels=CONTAINER_LABELS)
        over = GaugeMetricFamily("fracplugin_container_gpu_memory_over_limit",
                                 "1 while the container uses more GPU memory than its limit on this GPU.",
                                 labels=CONTAINER_LABELS)
        if len(self._labels) > 2 * len(tenancies) + 64:  # tenancies gone: their labels go too
            self._labels = {}
        # Samples appended directly with the cached label dicts (what
        # add_metric does, without a dict(zip()) per series per scrape).
        req_s, lim_s, used_s, sm_s, share_s = req.samples, lim.samples, used.samples, sm.samples, share.samples
        over_keys = self.m.watch.over() if self.m.watch is not None else None
        for t in tenancies:
            gpu = gpus.get(t.gpu_uuid)
            lab = self._tenancy_labels(t, gpu, host)
            req_s.append(Sample(req.name, lab, float(t.request_mib * MIB)))
            lim_s.append(Sample(lim.name, lab, float(t.limit_mib * MIB)))
            if over_keys is not None:
                over.samples.append(Sample(over.name, lab, float((t.pod_uid, t.container, t.gpu_uuid) in over_keys)))
            if usage is None:
                continue
            u = usage.get((t.pod_uid, t.container, t.gpu_uuid))
            used_b = float(u.used) if u else 0.0
            sm_pct = min(100.0, u.sm) if u else 0.0
            used_s.append(Sample(used.name, lab, used_b))
            sm_s.append(Sample(sm.name, lab, sm_pct))
            share_s.append(Sample(share.name, lab, _share_percent(sm_pct, t, gpu.memory_mib if gpu is not None else 0)))
        yield from (used, req, lim, sm, share)
        if over_keys is not None:
            yield over

    def _gpus(self, node: NodeInfo | None, tenancies: list[Tenancy], host: str) -> Iterator[Metric]:
        """Per GPU: tenants, held bytes, total bytes, compute mode info."""
        tenants = GaugeMetricFamily("fracplugin_gpu_tenants", "Containers holding a fraction of the GPU.", labels=GPU_LABELS)
        held = GaugeMetricFamily("fracplugin_gpu_memory_held_bytes", "GPU memory held by tenancies (requests).",
                                 labels=GPU_LABELS)
        mode = GaugeMetricFamily("fracplugin_gpu_compute_mode_info", "Compute mode of the GPU's tenants (1 = current).",
                                 labels=(*GPU_LABELS, "mode"))
        total = GaugeMetricFamily("fracplugin_gpu_memory_total_bytes", "GPU memory of the GPU (inventory).",
                                  labels=GPU_LABELS)
        per_gpu: dict[str, list[Tenancy]] = {}
        for t in tenancies:
            per_gpu.setdefault(t.gpu_uuid, []).append(t)
        for g in node.gpus if node is not None else ():
            ts = per_gpu.get(g.uuid, [])
            labels = gpu_label_values(g.uuid, g, host)
            tenants.add_metric(labels, float(len(ts)))
            held.add_metric(labels, float(sum(t.charged_mib for t in ts) * MIB))
            mode.add_metric([*labels, ts[0].mode.value if ts else "none"], 1.0)
            total.add_metric(labels, float(g.memory_mib * MIB))
        yield from (tenants, held, total, mode)

    def _identity(self, node: NodeInfo | None, host: str) -> Iterator[Metric]:
        """``fracplugin_build_info`` and ``fracplugin_gpu_info`` (value 1;
        issue 27 item 3): what a dashboard joins on to name a GPU the way
        dcgm-exporter does, and which fracplugin a node runs."""
        build = GaugeMetricFamily("fracplugin_build_info", "fracplugin's version (value 1).",
                                  labels=("version", "python_version"))
        build.add_metric([__version__, platform.python_version()], 1.0)
        yield build
        info = GaugeMetricFamily("fracplugin_gpu_info",
                                 "A GPU of the node, with dcgm-exporter's label names (value 1).", labels=GPU_INFO_LABELS)
        for g in node.gpus if node is not None else ():
            info.add_metric([g.uuid, str(g.index), g.name, host, f"nvidia{g.minor}", g.pci_bus_id], 1.0)
        yield info

    def _state(self, node: NodeInfo | None, host: str) -> Iterator[Metric]:
        """Door and GPU health series from ``Metrics.state`` (see ``attach_state``)."""
        if self.m.state is None:
            return
        try:
            st = self.m.state() or {}
        except Exception as e:
            log.warning("metrics: daemon state failed: %s", e)
            return
        healthy = st.get("gpu_healthy") or {}
        if node is not None and healthy:
            fam = GaugeMetricFamily("fracplugin_gpu_healthy",
                                    "1 when the GPU is Healthy at the device plugin, 0 when Unhealthy.", labels=GPU_LABELS)
            for g in node.gpus:
                if g.uuid in healthy:
                    fam.add_metric(gpu_label_values(g.uuid, g, host), 1.0 if healthy[g.uuid] else 0.0)
            yield fam
        nri = st.get("nri")
        if nri is not None:
            for name, key, doc in (
                ("fracplugin_nri_connected", "connected", "1 while the NRI plugin is connected to the runtime."),
                ("fracplugin_nri_synchronized", "synchronized", "1 once the runtime's Synchronize rebuilt the ledger."),
                ("fracplugin_nri_unadjusted_containers", "unadjusted",
                 "Running containers the last Synchronize found without the env the ledger's plan gives them."),
            ):
                fam = GaugeMetricFamily(name, doc)
                fam.add_metric([], float(nri.get(key) or 0))
                yield fam
            uf = nri.get("unfenced") or {}
            acted = CounterMetricFamily("fracplugin_unfenced_containers", "Fractional containers found running "
                                        "without fracplugin's adjustment, by what was done.", labels=("action",))
            for action in ("restarted", "reported", "backed_off"):
                acted.add_metric([action], float(uf.get(action) or 0))
            yield acted
            fam = GaugeMetricFamily("fracplugin_unfenced_containers_waiting",
                                    "Unfenced containers not restarted yet: their pod's spec is not known.")
            fam.add_metric([], float(len(uf.get("waiting") or ())))
            yield fam
        dp = st.get("device_plugin")
        if dp is not None:
            fam = GaugeMetricFamily("fracplugin_device_plugin_registered", "1 while the device plugin is registered with kubelet.")
            fam.add_metric([], 1.0 if dp.get("registered") else 0.0)
            yield fam

    def _daemons(self, status: dict[str, Any]) -> Iterator[Metric]:
        up = GaugeMetricFamily("fracplugin_mps_daemon_up", "1 when the MPS control daemon answers its probe.",
                               labels=("mode",))
        restarts = CounterMetricFamily("fracplugin_mps_daemon_restarts", "MPS control daemon restarts.", labels=("mode",))
        wedges = CounterMetricFamily("fracplugin_mps_daemon_wedges", "Drains that found the MPS daemon wedged.",
                                     labels=("mode",))
        probe = GaugeMetricFamily("fracplugin_mps_probe_duration_seconds", "Duration of the last active MPS probe.",
                                  labels=("mode",))
        orphans = GaugeMetricFamily("fracplugin_mps_orphan_namespaces",
                                    "MPS namespaces the daemon holds that no tenant owns (ADR 0034).", labels=("mode",))
        for d in status.get("daemons") or ():
            lbl = [str(d.get("mode", ""))]
            up.add_metric(lbl, 1.0 if d.get("healthy") else 0.0)
            restarts.add_metric(lbl, float(d.get("restarts") or 0))
            wedges.add_metric(lbl, float(d.get("wedges") or 0))
            if d.get("last_probe_s") is not None:
                probe.add_metric(lbl, float(d["last_probe_s"]))
            orphans.add_metric(lbl, float(len(d.get("orphans") or ())))
        yield from (up, restarts, wedges, probe, orphans)

    def _usage(self, tenancies: list[Tenancy], server_pids: set[int]) -> dict[tuple[str, str, str], _Usage] | None:
        """(pod_uid, container, gpu_uuid) -> summed usage; None when NVML failed."""
        m = self.m
        if m.inventory is None:
            return None
        try:
            samples = list(m.inventory.processes())
        except Exception as e:
            m.nvml_failed()
            log.warning("metrics: NVML process query failed: %s", e)
            return None
        by_cid: dict[str, list[Tenancy]] = {}
        by_pod: dict[str, list[Tenancy]] = {}
        for t in tenancies:
            if t.container_id:
                by_cid.setdefault(t.container_id, []).append(t)
            else:
                by_pod.setdefault(t.pod_uid, []).append(t)
        refs: dict[int, ContainerRef | None] = {}
        out: dict[tuple[str, str, str], _Usage] = {}
        for s in samples:
            if s.pid in server_pids:
                continue
            if s.pid not in refs:
                ref = m.procfs.container_of(s.pid)
                if ref is None and m.procfs.exe_basename(s.pid) == SERVER_EXE:
                    server_pids.add(s.pid)
                refs[s.pid] = ref
            ref = refs[s.pid]
            if ref is None:
                continue
            owner = _match(ref, s.gpu_uuid, by_cid, by_pod)
            if owner is None:
                continue
            u = out.setdefault((owner.pod_uid, owner.container, owner.gpu_uuid), _Usage())
            if s.used_memory_bytes is not None:
                u.used += int(s.used_memory_bytes)
            if s.sm_util_percent is not None and 0 <= s.sm_util_percent <= 100:
                u.sm += float(s.sm_util_percent)
        m.procfs.prune(refs)  # PIDs NVML no longer reports leave the cache
        return out


def gpu_label_values(uuid: str, gpu: GpuInfo | None, hostname: str) -> list[str]:
    """Values of ``GPU_LABELS`` for the GPU ``uuid`` (``gpu``: its inventory
    entry, None when the inventory lacks it: index and model then "")."""
    index = str(gpu.index) if gpu is not None else ""
    return [uuid, index, uuid, index, gpu.name if gpu is not None else "", hostname]


def _server_pids(status: Mapping[str, Any]) -> set[int]:
    """PIDs of the MPS servers in a supervisor ``status()`` (``daemons[].server_pids``):
    never a tenant. Malformed entries are skipped."""
    out: set[int] = set()
    for d in status.get("daemons") or ():
        with contextlib.suppress(TypeError, ValueError):
            out.update(int(p) for p in d.get("server_pids") or ())
    return out


def _match(ref: ContainerRef, gpu_uuid: str, by_cid: dict[str, list[Tenancy]],
           by_pod: dict[str, list[Tenancy]]) -> Tenancy | None:
    cands = by_cid.get(ref.container_id)
    if cands is None:  # short ids recorded in the ledger: prefix match, remembered for this scrape
        cands = by_cid[ref.container_id] = next(
            (ts for cid, ts in by_cid.items() if container_id_matches(cid, ref.container_id)), [])
    if cands:
        return next((t for t in cands if t.gpu_uuid == gpu_uuid), None)
    if ref.pod_uid:
        on_gpu = [t for t in by_pod.get(ref.pod_uid, ()) if t.gpu_uuid == gpu_uuid]
        if len({t.container for t in on_gpu}) == 1:
            return on_gpu[0]
    return None


def _share_percent(sm_pct: float, t: Tenancy, gpu_memory_mib: int) -> float:
    """SM % / the container's share, clamped to 100: share = active thread
    percentage / 100 when set (sm-sharing), else limit / GPU memory
    (gpu-fractioning metricsd's normalisation, docs/reference/gpu-fractioning-reference.md section 5)."""
    if t.active_thread_percentage:
        frac = t.active_thread_percentage / 100.0
    elif gpu_memory_mib > 0:
        frac = min(1.0, t.limit_mib / gpu_memory_mib)
    else:
        frac = 1.0
    if frac <= 0:
        return 0.0
    return min(100.0, sm_pct / frac)
