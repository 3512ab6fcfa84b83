"""Typed ports that a door needs of another part and that sit below every
part: ``HookMetrics`` (what the doors report per call) with its null object
``NoMetrics``, and ``Clock``; they depend on nothing of fracplugin (ADR 0023:
no import circle through ``parts.py``). The other ports are ``mps.api.MpsApi``, ``gpu.inventory.Inventory``,
``kubelet.podlookup.PodSource`` and ``ledger.Ledger``.
"""

from __future__ import annotations

from typing import Callable, Protocol

Clock = Callable[[], float]
"""Monotonic seconds (``time.monotonic``); injectable where a part measures time."""


class HookMetrics(Protocol):
    """What the doors report per call: ``observe_hook(door, seconds)`` (door
    ``nri``, ``allocate``, ``preferred``) and ``refusal(reason_code)``
    (``fracplugin.metrics.Metrics`` implements it; ``NoMetrics`` is the null object)."""

    def observe_hook(self, door: str, seconds: float) -> None: ...

    def refusal(self, reason_code: str) -> None: ...


class NoMetrics:
    """The no-op ``HookMetrics``."""

    def observe_hook(self, door: str, seconds: float) -> None:
        return None

    def refusal(self, reason_code: str) -> None:
        return None

