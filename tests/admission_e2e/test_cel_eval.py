"""The policy's CEL, evaluated by Kubernetes' own CEL environment (celeval:
k8s.io/apiserver/pkg/cel/environment, with the quantity, strings, lists and
regex libraries a ValidatingAdmissionPolicy gets), agrees with Python: the
first refusal of a pod is explain's message, byte for byte, on every row of
the contract's table and on generated annotation sets; good pods have none."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fracplugin_demo import admission
from tests.admission_e2e.cases import (BAD, DEVICES, GOOD, GPU, KAI_LIMIT, LIM, MODE, PORTION, REQ, expected_message,
                                       parse_message, pod, seed_pods)


class CelEval:
    """One celeval process; ``problems(pod)`` -> the policy's variables.problems."""

    def __init__(self, binary: Path) -> None:
        self.proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.prefix = admission.lit("nvidia.com/container.")
        self.expr = admission.problems_expression()

    def problems(self, manifest: dict[str, Any]) -> list[list[str]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prefix": self.prefix, "names": admission.NAMES_EXPRESSION,
                                          "problems": self.expr, "pod": manifest}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert "error" not in answer, answer["error"][:2000]
        return answer["problems"]

    def message(self, manifest: dict[str, Any]) -> str | None:
        p = self.problems(manifest)
        return p[0][0] if p else None

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def cel(celeval: Path) -> Iterator[CelEval]:
    c = CelEval(celeval)
    yield c
    c.close()


@pytest.mark.parametrize("case,annotations,containers", BAD, ids=[b[0] for b in BAD])
def test_each_bad_row_gets_explains_message(cel: CelEval, case: str, annotations: dict[str, str],
                                            containers: list[str]) -> None:
    manifest = pod(case, annotations, containers)
    want = expected_message(manifest)
    assert want is not None
    assert cel.message(manifest) == want


@pytest.mark.parametrize("case,annotations,containers", GOOD, ids=[g[0] for g in GOOD])
def test_each_good_pod_has_no_refusal(cel: CelEval, case: str, annotations: dict[str, str],
                                      containers: list[str]) -> None:
    assert cel.problems(pod(case, annotations, containers)) == []


def test_seed_pods_have_no_refusal(cel: CelEval) -> None:
    for name, manifest in seed_pods().items():
        assert cel.problems(manifest) == [], name


def test_a_pod_without_annotations_has_no_refusal(cel: CelEval) -> None:
    manifest = pod("bare", {}, ["app"])
    del manifest["metadata"]["annotations"]
    assert cel.problems(manifest) == []


def _with_sidecar(manifest: dict[str, Any], name: str, restart: str | None = "Always") -> dict[str, Any]:
    init: dict[str, Any] = {"name": name, "image": "busybox:1.37"}
    if restart is not None:
        init["restartPolicy"] = restart
    manifest["spec"]["initContainers"] = [init]
    return manifest


def test_a_named_native_sidecar_is_a_container_of_the_pod(cel: CelEval) -> None:
    """Issue 34 item 3: the pod-level forms may name a native sidecar (an init
    container with restartPolicy Always), not a plain init container; per
    container keys of the sidecar are checked, the sidecar's refusal first
    (it starts first), as explain reports."""
    ann = {"gpu-fraction": "0.25", "gpu-fraction-container-name": "side"}
    good = _with_sidecar(pod("sidecar-good", ann, ["app"]), "side")
    assert expected_message(good) is None and cel.problems(good) == []
    plain = _with_sidecar(pod("sidecar-plain", ann, ["app"]), "side", None)
    assert cel.message(plain) == expected_message(plain) == 'gpu-fraction-container-name="side" names no container of this pod'
    both = _with_sidecar(pod("sidecar-both", {"nvidia.com/container.app.gpu-memory.request": "lots",
                                              "nvidia.com/container.side.gpu-memory.request": "0"}, ["app"]), "side")
    want = expected_message(both)
    assert want is not None and want.startswith('nvidia.com/container.side.') and cel.message(both) == want


# ---- generated: every key of the contract with good and bad values, in any combination
QUANTITIES = ["40Gi", "4096M", "1.5G", "4294967296", "1e9", "1Mi", "1048577", "40960", "0", "-1Gi", "2Pi", "100Ki",
              "500m", "lots", "4 Gi", " 4Gi", "", "1e400", ".5Gi", "1.", "+4Gi", "40GB", "1000M", "900Mi"]
FRACTIONS = ["0.5", "0.25", "1", "0", "1.0", "0.999", "1.5", "50%", "NaN", "inf", "1e999", "1e-400", ".5", "5e-1",
             "", " 0.5", "0.3", "0.75", "-0.5", "half"]
INTS = ["1", "2", "3", "4", "0", "-5", "65", "64", "two", "20480", "1024", "20Gi", "1.5G", "99999999999", "",
        " 2", "0002", "512Ki", "1073741825"]
MODES = ["time-slicing", "sm-sharing", "SM-Sharing", "", "mps", " sm-sharing", "é" * 300]
DEVICE_LISTS = [GPU[0], f"{GPU[0]},{GPU[1]}", f"{GPU[0]}, {GPU[1]}", "0,1", "0,,1", "0,0", " ", "", ",",
                ",".join(str(i) for i in range(65)), "k8s.device-plugin.nvidia.com/gpu=" + GPU[2]]
NAMES = ["app", "side", "nope", "", " app"]


def _keys(c: str) -> dict[str, list[str]]:
    p = "nvidia.com/container."
    return {f"{p}{c}.gpu-memory.request": QUANTITIES, f"{p}{c}.gpu-memory.limit": QUANTITIES,
            f"{p}{c}.gpu-compute.mode": MODES, f"{p}{c}.gpu-compute.portion": FRACTIONS,
            f"{p}{c}.gpus.devices": DEVICE_LISTS, f"kai.scheduler/container.{c}.gpu-memory.portion.limit": FRACTIONS}


POOLS: dict[str, list[str]] = {
    **_keys("app"), **_keys("side"),
    "gpu-fraction": FRACTIONS, "gpu-fraction.limit": FRACTIONS, "gpu-memory": INTS + QUANTITIES[:6],
    "gpu-fraction-num-devices": INTS, "gpu-fraction-container-name": NAMES,
    "kai.scheduler/gpu-compute-sharing-mode": MODES,
}
assert {REQ, LIM, MODE, PORTION, DEVICES, KAI_LIMIT} <= set(POOLS)


@st.composite
def annotation_sets(draw: Any) -> tuple[dict[str, str], list[str]]:
    keys = draw(st.lists(st.sampled_from(sorted(POOLS)), min_size=1, max_size=6, unique=True))
    ann = {k: draw(st.sampled_from(POOLS[k])) for k in keys}
    containers = draw(st.sampled_from([["app"], ["app", "side"], ["side", "app"]]))
    return ann, containers


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=annotation_sets())
def test_generated_annotations_get_the_same_first_refusal(cel: CelEval, case: tuple[dict[str, str], list[str]]) -> None:
    annotations, containers = case
    assert cel.message(pod("gen", annotations, containers)) == parse_message(annotations, containers)


def test_large_device_lists_stay_within_the_cost_limit(cel: CelEval) -> None:
    """The duplicate check is quadratic: bounded (admission.DUPLICATE_CHECK_*)
    so a long list is refused or admitted, never a CEL cost error (which
    failurePolicy Ignore would turn into an admitted pod)."""
    long_list = ",".join(f"GPU-{i:036d}" for i in range(3000))
    for value, want in ((long_list, "names more than 64 devices"),
                        (",".join(["0"] * 2000), "names more than 64 devices"),  # the node says "twice" first
                        ("0," * 63 + "0", "names a device twice"),
                        ("x" * 200_000, None)):
        annotations = {REQ: "4Gi", DEVICES: value}
        got = cel.message(pod("big", annotations, ["app"]))
        assert (got is None) if want is None else (got is not None and got.endswith(f'" {want}')), (want, got and got[-80:])


def test_many_containers_stay_within_the_cost_limit(cel: CelEval) -> None:
    names = [f"c{i}" for i in range(40)]
    annotations = {f"nvidia.com/container.{c}.{k}": v for c in names for k, v in (
        ("gpu-memory.request", "4Gi"), ("gpu-memory.limit", "8Gi"), ("gpu-compute.mode", "sm-sharing"),
        ("gpu-compute.portion", "0.5"), ("gpus.devices", "0,1"))}
    annotations["gpu-fraction-num-devices"] = "2"
    assert cel.problems(pod("many", annotations, names)) == []
    annotations["nvidia.com/container.c39.gpu-compute.mode"] = "SM"
    assert cel.message(pod("many", annotations, names)) == parse_message(annotations, names)
