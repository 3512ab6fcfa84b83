"""The committed capture of the daemon's /metrics (tests/fixtures/metrics/
daemon-metrics.txt, used by the alert tests and the dashboard check) is still
what the real daemon emits: re-captured here with scripts/capture_metrics.py
(the real daemon on the simulated node, driven through its NRI and device
plugin sockets), every series of the fixture (name and label names) must be
in the live output. The dashboard's and the alerts' metric names are checked
against the live output too, and every dashboard query (selectors, grouping,
legends, table columns, variables: tests/unit/test_dashboard.py's checks)
against the live series."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"
CHART_FILES = REPO / "deploy" / "helm" / "fracplugin" / "files"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')
_METRIC = re.compile(r"\bfracplugin_[a-z0-9_]+")


def series(text: str) -> dict[str, set[frozenset[str]]]:
    """{sample or family name: {label-name sets}} of a text exposition."""
    out: dict[str, set[frozenset[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            out.setdefault(line.split()[2], set())
        elif line and not line.startswith("#") and (m := _SAMPLE.match(line)):
            out.setdefault(m.group(1), set()).add(frozenset(_LABEL.findall(m.group(3) or "")))
    return out


def missing(fixture: dict[str, set[frozenset[str]]], live: dict[str, set[frozenset[str]]]) -> list[str]:
    """Series of the fixture that the live output lacks."""
    out = []
    for name, labelsets in sorted(fixture.items()):
        if name not in live:
            out.append(f"{name} is no longer exported")
        for ls in labelsets - live.get(name, set()):
            out.append(f"{name} with labels {sorted(ls)} is no longer exported")
    return out


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def live_text() -> str:
    mod = _load("capture_metrics", REPO / "scripts" / "capture_metrics.py")
    return mod.capture() + mod.capture_memory_limits()  # the demo's daemon, then a memory-limits one


@pytest.fixture(scope="module")
def live(live_text: str) -> dict[str, set[frozenset[str]]]:
    return series(live_text)


@pytest.mark.timeout(300)
def test_every_dashboard_query_selects_live_series(live_text: str) -> None:
    dash_check = _load("dashboard_check", REPO / "tests" / "unit" / "test_dashboard.py")
    dash = json.loads((CHART_FILES / "dashboard.json").read_text())
    assert dash_check.query_problems(dash, dash_check.capture_series(live_text)) == []
    # the daemon's own node label is on every live series (no scrape relabelling needed)
    samples = dash_check.capture_series(live_text)
    assert samples and {lbl.get("node") for _, lbl in samples} == {"gpu-node-1"}


def test_fixture_series_are_still_exported(live) -> None:
    problems = missing(series(FIXTURE.read_text()), live)
    assert not problems, "re-run scripts/capture_metrics.py (and check the alerts and dashboard):\n" + "\n".join(problems)


def test_dashboard_and_alert_metrics_are_exported(live) -> None:
    dash = (CHART_FILES / "dashboard.json").read_text()
    json.loads(dash)
    rules = [r["expr"] for g in yaml.safe_load((CHART_FILES / "prometheus-rules.yaml").read_text())["groups"]
             for r in g["rules"]]
    named = set(_METRIC.findall(dash)) | {n for e in rules for n in _METRIC.findall(e)}
    assert named and sorted(n for n in named if n not in live) == []


def test_missing_series_are_detected() -> None:
    fixture = series(FIXTURE.read_text())
    live = {k: set(v) for k, v in fixture.items()}
    del live["fracplugin_gpu_healthy"]
    live["fracplugin_mps_daemon_up"] = {frozenset({"daemon"})}
    problems = missing(fixture, live)
    assert "fracplugin_gpu_healthy is no longer exported" in problems
    assert "fracplugin_mps_daemon_up with labels ['mode', 'node'] is no longer exported" in problems
