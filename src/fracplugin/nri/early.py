"""The NRI door's early MPS namespaces (ADR 0030, decisions 1-4, which this
module implements): a pod's namespaces are queued at RunPodSandbox, seconds
of image pull before its CreateContainer, so that StartContainer finds them
made (issue 28; the mask 0x62d, docs/reference/nri-protocol.md 1.4, 1.7).

RunPodSandbox plans the containers the pod's per-container memory keys name
as CreateContainer would (``NodeRules.replan``), against an empty ledger: only
the namespace's settings matter. Nothing here fails the sandbox (containerd
fails the pod on a plugin's error): a refused annotation is logged at DEBUG,
the refusal stays CreateContainer's. After a doors restart ``nri/orphans.py``
rebuilds the table from what the MPS layer holds.

The table is bounded (``EARLY_MAX`` owners, ``EARLY_PER_POD`` per pod; past
them CreateContainer does the work). ``early_plans`` plans a pod's containers;
the early table and its ensures are ``Namespaces``' (``queue_early``,
``release_early``, ``early_status``). RunPodSandbox and RemovePodSandbox never
wait: the stub serves them on its reader thread.
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
their CreateContainer."""


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
