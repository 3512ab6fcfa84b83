"""The node's CDI specs: GPU UUID -> CDI device name, and whether the device
carries the toolkit's memory-limit hook (ADR 0025b decisions 1-2, which give the
directories, the GPU kinds read and their priority, how a device is matched to a
GPU and what counts as the ``apply-cuda-memory-limits`` hook).

Re-reading happens off every request path (issue 34 item 5): the daemon's
watcher (``start``) stats the spec directories and every spec file every
``file_check_s`` seconds; anything changed -> the specs are read again and the
parsed snapshot swapped. Lookups only read the snapshot (the first lookup of a
registry never read reads it once: explain, tests). Only specs of a GPU kind are
parsed (the ``kind`` is sniffed from the file's first lines), with libyaml's
loader where present; only regular files are read, never blocking. A spec that
does not parse, or a device whose identities name different GPUs, is named in one
warning (per file version) and ignored; the rest still count.

Concurrency: lookups read an immutable snapshot; a re-read is done under one
lock and swaps the snapshot.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import yaml

from .atomicfile import read_regular
from .model import ContainerPlan, GpuInfo
from .logs import guarded

log = logging.getLogger(__name__)

DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
"""The CDI cache's default spec directories, lowest priority first."""
KIND_DEVICE_PLUGIN = "k8s.device-plugin.nvidia.com/gpu"
"""The NVIDIA device plugin's kind; its specs carry the memory-limit hook (toolkit v1.20.1+)."""
KIND_TOOLKIT = "nvidia.com/gpu"
"""The container toolkit's kind (``nvidia-ctk cdi generate``, the runtime's just-in-time specs)."""
DEFAULT_KINDS = (KIND_DEVICE_PLUGIN, KIND_TOOLKIT)
MEMORY_LIMIT_HOOK = "apply-cuda-memory-limits"
"""The toolkit's createRuntime hook that sets a container's CUDA memory limits (nvidia-cdi-hook subcommand)."""
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
"""CRI annotations by which kubelet and DRA drivers request CDI devices (value: comma list of names)."""
SPEC_SUFFIXES = (".yaml", ".yml", ".json")
OWN_CLAIM_SPEC_PREFIX = "gpu-memory.fracplugin.io-claim_"
"""File name prefix of the DRA door's per-claim specs (``dra/cdispec.spec_path``):
skipped when the node's specs are read (they name no GPU)."""
MAX_SPEC_BYTES = 4 << 20
"""Largest spec file read (4 MiB); a larger one is named in a warning and ignored."""


@dataclass(frozen=True)
class CdiDevice:
    """One GPU's CDI device on this node.

    Attributes:
        name: fully qualified CDI name ``<vendor>/<class>=<device>``
            (e.g. ``k8s.device-plugin.nvidia.com/gpu=GPU-8f3e...``).
        kind: ``<vendor>/<class>``.
        spec_path: the spec file that defines it.
        has_memory_limit_hook: its (or its spec's) ``containerEdits`` carry the
            ``apply-cuda-memory-limits`` createRuntime hook for this GPU.
    """

    name: str
    kind: str
    spec_path: str
    has_memory_limit_hook: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "spec": self.spec_path,
                "memory_limit_hook": self.has_memory_limit_hook}


@dataclass(frozen=True)
class _Snapshot:
    by_uuid: Mapping[str, CdiDevice] = field(default_factory=dict)
    name_to_uuid: Mapping[str, str] = field(default_factory=dict)
    specs: tuple[str, ...] = ()
    invalid: Mapping[str, str] = field(default_factory=dict)  # path -> reason


def _hook_names_limit(hook: Any) -> bool:
    if not isinstance(hook, Mapping):
        return False
    if str(hook.get("hookName", "createRuntime")) != "createRuntime":
        return False
    words = [str(hook.get("path", ""))] + [str(a) for a in hook.get("args") or () if isinstance(a, (str, int))]
    return any(w == MEMORY_LIMIT_HOOK or w.endswith("/" + MEMORY_LIMIT_HOOK) for w in words)


def _words_naming(values: Iterable[Any], uuids: Mapping[str, GpuInfo]) -> set[str]:
    """GPU UUIDs named by ``values`` (a word equal to a UUID, or ``...=UUID``, or a comma list of them)."""
    return {part for v in values if isinstance(v, str) for part in v.rpartition("=")[2].split(",") if part in uuids}


def _edits(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    e = obj.get("containerEdits")
    return e if isinstance(e, Mapping) else {}


def _hooks(edits: Mapping[str, Any]) -> list[Any]:
    h = edits.get("hooks")
    return list(h) if isinstance(h, list) else []


def _limit_hook_gpus(edits: Mapping[str, Any], uuids: Mapping[str, GpuInfo]) -> tuple[bool, set[str]]:
    """(some memory-limit hook without a GPU id, the GPUs hooks name by id)."""
    general, named = False, set()
    for h in _hooks(edits):
        if _hook_names_limit(h):
            ids = _words_naming(h.get("args") or (), uuids)
            if ids:
                named |= ids
            else:
                general = True
    return general, named


def _device_uuid(dev: Mapping[str, Any], gpus: Mapping[str, GpuInfo],
                 by_minor: Mapping[int, GpuInfo]) -> str | None:
    """The GPU UUID a spec device stands for (module docstring), or None.
    Every identity the device carries must name the same GPU: its name (a
    UUID), the UUIDs its hooks' arguments and ``NVIDIA_VISIBLE_DEVICES`` name,
    its one ``/dev/nvidia<minor>`` node. Raises ValueError when they disagree
    (issue 34 item 4: such a device matches no GPU)."""
    name = str(dev.get("name", ""))
    if name == "all" or ":" in name or (name.upper().startswith(("MIG-", "GPU-")) and name not in gpus):
        return None  # not a whole GPU, or a GPU UUID this node does not have (a stale spec)
    edits = _edits(dev)
    named = _words_naming([a for h in _hooks(edits) if isinstance(h, Mapping) for a in h.get("args") or ()], gpus)
    env = [e for e in edits.get("env") or () if isinstance(e, str) and e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    named |= _words_naming(env, gpus)
    if name in gpus:
        named.add(name)
    minors = set()
    for node in edits.get("deviceNodes") or ():
        path = str(node.get("path", "")) if isinstance(node, Mapping) else ""
        tail = path.removeprefix("/dev/nvidia")
        if path.startswith("/dev/nvidia") and tail.isdigit():
            minors.add(int(tail))
    if len(minors) == 1 and next(iter(minors)) in by_minor:
        by_node = by_minor[next(iter(minors))].uuid
        if named and by_node not in named:
            raise ValueError(f"device {name!r} names GPU {', '.join(sorted(named))} but its device node "
                             f"/dev/nvidia{next(iter(minors))} is GPU {by_node}: it matches no GPU")
        named.add(by_node)
    if len(named) > 1:
        raise ValueError(f"device {name!r} names several GPUs ({', '.join(sorted(named))}): it matches no GPU")
    return next(iter(named)) if named else None


_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's where present: ~10x faster
_KIND = re.compile(rb"""^\s*["']?kind["']?\s*:\s*["']?([^"'\s,#}]+)""", re.M)


def _sniff_kind(path: str) -> str | None:
    """The spec's ``kind`` read from its first lines without parsing it (a
    regular file only, never blocking), or None when not found there: specs
    of other vendors' kinds are skipped unparsed (issue 34 item 5)."""
    try:
        head = read_regular(path, 4096, whole=False)
    except OSError:
        return None
    m = _KIND.search(head)
    return m.group(1).decode("utf-8", "replace") if m else None


def _load(path: str) -> Any:
    """The parsed spec document. Raises ValueError naming what is wrong."""
    try:
        raw = read_regular(path, MAX_SPEC_BYTES)
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text) if path.endswith(".json") else yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not valid JSON at line {exc.lineno}: {exc.msg}") from None
    except RecursionError:
        raise ValueError("is nested too deeply to parse") from None
    except Exception as exc:  # the parser is not ours: anything it raises is the file's fault
        raise ValueError(f"cannot be parsed: {type(exc).__name__}") from None


def _check_spec(doc: Any) -> str:
    """The spec's kind. Raises ValueError naming the key, value and rule."""
    if not isinstance(doc, Mapping):
        raise ValueError("must be a mapping with cdiVersion, kind and devices (CDI spec)")
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind.count("/") != 1 or "=" in kind:
        raise ValueError(f"kind={kind!r} is not a CDI kind <vendor>/<class>")
    devices = doc.get("devices")
    if not isinstance(devices, list):
        raise ValueError(f"devices must be a list, got {type(devices).__name__}")
    for i, d in enumerate(devices):
        if not isinstance(d, Mapping) or not isinstance(d.get("name"), str) or not d.get("name"):
            raise ValueError(f"devices[{i}] has no name (each CDI device needs a non-empty name)")
    return kind


class CdiRegistry:
    """GPU UUID -> the node's CDI device for it (module docstring).

    Args:
        dirs: spec directories, lowest priority first (missing ones are fine:
            no spec there).
        gpus: the node's GPUs (UUIDs and minors to match devices against).
        kind: an operator-named kind (``--cdi-kind``), preferred over the
            default kinds; None = only ``k8s.device-plugin.nvidia.com/gpu``
            then ``nvidia.com/gpu``.
    """

    file_check_s = 1.0
    """Seconds between stats of every spec file (directory mtimes are checked on every ``refresh``)."""

    def __init__(self, dirs: Sequence[str], gpus: Sequence[GpuInfo], kind: str | None = None) -> None:
        self.dirs = tuple(dirs)
        self.kinds = tuple(dict.fromkeys(([kind] if kind else []) + list(DEFAULT_KINDS)))
        self._gpus = {g.uuid: g for g in gpus}
        self._by_minor = {g.minor: g for g in gpus}
        self._by_index = {str(g.index): g.uuid for g in gpus}
        self._lock = threading.Lock()
        self._snap = _Snapshot()
        self._dir_key: tuple[Any, ...] | None = None
        self._file_key: tuple[Any, ...] | None = None
        self._files_checked = 0.0
        self._warned: dict[tuple[str, Any], None] = {}
        self.reads = 0
        """How many times the specs were (re-)read."""
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # ---- the watcher (off the request path) ---------------------------------
    def start(self) -> None:
        """Read the specs now, then re-read them in the background whenever
        they change (checked every ``file_check_s`` seconds). A spec directory
        that is missing or unreadable is one warning here and a line in
        ``status`` (``unreadable_dirs``; issue 36 item 2). Idempotent."""
        self.refresh()
        for d, why in self.unreadable_dirs().items():
            log.warning("CDI spec directory %s: %s; no spec is read from it", d, why,
                        extra={"cdi_spec_dir": d, "reason": why})
        if self._watcher is not None:
            return
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, name="fracplugin-cdi", daemon=True)
        self._watcher.start()

    def unreadable_dirs(self) -> dict[str, str]:
        """Spec directory -> why no spec can be read from it (missing, not a
        directory, no permission)."""
        out = {}
        for d in self.dirs:
            if not os.path.isdir(d):
                out[d] = "does not exist" if not os.path.exists(d) else "is not a directory"
            elif not os.access(d, os.R_OK | os.X_OK):
                out[d] = "cannot be read (permission)"
        return out

    def _watch(self) -> None:
        while not self._stop.wait(self.file_check_s):
            guarded(log, "CDI spec re-read", self.refresh)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the watcher (within ``timeout_s``)."""
        self._stop.set()
        t, self._watcher = self._watcher, None
        if t is not None:
            t.join(timeout_s)

    def _current(self) -> _Snapshot:
        """The parsed snapshot; read once here when nothing has read it yet."""
        if self.reads == 0:
            self.refresh()
        return self._snap

    # ---- change detection ---------------------------------------------------
    def _dir_stats(self) -> tuple[Any, ...]:
        out: list[tuple[str, int | None, int | None]] = []
        for d in self.dirs:
            try:
                st = os.stat(d)
                out.append((d, st.st_mtime_ns, st.st_ino))
            except OSError:
                out.append((d, None, None))
        return tuple(out)

    def _spec_files(self) -> list[tuple[str, Any]]:
        """(path, (mtime_ns, size, ino)) of every spec file, directory order then name."""
        files: list[tuple[str, Any]] = []
        for d in self.dirs:
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                # our DRA door's per-claim specs (dra/cdispec.py) name no GPU: not read, so a
                # Prepare/Unprepare writing them costs the next refresh one scandir, not a parse
                if not e.name.endswith(SPEC_SUFFIXES) or e.name.startswith(OWN_CLAIM_SPEC_PREFIX):
                    continue
                try:
                    st = e.stat()
                except OSError:
                    continue
                if os.path.isfile(e.path):
                    files.append((e.path, (st.st_mtime_ns, st.st_size, st.st_ino)))
        return files

    def refresh(self, force: bool = False) -> bool:
        """Re-read the specs when they changed (or ``force``). Returns True
        when they were read. Never raises: a bad spec is warned about and
        ignored."""
        now = time.monotonic()
        dir_key = self._dir_stats()
        if not force and dir_key == self._dir_key and now - self._files_checked < self.file_check_s:
            return False
        with self._lock:
            files = self._spec_files()
            file_key = tuple(files)
            self._files_checked = now
            if not force and dir_key == self._dir_key and file_key == self._file_key:
                return False
            self._dir_key, self._file_key = dir_key, file_key
            self._snap = self._read(files)
            self.reads += 1
            return True

    def _read(self, files: Sequence[tuple[str, Any]]) -> _Snapshot:
        # candidates per UUID: (kind rank, exact-name rank, -file order) -> device; the
        # later directory/file wins a tie (the CDI cache's priority)
        best: dict[str, tuple[tuple[int, int, int], CdiDevice]] = {}
        names: dict[str, str] = {}
        specs: list[str] = []
        invalid: dict[str, str] = {}
        for order, (path, version) in enumerate(files):
            sniffed = _sniff_kind(path)
            if sniffed is not None and sniffed.count("/") == 1 and sniffed not in self.kinds:
                specs.append(path)  # another vendor's kind: not parsed
                continue
            try:
                doc = _load(path)
                kind = _check_spec(doc)
            except ValueError as exc:
                invalid[path] = str(exc)
                self._warn(path, version, str(exc))
                continue
            specs.append(path)
            if kind not in self.kinds:
                continue
            spec_general, spec_named = _limit_hook_gpus(_edits(doc), self._gpus)
            for dev in doc["devices"]:
                try:
                    uuid = _device_uuid(dev, self._gpus, self._by_minor)
                except ValueError as exc:
                    invalid[f"{path}#{dev['name']}"] = str(exc)
                    self._warn(path, (version, dev["name"]), str(exc))
                    continue
                if uuid is None:
                    continue
                general, named = _limit_hook_gpus(_edits(dev), self._gpus)
                hook = general or spec_general or uuid in named or uuid in spec_named
                qualified = f"{kind}={dev['name']}"
                names[qualified] = uuid
                rank = (self.kinds.index(kind), 0 if dev["name"] == uuid else 1, -order)
                cur = best.get(uuid)
                if cur is None or rank < cur[0]:
                    best[uuid] = (rank, CdiDevice(qualified, kind, path, hook))
        return _Snapshot({u: d for u, (_r, d) in best.items()}, names, tuple(specs), invalid)

    def _warn(self, path: str, version: Any, reason: str) -> None:
        if (path, version) not in self._warned:
            self._warned[(path, version)] = None
            log.warning("CDI spec %s ignored: %s", path, reason, extra={"cdi_spec": path, "reason": reason})

    # ---- lookups (the snapshot only: never a read on a request path) ----------
    def device_for(self, uuid: str) -> CdiDevice | None:
        """The CDI device this node's specs define for GPU ``uuid`` (preferred
        kind first, a device named by the UUID before one named otherwise), or
        None when no spec of a GPU kind lists it."""
        return self._current().by_uuid.get(uuid)

    def listed(self, name: str) -> bool:
        """Whether a spec this registry read defines the fully qualified CDI ``name``."""
        return name in self._current().name_to_uuid

    def gpu_of(self, name: str) -> str | None:
        """The GPU UUID a fully qualified CDI name stands for: a device of a
        spec this registry read, or a name whose device part is one of the
        node's GPU UUIDs or indices; None otherwise."""
        uuid = self._current().name_to_uuid.get(name)
        if uuid is not None:
            return uuid
        dev = name.partition("=")[2]
        return dev if dev in self._gpus else self._by_index.get(dev)

    def status(self) -> dict[str, Any]:
        """``{"spec_dirs", "kinds", "specs", "invalid_specs": [{path, reason}],
        "devices": {uuid: CdiDevice.to_dict()}, "gpus_without_spec": [uuid]}``
        for ``/status`` (section ``cdi``)."""
        snap = self._current()
        return {
            "spec_dirs": list(self.dirs),
            "unreadable_dirs": self.unreadable_dirs(),
            "kinds": list(self.kinds),
            "specs": list(snap.specs),
            "invalid_specs": [{"path": p, "reason": r} for p, r in snap.invalid.items()],
            "devices": {u: d.to_dict() for u, d in snap.by_uuid.items()},
            "gpus_without_spec": [u for u in self._gpus if u not in snap.by_uuid],
        }


def container_cdi_devices(container: Any) -> tuple[str, ...]:
    """The CDI devices a container already requests: NRI ``Container.CDI_devices``
    (v0.10+; kubelet's Allocate answer and DRA end up there) and the values of
    its ``cdi.k8s.io/*`` annotations (comma lists; the CRI form of the same).
    ``container`` is an NRI ``Container`` message (or anything with
    ``annotations`` and optionally ``CDI_devices``)."""
    out: dict[str, None] = {}
    for d in getattr(container, "CDI_devices", ()) or ():
        if d.name:
            out[d.name] = None
    annotations = getattr(container, "annotations", None) or {}
    for k in annotations:  # keys, then the few values wanted: a protobuf map's items() is Python code
        if k.startswith(CDI_ANNOTATION_PREFIX):
            for name in str(annotations[k]).split(","):
                if name.strip():
                    out[name.strip()] = None
    return tuple(out)


def with_node_cdi_devices(plan: ContainerPlan, registry: CdiRegistry | None,
                          present: Sequence[str] = ()) -> ContainerPlan:
    """``plan`` whose ``cdi_devices`` name one CDI device per planned GPU
    (issue 23 item 1, issue 34 item 4): never twice, never a GPU the container
    already gets by CDI, and never a name the node's specs do not list where
    they list one for that GPU.

    ``present`` are the CDI devices the container requests itself
    (``container_cdi_devices``): a name there is not requested again, and a
    GPU one of them stands for (``CdiRegistry.gpu_of``) gets no second device.
    A scheduler-written name of the plan is kept when the node's specs list it
    (or when they list nothing for its GPU: the runtime resolves it or says
    why); one they do not list is replaced by the node's own device for that
    GPU (``nvidia.com/gpu=0`` on a node whose specs have only
    ``k8s.device-plugin.nvidia.com/gpu``). Then one device per remaining GPU in
    plan order; a GPU with no spec gets none (its env still names it).
    ``registry`` None: ``plan`` unchanged. Reads the registry's snapshot only."""
    if registry is None:
        return plan
    have = set(present)
    covered = {u for u in (registry.gpu_of(n) for n in have) if u}
    names: dict[str, None] = {}
    for n in plan.cdi_devices:
        uuid = registry.gpu_of(n)
        own = registry.device_for(uuid) if uuid is not None and not registry.listed(n) else None
        name = own.name if own is not None else n
        if uuid not in covered and name not in have:
            names[name] = None
        if uuid is not None:
            covered.add(uuid)
    for uuid in plan.device_uuids:
        if uuid in covered:
            continue
        dev = registry.device_for(uuid)
        if dev is not None and dev.name not in have:
            names[dev.name] = None
    out = tuple(names)
    if out == plan.cdi_devices:
        return plan
    # a shallow copy with one field set: dataclasses.replace re-runs __init__
    # (~40 us under load, on every CreateContainer), this costs ~2 us
    q = copy.copy(plan)
    object.__setattr__(q, "cdi_devices", out)
    return q
