"""What the NRI door's handler parts share: the state ``FracNriPlugin``
sets up (``_PluginState``: attribute types for the mixins), the constants
and the small helpers (``_env_map``, ``_pod_ref``, ``_FailOpen``).

Split out of ``nri/plugin.py`` (issue 26, ADR 0023), moved as it was: the
module docstring of ``nri/plugin.py`` describes the behaviour and the
concurrency model; ``FracNriPlugin`` is the one class to use.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Mapping

from .._proto import nri_pb2
from ..annotations import KEY_GPU_FRACTION, KEY_GPU_FRACTION_LIMIT, KEY_GPU_MEMORY, KEY_NUM_DEVICES
from ..ledger import Ledger
from ..model import ComputeMode, ContainerPlan, FractionError, NodeInfo, PodRef, Tenancy
from ..mps.api import MpsApi
from ..ports import HookMetrics
from ..planner import PlannerConfig
from ..noderules import NodeRules
from ..enforce.nri import NriMemoryLimits
from .nsqueue import KeyedWorkQueue


_DEFAULT_REQUEST_TIMEOUT_S = 2.0
_POD_LEVEL_KEYS = (KEY_GPU_FRACTION, KEY_GPU_MEMORY, KEY_GPU_FRACTION_LIMIT, KEY_NUM_DEVICES)
_MARGIN_S = 0.15
_MODES = tuple(ComputeMode)
_NS_WORKERS = 4
_ENSURE = "ensure"
_RELEASE = "release"
_DRAIN = "drain"

Owner = tuple[str, str]
"""An MPS namespace owner: (pod UID, container name) (``Tenancy.owner``)."""


def _env_map(container: nri_pb2.Container) -> dict[str, str]:
    env: dict[str, str] = {}
    for kv in container.env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def _pod_ref(pod: nri_pb2.PodSandbox) -> PodRef:
    return PodRef(pod.namespace, pod.name, pod.uid)


def _ns_settings(p: ContainerPlan) -> tuple[Any, ...]:
    """The settings of ``p``'s MPS namespace, what ``ensure_namespace`` is
    given: (compute mode, active thread percentage, pinned limit MiB)."""
    return (p.compute_mode, p.active_thread_percentage, p.limit_mib)


def _failed(fut: Future[Any]) -> bool:
    """``fut`` ended without a result (cancelled, or its job raised)."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)



class _FailOpen(Exception):
    pass


class _PluginState:
    """The attributes ``FracNriPlugin.__init__`` sets (see its docstring),
    declared once for the mixins that implement its handlers."""

    rules: NodeRules
    node: NodeInfo
    memory_limits: NriMemoryLimits | None
    cdi: Any
    on_refusal: Callable[[PodRef, str, FractionError], None] | None
    on_warning: Callable[[PodRef, str, str], None] | None
    pod_lookup: Callable[[str, str], Mapping[str, Any] | None] | None
    unit_mib: int
    resource_name: str
    _warned_pods: dict[str, None]
    ledger: Ledger
    config: PlannerConfig
    mps: MpsApi
    metrics: HookMetrics
    fail_open: bool
    namespace_timeout_s: float
    drain_timeout_s: float
    start_wait_s: float
    events: int
    _ns_lock: threading.Lock
    _ns_pending: dict[str, tuple[Owner, Future[Any]]]
    _ns_made: dict[Owner, tuple[tuple[Any, ...], Future[Any]] | None]
    _ns_early: dict[Owner, tuple[tuple[Any, ...], Future[Any] | None, str]]
    _early_counts: dict[str, int]
    _stopped_holds: dict[str, list[Tenancy]]
    _ns_queue: KeyedWorkQueue | None
    _made_sources: dict[str, None]
    _synced: threading.Event
    unadjusted: list[dict[str, Any]]
