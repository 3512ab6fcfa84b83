"""scripts/render_dashboard.py (the stand-in renderer of docs/dashboard.png):
its instant-query evaluator gives the capture's values, refuses range
queries instead of inventing a value, and the HTML shows the tables' named
columns. Chromium is not needed here (the PNG step is not tested)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture(scope="module")
def rd():
    spec = importlib.util.spec_from_file_location("render_dashboard", REPO / "scripts" / "render_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["render_dashboard"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def samples(rd):
    return rd.load_capture(rd.CAPTURE.read_text())


def test_instant_queries_give_the_captures_values(rd, samples) -> None:
    req = rd.evaluate('sum by (node, namespace, pod, container) '
                      '(fracplugin_container_gpu_memory_request_bytes{node=~"$node",gpu=~"$gpu"})', samples)
    got = {(lbl["namespace"], lbl["pod"], lbl["container"]): v for lbl, v in req}
    assert got == {("research", "notebook", "app"): 2 * 40267 * MIB, ("default", "embeddings", "worker"): 8192 * MIB}
    modes = rd.evaluate('fracplugin_gpu_compute_mode_info{node=~"$node",gpu=~"$gpu"} == 1', samples)
    assert sorted(lbl["mode"] for lbl, _ in modes) == ["none", "none", "time-slicing", "time-slicing"]
    assert rd.evaluate('count by (node) (fracplugin_gpu_healthy{node=~"$node"} == 0) or on() vector(0)',
                       samples) == [({}, 0.0)]
    assert rd.evaluate('sum by (node) (fracplugin_gpu_healthy{node=~"$node"} == bool 0)', samples) == [
        ({"node": "gpu-node-1"}, 0.0)]
    ratio = rd.evaluate('fracplugin_gpu_memory_held_bytes{gpu="1"} / fracplugin_gpu_memory_total_bytes{gpu="1"}',
                        samples)
    assert [round(v, 4) for _, v in ratio] == [round(40267 / 81559, 4)]


def test_range_queries_are_not_evaluated(rd, samples) -> None:
    with pytest.raises(rd.Unsupported, match="single scrape"):
        rd.evaluate('increase(fracplugin_refusals_total{node=~"$node"}[5m])', samples)


def test_html_has_every_panel_and_named_table_columns(rd, samples) -> None:
    dash = json.loads(rd.DASHBOARD.read_text())
    page = rd.render_html(dash, samples, "capture")
    assert all(json.dumps(p["title"])[1:-1] in page or p["title"].replace("'", "&#x27;") in page for p in dash["panels"])
    assert "<th>Request</th>" in page and "<th>Limit</th>" in page and "<th>Used</th>" in page
    assert "Value #" not in page


def test_the_enforcement_panels_render_the_capture(rd, samples) -> None:
    """docs/dashboard.png's enforcement section: the capture's inference
    container is not enforced (NVML refused the set on its GPU 3,
    scripts/capture_metrics.py): its planned limits on four GPUs, read-back
    values on three, and it is listed as not enforced."""
    dash = json.loads(rd.DASHBOARD.read_text())
    (table,) = [p for p in dash["panels"] if p["title"] == "Planned vs enforced limits per container and GPU"]
    got = {t["refId"]: {lbl["gpu"]: v for lbl, v in rd.evaluate(t["expr"], samples)} for t in table["targets"]}
    assert got["B"] == {g: 61440 * MIB for g in "0123"}  # planned hard: the limit, on each GPU
    assert got["D"] == {g: 61440 * MIB for g in "012"}  # enforced hard: not read on GPU 3
    (ne,) = [p for p in dash["panels"] if p["title"] == "Not enforced: which containers"]
    assert [(lbl["pod"], lbl["container"]) for lbl, _ in rd.evaluate(ne["targets"][0]["expr"], samples)] == [
        ("inference", "app")]
    page = rd.render_html(dash, samples, "capture")
    assert "<th>Enforced hard</th>" in page and "<th>Planned soft</th>" in page
