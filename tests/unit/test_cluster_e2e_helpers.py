"""The cluster e2e's pure helpers (tests/cluster_e2e): README's DRA example as
the DRA scenarios read it (``readme.yaml_docs``) and the feature gates each
Kubernetes line's cluster turns on (``fullcluster.feature_gates``). They run
without root or a cluster, so that a README edit or a gate table slip fails
here first, not after a cluster came up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

CLUSTER_E2E = Path(__file__).resolve().parents[1] / "cluster_e2e"
sys.path.insert(0, str(CLUSTER_E2E))

import fullcluster  # noqa: E402
import readme  # noqa: E402


def test_readme_dra_example_is_a_claim_template_and_its_pod():
    docs = readme.yaml_docs(readme.DRA_EXAMPLE)
    assert sorted(docs) == ["Pod", "ResourceClaimTemplate"]
    tmpl, pod = docs["ResourceClaimTemplate"], docs["Pod"]
    req = tmpl["spec"]["spec"]["devices"]["requests"][0]
    assert req["exactly"]["deviceClassName"] == "sm-sharing.gpu-memory.fracplugin.io"  # the class sets the mode
    assert req["exactly"]["capacity"]["requests"]["memory"] == "20Gi"
    params = tmpl["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert params == {"apiVersion": "gpu-memory.fracplugin.io/v1alpha1", "kind": "GpuMemoryParameters",
                      "gpu-memory.limit": "24Gi", "gpu-compute.portion": "0.5"}
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == tmpl["metadata"]["name"]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]


def test_yaml_docs_refuses_two_manifests_of_one_kind_and_a_missing_block():
    text = "marker\n```yaml\nkind: Pod\n---\nkind: Pod\n```\n"
    with pytest.raises(readme.ReadmeError, match="two of kind 'Pod'"):
        readme.yaml_docs("marker", text)
    with pytest.raises(readme.ReadmeError, match="no ```yaml block"):
        readme.yaml_docs("marker", "marker\n```sh\nls\n```\n")


@pytest.mark.parametrize(("version", "gates"), [
    ("v1.35.4", {"DRAConsumableCapacity": True}),  # alpha, off by default (kube_features.go of v1.35.4)
    ("v1.34.0", {"DRAConsumableCapacity": True}),
    ("v1.36.0", {}),  # beta, on by default from 1.36
    ("v1.37.2", {}),
])
def test_feature_gates_per_kubernetes_line(version, gates):
    assert fullcluster.feature_gates(version) == gates
    flag = fullcluster.gates_flag(gates)
    assert flag == (["--feature-gates=DRAConsumableCapacity=true"] if gates else [])
