"""One allocation model for both doors (ADR 0007): pure functions, no I/O.

kubelet's allocation is authoritative for a container that requests the
extended resource (decision 1: annotations may only add a limit at or above
the request, the compute mode and the portion; anything else is an
``Ignored``). A reservation is keyed by the device IDs kubelet passed
(``reservation_key``, decision 2), and its holder is learned from evidence
(decision 3: the key travels in Allocate's answer, env ``FRACPLUGIN_RESERVATION``
and the container annotation of the same meaning).

``to_tenancies`` is the one conversion from a plan to ledger entries; the
ledger (both doors), the PodResources rebuild and the NRI Synchronize use it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from . import annotations as ann
from .model import ComputeMode, ContainerPlan, FractionRequest, MemorySpec, Tenancy

ENV_RESERVATION = "FRACPLUGIN_RESERVATION"
"""Env var of Allocate's answer that names the reservation (its key)."""
ANNOTATION_RESERVATION = "fracplugin.io/reservation"
"""Container annotation of Allocate's answer with the same value."""

DOOR_NRI = "nri"
DOOR_ALLOCATE = "allocate"
DOOR_OTHER_PLUGIN = "other-plugin"
DOOR_SYNC = "sync"
DOOR_DRA = "dra"
"""A DRA claim's hold (dra/prepare.py, ADR 0031): reservation ``dra:<claim uid>``, released at Unprepare."""

_MAX_KEY = 4096


class ReservationKeyError(ValueError):
    """A reservation key that is not in the canonical form."""


def reservation_key(by_gpu: Mapping[str, Iterable[int]]) -> str:
    """The canonical key of a set of device IDs, from ``{gpu uuid: [device
    numbers]}`` (IDs ``<uuid>::<n>``, kubelet/devices.py): GPUs sorted by UUID,
    numbers sorted and written as ranges, ``<uuid>::<a>-<b>,<c>`` joined by
    ``;``. Same devices, same key, whatever the order kubelet sent them in.
    Raises ReservationKeyError for an empty set."""
    parts = []
    for uuid in sorted(by_gpu):
        nums = sorted(set(int(n) for n in by_gpu[uuid]))
        if not nums:
            continue
        ranges = []
        for _, run in itertools.groupby(enumerate(nums), lambda p: p[1] - p[0]):  # consecutive numbers
            (_, first), *rest = run
            last = rest[-1][1] if rest else first
            ranges.append(str(first) if first == last else f"{first}-{last}")
        parts.append(f"{uuid}::{','.join(ranges)}")
    if not parts:
        raise ReservationKeyError("a reservation needs at least one device")
    return ";".join(parts)


def parse_reservation_key(key: str) -> dict[str, list[int]]:
    """Inverse of ``reservation_key``: ``{gpu uuid: [device numbers]}``.
    Raises ReservationKeyError naming the key and the rule when it is not
    canonical (a pod-authored value is never trusted blindly)."""
    if not key or len(key) > _MAX_KEY:
        raise ReservationKeyError(f"reservation key of {len(key)} characters (need 1..{_MAX_KEY})")
    out: dict[str, list[int]] = {}
    try:
        for part in key.split(";"):
            uuid, sep, ranges = part.partition("::")
            if not sep or not uuid or uuid in out:
                raise ValueError(part)
            nums: list[int] = []
            for r in ranges.split(","):
                a, dash, b = r.partition("-")
                lo = int(a)
                hi = int(b) if dash else lo
                if hi < lo or lo < 0 or str(lo) != a or (dash and str(hi) != b):
                    raise ValueError(r)
                nums.extend(range(lo, hi + 1))
            out[uuid] = nums
    except ValueError:
        raise ReservationKeyError(f"reservation key {key[:120]!r} is not <uuid>::<n>[-<m>],...;... ") from None
    if reservation_key(out) != key:
        raise ReservationKeyError(f"reservation key {key[:120]!r} is not in canonical form")
    return out


@functools.lru_cache(maxsize=4096)
def _device_sets(key: str) -> dict[str, frozenset[int]]:
    return {u: frozenset(v) for u, v in parse_reservation_key(key).items()}


def overlaps(key_a: str, key_b: str) -> bool:
    """True when two reservation keys share a device (canonical keys; raises
    ReservationKeyError otherwise). Parsed keys are cached."""
    a, b = _device_sets(key_a), _device_sets(key_b)
    return any(a[u] & b[u] for u in a if u in b)


def union_key(keys: Iterable[str]) -> str:
    """The canonical key of every device of ``keys`` (canonical keys; raises
    ReservationKeyError otherwise): the hold kubelet's reuse of an init
    container's devices makes of a pod's keys (ADR 0033 decision 3)."""
    by: dict[str, set[int]] = {}
    for k in keys:
        for u, nums in _device_sets(k).items():
            by.setdefault(u, set()).update(nums)
    return reservation_key(by)


def charge_mib(key: str, unit_mib: int) -> dict[str, int]:
    """What a device plugin door hold of ``key`` (canonical; raises
    ReservationKeyError otherwise) is charged on each GPU: ``unit_mib`` per
    device of the key on that GPU, MiB by GPU UUID. A union hold (ADR 0033
    decision 3) is charged by this, once, whichever door made it."""
    return {u: len(v) * unit_mib for u, v in _device_sets(key).items()}


def to_tenancies(
    plan: ContainerPlan, container_id: str = "", *, door: str = DOOR_NRI, reservation: str = "", bound: bool = True
) -> list[Tenancy]:
    """The ledger entries of ``plan``: one Tenancy per GPU (request and limit
    per GPU, MiB). ``bound=False`` records a reservation whose holder is not
    known yet (empty pod and container: the plan was made for a candidate,
    which is a guess, not a fact)."""
    pod = plan.pod
    return [
        Tenancy(
            pod_uid=pod.uid if bound else "",
            namespace=pod.namespace if bound else "",
            pod_name=pod.name if bound else "",
            container=plan.container if bound else "",
            gpu_uuid=g.uuid,
            request_mib=plan.request_mib,
            limit_mib=plan.limit_mib,
            mode=plan.compute_mode,
            container_id=container_id,
            mps_namespace=plan.mps_namespace,
            active_thread_percentage=plan.active_thread_percentage,
            door=door,
            reservation=reservation,
        )
        for g in plan.devices
    ]


@dataclass(frozen=True)
class Ignored:
    """An annotation (``key`` = ``value``) that was not applied, and ``why``."""

    key: str
    value: str
    why: str

    @property
    def message(self) -> str:
        return f'{self.key}="{self.value}" not applied: {self.why}'


def kubelet_request(
    container: str,
    uuids: Sequence[str],
    per_gpu_mib: int,
    count: int,
    parsed: FractionRequest | None,
    resource_key: str,
    *,
    gpu_memory_mib: int,
    reserve_mib: int = 0,
) -> tuple[FractionRequest, list[Ignored]]:
    """The FractionRequest of a container kubelet allocated ``count`` devices
    of ``uuids`` (``per_gpu_mib`` MiB on each), with what its annotations
    (``parsed``, or None) may add. Returns (request, ignored annotations).

    ``gpu_memory_mib`` (the smallest of the GPUs) and ``reserve_mib`` resolve
    fraction forms. Rules (ADR 0007): devices and request are kubelet's; a
    limit the pod wrote applies when it is >= the request, else it is ignored
    (the limit is then the request); a request annotation other than the
    units, or devices other than kubelet's, are ignored; compute mode and
    portion apply. Never raises."""
    request = MemorySpec(resource_key, f"{count} device(s) over {len(uuids)} GPU(s)", mib=per_gpu_mib)
    limit = request
    mode = ComputeMode.TIME_SLICING
    portion = None
    keys: dict[str, str] = {"request": resource_key, "limit": resource_key, "devices": resource_key}
    ignored: list[Ignored] = []
    why_request = (f"the request is kubelet's allocation, {count} device(s) of {resource_key} = "
                   f"{per_gpu_mib} MiB per GPU")
    if parsed is not None:
        mode, portion = parsed.compute_mode, parsed.portion
        keys.update({k: v for k, v in parsed.keys.items() if k in ("mode", "portion")})
        if _written_request(parsed):
            r = parsed.request
            if r.resolve_mib(gpu_memory_mib, reserve_mib) != per_gpu_mib:
                ignored.append(Ignored(r.key, r.raw, why_request))
        if _written_limit(parsed):
            lim = parsed.limit
            lim_mib = lim.resolve_mib(gpu_memory_mib, reserve_mib)
            if lim_mib < per_gpu_mib:
                ignored.append(Ignored(lim.key, lim.raw,
                                       f"it is {lim_mib} MiB, below kubelet's allocation of {per_gpu_mib} MiB per GPU "
                                       "(the limit must be >= the request); the limit is the request"))
            else:
                limit = lim
                keys["limit"] = lim.key
        if parsed.devices and set(parsed.devices) != set(uuids):
            dkey = parsed.keys.get("devices", "devices")
            ignored.append(Ignored(dkey, ",".join(parsed.devices),
                                   f"kubelet allocated {resource_key} on {','.join(uuids)}; a container with "
                                   "device plugin devices is never moved to other GPUs"))
    req = FractionRequest(container=container, request=request, limit=limit, compute_mode=mode, portion=portion,
                          devices=tuple(uuids), num_devices=len(uuids), keys=keys)
    return req, ignored


_LIMIT_SUFFIXES = (ann.SUFFIX_LIMIT, ".gpu-memory.portion.limit")


def _is_limit_key(key: str) -> bool:
    return key.endswith(_LIMIT_SUFFIXES) or key == ann.KEY_GPU_FRACTION_LIMIT


def _written_request(parsed: FractionRequest) -> bool:
    """True when the pod wrote a request (not the parser's request = limit
    default, not parse_for_kubelet's synthetic one)."""
    key = parsed.request.key
    return bool(key) and not _is_limit_key(key)


def _written_limit(parsed: FractionRequest) -> bool:
    """True when the pod wrote a limit (not the parser's limit = request default)."""
    key = parsed.limit.key
    return bool(key) and _is_limit_key(key)


def parse_for_kubelet(
    annotations: Mapping[str, str], container: str, per_gpu_mib: int, *, prefix: str,
    containers: Sequence[str] | None = None,
) -> FractionRequest | None:
    """``annotations.parse`` for a container kubelet allocated: when the
    container has no memory annotation, parse again with a synthetic request of
    ``per_gpu_mib`` so its compute mode and portion annotations still count
    (the synthetic key is dropped). Raises FractionError like ``parse``."""
    parsed = ann.parse(annotations, container, prefix=prefix, containers=containers)
    if parsed is None:
        synthetic = dict(annotations)
        synthetic[ann.container_key(prefix, container, ann.SUFFIX_REQUEST)] = f"{per_gpu_mib}Mi"
        parsed = ann.parse(synthetic, container, prefix=prefix, containers=containers)
        if parsed is not None:
            parsed = dataclasses.replace(
                parsed, keys={k: v for k, v in parsed.keys.items() if k in ("mode", "portion", "devices")},
                request=MemorySpec("", "", mib=per_gpu_mib), limit=MemorySpec("", "", mib=per_gpu_mib))
    return parsed
