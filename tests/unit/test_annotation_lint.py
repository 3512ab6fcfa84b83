"""annotation_lint: keys the contract does not read and forms it ignores (issue 25 item 3)."""

from __future__ import annotations

import pytest

from fracplugin.annotation_lint import ignored_forms, lint, unknown_keys

P = "nvidia.com/container."


@pytest.mark.parametrize("key, closest", [
    (P + "app.gpu-memory.requests", P + "app.gpu-memory.request"),
    (P + "app.gpu-memory.limt", P + "app.gpu-memory.limit"),
    (P + "app.gpu-compute.modes", P + "app.gpu-compute.mode"),
    (P + "app.gpus.device", P + "app.gpus.devices"),
    (P + "app.gpu-compute-portion", P + "app.gpu-compute.portion"),
    ("nvidia.com/containers.app.gpu-memory.request", P + "app.gpu-memory.request"),  # issue 36 input 3
    ("nvidia.com/container-app.gpu-memory.limit", P + "app.gpu-memory.limit"),
    ("nvidia.com/containerapp.gpu-compute.mode", P + "app.gpu-compute.mode"),
    ("nvidia.com/contianer.app.gpus.devices", P + "app.gpus.devices"),
    ("gpu-fractoin", "gpu-fraction"),
    ("gpu-fraction-num-device", "gpu-fraction-num-devices"),
    ("kai.scheduler/gpu-compute-sharing-mod", "kai.scheduler/gpu-compute-sharing-mode"),
])
def test_a_key_not_read_names_the_closest_valid_key(key: str, closest: str) -> None:
    (x,) = unknown_keys({key: "1"}, P, ["app"])
    assert x.key == key and f"did you mean {closest}?" in x.message and "has no effect" in x.message


def test_keys_of_the_contract_and_other_tools_are_not_warned() -> None:
    ann = {P + "app.gpu-memory.request": "1Gi", P + "app.gpus.devices": "0", "gpu-fraction": "0.5",
           "gpu-fraction-container-name": "app", "kai.scheduler/container.app.gpu-memory.portion.limit": "0.5",
           "kubectl.kubernetes.io/last-applied-configuration": "{}", "prometheus.io/scrape": "true", "team": "a",
           "nvidia.com/gpu.product": "H100", "nvidia.com/containers.app.image": "x"}  # near the prefix, no suffix
    assert unknown_keys(ann, P, ["app"]) == []


def test_the_closest_container_is_named() -> None:
    (x,) = unknown_keys({P + "ap.gpu-memory.requests": "1Gi"}, P, ["app", "sidecar"])
    assert f"did you mean {P}app.gpu-memory.request?" in x.message


def test_a_pod_level_form_beside_a_per_container_key_says_it_is_ignored() -> None:
    ann = {"gpu-fraction": "0.5", P + "app.gpu-memory.request": "8Gi"}
    (x,) = ignored_forms(ann, P, "app", ["app"])
    assert x.key == "gpu-fraction" and "is ignored for container app" in x.message
    assert ignored_forms(ann, P, "sidecar", ["app", "sidecar"]) == []  # the forms do not target it


def test_gpu_memory_beside_gpu_fraction_and_two_modes() -> None:
    ann = {"gpu-fraction": "0.5", "gpu-memory": "8192", "kai.scheduler/gpu-compute-sharing-mode": "sm-sharing",
           P + "app.gpu-compute.mode": "time-slicing"}
    assert sorted(x.key for x in lint(ann, P, ["app"])) == ["gpu-memory", "kai.scheduler/gpu-compute-sharing-mode"]


def test_a_pod_level_form_on_the_first_of_several_containers_says_which() -> None:
    """Issue 36 item 2: ``gpu-fraction`` without ``gpu-fraction-container-name`` goes to the first container."""
    ann = {"gpu-fraction": "0.5"}
    (x,) = ignored_forms(ann, P, "sidecar", ["sidecar", "app"])
    assert x.key == "gpu-fraction" and "applies to container sidecar, the first of the pod's 2 containers" in x.message
    assert ignored_forms(ann, P, "app", ["sidecar", "app"]) == []  # said once, for the container it went to
    assert ignored_forms(ann, P, "app", ["app"]) == []  # the only container: nothing to say
    assert ignored_forms({**ann, "gpu-fraction-container-name": "sidecar"}, P, "sidecar", ["sidecar", "app"]) == []
