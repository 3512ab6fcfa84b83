"""The Grafana dashboard (deploy/helm/fracplugin/files/dashboard.json) parses,
is well formed, shows what issue 16 asks for (per node and GPU memory held vs
total, tenants' request/limit vs used, SM share, MPS daemon state, hook
latency, refusals), and every metric its queries name is one the daemon
exports: the capture from the real daemon (tests/fixtures/metrics/
daemon-metrics.txt; tests/component/test_metrics_capture.py re-captures it
and checks the dashboard against the live /metrics too). Each check fails on a
mutated copy.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "helm" / "fracplugin" / "files" / "dashboard.json"
CAPTURE = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"
REQUIRED = {
    "fracplugin_gpu_memory_held_bytes", "fracplugin_gpu_memory_total_bytes",
    "fracplugin_container_gpu_memory_request_bytes", "fracplugin_container_gpu_memory_limit_bytes",
    "fracplugin_container_gpu_memory_used_bytes", "fracplugin_container_sm_utilization_share_percent",
    "fracplugin_mps_daemon_up", "fracplugin_hook_duration_seconds_bucket", "fracplugin_refusals_total",
}
_METRIC = re.compile(r"\bfracplugin_[a-z0-9_]+")


def exported_names(text: str) -> set[str]:
    """Family and sample names of a Prometheus text exposition."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    names.update(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))
    return names


def queries(dash: dict[str, Any]) -> list[str]:
    """Every PromQL text of the dashboard: panel targets and query variables."""
    out = []
    for panel in dash.get("panels", []):
        for sub in [panel, *panel.get("panels", [])]:
            out += [t["expr"] for t in sub.get("targets", []) if "expr" in t]
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        if var.get("type") == "query":
            out.append(q["query"] if isinstance(q, dict) else str(q))
    return out


def dashboard_problems(text: str, exported: set[str]) -> list[str]:
    """Parse errors, structure problems, metrics the daemon does not export,
    and required metrics that no panel shows."""
    try:
        dash = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"dashboard.json is not JSON: {exc}"]
    problems = [f"missing top-level {k!r}" for k in ("uid", "title", "panels", "templating") if k not in dash]
    ids = [p.get("id") for p in dash.get("panels", [])]
    if len(ids) != len(set(ids)):
        problems.append(f"duplicate panel ids {ids}")
    for p in dash.get("panels", []):
        g = p.get("gridPos", {})
        if not {"x", "y", "w", "h"} <= set(g) or g["x"] + g["w"] > 24:
            problems.append(f"panel {p.get('title')!r} has a bad gridPos {g}")
        if p.get("type") != "row" and not p.get("targets"):
            problems.append(f"panel {p.get('title')!r} has no query")
    named: set[str] = set()
    for q in queries(dash):
        for name in _METRIC.findall(q):
            named.add(name)
            if name not in exported:
                problems.append(f"query names {name}, which the daemon does not export: {q}")
    for name in sorted(REQUIRED - named):
        problems.append(f"no panel shows {name}")
    return problems


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_names(CAPTURE.read_text())


def test_dashboard_is_valid_and_names_only_exported_metrics(exported: set[str]) -> None:
    assert dashboard_problems(DASHBOARD.read_text(), exported) == []


def test_dashboard_has_node_and_gpu_variables() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "node", "gpu"]
    assert all('node=~"$node"' in q for q in queries(dash) if not q.startswith("label_values(fracplugin_gpu_memory_total_bytes, node)"))


def _rename(text: str) -> str:
    return text.replace("fracplugin_gpu_memory_total_bytes{", "fracplugin_gpu_memory_bytes{", 1)


def _drop_refusals(text: str) -> str:
    dash = json.loads(text)
    dash["panels"] = [p for p in dash["panels"] if "refusals" not in json.dumps(p.get("targets", []))]
    return json.dumps(dash)


def _duplicate_panel(text: str) -> str:
    dash = json.loads(text)
    dash["panels"].append(copy.deepcopy(dash["panels"][1]))
    return json.dumps(dash)


@pytest.mark.parametrize(("mutate", "needle"), [
    (_rename, "fracplugin_gpu_memory_bytes, which the daemon does not export"),
    (_drop_refusals, "no panel shows fracplugin_refusals_total"),
    (_duplicate_panel, "duplicate panel ids"),
    (lambda t: t[:-3], "not JSON"),
], ids=["renamed-metric", "missing-refusals", "duplicate-id", "truncated"])
def test_dashboard_check_fails_on_a_mutated_copy(exported: set[str], mutate, needle: str) -> None:
    problems = dashboard_problems(mutate(DASHBOARD.read_text()), exported)
    assert any(needle in p for p in problems), problems
