"""The operator guide's metrics table (docs/operator-guide.md) ("## Metrics") names exactly the metric families
of the daemon's /metrics, with their types and label names: the capture from
the real daemon (tests/fixtures/metrics/daemon-metrics.txt, re-captured and
compared with the live output by tests/component/test_metrics_capture.py).
Issue 27 item 3. The check fails on a mutated copy."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
README = REPO / "docs" / "operator-guide.md"  # the metrics table lives in the operator guide
CAPTURE = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"
GPU = ["gpu_uuid", "gpu_index", "UUID", "gpu", "modelName", "Hostname"]
"""What the table's ``GPU`` stands for (README says so above the table)."""
EVERY_SERIES = {"node"}  # on every series; README says so, the table leaves it out
_ROW = re.compile(r"^\| `(fracplugin_[a-z0-9_]+)` \|\s*(\w+)\s*\|([^|]*)\|")


def readme_table(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """{metric: (type, label names)} of the table in README's "## Metrics"
    section (``GPU`` expanded). Raises ValueError without that section."""
    m = re.search(r"^## Metrics\b.*?(?=^## )", text, re.M | re.S)
    if m is None:
        raise ValueError("docs/operator-guide.md has no '## Metrics' section")
    out = {}
    for line in m.group(0).splitlines():
        row = _ROW.match(line)
        if row:
            labels: list[str] = []
            for token in re.findall(r"[A-Za-z_]\w*", row.group(3)):
                labels += GPU if token == "GPU" else [token]
            out[row.group(1)] = (row.group(2), frozenset(labels))
    return out


def exported(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """{metric (counters with ``_total``): (type, label names but ``le`` and
    ``node``)} of a text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = {k for s in fam.samples for k in s.labels} - {"le"} - EVERY_SERIES
        out[name] = (fam.type, frozenset(labels))
    return out


def table_problems(table: dict[str, tuple[str, frozenset[str]]],
                   live: dict[str, tuple[str, frozenset[str]]]) -> list[str]:
    problems = [f"README lists {n}, which /metrics lacks" for n in sorted(set(table) - set(live))]
    problems += [f"/metrics has {n}, which README's table lacks" for n in sorted(set(live) - set(table))]
    for n in sorted(set(table) & set(live)):
        if table[n][0] != live[n][0]:
            problems.append(f"{n}: README says {table[n][0]}, /metrics says {live[n][0]}")
        if table[n][1] != live[n][1]:
            problems.append(f"{n}: README's labels {sorted(table[n][1])}, /metrics has {sorted(live[n][1])}")
    return problems


def test_readme_metrics_table_matches_metrics() -> None:
    table = readme_table(README.read_text())
    assert len(table) >= 20
    assert table_problems(table, exported(CAPTURE.read_text())) == []


def test_every_captured_series_has_the_node_label() -> None:
    samples = [s for fam in text_string_to_metric_families(CAPTURE.read_text()) for s in fam.samples]
    assert samples and all(s.labels.get("node") == "gpu-node-1" for s in samples)


def test_table_check_fails_on_mutated_copies() -> None:
    text = README.read_text()
    live = exported(CAPTURE.read_text())
    dropped = readme_table(text.replace("| `fracplugin_ledger_entries` |", "| ledger |", 1))
    assert table_problems(dropped, live) == ["/metrics has fracplugin_ledger_entries, which README's table lacks"]
    renamed = readme_table(text.replace("`fracplugin_gpu_tenants`", "`fracplugin_gpu_tenant_count`", 1))
    assert "README lists fracplugin_gpu_tenant_count, which /metrics lacks" in table_problems(renamed, live)
    relabelled = readme_table(text.replace("| gauge | `mode` |", "| gauge | `daemon` |", 1))
    assert any("README's labels ['daemon']" in p for p in table_problems(relabelled, live))
    typed = readme_table(text.replace("| `fracplugin_refusals_total` | counter |", "| `fracplugin_refusals_total` | gauge |"))
    assert table_problems(typed, live) == ["fracplugin_refusals_total: README says gauge, /metrics says counter"]
