"""Who holds what on each GPU, with the node-side guards and atomic persistence.

Concurrency: one ``threading.RLock`` guards all state; every public method is
safe to call from any thread (NRI handlers, gRPC workers, metrics scrapes).
Subscribers are called after the lock is released.

Invariants (checked by ``check_invariants`` and by property tests):

- one compute mode per GPU at a time;
- per GPU, the sum of request MiB held <= the GPU's memory;
- per GPU, at most ``max_clients_per_gpu`` tenants (MPS client limit, 48 on
  Volta and later: docs/reference/kubelet-device-plugin.md B.4);
- an owner (pod uid, container) appears at most once per GPU.

Persistence (ADR 0010, which gives the file formats and the recovery rules): a
snapshot ``<path>`` plus an append-only journal ``<path>.journal``
(``ledgerstore.LedgerStore``), so a change costs O(1) in the node's tenancies;
each change is appended and fdatasynced before it is acknowledged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .allocation import DOOR_ALLOCATE, DOOR_NRI, DOOR_OTHER_PLUGIN, DOOR_SYNC, to_tenancies
from .model import ComputeMode, ContainerPlan, FractionError, GpuInfo, NodeInfo, Tenancy
from .ledgerindex import LedgerIndex, invariant_problems
from .ledgerstore import LedgerStore
from .logs import guarded

log = logging.getLogger(__name__)

DEFAULT_MAX_CLIENTS_PER_GPU = 48
_WHOLE_DOORS = (DOOR_OTHER_PLUGIN, DOOR_SYNC)


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
    (docs/user-guide.md, "What each door decides when both are on"; never ``//``)."""
    if t.bound:
        return f"{t.namespace}/{t.pod_name}/{t.container}"
    return f"reservation {t.reservation} (holder not known yet)"


def admission_problem(
    gpu: GpuInfo,
    tenants: Iterable[Tenancy],
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
    # One pass, no per-tenant function calls and no list: this runs twice per
    # admission (planner, ledger) over up to max_clients tenants (issue 14 profile).
    uid, name = owner
    held = others = 0
    whole: Tenancy | None = None
    other_mode: Tenancy | None = None
    for t in tenants:
        if (reservation and t.reservation == reservation) or (uid and t.pod_uid == uid and t.container == name):
            continue
        others += 1
        held += t.charged_mib
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
    if others >= max_clients:
        return Problem(f"GPU {gpu.index} ({gpu.uuid}) already has {others} tenants",
                       f"the MPS client limit is {max_clients} per GPU")
    return None


def keep_charge(new: Iterable[Tenancy], old: Iterable[Tenancy]) -> list[Tenancy]:
    """``new`` with ``held_mib`` set where the replaced entries ``old`` of
    the same reservation (unbound, or of the same pod) were charged more on
    that GPU: kubelet counts a pod's devices as its own until the pod ends,
    so a union hold (an init container's devices reused, charged
    ``allocation.charge_mib`` of the union) stays charged while a smaller
    container of the pod holds it (ADR 0033 decision 3). The container's own
    request and limit are unchanged. ``Ledger.admit`` and the NRI
    Synchronize's rebuild (``nri/reconcile.py``) apply it."""
    charge: dict[tuple[str, str], list[Tenancy]] = {}
    for o in old:
        if o.reservation:
            charge.setdefault((o.reservation, o.gpu_uuid), []).append(o)
    out = []
    for t in new:
        mib = max((o.charged_mib for o in charge.get((t.reservation, t.gpu_uuid), ())
                   if not o.bound or o.pod_uid == t.pod_uid), default=0)
        out.append(t.charged_at_least(mib))
    return out


class Ledger:
    """Per-GPU tenancy of this node.

    Args:
        node: the node's GPUs (memory sizes bound the guards).
        path: the JSON snapshot to persist to (its journal is ``<path>.journal``);
            None keeps the ledger in memory.
        max_clients_per_gpu: tenants allowed per GPU.
        read_only: read ``path`` but never write or move it (``fracplugin explain --ledger``).

    Costs: an admission or release touches only the GPUs and the hold
    concerned (per-GPU, per-owner, per-reservation and per-container-id
    indexes) and appends one journal line: O(1) in the node's tenancies
    (issue 14, ``nri.create.service_growth_1_to_768_tenancies``).

    Parts (issue 33 item 3): ``_index`` (``ledgerindex.LedgerIndex``: the
    entries and their indexes) and ``_store`` (``ledgerstore.LedgerStore``:
    snapshot + journal), both called under the ledger's one lock.
    """

    def __init__(self, node: NodeInfo, path: str | os.PathLike[str] | None = None,
                 max_clients_per_gpu: int = DEFAULT_MAX_CLIENTS_PER_GPU, *, read_only: bool = False) -> None:
        self._node = node
        self._gpus = {g.uuid: g for g in node.gpus}
        self._max_clients = max_clients_per_gpu
        self._lock = threading.RLock()
        self._index = LedgerIndex()
        self._store = LedgerStore(node.name, path, read_only=read_only)
        self._subscribers: list[Callable[[], None]] = []

    @property
    def node(self) -> NodeInfo:
        return self._node

    @property
    def path(self) -> Path | None:
        """The snapshot file (None in memory); its journal is ``<path>.journal``."""
        return self._store.path

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every change (outside the lock)."""
        with self._lock:  # a new list: _notify reads the current one without the lock
            self._subscribers = [*self._subscribers, callback]

    # ---- persistence -------------------------------------------------------
    def load(self) -> list[str]:
        """Read the snapshot and replay its journal (``LedgerStore.load``:
        a corrupt file is moved aside and the ledger starts empty); returns
        warnings for the operator. Records on GPUs this node does not have
        are dropped with a warning; guard breaks are reported, not refused."""
        with self._lock:
            loaded, warnings = self._store.load()
            if loaded is None:
                return warnings
            kept = []
            for t in loaded:
                if t.gpu_uuid not in self._gpus:
                    warnings.append(f"ledger record for {t.namespace}/{t.pod_name}/{t.container} names GPU "
                                    f"{t.gpu_uuid}, which this node does not have; dropped")
                    continue
                kept.append(t)
            self._index.set_all(kept)
            warnings.extend(f"ledger file breaks a guard: {problem}" for problem in self.check_invariants())
        for w in warnings:
            log.warning(w)
        self._notify()
        return warnings

    def close(self) -> None:
        """Compact the journal into the snapshot (a clean stop leaves one
        file) and close it. Errors are logged, never raised."""
        with self._lock:
            self._store.close(self._index.entries)

    # ---- changing ----------------------------------------------------------
    def admit(self, plan: ContainerPlan, container_id: str = "", *, door: str = DOOR_NRI,
              reservation: str = "", bound: bool = True) -> list[Tenancy]:
        """Record ``plan`` (``allocation.to_tenancies``): one Tenancy per
        assigned GPU, replacing the hold's earlier entries (same owner, or the
        same ``reservation`` key); a reservation keeps what its earlier
        entries of the same pod (or of no pod yet) were charged on each GPU
        (``keep_charge``). ``bound=False`` records a kubelet
        reservation whose holder is not known yet. Atomic: either every GPU is
        admitted or none.

        Raises:
            FractionError: a guard fails (code ``guard``) or a GPU is unknown;
                the ledger is unchanged then.
            OSError: the file could not be written (the ledger is unchanged).
        """
        owner = (plan.pod.uid, plan.container) if bound else ("", "")
        with self._lock:
            old = self._index.held_by(owner, reservation)
            new = keep_charge(to_tenancies(plan, container_id, door=door, reservation=reservation, bound=bound), old)
            for t in new:
                gpu = self._gpus.get(t.gpu_uuid)
                if gpu is None:
                    raise FractionError("node", t.gpu_uuid, f"is not a GPU of node {self._node.name}", "device")
                problem = admission_problem(
                    gpu, self._index.by_gpu.get(gpu.uuid, ()), owner,
                    t.mode, t.charged_mib, self._max_clients, reservation,
                )
                if problem:
                    raise FractionError("node", str(plan.pod) + "/" + plan.container, str(problem), "guard")
            self._change(old, new)
        self._notify()
        return new

    def release(self, pod_uid: str, container: str) -> list[Tenancy]:
        """Drop one container's tenancies; returns what was dropped."""
        return self._drop(lambda: self._index.by_owner.get((pod_uid, container), ()))

    def release_container_id(self, container_id: str) -> list[Tenancy]:
        """Drop the tenancies recorded under a runtime container id."""
        return self._drop(lambda: self._index.by_container_id.get(container_id, ())) if container_id else []

    def release_reservation(self, key: str) -> list[Tenancy]:
        """Drop one kubelet reservation (kubelet freed its devices)."""
        return self._drop(lambda: self._index.by_reservation.get(key, ())) if key else []

    def release_stopped(self, container_id: str) -> list[Tenancy]:
        """A container stopped: drop what it holds through the NRI door, and
        unbind it from a kubelet reservation (the reservation stays held for
        its pod until kubelet frees the devices: the pod ends, or the devices
        are allocated again). Returns the dropped tenancies."""
        if not container_id:
            return []
        with self._lock:
            mine = list(self._index.by_container_id.get(container_id, ()))
            if not mine:
                return []
            gone = [t for t in mine if t.door != DOOR_ALLOCATE]
            unbound = [dataclasses.replace(t, container_id="") for t in mine if t.door == DOOR_ALLOCATE]
            self._change(mine, unbound)
        self._notify()
        return gone

    def transform(self, fn: Callable[[list[Tenancy]], Iterable[Tenancy]]) -> None:
        """Replace the state with ``fn(current entries)`` atomically (under the
        lock, so a concurrent admission is never lost), with ``replace_all``'s
        rules (unknown GPUs dropped, guard breaks logged, never refused)."""
        with self._lock:
            kept: list[Tenancy] = []
            seen: set[tuple[str, str, str]] = set()
            for t in fn(list(self._index.entries)):
                if t.gpu_uuid not in self._gpus:
                    log.warning("ledger: dropping tenancy on unknown GPU",
                                extra={"gpu_uuid": t.gpu_uuid, "pod_uid": t.pod_uid})
                    continue
                key = (*t.hold, t.gpu_uuid)
                if key in seen:
                    continue
                seen.add(key)
                kept.append(t)
            before = list(self._index.entries)
            self._index.set_all(kept)
            try:
                self._store.compact(self._index.entries)  # a whole new state: one snapshot, not a journal of it
            except OSError:
                self._index.set_all(before)
                raise
            for problem in self.check_invariants():
                log.warning("ledger: running containers break a guard: %s", problem)
        self._notify()

    def replace_all(self, tenancies: Iterable[Tenancy]) -> None:
        """Replace the whole state (rebuild after a runtime Synchronize).

        Records what is there without refusing: entries on unknown GPUs are
        dropped with a warning; guard violations are logged, since the
        containers already run.
        """
        items = list(tenancies)
        self.transform(lambda _cur: items)

    def _drop(self, pick: Callable[[], Iterable[Tenancy]]) -> list[Tenancy]:
        """Drop the entries ``pick()`` names (called under the lock),
        persisted, and notify the watchers when something went."""
        with self._lock:
            gone = list(pick())
            if gone:
                self._change(gone, [])
        if gone:
            self._notify()
        return gone

    def _change(self, removed: Sequence[Tenancy], added: Sequence[Tenancy]) -> None:
        """Apply one change in memory and persist it; on OSError memory is
        rolled back and the error raised (the caller holds the lock)."""
        self._index.apply(removed, added)
        try:
            self._store.persist(removed, added, self._index.entries)
        except OSError:
            self._index.apply(added, removed)
            raise

    def _notify(self) -> None:
        for cb in self._subscribers:
            guarded(log, "ledger subscriber", cb)

    # ---- reading -----------------------------------------------------------
    def tenancies(self) -> list[Tenancy]:
        """All tenancies, in admission order."""
        with self._lock:
            return list(self._index.entries)

    def tenants(self, gpu_uuid: str) -> list[Tenancy]:
        """Tenancies on one GPU (O(tenants of that GPU))."""
        with self._lock:
            return list(self._index.by_gpu.get(gpu_uuid, ()))

    def mode(self, gpu_uuid: str) -> ComputeMode | None:
        """The compute mode of a GPU's tenants, None when it has none."""
        tenants = self.tenants(gpu_uuid)
        return tenants[0].mode if tenants else None

    def find(self, pod_uid: str, container: str) -> list[Tenancy]:
        """The tenancies of one container (one per GPU)."""
        with self._lock:
            return list(self._index.by_owner.get((pod_uid, container), ()))

    def find_container_id(self, container_id: str) -> list[Tenancy]:
        """The tenancies recorded under a runtime container id."""
        if not container_id:
            return []
        with self._lock:
            return list(self._index.by_container_id.get(container_id, ()))

    def reservation(self, key: str) -> list[Tenancy]:
        """The tenancies of one kubelet reservation (one per GPU; empty when none)."""
        if not key:
            return []
        with self._lock:
            return list(self._index.by_reservation.get(key, ()))

    def reservations(self) -> dict[str, list[Tenancy]]:
        """Every reservation of the ``allocate`` door: key -> its tenancies."""
        with self._lock:
            return self._index.reservations()

    def check_invariants(self) -> list[str]:
        """Every broken invariant, as a sentence (empty when all hold)."""
        with self._lock:
            entries = list(self._index.entries)
        return invariant_problems(entries, self._node, self._max_clients)
