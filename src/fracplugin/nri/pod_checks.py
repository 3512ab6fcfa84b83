"""Checks of the NRI door that read the whole pod (issue 25 items 1 and 3).

Kept out of ``plugin.py`` (the handlers) so the hot path there stays a few
calls: the pod's annotation lint (``annotation_lint``) once per pod and
container, and the refusal when the pod's spec is needed but the pod watch
does not know the pod yet.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from .._proto import nri_pb2
from ..annotation_lint import ignored_forms, unknown_keys
from ..model import PodRef
from .ttrpc import Code, RpcError

log = logging.getLogger(__name__)

_MAX_LINTED = 4096


Warn = Callable[..., None]
"""``warn(ref, container, message, fields, key=..., value=...)``: log ``nri
annotation not applied`` and hand a Warning Event on (``PodReader.warn``)."""


def lint_pod(done: dict[Any, None], warn: Warn, prefix: str, pod: nri_pb2.PodSandbox, ref: PodRef, container: str,
             apps: Sequence[str] | None, everyone: Sequence[str] | None, fields: Mapping[str, Any]) -> None:
    """Warn through ``warn`` about the pod's annotation keys fracplugin does
    not read (once per pod) and the forms it ignores for ``container`` (once
    per pod and container). ``done``, the caller's memory of what was
    reported (pod UIDs and (pod UID, container) pairs), keeps at most 4096
    entries, the oldest dropped first."""
    annotations = pod.annotations
    if not annotations:
        return
    found = []
    if pod.uid not in done:
        done[pod.uid] = None
        found += unknown_keys(dict(annotations), prefix, everyone)
    if (pod.uid, container) not in done:
        done[(pod.uid, container)] = None
        found += ignored_forms(dict(annotations), prefix, container, apps)
    while len(done) > _MAX_LINTED:
        done.pop(next(iter(done)))
    for x in found:
        warn(ref, container, x.message, fields, key=x.key, value=x.value)


def spec_unknown(pod: nri_pb2.PodSandbox, *, pod_ready: Callable[[], bool] | None, fail_open: bool) -> None:
    """The pod carries forms whose target depends on its spec (pod-level KAI
    forms: the first or named app container) and the pod watch does not know
    the pod (yet): raise ``RpcError`` UNAVAILABLE (the runtime fails the
    creation, kubelet retries; the watch has it by then) rather than fence a
    sidecar. With ``fail_open``, or while the watch itself is not synced (the
    API server is unreachable: as without API access), the container is
    planned alone (logged; ``/readyz`` says the watch is not synced).
    ``pod_ready``: whether the pod watch is synced (None: taken as synced)."""
    what = f"{pod.namespace}/{pod.name}"
    if pod_ready is not None and not pod_ready():
        log.warning("nri pod watch not synced; pod-level forms read for this container alone",
                    extra={"pod": what, "pod_uid": pod.uid})
        return
    if fail_open:
        log.warning("nri pod spec not known; pod-level forms read for this container alone (fail-open)",
                    extra={"pod": what, "pod_uid": pod.uid})
        return
    raise RpcError(Code.UNAVAILABLE,
                   f"fracplugin: pod {what} carries pod-level GPU fraction annotations (they apply to the first or "
                   "named app container) and the pod watch does not know its spec yet; retried")
