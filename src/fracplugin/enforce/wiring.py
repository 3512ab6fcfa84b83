"""Memory limits as one daemon part: NVML backend, capability gate, the
enforcer, the NRI hooks, readiness, status and metrics (issue 23, ADR 0025).

``MemoryLimits.build(...)`` is all the daemon calls; it reads only the
settings ``memory_limits``, ``memory_limits_policy`` and ``cgroup_root``.
Readiness (``readiness()``) is False, with the gate's reason, when the node
cannot enforce and the mode is not ``off``: ``/readyz`` detail and the KAI
node condition (False, reason ``MemoryLimitsNotReady``) then say which
capability is missing.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Iterator

from ..model import NodeInfo, PodRef
from ..parts import PartBase, Readiness
from .capability import CAPABILITIES, CapabilityGate, gpu_region
from .memlimits import (LimitError, LimitPolicy, MemoryLimitEnforcer, MemoryLimitMode, NvmlLimits, metrics_rows,
                        read_dmem_current)
from .nri import NriMemoryLimits
from .softlimits import reservation_drift

log = logging.getLogger(__name__)

START_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class MemoryLimits:
    """Everything memory-limit related of one daemon.

    Args:
        mode, policy, cgroup_root: the settings.
        node: the node (GPUs, driver version).
        mps_protocol: ``() -> 2 | 3 | None``.
        hook_of: ``uuid -> bool | None``: the GPU's CDI spec carries the
            toolkit's memory-limit hook (from the CDI reader; None = not read).
        on_not_enforced: ``f(pod ref, container, message)`` (the Warning Event).

    Built only with ``--memory-limits`` not off (``builders._build_memory_limits``). NVML is opened here
    (``NvmlLimits``); when it cannot be initialised ``nvml`` is None and the gate's ``memory_accounting``
    says so."""

    def __init__(self, mode: MemoryLimitMode, policy: LimitPolicy, cgroup_root: str, node: NodeInfo, *,
                 mps_protocol: Callable[[], int | None] | None = None,
                 hook_of: Callable[[str], bool | None] | None = None,
                 on_not_enforced: Callable[[PodRef, str, str], None] | None = None) -> None:
        self.mode = mode
        self.policy = policy
        self.cgroup_root = cgroup_root
        self.node = node
        self.nvml: NvmlLimits | None = None
        self.nvml_error = ""
        nv = NvmlLimits()
        try:
            nv.open()
            self.nvml = nv
        except LimitError as exc:
            self.nvml_error = exc.reason
            log.warning("memory limits: NVML not available", extra={"reason": exc.reason})
        backend = self.nvml
        self.gate = CapabilityGate(
            lambda: node.gpus, node.driver_version, cgroup_root=cgroup_root, mps_protocol=mps_protocol,
            nvml_probe=(lambda u: backend.probe(u, cgroup_root)) if backend is not None else None, hook_of=hook_of)
        self.regions = {g.uuid: gpu_region(g) for g in node.gpus}
        self.enforcer = MemoryLimitEnforcer(mode, backend, cgroup_root=cgroup_root, hook_of=hook_of,
                                            region_of=self.regions.get, can_enforce=self.gate.reason)
        self._hist: Any = None
        self._drift: tuple[Any, list[dict[str, Any]]] = (None, [])
        self.nri = NriMemoryLimits(self.enforcer, policy, observe=self._observe,
                                   on_not_enforced=on_not_enforced, capabilities=self.gate.current)

    @classmethod
    def build(cls, cfg: Any, node: NodeInfo, **kw: Any) -> "MemoryLimits":
        """From the daemon's config (``memory_limits``, ``memory_limits_policy``, ``cgroup_root``)."""
        return cls(MemoryLimitMode(cfg.memory_limits), LimitPolicy(cfg.memory_limits_policy),
                   cfg.cgroup_root, node, **kw)

    def _observe(self, seconds: float) -> None:
        if self._hist is not None:
            self._hist.observe(seconds)

    def readiness(self) -> Readiness:
        """The ``/readyz`` check ``memory_limits``: the gate's answer."""
        caps = self.gate.current()
        if not caps.can_enforce:
            return Readiness(False, caps.reason)
        notes = [f"{c.name}: {c.detail}" for c in caps.items if c.ok is not True]
        detail = f"memory limits {self.mode.value}, policy {self.policy.value}"
        return Readiness(True, detail + ("; " + "; ".join(notes) if notes else ""))

    def status(self) -> dict[str, Any]:
        """The ``/status`` ``memory_limits`` section."""
        return {"mode": self.mode.value, "policy": self.policy.value, "cgroup_root": self.cgroup_root,
                "nvml": self.nvml is not None, "nvml_error": self.nvml_error, "node": self.gate.current().to_dict(),
                "containers": [r.to_dict() for r in self.enforcer.results()],
                "soft_zeroing": dict(self.enforcer.zeroing),
                "soft_reservations": [r for r in self.drift() if r["drift"]]}

    def drift(self) -> list[dict[str, Any]]:
        """``softlimits.reservation_drift`` over the parents of the leaves seen,
        on every GPU NVML answers for ([] without NVML). Costs
        one NVML read per (parent or child cgroup, GPU); kept until a soft
        limit may have changed (the enforcer's ``generation``), at most 60 s."""
        backend = self.nvml
        if backend is None:
            return []
        key = (self.enforcer.generation, int(time.monotonic() // 60))
        if self._drift[0] == key:
            return self._drift[1]

        def soft_of(gpu: str, cgroup: str) -> int | None:
            try:
                return int(backend.get(gpu, cgroup).soft)
            except LimitError:
                return None
        rows = reservation_drift(soft_of, [g.uuid for g in self.node.gpus if not g.mig_enabled],
                                 self.enforcer.parents())
        self._drift = (key, rows)
        return rows

    def dmem_used(self, container_id: str, uuid: str) -> int | None:
        """Bytes the ``dmem.current`` of the container's leaf cgroup lists for
        GPU ``uuid``; None when the leaf (a container started before the
        daemon, mode off) or the kernel's dmem file is unknown (the usage poll
        then counts NVML's per-process usage: overlimit.py)."""
        r, region = self.enforcer.result(container_id), self.regions.get(uuid)
        return read_dmem_current(r.cgroup, region) if r is not None and r.cgroup and region else None

    def attach_metrics(self, registry: Any, hostname: str = "") -> None:
        """Register the collector and the StartContainer histogram on a
        prometheus-client ``CollectorRegistry``. ``hostname``: the node's name
        for dcgm-exporter's ``Hostname`` label (the daemon's ``node`` label;
        "" = the inventory node's name)."""
        from prometheus_client import Histogram  # noqa: PLC0415

        self._hist = Histogram("fracplugin_memory_limits_start_seconds",
                               "StartContainer's cost of applying/verifying CUDA memory limits.",
                               buckets=START_BUCKETS, registry=registry)
        registry.register(MemoryLimitsCollector(self, hostname or self.node.name))

    def close(self) -> None:
        self.enforcer.close()
        if self.nvml is not None:
            self.nvml.close()


class MemoryLimitsCollector:
    """The memory-limit series: names, labels and meaning are the metrics table of
    docs/operator-guide.md "## Metrics" (``tests/unit/test_metrics_readme.py``
    checks it). A GPU the inventory lacks gets index and model ""."""

    def __init__(self, limits: MemoryLimits, hostname: str) -> None:
        self.limits = limits
        self.hostname = hostname

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

        try:
            caps = self.limits.gate.current()
            fam = GaugeMetricFamily("fracplugin_node_capability",
                                    "Memory-limit capability of the node: 1 present, 0 missing, -1 unknown.",
                                    labels=("capability",))
            for name in CAPABILITIES:
                c = caps.get(name)
                fam.add_metric([name], -1.0 if c is None or c.ok is None else (1.0 if c.ok else 0.0))
            yield fam
            can = GaugeMetricFamily("fracplugin_memory_limits_enforceable",
                                    "1 when the node can enforce CUDA memory limits (every required capability).")
            can.add_metric([], 1.0 if caps.can_enforce else 0.0)
            yield can
            lim = GaugeMetricFamily("fracplugin_container_cuda_memory_limit_bytes",
                                    "A container's CUDA memory limit per GPU (cgroup soft/hard, issue 23): planned, "
                                    "enforced (read back from NVML), and used (dmem.current, else NVML).",
                                    labels=("namespace", "pod", "container", "gpu_uuid", "UUID", "gpu", "modelName",
                                            "Hostname", "kind", "source"))
            results = self.limits.enforcer.results()
            for labels, value in metrics_rows(results):
                ns, _, name = labels["pod"].partition("/")
                uuid = labels["gpu"]
                gpu = self.limits.node.gpu_by_uuid(uuid)
                index, model = (str(gpu.index), gpu.name) if gpu is not None else ("", "")
                lim.add_metric([ns, name, labels["container"], uuid, uuid, index, model, self.hostname,
                                labels["kind"], labels["source"]], value)
            yield lim
            ne = GaugeMetricFamily("fracplugin_container_cuda_memory_limit_enforced",
                                   "1 when every GPU of the container has its planned limit in force, 0 when not.",
                                   labels=("namespace", "pod", "container"))
            for r in results:
                if r.enforced != "unknown":
                    ns, _, name = r.pod.partition("/")
                    ne.add_metric([ns, name, r.container], 1.0 if r.enforced == "yes" else 0.0)
            yield ne
            zc = CounterMetricFamily("fracplugin_memory_limits_soft_zeroed",
                                     "Soft limits (container x GPU) zeroed when their leaf cgroup emptied or at "
                                     "RemoveContainer (zeroed), found deleted first (leaf_gone: the driver keeps them "
                                     "reserved on the parent cgroups), or refused by NVML (failed).",
                                     labels=("outcome",))
            for outcome, n in sorted(self.limits.enforcer.zeroing.items()):
                zc.add_metric([outcome], float(n))
            yield zc
            drift = GaugeMetricFamily("fracplugin_memory_limits_reservation_drift_bytes",
                                      "Soft-limit reservation NVML reads on the parent cgroups (pod, QoS, kubepods) "
                                      "of containers' leaves minus what their child cgroups carry, summed per GPU: "
                                      "reservations of cgroups deleted without zeroing (ADR 0036).",
                                      labels=("UUID", "gpu", "modelName", "Hostname"))
            per_gpu: dict[str, int] = {}
            for row in self.limits.drift():
                per_gpu[str(row["gpu"])] = per_gpu.get(str(row["gpu"]), 0) + int(row["drift"])
            for uuid, value in sorted(per_gpu.items()):
                gpu = self.limits.node.gpu_by_uuid(uuid)
                drift.add_metric([uuid, str(gpu.index) if gpu else "", gpu.name if gpu else "", self.hostname],
                                 float(value))
            yield drift
        except Exception:
            log.exception("metrics: memory limits collection failed")


class MemoryLimitsPart(PartBase):
    """The daemon part (``parts.Part``): readiness check ``memory_limits``
    (the gate), status ``memory_limits``, NVML shut down at stop. Its
    settings take effect at restart."""

    name = "memory limits"
    check = "memory_limits"
    reads = frozenset({"memory_limits", "memory_limits_policy", "cgroup_root"})

    def __init__(self, cfg: Any, limits: MemoryLimits) -> None:
        super().__init__(cfg)
        self.limits = limits

    def stop(self, timeout_s: float) -> None:
        self.limits.close()

    def readiness(self) -> Readiness:
        return self.limits.readiness()

    def status(self) -> dict[str, Any]:
        return self.limits.status()
