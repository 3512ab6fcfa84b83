"""GetPreferredAllocation's decision (docs/reference/kubelet-device-plugin.md
A.5): the device IDs to propose for one container, never a GPU at its tenant
limit or held whole, never an uneven split, and the compute modes the
pending candidates want.

``PreferredAllocation`` is a member of ``allocator.Allocator``, whose module
docstring describes the decisions.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .. import allocation as al
from ..model import ComputeMode, FractionError, Tenancy
from ..noderules import NodeRules
from ..rpcstatus import StatusCode
from . import podlookup
from .allocbase import Counters, Refusal
from .devices import DeviceTable, preferred_allocation


class PreferredAllocation:
    """GetPreferredAllocation.

    Args:
        rules: the node's rules (its GPUs, the ledger, the planner settings).
        table: the advertised devices.
        policy: ``pack`` | ``spread``.
        candidates: ``count -> pods`` that may be the next one admitted with
            ``count`` devices (``Allocator.candidates``); None without a pod source.
        counters: the door's counters (``preferred`` counts each call).
    """

    def __init__(self, rules: NodeRules, table: DeviceTable, policy: str,
                 candidates: Callable[[int], list[podlookup.Candidate]] | None, counters: Counters) -> None:
        self.rules = rules
        self.table = table
        self.policy = policy
        self._candidates = candidates
        self._counters = counters

    def devices(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Device IDs for one container (``devices.preferred_allocation``),
        never a GPU at its tenant limit, never an uneven split (issue 10 item 7).
        Raises Refusal for a negative size."""
        if size < 0:
            raise Refusal(StatusCode.INVALID_ARGUMENT, f"allocation_size {size} is negative", "invalid")
        modes = self._modes_for(size)
        full_of: Callable[[str], bool] = self._full
        if len(modes) > 1:
            # candidates differ in mode: a GPU with any tenant would refuse one
            # of them (issue 25 item 6); used only when nothing else fits
            full_of = lambda u: self._full(u) or bool(self._tenants_of(u))  # noqa: E731
        out = preferred_allocation(
            self.table, list(available), list(must_include), size, mode_of=self._mode_of,
            pod_mode=modes.pop() if len(modes) == 1 else None, policy=self.policy, free_mib_of=self._free_mib_of,
            full_of=full_of,
        )
        self._counters.bump("preferred")
        return out

    def _mode_of(self, uuid: str) -> ComputeMode | None:
        try:
            return self.rules.ledger.mode(uuid)
        except Exception:
            return None

    def _full(self, uuid: str) -> bool:
        tenants = self._tenants_of(uuid)
        return len(tenants) >= self.rules.config.max_clients_per_gpu or any(
            t.door in (al.DOOR_OTHER_PLUGIN, al.DOOR_SYNC) for t in tenants)

    def _free_mib_of(self, uuid: str) -> int | None:
        gpu = self.rules.node.gpu_by_uuid(uuid)
        try:
            return None if gpu is None else gpu.memory_mib - sum(t.charged_mib for t in self.rules.ledger.tenants(uuid))
        except Exception:
            return None

    def _tenants_of(self, uuid: str) -> list[Tenancy]:
        try:
            return self.rules.ledger.tenants(uuid)
        except Exception:
            return []

    def _modes_for(self, count: int) -> set[ComputeMode]:
        """The compute modes the pending candidates for ``count`` devices want."""
        if self._candidates is None:
            return set()
        modes: set[ComputeMode] = set()
        prefix = self.rules.config.annotation_prefix
        for c in self._candidates(count):
            annotations = (c.pod.get("metadata") or {}).get("annotations") or {}
            try:
                parsed = al.parse_for_kubelet(annotations, c.container, self.table.unit_mib * count, prefix=prefix)
            except FractionError:
                continue
            modes.add(parsed.compute_mode if parsed is not None else ComputeMode.TIME_SLICING)
        return modes
