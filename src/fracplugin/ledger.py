"""Who holds what on each GPU, with the node-side guards and atomic persistence.

Concurrency: one ``threading.RLock`` guards all state; every public method is
safe to call from any thread (NRI handlers, gRPC workers, metrics scrapes).
Subscribers are called after the lock is released.

Invariants (checked by ``check_invariants`` and by property tests):

- one compute mode per GPU at a time;
- per GPU, the sum of request MiB held <= the GPU's memory;
- per GPU, at most ``max_clients_per_gpu`` tenants (MPS client limit, 48 on
  Volta and later: kubelet-device-plugin.md B.4);
- an owner (pod uid, container) appears at most once per GPU.

Persistence (issue 14, ADR 0010): a snapshot plus an
append-only journal, so a change costs O(1) in the node's tenancies.

- snapshot ``<path>``: ``{"version": 1, "node": ..., "generation": G,
  "tenancies": [...]}``, written to a temp file in the same directory,
  fsynced, renamed over the old file, and the directory fsynced;
- journal ``<path>.journal``: a header line ``{"journal": 1, "generation": G}``
  then one line per change ``{"del": [tenancy...], "add": [tenancy...]}``,
  appended and fdatasynced before the change is acknowledged (fsync is
  nearly free on tmpfs, where production keeps the state directory);
- compaction writes a new snapshot generation and a fresh journal (first
  change after ``load``, every ``max(1024, 2 x tenancies)`` changes, and
  ``close``); a journal whose generation is not the snapshot's is stale.

A snapshot that cannot be read back is moved aside to
``<path>.corrupt-<unix seconds>`` and reported; it is never trusted. A torn
last journal line (cut by a crash during its append) is dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from .allocation import DOOR_ALLOCATE, DOOR_NRI, DOOR_OTHER_PLUGIN, DOOR_SYNC, to_tenancies
from .model import ComputeMode, ContainerPlan, FractionError, GpuInfo, NodeInfo, Tenancy

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_MAX_CLIENTS_PER_GPU = 48
_WHOLE_DOORS = (DOOR_OTHER_PLUGIN, DOOR_SYNC)
JOURNAL_SUFFIX = ".journal"
DEFAULT_COMPACT_MIN_RECORDS = 1024
"""Journal changes kept before a compaction, at least (issue 14)."""


@dataclass(frozen=True)
class Problem:
    """Why one GPU cannot take a container: ``fact`` about the GPU and the
    ``rule`` it breaks (kept apart so a refusal listing several GPUs states
    each rule once)."""

    fact: str
    rule: str

    def __str__(self) -> str:
        return f"{self.fact}; {self.rule}"


def same_hold(t: Tenancy, owner: tuple[str, str], reservation: str = "") -> bool:
    """True when ``t`` is the hold being (re)admitted: the same kubelet
    reservation (an init container and the app container reusing its device
    IDs are one hold, ADR 0007), or the same bound (pod uid, container)."""
    if reservation and t.reservation == reservation:
        return True
    return bool(owner[0]) and t.owner == owner


def holder_text(t: Tenancy) -> str:
    """``namespace/pod/container`` of a hold, or ``reservation <key> (holder
    not known yet)`` for a kubelet reservation no container claimed yet
    (README, "What each door decides"; never ``//``)."""
    if t.bound:
        return f"{t.namespace}/{t.pod_name}/{t.container}"
    return f"reservation {t.reservation} (holder not known yet)"


def admission_problem(
    gpu: GpuInfo,
    tenants: Sequence[Tenancy],
    owner: tuple[str, str],
    mode: ComputeMode,
    request_mib: int,
    max_clients: int,
    reservation: str = "",
) -> Problem | None:
    """Why ``owner`` cannot take ``request_mib`` MiB of ``gpu`` in ``mode``, or None.

    ``tenants`` are the GPU's current tenancies; the hold's own earlier
    entries (``same_hold``: same owner, or same ``reservation``) are ignored
    (a restarted container replaces its hold). A GPU given whole to a
    container by another device plugin (door ``other-plugin``) takes no
    fraction. Shared by the planner (to choose) and the ledger (to enforce
    atomically).
    """
    # One pass, no per-tenant function calls: this runs twice per admission
    # (planner, ledger) over up to max_clients tenants (issue 14 profile).
    uid, name = owner
    if reservation or uid:
        others = [t for t in tenants
                  if not ((reservation and t.reservation == reservation)
                          or (uid and t.pod_uid == uid and t.container == name))]
    else:
        others = list(tenants)
    held = 0
    whole: Tenancy | None = None
    other_mode: Tenancy | None = None
    for t in others:
        held += t.request_mib
        if whole is None and t.door in _WHOLE_DOORS:
            whole = t
        if other_mode is None and t.mode is not mode:
            other_mode = t
    if whole is not None:
        t = whole
        how = (f"by another device plugin ({t.reservation})" if t.door == DOOR_OTHER_PLUGIN
               else "(a running container fracplugin did not adjust)")
        return Problem(
            f"GPU {gpu.index} ({gpu.uuid}) is used whole by {t.namespace}/{t.pod_name}/{t.container} {how}",
            "a GPU used whole is not shared",
        )
    if other_mode is not None:
        t = other_mode
        return Problem(
            f"GPU {gpu.index} ({gpu.uuid}) is in {t.mode.value} mode for {holder_text(t)}",
            f"one compute mode per GPU, this container wants {mode.value}",
        )
    if held + request_mib > gpu.memory_mib:
        return Problem(
            f"GPU {gpu.index} ({gpu.uuid}) has {gpu.memory_mib - held} MiB of {gpu.memory_mib} MiB free",
            f"this container requests {request_mib} MiB",
        )
    if len(others) >= max_clients:
        return Problem(f"GPU {gpu.index} ({gpu.uuid}) already has {len(others)} tenants",
                       f"the MPS client limit is {max_clients} per GPU")
    return None


_str = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # json.dumps' own string encoder


def _int(v: int | None) -> str:
    if v is None:
        return "null"
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {v!r}")
    return int.__repr__(v)


def encode_tenancy(t: Tenancy) -> str:
    """One tenancy as its ledger record: exactly
    ``json.dumps(t.to_dict(), sort_keys=True, separators=(",", ":"))``
    (keys sorted, compact, ASCII with ``\\uXXXX`` escapes), written field by
    field (issue 14: 2 us instead of 5 us per admission). A property test
    keeps the two identical. Raises TypeError for a non-integer MiB field."""
    ns = t.mps_namespace
    return ('{"active_thread_percentage":%s,"container":%s,"container_id":%s,"door":%s,"gpu_uuid":%s,'
            '"limit_mib":%s,"mode":%s,"mps_namespace":%s,"namespace":%s,"pod_name":%s,"pod_uid":%s,'
            '"request_mib":%s,"reservation":%s}' % (
                _int(t.active_thread_percentage), _str(t.container), _str(t.container_id), _str(t.door),
                _str(t.gpu_uuid), _int(t.limit_mib), _str(t.mode.value), "null" if ns is None else _str(ns),
                _str(t.namespace), _str(t.pod_name), _str(t.pod_uid), _int(t.request_mib), _str(t.reservation)))


class _Corrupt(ValueError):
    """The snapshot or the journal cannot be trusted (the message says why)."""


class Ledger:
    """Per-GPU tenancy of this node.

    Args:
        node: the node's GPUs (memory sizes bound the guards).
        path: the JSON snapshot to persist to (its journal is ``<path>.journal``);
            None keeps the ledger in memory.
        max_clients_per_gpu: tenants allowed per GPU.
        read_only: read ``path`` but never write or move it (``fracplugin explain --ledger``).
        compact_min_records: the journal is compacted into the snapshot once it
            holds more than ``max(compact_min_records, 2 x tenancies)`` changes
            (amortised O(1) per change).

    Costs: an admission or release touches only the GPUs and the hold
    concerned (per-GPU, per-owner, per-reservation and per-container-id
    indexes) and appends one journal line: O(1) in the node's tenancies
    (issue 14, ``nri.create.service_growth_1_to_768_tenancies``).
    """

    def __init__(self, node: NodeInfo, path: str | os.PathLike[str] | None = None,
                 max_clients_per_gpu: int = DEFAULT_MAX_CLIENTS_PER_GPU, *, read_only: bool = False,
                 compact_min_records: int = DEFAULT_COMPACT_MIN_RECORDS) -> None:
        self._read_only = read_only
        self._node = node
        self._gpus = {g.uuid: g for g in node.gpus}
        self._path = Path(path) if path is not None else None
        self._journal_path = self._path.with_name(self._path.name + JOURNAL_SUFFIX) if self._path else None
        self._max_clients = max_clients_per_gpu
        self._compact_min = max(1, compact_min_records)
        self._lock = threading.RLock()
        # Insertion-ordered sets (dict keys) of tenancies: all, and indexes.
        self._entries: dict[Tenancy, None] = {}
        self._by_gpu: dict[str, dict[Tenancy, None]] = {}
        self._by_owner: dict[tuple[str, str], dict[Tenancy, None]] = {}
        self._by_reservation: dict[str, dict[Tenancy, None]] = {}
        self._by_container_id: dict[str, dict[Tenancy, None]] = {}
        self._subscribers: list[Callable[[], None]] = []
        # Serialised form of each tenancy (frozen, hashable): a change encodes
        # only what is new (the NRI hot path).
        self._fragments: dict[Tenancy, str] = {}
        self._dir_ready = False
        self._journal_fd: int | None = None  # open (O_APPEND) journal of the current generation
        self._journal_size = 0
        self._journal_records = 0
        self._replayed = False  # load() replayed journal lines: close() folds them into the snapshot

    # ---- indexes -----------------------------------------------------------
    def _index(self, t: Tenancy) -> None:
        self._entries[t] = None
        self._by_gpu.setdefault(t.gpu_uuid, {})[t] = None
        if t.pod_uid:
            self._by_owner.setdefault(t.owner, {})[t] = None
        if t.reservation:
            self._by_reservation.setdefault(t.reservation, {})[t] = None
        if t.container_id:
            self._by_container_id.setdefault(t.container_id, {})[t] = None

    def _unindex(self, t: Tenancy) -> None:
        del self._entries[t]
        indexes: tuple[tuple[dict[Any, dict[Tenancy, None]], Any], ...] = (
            (self._by_gpu, t.gpu_uuid), (self._by_owner, t.owner),
            (self._by_reservation, t.reservation), (self._by_container_id, t.container_id))
        for index, key in indexes:
            bucket = index.get(key)
            if bucket is not None:
                bucket.pop(t, None)
                if not bucket:
                    del index[key]

    def _set_all(self, items: Iterable[Tenancy]) -> None:
        self._entries, self._by_gpu, self._by_owner = {}, {}, {}
        self._by_reservation, self._by_container_id = {}, {}
        for t in items:
            self._index(t)

    def _apply(self, removed: Sequence[Tenancy], added: Sequence[Tenancy]) -> None:
        for t in removed:
            self._unindex(t)
        for t in added:
            self._index(t)

    def _held_by(self, owner: tuple[str, str], reservation: str) -> list[Tenancy]:
        """The hold's current entries (``same_hold``), via the indexes."""
        out: dict[Tenancy, None] = {}
        if reservation:
            out.update(self._by_reservation.get(reservation, {}))
        if owner[0]:
            out.update(self._by_owner.get(owner, {}))
        return list(out)

    # ---- reading -----------------------------------------------------------
    @property
    def node(self) -> NodeInfo:
        return self._node

    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def journal_path(self) -> Path | None:
        """``<path>.journal``: the changes since the snapshot (None in memory)."""
        return self._journal_path

    def tenancies(self) -> list[Tenancy]:
        """All tenancies, in admission order."""
        with self._lock:
            return list(self._entries)

    def tenants(self, gpu_uuid: str) -> list[Tenancy]:
        """Tenancies on one GPU (O(tenants of that GPU))."""
        with self._lock:
            return list(self._by_gpu.get(gpu_uuid, ()))

    def held_mib(self, gpu_uuid: str) -> int:
        """Request MiB held on one GPU."""
        return sum(t.request_mib for t in self.tenants(gpu_uuid))

    def mode(self, gpu_uuid: str) -> ComputeMode | None:
        """The compute mode of a GPU's tenants, None when it has none."""
        tenants = self.tenants(gpu_uuid)
        return tenants[0].mode if tenants else None

    def find(self, pod_uid: str, container: str) -> list[Tenancy]:
        """The tenancies of one container (one per GPU)."""
        with self._lock:
            return list(self._by_owner.get((pod_uid, container), ()))

    def find_container_id(self, container_id: str) -> list[Tenancy]:
        """The tenancies recorded under a runtime container id."""
        if not container_id:
            return []
        with self._lock:
            return list(self._by_container_id.get(container_id, ()))

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every change (outside the lock)."""
        with self._lock:
            self._subscribers.append(callback)

    def reservation(self, key: str) -> list[Tenancy]:
        """The tenancies of one kubelet reservation (one per GPU; empty when none)."""
        if not key:
            return []
        with self._lock:
            return list(self._by_reservation.get(key, ()))

    def reservations(self) -> dict[str, list[Tenancy]]:
        """Every reservation of the ``allocate`` door: key -> its tenancies."""
        out: dict[str, list[Tenancy]] = {}
        with self._lock:
            for key, bucket in self._by_reservation.items():
                mine = [t for t in bucket if t.door == DOOR_ALLOCATE]
                if mine:
                    out[key] = mine
        return out

    # ---- changing ----------------------------------------------------------
    def admit(self, plan: ContainerPlan, container_id: str = "", *, door: str = DOOR_NRI,
              reservation: str = "", bound: bool = True) -> list[Tenancy]:
        """Record ``plan`` (``allocation.to_tenancies``): one Tenancy per
        assigned GPU, replacing the hold's earlier entries (same owner, or the
        same ``reservation`` key). ``bound=False`` records a kubelet
        reservation whose holder is not known yet. Atomic: either every GPU is
        admitted or none.

        Raises:
            FractionError: a guard fails (code ``guard``) or a GPU is unknown;
                the ledger is unchanged then.
            OSError: the file could not be written (the ledger is unchanged).
        """
        owner = (plan.pod.uid, plan.container) if bound else ("", "")
        new = to_tenancies(plan, container_id, door=door, reservation=reservation, bound=bound)
        with self._lock:
            for t in new:
                gpu = self._gpus.get(t.gpu_uuid)
                if gpu is None:
                    raise FractionError("node", t.gpu_uuid, f"is not a GPU of node {self._node.name}", "device")
                problem = admission_problem(
                    gpu, list(self._by_gpu.get(gpu.uuid, ())), owner,
                    t.mode, t.request_mib, self._max_clients, reservation,
                )
                if problem:
                    raise FractionError("node", str(plan.pod) + "/" + plan.container, str(problem), "guard")
            self._change(self._held_by(owner, reservation), new)
        self._notify()
        return new

    def release(self, pod_uid: str, container: str) -> list[Tenancy]:
        """Drop one container's tenancies; returns what was dropped."""
        return self._release_from(self._by_owner, (pod_uid, container))

    def release_container_id(self, container_id: str) -> list[Tenancy]:
        """Drop the tenancies recorded under a runtime container id."""
        return self._release_from(self._by_container_id, container_id) if container_id else []

    def release_reservation(self, key: str) -> list[Tenancy]:
        """Drop one kubelet reservation (kubelet freed its devices)."""
        return self._release_from(self._by_reservation, key) if key else []

    def _release_from(self, index: Mapping[Any, Any], key: Any) -> list[Tenancy]:
        """Drop what ``index[key]`` names (one of the ledger's indexes), under
        the lock, and notify the watchers when something went."""
        with self._lock:
            gone = self._drop(list(index.get(key, ())))
        if gone:
            self._notify()
        return gone

    def release_stopped(self, container_id: str) -> list[Tenancy]:
        """A container stopped: drop what it holds through the NRI door, and
        unbind it from a kubelet reservation (the reservation stays held for
        its pod until kubelet frees the devices: the pod ends, or the devices
        are allocated again). Returns the dropped tenancies."""
        if not container_id:
            return []
        with self._lock:
            mine = list(self._by_container_id.get(container_id, ()))
            if not mine:
                return []
            gone = [t for t in mine if t.door != DOOR_ALLOCATE]
            unbound = [dataclasses.replace(t, container_id="") for t in mine if t.door == DOOR_ALLOCATE]
            self._change(mine, unbound)
        self._notify()
        return gone

    def release_pod(self, pod_uid: str) -> list[Tenancy]:
        """Drop every tenancy of a pod."""
        return self._remove(lambda t: t.pod_uid == pod_uid)

    def transform(self, fn: Callable[[list[Tenancy]], Iterable[Tenancy]]) -> None:
        """Replace the state with ``fn(current entries)`` atomically (under the
        lock, so a concurrent admission is never lost), with ``replace_all``'s
        rules (unknown GPUs dropped, guard breaks logged, never refused)."""
        self._replace(fn)

    def replace_all(self, tenancies: Iterable[Tenancy]) -> None:
        """Replace the whole state (rebuild after a runtime Synchronize).

        Records what is there without refusing: entries on unknown GPUs are
        dropped with a warning; guard violations are logged, since the
        containers already run.
        """
        items = list(tenancies)
        self._replace(lambda _cur: items)

    def _replace(self, fn: Callable[[list[Tenancy]], Iterable[Tenancy]]) -> None:
        with self._lock:
            kept: list[Tenancy] = []
            seen: set[tuple[str, str, str]] = set()
            for t in fn(list(self._entries)):
                if t.gpu_uuid not in self._gpus:
                    log.warning("ledger: dropping tenancy on unknown GPU",
                                extra={"gpu_uuid": t.gpu_uuid, "pod_uid": t.pod_uid})
                    continue
                key = (*t.hold, t.gpu_uuid)
                if key in seen:
                    continue
                seen.add(key)
                kept.append(t)
            before = list(self._entries)
            self._set_all(kept)
            try:
                self._compact()  # a whole new state: one snapshot, not a journal of it
            except OSError:
                self._set_all(before)
                raise
            for problem in self.check_invariants():
                log.warning("ledger: running containers break a guard: %s", problem)
        self._notify()

    def _remove(self, match: Callable[[Tenancy], bool]) -> list[Tenancy]:
        with self._lock:
            gone = self._drop([t for t in self._entries if match(t)])
        if gone:
            self._notify()
        return gone

    def _drop(self, gone: list[Tenancy]) -> list[Tenancy]:
        """Remove ``gone`` (persisted); the caller holds the lock and
        notifies after releasing it."""
        if gone:
            self._change(gone, [])
        return gone

    def _change(self, removed: Sequence[Tenancy], added: Sequence[Tenancy]) -> None:
        """Apply one change in memory and persist it; on OSError memory is
        rolled back and the error raised (the caller holds the lock)."""
        self._apply(removed, added)
        try:
            self._persist(removed, added)
        except OSError:
            self._apply(added, removed)
            raise

    def _notify(self) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for cb in subscribers:
            try:
                cb()
            except Exception:  # a subscriber never breaks the ledger
                log.exception("ledger subscriber failed")

    # ---- invariants --------------------------------------------------------
    def check_invariants(self) -> list[str]:
        """Every broken invariant, as a sentence (empty when all hold)."""
        problems = []
        with self._lock:
            entries = list(self._entries)
        for gpu in self._node.gpus:
            on = [t for t in entries if t.gpu_uuid == gpu.uuid]
            if len({t.mode for t in on}) > 1:
                problems.append(f"GPU {gpu.uuid} has tenants of more than one compute mode")
            held = sum(t.request_mib for t in on)
            if held > gpu.memory_mib:
                problems.append(f"GPU {gpu.uuid} holds {held} MiB of {gpu.memory_mib} MiB")
            if len(on) > self._max_clients:
                problems.append(f"GPU {gpu.uuid} has {len(on)} tenants, limit {self._max_clients}")
            owners = [t.hold for t in on]
            if len(owners) != len(set(owners)):
                problems.append(f"GPU {gpu.uuid} lists one container twice")
        return problems

    # ---- persistence -------------------------------------------------------
    def load(self) -> list[str]:
        """Read the snapshot and replay its journal (if any) into memory;
        returns warnings for the operator.

        A snapshot that is not valid JSON of our format, or a journal with a
        bad record before its last line, is moved aside to
        ``<path>.corrupt-<unix seconds>`` (the journal to
        ``<path>.journal.corrupt-<unix seconds>``) and the ledger starts
        empty. A torn last journal line (a change whose append a crash cut:
        it was never acknowledged, since the append's fsync comes before the
        answer) is dropped with a warning. A journal of another generation
        than the snapshot (a compaction that crashed between its two renames)
        is stale: every change in it is already in the snapshot. Records on
        GPUs this node does not have are dropped with a warning. Writes
        nothing: the first change after ``load`` compacts.
        """
        if self._path is None or not self._path.exists():
            return []
        warnings: list[str] = []
        try:
            doc = json.loads(self._path.read_text())
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format (version {doc.get('version') if isinstance(doc, dict) else None!r})")
            records = doc["tenancies"]
            if not isinstance(records, list):
                raise ValueError("tenancies is not a list")
            entries = {Tenancy.from_dict(r): None for r in records}
            generation = doc.get("generation")
            if isinstance(generation, str) and generation:
                entries, torn, replayed = self._replay(entries, generation)
                self._replayed = replayed or bool(torn)
                if torn:
                    warnings.append(f"ledger journal {self._journal_path}: {torn}; dropped")
            for t in entries:
                if not 1 <= t.request_mib <= t.limit_mib:
                    raise ValueError(f"record {t.namespace}/{t.pod_name}/{t.container} has request {t.request_mib} MiB "
                                     f"and limit {t.limit_mib} MiB (need 1 <= request <= limit)")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            what = "journal" if isinstance(exc, _Corrupt) else "file"
            if self._read_only:
                return [f"ledger {what} {self._path} is unreadable ({exc}); ignored"]
            stamp = int(time.time())
            aside = self._path.with_name(f"{self._path.name}.corrupt-{stamp}")
            os.replace(self._path, aside)
            assert self._journal_path is not None
            if self._journal_path.exists():
                os.replace(self._journal_path, self._journal_path.with_name(f"{self._journal_path.name}.corrupt-{stamp}"))
            msg = f"ledger {what} {self._path} is corrupt ({exc}); moved aside to {aside}, starting empty"
            log.error(msg)
            return [msg]
        kept = []
        for t in entries:
            if t.gpu_uuid not in self._gpus:
                warnings.append(f"ledger record for {t.namespace}/{t.pod_name}/{t.container} names GPU {t.gpu_uuid}, "
                                f"which this node does not have; dropped")
                continue
            kept.append(t)
        with self._lock:
            self._close_journal()  # the next change compacts: a new generation
            self._set_all(kept)
            for problem in self.check_invariants():
                warnings.append(f"ledger file breaks a guard: {problem}")
        for w in warnings:
            log.warning(w)
        self._notify()
        return warnings

    def _replay(self, entries: dict[Tenancy, None], generation: str) -> tuple[dict[Tenancy, None], str, bool]:
        """Apply the journal of ``generation`` to the snapshot's ``entries``.
        Returns the entries, why a torn tail was dropped ('' when none) and
        whether any change was replayed.
        Raises _Corrupt for a bad record that is not the last line."""
        assert self._journal_path is not None
        try:
            raw = self._journal_path.read_bytes()
        except FileNotFoundError:
            return entries, "", False
        lines = raw.split(b"\n")
        # A complete file ends with "\n": the last element is then b"".
        tail_cut = lines[-1] != b""
        lines = lines[:-1] if not tail_cut else lines
        if not lines:
            return entries, "", False
        try:
            header = json.loads(lines[0])
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("generation") != generation:
            return entries, "", False  # stale (or torn header): every change is in the snapshot
        torn = ""
        replayed = False
        order = dict(entries)
        for i, line in enumerate(lines[1:], start=1):
            last = i == len(lines) - 1
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("a journal record must be an object")
                removed = [Tenancy.from_dict(r) for r in rec.get("del", [])]
                added = [Tenancy.from_dict(r) for r in rec.get("add", [])]
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                if last:
                    torn = f"line {i + 1} is a torn (unfinished) change ({exc})"
                    break
                raise _Corrupt(f"journal line {i + 1}: {exc}") from None
            if last and tail_cut:
                torn = f"line {i + 1} is a torn (unfinished) change (no end of line)"
                break
            for t in removed:
                order.pop(t, None)
            for t in added:
                order[t] = None
            replayed = True
        return order, torn, replayed

    def close(self) -> None:
        """Compact the journal into the snapshot (a clean stop leaves one
        file) and close it. Errors are logged, never raised: every change is
        already durable in the journal."""
        with self._lock:
            if not self._read_only and ((self._journal_fd is not None and self._journal_records) or self._replayed):
                try:
                    self._compact()
                except OSError as exc:
                    log.warning("ledger: compaction at close failed: %s", exc)
            self._close_journal()

    def _close_journal(self) -> None:
        if self._journal_fd is not None:
            try:
                os.close(self._journal_fd)
            except OSError:
                pass
        self._journal_fd = None
        self._journal_records = 0
        self._journal_size = 0

    def _fragment(self, t: Tenancy) -> str:
        frag = self._fragments.get(t)
        if frag is None:
            frag = self._fragments[t] = encode_tenancy(t)
        return frag

    def _persist(self, removed: Sequence[Tenancy], added: Sequence[Tenancy]) -> None:
        """Make one change durable: one journal line appended and fsynced
        (O(size of the change)); the first change after a load, and every
        ``max(compact_min_records, 2 x tenancies)`` changes, compact instead."""
        if self._path is None or self._read_only:
            return
        if self._journal_fd is None:
            self._compact()
            return
        line = ('{"del":[%s],"add":[%s]}\n' % (
            ",".join(self._fragment(t) for t in removed), ",".join(self._fragment(t) for t in added))).encode()
        fd = self._journal_fd
        try:
            view = memoryview(line)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fdatasync(fd)
        except OSError:
            # Cut what may have reached the file, so a rolled-back change is
            # not replayed; the next change compacts from memory either way.
            try:
                os.ftruncate(fd, self._journal_size)
            except OSError:
                pass
            self._close_journal()
            raise
        self._journal_size += len(line)
        self._journal_records += 1
        if self._journal_records > max(self._compact_min, 2 * len(self._entries)):
            try:
                self._compact()
            except OSError as exc:  # the change is durable in the journal already
                log.warning("ledger: compaction failed (the journal keeps every change): %s", exc)
                self._close_journal()

    def _compact(self) -> None:
        """Write the whole state as a new snapshot generation, then start an
        empty journal of that generation. Order (crash-safe at every step):
        snapshot temp, fsync, rename, fsync dir; journal temp (header line),
        fsync, rename, fsync dir. A crash between the two renames leaves the
        old journal, whose generation no longer matches: it is ignored, and
        the snapshot already holds all of its changes."""
        if self._path is None or self._read_only:
            return
        assert self._journal_path is not None
        self._close_journal()
        self._replayed = False
        if len(self._fragments) > 2 * len(self._entries) + 64:
            live = self._entries
            self._fragments = {t: f for t, f in self._fragments.items() if t in live}
        generation = os.urandom(8).hex()
        # The document in compact JSON, one tenancy per line so the file stays
        # readable with `less`.
        data = ('{"node":%s,"version":%d,"generation":"%s","tenancies":[\n%s\n]}\n' % (
            json.dumps(self._node.name), FORMAT_VERSION, generation,
            ",\n".join(self._fragment(t) for t in self._entries))).encode()
        directory = self._path.parent
        if not self._dir_ready:
            directory.mkdir(parents=True, exist_ok=True)
            self._dir_ready = True
        self._write_atomically(self._path, data)
        # From here the state is durable in the snapshot: a failure to start
        # the journal must not undo the change (the old journal, if any, is
        # of another generation: stale). The next change compacts again.
        header = ('{"journal":%d,"generation":"%s"}\n' % (FORMAT_VERSION, generation)).encode()
        try:
            self._write_atomically(self._journal_path, header)
            fd = os.open(self._journal_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("ledger: snapshot written, journal not started (the next change writes a snapshot again): %s",
                        exc)
            return
        self._journal_fd = fd
        self._journal_size = len(header)
        self._journal_records = 0

    @staticmethod
    def _write_atomically(path: Path, data: bytes) -> None:
        directory = path.parent
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


TMPFS_MAGIC = 0x01021994
"""``f_type`` of tmpfs in statfs(2) (linux/magic.h TMPFS_MAGIC); ramfs is 0x858458f6."""
RAMFS_MAGIC = 0x858458F6


def filesystem_type(path: str | os.PathLike[str]) -> int | None:
    """The ``f_type`` that statfs(2) reports for ``path`` (None when the call
    fails or is not available). Python's os.statvfs has no f_type, so this
    calls libc's statfs through ctypes (struct statfs: f_type is the first
    field, a ``long`` on Linux: man 2 statfs)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64 and arm64
        if libc.statfs(os.fsencode(os.fspath(path)), buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value
    except (OSError, AttributeError, ValueError):
        return None


def state_dir_warning(state_dir: str | os.PathLike[str]) -> str:
    """A warning for the operator when ``state_dir`` is not on tmpfs (or
    ramfs), '' otherwise (or when the type cannot be told). On a disk, each
    ledger change waits for an fsync of the journal: bench_nri measured a
    64-queued CreateContainer p99 of 1.37 s with the state on a disk before
    the journal (issue 14), against containerd's 2 s NRI budget."""
    probe = Path(state_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    ftype = filesystem_type(probe)
    if ftype is None or ftype in (TMPFS_MAGIC, RAMFS_MAGIC):
        return ""
    return (f"--state-dir {state_dir} is not on tmpfs (statfs f_type 0x{ftype:x}, tmpfs is 0x{TMPFS_MAGIC:08x}): "
            f"every ledger change waits for a disk fsync inside the runtime's CreateContainer budget; "
            f"use a tmpfs such as /run/fracplugin/state")


def remove_crash_leftovers(path: str | os.PathLike[str]) -> list[str]:
    """Remove what crashes leave next to the ledger file ``path`` (issue 13
    item 5), and return one message per action for the log:

    - ``.<name>.*``: temporary files of an atomic write (``_persist``:
      mkstemp, fsync, rename) that a kill -9 interrupted before the rename;
      ``.endpoints.*`` temps of the daemon's endpoints file likewise;
    - ``<name>.corrupt-<unix seconds>``: copies of corrupt ledgers moved aside
      by ``load``; the newest (largest suffix, then mtime) is kept for a post
      mortem, the others removed.

    Call it at start, after ``load`` and before anything writes the ledger
    (one daemon per node owns the directory). Never raises: a file that
    cannot be removed is reported in the returned messages.
    """
    p = Path(path)
    directory = p.parent
    msgs: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        return [f"state directory {directory} not listed for crash leftovers: {exc}"]
    temps = [n for n in names if n.startswith(f".{p.name}.") or n.startswith(".endpoints.")]
    corrupt = [n for n in names if n.startswith(f"{p.name}.corrupt-")]

    def rank(name: str) -> tuple[int, float]:
        suffix = name.rsplit("-", 1)[-1]
        try:
            mtime = (directory / name).stat().st_mtime
        except OSError:
            mtime = 0.0
        return (int(suffix) if suffix.isdigit() else -1, mtime)

    corrupt.sort(key=rank)
    if corrupt:
        msgs.append(f"kept the newest corrupt ledger copy {directory / corrupt[-1]}")
    for name in temps + corrupt[:-1]:
        target = directory / name
        try:
            if target.is_file() and not target.is_symlink():
                target.unlink()
                msgs.append(f"removed crash leftover {target}")
        except OSError as exc:
            msgs.append(f"cannot remove crash leftover {target}: {exc}")
    return msgs
