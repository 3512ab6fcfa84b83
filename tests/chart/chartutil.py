"""Helpers of the chart tests (tests/chart): run helm and promtool, load the
rendered chart, and the checks that tests/unit/test_manifests.py applies to
daemonset/, reused on every rendering.

Every check returns a list of problems (empty = fine) so that each can be
shown to fail on a mutated copy.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "fracplugin"
VALUE_SETS_DIR = CHART / "ci"
CRD_DIR = REPO / "tests" / "fixtures" / "crds"
METRICS_FIXTURE = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"
NAMESPACE = "fracplugin-system"


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


manifest_checks = _load("fp_test_manifests", REPO / "tests" / "unit" / "test_manifests.py")
render_manifests = _load("fp_render_manifests", REPO / "scripts" / "render_manifests.py")


def tool(name: str) -> str:
    """Path of ``helm`` / ``promtool`` from $HELM / $PROMTOOL (set by `make
    chart`, which builds them with scripts/chart-tools.sh). A missing tool is a
    failure, never a skip."""
    env = name.upper()
    path = os.environ.get(env)
    if not path:
        out = subprocess.run(["bash", str(REPO / "scripts" / "chart-tools.sh"), name], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"${env} is not set and scripts/chart-tools.sh {name} failed:\n{out.stderr}")
        path = out.stdout.strip().split("=", 1)[1]
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{name} at {path} is not executable (run `make chart`)")
    return path


def value_sets() -> dict[str, list[Path]]:
    """The documented values sets: "default" (no file) and every ci/*-values.yaml."""
    out: dict[str, list[Path]] = {"default": []}
    for p in sorted(VALUE_SETS_DIR.glob("*-values.yaml")):
        out[p.name[: -len("-values.yaml")]] = [p]
    return out


def template(helm: str, values: list[Path], sets: tuple[str, ...] = (), chart: Path = CHART) -> subprocess.CompletedProcess[str]:
    """``helm template fracplugin <chart> -n fracplugin-system -f ... --set ...`` (not checked)."""
    cmd = [helm, "template", "fracplugin", str(chart), "--namespace", NAMESPACE]
    for v in values:
        cmd += ["--values", str(v)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True)


def rendered(helm: str, values: list[Path], sets: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    """Rendered chart as {template file name: its objects} (the shape
    test_manifests.py's checks take). Raises AssertionError with helm's stderr."""
    out = template(helm, values, sets)
    assert out.returncode == 0, out.stderr
    return {name: [d for d in yaml.safe_load_all(text) if d is not None]
            for name, text in render_manifests.split_by_source(out.stdout).items()}


def objects(m: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for docs in m.values() for d in docs]


# ---------------------------------------------------------------- schemas


def _strict(schema: Any) -> Any:
    """A CRD openAPIV3Schema made strict: every object with ``properties`` and
    no ``additionalProperties`` / ``x-kubernetes-preserve-unknown-fields``
    rejects unknown fields (what the API server's strict field validation does)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict JSON schema, from tests/fixtures/crds."""
    out = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd:
                continue
            spec = crd["spec"]
            for v in spec["versions"]:
                schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server
                out[(f"{spec['group']}/{v['name']}", spec["names"]["kind"])] = _strict(schema)
    return out


def schema_problems(m: dict[str, list[dict[str, Any]]], version: str) -> list[str]:
    """Strict validation of every rendered object: built-in kinds against the
    Kubernetes schemas of ``version`` (kubernetes_validate, as
    test_manifests.py), custom resources against the vendored CRD schemas."""
    crds = crd_schemas()
    core: dict[str, list[dict[str, Any]]] = {}
    problems = []
    for name, docs in m.items():
        for doc in docs:
            key = (doc.get("apiVersion"), doc.get("kind"))
            if key in crds:
                for e in jsonschema.Draft7Validator(crds[key]).iter_errors(doc):
                    path = ".".join(str(p) for p in e.absolute_path)
                    problems.append(f"{name}: {key[1]}/{doc.get('metadata', {}).get('name')} invalid at {path}: {e.message}")
            else:
                core.setdefault(name, []).append(doc)
    return problems + manifest_checks.schema_problems(core, version)


# ---------------------------------------------------------------- metrics names


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')


def exposition_series(text: str) -> dict[str, set[frozenset[str]]]:
    """Prometheus text exposition -> {sample name: {frozenset of label names}},
    plus every family named in ``# TYPE`` lines (with no label sets)."""
    out: dict[str, set[frozenset[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            out.setdefault(line.split()[2], set())
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out.setdefault(m.group(1), set()).add(frozenset(_LABEL.findall(m.group(3) or "")))
    return out


_METRIC = re.compile(r"\bfracplugin_[a-z0-9_]+")


def metric_names_in(text: str) -> set[str]:
    """Every ``fracplugin_*`` name in a PromQL expression (or any text)."""
    return set(_METRIC.findall(text))


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
