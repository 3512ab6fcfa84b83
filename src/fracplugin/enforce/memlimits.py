"""Apply or verify CUDA 13.4 memory limits per container and GPU, via NVML.

Per container at StartContainer (its leaf cgroup exists, user code has not
run): for each GPU of its plan read ``nvmlDeviceGetMemoryLimits_v1`` on the
leaf cgroup and compare with the plan (soft = request, hard = limit, bytes;
docs/reference/mps-nvml.md section 3, 4.4). Modes (``--memory-limits``):

* ``apply``: set them with ``nvmlDeviceSetMemoryLimits_v1`` when they differ,
  then read back.
* ``verify``: report only (the toolkit's ``apply-cuda-memory-limits`` hook
  sets them at createRuntime).
* ``auto`` (default): apply on GPUs whose CDI spec lacks the hook (or is not
  known to carry it), verify where it is present.
* ``off``: nothing (no NVML call, nothing reported as not enforced).

The soft limit is zeroed (hard kept) before the leaf goes, since the driver
keeps a deleted leaf's soft limit reserved on its parent cgroups (NVIDIA,
ADR 0036): when the leaf empties (``softlimits.LeafWatch``, the container's
last process exited), else at RemoveContainer if the leaf is still there.

NVML refusals (no permission, not supported, MIG), a cgroup that cannot be
found and a missing library become a ``reason`` on the result, never an
exception out of ``start``/``remove``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .cgroups import DEFAULT_CGROUP_ROOT, CgroupNotFound, resolve_leaf
from .capability import dmem_regions
from .softlimits import LeafWatch, ancestors

log = logging.getLogger(__name__)

LIMIT_MAX = 0xFFFFFFFFFFFFFFFF
"""``NVML_DEVICE_MEMORY_LIMIT_MAX``: no hard limit."""
MIB = 1 << 20


HOLDS = ("cgroup", "per-process", "none")
"""What can hold a container's total GPU memory on one GPU (``what_holds``)."""


def what_holds(cgroup: bool | None, mps: bool) -> str:
    """What holds a container's total memory on one GPU, one of ``HOLDS`` (issue 35 item 2; the one rule
    ``fracplugin status`` and ``explain`` call): ``cgroup`` when the CUDA 13.4 limit is in force on its leaf
    cgroup (``cgroup`` True: applied or verified, or for a plan, ``--memory-limits`` not off on a node that
    can enforce), which holds every process together even when a worker narrows ``CUDA_VISIBLE_DEVICES``;
    ``per-process`` when only MPS's pinned limit does (``mps``: each process alone, and dropped by a client
    whose list names a GPU it cannot see: NVIDIA's measurements, docs/reference/enforcement-cdi-dra.md);
    ``none`` otherwise."""
    return "cgroup" if cgroup else "per-process" if mps else "none"


class MemoryLimitMode(str, enum.Enum):
    """``--memory-limits``: auto | apply | verify | off."""

    AUTO = "auto"
    APPLY = "apply"
    VERIFY = "verify"
    OFF = "off"


class LimitPolicy(str, enum.Enum):
    """``--memory-limits-policy``: what happens when a limit cannot be enforced
    (ADR 0025): ``warn`` starts the container and warns (Event, metric,
    status); ``refuse`` fails its start (StartContainer error; CreateContainer
    refusal when the node cannot enforce at all)."""

    WARN = "warn"
    REFUSE = "refuse"


class LimitError(Exception):
    """An NVML limits call failed; ``reason`` is the operator's sentence,
    ``code`` a short label (no_permission, not_supported, not_found, no_nvml, nvml)."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class GpuLimits:
    """Limits on one GPU for one cgroup: bytes; hard ``LIMIT_MAX`` = none."""

    soft: int
    hard: int
    used: int | None = None


_CODES = {3: "not_supported", 4: "no_permission", 6: "not_found", 13: "not_supported", 12: "no_nvml"}
_HINTS = {"not_found": " (cgroup or GPU not found)", "no_permission": " (setting limits needs root)",
          "not_supported": " (driver without memory partitioning, or MIG)"}


class NvmlLimits:
    """NVML's memory limits of a cgroup on a GPU through nvidia-ml-py (pynvml):
    ``get``/``set`` (bytes; raise LimitError) on ``nvmlDeviceGet/SetMemoryLimits_v1``.

    Uses pynvml's own structs and wrappers when the installed version has
    them (13.615+), else our own ctypes structs through pynvml's loaded
    library handle. Calls ``nvmlInit`` once (``open``), ``nvmlShutdown`` at
    ``close``. Thread-safe (NVML is; handles are cached under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}
        self._open = False
        self._pynvml: Any = None

    def open(self) -> None:
        """Initialise NVML. Raises LimitError (no_nvml) when it cannot."""
        with self._lock:
            if self._open:
                return
            try:
                import pynvml  # noqa: PLC0415

                pynvml.nvmlInit()
            except Exception as exc:
                raise LimitError("no_nvml", f"NVML could not be initialised: {exc}") from None
            self._pynvml = pynvml
            self._open = True

    @staticmethod
    def loadable() -> bool:
        """Whether NVML initialises here (the real library, or the fake one of
        tests/fakes/nvml on ``LD_LIBRARY_PATH``); never raises."""
        nv = NvmlLimits()
        try:
            nv.open()
        except LimitError:
            return False
        nv.close()
        return True

    def close(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
            self._handles.clear()
            with contextlib.suppress(Exception):
                self._pynvml.nvmlShutdown()

    def _handle(self, uuid: str) -> Any:
        self.open()
        with self._lock:
            h = self._handles.get(uuid)
            if h is None:
                h = self._pynvml.nvmlDeviceGetHandleByUUID(uuid)
                self._handles[uuid] = h
            return h

    def _call(self, verb: str, gpu_uuid: str, namespace: str, **limits: int) -> Any:
        """``nvmlDevice<verb>MemoryLimits_v1`` (verb Get or Set) on the struct filled with ``namespace`` and
        ``limits``; returns the struct. Uses pynvml's struct and wrapper when it has them, else ours through
        its library handle. Raises LimitError (``_CODES``)."""
        name = f"nvmlDevice{verb}MemoryLimits_v1"
        try:
            h = self._handle(gpu_uuid)
            p = self._pynvml
            st = getattr(p, f"c_nvml{verb}MemoryLimits_v1_t", _OWN[verb])()
            st.nameSpace = os.fsencode(namespace)
            for key, n in limits.items():
                setattr(st, key, n)
            fn = getattr(p, name, None)
            if fn is not None:
                fn(h, st)
            else:
                import ctypes  # noqa: PLC0415

                p._nvmlCheckReturn(p._nvmlGetFunctionPointer(name)(h, ctypes.byref(st)))
            return st
        except LimitError:
            raise
        except Exception as exc:
            value = getattr(exc, "value", None)
            code = _CODES.get(value, "nvml") if isinstance(value, int) else "nvml"
            raise LimitError(code, f"NVML {name[len('nvmlDevice'):]} on {gpu_uuid} for {namespace}: {exc}"
                                   f"{_HINTS.get(code, '')}") from None

    def get(self, gpu_uuid: str, namespace: str) -> GpuLimits:
        st = self._call("Get", gpu_uuid, namespace)
        return GpuLimits(int(st.softLimit), int(st.hardLimit), int(getattr(st, "currentUsed", 0)) or None)

    def set(self, gpu_uuid: str, namespace: str, soft: int, hard: int) -> None:
        self._call("Set", gpu_uuid, namespace, softLimit=soft, hardLimit=hard)

    def probe(self, gpu_uuid: str, root: str = DEFAULT_CGROUP_ROOT) -> str | None:
        """None when ``nvmlDeviceGetMemoryLimits_v1`` answers on ``root`` for
        the GPU, else the reason (the capability gate's NVML input)."""
        try:
            self.get(gpu_uuid, root)
            return None
        except LimitError as exc:
            return exc.reason


def _own_structs() -> dict[str, Any]:
    import ctypes  # noqa: PLC0415

    class Get(ctypes.Structure):
        _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong),
                    ("hardLimit", ctypes.c_ulonglong), ("currentUsed", ctypes.c_ulonglong)]

    class Set(ctypes.Structure):
        _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong),
                    ("hardLimit", ctypes.c_ulonglong)]

    return {"Get": Get, "Set": Set}


_OWN = _own_structs()


@dataclass
class GpuLimitResult:
    """One GPU of one container: planned and read limits (bytes) and the verdict.

    ``enforced``: True (read == planned), False (differs or could not be
    set/read: ``reason``), None (not checked: mode off). ``action``:
    ``applied``, ``verified``, ``none``. ``used`` from ``dmem.current`` when the
    kernel has it (None otherwise)."""

    gpu_uuid: str
    planned_soft: int
    planned_hard: int
    read_soft: int | None = None
    read_hard: int | None = None
    enforced: bool | None = None
    action: str = "none"
    reason: str = ""
    used: int | None = None
    used_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu_uuid, "planned_soft_bytes": self.planned_soft, "planned_hard_bytes": self.planned_hard,
                "read_soft_bytes": self.read_soft, "read_hard_bytes": self.read_hard, "enforced": self.enforced,
                "action": self.action, "reason": self.reason, "used_bytes": self.used,
                "used_source": self.used_source}


@dataclass
class ContainerLimits:
    """One container's limits on all its GPUs (``enforced`` yes/no/unknown)."""

    container_id: str
    pod: str
    container: str
    cgroup: str | None
    gpus: list[GpuLimitResult] = field(default_factory=list)
    reason: str = ""

    @property
    def enforced(self) -> str:
        """``yes``, ``no`` or ``unknown`` (the ENFORCED column)."""
        states = [g.enforced for g in self.gpus]
        if self.reason and not states:
            return "no"
        if any(s is False for s in states):
            return "no"
        if states and all(s is True for s in states):
            return "yes"
        return "unknown"

    @property
    def why(self) -> str:
        """The first reason (container-level, then per GPU)."""
        return self.reason or next((g.reason for g in self.gpus if g.reason), "")

    def to_dict(self) -> dict[str, Any]:
        return {"container_id": self.container_id, "pod": self.pod, "container": self.container,
                "cgroup": self.cgroup, "enforced": self.enforced, "reason": self.why,
                "gpus": [g.to_dict() for g in self.gpus]}


def read_dmem_current(leaf: str, region: str) -> int | None:
    """The ``region`` line of ``<leaf>/dmem.current`` in bytes (None when absent)."""
    found = dmem_regions(leaf, "dmem.current")
    return found.get(region) if isinstance(found, dict) else None


class MemoryLimitEnforcer:
    """Apply/verify per container (see the module docstring).

    Args:
        mode: the ``--memory-limits`` mode.
        backend: NVML limits (``NvmlLimits``); None = no NVML (every
            container "no (NVML not available)" unless mode is off).
        cgroup_root: where leaf cgroups are resolved (``--cgroup-root``).
        hook_of: ``uuid -> bool | None``: the GPU's CDI spec carries the
            toolkit hook (auto mode verifies there, applies elsewhere).
        region_of: ``uuid -> dmem region`` (``nvidia/<bdf>/vidmem``) to read
            ``dmem.current``; None = do not read.
        can_enforce: ``() -> reason`` (``""`` when the node can enforce): a
            node that cannot is reported without NVML calls.

    A started container's soft limits are zeroed when its leaf empties
    (``LeafWatch``, one inotify thread made at the first start). Thread-safe; results are kept per container id until ``remove``.
    ``zeroing`` counts soft limits (container x GPU) by outcome: ``zeroed``,
    ``leaf_gone`` (deleted first: its reservation stays on the parents),
    ``failed``."""

    def __init__(self, mode: MemoryLimitMode, backend: NvmlLimits | None, *,
                 cgroup_root: str = DEFAULT_CGROUP_ROOT,
                 hook_of: Callable[[str], bool | None] | None = None,
                 region_of: Callable[[str], str | None] | None = None,
                 can_enforce: Callable[[], str] | None = None) -> None:
        self.mode = mode
        self.backend = backend
        self.cgroup_root = cgroup_root
        self.hook_of = hook_of
        self.region_of = region_of
        self.can_enforce = can_enforce
        self._lock = threading.Lock()
        self._results: dict[str, ContainerLimits] = {}
        self._watch: LeafWatch | None = None
        self._watching = True
        self._handled: set[str] = set()  # containers whose leaf emptied (zeroed, or found gone)
        self._parents: set[str] = set()
        self.zeroing = {"zeroed": 0, "leaf_gone": 0, "failed": 0}
        self.generation = 0  # bumped whenever a soft limit may have changed (drift is cached on it)

    def _applies(self, uuid: str) -> bool:
        if self.mode is MemoryLimitMode.APPLY:
            return True
        if self.mode is MemoryLimitMode.VERIFY:
            return False
        hook = None
        with contextlib.suppress(Exception):
            hook = self.hook_of(uuid) if self.hook_of is not None else None
        return hook is not True

    def start(self, container_id: str, cgroups_path: str, gpus: Sequence[tuple[str, int, int]],
              pod: str = "", container: str = "") -> ContainerLimits | None:
        """Apply or verify the limits of one container.

        Args:
            container_id: the runtime's id.
            cgroups_path: NRI ``linux.cgroups_path``.
            gpus: ``(gpu uuid, request MiB, limit MiB)`` per GPU of its plan.
        Returns the result (None with mode off or no GPUs). Never raises."""
        if self.mode is MemoryLimitMode.OFF or not gpus:
            return None
        res = ContainerLimits(container_id, pod, container, None,
                              [GpuLimitResult(u, req * MIB, lim * MIB) for u, req, lim in gpus])
        try:
            self._start(res, cgroups_path)
        except Exception as exc:  # never a traceback into the runtime's call
            log.exception("memory limits: unexpected failure", extra={"container_id": container_id})
            res.reason = f"unexpected error: {exc}"
        with self._lock:
            self._results[container_id] = res
            self.generation += 1
            if res.cgroup is not None:
                self._parents.update(ancestors(res.cgroup, self.cgroup_root))
        if res.cgroup is not None and any(g.read_soft for g in res.gpus):
            self._arm(container_id, res.cgroup)
        return res

    def _start(self, res: ContainerLimits, cgroups_path: str) -> None:
        why = self.can_enforce() if self.can_enforce is not None else ""
        if not why:
            try:
                leaf = res.cgroup = resolve_leaf(cgroups_path, self.cgroup_root)
            except CgroupNotFound as exc:
                why = exc.reason
        if not why and self.backend is None:
            why = "NVML is not available to read or set memory limits"
        res.reason = why
        for g in res.gpus:
            if why:
                g.enforced = False
            else:
                self._one(g, leaf)

    def _one(self, g: GpuLimitResult, leaf: str) -> None:
        assert self.backend is not None
        apply = self._applies(g.gpu_uuid)
        g.action = "applied" if apply else "verified"
        try:
            cur = self.backend.get(g.gpu_uuid, leaf)
            if apply and (cur.soft, cur.hard) != (g.planned_soft, g.planned_hard):
                self.backend.set(g.gpu_uuid, leaf, g.planned_soft, g.planned_hard)
                cur = self.backend.get(g.gpu_uuid, leaf)
        except LimitError as exc:
            g.enforced = False
            g.reason = exc.reason
            return
        g.read_soft, g.read_hard = cur.soft, cur.hard
        if cur.used is not None:
            g.used, g.used_source = cur.used, "nvml"
        if self.region_of is not None:
            region = self.region_of(g.gpu_uuid)
            if region:
                used = read_dmem_current(leaf, region)
                if used is not None:
                    g.used, g.used_source = used, "dmem"
        g.enforced = (cur.soft, cur.hard) == (g.planned_soft, g.planned_hard)
        if not g.enforced:
            hard = "max" if cur.hard == LIMIT_MAX else f"{cur.hard // MIB} MiB"
            g.reason = (f"read soft {cur.soft // MIB} MiB / hard {hard}, planned soft {g.planned_soft // MIB} MiB / "
                        f"hard {g.planned_hard // MIB} MiB" + ("" if apply else " (verify mode: not set)"))

    def _arm(self, container_id: str, leaf: str) -> None:
        if self._watching and self._watch is None:
            try:
                self._watch = LeafWatch(self._on_empty)
            except OSError as exc:
                self._watching = False
                log.warning("memory limits: no inotify; soft limits are zeroed at RemoveContainer only",
                            extra={"reason": str(exc)})
        if self._watch is not None and not self._watch.watch(container_id, leaf):
            log.info("memory limits: leaf not watchable (no cgroup.events)", extra={"cgroup": leaf})

    def _on_empty(self, container_id: str) -> None:
        with self._lock:
            res = self._results.get(container_id)
            self._handled.add(container_id)
        if res is not None and res.cgroup is not None:
            self._zero(container_id, res.cgroup, [(g.gpu_uuid, g.read_hard) for g in res.gpus if g.read_soft], res)

    def _count(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.zeroing[outcome] += n
            self.generation += 1

    def _zero(self, container_id: str, leaf: str, todo: Sequence[tuple[str, int | None]],
              res: ContainerLimits | None = None) -> None:
        """Soft 0, hard kept, on each ``(gpu, hard)`` of ``todo``; counted in ``zeroing``."""
        assert self.backend is not None
        fields = {"container_id": container_id, "cgroup": leaf}
        if todo and not os.path.isdir(leaf):
            self._count("leaf_gone", len(todo))
            log.warning("memory limits: leaf cgroup deleted before its soft limit was zeroed; the driver keeps it "
                        "reserved on the parent cgroups (ADR 0036)", extra=fields)
            return
        for uuid, hard in todo:
            try:
                self.backend.set(uuid, leaf, 0, hard if hard is not None else LIMIT_MAX)
            except LimitError as exc:
                self._count("leaf_gone" if exc.code == "not_found" else "failed")
                log.warning("memory limits: soft limit not zeroed", extra={**fields, "gpu_uuid": uuid,
                                                                          "reason": exc.reason})
                continue
            self._count("zeroed")
            for g in res.gpus if res is not None else ():
                if g.gpu_uuid == uuid:
                    g.read_soft = 0

    def remove(self, container_id: str, cgroups_path: str = "", gpus: Sequence[str] = ()) -> None:
        """Zero the soft limit (hard kept) on every GPU where it was set or
        read, unless its leaf emptied before (``LeafWatch`` did it), then
        forget the container. A container started before this daemon did (no
        kept result) is found from ``cgroups_path``: each GPU of ``gpus``
        whose soft limit on its leaf is not 0 gets it zeroed. Never raises.

        Under containerd the leaf is gone by now (runc deletes it when the
        task is deleted, before NRI StopContainer/RemoveContainer; docs/e2e.md)
        and a soft limit not zeroed at the leaf's emptying stays reserved on
        the parents (counted ``leaf_gone``); CRI-O calls NRI RemoveContainer
        before it deletes the container (ADR 0036)."""
        if self._watch is not None:
            self._watch.unwatch(container_id)
        with self._lock:
            res = self._results.pop(container_id, None)
            self.generation += 1
            handled = container_id in self._handled
            self._handled.discard(container_id)
        if self.backend is None or self.mode is MemoryLimitMode.OFF or handled:
            return
        if res is not None and res.cgroup is not None:
            self._zero(container_id, res.cgroup, [(g.gpu_uuid, g.read_hard) for g in res.gpus if g.read_soft])
        elif res is None and cgroups_path and gpus:
            try:
                leaf = resolve_leaf(cgroups_path, self.cgroup_root)
            except CgroupNotFound:
                return
            todo = []
            for uuid in gpus:
                try:
                    cur = self.backend.get(uuid, leaf)
                except LimitError:
                    continue
                if cur.soft:
                    todo.append((uuid, cur.hard))
            self._zero(container_id, leaf, todo)

    def parents(self) -> set[str]:
        """The parent cgroups (pod, QoS, kubepods) of every leaf seen, while they exist."""
        with self._lock:
            self._parents = {p for p in self._parents if os.path.isdir(p)}
            return set(self._parents)

    def close(self) -> None:
        """Stop the leaf watch."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def results(self) -> list[ContainerLimits]:
        """The kept results (one per started container not removed yet)."""
        with self._lock:
            return list(self._results.values())

    def result(self, container_id: str) -> ContainerLimits | None:
        with self._lock:
            return self._results.get(container_id)

    def enforced_on(self, container_id: str, gpu_uuid: str) -> bool:
        """The container's limit on that GPU was applied or verified at its start (``what_holds``'s ``cgroup``)."""
        r = self.result(container_id) if container_id else None
        return r is not None and any(g.gpu_uuid == gpu_uuid and g.enforced is True for g in r.gpus)

    def status(self) -> dict[str, Any]:
        """JSON-able: ``{"mode", "containers": [ContainerLimits.to_dict()]}``."""
        return {"mode": self.mode.value, "containers": [r.to_dict() for r in self.results()]}


def plan_gpus(tenancies: Sequence[Any]) -> list[tuple[str, int, int]]:
    """``(uuid, request MiB, limit MiB)`` per GPU from a container's ledger
    tenancies (``Tenancy``: ``gpu_uuid``, ``request_mib``, ``limit_mib``)."""
    seen: dict[str, tuple[str, int, int]] = {}
    for t in tenancies:
        seen.setdefault(t.gpu_uuid, (t.gpu_uuid, int(t.request_mib), int(t.limit_mib)))
    return list(seen.values())


def metrics_rows(results: Sequence[ContainerLimits]) -> list[tuple[Mapping[str, str], float]]:
    """Rows for ``fracplugin_container_gpu_memory_limit_bytes{pod, container,
    gpu, kind, source}``: kind soft|hard|used, source planned|enforced|dmem|nvml."""
    rows: list[tuple[Mapping[str, str], float]] = []
    for r in results:
        for g in r.gpus:
            base = {"pod": r.pod, "container": r.container, "gpu": g.gpu_uuid}
            rows.append(({**base, "kind": "soft", "source": "planned"}, float(g.planned_soft)))
            rows.append(({**base, "kind": "hard", "source": "planned"}, float(g.planned_hard)))
            if g.read_soft is not None:
                rows.append(({**base, "kind": "soft", "source": "enforced"}, float(g.read_soft)))
            if g.read_hard is not None and g.read_hard != LIMIT_MAX:
                rows.append(({**base, "kind": "hard", "source": "enforced"}, float(g.read_hard)))
            if g.used is not None:
                rows.append(({**base, "kind": "used", "source": g.used_source or "nvml"}, float(g.used)))
    return rows
