"""Pod annotations -> FractionRequest for one container (pure; no I/O).

The contract is docs/reference/design.md section 4; the rules come from the reference node
stack's annotation parser and KAI's NvFractions binder/admission
(docs/reference/gpu-fractioning-reference.md sections 2a and 2b). Every refusal is a
``FractionError`` naming the key, the value and the rule.

Keys read, for container ``c`` and prefix ``p`` (default ``nvidia.com/container.``):

- ``p c .gpu-memory.request`` / ``.gpu-memory.limit``: Kubernetes quantities,
  rounded **up** to whole MiB, each >= 1 MiB; one defaults to the other.
- ``p c .gpu-compute.mode``: exactly ``time-slicing`` (default) or ``sm-sharing``.
- ``p c .gpu-compute.portion``: a finite decimal in (0, 1].
- ``p c .gpus.devices``: comma list of GPU UUIDs, indices or CDI names.
- pod-level KAI forms, used when no per-container memory key is given:
  ``gpu-fraction`` (0 < f < 1), ``gpu-fraction.limit`` (f < l <= 1),
  ``gpu-memory`` (a whole number of MiB per GPU, not a quantity), ``gpu-fraction-num-devices`` (integer >= 1),
  ``gpu-fraction-container-name`` (which container they apply to), and
  ``kai.scheduler/container.<c>.gpu-memory.portion.limit`` (0 < l <= 1).
- pod-level ``kai.scheduler/gpu-compute-sharing-mode`` (the form KAI's docs
  name): the compute mode of the pod's fractional container when its
  per-container ``.gpu-compute.mode`` key is absent (the per-container key wins).
"""

from __future__ import annotations

import functools
import math
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any, Mapping, Sequence

from . import contract as C
from .contract import MAX_DEVICES, MAX_QUANTITY_BYTES, MIB  # noqa: F401 (re-exported)
from .model import ComputeMode, FractionError, FractionRequest, MemorySpec

DEFAULT_PREFIX = "nvidia.com/container."

KEY_GPU_FRACTION = "gpu-fraction"
KEY_GPU_FRACTION_LIMIT = "gpu-fraction.limit"
KEY_GPU_MEMORY = "gpu-memory"
KEY_NUM_DEVICES = "gpu-fraction-num-devices"
KEY_CONTAINER_NAME = "gpu-fraction-container-name"
KAI_PORTION_LIMIT = "kai.scheduler/container.{c}.gpu-memory.portion.limit"
#: Pod-level compute mode named by KAI's documentation (docs/gpu-sharing/README.md,
#: "Compute sharing mode within a fractional GPU group"); KAI's binder and the
#: reference node stack read the per-container ``.gpu-compute.mode`` key, which
#: wins when both are set.
KEY_POD_COMPUTE_MODE = "kai.scheduler/gpu-compute-sharing-mode"

SUFFIX_REQUEST = ".gpu-memory.request"
SUFFIX_LIMIT = ".gpu-memory.limit"
SUFFIX_MODE = ".gpu-compute.mode"
SUFFIX_PORTION = ".gpu-compute.portion"
SUFFIX_DEVICES = ".gpus.devices"

_DECIMAL_RE = re.compile(rf"^{C.DECIMAL_PATTERN}\Z")
_INT_RE = re.compile(rf"^{C.INT_PATTERN}\Z")  # ASCII digits only (str.isdigit() accepts "²", "١")
# The Kubernetes quantity grammar (apimachinery resource.ParseQuantity): the
# Python client's parser is laxer (it accepts "4 Gi"), so the shape is checked first.
_QUANTITY_RE = re.compile(rf"^{C.QUANTITY_PATTERN}\Z")


def container_key(prefix: str, container: str, suffix: str) -> str:
    """``<prefix><container><suffix>``; exact-key lookup means ``trainer`` never
    matches ``trainer-2`` (docs/reference/gpu-fractioning-reference.md section 2a)."""
    return f"{prefix}{container}{suffix}"


def _no_padding(key: str, raw: str) -> None:
    if raw == "":
        raise FractionError(key, raw, C.BLANK, "blank")
    if raw != raw.strip():
        raise FractionError(key, raw, C.PADDED, "whitespace")


_SUFFIX_EXPONENTS = {"n": -3, "u": -2, "m": -1, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
"""Power of the base per suffix letter: base 1000 alone (``k``, ``M``...), base
1024 before ``i`` (``Ki``, ``Mi``...); apimachinery resource.Quantity, as the
kubernetes client's ``utils.parse_quantity`` implements it."""
_DEC_1000 = Decimal(1000)
_DEC_1024 = Decimal(1024)


def quantity_value(raw: str) -> Decimal:
    """The value of a quantity string that ``_QUANTITY_RE`` accepts, exactly
    as ``kubernetes.utils.parse_quantity`` computes it (Decimal arithmetic,
    default context: ``number * base ** exponent``), without importing the
    kubernetes client (about 35 MiB of RSS, issue 14). A property test keeps
    the two identical (tests/unit/test_annotations_quantity.py).

    Raises:
        ValueError / decimal.InvalidOperation / ArithmeticError: not a number.
    """
    if len(raw) >= 2 and raw[-1] == "i" and raw[-2] in "KMGTPE":
        return Decimal(raw[:-2]) * (_DEC_1024 ** _SUFFIX_EXPONENTS[raw[-2]])
    if raw and raw[-1] in _SUFFIX_EXPONENTS:
        return Decimal(raw[:-1]) * (_DEC_1000 ** _SUFFIX_EXPONENTS[raw[-1]])
    return Decimal(raw)


def parse_quantity_mib(key: str, raw: str) -> int:
    """A Kubernetes quantity (``40Gi``, ``4096M``, ``1.5G``, ``4294967296``, ``1e9``)
    -> whole MiB, rounded up (``1G`` -> 954, ``4096M`` -> 3907).

    Parsing is ``quantity_value`` (the kubernetes client's ``parse_quantity``
    rules, behind our stricter syntax ``_QUANTITY_RE``); the range rules are
    ours: at least 1 MiB (1048576 bytes), at most 1 PiB, no whitespace. Every
    refusal says the key is a quantity in bytes (``contract.BYTES_UNIT``), and
    a bare positive integer below 1Mi gets "did you mean <raw>Mi?".

    Raises:
        FractionError: blank, padded, non-numeric, negative, zero, sub-MiB or
            absurd values, naming ``key`` and ``raw``.
    """
    _no_padding(key, raw)
    try:
        if not _QUANTITY_RE.match(raw):
            raise ValueError(raw)
        value = quantity_value(raw)
    except (ValueError, InvalidOperation, TypeError, ArithmeticError):
        raise FractionError(key, raw, C.QUANTITY_SYNTAX, "quantity") from None
    if not value.is_finite():
        raise FractionError(key, raw, C.QUANTITY_NOT_FINITE, "quantity")
    if value < 0:
        raise FractionError(key, raw, C.QUANTITY_NEGATIVE, "quantity")
    if value > MAX_QUANTITY_BYTES:
        raise FractionError(key, raw, C.QUANTITY_ABSURD, "quantity")
    if value < MIB:
        hint = C.QUANTITY_MIB_HINT.format(raw=raw) if _INT_RE.match(raw) and value > 0 else ""
        raise FractionError(key, raw, C.QUANTITY_BELOW_MIB + hint, "quantity")
    return int((value / MIB).to_integral_value(rounding=ROUND_CEILING))


def parse_fraction(key: str, raw: str, *, allow_one: bool) -> float:
    """A decimal fraction under ``key`` in (0, 1] (``allow_one``: the
    contract's ``.gpu-compute.portion`` rule) or (0, 1). The DRA door's
    parameters type (dra/params.py) uses it with its own key. Raises
    FractionError naming ``key`` and ``raw``."""
    _no_padding(key, raw)
    if not _DECIMAL_RE.match(raw):
        raise FractionError(key, raw, C.FRACTION_SYNTAX, "fraction")
    value = float(raw)
    if not math.isfinite(value):
        raise FractionError(key, raw, C.FRACTION_NOT_FINITE, "fraction")
    upper = "1]" if allow_one else "1)"
    if value <= 0 or value > 1 or (value == 1 and not allow_one):
        raise FractionError(key, raw, C.FRACTION_OUTSIDE.format(upper=upper), "fraction")
    return value


def parse_mode(key: str, raw: str) -> ComputeMode:
    """A compute mode value under ``key`` (the contract's ``.gpu-compute.mode``
    rule, ``contract.MODE``): exactly ``time-slicing`` or ``sm-sharing``.
    Used by the DRA door's parameters type (dra/params.py) with its own key.
    Raises FractionError naming ``key`` and ``raw``."""
    for mode in ComputeMode:
        if raw == mode.value:
            return mode
    raise FractionError(key, raw, C.MODE, "mode")


def _parse_positive_int(key: str, raw: str, *, maximum: int) -> int:
    """A whole number in [1, maximum]; each refusal names the key's unit
    (``contract.int_unit``), and a ``gpu-memory`` written as a quantity of at
    least 1Mi (``20Gi``) gets "did you mean "<MiB>" (MiB)?"."""
    _no_padding(key, raw)
    unit = C.int_unit(key)
    if raw.startswith("-") and _INT_RE.match(raw[1:]):
        raise FractionError(key, raw, C.with_unit(C.INT_AT_LEAST_1, unit), "integer")
    if not _INT_RE.match(raw):
        raise FractionError(key, raw, C.with_unit(C.INT_NOT_WHOLE, unit) + _mib_hint(key, raw), "integer")
    if len(raw) > len(str(maximum)):
        raise FractionError(key, raw, C.with_unit(C.INT_AT_MOST.format(maximum=maximum), unit), "integer")
    value = int(raw)
    if value < 1:
        raise FractionError(key, raw, C.with_unit(C.INT_AT_LEAST_1, unit), "integer")
    if value > maximum:
        raise FractionError(key, raw, C.with_unit(C.INT_AT_MOST.format(maximum=maximum), unit), "integer")
    return value


def _mib_hint(key: str, raw: str) -> str:
    """``contract.MIB_QUANTITY_HINT`` for a pod-level ``gpu-memory`` holding a
    quantity in [1Mi, 1Pi] (the MiB it means, rounded up); else empty."""
    if key != KEY_GPU_MEMORY or not _QUANTITY_RE.match(raw):
        return ""
    try:
        value = quantity_value(raw)
    except (ValueError, InvalidOperation, ArithmeticError):
        return ""
    if not value.is_finite() or not MIB <= value <= MAX_QUANTITY_BYTES:
        return ""
    return C.MIB_QUANTITY_HINT.format(mib=int((value / MIB).to_integral_value(rounding=ROUND_CEILING)))


def _parse_devices(key: str, raw: str) -> tuple[str, ...]:
    entries = tuple(e.strip() for e in raw.split(","))
    if any(e == "" for e in entries):
        raise FractionError(key, raw, C.DEVICES_EMPTY_ENTRY, "devices")
    if len(set(entries)) != len(entries):
        raise FractionError(key, raw, C.DEVICES_TWICE, "devices")
    if len(entries) > MAX_DEVICES:
        raise FractionError(key, raw, C.DEVICES_TOO_MANY, "devices")
    return entries


PARSE_CACHE_SIZE = 1024
"""Parsed requests kept by ``parse`` (LRU), keyed by the values it reads."""
PARSE_CACHE_MAX_CHARS = 1024
"""Annotation values longer than this in total are parsed without the cache
(a cached key holds them: 1024 entries x 1 KiB at most)."""


def parse(
    annotations: Mapping[str, str],
    container: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    containers: Sequence[str] | None = None,
) -> FractionRequest | None:
    """Parse the annotations that concern ``container`` (``parse_uncached``'s
    contract, which see), from a cache (issue 14: this runs on every
    CreateContainer, 10 us of Decimal arithmetic and regexes per call).

    The result depends only on ``container``, ``prefix``, ``containers`` and
    the values of the at most 12 keys ``relevant_keys(prefix, container)``
    names (absent = None), so those are the cache key: a pod of the same
    Deployment, a restarted container and every container without
    annotations parse once. The returned ``FractionRequest`` is shared
    between callers: it is frozen, and its ``keys`` mapping must not be
    changed. Refusals are not cached (``FractionError`` is raised again,
    each time, by ``parse_uncached``).
    """
    names = relevant_keys(prefix, container)
    values = tuple(map(annotations.get, names))
    size = 0
    for v in values:
        if v is not None:
            if type(v) is not str:  # not hashable as a key for sure, and not the contract: no cache
                size = PARSE_CACHE_MAX_CHARS + 1
                break
            size += len(v)
    if size > PARSE_CACHE_MAX_CHARS:
        return parse_uncached(annotations, container, prefix=prefix, containers=containers)
    return _parse_values(names, values, container, prefix, None if containers is None else tuple(containers))


@functools.lru_cache(maxsize=256)
def relevant_keys(prefix: str, container: str) -> tuple[str, ...]:
    """Every annotation key ``parse_uncached`` reads for ``container``: the
    five per-container keys, KAI's portion limit, the pod-level KAI forms and
    KAI's pod-level compute mode (docs/reference/design.md section 4)."""
    return (
        *(container_key(prefix, container, s) for s in (SUFFIX_REQUEST, SUFFIX_LIMIT, SUFFIX_MODE,
                                                          SUFFIX_PORTION, SUFFIX_DEVICES)),
        KAI_PORTION_LIMIT.format(c=container),
        KEY_GPU_FRACTION, KEY_GPU_FRACTION_LIMIT, KEY_GPU_MEMORY, KEY_NUM_DEVICES, KEY_CONTAINER_NAME,
        KEY_POD_COMPUTE_MODE,
    )


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parse_values(names: tuple[str, ...], values: tuple[str | None, ...], container: str, prefix: str,
                  containers: tuple[str, ...] | None) -> FractionRequest | None:
    present = {k: v for k, v in zip(names, values) if v is not None}
    return parse_uncached(present, container, prefix=prefix, containers=containers)


def parse_uncached(
    annotations: Mapping[str, str],
    container: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    containers: Sequence[str] | None = None,
) -> FractionRequest | None:
    """Parse the annotations that concern ``container``.

    Args:
        annotations: the pod's annotations (key -> string value).
        container: the container name (exact match).
        prefix: the per-container key prefix (may be empty).
        containers: the containers the pod-level KAI forms may apply to,
            when known (``form_targets`` of the pod's spec: its app containers
            in spec order, then its native sidecars). Without
            ``gpu-fraction-container-name`` they apply to the first, the first
            app container (KAI's rule); the name must be one of them. When
            unknown (the NRI door sees one container at a time) they apply to
            ``container``.

    Returns:
        A FractionRequest, or None when the container has no memory annotation
        (it is not fractional and gets nothing). Memory values may be fractions
        resolved later against the GPU (planner).

    Raises:
        FractionError: any rule of the contract broken (key, value, rule).
    """
    keys: dict[str, str] = {}  # what each part of the request was read from
    request, limit = _container_memory(annotations, prefix, container, keys)
    # Pod-level KAI forms apply to one container of the pod.
    applies = _pod_level_applies(annotations, container, containers)
    if applies:
        request, limit = _pod_level_memory(annotations, request, limit, keys)
    k = KAI_PORTION_LIMIT.format(c=container)
    if limit is None and k in annotations:
        limit = MemorySpec(k, annotations[k], fraction=parse_fraction(k, annotations[k], allow_one=True))
        keys["limit"] = k
    # Mode, portion and devices are validated even before we know the container
    # is fractional, so a typo never goes unnoticed (reference: portion errors
    # are errors in every mode).
    mode, portion, devices = _compute_and_devices(annotations, prefix, container, keys)
    if request is None and limit is None:
        return None
    request, limit = _request_and_limit(request, limit, keys)
    num_devices = len(devices) if devices else 1
    if applies and KEY_NUM_DEVICES in annotations:
        num_devices = _num_devices(annotations[KEY_NUM_DEVICES], devices, keys)
    return FractionRequest(
        container=container,
        request=request,
        limit=limit,
        compute_mode=mode,
        portion=portion,
        devices=devices,
        num_devices=num_devices,
        keys=keys,
    )


def _container_memory(annotations: Mapping[str, str], prefix: str, container: str,
                      keys: dict[str, str]) -> tuple[MemorySpec | None, MemorySpec | None]:
    """The per-container absolute forms (``<prefix><c>.gpu-memory.request`` /
    ``.limit``): (request, limit), each None when absent; records their keys."""
    out: list[MemorySpec | None] = []
    for part, suffix in (("request", SUFFIX_REQUEST), ("limit", SUFFIX_LIMIT)):
        k = container_key(prefix, container, suffix)
        if k in annotations:
            out.append(MemorySpec(k, annotations[k], mib=parse_quantity_mib(k, annotations[k])))
            keys[part] = k
        else:
            out.append(None)
    return out[0], out[1]


def _pod_level_memory(annotations: Mapping[str, str], request: MemorySpec | None, limit: MemorySpec | None,
                      keys: dict[str, str]) -> tuple[MemorySpec | None, MemorySpec | None]:
    """KAI's pod-level forms, for what the per-container keys left unset:
    ``gpu-fraction`` (else ``gpu-memory``) for the request, ``gpu-fraction.limit``
    (strictly above ``gpu-fraction``) for the limit."""
    if request is None and KEY_GPU_FRACTION in annotations:
        raw = annotations[KEY_GPU_FRACTION]
        request = MemorySpec(KEY_GPU_FRACTION, raw, fraction=parse_fraction(KEY_GPU_FRACTION, raw, allow_one=False))
        keys["request"] = KEY_GPU_FRACTION
    elif request is None and KEY_GPU_MEMORY in annotations:
        raw = annotations[KEY_GPU_MEMORY]
        mib = _parse_positive_int(KEY_GPU_MEMORY, raw, maximum=C.MAX_GPU_MEMORY_MIB)
        request = MemorySpec(KEY_GPU_MEMORY, raw, mib=mib)
        keys["request"] = KEY_GPU_MEMORY
    if limit is None and KEY_GPU_FRACTION_LIMIT in annotations:
        raw = annotations[KEY_GPU_FRACTION_LIMIT]
        frac = parse_fraction(KEY_GPU_FRACTION_LIMIT, raw, allow_one=True)
        if request is not None and request.fraction is not None and frac <= request.fraction:
            raise FractionError(
                KEY_GPU_FRACTION_LIMIT, raw,
                C.FRACTION_LIMIT_NOT_ABOVE.format(fraction_key=KEY_GPU_FRACTION, fraction_raw=request.raw),
                "limit_below_request",
            )
        limit = MemorySpec(KEY_GPU_FRACTION_LIMIT, raw, fraction=frac)
        keys["limit"] = KEY_GPU_FRACTION_LIMIT
    return request, limit


def _compute_and_devices(annotations: Mapping[str, str], prefix: str, container: str,
                         keys: dict[str, str]) -> tuple[ComputeMode, float | None, tuple[str, ...]]:
    """(compute mode, portion or None, devices named) of ``container``: the
    per-container mode key wins over KAI's pod-level one; time-slicing by
    default; a blank ``.gpus.devices`` names none."""
    mode = ComputeMode.TIME_SLICING
    k = container_key(prefix, container, SUFFIX_MODE)
    if k in annotations:
        mode = parse_mode(k, annotations[k])
        keys["mode"] = k
    elif KEY_POD_COMPUTE_MODE in annotations:
        mode = parse_mode(KEY_POD_COMPUTE_MODE, annotations[KEY_POD_COMPUTE_MODE])
        keys["mode"] = KEY_POD_COMPUTE_MODE
    portion: float | None = None
    k = container_key(prefix, container, SUFFIX_PORTION)
    if k in annotations:
        portion = parse_fraction(k, annotations[k], allow_one=True)
        keys["portion"] = k
    devices: tuple[str, ...] = ()
    k = container_key(prefix, container, SUFFIX_DEVICES)
    if k in annotations and annotations[k].strip() != "":
        devices = _parse_devices(k, annotations[k])
        keys["devices"] = k
    return mode, portion, devices


def _request_and_limit(request: MemorySpec | None, limit: MemorySpec | None,
                       keys: dict[str, str]) -> tuple[MemorySpec, MemorySpec]:
    """Each defaults to the other; the limit must not be below the request
    (compared when both are MiB, or both fractions)."""
    if request is None:
        assert limit is not None
        request = limit
        keys["request"] = keys["limit"]
    if limit is None:
        limit = request
        keys["limit"] = keys["request"]
    if request.mib is not None and limit.mib is not None and limit.mib < request.mib:
        raise FractionError(
            limit.key, limit.raw,
            C.LIMIT_BELOW_REQUEST_MIB.format(request_raw=request.raw, request_mib=request.mib),
            "limit_below_request",
        )
    if (
        request.fraction is not None and limit.fraction is not None
        and limit is not request and limit.fraction < request.fraction
    ):
        raise FractionError(
            limit.key, limit.raw,
            C.LIMIT_BELOW_REQUEST_FRACTION.format(request_raw=request.raw),
            "limit_below_request",
        )
    return request, limit


def _num_devices(raw: str, devices: tuple[str, ...], keys: dict[str, str]) -> int:
    """``gpu-fraction-num-devices``: an integer in [1, MAX_DEVICES] that must
    match the number of devices named, when some are."""
    n = _parse_positive_int(KEY_NUM_DEVICES, raw, maximum=MAX_DEVICES)
    keys["num_devices"] = KEY_NUM_DEVICES
    if devices and n != len(devices):
        raise FractionError(
            KEY_NUM_DEVICES, raw,
            C.DEVICES_COUNT_MISMATCH.format(count=len(devices), devices_key=keys["devices"]),
            "devices",
        )
    return n


def _pod_level_applies(annotations: Mapping[str, str], container: str, containers: Sequence[str] | None) -> bool:
    named = annotations.get(KEY_CONTAINER_NAME)
    if named is not None:
        _no_padding(KEY_CONTAINER_NAME, named)
        if containers is not None and named not in containers:
            raise FractionError(KEY_CONTAINER_NAME, named, C.CONTAINER_NOT_IN_POD, "container")
        return named == container
    if containers:
        return containers[0] == container
    return True


def native_sidecars(spec: Mapping[str, Any]) -> list[str]:
    """The pod's native sidecars, in spec order: its init containers with
    ``restartPolicy: Always`` (Kubernetes 1.29+ SidecarContainers), which
    start before the app containers and run beside them for the pod's life.
    ``spec``: the pod's ``spec`` (a dict in the API's JSON shape); entries
    of the wrong type are skipped. Never raises."""
    inits = spec.get("initContainers") if isinstance(spec, Mapping) else None
    if not isinstance(inits, (list, tuple)):
        return []
    return [str(c.get("name")) for c in inits
            if isinstance(c, Mapping) and c.get("restartPolicy") == "Always" and c.get("name")]


def form_targets(spec: Mapping[str, Any]) -> list[str]:
    """The containers a pod-level KAI form (``gpu-fraction``, ``gpu-memory``,
    ...) may apply to, as ``parse``'s ``containers`` takes them: the app
    containers in spec order, then the native sidecars (``native_sidecars``).
    Without ``gpu-fraction-container-name`` the forms apply to the first
    (the first app container, KAI's rule); the name may be any of them. A
    plain init container runs to completion before the app starts: it is
    not one. Every door and ``fracplugin explain`` use this one list."""
    raw = spec.get("containers") if isinstance(spec, Mapping) else None
    apps = [str(c.get("name")) for c in raw if isinstance(c, Mapping)] if isinstance(raw, (list, tuple)) else []
    return apps + [n for n in native_sidecars(spec) if n not in apps]


def annotated_containers(annotations: Mapping[str, str], prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The containers the pod's per-container memory keys name, sorted:
    ``<prefix><c>.gpu-memory.request`` / ``.gpu-memory.limit`` and KAI's
    ``kai.scheduler/container.<c>.gpu-memory.portion.limit`` (the forms that
    make ``c`` fractional without the pod's spec; docs/reference/design.md
    section 4). The pod-level KAI forms name no container here: which
    container they apply to needs the pod's spec. Never raises; a name is
    not checked against the pod (``parse`` refuses what is wrong)."""
    kai_head, kai_tail = KAI_PORTION_LIMIT.split("{c}")
    names: set[str] = set()
    for key in annotations:
        if prefix and key.startswith(prefix):
            rest = key[len(prefix):]
            for suffix in (SUFFIX_REQUEST, SUFFIX_LIMIT):
                if rest.endswith(suffix) and len(rest) > len(suffix):
                    names.add(rest[: -len(suffix)])
        elif key.startswith(kai_head) and key.endswith(kai_tail) and len(key) > len(kai_head) + len(kai_tail):
            names.add(key[len(kai_head): -len(kai_tail)])
    return sorted(names)


def stray_container_keys(annotations: Mapping[str, str], prefix: str, names: Sequence[str]) -> list[str]:
    """Per-container annotation keys that name no container of the pod (a typo
    such as ``nvidia.com/container.ap.gpu-memory.request`` for ``app`` leaves
    the container unfenced, so say so). ``names``: every container of the pod
    (init and app). Used by ``fracplugin explain`` and the NRI door alike."""
    if not prefix:
        return []
    suffixes = (SUFFIX_REQUEST, SUFFIX_LIMIT, SUFFIX_MODE, SUFFIX_PORTION, SUFFIX_DEVICES)
    stray = []
    for key in annotations:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        for suffix in suffixes:
            if rest.endswith(suffix) and rest[: -len(suffix)] not in names:
                stray.append(key)
    return sorted(stray)
