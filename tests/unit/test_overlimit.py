"""The over-limit watch's episodes (overlimit.py) and the restart route
(restart.py) against a tiny HTTP API server: the kubernetes client makes
real requests (issue 35 item 3, ADR 0035)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kubernetes import client

from fracplugin.enforce.memlimits import read_dmem_current
from fracplugin.model import ComputeMode, PodRef, Tenancy
from fracplugin.overlimit import OverLimitWatch
from fracplugin.restart import Restarter
from tests.helpers import wait_until

MIB = 1 << 20
T = Tenancy("uid-1", "ns", "p", "app", "GPU-0", 4096, 8192, ComputeMode.TIME_SLICING, container_id="c1")


class Events:
    def __init__(self) -> None:
        self.sent: list[tuple[PodRef, str, str, str]] = []

    def over_limit(self, pod: PodRef, container: str, message: str, action: str) -> None:
        self.sent.append((pod, container, message, action))


def test_dmem_current_wins_over_nvml_and_a_failed_nvml_poll_changes_nothing(tmp_path: Path) -> None:
    """Used comes from the leaf's dmem.current when it has the GPU's region
    (NVML's sum is then ignored); the episode starts once, lasts while over,
    survives a poll whose NVML query failed, ends at or under the limit."""
    dmem = tmp_path / "dmem.current"
    dmem.write_text(f"nvidia/0000:18:00.0/vidmem {9000 * MIB}\n")
    ev = Events()
    w = OverLimitWatch("report", ev, dmem_used=lambda cid, u: read_dmem_current(str(tmp_path), "nvidia/0000:18:00.0/vidmem"))
    nvml = {("uid-1", "app", "GPU-0"): SimpleNamespace(used=1 * MIB)}
    for usage in (nvml, nvml, None):
        w.check([T], usage)
    assert [m for _, _, m, _ in ev.sent] == [
        "GPU GPU-0: used 9000 MiB (dmem.current usage), above the container's limit 8192 MiB (episode 1 on this node)"]
    assert w.over() == {("uid-1", "app", "GPU-0"): 9000 * MIB} and w.status()["polls"] == 3
    dmem.write_text(f"nvidia/0000:18:00.0/vidmem {8192 * MIB}\n")  # at the limit: not above
    w.check([T], nvml)
    assert w.over() == {} and w.episodes == 1 and len(ev.sent) == 1


def test_restart_without_api_access_reports_and_says_so() -> None:
    ev = Events()
    w = OverLimitWatch("restart", ev)
    w.check([T], {("uid-1", "app", "GPU-0"): SimpleNamespace(used=8193 * MIB)})
    [(pod, container, msg, action)] = ev.sent
    assert (pod, container, action) == (PodRef("ns", "p", "uid-1"), "app", "Restart")
    assert msg.endswith("; not restarted: no API access to evict its pod"), msg


class Api:
    """Answers POST .../pods/<name>/eviction with ``status``; waits on ``gate`` first when set."""

    def __init__(self, status: int) -> None:
        self.paths: list[str] = []
        self.gate: threading.Event | None = None
        api = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                api.paths.append(self.path)
                if api.gate is not None:
                    api.gate.wait(30)
                out = json.dumps({"kind": "Status", "apiVersion": "v1", "code": status}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.client = client.ApiClient(cfg)


def test_a_refused_eviction_is_counted_and_a_pod_in_flight_is_asked_once() -> None:
    """A PodDisruptionBudget's 429 is counted as failed with its status; a
    second request for a pod whose eviction is in flight is dropped."""
    api = Api(429)
    try:
        api.gate = threading.Event()
        r = Restarter(api.client)
        pod = PodRef("ns", "p", "uid-1")
        assert r.restart(pod, "app", "over") is True
        wait_until(lambda: api.paths, 10)
        assert r.restart(pod, "app", "over again") is False
        api.gate.set()
        wait_until(lambda: r.stats()["failed"] == 1, 10, lambda: f"{r.stats()}")
        assert api.paths == ["/api/v1/namespaces/ns/pods/p/eviction"]
        assert r.stats() == {"requested": 1, "evicted": 0, "failed": 1, "in_flight": 0,
                             "last_error": "HTTP 429 Too Many Requests"}
    finally:
        api.httpd.shutdown()
