"""Annotation keys that look like the contract but are not in it, and forms
that are read but ignored (issue 25 item 3; pure, no I/O).

A typo such as ``nvidia.com/container.app.gpu-memory.requests`` (plural)
is not a key the contract reads, so the container runs unfenced. Every door
(``fracplugin explain``, the NRI door's Warning Event, Allocate's log) says
so with the same words, naming the key and the closest valid one.

Keys checked (docs/reference/design.md section 4, ``annotations.py``):

- under the per-container prefix (``nvidia.com/container.``): the rest must
  be ``<container><suffix>`` with one of ``SUFFIXES``. Container names are DNS
  labels (no dots), so the container is the text before the first dot.
- a key whose head is one edit away from the prefix
  (``nvidia.com/containers.``, ``nvidia.com/container-``) and whose rest
  is ``<container><suffix>``: a typo in the prefix, the same words.
- KAI's pod-level keys (``POD_LEVEL_KEYS``) and the ``kai.scheduler/`` keys this
  contract reads: a key without ``/`` (or under ``kai.scheduler/``) close to
  one of them (difflib ratio >= 0.8) but not equal is a typo.

A pod-level form (``gpu-fraction``, ``gpu-memory``) without
``gpu-fraction-container-name`` in a pod of several containers says which
container it went to (the first: KAI's rule).

Ignored forms: a per-container memory key wins over the pod-level KAI forms
for that container; ``gpu-fraction`` wins over ``gpu-memory``; the
per-container compute mode wins over ``kai.scheduler/gpu-compute-sharing-mode``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Mapping, Sequence

from .annotations import (KAI_PORTION_LIMIT, KEY_CONTAINER_NAME, KEY_GPU_FRACTION, KEY_GPU_FRACTION_LIMIT,
                          KEY_GPU_MEMORY, KEY_NUM_DEVICES, KEY_POD_COMPUTE_MODE, SUFFIX_DEVICES, SUFFIX_LIMIT,
                          SUFFIX_MODE, SUFFIX_PORTION, SUFFIX_REQUEST, container_key)

SUFFIXES = (SUFFIX_REQUEST, SUFFIX_LIMIT, SUFFIX_MODE, SUFFIX_PORTION, SUFFIX_DEVICES)
"""The per-container suffixes of the contract."""

POD_LEVEL_KEYS = (KEY_GPU_FRACTION, KEY_GPU_FRACTION_LIMIT, KEY_GPU_MEMORY, KEY_NUM_DEVICES, KEY_CONTAINER_NAME)
"""KAI's pod-level keys."""

_KAI_PREFIX = "kai.scheduler/"
_KAI_PORTION_SUFFIX = ".gpu-memory.portion.limit"
_CUTOFF = 0.8


@dataclass(frozen=True)
class Lint:
    """One warning: the annotation ``key`` (its ``value``) and the message
    (which names the key, the closest valid key when there is one, and why)."""

    key: str
    value: str
    message: str


def _closest(word: str, choices: Sequence[str], cutoff: float = 0.0) -> str | None:
    got = difflib.get_close_matches(word, choices, n=1, cutoff=cutoff)
    return got[0] if got else None


def _one_edit(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` differ by exactly one inserted, deleted,
    changed or swapped (two neighbours) character (Damerau's edit distance 1)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (a[i + 1:] == b[i + 1:] or a[i:] == b[i + 1:] or a[i + 1:] == b[i:]
            or (a[i + 2:] == b[i + 2:] and a[i:i + 2] == b[i:i + 2][::-1]))


def _near_prefix(key: str, prefix: str) -> tuple[str, str] | None:
    """(container, closest suffix) of a key whose head is one edit away from
    ``prefix`` (``nvidia.com/containers.``, ``nvidia.com/container-``) and
    whose rest is ``<container><suffix>`` with a suffix close to the
    contract's (difflib ratio >= 0.8); None otherwise."""
    for n in (len(prefix) - 1, len(prefix), len(prefix) + 1):
        c, dot, tail = key[n:].partition(".")
        best = _closest(dot + tail, SUFFIXES, _CUTOFF) if c and dot else None
        if best is not None and _one_edit(key[:n], prefix):
            return c, best
    return None


def unknown_keys(annotations: Mapping[str, str], prefix: str, containers: Sequence[str] | None = None) -> list[Lint]:
    """Keys under ``prefix`` whose suffix is not in the contract, and keys close
    to a KAI key but not one. ``containers``: every container name of the pod
    when known (the closest key then names the closest container). Sorted by key."""
    out: list[Lint] = []
    for key in sorted(annotations):
        if not isinstance(key, str):
            continue
        value = str(annotations[key])
        near: tuple[str, str] | None = None
        if prefix and key.startswith(prefix):
            c, dot, tail = key[len(prefix):].partition(".")
            if not c or not dot or dot + tail in SUFFIXES:
                continue  # a key of the contract, or not shaped as <container>.<field>: not ours to judge
            near = c, _closest(dot + tail, SUFFIXES) or SUFFIX_REQUEST
        elif prefix:
            near = _near_prefix(key, prefix)  # a typo in the prefix itself (containers., container-): same words
        if near is not None:
            c, suffix = near
            if containers and c not in containers:
                c = _closest(c, list(containers)) or c
            out.append(_did_you_mean(key, value, container_key(prefix, c, suffix)))
            continue
        if "/" in key and not key.startswith(_KAI_PREFIX):
            continue
        if key in POD_LEVEL_KEYS or key == KEY_POD_COMPUTE_MODE:
            continue
        if key.startswith(_KAI_PREFIX + "container.") and key.endswith(_KAI_PORTION_SUFFIX):
            continue
        known = list(POD_LEVEL_KEYS) + [KEY_POD_COMPUTE_MODE]
        if key.startswith(_KAI_PREFIX + "container."):
            c = key[len(_KAI_PREFIX + "container."):].partition(".")[0]
            known.append(KAI_PORTION_LIMIT.format(c=c))
        best = _closest(key, known, _CUTOFF)
        if best is not None:
            out.append(_did_you_mean(key, value, best))
    return out


def _did_you_mean(key: str, value: str, closest: str) -> Lint:
    return Lint(key, value, f'annotation {key}="{value}" is not a key fracplugin reads (did you mean '
                            f"{closest}?); it has no effect")


def ignored_forms(annotations: Mapping[str, str], prefix: str, container: str,
                  containers: Sequence[str] | None = None) -> list[Lint]:
    """Forms present for ``container`` that the contract reads but does not
    use because another form wins, and a pod-level form that went to it, the
    first of several containers (module docstring). ``containers``: the
    pod's app containers in spec order when known (the pod-level forms apply
    to the named or first one; unknown: to ``container``)."""
    named = annotations.get(KEY_CONTAINER_NAME)
    if named is not None:
        applies = named == container
    else:
        applies = not containers or containers[0] == container
    out: list[Lint] = []
    if applies:
        for part, suffix, pod_keys in (("request", SUFFIX_REQUEST, (KEY_GPU_FRACTION, KEY_GPU_MEMORY)),
                                       ("limit", SUFFIX_LIMIT, (KEY_GPU_FRACTION_LIMIT,))):
            ck = container_key(prefix, container, suffix)
            if ck in annotations:
                for k in pod_keys:
                    if k in annotations:
                        out.append(Lint(k, annotations[k], f'annotation {k}="{annotations[k]}" is ignored for '
                                                           f"container {container}: {ck} gives its {part} "
                                                           "(the per-container key wins)"))
        pod_key = next((k for k in (KEY_GPU_FRACTION, KEY_GPU_MEMORY) if k in annotations), None)
        if (named is None and pod_key and containers and len(containers) > 1
                and container_key(prefix, container, SUFFIX_REQUEST) not in annotations):
            out.append(Lint(pod_key, annotations[pod_key], f'annotation {pod_key}="{annotations[pod_key]}" applies to '
                            f"container {container}, the first of the pod's {len(containers)} containers "
                            f"({', '.join(containers)}); {KEY_CONTAINER_NAME} names another"))
        if (KEY_GPU_FRACTION in annotations and KEY_GPU_MEMORY in annotations
                and container_key(prefix, container, SUFFIX_REQUEST) not in annotations):
            out.append(Lint(KEY_GPU_MEMORY, annotations[KEY_GPU_MEMORY],
                            f'annotation {KEY_GPU_MEMORY}="{annotations[KEY_GPU_MEMORY]}" is ignored for container '
                            f"{container}: {KEY_GPU_FRACTION} gives its request ({KEY_GPU_FRACTION} wins)"))
    mk = container_key(prefix, container, SUFFIX_MODE)
    if mk in annotations and KEY_POD_COMPUTE_MODE in annotations and annotations[mk] != annotations[KEY_POD_COMPUTE_MODE]:
        out.append(Lint(KEY_POD_COMPUTE_MODE, annotations[KEY_POD_COMPUTE_MODE],
                        f'annotation {KEY_POD_COMPUTE_MODE}="{annotations[KEY_POD_COMPUTE_MODE]}" is ignored for '
                        f"container {container}: {mk} gives its compute mode (the per-container key wins)"))
    return out


def lint(annotations: Mapping[str, str], prefix: str, apps: Sequence[str] | None = None,
         everyone: Sequence[str] | None = None) -> list[Lint]:
    """``unknown_keys`` plus ``ignored_forms`` of every app container in
    ``apps`` (when known), without duplicates; the one list every door reports."""
    out = unknown_keys(annotations, prefix, everyone if everyone is not None else apps)
    seen = {x.message for x in out}
    for c in apps or ():
        for x in ignored_forms(annotations, prefix, c, apps):
            if x.message not in seen:
                seen.add(x.message)
                out.append(x)
    return out
