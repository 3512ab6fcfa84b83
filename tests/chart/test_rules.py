"""fracplugin's alerts (deploy/helm/fracplugin/files/prometheus-rules.yaml)
with the real promtool: `promtool check rules` and `promtool test rules`
(tests/chart/rules/*.test.yaml). The test inputs are series the daemon emits:
each input series' name and label names are those of a series in the capture
from the real daemon (tests/fixtures/metrics/daemon-metrics.txt) plus the
target labels a scrape adds; every metric an alert names is in the capture.
Each check fails on a mutated copy.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from chartutil import CHART, METRICS_FIXTURE, REPO, exposition_series, metric_names_in

RULES = CHART / "files" / "prometheus-rules.yaml"
TESTS_DIR = REPO / "tests" / "chart" / "rules"
TARGET_LABELS = {"instance", "job"}  # added by the scrape
OPTIONAL_LABELS = {"node"}  # the daemon's own, absent only when it knows no node name (metrics.NODE_LABEL)
# Alerts the issue asks for (issue 16 item 3), each with a runbook section.
ALERTS = {
    "FracpluginMPSDaemonDown", "FracpluginMPSDaemonRestarting", "FracpluginMPSDaemonWedged",
    "FracpluginDevicePluginNotRegistered", "FracpluginNRIDisconnected", "FracpluginRefusalsClimbing",
    "FracpluginGPUUnhealthy", "FracpluginHookLatencyNearBudget", "FracpluginLedgerDisagreesWithRuntime",
    "FracpluginMemoryLimitNotEnforced",  # issue 23 item 4
    "FracpluginContainerOverGpuMemoryLimit",  # issue 35 item 3
    "FracpluginSoftLimitReservationDrift",  # issue 35 item 5
}
RUNBOOKS = REPO / "docs" / "runbooks.md"


def _rules(path: Path = RULES) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def _promtool(promtool: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, cwd=cwd)


def test_rules_are_valid(promtool: str) -> None:
    out = _promtool(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_fires_and_stays_silent_as_tested(promtool: str) -> None:
    tests = sorted(TESTS_DIR.glob("*.test.yaml"))
    assert tests
    out = _promtool(promtool, "test", "rules", *map(str, tests))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_tested_firing_and_silent() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for path in TESTS_DIR.glob("*.test.yaml"):
        for t in yaml.safe_load(path.read_text())["tests"]:
            for case in t.get("alert_rule_test", []):
                (fired if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {r["alert"] for r in _rules()}
    assert names == ALERTS
    assert fired == names and silent == names


def runbook_url_problems(rules: list[dict], chart: dict, runbooks: str) -> list[str]:
    """Every alert's ``runbook_url`` is absolute: Chart.yaml's ``sources[0]``,
    ``/blob/v<chart version>/docs/runbooks.md#<alert in lower case>``, and
    docs/runbooks.md has that section (issue 27 item 3: kube-prometheus'
    annotation name, a link that works from Alertmanager)."""
    want = f"{chart['sources'][0]}/blob/v{chart['version']}/docs/runbooks.md#"
    problems = []
    for r in rules:
        ann = r.get("annotations", {})
        url = ann.get("runbook_url", "")
        if "runbook" in ann:
            problems.append(f"alert {r['alert']} has a relative 'runbook' annotation; use runbook_url")
        if url != want + r["alert"].lower():
            problems.append(f"alert {r['alert']}: runbook_url {url!r} is not {want + r['alert'].lower()!r}")
        if not re.search(rf"^##+ {r['alert']}\s*$", runbooks, re.M):
            problems.append(f"docs/runbooks.md has no section {r['alert']}")
    return problems


def test_every_alert_has_an_absolute_runbook_url_at_the_charts_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["home"] == chart["sources"][0] and chart["sources"][0].startswith("https://")
    assert runbook_url_problems(_rules(), chart, RUNBOOKS.read_text()) == []


def test_runbook_url_check_fails_on_mutated_copies() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    text = RUNBOOKS.read_text()
    rules = _rules()
    old = [dict(rules[0], annotations={**rules[0]["annotations"], "runbook_url": "docs/runbooks.md#x"})]
    assert "is not" in runbook_url_problems(old, chart, text)[0]
    bumped = {**chart, "version": "9.9.9"}
    assert len(runbook_url_problems(rules, bumped, text)) == len(rules)
    assert runbook_url_problems(rules, chart, text.replace("## FracpluginGPUUnhealthy", "## GPU")) == [
        "docs/runbooks.md has no section FracpluginGPUUnhealthy"]


def input_series_problems(test_files: list[Path], captured: dict[str, set[frozenset[str]]]) -> list[str]:
    """Every input series of the promtool tests is a series the daemon emits:
    its name is in the capture with exactly its label names (the scrape's
    target labels aside, and ``node`` present or not)."""
    problems = []
    for path in test_files:
        for t in yaml.safe_load(path.read_text())["tests"]:
            for s in t.get("input_series", []):
                m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$", s["series"])
                if not m:
                    problems.append(f"{path.name}: cannot parse {s['series']!r}")
                    continue
                name = m.group(1)
                labels = frozenset(re.findall(r'([a-zA-Z_]\w*)="', m.group(2))) - TARGET_LABELS - OPTIONAL_LABELS
                if name not in captured:
                    problems.append(f"{path.name}: {name} is not a series the daemon emits")
                elif labels not in {x - OPTIONAL_LABELS for x in captured[name]}:
                    problems.append(f"{path.name}: {name} with labels {sorted(labels)}: the daemon emits "
                                    f"{[sorted(x) for x in captured[name]]}")
    return problems


def rule_metric_problems(rules: list[dict], captured: dict[str, set[frozenset[str]]]) -> list[str]:
    return [f"alert {r['alert']} names {n}, which the daemon does not emit"
            for r in rules for n in sorted(metric_names_in(r["expr"])) if n not in captured]


def test_inputs_and_rules_use_the_series_the_daemon_emits() -> None:
    captured = exposition_series(METRICS_FIXTURE.read_text())
    assert input_series_problems(sorted(TESTS_DIR.glob("*.test.yaml")), captured) == []
    assert rule_metric_problems(_rules(), captured) == []


# ---------------------------------------------------------------- mutated copies fail


@pytest.fixture
def copied(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the rule file and of the tests pointing at it."""
    rules = tmp_path / "rules.yaml"
    shutil.copy(RULES, rules)
    test = tmp_path / "fracplugin-rules.test.yaml"
    doc = yaml.safe_load((TESTS_DIR / "fracplugin-rules.test.yaml").read_text())
    doc["rule_files"] = [rules.name]
    test.write_text(yaml.safe_dump(doc, sort_keys=False))
    return rules, test


@pytest.mark.parametrize(("old", "new"), [
    ("fracplugin_mps_daemon_up == 0", "fracplugin_mps_daemon_up == 1"),      # inverted condition
    ("[15m]) > 2", "[15m]) > 20"),                                          # threshold too high
    ("for: 5m", "for: 30m"),                                                # never fires in time
    ('{door="nri"}', '{door="allocate"}'),                                  # wrong door
    ("fracplugin_nri_unadjusted_containers > 0", "fracplugin_nri_unadjusted > 0"),  # renamed metric
], ids=["inverted", "threshold", "for", "door", "metric-name"])
def test_promtool_tests_fail_on_a_mutated_rule(promtool: str, copied: tuple[Path, Path], old: str, new: str) -> None:
    rules, test = copied
    ok = _promtool(promtool, "test", "rules", str(test))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = rules.read_text()
    assert old in text
    rules.write_text(text.replace(old, new, 1))
    out = _promtool(promtool, "test", "rules", str(test))
    assert out.returncode != 0


def test_check_rules_fails_on_a_broken_expression(promtool: str, copied: tuple[Path, Path]) -> None:
    rules, _ = copied
    rules.write_text(rules.read_text().replace("fracplugin_gpu_healthy == 0", "fracplugin_gpu_healthy == ", 1))
    out = _promtool(promtool, "check", "rules", str(rules))
    assert out.returncode != 0


def test_series_checks_fail_on_mutated_copies(tmp_path: Path) -> None:
    captured = exposition_series(METRICS_FIXTURE.read_text())
    test = tmp_path / "t.test.yaml"
    test.write_text((TESTS_DIR / "fracplugin-rules.test.yaml").read_text()
                    .replace('fracplugin_gpu_healthy{gpu_uuid=', 'fracplugin_gpu_health{gpu_uuid=', 1)
                    .replace('fracplugin_mps_daemon_up{mode=', 'fracplugin_mps_daemon_up{daemon=', 1))
    problems = input_series_problems([test], captured)
    assert any("fracplugin_gpu_health is not" in p for p in problems), problems
    assert any("fracplugin_mps_daemon_up with labels ['daemon']" in p for p in problems), problems
    rules = [{"alert": "X", "expr": "fracplugin_gpu_unhealthy_total > 0"}]
    assert rule_metric_problems(rules, captured) == ["alert X names fracplugin_gpu_unhealthy_total, which the daemon does not emit"]


# ---------------------------------------------------------------- runbook links and the project's address


def test_chart_home_and_sources_are_the_projects_repository() -> None:
    """Chart.yaml's ``home`` and ``sources`` are the repository pyproject.toml's
    [project.urls] names (issue 36 item 4), not two addresses that drift."""
    import tomllib

    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["home"] == urls["Homepage"] == urls["Source"] and chart["sources"] == [urls["Source"]]
    assert urls["Documentation"] == f"{urls['Source']}/tree/main/docs"


def test_runbook_url_comes_from_the_alerts_runbook_base_url_value(helm: str) -> None:
    """``alerts.runbookBaseURL`` (values.yaml, values.schema.json) is where every
    alert's runbook_url points: its default is docs/runbooks.md in the project's
    repository at the chart's version (the file's links); another value moves
    every link; a value that is not an http(s) URL is refused by the schema."""
    from chartutil import objects, rendered, template

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    default = yaml.safe_load((CHART / "values.yaml").read_text())["alerts"]["runbookBaseURL"]
    assert default == f"{chart['sources'][0]}/blob/v{chart['version']}/docs/runbooks.md"
    assert {r["annotations"]["runbook_url"] for r in _rules()} == {f"{default}#{a.lower()}" for a in ALERTS}

    def urls(*sets: str) -> dict[str, str]:
        (rule,) = [d for d in objects(rendered(helm, [], ("prometheusRule.enabled=true", *sets)))
                   if d["kind"] == "PrometheusRule"]
        return {r["alert"]: r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]}

    assert urls() == {r["alert"]: r["annotations"]["runbook_url"] for r in _rules()}
    wiki = "https://wiki.example.com/ops/fracplugin-runbooks"
    assert urls(f"alerts.runbookBaseURL={wiki}") == {a: f"{wiki}#{a.lower()}" for a in ALERTS}
    bad = template(helm, [], ("prometheusRule.enabled=true", "alerts.runbookBaseURL=docs/runbooks.md"))
    assert bad.returncode != 0 and "runbookBaseURL" in bad.stderr, bad.stderr
