"""The Grafana dashboard (deploy/helm/fracplugin/files/dashboard.json) parses,
is well formed, shows what issue 16 asks for (per node and GPU memory held vs
total, tenants' request/limit vs used, SM share, MPS daemon state, hook
latency, refusals), and every metric its queries name is one the daemon
exports: the capture from the real daemon (tests/fixtures/metrics/
daemon-metrics.txt; tests/component/test_metrics_capture.py re-captures it
and checks the dashboard against the live /metrics too).

Issue 27 item 3: every selector of every query (the dashboard's variables
replaced by what "All" selects) selects series of that capture, every label a
query groups by, a legend shows, a variable lists or a table column renames is
on those series, and no table shows a ``Value``/``Value #A`` column (organize
transformations name them). Each check fails on a mutated copy.
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
    # memory-limit enforcement (issue 36 item 5)
    "fracplugin_container_cuda_memory_limit_bytes", "fracplugin_container_cuda_memory_limit_enforced",
    "fracplugin_node_capability", "fracplugin_container_gpu_memory_over_limit",
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


# ---------------------------------------------------------------- queries against the capture

VARIABLES = {"$node": ".*", "$gpu": ".*", "$__rate_interval": "5m", "${datasource}": ""}
"""What the dashboard's variables are when "All" is selected (allValue .*)."""
_SELECTOR = re.compile(r"\b(fracplugin_[a-z0-9_]+)(\{([^}]*)\})?")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_]\w*)\s*\}\}")


def capture_series(text: str) -> list[tuple[str, dict[str, str]]]:
    """Every sample of a text exposition as (sample name, labels)."""
    return [(smp.name, dict(smp.labels)) for fam in text_string_to_metric_families(text) for smp in fam.samples]


def _matches(labels: dict[str, str], op: str, name: str, value: str) -> bool:
    have = labels.get(name, "")
    if op == "=":
        return have == value
    if op == "!=":
        return have != value
    hit = re.fullmatch(value, have) is not None
    return hit if op == "=~" else not hit


def _expand(q: str) -> str:
    for var, value in VARIABLES.items():
        q = q.replace(var, value)
    return q


def query_labels(q: str, series: list[tuple[str, dict[str, str]]]) -> tuple[set[str], list[str]]:
    """(labels every series the query selects has, problems) for one PromQL
    text: a selector that selects nothing in the capture is a problem; with
    ``by (...)`` only those labels remain, and each must be on the series."""
    q = _expand(q)
    problems: list[str] = []
    common: set[str] | None = None
    for m in _SELECTOR.finditer(q):
        name, matchers = m.group(1), _MATCHER.findall(m.group(3) or "")
        hit = [lbl for n, lbl in series if n == name and all(_matches(lbl, op, k, v) for k, op, v in matchers)]
        if not hit:
            problems.append(f"{m.group(0)} selects no series of the daemon's /metrics capture")
            continue
        for lbl in hit:
            common = set(lbl) if common is None else common & set(lbl)
    have = common or set()
    for group in _GROUPING.findall(q):
        by = {x.strip() for x in group.split(",") if x.strip()} - {"le"}
        for label in sorted(by - have):
            problems.append(f"{q}: groups by {label!r}, which the selected series lack")
        have = by & have if "by" in q else have - by
    return have, problems


def query_problems(dash: dict[str, Any], series: list[tuple[str, dict[str, str]]]) -> list[str]:
    """Every panel query, legend and table column, and every variable,
    checked against the captured series (see the module docstring)."""
    problems: list[str] = []
    for panel in dash.get("panels", []):
        title = panel.get("title")
        panel_labels: set[str] = set()
        for t in panel.get("targets", []):
            have, found = query_labels(t.get("expr", ""), series)
            problems += [f"panel {title!r} {t.get('refId')}: {p}" for p in found]
            panel_labels |= have
            for label in _LEGEND.findall(t.get("legendFormat", "")):
                if label not in have:
                    problems.append(f"panel {title!r} {t.get('refId')}: legend shows {{{{{label}}}}}, "
                                    f"which its series lack")
        for tr in panel.get("transformations", []):
            if tr.get("id") == "organize":
                for col in tr["options"].get("renameByName", {}):
                    if not col.startswith("Value") and col not in panel_labels:
                        problems.append(f"panel {title!r}: renames column {col!r}, which no query's series has")
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else str(var["query"])
        m = re.fullmatch(r"label_values\((.*),\s*([a-zA-Z_]\w*)\)", q)
        if m is None:
            problems.append(f"variable {var['name']}: {q!r} is not label_values(SELECTOR, LABEL)")
            continue
        have, found = query_labels(m.group(1), series)
        problems += [f"variable {var['name']}: {p}" for p in found]
        if m.group(2) not in have:
            problems.append(f"variable {var['name']}: lists label {m.group(2)!r}, which its series lack")
    return problems


def table_column_problems(dash: dict[str, Any]) -> list[str]:
    """A table panel must not show Grafana's default value column names
    (``Value`` for one query, ``Value #<refId>`` for several): each is renamed
    or hidden by an organize transformation."""
    problems = []
    for panel in dash.get("panels", []):
        if panel.get("type") != "table":
            continue
        refs = [t["refId"] for t in panel.get("targets", [])]
        defaults = ["Value"] if len(refs) == 1 else [f"Value #{r}" for r in refs]
        named: set[str] = set()
        for tr in panel.get("transformations", []):
            if tr.get("id") == "organize":
                named |= set(tr["options"].get("renameByName", {}))
                named |= {k for k, v in tr["options"].get("excludeByName", {}).items() if v}
        for col in defaults:
            if col not in named:
                problems.append(f"table {panel.get('title')!r} shows a column {col!r}: rename or hide it "
                                f"(organize transformation)")
    return problems


@pytest.fixture(scope="module")
def captured() -> list[tuple[str, dict[str, str]]]:
    return capture_series(CAPTURE.read_text())


def test_every_query_selects_captured_series_with_the_labels_it_uses(captured) -> None:
    assert query_problems(json.loads(DASHBOARD.read_text()), captured) == []


def test_table_columns_have_names() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert [p["title"] for p in dash["panels"] if p["type"] == "table"]
    assert table_column_problems(dash) == []


def test_a_panel_shows_used_against_request_and_limit_per_container(captured) -> None:
    dash = json.loads(DASHBOARD.read_text())
    want = {f"fracplugin_container_gpu_memory_{k}_bytes" for k in ("used", "request", "limit")}
    panels = [p for p in dash["panels"] if p["type"] == "timeseries"
              and want <= {n for t in p["targets"] for n in _METRIC.findall(t["expr"])}]
    assert panels, "no time series panel shows used, request and limit together"
    for p in panels:
        for t in p["targets"]:
            have, problems = query_labels(t["expr"], captured)
            assert problems == [] and {"namespace", "pod", "container"} <= have


def _set_expr(dash: dict[str, Any], title: str, old: str, new: str) -> dict[str, Any]:
    dash = copy.deepcopy(dash)
    (panel,) = [p for p in dash["panels"] if p.get("title") == title]
    t = next(t for t in panel["targets"] if old in t["expr"] or old in t.get("legendFormat", ""))
    t["expr"] = t["expr"].replace(old, new)
    t["legendFormat"] = t.get("legendFormat", "").replace(old, new)
    return dash


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: _set_expr(d, "GPU memory held vs total", 'gpu=~"$gpu"', 'gpu_idx="0"'), "selects no series"),
    (lambda d: _set_expr(d, "GPU memory held vs total", 'node=~"$node"', 'node="gpu-node-9"'), "selects no series"),
    (lambda d: _set_expr(d, "Hooks per second", "by (door, node)", "by (door, host)"), "groups by 'host'"),
    (lambda d: _set_expr(d, "Tenants per GPU", "{{gpu}}", "{{gpu_id}}"), "legend shows {{gpu_id}}"),
    (lambda d: _set_expr(d, "Hook latency p50 / p99", "{{door}}", "{{mode}}"), "legend shows {{mode}}"),
], ids=["wrong-label", "no-node", "group-by", "legend", "legend-after-sum"])
def test_query_check_fails_on_a_mutated_copy(captured, mutate, needle: str) -> None:
    problems = query_problems(mutate(json.loads(DASHBOARD.read_text())), captured)
    assert any(needle in p for p in problems), problems


def test_table_check_fails_without_the_organize_transformation() -> None:
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        p["transformations"] = [t for t in p.get("transformations", []) if t["id"] != "organize"]
    problems = table_column_problems(dash)
    assert any("'Value #A'" in p for p in problems) and any("'Value'" in p for p in problems), problems


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


# ---------------------------------------------------------------- per GPU, never summed across GPUs (issue 36 item 5)
_AGG = re.compile(r"\b(sum|max|min|avg|count)\s+(by|without)\s*\(([^)]*)\)\s*\(")


def summed_across_gpus_problems(dash: dict[str, Any], series: list[tuple[str, dict[str, str]]]) -> list[str]:
    """A query that aggregates a per-GPU memory series (bytes with a ``gpu``
    label: a container's request/limit/used, its CUDA limits, a GPU's held or
    total) without keeping ``gpu``: a container's limit holds on each of its
    GPUs, so a sum over them (125.8 GiB for two 62.9 GiB limits) is no
    quantity any GPU has."""
    per_gpu = {n for n, lbl in series if n.endswith("_bytes") and "gpu" in lbl}
    problems = []
    for panel in dash.get("panels", []):
        for t in panel.get("targets", []):
            q = t.get("expr", "")
            for m in _AGG.finditer(q):
                labels = {x.strip() for x in m.group(3).split(",")}
                inner = q[m.end():]
                names = set(_METRIC.findall(inner)) & per_gpu
                if names and (("gpu" not in labels) if m.group(2) == "by" else ("gpu" in labels)):
                    problems.append(f"panel {panel.get('title')!r} {t.get('refId')}: {m.group(1)} {m.group(2)} "
                                    f"({m.group(3)}) over {sorted(names)} adds up GPUs")
    return problems


def test_no_panel_sums_memory_across_gpus(captured) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert summed_across_gpus_problems(dash, captured) == []
    # the per-container panel as it was (one pod: a 125.8 GiB limit beside 79.6 GiB GPUs) fails
    old = _set_expr(dash, "GPU memory per container and GPU: used vs request vs limit",
                    'fracplugin_container_gpu_memory_limit_bytes{node=~"$node",gpu=~"$gpu"}',
                    'sum by (node, namespace, pod, container) '
                    '(fracplugin_container_gpu_memory_limit_bytes{node=~"$node",gpu=~"$gpu"})')
    assert any("adds up GPUs" in p for p in summed_across_gpus_problems(old, captured))


def test_enforcement_panels_show_planned_vs_enforced_per_gpu_and_what_is_not_enforced(captured) -> None:
    """The enforcement section: a table of planned vs enforced (read back)
    soft and hard limits with used, per container and GPU; the containers
    not enforced; the node's capabilities (why none is); the over-limit series."""
    dash = json.loads(DASHBOARD.read_text())
    by_title = {p["title"]: p for p in dash["panels"]}
    table = by_title["Planned vs enforced limits per container and GPU"]
    exprs = [t["expr"] for t in table["targets"]]
    for kind in ("soft", "hard"):
        for source in ("planned", "enforced"):
            assert any(f'kind="{kind}"' in e and f'source="{source}"' in e for e in exprs), (kind, source)
    assert any('kind="used"' in e for e in exprs)
    for e in exprs:
        have, problems = query_labels(e, captured)
        assert problems == [] and {"namespace", "pod", "container", "gpu"} <= have, (e, problems)
    not_enforced = by_title["Not enforced: which containers"]["targets"][0]["expr"]
    assert re.fullmatch(r'fracplugin_container_cuda_memory_limit_enforced\{node=~"\$node"\} == 0', not_enforced)
    assert "fracplugin_node_capability" in by_title["Node capabilities for memory limits"]["targets"][0]["expr"]
    over = by_title["Over limit per container and GPU"]
    assert over["targets"][0]["legendFormat"].endswith("GPU {{gpu}}")
    assert over["targets"][0]["expr"].startswith("fracplugin_container_gpu_memory_over_limit{")
