"""The annotation contract as a Kubernetes ValidatingAdmissionPolicy (CEL).

ADR 0026. ``policy_objects`` builds the ValidatingAdmissionPolicy and its
binding that refuse, at ``kubectl apply``, a pod whose fracplugin annotations
break the contract, with the message ``fracplugin explain`` (and the node
daemon, at CreateContainer) gives: ``<key>="<value>" <reason>``.

Everything is generated from the contract's one definition: the keys and the
order in which ``annotations.parse_uncached`` reads them, the patterns,
bounds and reason templates of ``contract.py``. What CEL evaluates and what
Python evaluates are two spellings of each predicate; the apiserver test
(tests/admission_e2e) runs the contract's table of bad annotations through
both. ``scripts/render_admission_policy.py`` writes the Helm template
(deploy/helm/fracplugin/templates/admissionpolicy.yaml); a unit test keeps the
committed file equal to its output.

What the policy checks, per app container ``n`` of the pod, in
``parse_uncached``'s order, stopping at the first refusal: the per-container
memory quantities, ``gpu-fraction-container-name``, KAI's pod-level forms
for the container they apply to, KAI's portion limit, both compute-mode keys,
the portion, the device list, limit >= request, and
``gpu-fraction-num-devices``. What it cannot check is node-side: which GPUs
exist, room, one mode per GPU, clients per GPU.

CEL used: Kubernetes' quantity library (``isQuantity``, ``quantity``,
``isLessThan``, ``isGreaterThan``, ``asApproximateFloat``; not ``sign``:
k8s.io/apiserver v0.37 declares it a global function though its docs call it
a method), the
strings extension (``trim``, ``split``), the lists library (``indexOf``,
``lastIndexOf``) and RE2 ``matches``; all in the CEL environment of
Kubernetes >= 1.30 (ValidatingAdmissionPolicy v1).

Known differences (all on values no one writes): a value with a control
character is quoted verbatim here and escaped in Python (with a line break the
API server shows ``STATIC_MESSAGE`` instead); ``MiB`` rounding of a limit
compared with its request uses a float (exact below 2**53 bytes).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fracplugin import annotations as A
from fracplugin import contract as C
from fracplugin.model import ComputeMode, FractionError

POLICY_NAME = "fracplugin-annotations"
STATIC_MESSAGE = ("a fracplugin annotation of this pod breaks the contract (docs/user-guide.md \"Annotations\"); "
                  "`fracplugin explain POD.yaml --node NODE.yaml` names the key, the value and the rule")
VALIDATION_ACTIONS = ("Deny", "Warn")

# ---- CEL spelling helpers ------------------------------------------------------


def lit(text: str) -> str:
    """A CEL string literal holding ``text`` (single-quoted, backslash escapes)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def regex(pattern: str) -> str:
    """A CEL literal of an RE2 pattern anchored at both ends."""
    return lit(f"^(?:{pattern})$")


_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def cel_template(template: str, **exprs: str) -> str:
    """The CEL string expression of a ``contract`` reason template: literal
    text joined with the CEL expressions given for its ``{name}`` slots.
    Raises KeyError for a slot without an expression."""
    parts: list[str] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        if m.start() > pos:
            parts.append(lit(template[pos:m.start()]))
        parts.append(f"({exprs[m.group(1)]})")
        pos = m.end()
    if pos < len(template):
        parts.append(lit(template[pos:]))
    return " + ".join(parts) if parts else "''"


ANN = "variables.ann"


def has(key: str) -> str:
    """CEL: the annotation whose key is the CEL expression ``key`` is present."""
    return f"(({key}) in {ANN})"


def val(key: str) -> str:
    """CEL: the value of the annotation whose key is the CEL expression ``key``."""
    return f"{ANN}[{key}]"


def quoted(v: str) -> str:
    """CEL: the value ``v`` as FractionError quotes it: verbatim up to
    ``MAX_QUOTED`` characters, else cut there with the length appended."""
    n = FractionError.MAX_QUOTED
    return f"(size({v}) > {n} ? {v}.substring(0, {n}) + '... (' + string(size({v})) + ' characters)' : {v})"


def message(key: str, reason: str) -> str:
    """CEL: ``<key>="<value>" <reason>`` (FractionError.message), ``reason`` a CEL expression."""
    return f"{key} + '=\"' + {quoted(val(key))} + '\" ' + {reason}"


Check = tuple[str, str]
"""(CEL condition that the value is refused, CEL message expression)."""


def _refusals(key: str, steps: list[tuple[str, str]]) -> list[Check]:
    """Checks of one key: each step is (condition on ``v``, reason CEL); ``v``
    stands for the value and is replaced by ``val(key)``."""
    v = val(key)
    return [(cond.replace("$v", v), message(key, reason.replace("$v", v))) for cond, reason in steps]


def _padding() -> list[tuple[str, str]]:
    return [("$v == ''", lit(C.BLANK)), ("$v.trim() != $v", lit(C.PADDED))]


def _mib_ceil(q: str) -> str:
    """CEL int: the quantity expression ``q`` in MiB, rounded up."""
    x = f"({q}.asApproximateFloat() / {float(C.MIB)})"
    return f"(int({x}) + (double(int({x})) < {x} ? 1 : 0))"


QTY = "quantity($v)"


def quantity_checks(key: str) -> list[Check]:
    """annotations.parse_quantity_mib: a quantity in bytes in [1Mi, 1Pi]."""
    hint = (f"($v.matches({regex(C.INT_PATTERN)}) && {QTY}.isGreaterThan(quantity('0')) ? "
            f"{cel_template(C.QUANTITY_MIB_HINT, raw='$v')} : '')")
    return _refusals(key, _padding() + [
        (f"!$v.matches({regex(C.QUANTITY_PATTERN)}) || !isQuantity($v)", lit(C.QUANTITY_SYNTAX)),
        (f"{QTY}.isLessThan(quantity('0'))", lit(C.QUANTITY_NEGATIVE)),
        (f"{QTY}.isGreaterThan(quantity('1Pi'))", lit(C.QUANTITY_ABSURD)),
        (f"{QTY}.isLessThan(quantity('1Mi'))", f"{lit(C.QUANTITY_BELOW_MIB)} + {hint}"),
    ])


#: The largest finite double: a decimal above it is ``inf`` for Python's float().
_MAX_DOUBLE = "1.7976931348623157e308"


def fraction_checks(key: str, *, allow_one: bool) -> list[Check]:
    """annotations.parse_fraction: a decimal in (0, 1] or (0, 1)."""
    upper = "1]" if allow_one else "1)"
    outside = "double($v) <= 0.0 || double($v) > 1.0" + ("" if allow_one else " || double($v) == 1.0")
    return _refusals(key, _padding() + [
        (f"!$v.matches({regex(C.DECIMAL_PATTERN)})", lit(C.FRACTION_SYNTAX)),
        (f"isQuantity($v) && {QTY}.isGreaterThan(quantity('{_MAX_DOUBLE}'))", lit(C.FRACTION_NOT_FINITE)),
        (outside, lit(C.FRACTION_OUTSIDE.format(upper=upper))),
    ])


def mode_checks(key: str) -> list[Check]:
    """annotations.parse_mode: exactly one of the compute modes."""
    modes = " && ".join(f"$v != {lit(m.value)}" for m in ComputeMode)
    return _refusals(key, [(modes, lit(C.MODE))])


def positive_int_checks(key_name: str, *, maximum: int) -> list[Check]:
    """annotations._parse_positive_int: a whole number in [1, maximum], each
    reason with the key's unit; ``gpu-memory`` gets the MiB hint of a quantity."""
    unit = C.int_unit(key_name)
    hint = "''"
    if key_name == A.KEY_GPU_MEMORY:
        within = (f"$v.matches({regex(C.QUANTITY_PATTERN)}) && isQuantity($v) && "
                  f"!{QTY}.isLessThan(quantity('1Mi')) && !{QTY}.isGreaterThan(quantity('1Pi'))")
        hint = f"({within} ? {cel_template(C.MIB_QUANTITY_HINT, mib=f'string({_mib_ceil(QTY)})')} : '')"
    at_most = lit(C.with_unit(C.INT_AT_MOST.format(maximum=maximum), unit))
    at_least = lit(C.with_unit(C.INT_AT_LEAST_1, unit))
    return _refusals(lit(key_name), _padding() + [
        (f"$v.matches({regex('-' + C.INT_PATTERN)})", at_least),
        (f"!$v.matches({regex(C.INT_PATTERN)})", f"{lit(C.with_unit(C.INT_NOT_WHOLE, unit))} + {hint}"),
        (f"size($v) > {len(str(maximum))}", at_most),
        ("int($v) < 1", at_least),
        (f"int($v) > {maximum}", at_most),
    ])


#: Largest device list (characters, entries) checked for a device named twice:
#: the check is quadratic and CEL has no set to make it linear; beyond these a
#: list of more than MAX_DEVICES entries is refused as too long (Python may
#: say "twice" first) and a shorter one with a repeat is left to the node.
DUPLICATE_CHECK_MAX_CHARS = 4096
DUPLICATE_CHECK_MAX_ENTRIES = 2 * C.MAX_DEVICES


def devices_checks(key: str) -> list[Check]:
    """annotations._parse_devices: no empty entry, none twice (lists within
    ``DUPLICATE_CHECK_MAX_*``, the CEL cost limit), at most MAX_DEVICES."""
    entries = "$v.split(',').map(e, e.trim())"
    small = f"size($v) <= {DUPLICATE_CHECK_MAX_CHARS} && size($v.split(',')) <= {DUPLICATE_CHECK_MAX_ENTRIES}"
    return _refusals(key, [
        (f"{entries}.exists(e, e == '')", lit(C.DEVICES_EMPTY_ENTRY)),
        (f"{small} && {entries}.exists(e, {entries}.indexOf(e) != {entries}.lastIndexOf(e))", lit(C.DEVICES_TWICE)),
        (f"size({entries}) > {C.MAX_DEVICES}", lit(C.DEVICES_TOO_MANY)),
    ])


def chain(checks: list[Check]) -> str:
    """CEL string: the message of the first refused check of ``checks`` (a
    ternary chain, so a check is evaluated only when those before it passed:
    ``quantity(v)`` only once ``isQuantity(v)`` holds), ``''`` when none is."""
    out = "''"
    for cond, msg in reversed(checks):
        out = f"({cond}) ? ({msg}) : ({out})"
    return out


def element(guard: str, checks: list[Check]) -> str:
    """CEL string: ``chain(checks)`` where the CEL condition ``guard`` holds, else ``''``."""
    return f"({guard}) ? ({chain(checks)}) : ''"


def qty_valid(x: str) -> str:
    """CEL: ``x`` is a quantity in [0, 1Pi], so ``_mib_ceil(quantity(x))`` can be
    evaluated (``1e400`` is a quantity whose float is +Inf: ``int()`` of it errs)."""
    return (f"{x}.matches({regex(C.QUANTITY_PATTERN)}) && isQuantity({x}) && "
            f"!quantity({x}).isGreaterThan(quantity('1Pi')) && !quantity({x}).isLessThan(quantity('0'))")


def frac_valid(x: str) -> str:
    """CEL: ``double(x)`` can be evaluated (a decimal below the largest double)."""
    return f"{x}.matches({regex(C.DECIMAL_PATTERN)}) && isQuantity({x}) && !quantity({x}).isGreaterThan(quantity('{_MAX_DOUBLE}'))"


def int_valid(x: str) -> str:
    """CEL: ``int(x)`` can be evaluated (at most 18 digits)."""
    return f"{x}.matches({regex(C.INT_PATTERN)}) && size({x}) <= 18"


def container_elements() -> list[str]:
    """CEL string expressions, one per key (or cross-key rule) that
    ``annotations.parse_uncached`` checks for container ``n`` (a CEL variable
    bound by ``problems_expression``) with the pod's app container names
    then native sidecars ``variables.names`` (``NAMES_EXPRESSION``), in the order it checks them: each is the refusal of
    that key, or ``''``. The first non-empty one is the refusal Python raises
    (it stops there; each element here evaluates only what it can, so a later
    one may be non-empty too, and is not reported). A cross-key rule reads
    only values that parse (``qty_valid``...): a value that does not is
    refused by an earlier element."""
    def ckey(suffix: str) -> str:
        return f"variables.prefix + n + {lit(suffix)}"

    req, lim = ckey(A.SUFFIX_REQUEST), ckey(A.SUFFIX_LIMIT)
    mode_k, portion_k, dev_k = ckey(A.SUFFIX_MODE), ckey(A.SUFFIX_PORTION), ckey(A.SUFFIX_DEVICES)
    before, after = A.KAI_PORTION_LIMIT.split("{c}")
    kai_limit = f"{lit(before)} + n + {lit(after)}"
    gf, gfl, gm = lit(A.KEY_GPU_FRACTION), lit(A.KEY_GPU_FRACTION_LIMIT), lit(A.KEY_GPU_MEMORY)
    nd, cn, pmode = lit(A.KEY_NUM_DEVICES), lit(A.KEY_CONTAINER_NAME), lit(A.KEY_POD_COMPUTE_MODE)

    applies = f"({has(cn)} ? {val(cn)} == n : variables.names[0] == n)"
    req_fraction = f"{applies} && !{has(req)} && {has(gf)}"
    req_mib_pod = f"{applies} && !{has(req)} && !{has(gf)} && {has(gm)}"
    lim_pod = f"{applies} && !{has(lim)} && {has(gfl)}"
    lim_set = f"({has(lim)} || ({lim_pod}))"
    kai = f"!{lim_set} && {has(kai_limit)}"
    req_set = f"({has(req)} || ({applies} && ({has(gf)} || {has(gm)})))"
    fractional = f"({req_set} || {lim_set} || {has(kai_limit)})"
    devices_named = f"{has(dev_k)} && {val(dev_k)}.trim() != ''"

    out = [
        element(has(req), quantity_checks(req)),
        element(has(lim), quantity_checks(lim)),
        element(has(cn), _refusals(cn, _padding() + [("!($v in variables.names)", lit(C.CONTAINER_NOT_IN_POD))])),
        element(req_fraction, fraction_checks(gf, allow_one=False)),
        element(req_mib_pod, positive_int_checks(A.KEY_GPU_MEMORY, maximum=C.MAX_GPU_MEMORY_MIB)),
        element(lim_pod, fraction_checks(gfl, allow_one=True)),
        element(f"({lim_pod}) && ({req_fraction}) && {frac_valid(val(gfl))} && {frac_valid(val(gf))}", [
            (f"double({val(gfl)}) <= double({val(gf)})",
             message(gfl, cel_template(C.FRACTION_LIMIT_NOT_ABOVE, fraction_key=gf, fraction_raw=val(gf))))]),
        element(kai, fraction_checks(kai_limit, allow_one=True)),
        element(has(mode_k), mode_checks(mode_k)),
        element(f"!{has(mode_k)} && {has(pmode)}", mode_checks(pmode)),
        element(has(portion_k), fraction_checks(portion_k, allow_one=True)),
        element(devices_named, devices_checks(dev_k)),
    ]
    # limit >= request, when both are MiB (a per-container limit against the
    # per-container request or KAI's gpu-memory) or both fractions (KAI's
    # portion limit against gpu-fraction); reached only for a fractional container
    lim_mib = _mib_ceil(f"quantity({val(lim)})")
    for req_cond, req_raw, req_mib in (
        (f"{has(req)} && {qty_valid(val(req))}", val(req), _mib_ceil(f"quantity({val(req)})")),
        (f"{req_mib_pod} && {int_valid(val(gm))}", val(gm), f"int({val(gm)})"),
    ):
        reason = cel_template(C.LIMIT_BELOW_REQUEST_MIB, request_raw=req_raw, request_mib=f"string({req_mib})")
        out.append(element(f"{fractional} && {has(lim)} && {qty_valid(val(lim))} && ({req_cond})",
                           [(f"{lim_mib} < {req_mib}", message(lim, reason))]))
    out.append(element(f"{fractional} && ({kai}) && ({req_fraction}) && {frac_valid(val(kai_limit))} && "
                       f"{frac_valid(val(gf))}",
                       [(f"double({val(kai_limit)}) < double({val(gf)})",
                         message(kai_limit, cel_template(C.LIMIT_BELOW_REQUEST_FRACTION, request_raw=val(gf))))]))
    nd_applies = f"{fractional} && {applies} && {has(nd)}"
    out.append(element(nd_applies, positive_int_checks(A.KEY_NUM_DEVICES, maximum=C.MAX_DEVICES)))
    count = f"size({val(dev_k)}.split(','))"
    out.append(element(f"{nd_applies} && ({devices_named}) && {int_valid(val(nd))}", [
        (f"int({val(nd)}) != {count}",
         message(nd, cel_template(C.DEVICES_COUNT_MISMATCH, count=f"string({count})", devices_key=dev_k)))]))
    return out


SIDECARS_EXPRESSION = ("(has(object.spec.initContainers) ? object.spec.initContainers.filter(c, "
                       "has(c.restartPolicy) && c.restartPolicy == 'Always').map(c, c.name) : [])")
"""CEL list(string): the pod's native sidecars (``annotations.native_sidecars``)."""

NAMES_EXPRESSION = f"object.spec.containers.map(c, c.name) + {SIDECARS_EXPRESSION}"
"""CEL list(string), the policy's ``variables.names``: the containers the
pod-level forms may apply to, as ``annotations.form_targets`` lists them
(the app containers in spec order, then the native sidecars: init containers
with ``restartPolicy: Always``). ``variables.names[0]`` is the first app
container."""


def problems_expression() -> str:
    """CEL list(list(string)): per native sidecar, then app container, with a refusal, the non-empty
    ``container_elements``; the first string of the first list is the message."""
    items = ",\n  ".join(container_elements())
    # in the order the containers start (native sidecars first), as explain lists them: the first refusal is
    # the one explain reports first
    order = f"{SIDECARS_EXPRESSION} + object.spec.containers.map(c, c.name)"
    return f"({order}).map(n, [\n  {items}\n].filter(m, m != '')).filter(l, size(l) > 0)"


def policy_objects(*, prefix_expression: str, validation_actions: list[str] | str,
                   failure_policy: str = "Ignore", name: str = POLICY_NAME) -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicy and its binding (admissionregistration.k8s.io/v1).

    Args:
        prefix_expression: CEL expression of the per-container key prefix
            (``lit("nvidia.com/container.")``; the Helm template puts the
            chart's ``annotationPrefix`` there).
        validation_actions: ``["Deny"]`` or ``["Warn"]`` (or a template
            placeholder string).
        failure_policy: what the API server does when the CEL cannot be
            evaluated (``Ignore``: the pod is admitted and the node still
            checks it; ``Fail``: it is refused).
        name: object names.

    Matches pod CREATE only: annotations are read when the pod's containers are
    created, and a pod admitted before the policy existed must stay updatable.
    """
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": failure_policy,
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"],
            }]},
            "variables": [
                {"name": "prefix", "expression": prefix_expression},
                {"name": "ann", "expression":
                    "has(object.metadata.annotations) ? object.metadata.annotations : {'': ''}"},
                {"name": "names", "expression": NAMES_EXPRESSION},
                {"name": "problems", "expression": problems_expression()},
            ],
            "validations": [{
                "expression": "size(variables.problems) == 0",
                "messageExpression": "variables.problems[0][0]",
                # shown when the message cannot be (a value with a line break)
                "message": STATIC_MESSAGE,
                "reason": "Invalid",
            }],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": validation_actions},
    }
    return [policy, binding]


TEMPLATE_HEADER = """\
{{- /*
GENERATED by scripts/render_admission_policy.py from src/fracplugin/contract.py and
annotations.py (ADR 0026): do not edit; run `python scripts/render_admission_policy.py`.
tests/unit/test_admission_policy.py fails when this file is not the script's output.
*/ -}}
"""


def helm_template() -> str:
    """The chart template (templates/admissionpolicy.yaml): ``policy_objects``
    with the chart's values in place, rendered only with
    ``admissionPolicy.enabled``; each string a JSON (so YAML) double-quoted
    scalar, so no CEL text is read as YAML or template syntax."""
    prefix_slot, actions_slot, failure_slot = "@@PREFIX@@", "@@ACTIONS@@", "@@FAILURE@@"
    objs = policy_objects(prefix_expression=prefix_slot, validation_actions=actions_slot,
                          failure_policy=failure_slot, name="@@NAME@@")
    docs = []
    for obj in objs:
        text = _yaml_json(obj)
        if "{{" in text or "}}" in text:
            raise ValueError("generated CEL contains '{{' or '}}', which Helm would read as template syntax")
        docs.append(text)
    body = "---\n".join(docs)
    body = (body
            .replace('"@@PREFIX@@"', "{{ .Values.annotationPrefix | toJson | toJson }}")
            .replace('"@@ACTIONS@@"', "{{ .Values.admissionPolicy.validationActions | toJson }}")
            .replace('"@@FAILURE@@"', "{{ .Values.admissionPolicy.failurePolicy | toJson }}")
            .replace('"@@NAME@@"', '{{ include "fracplugin.fullname" . }}-annotations'))
    labels = "  labels:\n    {{- include \"fracplugin.labels\" . | nindent 4 }}\n"
    body = body.replace("metadata:\n  name: ", labels.join(["metadata:\n", "  name: "]))
    return TEMPLATE_HEADER + "{{- if .Values.admissionPolicy.enabled }}\n" + body + "{{- end }}\n"


def _yaml_json(obj: Any, indent: int = 0) -> str:
    """Block YAML of ``obj``: multi-line strings as ``|-`` block scalars (no
    line of them may start with a space: the block's indentation would change),
    every other scalar written as JSON (valid YAML)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:\n" + _yaml_json(v, indent + 1))
            elif isinstance(v, str) and "\n" in v:  # a block scalar: the CEL as it reads
                body = "".join(f"{pad}  {line}\n" if line else "\n" for line in v.split("\n"))
                lines.append(f"{pad}{k}: |-\n{body}")
            else:
                lines.append(f"{pad}{k}: {json.dumps(v)}\n")
    else:
        for v in obj:
            if isinstance(v, (dict, list)) and v:
                inner = _yaml_json(v, indent + 1)
                lines.append(f"{pad}- " + inner[len(pad) + 2:])
            else:
                lines.append(f"{pad}- {json.dumps(v)}\n")
    return "".join(lines)
