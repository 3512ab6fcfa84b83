#!/usr/bin/env python3
"""Render the Grafana dashboard against a /metrics capture, as a PNG.

    .venv/bin/python scripts/render_dashboard.py [--capture FILE] [--html OUT.html] [--png OUT.png]

What this is (and is not): Grafana's own renderer cannot be installed here,
so this is a small stand-in. It evaluates each panel query of
deploy/helm/fracplugin/files/dashboard.json as an *instant* query against ONE
scrape (default tests/fixtures/metrics/daemon-metrics.txt, the real daemon's
/metrics captured by scripts/capture_metrics.py), with the variables set to
"All", and lays the panels out on Grafana's 24-column grid in HTML:

- stat panels: one number per series, with its legend;
- time series panels: the instant value of each series as a bar (one scrape
  has no history; the panel says so);
- table panels: Grafana's merge of the queries' series on their common labels,
  then the panel's organize transformation (hidden, renamed, ordered columns).

The evaluator knows only the PromQL this dashboard uses (a selector with
matchers, ``A / B`` on identical label sets, ``X == N``, ``X == bool N``, ``sum by``/``count by``,
``or on() vector(0)``). Queries over a range (``rate``, ``increase``,
``histogram_quantile`` of a rate) need two scrapes: their panels say "not
evaluated from a single scrape" instead of showing a made-up value. The HTML
is screenshotted by headless Chromium (``chromium-headless-shell`` or
``chromium`` on PATH) when ``--png`` is given.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "helm" / "fracplugin" / "files" / "dashboard.json"
CAPTURE = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"
VARIABLES = {"$node": ".*", "$gpu": ".*"}
ROW_PX = 30
WIDTH_PX = 1600

Series = tuple[dict[str, str], float]


class Unsupported(Exception):
    """A query this evaluator does not evaluate (a range query, or PromQL it does not know)."""


def load_capture(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample of a text exposition."""
    sys.path.insert(0, str(REPO / "src"))
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def _split_top(expr: str, op: str) -> tuple[str, str] | None:
    depth = 0
    for i in range(len(expr) - len(op) + 1):
        c = expr[i]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0 and expr.startswith(op, i):
            return expr[:i].strip(), expr[i + len(op):].strip()
    return None


def _strip_parens(expr: str) -> str:
    expr = expr.strip()
    while expr.startswith("(") and expr.endswith(")") and _split_top(expr[1:-1], ")") is None:
        depth = 0
        ok = True
        for i, c in enumerate(expr):
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and i < len(expr) - 1:
                ok = False
                break
        if not ok:
            break
        expr = expr[1:-1].strip()
    return expr


def evaluate(expr: str, samples: list[tuple[str, dict[str, str], float]]) -> list[Series]:
    """Instant value of ``expr`` over one scrape. Raises Unsupported."""
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    expr = _strip_parens(expr)
    if re.search(r"\b(rate|increase|irate|delta|histogram_quantile)\s*\(", expr):
        raise Unsupported("a range query: not evaluated from a single scrape")
    parts = _split_top(expr, " or on() vector(0)")
    if parts is not None:
        left = evaluate(parts[0], samples)
        return left or [({}, 0.0)]
    m = re.fullmatch(r"(sum|count)\s+by\s*\(([^)]*)\)\s*\((.*)\)", expr, re.S)
    if m:
        by = [x.strip() for x in m.group(2).split(",") if x.strip()]
        groups: dict[tuple[str, ...], list[float]] = {}
        for labels, v in evaluate(m.group(3), samples):
            groups.setdefault(tuple(labels.get(k, "") for k in by), []).append(v)
        return [({k: val for k, val in zip(by, key) if val}, sum(vs) if m.group(1) == "sum" else float(len(vs)))
                for key, vs in groups.items()]
    parts = _split_top(expr, " / ")
    if parts is not None:
        right = {tuple(sorted(lbl.items())): v for lbl, v in evaluate(parts[1], samples)}
        return [(lbl, v / right[key]) for lbl, v in evaluate(parts[0], samples)
                if (key := tuple(sorted(lbl.items()))) in right and right[key] != 0]
    m = re.fullmatch(r"(.*\S)\s*==\s*(bool\s+)?([0-9.]+)", expr, re.S)
    if m:
        want = float(m.group(3))
        if m.group(2):  # == bool: every series, 1 or 0
            return [(lbl, 1.0 if v == want else 0.0) for lbl, v in evaluate(m.group(1), samples)]
        return [(lbl, v) for lbl, v in evaluate(m.group(1), samples) if v == want]
    m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?", expr)
    if not m:
        raise Unsupported(f"PromQL this renderer does not evaluate: {expr}")
    matchers = re.findall(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"', m.group(3) or "")
    out = []
    for name, labels, value in samples:
        if name != m.group(1):
            continue
        ok = True
        for k, op, want in matchers:
            have = labels.get(k, "")
            hit = {"=": have == want, "!=": have != want}.get(op)
            if hit is None:
                hit = (re.fullmatch(want, have) is not None) == (op == "=~")
            ok = ok and hit
        if ok:
            out.append(({k: v for k, v in labels.items()}, value))
    return out


def fmt(value: float, unit: str) -> str:
    """A value as Grafana's unit would show it (bytes, percent, percentunit, s, short)."""
    if unit == "bytes":
        for suffix, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if abs(value) >= div:
                return f"{value / div:.1f} {suffix}"
        return f"{value:.0f} B"
    if unit == "percent":
        return f"{value:.1f}%"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:g}"


def legend(fmt_text: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt_text or "")
    return text if text and text != "__auto" else ", ".join(f"{k}={v}" for k, v in labels.items()) or "value"


def _table(panel: dict[str, Any], samples: list[tuple[str, dict[str, str], float]]) -> str:
    targets = panel["targets"]
    rows: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for t in targets:
        col = "Value" if len(targets) == 1 else f"Value #{t['refId']}"
        for labels, v in evaluate(t["expr"], samples):
            key = tuple(sorted(labels.items()))
            row = rows.setdefault(key, {"Time": "", **labels})
            row[col] = v
    columns: list[str] = []
    for r in rows.values():
        columns += [c for c in r if c not in columns]
    rename: dict[str, str] = {}
    for tr in panel.get("transformations", []):
        if tr["id"] == "organize":
            o = tr["options"]
            columns = [c for c in columns if not o.get("excludeByName", {}).get(c)]
            index = o.get("indexByName", {})
            columns.sort(key=lambda c: index.get(c, 1000))
            rename = o.get("renameByName", {})
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    head = "".join(f"<th>{html.escape(rename.get(c, c))}</th>" for c in columns)
    body = ""
    for r in rows.values():
        cells = "".join(
            f"<td class=num>{html.escape(fmt(r[c], unit))}</td>" if isinstance(r.get(c), float)
            else f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in columns)
        body += f"<tr>{cells}</tr>"
    return f"<table><tr>{head}</tr>{body}</table>"


def _panel_body(panel: dict[str, Any], samples: list[tuple[str, dict[str, str], float]]) -> str:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    if panel["type"] == "table":
        try:
            return _table(panel, samples)
        except Unsupported as exc:
            return f"<div class=na>{html.escape(str(exc))}</div>"
    items = []
    skipped = ""
    for t in panel["targets"]:
        try:
            items += [(legend(t.get("legendFormat", ""), lbl), v) for lbl, v in evaluate(t["expr"], samples)]
        except Unsupported as exc:
            skipped += f"<div class=na>query {html.escape(t['refId'])}: {html.escape(str(exc))}</div>"
    if not items:
        return skipped or "<div class=na>no data in the capture</div>"
    if panel["type"] == "stat":
        return skipped + "".join(f"<div class=stat><b>{html.escape(fmt(v, unit))}</b><span>{html.escape(n)}</span></div>"
                       for n, v in items)
    top = max(abs(v) for _, v in items) or 1.0
    bars = "".join(f"<div class=bar><span class=lbl>{html.escape(n)}</span><span class=track><span class=fill "
                   f"style='width:{100 * abs(v) / top:.1f}%'></span></span><span class=val>{html.escape(fmt(v, unit))}"
                   f"</span></div>" for n, v in items)
    return f"<div class=note>instant values of one scrape (Grafana draws these over time)</div>{skipped}{bars}"


def render_html(dash: dict[str, Any], samples: list[tuple[str, dict[str, str], float]], source: str) -> str:
    """The dashboard as one HTML page (panels absolutely placed on the grid)."""
    col = WIDTH_PX / 24
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    out = []
    for p in dash["panels"]:
        g = p["gridPos"]
        style = f"left:{g['x'] * col:.0f}px;top:{g['y'] * ROW_PX + 40}px;width:{g['w'] * col - 6:.0f}px;" \
                f"height:{g['h'] * ROW_PX - 6}px"
        if p["type"] == "row":
            out.append(f"<div class=row style='{style}'>{html.escape(p['title'])}</div>")
            continue
        out.append(f"<div class=panel style='{style}'><div class=title>{html.escape(p['title'])}</div>"
                   f"<div class=body>{_panel_body(p, samples)}</div></div>")
    css = """
body{margin:0;background:#111217;color:#ccccdc;font:12px DejaVu Sans,sans-serif}
.hdr{position:absolute;left:8px;top:8px;font-size:16px;color:#fff}.hdr small{color:#8e8e9e;font-size:11px}
.panel,.row{position:absolute;box-sizing:border-box}.panel{background:#181b1f;border:1px solid #2c3235;border-radius:3px;overflow:hidden}
.row{font-size:14px;color:#fff;padding:6px 4px;border-bottom:1px solid #2c3235}
.title{padding:5px 8px;font-weight:bold;color:#d8d9da}.body{padding:2px 8px;overflow:hidden;height:calc(100% - 30px)}
.stat{display:inline-block;margin:4px 10px 0 0}.stat b{display:block;font-size:26px;color:#73bf69}.stat span{color:#8e8e9e;font-size:10px}
.bar{display:flex;align-items:center;margin:2px 0}.lbl{width:46%;overflow:hidden;white-space:nowrap;text-overflow:ellipsis;font-size:10px}
.track{flex:1;background:#22252b;height:9px;margin:0 6px}.fill{display:block;height:9px;background:#5794f2}.val{width:70px;text-align:right;font-size:10px}
.na,.note{color:#8e8e9e;font-style:italic;font-size:10px;margin:3px 0}
table{border-collapse:collapse;width:100%;font-size:10px}th{text-align:left;color:#6e9fff;border-bottom:1px solid #2c3235;padding:2px 4px}
td{padding:2px 4px;border-bottom:1px solid #202226;white-space:nowrap}.num{text-align:right}
"""
    return (f"<!doctype html><html><head><meta charset=utf-8><style>{css}</style></head><body>"
            f"<div class=hdr>{html.escape(dash['title'])} <small>rendered by scripts/render_dashboard.py from "
            f"{html.escape(source)} (one scrape, instant queries, node=All, gpu=All); not Grafana</small></div>"
            + "".join(out) + f"<div style='position:absolute;top:{bottom * ROW_PX + 48}px;height:1px'></div></body></html>")


def screenshot(page: Path, png: Path, height: int) -> None:
    """Screenshot ``page`` with headless Chromium. Raises RuntimeError without one."""
    exe = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    if exe is None:
        raise RuntimeError("no chromium-headless-shell or chromium on PATH")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
               f"--window-size={WIDTH_PX},{height}", f"--screenshot={png}", page.as_uri()]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium failed ({out.returncode}): {out.stderr[-2000:]}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capture", type=Path, default=CAPTURE)
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    ap.add_argument("--html", type=Path)
    ap.add_argument("--png", type=Path)
    args = ap.parse_args(argv[1:])
    dash = json.loads(args.dashboard.read_text())
    samples = load_capture(args.capture.read_text())
    try:
        source = str(args.capture.resolve().relative_to(REPO))
    except ValueError:
        source = str(args.capture)
    page = render_html(dash, samples, source)
    with tempfile.TemporaryDirectory() as tmp:
        html_path = args.html or Path(tmp) / "dashboard.html"
        html_path.write_text(page)
        if args.png:
            bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
            screenshot(html_path, args.png, bottom * ROW_PX + 56)
            print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
