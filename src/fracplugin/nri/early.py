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
- CreateContainer (``Namespaces.start``, ``nri/namespaces.py``): an early ensure of the
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

Where it is done: ``early_plans`` here plans a pod's containers; the
early table and its ensures are the namespace table's (``Namespaces.queue_early``,
``release_early``, ``early_status`` in ``nri/namespaces.py``).

Concurrency model: as ``nri/plugin.py``; the early table is under
the namespace table's lock. RunPodSandbox and RemovePodSandbox never wait (a plan, a
dict update and a queue put): the stub serves them on its reader thread.
"""

from __future__ import annotations

import logging
from typing import Callable

from .._proto import nri_pb2
from ..annotations import (KEY_CONTAINER_NAME, KEY_NUM_DEVICES, SUFFIX_DEVICES, annotated_containers, container_key,
                           parse)
from ..model import ComputeMode, ContainerPlan, FractionError
from ..noderules import NodeRules
from .pluginbase import _POD_LEVEL_KEYS, _pod_ref

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log

EARLY_MAX = 4096
"""Most owners with an early namespace not yet held by a container."""

EARLY_PER_POD = 16
"""Most containers of one pod that get an early namespace (the first, by
name): a pod's annotations may name containers it does not have, whose
namespaces are made for nothing until RemovePodSandbox; the rest wait for
their CreateContainer as before."""


def early_plans(rules: NodeRules, pod: nri_pb2.PodSandbox, mode_up: Callable[[ComputeMode], bool]) -> list[ContainerPlan]:
    """The plans, against an empty ledger, of the containers the pod's
    per-container keys name that get an MPS namespace (none for a pod
    whose forms need its spec, none whose mode's daemon is not ``mode_up``).
    A refused annotation is skipped (DEBUG). ``Namespaces.queue_early``
    queues their ensures."""
    ann = pod.annotations
    if KEY_CONTAINER_NAME in ann or any(k in ann for k in _POD_LEVEL_KEYS if k != KEY_NUM_DEVICES):
        return []
    prefix = rules.config.annotation_prefix
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
            p = rules.replan(req, ref) if req is not None else None
        except FractionError as err:
            log.debug("nri RunPodSandbox: container refused; CreateContainer will say so",
                      extra={"pod": str(ref), "container": name, "key": err.key, "rule": err.reason})
            continue
        if p is not None and p.mps_namespace is not None and mode_up(p.compute_mode):
            plans.append(p)
    return plans
