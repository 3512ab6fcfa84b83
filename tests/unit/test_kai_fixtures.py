"""KAI's NvFractions contract (tests/fixtures/kai/): every seed pod as KAI's
binder leaves it, planned by fracplugin's planner with its default settings,
must get exactly the fixture's env and CDI devices; the two seed pods cannot
share gpu-node-1."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import FractionError, PodRef
from fracplugin.nri.plugin import build_adjustment
from fracplugin.planner import EmptyLedger, PlannerConfig
from tests.helpers import plan_container

HERE = Path(__file__).resolve().parents[1]
FIXTURE = yaml.safe_load((HERE / "fixtures" / "kai" / "nvfractions-binder.yaml").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}


def bound_pod(case: dict[str, Any], examples: Path) -> dict[str, Any]:
    """The seed pod after KAI's admission and binder (annotations merged)."""
    pod = copy.deepcopy(yaml.safe_load((examples / "pods" / case["seed"]).read_text()))
    ann = pod["metadata"].setdefault("annotations", {})
    ann.update(case["admission_adds"])
    ann.update(case["binder_writes"])
    pod["spec"]["nodeName"] = "gpu-node-1"
    return pod


@pytest.fixture(scope="module")
def node(node_file: Path):
    return load_node(str(node_file))


def test_fixture_covers_each_seed_and_binder() -> None:
    seeds = {c["seed"] for c in FIXTURE["cases"]}
    assert seeds == {"notebook-time-slicing-2gpu.yaml", "inference-sm-sharing-4gpu.yaml"}
    for seed in seeds:
        kinds = {c["name"].split("/", 1)[1] for c in FIXTURE["cases"] if c["seed"] == seed}
        assert kinds == {"newest-binder-reserve-1Gi", "newest-binder-reserve-0", "older-binder-no-portion",
                         "newest-binder-reserve-1Gi-cdi"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_binder_output_gets_the_fixture_env(name: str, node, examples: Path) -> None:
    case = CASES[name]
    pod = bound_pod(case, examples)
    md = pod["metadata"]
    p = plan_container(md["annotations"], "app", PodRef(md["namespace"], md["name"], md["uid"]), node,
                       EmptyLedger(), PlannerConfig(), containers=["app"])
    assert p is not None
    assert dict(p.env) == case["env"]
    assert p.compute_mode.value == case["mode"]
    assert list(p.cdi_devices) == case["cdi_devices"]
    assert [d.name for d in build_adjustment(p).CDI_devices] == case["cdi_devices"]
    assert not p.placed_by_node  # KAI chose the GPUs


@pytest.mark.parametrize("name", sorted(CASES))
def test_reserve_setting_does_not_change_what_kai_wrote(name: str, node, examples: Path) -> None:
    """Once KAI wrote absolute MiB, fracplugin's own reserve plays no part."""
    case = CASES[name]
    md = bound_pod(case, examples)["metadata"]
    ref = PodRef(md["namespace"], md["name"], md["uid"])
    for reserve in (0, 1024, 4096):
        p = plan_container(md["annotations"], "app", ref, node, EmptyLedger(), PlannerConfig(reserve_mib=reserve))
        assert dict(p.env) == case["env"]


def test_both_seed_pods_cannot_share_the_node(node, examples: Path, tmp_path: Path) -> None:
    both = FIXTURE["both_pods"]
    ledger = Ledger(node, str(tmp_path / "ledger.json"))
    first = bound_pod(CASES[both["first"]], examples)["metadata"]
    p1 = plan_container(first["annotations"], "app", PodRef(first["namespace"], first["name"], first["uid"]),
                        node, ledger, PlannerConfig())
    ledger.admit(p1)
    second = bound_pod(CASES[both["second"]], examples)["metadata"]
    with pytest.raises(FractionError) as e:
        plan_container(second["annotations"], "app", PodRef(second["namespace"], second["name"], second["uid"]),
                       node, ledger, PlannerConfig())
    assert e.value.key == both["refused_key"]
    for text in both["reason_contains"]:
        assert text in e.value.reason, e.value.reason
