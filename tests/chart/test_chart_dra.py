"""The chart's DRA objects (``dra.enabled``, ADR 0031 and its addendum),
rendered with the real helm: the DeviceClass of every GPU and one class per
compute mode, whose CEL selector reads the ``computeMode`` attribute the
daemon publishes (``fracplugin.dra.slices``) and whose opaque config the
door reads as a class config (``fracplugin.dra.claims``). The CEL is not
evaluated here (no CEL engine in the test deps); the cluster e2e
(tests/cluster_e2e/test_dra.py) runs it in kube-scheduler."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from chartutil import REPO, rendered
from fracplugin.dra import DRIVER_NAME, claims
from fracplugin.dra.slices import ATTR_COMPUTE_MODE, MODE_NONE
from fracplugin.gpu.simulated import load_node
from fracplugin.model import ComputeMode
from tests.peers.resource_api import claim_doc

NODE = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))


@pytest.fixture(scope="module")
def classes(helm: str) -> dict[str, dict[str, Any]]:
    m = rendered(helm, [], ("dra.enabled=true",))
    return {d["metadata"]["name"]: d for d in m["deviceclass.yaml"]}


def test_one_class_for_every_gpu_and_one_per_compute_mode(classes: dict[str, dict[str, Any]]) -> None:
    assert set(classes) == {DRIVER_NAME, *(f"{m.value}.{DRIVER_NAME}" for m in ComputeMode)}
    every = classes[DRIVER_NAME]["spec"]
    assert every["selectors"] == [{"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}]
    assert "config" not in every  # the mode is the claim's own (time-slicing by default)


@pytest.mark.parametrize("version", ["1.34.0", "1.37.0"])  # resource.k8s.io/v1: 1.34+
def test_classes_are_schema_valid(classes: dict[str, dict[str, Any]], version: str) -> None:
    for doc in classes.values():
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("mode", list(ComputeMode))
def test_mode_class_admits_free_gpus_and_its_mode_and_sets_the_mode(classes: dict[str, dict[str, Any]],
                                                                    mode: ComputeMode) -> None:
    spec = classes[f"{mode.value}.{DRIVER_NAME}"]["spec"]
    (selector,) = spec["selectors"]
    attr = f'device.attributes["{DRIVER_NAME}"].{ATTR_COMPUTE_MODE}'
    assert selector["cel"]["expression"] == (
        f'device.driver == "{DRIVER_NAME}" && has({attr}) && {attr} in ["{MODE_NONE}", "{mode.value}"]')
    # the class's config, as the scheduler copies it into the allocation, sets the claim's mode
    (config,) = spec["config"]
    assert config["opaque"]["driver"] == DRIVER_NAME
    doc = claim_doc("ns", "c", "uid-1")
    doc["status"]["allocation"]["devices"]["config"] = [{"source": "FromClass", "requests": ["gpu"], **config}]
    assert claims.read_claim(doc, NODE).parameters.compute_mode is mode
