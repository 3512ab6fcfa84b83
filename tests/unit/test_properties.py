"""Property tests of the parser and the planner, in three families:

- **valid annotation sets** (``valid_pods``), built from the contract (README
  "Annotations"; ``annotations.py``): quantities in every unit form, KAI's
  pod-level fractions and MiB, portion limits, both modes by either key,
  portions, GPUs named by UUID, index or CDI name, GPU counts that fit the
  simulated node. Each example carries what the contract says it must get
  (``Expect``); every one of them must plan on an idle node, and get exactly
  that. On a shared ledger the only refusals allowed are node guards, and the
  share that gets a plan is asserted.
- **invalid annotation sets** (``invalid_pods``): a valid set with one key
  broken (a value outside the key's grammar, or a cross-key rule broken);
  the refusal must name that key, its value and the rule (``FractionError``
  ``key``/``value``/``code``).
- **arbitrary strings**: parser and quantity parser are total (a result or a
  FractionError naming the key and value, never another exception).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from hypothesis import event, given, settings, strategies as st

from fracplugin.annotations import parse, parse_quantity_mib
from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import ComputeMode, ContainerPlan, FractionError, FractionRequest, PodRef
from fracplugin.planner import DEFAULT_RESERVE_MIB
from tests.helpers import plan_container
from tests.conftest import NODE_FILE

NODE = load_node(NODE_FILE)
GPU_MIB = min(g.memory_mib for g in NODE.gpus)  # 81559 on every GPU of the example node
USABLE_MIB = GPU_MIB - DEFAULT_RESERVE_MIB  # what fractions resolve against (KAI's binder reserve)
P = "nvidia.com/container.app."
REQUEST, LIMIT = P + "gpu-memory.request", P + "gpu-memory.limit"
MODE, PORTION, DEVICES = P + "gpu-compute.mode", P + "gpu-compute.portion", P + "gpus.devices"
POD_MODE = "kai.scheduler/gpu-compute-sharing-mode"
FRACTION, FRACTION_LIMIT, GPU_MEMORY = "gpu-fraction", "gpu-fraction.limit", "gpu-memory"
NUM_DEVICES, CONTAINER_NAME = "gpu-fraction-num-devices", "gpu-fraction-container-name"
PORTION_LIMIT = "kai.scheduler/container.app.gpu-memory.portion.limit"
MIB = 1 << 20


@dataclass(frozen=True)
class Expect:
    """What the contract says a valid annotation set gets on an idle node."""

    request_mib: int
    limit_mib: int
    mode: ComputeMode
    num_devices: int
    named: tuple[str, ...] | None  # GPU UUIDs in the order the annotation names them; None: the node places
    atp: int | None  # active thread percentage, when the portion is given and the mode is sm-sharing
    portion_given: bool


# --------------------------------------------------------------- valid inputs

def _quantity(mib: int) -> st.SearchStrategy[str]:
    """``mib`` MiB written in one of the Kubernetes quantity forms, each exactly ``mib`` MiB."""
    exact = Decimal(mib)
    forms = [
        f"{mib}Mi",
        f"{mib * 1024}Ki",
        str(mib * MIB),  # bytes
        f"{format(exact / 1024, 'f')}Gi",
        f"{format(exact * MIB / 1000, 'f')}k",
        f"{format(exact * MIB / 10**6, 'f')}M",
    ]
    if mib % 1024 == 0:
        forms.append(f"{mib // 1024}Gi")
    return st.sampled_from(forms)


def _fraction(low: int, high: int) -> st.SearchStrategy[str]:
    """A decimal string n/1000 for n in [low, high] ("0.5", "0.125", "1")."""
    return st.integers(low, high).map(lambda n: str(Decimal(n) / 1000))


def _floor_usable(fraction: str) -> int:
    """KAI's binder formula (docs/reference/gpu-fractioning-reference.md 2b): floor((memory - reserve) x fraction), float64."""
    return math.floor(USABLE_MIB * float(fraction))


@st.composite
def _memory(draw: st.DrawFn, max_mib: int) -> tuple[dict[str, str], int, int]:
    """One memory form of the contract -> (annotations, request MiB, limit MiB)."""
    form = draw(st.sampled_from(["quantity", "limit-only", "fraction", "gpu-memory", "portion-limit"]))
    top = max(1, min(max_mib, GPU_MIB))
    top_frac = max(1, min(999, max_mib * 1000 // USABLE_MIB))  # fractions in thousandths below max_mib
    if form == "quantity":
        req = draw(st.integers(1, top))
        out = {REQUEST: draw(_quantity(req))}
        lim = req
        if draw(st.booleans()):
            lim = draw(st.integers(req, top))
            out[LIMIT] = draw(_quantity(lim))
        return out, req, lim
    if form == "limit-only":  # the request defaults to the limit
        lim = draw(st.integers(1, top))
        return {LIMIT: draw(_quantity(lim))}, lim, lim
    if form == "fraction":
        f = draw(_fraction(1, top_frac))
        out, req = {FRACTION: f}, _floor_usable(f)
        lim = req
        which = draw(st.sampled_from(["none", "fraction-limit", "portion-limit"]))
        n = int(Decimal(f) * 1000)
        if which == "fraction-limit" and n < 1000:  # strictly above the fraction, at most 1
            out[FRACTION_LIMIT] = draw(_fraction(n + 1, 1000))
            lim = _floor_usable(out[FRACTION_LIMIT])
        elif which == "portion-limit":  # at least the fraction, at most 1
            out[PORTION_LIMIT] = draw(_fraction(n, 1000))
            lim = _floor_usable(out[PORTION_LIMIT])
        return out, req, lim
    if form == "gpu-memory":
        req = draw(st.integers(1, top))
        out = {GPU_MEMORY: str(req)}
        lim = req
        if draw(st.booleans()):
            lim = draw(st.integers(req, GPU_MIB))
            out[LIMIT] = draw(_quantity(lim))
        return out, req, lim
    f = draw(_fraction(1, min(1000, top_frac)))  # portion limit alone: the request defaults to it
    return {PORTION_LIMIT: f}, _floor_usable(f), _floor_usable(f)


def _device_entry(index: int) -> st.SearchStrategy[str]:
    uuid = NODE.gpus[index].uuid
    return st.sampled_from([uuid, str(index), f"k8s.device-plugin.nvidia.com/gpu={uuid}",
                            f"k8s.device-plugin.nvidia.com/gpu={index}"])


@st.composite
def valid_pods(draw: st.DrawFn, max_mib: int = GPU_MIB,
               mode: ComputeMode | None = None) -> tuple[dict[str, str], Expect]:
    """A valid annotation set for container ``app`` and what it must get.

    ``max_mib`` bounds the request (a smaller bound packs more tenants per
    GPU); ``mode``: only that compute mode (None: either)."""
    annotations, req, lim = draw(_memory(max_mib))
    if mode is None:
        mode = draw(st.sampled_from(list(ComputeMode)))
    # either key names the mode; without one it is time-slicing (the default)
    mode_key = draw(st.sampled_from([MODE, POD_MODE, None] if mode is ComputeMode.TIME_SLICING else [MODE, POD_MODE]))
    if mode_key is not None:
        annotations[mode_key] = mode.value
    atp, portion_given = None, draw(st.booleans())
    if portion_given:
        portion = draw(_fraction(1, 1000))
        annotations[PORTION] = portion
        if mode is ComputeMode.SM_SHARING:
            atp = max(1, math.floor(float(portion) * 100))  # floor(portion x 100), at least 1 (README)
    named: tuple[str, ...] | None = None
    num = 1
    if draw(st.booleans()):
        order = draw(st.permutations(range(len(NODE.gpus))))
        chosen = order[: draw(st.integers(1, len(NODE.gpus)))]
        annotations[DEVICES] = ",".join(draw(_device_entry(i)) for i in chosen)
        named = tuple(NODE.gpus[i].uuid for i in chosen)
        num = len(chosen)
        if draw(st.booleans()):
            annotations[NUM_DEVICES] = str(num)
    elif draw(st.booleans()):
        num = draw(st.integers(1, len(NODE.gpus)))
        annotations[NUM_DEVICES] = str(num)
    if draw(st.booleans()):
        annotations[CONTAINER_NAME] = "app"
    return annotations, Expect(req, lim, mode, num, named, atp, portion_given)


# ------------------------------------------------------------- invalid inputs

BAD_QUANTITIES = ["", " 4Gi", "4Gi ", "4 Gi", "abc", "-1Gi", "0", "1Ki", "512Ki", "2Ei", "4GB", "1.2.3Mi", "nan", "inf"]
BAD_FRACTIONS = ["", " 0.5", "0", "0.0", "-0.5", "1.5", "2", "x", "nan", "inf", "1e3", "0,5", "½"]
BAD_MODES = ["", "SM-SHARING", "sm_sharing", " time-slicing", "mps", "exclusive"]
BAD_INTEGERS = ["", " 2", "0", "-1", "1.5", "x", "²", "99999999999999999999"]
BAD_DEVICES = ["0,,1", ",", "0,0", "1,GPU-x,1"]
SYNTAX_CODES = {"blank", "whitespace", "quantity", "fraction", "mode", "integer", "devices"}


def _bad_values(key: str) -> list[str]:
    if key in (REQUEST, LIMIT):
        return BAD_QUANTITIES
    if key in (FRACTION, FRACTION_LIMIT, PORTION_LIMIT, PORTION):
        return BAD_FRACTIONS + (["1"] if key == FRACTION else [])  # gpu-fraction is in (0, 1)
    if key in (MODE, POD_MODE):
        return BAD_MODES
    if key == GPU_MEMORY:
        return BAD_INTEGERS
    if key == NUM_DEVICES:
        return BAD_INTEGERS + ["65"]  # at most 64 devices
    if key == DEVICES:
        return BAD_DEVICES
    raise AssertionError(key)


@st.composite
def invalid_pods(draw: st.DrawFn) -> tuple[dict[str, str], str, str, set[str]]:
    """(annotations, the broken key, its value, the rule codes it may be refused with)."""
    annotations, expect = draw(valid_pods())
    rule = draw(st.sampled_from(["syntax", "syntax", "syntax", "limit_below_request", "too_large", "device",
                                 "num_devices"]))
    if rule == "limit_below_request" and expect.request_mib > 1 and (REQUEST in annotations
                                                                      or GPU_MEMORY in annotations):
        annotations.pop(FRACTION_LIMIT, None)
        annotations.pop(PORTION_LIMIT, None)
        annotations[LIMIT] = draw(_quantity(draw(st.integers(1, expect.request_mib - 1))))
        return annotations, LIMIT, annotations[LIMIT], {"limit_below_request"}
    if rule == "too_large" and REQUEST in annotations:
        annotations.pop(LIMIT, None)
        annotations[REQUEST] = draw(_quantity(draw(st.integers(GPU_MIB + 1, 4 * GPU_MIB))))
        return annotations, REQUEST, annotations[REQUEST], {"too_large"}
    if rule == "device" and DEVICES in annotations:
        annotations.pop(NUM_DEVICES, None)
        bad = draw(st.sampled_from(["4", "9", "GPU-00000000-0000-0000-0000-000000000000",
                                    "k8s.device-plugin.nvidia.com/gpu=7"]))
        annotations[DEVICES] = annotations[DEVICES] + "," + bad
        return annotations, DEVICES, annotations[DEVICES], {"device"}
    if rule == "num_devices":
        if DEVICES in annotations:  # does not match the devices named
            n = draw(st.integers(1, 8).filter(lambda n: n != expect.num_devices))
            annotations[NUM_DEVICES] = str(n)
            return annotations, NUM_DEVICES, str(n), {"devices"}
        annotations[NUM_DEVICES] = str(draw(st.integers(len(NODE.gpus) + 1, 64)))  # more than the node has
        return annotations, NUM_DEVICES, annotations[NUM_DEVICES], {"device"}
    key = draw(st.sampled_from(sorted(k for k in annotations if k != CONTAINER_NAME)))
    annotations[key] = draw(st.sampled_from(_bad_values(key)))
    return annotations, key, annotations[key], SYNTAX_CODES


# ---------------------------------------------------------------- properties

def _plan(annotations: dict[str, str], ledger: Ledger, i: int = 0) -> ContainerPlan | None:
    return plan_container(annotations, "app", PodRef("ns", f"p{i}", f"u{i}"), NODE, ledger)


@settings(max_examples=400, deadline=None)
@given(valid_pods())
def test_every_valid_annotation_set_plans_on_an_idle_node_as_the_contract_says(case):
    annotations, want = case
    plan = _plan(annotations, Ledger(NODE))  # a FractionError here fails the test: valid input must plan
    assert isinstance(plan, ContainerPlan)
    assert (plan.request_mib, plan.limit_mib, plan.compute_mode) == (want.request_mib, want.limit_mib, want.mode)
    uuids = tuple(g.uuid for g in plan.devices)
    if want.named is not None:
        assert uuids == want.named and not plan.placed_by_node
    else:  # idle node: the lowest indices (fewest tenants first, then index)
        assert uuids == tuple(g.uuid for g in NODE.gpus[: want.num_devices]) and plan.placed_by_node
    env = plan.env
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == str(want.request_mib)
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == str(want.limit_mib)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == ",".join(f"{u}={want.limit_mib}M" for u in uuids)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    if want.mode is ComputeMode.TIME_SLICING:
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env and plan.active_thread_percentage is None
    elif want.portion_given:
        assert plan.active_thread_percentage == want.atp
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(want.atp)
    else:  # the portion KAI would write caps it (ADR 0005)
        assert 1 <= plan.active_thread_percentage <= 100


@settings(max_examples=400, deadline=None)
@given(invalid_pods())
def test_an_invalid_annotation_set_is_refused_naming_key_value_and_rule(case):
    annotations, key, value, codes = case
    try:
        _plan(annotations, Ledger(NODE))
    except FractionError as err:
        # the value verbatim, cut after 256 characters (FractionError.MAX_QUOTED)
        quoted = value if len(value) <= 256 else f"{value[:256]}... ({len(value)} characters)"
        assert (err.key, err.value) == (key, quoted), (err.key, err.value, err.reason)
        assert err.code in codes, (err.code, err.reason)
        assert err.reason and f'{key}="{quoted}"' in str(err)
        event(f"refused: {err.code}")
    else:
        raise AssertionError(f"{key}={value!r} was accepted in {annotations}")


def test_valid_pods_share_a_ledger_and_most_get_a_plan():
    """Up to six valid pods planned one after the other on one ledger: each
    gets a plan that fits (admitted; ledger invariants hold) or is refused by a
    node guard (no fit, one mode per GPU), never by the parser; at least 80 %
    of them get a plan (requests up to a quarter of a GPU; in two examples of
    three every pod has the same compute mode, in the third they mix)."""
    counts = {"planned": 0, "guard": 0}

    @settings(max_examples=200, deadline=None)
    @given(st.sampled_from([ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING, None]).flatmap(
        lambda mode: st.lists(valid_pods(max_mib=GPU_MIB // 4, mode=mode), min_size=1, max_size=6)))
    def run(pods: list[tuple[dict[str, str], Expect]]) -> None:
        ledger = Ledger(NODE)
        for i, (annotations, want) in enumerate(pods):
            try:
                plan = _plan(annotations, ledger, i)
            except FractionError as err:
                assert err.code in ("no_fit", "guard"), (err.code, str(err))
                assert i > 0  # the first pod meets an idle node
                counts["guard"] += 1
                event("refused by a node guard")
                continue
            assert plan is not None
            assert (plan.request_mib, plan.limit_mib, plan.compute_mode) == (want.request_mib, want.limit_mib,
                                                                            want.mode)
            assert len(plan.devices) == want.num_devices
            ledger.admit(plan)  # a plan made against the ledger always fits it
            assert ledger.check_invariants() == []
            counts["planned"] += 1
            event("planned")

    run()
    total = counts["planned"] + counts["guard"]
    assert total > 0 and counts["planned"] / total >= 0.8, counts


# ------------------------------------------------------------ arbitrary input

quantities = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"\A[+-]?[0-9]{1,6}(\.[0-9]{1,3})?(Ki|Mi|Gi|Ti|k|M|G|T|m|e[0-9]{1,3})?\Z"),
)
fractions = st.one_of(st.text(max_size=6), st.floats(allow_nan=True, allow_infinity=True).map(str),
                      st.sampled_from(["0.5", "1", "0", "0.8", "1.5"]))
arbitrary = st.fixed_dictionaries({}, optional={
    REQUEST: quantities,
    LIMIT: quantities,
    MODE: st.one_of(st.text(max_size=14), st.sampled_from(["sm-sharing", "time-slicing"])),
    PORTION: fractions,
    DEVICES: st.one_of(st.text(max_size=20), st.sampled_from(["0", "0,1", "1,3", NODE.gpus[2].uuid, "9"])),
    FRACTION: fractions,
    FRACTION_LIMIT: fractions,
    GPU_MEMORY: st.one_of(st.text(max_size=6), st.integers(-5, 100000).map(str)),
    NUM_DEVICES: st.one_of(st.text(max_size=3), st.integers(-1, 6).map(str)),
    CONTAINER_NAME: st.sampled_from(["app", "other", ""]),
    PORTION_LIMIT: fractions,
})


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=30))
def test_quantity_parser_total(raw):
    try:
        mib = parse_quantity_mib("k", raw)
    except FractionError as err:
        assert err.key == "k" and err.value == raw and err.reason
    else:
        assert 1 <= mib <= 2**30


@settings(max_examples=400, deadline=None)
@given(arbitrary)
def test_parser_total_on_arbitrary_strings(annotations):
    try:
        r = parse(annotations, "app")
    except FractionError as err:
        assert err.key in annotations and err.value == annotations[err.key]
        return
    assert r is None or isinstance(r, FractionRequest)
    if r is not None:
        assert r.num_devices >= 1
        if r.request.mib is not None and r.limit.mib is not None:
            assert r.limit.mib >= r.request.mib
