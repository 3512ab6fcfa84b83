"""The annotation contract's value rules, written once for both checkers.

``annotations.py`` (the node daemon and ``fracplugin explain``) and
``fracplugin_demo/admission.py`` (the CEL of the chart's ValidatingAdmissionPolicy, ADR 0026)
build every refusal from the patterns, bounds and reasons here, so the
message ``kubectl apply`` shows and the one ``explain`` prints cannot drift.

Reasons are templates: ``{raw}`` is the annotation's value and ``{mib}`` a
whole number of MiB computed from it; ``render`` fills them in Python and
``admission.cel_template`` turns them into CEL string concatenations.

Units (issue 27 item 4): the per-container ``.gpu-memory.request`` /
``.gpu-memory.limit`` keys are Kubernetes quantities **in bytes** (``40Gi``;
a bare ``40960`` is 40960 bytes), KAI's pod-level ``gpu-memory`` is a whole
number **of MiB** per GPU (``20480``; ``20Gi`` is refused); each refusal of
these keys says which, with a "did you mean" for the other unit's spelling.
Sources: the reference node stack's parser and KAI's pod-level forms
(docs/reference/gpu-fractioning-reference.md sections 2a and 2b).
"""

from __future__ import annotations

MIB = 1 << 20
# Larger than any GPU for decades; anything above is a typo (e.g. "40Ei").
MAX_QUANTITY_BYTES = 1 << 50  # 1 PiB
MAX_GPU_MEMORY_MIB = MAX_QUANTITY_BYTES // MIB
MAX_DEVICES = 64

# Value syntax, without anchors (Python adds ``^...\Z``, CEL/RE2 ``^...$``).
#: The Kubernetes quantity grammar (apimachinery resource.ParseQuantity).
QUANTITY_PATTERN = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?"
#: A plain decimal number (fractions, portions): no sign, no suffix.
DECIMAL_PATTERN = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
#: ASCII digits only (str.isdigit() accepts "²", "١").
INT_PATTERN = r"[0-9]+"

# ---- reasons (the text after ``<key>="<value>" ``) ------------------------------
BLANK = "is blank: give a value or remove the annotation"
PADDED = "has leading or trailing whitespace"

#: What the per-container memory keys are, said in every refusal of them.
BYTES_UNIT = "this key is a Kubernetes quantity in bytes (40Gi, 4096Mi, 42949672960)"
QUANTITY_SYNTAX = "is not a Kubernetes quantity (examples: 40Gi, 4096M, 1.5G, 4294967296); " + BYTES_UNIT
QUANTITY_NOT_FINITE = "is not a finite quantity; " + BYTES_UNIT
QUANTITY_NEGATIVE = "is negative: GPU memory must be at least 1Mi; " + BYTES_UNIT
QUANTITY_ABSURD = "is absurdly large: GPU memory above 1Pi is refused; " + BYTES_UNIT
QUANTITY_BELOW_MIB = "is below 1Mi: GPU memory must be at least 1Mi (1048576 bytes); " + BYTES_UNIT
#: Appended to QUANTITY_BELOW_MIB when the value is a bare positive integer
#: (someone wrote MiB, as KAI's pod-level ``gpu-memory`` takes).
QUANTITY_MIB_HINT = "; did you mean {raw}Mi?"

#: What KAI's pod-level ``gpu-memory`` is, said in every refusal of it.
MIB_UNIT = "gpu-memory is a whole number of MiB per GPU (KAI's pod-level form, e.g. 20480)"
#: What ``gpu-fraction-num-devices`` is.
GPUS_UNIT = "gpu-fraction-num-devices is a whole number of GPUs (e.g. 2)"
INT_NOT_WHOLE = "is not a whole number"
INT_AT_LEAST_1 = "must be at least 1"
INT_AT_MOST = "must be at most {maximum}"
#: Appended to a ``gpu-memory`` refusal whose value is a quantity of at least
#: 1Mi (``20Gi``): the MiB it means, rounded up.
MIB_QUANTITY_HINT = '; did you mean "{mib}" (MiB)?'

FRACTION_SYNTAX = "is not a decimal number (example: 0.5)"
FRACTION_NOT_FINITE = "is not a finite number"
FRACTION_OUTSIDE = "is outside (0, {upper}"

MODE = 'must be exactly "time-slicing" or "sm-sharing"'

DEVICES_EMPTY_ENTRY = "has an empty entry: give a comma list of GPU UUIDs or indices"
DEVICES_TWICE = "names a device twice"
DEVICES_TOO_MANY = f"names more than {MAX_DEVICES} devices"
DEVICES_COUNT_MISMATCH = "does not match the {count} device(s) in {devices_key}"

CONTAINER_NOT_IN_POD = "names no container of this pod"

FRACTION_LIMIT_NOT_ABOVE = 'is not above {fraction_key}="{fraction_raw}": the limit must be greater than the fraction'
LIMIT_BELOW_REQUEST_MIB = "is below the request {request_raw} ({request_mib} MiB): the limit must be >= the request"
LIMIT_BELOW_REQUEST_FRACTION = "is below the request {request_raw}: the limit must be >= the request"


def int_unit(key: str) -> str:
    """The unit sentence of a whole-number key (``gpu-memory``: MiB per GPU;
    ``gpu-fraction-num-devices``: GPUs); empty for any other key."""
    return {"gpu-memory": MIB_UNIT, "gpu-fraction-num-devices": GPUS_UNIT}.get(key, "")


def with_unit(reason: str, unit: str) -> str:
    """``reason`` followed by ``; <unit>`` when there is a unit sentence."""
    return f"{reason}; {unit}" if unit else reason
