"""fracplugin explain as a user runs it: a real subprocess, exit codes, JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", *args],
                          capture_output=True, text=True, timeout=60)


def test_bound_inference_json(examples, node_file):
    r = run(str(examples / "pods/inference-sm-sharing-4gpu.bound.yaml"), "--node", str(node_file), "-o", "json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["pod"] == "default/inference" and report["node"] == "gpu-node-1"
    (c,) = report["containers"]
    assert set(c) >= {"name", "fractional", "devices", "compute_mode", "env", "mounts", "error"}
    assert c["fractional"] is True and c["error"] is None and c["compute_mode"] == "sm-sharing"
    assert c["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == (  # issue 35 input 2: UUID keys, its own GPUs
        "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01=61440M,GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a02=61440M,"
        "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a03=61440M,GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a04=61440M")
    assert c["mounts"][0]["destination"] == "/tmp/nvidia-mps" and c["mounts"][0]["read_only"] is True


@pytest.mark.parametrize("limits,holds", [("apply", "cgroup"), ("off", "per-process"), (None, "cgroup")])
def test_what_holds_each_gpus_total(examples, node_file, tmp_path, limits, holds):
    """Issue 35 input 2: per GPU, what would hold the container's total: the cgroup limit with
    --memory-limits apply (or the default auto) on a capable node (driver r615+, no MIG), the per-process
    pinned limit with off, and never the cgroup on a node whose driver cannot (r570)."""
    pod = str(examples / "pods/inference-sm-sharing-4gpu.bound.yaml")
    r = run(pod, "--node", str(node_file), "-o", "json", *(["--memory-limits", limits] if limits else []))
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)["containers"]
    assert c["holds"] == {u: holds for u in c["devices"]} and len(c["devices"]) == 4
    old = tmp_path / "old.yaml"
    old.write_text(node_file.read_text().replace('driver_version: "615.71.09"', 'driver_version: "570.86.15"'))
    r = run(pod, "--node", str(old), "-o", "json", "--memory-limits", "apply", "--memory-limits-policy", "warn")
    (c,) = json.loads(r.stdout)["containers"]
    assert set(c["holds"].values()) == {"per-process"}, r.stderr
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in c["env"]  # the toolkit hook would fail the start: withheld, as the daemon
    assert "what holds the total per GPU: GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01 per-process" in run(
        pod, "--node", str(old), "--memory-limits-policy", "warn").stdout
    # the daemon's default policy refuses there (review: explain planned it)
    r = run(pod, "--node", str(old), "-o", "json")
    (c,) = json.loads(r.stdout)["containers"]
    assert r.returncode == 1 and c["error"]["key"] == "node", r.stdout
    assert "driver 570.86.15 is older than r615" in c["error"]["reason"], c["error"]


def test_table_output_and_refusal_exit_code(tmp_path, node_file):
    pod = tmp_path / "pod.yaml"
    pod.write_text("""
apiVersion: v1
kind: Pod
metadata:
  name: bad
  namespace: ns
  uid: u-1
  annotations:
    nvidia.com/container.app.gpu-memory.request: "40Gi"
    nvidia.com/container.app.gpu-memory.limit: "20Gi"
spec:
  containers: [{name: app, image: x}, {name: side, image: y}]
""")
    r = run(str(pod), "--node", str(node_file))
    assert r.returncode == 1
    assert "container app: REFUSED" in r.stdout
    assert "the limit must be >= the request" in r.stdout
    assert "container side: not fractional" in r.stdout
    j = json.loads(run(str(pod), "--node", str(node_file), "-o", "json").stdout)
    assert j["containers"][0]["error"] == {
        "key": "nvidia.com/container.app.gpu-memory.limit", "value": "20Gi",
        "reason": "is below the request 40Gi (40960 MiB): the limit must be >= the request"}
    only = json.loads(run(str(pod), "--node", str(node_file), "-o", "json", "--container", "side").stdout)
    assert [c["name"] for c in only["containers"]] == ["side"]


@pytest.mark.parametrize("content,fragment", [
    (None, "cannot read pod file"),
    ("a: [unclosed", "not valid YAML"),
    ("kind: Service\nmetadata: {name: x}\n", "holds no Pod"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, node_file, content, fragment):
    pod = tmp_path / "pod.yaml"
    if content is not None:
        pod.write_text(content)
    r = run(str(pod), "--node", str(node_file))
    assert r.returncode == 2
    assert fragment in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_typo_in_a_container_name_is_a_warning(tmp_path, node_file):
    pod = tmp_path / "pod.yaml"
    pod.write_text("""
kind: Pod
metadata:
  name: typo
  uid: u-2
  annotations:
    nvidia.com/container.ap.gpu-memory.request: "20Gi"
spec:
  containers: [{name: app, image: x}]
""")
    r = run(str(pod), "--node", str(node_file))
    assert r.returncode == 0
    assert "warning: annotation nvidia.com/container.ap.gpu-memory.request names no container" in r.stdout
    j = json.loads(run(str(pod), "--node", str(node_file), "-o", "json").stdout)
    assert len(j["warnings"]) == 1 and j["containers"][0]["fractional"] is False
    assert run(str(pod), "--node", str(node_file), "--reserve-mib", "-5").returncode == 2


def test_bad_node_file_and_unknown_container(tmp_path, examples):
    node = tmp_path / "node.yaml"
    node.write_text("gpus: [{index: 0}]\n")
    pod = str(examples / "pods/notebook-time-slicing-2gpu.yaml")
    r = run(pod, "--node", str(node))
    assert r.returncode == 2 and "lacks 'uuid'" in r.stderr
    r = run(pod, "--node", str(examples / "nodes/gpu-node-1.yaml"), "--container", "ghost")
    assert r.returncode == 2 and "no container 'ghost'" in r.stderr


def test_explain_against_a_ledger_shows_the_mode_guard(tmp_path, examples, node_file):
    from fracplugin.gpu.simulated import load_node
    from fracplugin.ledger import Ledger
    from fracplugin.model import PodRef
    from tests.helpers import plan_container
    import yaml
    node = load_node(node_file)
    led = Ledger(node, tmp_path / "ledger.json")
    inf = yaml.safe_load((examples / "pods/inference-sm-sharing-4gpu.bound.yaml").read_text())
    led.admit(plan_container(inf["metadata"]["annotations"], "app", PodRef("default", "inference", inf["metadata"]["uid"]), node, led))
    r = run(str(examples / "pods/notebook-time-slicing-2gpu.yaml"), "--node", str(node_file),
            "--ledger", str(tmp_path / "ledger.json"))
    assert r.returncode == 1 and "is in sm-sharing mode for default/inference/app" in r.stdout


def test_containers_of_one_pod_are_placed_against_each_other(tmp_path, node_file):
    """Two 50Gi containers cannot both fit on one 81559 MiB GPU (issue 10 item 6):
    named on GPU 0, the second is refused; placed by the node, they get two GPUs."""
    pod = tmp_path / "pod.yaml"
    pod.write_text("""
kind: Pod
metadata:
  name: two
  uid: u-3
  annotations:
    nvidia.com/container.a.gpu-memory.request: "50Gi"
    nvidia.com/container.a.gpus.devices: "0"
    nvidia.com/container.b.gpu-memory.request: "50Gi"
    nvidia.com/container.b.gpus.devices: "0"
    nvidia.com/container.c.gpu-memory.request: "50Gi"
    nvidia.com/container.d.gpu-memory.request: "50Gi"
spec:
  containers: [{name: a, image: x}, {name: b, image: x}, {name: c, image: x}, {name: d, image: x}]
""")
    r = run(str(pod), "--node", str(node_file), "-o", "json")
    assert r.returncode == 1, r.stdout
    a, b, c, d = json.loads(r.stdout)["containers"]
    assert a["error"] is None and a["devices"] == ["GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01"]
    assert b["error"] is not None and "30359 MiB of 81559 MiB free" in b["error"]["reason"]
    assert c["devices"] != d["devices"] and a["devices"][0] not in c["devices"] + d["devices"]


def test_a_named_native_sidecar_is_listed_fractional_and_the_app_untouched(tmp_path, node_file):
    """Issue 34, input 5: the sidecar (an init container with restartPolicy
    Always) gets the pod-level fraction, the app is not fractional, nothing is
    refused; a plain init container is not listed."""
    pod = tmp_path / "pod.yaml"
    pod.write_text("""
apiVersion: v1
kind: Pod
metadata:
  name: kai-sidecar
  annotations:
    gpu-fraction: "0.25"
    gpu-fraction-container-name: sidecar
spec:
  initContainers:
  - name: setup
  - name: sidecar
    restartPolicy: Always
  containers:
  - name: app
""")
    r = run(str(pod), "--node", str(node_file), "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert [(c["name"], c["fractional"], c["request_mib"], c["error"]) for c in report["containers"]] == [
        ("sidecar", True, 20133, None), ("app", False, None, None)]  # floor((81559 - 1024) x 0.25)
    assert report["warnings"] == []
    r = run(str(pod), "--node", str(node_file), "--container", "sidecar")
    assert r.returncode == 0 and "container sidecar: time-slicing, 20133 MiB request" in r.stdout, r.stdout
    assert "container app" not in r.stdout
