"""The ledger's in-memory indexes and its read side: every tenancy, by GPU,
by owner, by reservation and by container id, and the invariants check.

Split out of ``ledger.py`` (issue 26, ADR 0023), moved as it was; the module
docstring of ``ledger.py`` gives the invariants and the concurrency model
(``Ledger`` is the one class to use).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

from .allocation import DOOR_ALLOCATE
from .model import ComputeMode, NodeInfo, Tenancy


class _LedgerIndex:
    """Indexes and reads of ``Ledger`` (a mixin: ``Ledger.__init__`` sets
    these attributes)."""

    _lock: threading.RLock
    _node: NodeInfo
    _path: Path | None
    _journal_path: Path | None
    _max_clients: int
    _entries: dict[Tenancy, None]
    _by_gpu: dict[str, dict[Tenancy, None]]
    _by_owner: dict[tuple[str, str], dict[Tenancy, None]]
    _by_reservation: dict[str, dict[Tenancy, None]]
    _by_container_id: dict[str, dict[Tenancy, None]]

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
