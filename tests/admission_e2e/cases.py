"""The contract's table (docs/user-guide.md "Annotations") as admission cases: for each
row, annotations that break it one way each, and good pods that must be
admitted. The expected message is always computed by ``fracplugin explain``
(``expected_message``), never written here: what is pinned is that the API
server's policy and explain agree."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from fracplugin.annotations import parse_uncached
from fracplugin.explain import explain
from fracplugin.model import FractionError
from fracplugin.safetext import escape_controls

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
P = "nvidia.com/container."
REQ, LIM = f"{P}app.gpu-memory.request", f"{P}app.gpu-memory.limit"
MODE, PORTION, DEVICES = f"{P}app.gpu-compute.mode", f"{P}app.gpu-compute.portion", f"{P}app.gpus.devices"
KAI_LIMIT = "kai.scheduler/container.app.gpu-memory.portion.limit"
GPU = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]

#: (case id, annotations, container names): each breaks one rule of one row.
BAD: list[tuple[str, dict[str, str], list[str]]] = [
    # .gpu-memory.request / .limit: a Kubernetes quantity in bytes, >= 1Mi, limit >= request
    ("request-bare-mib", {REQ: "40960"}, ["app"]),
    ("request-not-quantity", {REQ: "40GB"}, ["app"]),
    ("request-spaced", {REQ: "4 Gi"}, ["app"]),
    ("request-blank", {REQ: ""}, ["app"]),
    ("request-padded", {REQ: " 4Gi"}, ["app"]),
    ("request-negative", {REQ: "-1Gi"}, ["app"]),
    ("request-absurd", {REQ: "2Pi"}, ["app"]),
    ("request-below-mib", {REQ: "100Ki"}, ["app"]),
    ("request-milli", {REQ: "500m"}, ["app"]),
    # found by the generated test: 1e400 is a quantity whose float is +Inf; the
    # limit-vs-request rule must not read it (the CEL erred instead of refusing)
    ("request-absurd-exponent-with-limit", {REQ: "1e400", LIM: "40Gi"}, ["app"]),
    ("limit-below-request", {REQ: "40Gi", LIM: "20Gi"}, ["app"]),
    ("limit-below-request-rounded", {REQ: "1000M", LIM: "900Mi"}, ["app"]),
    ("limit-not-quantity", {LIM: "lots"}, ["app"]),
    # .gpu-compute.mode and KAI's pod-level mode
    ("mode-case", {REQ: "4Gi", MODE: "SM-Sharing"}, ["app"]),
    ("mode-blank", {REQ: "4Gi", MODE: ""}, ["app"]),
    ("mode-unknown", {REQ: "4Gi", MODE: "mps"}, ["app"]),
    ("mode-long-value-cut-as-explain-cuts-it", {REQ: "4Gi", MODE: "sm-sharing," * 40}, ["app"]),
    ("mode-unfractional-still-checked", {MODE: "time_slicing"}, ["app"]),
    ("pod-mode-case", {REQ: "4Gi", "kai.scheduler/gpu-compute-sharing-mode": "SM-Sharing"}, ["app"]),
    # .gpu-compute.portion: a decimal in (0, 1]
    ("portion-zero", {REQ: "4Gi", PORTION: "0"}, ["app"]),
    ("portion-above-one", {REQ: "4Gi", PORTION: "1.5"}, ["app"]),
    ("portion-percent", {REQ: "4Gi", PORTION: "50%"}, ["app"]),
    ("portion-nan", {REQ: "4Gi", PORTION: "NaN"}, ["app"]),
    ("portion-infinite", {REQ: "4Gi", PORTION: "1e999"}, ["app"]),
    ("portion-padded", {REQ: "4Gi", PORTION: "0.5 "}, ["app"]),
    # .gpus.devices
    ("devices-empty-entry", {REQ: "4Gi", DEVICES: f"{GPU[0]},,{GPU[1]}"}, ["app"]),
    ("devices-twice", {REQ: "4Gi", DEVICES: f"{GPU[0]}, {GPU[0]}"}, ["app"]),
    ("devices-too-many", {REQ: "4Gi", DEVICES: ",".join(str(i) for i in range(65))}, ["app"]),
    # pod-level gpu-fraction / gpu-fraction.limit
    ("fraction-one", {"gpu-fraction": "1"}, ["app"]),
    ("fraction-zero", {"gpu-fraction": "0"}, ["app"]),
    ("fraction-text", {"gpu-fraction": "half"}, ["app"]),
    ("fraction-limit-not-above", {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.4"}, ["app"]),
    ("fraction-limit-equal", {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.5"}, ["app"]),
    ("fraction-limit-above-one", {"gpu-fraction": "0.5", "gpu-fraction.limit": "1.2"}, ["app"]),
    # pod-level gpu-memory: a whole number of MiB per GPU
    ("gpu-memory-quantity", {"gpu-memory": "20Gi"}, ["app"]),
    ("gpu-memory-zero", {"gpu-memory": "0"}, ["app"]),
    ("gpu-memory-negative", {"gpu-memory": "-5"}, ["app"]),
    ("gpu-memory-huge", {"gpu-memory": "99999999999"}, ["app"]),
    ("gpu-memory-text", {"gpu-memory": "lots"}, ["app"]),
    ("gpu-memory-limit-below", {"gpu-memory": "20480", LIM: "10Gi"}, ["app"]),
    # gpu-fraction-num-devices
    ("num-devices-zero", {"gpu-memory": "1024", "gpu-fraction-num-devices": "0"}, ["app"]),
    ("num-devices-text", {"gpu-memory": "1024", "gpu-fraction-num-devices": "two"}, ["app"]),
    ("num-devices-too-many", {"gpu-memory": "1024", "gpu-fraction-num-devices": "65"}, ["app"]),
    ("num-devices-mismatch", {REQ: "4Gi", DEVICES: f"{GPU[0]},{GPU[1]}", "gpu-fraction-num-devices": "3"}, ["app"]),
    # gpu-fraction-container-name
    ("container-name-unknown", {"gpu-fraction": "0.5", "gpu-fraction-container-name": "nope"}, ["app"]),
    ("container-name-blank", {"gpu-fraction": "0.5", "gpu-fraction-container-name": ""}, ["app"]),
    ("container-name-second", {"gpu-fraction-container-name": "side", "gpu-memory": "20Gi"}, ["app", "side"]),
    # kai.scheduler/container.<c>.gpu-memory.portion.limit
    ("kai-limit-above-one", {"gpu-fraction": "0.5", KAI_LIMIT: "2"}, ["app"]),
    ("kai-limit-below-fraction", {"gpu-fraction": "0.5", KAI_LIMIT: "0.3"}, ["app"]),
    # the second container's own keys
    ("second-container-request", {REQ: "4Gi", f"{P}side.gpu-memory.request": "4096"}, ["app", "side"]),
]

#: (case id, annotations, container names) admitted, beside the seed pods.
GOOD: list[tuple[str, dict[str, str], list[str]]] = [
    ("no-annotations", {}, ["app"]),
    ("other-annotations", {"prometheus.io/scrape": "true"}, ["app"]),
    ("gpu-memory-mib", {"gpu-memory": "20480", "gpu-fraction-num-devices": "2"}, ["app"]),
    ("request-limit", {REQ: "40960Mi", LIM: "60Gi", MODE: "sm-sharing", PORTION: "0.5"}, ["app"]),
    ("request-bytes", {REQ: "4294967296"}, ["app"]),
    ("devices", {REQ: "4Gi", DEVICES: f"{GPU[0]}, {GPU[1]}", "gpu-fraction-num-devices": "2"}, ["app"]),
    ("fraction-limit", {"gpu-fraction": "0.5", "gpu-fraction.limit": "1", KAI_LIMIT: "0.1"}, ["app"]),
    ("kai-limit", {"gpu-fraction": "0.25", KAI_LIMIT: "0.75"}, ["app"]),
    ("pod-mode", {"gpu-fraction": "0.5", "kai.scheduler/gpu-compute-sharing-mode": "sm-sharing"}, ["app"]),
    ("container-name", {"gpu-fraction-container-name": "side", "gpu-memory": "2048"}, ["app", "side"]),
    # a key for a container the pod does not have: a warning in explain, no refusal
    ("stray-key", {f"{P}ap.gpu-memory.request": "oops"}, ["app"]),
]


def pod(name: str, annotations: dict[str, str], containers: list[str]) -> dict[str, Any]:
    """A minimal valid core/v1 Pod in namespace ``default``."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": dict(annotations)},
        "spec": {"containers": [{"name": c, "image": "busybox:1.37"} for c in containers]},
    }


def seed_pods() -> dict[str, dict[str, Any]]:
    """examples/pods/*.yaml and the kubectl fixture, made creatable: namespace
    default, no uid / resourceVersion / managedFields / status (server-set)."""
    out = {}
    paths = sorted((REPO / "examples" / "pods").glob("*.yaml")) + [
        REPO / "tests" / "fixtures" / "kubectl" / "inference-pod.yaml"]
    for p in paths:
        d = copy.deepcopy(yaml.safe_load(p.read_text()))
        md = d["metadata"]
        for k in ("uid", "resourceVersion", "managedFields", "creationTimestamp", "ownerReferences", "generateName"):
            md.pop(k, None)
        md["namespace"] = "default"
        md["name"] = p.name[: -len(".yaml")].replace(".", "-")
        d.pop("status", None)
        d["spec"].pop("nodeName", None)
        d["spec"].pop("volumes", None)
        for c in d["spec"]["containers"]:
            c.pop("volumeMounts", None)
        out[md["name"]] = d
    return out


def expected_message(manifest: dict[str, Any]) -> str | None:
    """``fracplugin explain``'s first refusal of the pod (its containers in
    order) on the example node, as ``<key>="<value>" <reason>``; None when it
    refuses none."""
    report = explain(copy.deepcopy(manifest), str(NODE))
    for c in report["containers"]:
        if c["error"]:
            e = c["error"]  # the value already cut as FractionError cuts it: not wrapped again
            return escape_controls(f'{e["key"]}="{e["value"]}" {e["reason"]}')
    return None


def parse_message(annotations: dict[str, str], containers: list[str]) -> str | None:
    """``annotations.parse_uncached``'s first refusal over the containers in
    order (what the policy mirrors: no node-side rule), or None."""
    for c in containers:
        try:
            parse_uncached(annotations, c, containers=containers)
        except FractionError as err:
            return err.message
    return None
