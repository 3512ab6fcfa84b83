"""Property tests: parser and planner fed arbitrary strings and annotation maps
either return a valid result or raise FractionError, never anything else."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from fracplugin.annotations import parse, parse_quantity_mib
from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import ContainerPlan, FractionError, FractionRequest, PodRef
from fracplugin.planner import plan_container
from tests.conftest import NODE_FILE

NODE = load_node(NODE_FILE)
P = "nvidia.com/container.app."

quantities = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"\A[+-]?[0-9]{1,6}(\.[0-9]{1,3})?(Ki|Mi|Gi|Ti|k|M|G|T|m|e[0-9]{1,3})?\Z"),
)
fractions = st.one_of(st.text(max_size=6), st.floats(allow_nan=True, allow_infinity=True).map(str),
                      st.sampled_from(["0.5", "1", "0", "0.8", "1.5"]))
values = {
    P + "gpu-memory.request": quantities,
    P + "gpu-memory.limit": quantities,
    P + "gpu-compute.mode": st.one_of(st.text(max_size=14), st.sampled_from(["sm-sharing", "time-slicing"])),
    P + "gpu-compute.portion": fractions,
    P + "gpus.devices": st.one_of(st.text(max_size=20), st.sampled_from(["0", "0,1", "1,3", NODE.gpus[2].uuid, "9"])),
    "gpu-fraction": fractions,
    "gpu-fraction.limit": fractions,
    "gpu-memory": st.one_of(st.text(max_size=6), st.integers(-5, 100000).map(str)),
    "gpu-fraction-num-devices": st.one_of(st.text(max_size=3), st.integers(-1, 6).map(str)),
    "gpu-fraction-container-name": st.sampled_from(["app", "other", ""]),
    "kai.scheduler/container.app.gpu-memory.portion.limit": fractions,
}
annotation_maps = st.fixed_dictionaries({}, optional=values)


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
@given(annotation_maps)
def test_parser_total(annotations):
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


@settings(max_examples=300, deadline=None)
@given(st.lists(annotation_maps, min_size=1, max_size=6))
def test_planner_total_and_ledger_keeps_invariants(pods):
    ledger = Ledger(NODE)
    for i, pod_annotations in enumerate(pods):
        try:
            plan = plan_container(pod_annotations, "app", PodRef("ns", f"p{i}", f"u{i}"), NODE, ledger)
        except FractionError as err:
            assert err.reason and err.key
            continue
        if plan is None:
            continue
        assert isinstance(plan, ContainerPlan)
        assert 1 <= plan.request_mib <= plan.limit_mib <= min(g.memory_mib for g in plan.devices)
        assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].count("=") == len(plan.devices)
        ledger.admit(plan)  # a plan made against the ledger always fits it
        assert ledger.check_invariants() == []
