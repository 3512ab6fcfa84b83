"""The node condition KAI gates fractional pods on, published by the real
daemon (``fracplugin run`` subprocess) through a kubeconfig to an HTTP stand-in
for the API server that keeps a Node and applies strategic merge patches of
``status.conditions`` by ``type`` (issue #18, ADR 0005).

The real-apiserver version of this test is ``tests/kai_e2e/`` (needs the
kube-apiserver + etcd harness of issue #11).
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable

from test_daemon import FAKE_MPS, DaemonProc, serve_fake_api
from test_daemon import daemon, root  # noqa: F401  pytest fixtures

from tests.helpers import wait_until

SMP = "application/strategic-merge-patch+json"
KAI = "gpu-fractioning.nvidia.com/Ready"  # KAI's api module, the renamed node stack
KAI_OLD = "gpu-sharing.nvidia.com/Ready"  # the older operator's name


class FakeNodeApi:
    """A Node held in memory; GET /api/v1/nodes/<n>, PATCH /api/v1/nodes/<n>/status
    (strategic merge of status.conditions on ``type``, as the API server does
    for NodeStatus.conditions); other requests get 404. Records each PATCH
    (content type, body) and can fail the next N patches with a status code."""

    def __init__(self, name: str = "gpu-node-1") -> None:
        self.name = name
        self.node: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "resourceVersion": "1"},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "kubelet is posting ready status",
                                       "lastHeartbeatTime": "2026-11-30T00:00:00Z",
                                       "lastTransitionTime": "2026-11-30T00:00:00Z"}]}}
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.fail_next: list[int] = []
        self.lock = threading.Lock()

    def condition(self, ctype: str) -> dict[str, Any] | None:
        with self.lock:
            return next((dict(c) for c in self.node["status"]["conditions"] if c["type"] == ctype), None)

    def handler(self) -> type:
        api = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _reply(self, code: int, doc: Any) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.split("?")[0] == f"/api/v1/nodes/{api.name}":
                    with api.lock:
                        self._reply(200, copy.deepcopy(api.node))
                else:
                    self._reply(404, {"kind": "Status", "code": 404})

            def do_PATCH(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ctype = self.headers.get("Content-Type", "")
                with api.lock:
                    api.patches.append((ctype, body))
                    fail = api.fail_next.pop(0) if api.fail_next else None
                if self.path.split("?")[0] != f"/api/v1/nodes/{api.name}/status":
                    return self._reply(404, {"kind": "Status", "code": 404})
                if fail:
                    return self._reply(fail, {"kind": "Status", "code": fail, "reason": "Injected"})
                if ctype != SMP:
                    return self._reply(415, {"kind": "Status", "code": 415})
                with api.lock:
                    conds = api.node["status"]["conditions"]
                    for c in body.get("status", {}).get("conditions", []):
                        old = next((x for x in conds if x["type"] == c["type"]), None)
                        if old is None:
                            conds.append(dict(c))
                        else:
                            old.update(c)
                    api.node["metadata"]["resourceVersion"] = str(int(api.node["metadata"]["resourceVersion"]) + 1)
                    self._reply(200, copy.deepcopy(api.node))

        return H


def start_api(root: Path) -> tuple[FakeNodeApi, Any, Path]:
    fake = FakeNodeApi()
    server, kubeconfig = serve_fake_api(fake.handler(), root)
    return fake, server, kubeconfig


def test_condition_true_when_ready_false_when_mps_down_unknown_at_shutdown(
        daemon: Callable[..., DaemonProc], root: Path) -> None:
    """Both names by default; small failing input 4 of issue 23: the daemon
    stops on purpose (SIGTERM) -> both conditions Unknown (was: False
    ShuttingDown under one name)."""
    fake, server, kubeconfig = start_api(root)
    try:
        d = daemon("--no-nri", "--no-device-plugin", "--mps-control-binary", str(FAKE_MPS),
                   "--kubeconfig", str(kubeconfig), "--node-name", "gpu-node-1")
        wait_until(d.ready, 20, lambda: f"readiness: {d.get('/readyz')}")
        wait_until(lambda: (fake.condition(KAI) or {}).get("status") == "True", 20,
                   lambda: f"the condition True: {fake.patches} {d.logs()[-2000:]}")
        c = fake.condition(KAI)
        assert c["reason"] == "FracpluginReady" and "mps" in c["message"]
        assert fake.condition(KAI_OLD)["status"] == "True"  # the older KAI name, same status
        assert fake.condition("Ready")["reason"] == "KubeletReady"  # kubelet's condition untouched
        assert all(ct == SMP for ct, _ in fake.patches)
        assert set(c) >= {"type", "status", "reason", "message", "lastHeartbeatTime", "lastTransitionTime"}
        # the fake records the patch before it answers; the daemon counts it published once the answer is read
        st = wait_until(lambda: (lambda nc: nc if (nc.get("published") or {}).get("status") == "True" else None)(
            d.get("/status")[1]["node_condition"]), 20, lambda: f"published in /status: {d.get('/status')[1]}")
        assert st["types"] == [KAI, KAI_OLD] and st["failures"] == 0

        # MPS down: the time-slicing control daemon crashes and cannot start again
        (root / "mps" / "ts" / "fake-control.json").write_text(json.dumps({"crash": True, "fail_start": True}))
        wait_until(lambda: (fake.condition(KAI) or {}).get("status") == "False", 30,
                   lambda: f"the condition False: {fake.condition(KAI)} {d.get('/readyz')}")
        c = fake.condition(KAI)
        assert c["reason"] == "MPSNotHealthy" and c["message"].startswith("mps: "), c

        # MPS back: True again
        (root / "mps" / "ts" / "fake-control.json").unlink()
        wait_until(lambda: (fake.condition(KAI) or {}).get("status") == "True", 60,
                   lambda: f"the condition True again: {fake.condition(KAI)} {d.get('/readyz')}")

        # orderly shutdown (SIGTERM): Unknown under both names before the doors go
        assert d.terminate() == 0
        for t in (KAI, KAI_OLD):
            c = fake.condition(t)
            assert c["status"] == "Unknown" and c["reason"] == "ShuttingDown", (t, c)
    finally:
        server.shutdown()
        server.server_close()


def test_api_errors_are_retried_and_do_not_block_the_doors(
        daemon: Callable[..., DaemonProc], root: Path) -> None:
    """Two 500s then success: tenacity retries the patch; the daemon is ready
    (doors serving) whatever the API server does."""
    fake, server, kubeconfig = start_api(root)
    fake.fail_next = [500, 500]
    try:
        d = daemon("--no-nri", "--no-device-plugin", "--no-mps", "--kubeconfig", str(kubeconfig),
                   "--node-name", "gpu-node-1")
        wait_until(lambda: fake.condition(KAI) is not None, 20,
                   lambda: f"a condition published: {fake.patches} {d.logs()[-2000:]}")
        assert len(fake.patches) >= 3
        # no door enabled at all: nothing serves fractional pods, so False
        c = fake.condition(KAI)
        assert c["status"] == "False" and c["reason"] == "NoDoorsEnabled"
        assert d.terminate() == 0
    finally:
        server.shutdown()
        server.server_close()


def test_forbidden_is_reported_not_retried_in_a_loop(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """A 403 (missing RBAC) is not retried by tenacity; /status names the
    error; the daemon stays up."""
    fake, server, kubeconfig = start_api(root)
    fake.fail_next = [403] * 1000
    try:
        d = daemon("--no-nri", "--no-device-plugin", "--no-mps", "--kubeconfig", str(kubeconfig),
                   "--node-name", "gpu-node-1")
        wait_until(lambda: (d.get("/status")[1].get("node_condition") or {}).get("failures"), 20,
                   lambda: f"a failed publish: {d.get('/status')[1].get('node_condition')}")
        nc = d.get("/status")[1]["node_condition"]
        assert "403" in nc["last_error"] and nc["published"] is None
        # one request per failed publish (no tenacity retry on 403); at most one more in flight
        assert nc["failures"] <= len(fake.patches) <= nc["failures"] + 1
        assert any("nodes/status patch" in str(r.get("msg", "")) for r in d.log_records())
        assert d.terminate() == 0
    finally:
        server.shutdown()
        server.server_close()


def test_no_condition_types_publishes_nothing(daemon: Callable[..., DaemonProc], root: Path) -> None:
    fake, server, kubeconfig = start_api(root)
    try:
        d = daemon("--no-nri", "--no-device-plugin", "--no-mps", "--kubeconfig", str(kubeconfig),
                   "--node-name", "gpu-node-1", "--node-condition-types", "")
        assert d.get("/status")[1]["node_condition"] is None
        assert d.terminate() == 0
        assert fake.patches == []
    finally:
        server.shutdown()
        server.server_close()
