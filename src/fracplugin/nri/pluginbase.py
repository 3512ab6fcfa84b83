"""What the NRI door's parts share: their settings (``DoorSettings``, one
object ``FracNriPlugin`` hands each part, so a reload of ``fail_open`` reaches
all of them), the constants and the small helpers (``_env_map``,
``_pod_ref``, ``mps_timeout``, ``_FailOpen``).

The module docstring of ``nri/plugin.py`` describes the behaviour and the
concurrency model; ``FracNriPlugin`` is the one class to use, its parts are
objects it holds.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

from .._proto import nri_pb2
from ..annotations import KEY_CONTAINER_NAME, KEY_GPU_FRACTION, KEY_GPU_FRACTION_LIMIT, KEY_GPU_MEMORY, KEY_NUM_DEVICES
from ..model import ComputeMode, ContainerPlan, PodRef
from .interfaces import CallContext


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
    """The container's ``K=V`` env as a dict (the last of a name wins)."""
    return dict(kv.partition("=")[::2] for kv in container.env)


def needs_spec(annotations: Any, container: str) -> bool:
    """Whether the pod's spec decides if ``container`` is the target of its
    pod-level KAI forms (unnamed, or naming another container; issue 25)."""
    named = annotations.get(KEY_CONTAINER_NAME)
    return (named is None and any(k in annotations for k in _POD_LEVEL_KEYS)) or (
        named is not None and named != container)


def _pod_ref(pod: nri_pb2.PodSandbox) -> PodRef:
    return PodRef(pod.namespace, pod.name, pod.uid)


def _ns_settings(p: ContainerPlan) -> tuple[Any, ...]:
    """The settings of ``p``'s MPS namespace, what ``ensure_namespace`` is
    given: (compute mode, active thread percentage, pinned limit MiB)."""
    return (p.compute_mode, p.active_thread_percentage, p.limit_mib)


def mps_timeout(ctx: CallContext | None, share: float) -> float:
    """Seconds an MPS call may take: ``share`` of the request timeout,
    never past the handler's budget (minus a margin)."""
    if ctx is None:
        return _DEFAULT_REQUEST_TIMEOUT_S * share
    return max(0.05, min(ctx.request_timeout_s * share, ctx.remaining() - _MARGIN_S))


def _failed(fut: Future[Any]) -> bool:
    """``fut`` ended without a result (cancelled, or its job raised)."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


class _FailOpen(Exception):
    pass


@dataclasses.dataclass
class DoorSettings:
    """The NRI door's settings, one object its parts share
    (``FracNriPlugin``'s arguments of the same names). ``fail_open`` is
    reloaded (``parts.NriDoor``) by setting it here."""

    fail_open: bool = False
    namespace_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0
    start_wait_s: float = 1.0
