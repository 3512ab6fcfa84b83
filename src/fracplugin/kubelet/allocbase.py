"""What the device plugin door's decision parts share: the answer types
(``Refusal``, ``Answer``, ``Counters``) and the state ``Allocator`` sets up
(``_AllocatorState``: attribute types for its mixins).

Split out of ``kubelet/allocator.py`` (issue 26, ADR 0023), moved as it was:
the module docstring of ``kubelet/allocator.py`` describes the decisions;
``Allocator`` is the one class to use. Like it, this module loads no gRPC
library.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .. import allocation as al
from .. import planner as planner_mod
from ..ledger import Ledger
from ..noderules import NodeRules
from ..model import FractionRequest, Mount, NodeInfo
from ..rpcstatus import StatusCode
from . import podlookup
from .devices import DeviceTable


class Refusal(Exception):
    """An Allocate / GetPreferredAllocation answered with a gRPC error.

    ``code`` is the gRPC status kubelet gets (``rpcstatus.StatusCode``: our own
    type, the canonical gRPC numbers, so this module loads no gRPC library),
    ``message`` the text kubelet shows as the pod's admission error, ``label``
    the metrics reason."""

    def __init__(self, code: StatusCode, message: str, label: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.label = label


@dataclass(frozen=True)
class Answer:
    """What Allocate answers: env, mounts, the GPUs (ordinal order), the
    reservation key and ``kind`` (``planned``, ``reserved`` = a recorded
    reservation answered again, or ``fallback``)."""

    env: Mapping[str, str]
    mounts: tuple[Mount, ...]
    uuids: tuple[str, ...]
    key: str
    kind: str


@dataclass
class Counters:
    """What the door did since start (``/status`` ``device_plugin``): Allocates
    answered, of which planned / reserved (a recorded reservation answered
    again) / fallbacks, refusals, GetPreferredAllocation calls, and the last
    fallback and refusal reasons."""

    allocations: int = 0
    planned: int = 0
    reserved: int = 0
    fallbacks: int = 0
    refusals: int = 0
    preferred: int = 0
    last_fallback: str = ""
    last_refusal: str = ""


class _AllocatorState:
    """The attributes ``Allocator.__init__`` sets (see its docstring),
    declared once for the mixins that implement its parts, and the methods
    of ``Allocator`` they call (declared for the type checker only)."""

    rules: NodeRules
    node: NodeInfo
    ledger: Ledger
    planner_config: planner_mod.PlannerConfig
    table: DeviceTable
    unit_mib: int
    resource_name: str
    pod_source: podlookup.PodSource | None
    allocate_deadline_s: float
    unhealthy: Callable[[], Mapping[str, Sequence[str]]]
    policy: str
    recent_deleted_s: float
    podresources_grace_s: float
    counters: Counters
    _count_lock: threading.Lock
    _lock: threading.Lock
    _served: set[tuple[str, str]]
    _hints: dict[str, set[str]]
    _made: dict[str, float]
    _deleted: list[tuple[float, Mapping[str, Any]]]
    _gone_keys: dict[str, str]
    _gone_lock: threading.Lock

    if TYPE_CHECKING:  # Allocator's own
        def _bump(self, counter: str, **last: str) -> None: ...
        def _forget(self, key: str) -> None: ...
        def _candidates(self, count: int) -> list[podlookup.Candidate]: ...
        def request_for(self, cand: podlookup.Candidate, uuids: Sequence[str], request_mib: int,
                        count: int) -> tuple[FractionRequest, list[al.Ignored]]: ...
