"""The ledger's in-memory indexes: every tenancy, by GPU, by owner, by
reservation and by container id (insertion-ordered sets: dict keys), the
reservations of the ``allocate`` door, and the invariants check
(``invariant_problems``).

A ``LedgerIndex`` is a member of ``Ledger`` (issue 33 item 3: composition,
not a mixin); it takes no lock: the ledger calls it under its own. The
module docstring of ``ledger.py`` gives the invariants and the concurrency
model (``Ledger`` is the one class to use).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from .allocation import DOOR_ALLOCATE
from .model import NodeInfo, Tenancy


class LedgerIndex:
    """Every tenancy and its indexes. ``entries`` and the ``by_*`` maps are
    read by the ledger (under its lock); only ``set_all`` and ``apply``
    change them."""

    def __init__(self) -> None:
        self.entries: dict[Tenancy, None] = {}
        self.by_gpu: dict[str, dict[Tenancy, None]] = {}
        self.by_owner: dict[tuple[str, str], dict[Tenancy, None]] = {}
        self.by_reservation: dict[str, dict[Tenancy, None]] = {}
        self.by_container_id: dict[str, dict[Tenancy, None]] = {}

    def _add(self, t: Tenancy) -> None:
        self.entries[t] = None
        self.by_gpu.setdefault(t.gpu_uuid, {})[t] = None
        if t.pod_uid:
            self.by_owner.setdefault(t.owner, {})[t] = None
        if t.reservation:
            self.by_reservation.setdefault(t.reservation, {})[t] = None
        if t.container_id:
            self.by_container_id.setdefault(t.container_id, {})[t] = None

    def _discard(self, t: Tenancy) -> None:
        del self.entries[t]
        indexes: tuple[tuple[dict[Any, dict[Tenancy, None]], Any], ...] = (
            (self.by_gpu, t.gpu_uuid), (self.by_owner, t.owner),
            (self.by_reservation, t.reservation), (self.by_container_id, t.container_id))
        for index, key in indexes:
            bucket = index.get(key)
            if bucket is not None:
                bucket.pop(t, None)
                if not bucket:
                    del index[key]

    def set_all(self, items: Iterable[Tenancy]) -> None:
        """Replace every entry with ``items`` (in their order)."""
        self.entries, self.by_gpu, self.by_owner = {}, {}, {}
        self.by_reservation, self.by_container_id = {}, {}
        for t in items:
            self._add(t)

    def apply(self, removed: Sequence[Tenancy], added: Sequence[Tenancy]) -> None:
        """One change: ``removed`` go, ``added`` come (last)."""
        for t in removed:
            self._discard(t)
        for t in added:
            self._add(t)

    def held_by(self, owner: tuple[str, str], reservation: str) -> list[Tenancy]:
        """The hold's current entries (``ledger.same_hold``), via the indexes."""
        out: dict[Tenancy, None] = {}
        if reservation:
            out.update(self.by_reservation.get(reservation, {}))
        if owner[0]:
            out.update(self.by_owner.get(owner, {}))
        return list(out)

    def reservations(self) -> dict[str, list[Tenancy]]:
        """Every reservation of the ``allocate`` door: key -> its tenancies."""
        out: dict[str, list[Tenancy]] = {}
        for key, bucket in self.by_reservation.items():
            mine = [t for t in bucket if t.door == DOOR_ALLOCATE]
            if mine:
                out[key] = mine
        return out


def invariant_problems(entries: Sequence[Tenancy], node: NodeInfo, max_clients: int) -> list[str]:
    """Every invariant ``entries`` break on ``node``, as a sentence (empty
    when all hold). Pure: the ledger copies its entries under its lock and
    calls this outside it."""
    problems = []
    for gpu in node.gpus:
        on = [t for t in entries if t.gpu_uuid == gpu.uuid]
        if len({t.mode for t in on}) > 1:
            problems.append(f"GPU {gpu.uuid} has tenants of more than one compute mode")
        held = sum(t.charged_mib for t in on)
        if held > gpu.memory_mib:
            problems.append(f"GPU {gpu.uuid} holds {held} MiB of {gpu.memory_mib} MiB")
        if len(on) > max_clients:
            problems.append(f"GPU {gpu.uuid} has {len(on)} tenants, limit {max_clients}")
        owners = [t.hold for t in on]
        if len(owners) != len(set(owners)):
            problems.append(f"GPU {gpu.uuid} lists one container twice")
    return problems
