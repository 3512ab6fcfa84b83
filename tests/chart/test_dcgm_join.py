"""The operator guide's PromQL joins with dcgm-exporter ("### Next to dcgm-exporter" in
docs/operator-guide.md), evaluated by the real promtool (`promtool test rules`, promql_expr_test).

Inputs: fracplugin's series as the real daemon names them (the capture,
tests/fixtures/metrics/daemon-metrics.txt, with chosen values) and dcgm-exporter's per-GPU series
as it writes them for the recorded PodResources answer (tests/fixtures/podresources/) with
``--nvidia-resource-names fracplugin.io/gpu-memory --kubernetes-virtual-gpus``: one copy per
(container, unit) with ``pod``/``namespace``/``container``/``vgpu``, the per-GPU series kept
beside the copies of ``DCGM_FI_DEV_FB_USED`` (the rule: tests/unit/test_dcgm_exporter_join.py).
The join must give one answer per fracplugin series, whatever the copies.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from chartutil import METRICS_FIXTURE, REPO, tool

GUIDE = REPO / "docs" / "operator-guide.md"
TARGET = {"instance": "10.0.0.7:9400", "job": "dcgm-exporter"}
OURS = {"instance": "10.0.0.7:2112", "job": "fracplugin"}
FB_USED_MIB = {0: 4096, 1: 8192, 2: 1024, 3: 2048}
"""The whole GPU's DCGM_FI_DEV_FB_USED (MiB); a pod's copy carries less."""
XID = {0: 79, 1: 0, 2: 0, 3: 0}


def _rule():
    spec = importlib.util.spec_from_file_location("fp_dcgm_rule", REPO / "tests" / "unit" / "test_dcgm_exporter_join.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fp_dcgm_rule"] = mod
    spec.loader.exec_module(mod)
    return mod


def guide_queries() -> list[str]:
    """The indented PromQL blocks of the guide's dcgm-exporter section, one per ``#`` comment."""
    m = re.search(r"^### Next to dcgm-exporter\n(.*?)(?=^##)", GUIDE.read_text(), re.M | re.S)
    assert m, "docs/operator-guide.md has no '### Next to dcgm-exporter' section"
    out: list[list[str]] = []
    for line in m.group(1).splitlines():
        if not line.startswith("    "):
            continue
        if line.strip().startswith("#"):
            out.append([])
        else:
            out[-1].append(line.strip())
    return [" ".join(q) for q in out]


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _dcgm_inputs(rule) -> list[dict[str, str]]:
    copies = rule.dcgm_attribution(rule.listed(), ["fracplugin.io/gpu-memory"], virtual_gpus=True)
    out = []
    for g in rule.NODE.gpus:
        base = {"UUID": g.uuid, "gpu": str(g.index), "modelName": g.name, "Hostname": rule.NODE.name,
                "device": f"nvidia{g.minor}", "pci_bus_id": g.pci_bus_id, **TARGET}
        who = copies.get(g.index, [])
        # FB_USED: the device-level series stays beside the per-pod copies; XID: copies only (if any)
        out.append({"series": _series("DCGM_FI_DEV_FB_USED", base), "values": f"{FB_USED_MIB[g.index]}x5"})
        for ns, pod, ct, vgpu in who:
            lab = {**base, "namespace": ns, "pod": pod, "container": ct, "vgpu": vgpu}
            out.append({"series": _series("DCGM_FI_DEV_FB_USED", lab), "values": f"{FB_USED_MIB[g.index] // 4}x5"})
            out.append({"series": _series("DCGM_FI_DEV_XID_ERRORS", lab), "values": f"{XID[g.index]}x5"})
        if not who:
            out.append({"series": _series("DCGM_FI_DEV_XID_ERRORS", base), "values": f"{XID[g.index]}x5"})
    return out


def test_guide_joins_give_one_answer_per_fracplugin_series(tmp_path: Path) -> None:
    rule = _rule()
    gpu_of = {g.uuid: g.index for g in rule.NODE.gpus}
    samples = [s for fam in text_string_to_metric_families(METRICS_FIXTURE.read_text()) for s in fam.samples
               if s.name in ("fracplugin_container_gpu_memory_used_bytes", "fracplugin_container_gpu_memory_request_bytes")]
    used = [s for s in samples if s.name == "fracplugin_container_gpu_memory_used_bytes"]
    assert used and {s.labels["UUID"] for s in used} <= set(gpu_of)
    inputs = _dcgm_inputs(rule)
    for i, s in enumerate(samples):
        value = (i + 1) * 2**28 if s.name.endswith("used_bytes") else s.value
        inputs.append({"series": _series(s.name, {**s.labels, **OURS}), "values": f"{value:.0f}x5"})
    share, xid = guide_queries()
    assert "on(UUID) group_left" in share and "on(UUID) group_left" in xid
    exp_share = [{"labels": _series("", {**s.labels, **OURS}),
                  "value": ((samples.index(s) + 1) * 2**28) / (FB_USED_MIB[gpu_of[s.labels["UUID"]]] * 1048576)}
                 for s in used]
    containers = {(s.labels["namespace"], s.labels["pod"], s.labels["container"], s.labels["UUID"])
                  for s in samples if s.name.endswith("request_bytes")}
    exp_xid = [{"labels": _series("", dict(zip(("namespace", "pod", "container", "UUID"), c))), "value": XID[gpu_of[c[3]]]}
               for c in sorted(containers) if XID[gpu_of[c[3]]] > 0]
    assert exp_xid  # the capture has a container on the GPU with the XID
    doc = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": inputs,
        "promql_expr_test": [{"expr": share, "eval_time": "2m", "exp_samples": exp_share},
                             {"expr": xid, "eval_time": "2m", "exp_samples": exp_xid}]}]}
    path = tmp_path / "dcgm-join.test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = subprocess.run([tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
