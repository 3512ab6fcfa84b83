"""The NRI door's early MPS namespaces (ADR 0030): a pod's namespaces are
queued at RunPodSandbox, seconds of image pull before its CreateContainer,
so that StartContainer (which containerd serves under its NRI lock) finds
them made instead of waiting for two control commands per pod (issue 28).

Behaviour (the mask has RUN_POD_SANDBOX and REMOVE_POD_SANDBOX: 0x62d,
docs/reference/nri-protocol.md 1.4; a v0.8 runtime delivers both as
StateChange, 1.7):

- RunPodSandbox: each container the pod's per-container memory keys name
  (``annotations.annotated_containers``) is planned as CreateContainer would
  plan it (``NodeRules.replan``) against an empty ledger: the GPU
  placement does not matter for the namespace, only its settings (compute
  mode, active thread percentage, pinned limit), which come from the
  annotations and the GPUs' size. Each plan with an MPS namespace (every
  mode with MPS v3, as at CreateContainer) queues one ensure of its owner (pod UID, container name) on the
  keyed MPS work queue, tagged with those settings. Not for a pod with
  pod-level KAI memory forms or ``gpu-fraction-container-name`` (which
  container they apply to needs the pod's spec), nor, with
  ``gpu-fraction-num-devices``, for a container that names no devices (the
  count would decide how many GPUs it gets), nor while the mode's daemon is down
  (CreateContainer refuses then), nor for an owner whose namespace an
  ensure already made with the same settings. A container that kubelet
  binds to a device-plugin reservation is only known at CreateContainer: its
  plan there may differ, and then takes the mismatch path below. Nothing
  here fails the sandbox: RunPodSandbox carries no adjustment, and
  containerd fails the pod on a plugin's error, so a bad annotation or any
  other error is logged (DEBUG for a refused annotation: CreateContainer
  refuses it, with the Event, as before) and the refusal stays
  CreateContainer's.
- CreateContainer (``_Namespaces._start_namespace``): an early ensure of the
  owner with the same settings that has not failed is what StartContainer
  awaits: no second ensure is queued (Create and Start then issue no MPS
  command). Different settings, or a failed or cancelled early ensure:
  today's path (a new ensure of the owner; a still-queued early one is
  replaced, MPS re-sets the caps of an existing namespace). Either way the
  owner then leaves the early table: a container holds it, and its
  RemoveContainer releases the namespace as before.
- RemovePodSandbox: the early namespaces of the sandbox's owners that no
  container ever held are released (a queued ensure that never started is
  dropped, nothing to release). An entry is the latest sandbox's: when
  kubelet recreates a dead sandbox (same pod UID, new sandbox id) the new
  RunPodSandbox claims the entry, and the old sandbox's removal leaves it.
- Synchronize: early namespaces of sandboxes the runtime no longer reports
  are released the same way (a RemovePodSandbox missed while disconnected).
  The table itself is lost when the doors restart: ``nri/orphans.py`` then
  rebuilds it from what the MPS layer holds for live pods, and releases
  what it holds for pods gone.

The table is bounded (``EARLY_MAX`` owners, ``EARLY_PER_POD`` per pod; past
them a container gets no early namespace, and CreateContainer does the work
as before; the first bound is logged).

Concurrency model: as ``nri/plugin.py``; the early table is under
``_ns_lock``. RunPodSandbox and RemovePodSandbox never wait (a plan, a
dict update and a queue put): the stub serves them on its reader thread.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterable, Sequence

from .._proto import nri_pb2
from ..annotations import (KEY_CONTAINER_NAME, KEY_NUM_DEVICES, SUFFIX_DEVICES, annotated_containers, container_key,
                           parse)
from ..model import ContainerPlan, FractionError
from .interfaces import CallContext
from .pluginbase import _ENSURE, _POD_LEVEL_KEYS, _ns_settings, _pod_ref
from .release import _Release

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log

EARLY_MAX = 4096
"""Most owners with an early namespace not yet held by a container."""

EARLY_PER_POD = 16
"""Most containers of one pod that get an early namespace (the first, by
name): a pod's annotations may name containers it does not have, whose
namespaces are made for nothing until RemovePodSandbox; the rest wait for
their CreateContainer as before."""


class _Early(_Release):
    """RunPodSandbox and RemovePodSandbox (a mixin of ``FracNriPlugin``; the
    module docstring says what they do)."""

    def run_pod_sandbox(self, pod: nri_pb2.PodSandbox, ctx: CallContext | None = None) -> None:
        """RunPodSandbox: queue the pod's early namespace ensures (module
        docstring). Never raises: errors are logged, the sandbox goes on."""
        try:
            self._queue_early(pod, self._early_plans(pod))
        except Exception:
            log.exception("nri RunPodSandbox: early MPS namespaces not queued",
                          extra={"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid})
        return None

    def _early_plans(self, pod: nri_pb2.PodSandbox) -> list[ContainerPlan]:
        """The plans, against an empty ledger, of the containers the pod's
        per-container keys name that get an MPS namespace (none for a pod
        whose forms need its spec). A refused annotation is skipped (DEBUG)."""
        ann = pod.annotations
        if KEY_CONTAINER_NAME in ann or any(k in ann for k in _POD_LEVEL_KEYS if k != KEY_NUM_DEVICES):
            return []
        prefix = self.config.annotation_prefix
        names = annotated_containers(ann, prefix)
        if KEY_NUM_DEVICES in ann:
            # the count applies to one container the spec names; it changes nothing (or refuses) where the
            # container names its devices, else it decides how many GPUs the node places: not known here
            names = [n for n in names if ann.get(container_key(prefix, n, SUFFIX_DEVICES), "").strip()]
        if not names:
            return []
        annotations, ref, plans = dict(ann), _pod_ref(pod), []
        for name in names[:EARLY_PER_POD]:
            try:
                req = parse(annotations, name, prefix=prefix)
                p = self.rules.replan(req, ref) if req is not None else None
            except FractionError as err:
                log.debug("nri RunPodSandbox: container refused; CreateContainer will say so",
                          extra={"pod": str(ref), "container": name, "key": err.key, "rule": err.reason})
                continue
            if p is not None and p.mps.namespace is not None and self._mps_up(p.compute_mode):
                plans.append(p)
        return plans

    def _queue_early(self, pod: nri_pb2.PodSandbox, plans: Sequence[ContainerPlan]) -> None:
        """One ensure per owner of ``plans`` (module docstring)."""
        for p in plans:
            owner = (p.pod.uid, p.container)
            settings = _ns_settings(p)
            fields = {"pod": str(p.pod), "pod_uid": p.pod.uid, "container": p.container, "early": True}
            with self._ns_lock:
                made = self._ns_made.get(owner)
                q = self._ns_work()
                key = ("ns", *owner)
                if owner in self._ns_early:  # a RunPodSandbox seen twice, or the pod's new sandbox
                    cur = self._ns_early[owner]
                    self._ns_early[owner] = (cur[0], cur[1], pod.id)  # the old sandbox's removal keeps it
                    continue
                if self.ledger.find(*owner):
                    continue  # a container already holds it
                if made is not None and made[0] == settings and not q.busy(key):
                    continue  # made with these settings: CreateContainer reuses it as it is
                if len(self._ns_early) >= EARLY_MAX:
                    log.info("nri RunPodSandbox: too many early MPS namespaces; made at CreateContainer",
                             extra={**fields, "early_max": EARLY_MAX})
                    return
                job = functools.partial(self._ensure_job, owner, p.active_thread_percentage, fields,
                                        p.compute_mode, p.limit_mib)
                fut = q.put(key, job, join=q.pending_tag(key) == _ENSURE, tag=_ENSURE)
                self._ns_early[owner] = (settings, fut, pod.id)
                self._early_counts["queued"] += 1

    def remove_pod_sandbox(self, pod: nri_pb2.PodSandbox, ctx: CallContext | None = None) -> None:
        """RemovePodSandbox: release the early namespaces of this sandbox
        that no container ever held (in the background; never raises). An
        entry a newer sandbox of the same pod claimed (kubelet recreates a
        dead sandbox, then removes the old one) stays."""
        self._release_early(lambda uid, sandbox: uid == pod.uid and sandbox == pod.id)
        return None

    def _release_early_gone(self, pods: Iterable[nri_pb2.PodSandbox]) -> None:
        """Synchronize: release the early namespaces of sandboxes not in ``pods``."""
        live = {p.id for p in pods}
        self._release_early(lambda uid, sandbox: sandbox not in live)

    def _release_early(self, gone: Any) -> None:
        """Drop the early entries for which ``gone(pod UID, sandbox id)`` is
        true and release their namespaces (``_release_owners``: a queued
        ensure that never started is dropped, nothing to release)."""
        with self._ns_lock:
            owners = {o for o, e in self._ns_early.items() if gone(o[0], e[2])}
            for o in owners:
                del self._ns_early[o]
            self._early_counts["released"] += len(owners)
        if owners:
            log.info("nri early MPS namespaces released: no container of the pod held them",
                     extra={"owners": len(owners), "pod_uid": ",".join(sorted({o[0] for o in owners}))})
            try:
                self._release_owners(owners)
            except Exception:
                log.exception("nri early MPS namespace release failed")

    def early_status(self) -> dict[str, int]:
        """``{"pending": early namespaces no container holds yet, "queued":
        early ensures queued since start, "used": CreateContainers that
        awaited one, "mismatched": CreateContainers whose settings differed
        (or whose early ensure failed) and queued their own, "released":
        early namespaces released at RemovePodSandbox or Synchronize,
        "adopted": namespaces the MPS layer held for a live pod that nothing
        here held, taken into the early table at Synchronize, "orphaned":
        namespaces the MPS layer held for pods the runtime no longer has,
        released at Synchronize (``nri/orphans.py``)}``; counts since start
        except ``pending``."""
        with self._ns_lock:
            return {"pending": len(self._ns_early), **self._early_counts}
