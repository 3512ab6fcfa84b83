"""Checks of the NRI door that read the whole pod (issue 25 items 1 and 3).

Kept out of ``plugin.py`` (the handlers) so the hot path there stays a few
calls: the pod's annotation lint (``annotation_lint``) once per pod and
container, and the refusal when the pod's spec is needed but the pod watch
does not know the pod yet.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from ..annotation_lint import ignored_forms, unknown_keys
from ..model import PodRef
from .ttrpc import Code, RpcError

log = logging.getLogger(__name__)

_MAX_LINTED = 4096


def lint_pod(plugin: Any, pod: Any, ref: PodRef, container: str, apps: Sequence[str] | None,
             everyone: Sequence[str] | None, fields: Mapping[str, Any]) -> None:
    """Warn through ``plugin._warn`` (log ``nri annotation not applied`` and a
    Warning Event) about the pod's annotation keys fracplugin does not read
    (once per pod) and the forms it ignores for ``container`` (once per pod
    and container). ``plugin._linted`` (a dict made here) remembers what was
    reported, the oldest of 4096 entries dropped first."""
    done: dict[Any, None] | None = getattr(plugin, "_linted", None)
    if done is None:
        done = plugin._linted = {}
    annotations = pod.annotations
    if not annotations:
        return
    prefix = plugin.config.annotation_prefix
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
        plugin._warn(ref, container, x.message, fields, key=x.key, value=x.value)


def spec_unknown(plugin: Any, pod: Any) -> None:
    """The pod carries forms whose target depends on its spec (pod-level KAI
    forms: the first or named app container) and the pod watch does not know
    the pod (yet): raise ``RpcError`` UNAVAILABLE (the runtime fails the
    creation, kubelet retries; the watch has it by then) rather than fence a
    sidecar. With ``fail_open``, or while the watch itself is not synced (the
    API server is unreachable: as without API access), the container is
    planned alone (logged; ``/readyz`` says the watch is not synced)."""
    what = f"{pod.namespace}/{pod.name}"
    source = getattr(plugin.pod_lookup, "__self__", None)  # the pod source whose ``get`` is the lookup
    ready = getattr(source, "ready", None)
    if callable(ready) and not ready():
        # the watch itself is not synced (API server unreachable): as without
        # API access, the container is planned alone; /readyz says so
        log.warning("nri pod watch not synced; pod-level forms read for this container alone",
                    extra={"pod": what, "pod_uid": pod.uid})
        return
    if plugin.fail_open:
        log.warning("nri pod spec not known; pod-level forms read for this container alone (fail-open)",
                    extra={"pod": what, "pod_uid": pod.uid})
        return
    raise RpcError(Code.UNAVAILABLE,
                   f"fracplugin: pod {what} carries pod-level GPU fraction annotations (they apply to the first or "
                   "named app container) and the pod watch does not know its spec yet; retried")
