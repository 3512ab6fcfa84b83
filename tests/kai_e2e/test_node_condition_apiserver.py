"""KAI's readiness gate against a REAL kube-apiserver (issue #18).

``fracplugin run`` (simulated node, fake MPS binary, no NRI, no device plugin)
publishes ``gpu-sharing.nvidia.com/Ready`` (and, by default, ``gpu-fractioning.nvidia.com/Ready``)
on a Node object of a real API server: True once ready, False with reason
``MPSNotHealthy`` when MPS goes down, True again when it comes back, Unknown
(``ShuttingDown``) under both names after SIGTERM (issue 23 item 5, ADR 0025b);
kubelet's own conditions are untouched (the API server's strategic merge on
``type``).

What it needs: an admin kubeconfig of a running kube-apiserver (etcd behind
it; no kubelet, scheduler or controller-manager needed) in
``FRACPLUGIN_KAI_E2E_KUBECONFIG``. The test creates its own Node object
(``fp-kai-e2e-<pid>``; its status is written through ``nodes/status``) and
deletes it at the end. ``make kai-e2e`` (tests/kai_e2e/run.py) starts a
real etcd + kube-apiserver from the kubelet-e2e build cache and runs this
module against it; issue #11's harness (tests/kubelet_e2e/cluster.py) can
instead point the variable at ``Cluster.kubeconfig`` or call
``run_scenario(kubeconfig_path, workdir)``. Not part of ``make test``:
without the variable the test is skipped (fails under
``FRACPLUGIN_E2E_REQUIRED=1``, which run.py sets), never silently passed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
NODE_FILE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
TYPE = "gpu-sharing.nvidia.com/Ready"


def _wait(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _api(kubeconfig: str) -> Any:
    from kubernetes import client, config

    c = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=c)
    return client.CoreV1Api(client.ApiClient(c))


def _condition(api: Any, node: str, ctype: str) -> Any:
    n = api.read_node(node)
    return next((c for c in (n.status.conditions or []) if c.type == ctype), None)


def run_scenario(kubeconfig: str, workdir: Path) -> dict[str, Any]:
    """The whole scenario; returns what it observed (for a harness to record).
    Raises AssertionError naming the step that failed."""
    from kubernetes import client

    api = _api(kubeconfig)
    node = f"fp-kai-e2e-{os.getpid()}"
    api.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node, labels={"nvidia.com/gpu.present": "true"})))
    api.patch_node_status(node, {"status": {"conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "stand-in kubelet condition",
        "lastHeartbeatTime": "2026-11-30T00:00:00Z", "lastTransitionTime": "2026-11-30T00:00:00Z"}]}})
    mps_root = workdir / "mps"
    log = open(workdir / "daemon.log", "ab")
    proc = subprocess.Popen([
        sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE_FILE),
        "--no-nri", "--no-device-plugin", "--mps-control-binary", str(FAKE_MPS), "--mps-root", str(mps_root),
        "--state-dir", str(workdir / "state"), "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
        "--kubeconfig", kubeconfig, "--node-name", node, "--log-format", "json"],
        stdout=log, stderr=subprocess.STDOUT, cwd=str(workdir))
    seen: dict[str, Any] = {"node": node}
    try:
        t0 = time.monotonic()
        c = _wait(lambda: (x := _condition(api, node, TYPE)) is not None and x.status == "True" and x,
                  60, f"{TYPE}=True")
        seen["true_after_s"] = round(time.monotonic() - t0, 2)
        assert c.reason == "FracpluginReady", c
        (mps_root / "ts" / "fake-control.json").write_text(json.dumps({"crash": True, "fail_start": True}))
        t1 = time.monotonic()
        c = _wait(lambda: (x := _condition(api, node, TYPE)) is not None and x.status == "False" and x,
                  60, f"{TYPE}=False after MPS went down")
        seen["false_after_s"] = round(time.monotonic() - t1, 2)
        assert c.reason == "MPSNotHealthy" and "mps" in c.message, c
        (mps_root / "ts" / "fake-control.json").unlink()
        _wait(lambda: (x := _condition(api, node, TYPE)) is not None and x.status == "True", 90,
              f"{TYPE}=True after MPS came back")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for t in (TYPE, "gpu-fractioning.nvidia.com/Ready"):
            c = _condition(api, node, t)
            assert c is not None and c.status == "Unknown" and c.reason == "ShuttingDown", (t, c)
        kubelet = _condition(api, node, "Ready")
        assert kubelet is not None and kubelet.reason == "KubeletReady"
        return seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        try:
            api.delete_node(node)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass


def test_node_condition_on_a_real_apiserver() -> None:
    kubeconfig = os.environ.get("FRACPLUGIN_KAI_E2E_KUBECONFIG")
    if not kubeconfig:
        msg = "FRACPLUGIN_KAI_E2E_KUBECONFIG (admin kubeconfig of a real kube-apiserver) is not set"
        if os.environ.get("FRACPLUGIN_E2E_REQUIRED") == "1":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    work = Path(tempfile.mkdtemp(prefix="fpkai", dir="/tmp"))
    os.chmod(work, 0o755)  # the MPS root below it must be traversable, or the daemon is not ready (issue 12)
    try:
        print(run_scenario(kubeconfig, work))
    except AssertionError as exc:
        tail = (work / "daemon.log").read_text(errors="replace")[-4000:] if (work / "daemon.log").exists() else ""
        raise AssertionError(f"{exc}\n--- daemon log (tail) ---\n{tail}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
