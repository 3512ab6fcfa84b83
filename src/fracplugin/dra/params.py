"""The DRA door's opaque parameters type: ``GpuMemoryParameters`` (pure; no I/O).

A claim (or its DeviceClass) carries it in ``spec.devices.config[].opaque``
with ``driver: gpu-memory.fracplugin.io``; the allocation copies it into
``status.allocation.devices.config`` (docs/reference/kubelet-dra.md §3)::

    apiVersion: gpu-memory.fracplugin.io/v1alpha1
    kind: GpuMemoryParameters
    gpu-memory.limit: 24Gi        # optional: a quantity in bytes, >= the consumed memory
    gpu-compute.mode: sm-sharing  # optional: time-slicing (default) or sm-sharing
    gpu-compute.portion: "0.5"    # optional: (0, 1]; the MPS active thread percentage is floor(portion x 100)

The field names are the contract's per-container annotation suffixes, checked
by the annotation parser's own functions (ADR 0031 item 3), so a refusal reads
as ``fracplugin explain`` says it: ``GpuMemoryParameters.gpu-compute.mode="fast"
must be exactly "time-slicing" or "sm-sharing"``. The memory *request* is the
``memory`` capacity the scheduler allocated (``consumedCapacity``).

Several configs may apply to one claim (the DeviceClass's first, then the
claim's, in ``status.allocation.devices.config`` order): ``merge`` lets a
later one's fields win, as Kubernetes orders class and claim configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .. import annotations as ann
from .. import contract as C
from ..model import ComputeMode, FractionError

API_VERSION = "gpu-memory.fracplugin.io/v1alpha1"
KIND = "GpuMemoryParameters"
FIELD_LIMIT = "gpu-memory.limit"
FIELD_MODE = "gpu-compute.mode"
FIELD_PORTION = "gpu-compute.portion"
FIELDS = (FIELD_LIMIT, FIELD_MODE, FIELD_PORTION)
_META = ("apiVersion", "kind")

UNKNOWN_FIELD = "is not a field of " + KIND + " (fields: " + ", ".join(FIELDS) + ")"
NOT_AN_OBJECT = "must be an object with apiVersion " + API_VERSION + " and kind " + KIND
WRONG_API_VERSION = "must be " + API_VERSION
WRONG_KIND = "must be " + KIND
NOT_TEXT = "must be a string or a number"


def field_key(name: str) -> str:
    """The key a refusal names: ``GpuMemoryParameters.<field>``."""
    return f"{KIND}.{name}"


@dataclass(frozen=True)
class GpuMemoryParameters:
    """Checked parameters of one claim.

    Attributes:
        limit_mib: the per-GPU memory limit in MiB (rounded up from bytes), or
            None (the limit is the consumed memory).
        limit_raw: the limit as written (for refusals), "" when absent.
        compute_mode: time-slicing (default) or sm-sharing.
        portion: the compute portion in (0, 1], or None (the planner derives it
            from the memory share, as for annotations).
        given: the fields that were written (for ``explain``).
    """

    limit_mib: int | None = None
    limit_raw: str = ""
    compute_mode: ComputeMode = ComputeMode.TIME_SLICING
    portion: float | None = None
    given: tuple[str, ...] = ()


def _text(name: str, value: Any) -> str:
    """A field's value as the string the contract's parsers take: strings as
    they are, integers and finite floats in their shortest form (YAML writes
    ``0.5`` as a float); anything else (bools, lists, objects) is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FractionError(field_key(name), str(value), NOT_TEXT, "parameters")
    if isinstance(value, float) and not math.isfinite(value):
        raise FractionError(field_key(name), str(value), C.FRACTION_NOT_FINITE, "parameters")
    return repr(value)


def merge(docs: Sequence[Any]) -> dict[str, Any]:
    """One parameters document from several (class first, then claim): the
    later document's fields win. Each must pass ``check_header``. Returns the
    merged fields without ``apiVersion``/``kind``. Raises FractionError."""
    out: dict[str, Any] = {}
    for doc in docs:
        check_header(doc)
        assert isinstance(doc, Mapping)
        out.update({k: v for k, v in doc.items() if k not in _META})
    return out


def check_header(doc: Any) -> None:
    """``doc`` is an object with our ``apiVersion`` and ``kind`` and only
    known fields. Raises FractionError naming the key, value and rule."""
    if not isinstance(doc, Mapping):
        raise FractionError(KIND, str(doc)[:200], NOT_AN_OBJECT, "parameters")
    if doc.get("apiVersion") != API_VERSION:
        raise FractionError("apiVersion", str(doc.get("apiVersion")), WRONG_API_VERSION, "parameters")
    if doc.get("kind") != KIND:
        raise FractionError("kind", str(doc.get("kind")), WRONG_KIND, "parameters")
    for key in doc:
        if key not in FIELDS and key not in _META:
            raise FractionError(field_key(str(key)), str(doc[key])[:200], UNKNOWN_FIELD, "parameters")


def parse(docs: Sequence[Any]) -> GpuMemoryParameters:
    """Check and merge the parameters documents that apply to one claim
    (``merge`` order); none gives the defaults.

    Returns:
        GpuMemoryParameters (limit in MiB, rounded up from bytes).

    Raises:
        FractionError: wrong apiVersion/kind, an unknown field, a value of the
            wrong type, or a value the contract refuses (quantity syntax and
            range, mode, portion range), naming ``GpuMemoryParameters.<field>``,
            the value and the rule (contract.py).
    """
    fields = merge(docs)
    limit_mib: int | None = None
    limit_raw = ""
    if FIELD_LIMIT in fields:
        limit_raw = _text(FIELD_LIMIT, fields[FIELD_LIMIT])
        limit_mib = ann.parse_quantity_mib(field_key(FIELD_LIMIT), limit_raw)
    mode = ComputeMode.TIME_SLICING
    if FIELD_MODE in fields:
        mode = ann.parse_mode(field_key(FIELD_MODE), _text(FIELD_MODE, fields[FIELD_MODE]))
    portion: float | None = None
    if FIELD_PORTION in fields:
        portion = ann.parse_fraction(field_key(FIELD_PORTION), _text(FIELD_PORTION, fields[FIELD_PORTION]),
                                     allow_one=True)
    return GpuMemoryParameters(limit_mib=limit_mib, limit_raw=limit_raw, compute_mode=mode, portion=portion,
                               given=tuple(f for f in FIELDS if f in fields))
