"""daemonset/kai/: the GpuSharingConfig KAI's operator waits for in NvFractions
mode (ADR 0005). The group/version/kind/name are the ones KAI's operator reads
(KAI-Scheduler pkg/operator/operands/gpu_sharing/gpu_sharing.go:
gpu-sharing.kai.scheduler/v1alpha1 GpuSharingConfig "default", older
gpu-fractioning.kai.scheduler/v1alpha1 GpuFractioningConfig), and Ready=True
sits in status.conditions where it looks."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

KAI_DIR = Path(__file__).resolve().parents[2] / "daemonset" / "kai"
WANT = {("gpu-sharing.kai.scheduler", "GpuSharingConfig", "gpusharingconfigs"),
        ("gpu-fractioning.kai.scheduler", "GpuFractioningConfig", "gpufractioningconfigs")}


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KAI_DIR / name).read_text()) if d]


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_crds_are_valid_and_name_kais_kinds(version: str) -> None:
    crds = docs("gpusharingconfig-crd.yaml")
    got = set()
    for crd in crds:
        kubernetes_validate.validate(crd, version, strict=True)
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
        assert spec["scope"] == "Cluster"
        (v,) = spec["versions"]
        assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
        assert "subresources" not in v  # so that `kubectl apply` sets the status
        got.add((spec["group"], spec["names"]["kind"], spec["names"]["plural"]))
    assert got == WANT


def test_default_objects_are_ready() -> None:
    objs = docs("gpusharingconfig-default.yaml")
    assert {(o["apiVersion"], o["kind"]) for o in objs} == {
        (f"{g}/v1alpha1", k) for g, k, _ in WANT}
    for o in objs:
        assert o["metadata"]["name"] == "default" and "namespace" not in o["metadata"]
        ready = [c for c in o["status"]["conditions"] if c["type"] == "Ready"]
        assert len(ready) == 1 and ready[0]["status"] == "True" and ready[0]["reason"]
