"""``fracplugin explain`` on a live node (issue 27 item 2): a cluster pod as
``kubectl get pod -o yaml`` prints it, on standard input, planned against the
running daemon's ``/status`` (``--node-from-status URL``) or the daemon itself
(``--live``: its GPUs, settings and tenants). The daemon is ``fracplugin run``
on the simulated four-GPU node, as a subprocess (test_daemon.DaemonProc)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from tests.component.test_daemon import GPU0, NODE, DaemonProc, daemon, root  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
KUBECTL_POD = REPO / "tests" / "fixtures" / "kubectl" / "inference-pod.yaml"
UUIDS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]


def explain(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", *args], input=stdin,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def _report(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return json.loads(r.stdout)


def test_kubectl_pod_on_stdin_against_the_daemons_status(daemon: Callable[..., DaemonProc], root: Path) -> None:
    d = daemon("--no-nri", "--no-device-plugin", "--no-mps")
    url = f"http://{d.endpoints['health']}/status"
    pod = KUBECTL_POD.read_text()
    r = explain("-", "--node-from-status", url, "-o", "json", stdin=pod)
    assert r.returncode == 0, r.stderr
    report = _report(r)
    assert report["pod"] == "default/inference-7d9c6b5f4-x2k8q" and report["node"] == "gpu-node-1"
    (c,) = report["containers"]
    assert c["error"] is None and c["compute_mode"] == "sm-sharing" and sorted(c["devices"]) == UUIDS
    assert c["env"]["NVIDIA_GPU_MEMORY_REQUEST"] == "40960" and c["env"]["NVIDIA_GPU_MEMORY_LIMIT"] == "61440"
    # the daemon's own settings: its MPS root (the test's, not /run/fracplugin/mps) holds the pipe directory
    assert c["mounts"][0]["source"].startswith(str(root / "mps") + "/sm/shared/fp_")
    # the same plan as against the node file the daemon simulates, apart from that root
    offline = _report(explain(str(KUBECTL_POD), "--node", str(NODE), "-o", "json"))
    assert offline["containers"][0]["env"] == c["env"] and offline["containers"][0]["devices"] == c["devices"]
    # the table rendering, as an operator reads it
    r = explain("-", "--node-from-status", url, stdin=pod)
    assert r.returncode == 0 and "container app: sm-sharing, 40960 MiB request / 61440 MiB limit per GPU" in r.stdout


def test_live_plans_against_the_daemons_tenants(daemon: Callable[..., DaemonProc], root: Path) -> None:
    # every GPU already holds a time-slicing tenant: the sm-sharing pod cannot share any of them
    state = root / "state"
    state.mkdir()
    tenants = [{"pod_uid": f"u{i}", "namespace": "research", "pod_name": "nb", "container": "c", "gpu_uuid": u,
                "request_mib": 1024, "limit_mib": 1024, "mode": "time-slicing"} for i, u in enumerate(UUIDS)]
    (state / "ledger.json").write_text(json.dumps({"version": 1, "node": "gpu-node-1", "tenancies": tenants}))
    d = daemon("--no-nri", "--no-device-plugin", "--no-mps")
    pod = KUBECTL_POD.read_text()
    r = explain("-", "--live", "--health-address", d.endpoints["health"], "-o", "json", stdin=pod)
    assert r.returncode == 1, r.stdout + r.stderr
    err = _report(r)["containers"][0]["error"]
    assert "time-slicing" in err["reason"] and "research/nb/c" in err["reason"], err
    # the daemon's address from the environment, as `fracplugin status` finds it
    r = explain("-", "--live", "-o", "json", stdin=pod, env={"FRACPLUGIN_HEALTH_ADDRESS": d.endpoints["health"]})
    assert r.returncode == 1 and _report(r)["containers"][0]["error"] == err
    # --node-from-status: the node without its tenants, so the pod plans
    r = explain("-", "--node-from-status", f"http://{d.endpoints['health']}", "-o", "json", stdin=pod)
    assert r.returncode == 0, r.stderr


def test_status_sources_that_cannot_serve_say_why(tmp_path: Path) -> None:
    pod = KUBECTL_POD.read_text()
    # nothing listens there
    r = explain("-", "--node-from-status", "http://127.0.0.1:1/status", stdin=pod)
    assert r.returncode == 2 and "cannot reach the daemon at http://127.0.0.1:1/status" in r.stderr
    # a /status of another shape: the missing field is named, with what planning needs
    bad = tmp_path / "status.json"
    bad.write_text(json.dumps({"node": "n", "gpus": [{"index": 0, "uuid": GPU0, "name": "H100"}]}))
    r = explain("-", "--node-from-status", str(bad), stdin=pod)
    assert r.returncode == 2, r.stderr
    assert "gpus[0] lacks 'memory_mib' (planning needs index, uuid, name, memory_mib)" in r.stderr
    bad.write_text(json.dumps({"node": "n"}))
    r = explain("-", "--node-from-status", str(bad), stdin=pod)
    assert r.returncode == 2 and "has no 'gpus' list" in r.stderr
    # standard input empty
    r = explain("-", "--node", str(NODE), stdin="")
    assert r.returncode == 2 and "standard input is empty" in r.stderr
    # one source of the node only
    r = explain("-", "--node", str(NODE), "--live", stdin=pod)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_a_pod_list_from_kubectl_get_pods_is_read(tmp_path: Path) -> None:
    import yaml

    pod = yaml.safe_load(KUBECTL_POD.read_text())
    listing = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": [pod]}
    r = explain("-", "--node", str(NODE), "-o", "json", stdin=yaml.safe_dump(listing))
    assert r.returncode == 0, r.stderr
    assert _report(r)["pod"] == "default/inference-7d9c6b5f4-x2k8q"
