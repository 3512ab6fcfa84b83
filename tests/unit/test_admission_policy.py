"""The chart's ValidatingAdmissionPolicy (ADR 0026) without an API server:
the committed template is the generator's output, the objects are valid
admissionregistration.k8s.io/v1 for the oldest and newest Kubernetes we
support, and the CEL is built from the contract's one definition (every
reason of contract.py appears in it). Whether the API server refuses and
admits as explain does is tests/admission_e2e (real kube-apiserver) and
test_cel_eval there (Kubernetes' own CEL libraries)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from fracplugin import contract
from fracplugin_demo import admission

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "deploy" / "helm" / "fracplugin" / "templates" / "admissionpolicy.yaml"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # as tests/unit/test_manifests.py


def test_committed_template_is_the_generated_one() -> None:
    assert TEMPLATE.read_text() == admission.helm_template(), (
        "templates/admissionpolicy.yaml is stale: run .venv/bin/python scripts/render_admission_policy.py")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "render_admission_policy.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_check_mode_detects_a_stale_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_admission_policy", REPO / "scripts" / "render_admission_policy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stale = tmp_path / "admissionpolicy.yaml"
    stale.write_text(TEMPLATE.read_text().replace("is below 1Mi", "is below 2Mi"))
    monkeypatch.setattr(mod, "TEMPLATE", stale)
    monkeypatch.setattr(mod, "REPO", tmp_path)
    assert mod.main(["--check"]) == 1
    assert mod.main([]) == 0 and stale.read_text() == TEMPLATE.read_text()


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("actions", [["Deny"], ["Warn"]])
def test_objects_are_valid_admissionregistration_v1(version: str, actions: list[str]) -> None:
    objs = admission.policy_objects(prefix_expression=admission.lit("nvidia.com/container."),
                                    validation_actions=actions)
    assert [o["kind"] for o in objs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    for o in objs:
        kubernetes_validate.validate(o, version, strict=True)
    assert objs[1]["spec"]["policyName"] == objs[0]["metadata"]["name"]


def test_a_mutated_policy_fails_the_schema_check() -> None:
    (policy, _) = admission.policy_objects(prefix_expression="'p/'", validation_actions=["Deny"])
    policy["spec"]["validations"][0]["messageExpresion"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)


def _reasons() -> list[str]:
    """Every reason template of contract.py, with its slots cut out (the CEL
    spells the slots as expressions)."""
    out = []
    for name in dir(contract):
        v = getattr(contract, name)
        # QUANTITY_NOT_FINITE: unreachable in Python too (a Decimal built from a
        # string of the quantity grammar is finite; an overflowing suffix raises).
        if name.isupper() and isinstance(v, str) and name not in (
                "QUANTITY_PATTERN", "DECIMAL_PATTERN", "INT_PATTERN", "QUANTITY_NOT_FINITE"):
            out.extend(p for p in __import__("re").split(r"\{[a-z_]+\}", v) if p)
    return out


def test_every_reason_of_the_contract_is_in_the_cel() -> None:
    cel = admission.problems_expression()
    missing = [r for r in _reasons() if admission.lit(r)[1:-1] not in cel and r not in cel]
    assert missing == []


def test_the_template_renders_to_yaml_with_the_cel_intact() -> None:
    """Helm's directives replaced by what the defaults give: the YAML parses
    and its CEL is the generator's, byte for byte (block scalars keep it)."""
    text = TEMPLATE.read_text()
    body = text.split("{{- if .Values.admissionPolicy.enabled }}\n", 1)[1].rsplit("{{- end }}", 1)[0]
    body = (body.replace('{{ .Values.annotationPrefix | toJson | toJson }}', '"\\"nvidia.com/container.\\""')
            .replace("{{ .Values.admissionPolicy.validationActions | toJson }}", '["Deny"]')
            .replace("{{ .Values.admissionPolicy.failurePolicy | toJson }}", '"Ignore"')
            .replace('{{ include "fracplugin.fullname" . }}', "fracplugin")
            .replace('    {{- include "fracplugin.labels" . | nindent 4 }}\n', "    app: fracplugin\n"))
    policy, binding = [d for d in yaml.safe_load_all(body) if d]
    want = admission.policy_objects(prefix_expression='"nvidia.com/container."', validation_actions=["Deny"],
                                    name="fracplugin-annotations")
    policy["metadata"].pop("labels")
    binding["metadata"].pop("labels")
    assert [policy, binding] == want


def test_cel_literals_escape_quotes_and_backslashes() -> None:
    assert admission.lit("it's a \\ path") == "'it\\'s a \\\\ path'"
    assert admission.cel_template("below {x}: see {y}", x="a", y="b") == "'below ' + (a) + ': see ' + (b)"
    with pytest.raises(KeyError):
        admission.cel_template("{nope}")
