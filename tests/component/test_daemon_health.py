"""In-process pieces of the daemon: the health HTTP server, structured logs,
the pods-file watcher and the status table."""

from __future__ import annotations

import io
import json
import logging
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from fracplugin import logs
from fracplugin.podsfile import PodsFileWatcher, read_pods_file
from fracplugin.health import HealthServer
from fracplugin.kubelet.podlookup import InMemoryPodSource
from fracplugin.status import render_table, url_for
from tests.helpers import scaled, wait_until


def get(addr: tuple[str, int], path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_server_endpoints() -> None:
    state: dict[str, Any] = {"ready": False, "alive": None, "boom": False}

    def checks() -> dict[str, dict[str, Any]]:
        return {"nri": {"ready": state["ready"], "detail": "x"}}

    def status() -> dict[str, Any]:
        if state["boom"]:
            raise RuntimeError("status exploded")
        return {"node": "n"}

    h = HealthServer("127.0.0.1:0", checks, status, alive=lambda: state["alive"])
    addr = h.start()
    try:
        assert get(addr, "/healthz") == (200, "ok\n")
        code, body = get(addr, "/readyz")
        assert code == 503 and json.loads(body) == {"ready": False, "checks": {"nri": {"ready": False, "detail": "x"}}}
        state["ready"] = True
        assert get(addr, "/readyz")[0] == 200
        assert json.loads(get(addr, "/status")[1]) == {"node": "n"}
        state["boom"] = True
        code, body = get(addr, "/status")
        assert code == 500 and "status exploded" in body
        assert get(addr, "/healthz")[0] == 200  # the server survived the broken callback
        state["alive"] = "shutting down"
        assert get(addr, "/healthz") == (503, "not alive: shutting down\n")
        assert get(addr, "/metrics")[0] == 404
    finally:
        h.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/healthz", timeout=2)


def test_json_and_text_logs_carry_extras() -> None:
    buf = io.StringIO()
    logs.setup("json", "debug", stream=buf)
    try:
        logging.getLogger("fracplugin.t").info("hello %s", "you", extra={"pod": "ns/p", "n": 3})
        rec = json.loads(buf.getvalue().splitlines()[-1])
        assert rec["msg"] == "hello you" and rec["pod"] == "ns/p" and rec["n"] == 3
        assert rec["level"] == "info" and rec["logger"] == "fracplugin.t" and rec["ts"].endswith("Z")
        buf2 = io.StringIO()
        logs.setup("text", "warning", stream=buf2)
        logging.getLogger("fracplugin.t").info("hidden")
        logging.getLogger("fracplugin.t").warning("shown", extra={"key": "a b"})
        out = buf2.getvalue()
        assert "hidden" not in out and 'shown key="a b"' in out
        assert len([h for h in logging.getLogger().handlers if h.get_name() == "fracplugin"]) == 1
        with pytest.raises(ValueError):
            logs.set_level("loud")
    finally:
        logs.setup("text", "warning", stream=io.StringIO())


def _pod(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "d", "uid": uid},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {"x.io/m": "2"}}}]},
            "status": {"phase": "Pending"}}


def test_pods_file_watcher_adds_and_deletes(tmp_path: Path) -> None:
    f = tmp_path / "pods.yaml"
    src = InMemoryPodSource("n1")
    w = PodsFileWatcher(str(f), src)
    assert w.sync() is False and len(src) == 0  # no file: no pods
    f.write_text(yaml.safe_dump_all([_pod("a", "1"), _pod("b", "2")]))
    assert w.sync() is True and {p["metadata"]["name"] for p in src.pods()} == {"a", "b"}
    f.write_text(yaml.safe_dump({"kind": "List", "items": [_pod("b", "2")]}) + "\n")
    assert w.sync() is True and [p["metadata"]["name"] for p in src.pods()] == ["b"]
    assert w.sync() is False  # unchanged
    f.write_text("a: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        read_pods_file(str(f))


def test_status_table_rendering() -> None:
    doc = {
        "node": "n1", "version": "0", "pid": 1, "ready": False,
        "checks": {"mps": {"ready": False, "detail": "unhealthy: sm-sharing"}},
        "doors": {"nri": True, "device_plugin": False, "mps": True}, "fail_open": True,
        "gpus": [{"index": 0, "uuid": "GPU-a", "memory_mib": 100, "held_mib": 40, "mode": "sm-sharing",
                  "healthy": False, "unhealthy_reasons": ["mps down"],
                  "tenants": [{"namespace": "d", "pod_name": "p", "container": "c", "request_mib": 40,
                               "limit_mib": 60, "mode": "sm-sharing", "active_thread_percentage": 50,
                               "container_id": "0123456789abcdef"}]}],
        "mps": {"enabled": True, "protocol": 3, "ready": False,
                "daemons": [{"mode": "sm-sharing", "healthy": False, "state": "restarting", "pid": None,
                             "restarts": 2, "last_error": "probe timed out"}]},
    }
    out = render_table(doc)
    assert "ready: no" in out and "fail-open=on" in out and "device_plugin=off" in out
    assert "UNHEALTHY: mps down" in out and "40/100" in out
    assert "d/p/c: request 40 MiB, limit 60 MiB, sm-sharing  ATP 50%  id 0123456789ab" in out
    assert "sm-sharing    UNHEALTHY state restarting  restarts 2  last_error probe timed out" in out
    assert url_for("0.0.0.0:8080") == "http://127.0.0.1:8080/status" and url_for(":9") == "http://127.0.0.1:9/status"


def post(addr: tuple[str, int], path: str, body: bytes | None, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(f"http://{addr[0]}:{addr[1]}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def test_simulate_xid_validates_the_body_and_calls_back() -> None:
    from fracplugin.health import MAX_BODY

    injected: list[tuple[str, int]] = []

    def inject(uuid: str, xid: int) -> None:
        if uuid != "GPU-a":
            raise LookupError(f"no GPU {uuid} on node n")
        injected.append((uuid, xid))

    h = HealthServer("127.0.0.1:0", dict, dict, simulate_xid=inject)
    addr = h.start()
    try:
        code, body, _ = post(addr, "/simulate/xid", json.dumps({"gpu_uuid": "GPU-a", "xid": 79}).encode())
        assert code == 202 and json.loads(body) == {"injected": {"gpu_uuid": "GPU-a", "xid": 79}}
        assert injected == [("GPU-a", 79)]
        code, body, _ = post(addr, "/simulate/xid", json.dumps({"gpu_uuid": "GPU-zz", "xid": 79}).encode())
        assert code == 404 and "no GPU GPU-zz" in body
        bad = {
            b"{not json": "not valid JSON",
            b"[1, 2]": "JSON list",
            json.dumps({"gpu_uuid": "GPU-a"}).encode(): "xid must be an integer",
            json.dumps({"gpu_uuid": "GPU-a", "xid": "79"}).encode(): "xid must be an integer",
            json.dumps({"gpu_uuid": "GPU-a", "xid": True}).encode(): "xid must be an integer",
            json.dumps({"gpu_uuid": "GPU-a", "xid": 79.0}).encode(): "xid must be an integer",
            json.dumps({"gpu_uuid": "GPU-a", "xid": 0}).encode(): "xid must be an integer",
            json.dumps({"gpu_uuid": "GPU-a", "xid": 2**32}).encode(): "xid must be an integer",
            json.dumps({"gpu_uuid": "", "xid": 79}).encode(): "gpu_uuid must be a non-empty string",
            json.dumps({"gpu_uuid": 3, "xid": 79}).encode(): "gpu_uuid must be a non-empty string",
            json.dumps({"uuid": "GPU-a", "xid": 79}).encode(): "unknown field(s) 'uuid'",
        }
        for payload, why in bad.items():
            code, body, _ = post(addr, "/simulate/xid", payload)
            assert code == 400 and why in body and '"gpu_uuid"' in body, (payload, code, body)
        code, body, _ = post(addr, "/simulate/xid", b"x" * (MAX_BODY + 1))
        assert code == 413, (code, body)
        import http.client

        conn = http.client.HTTPConnection(addr[0], addr[1], timeout=5)
        conn.putrequest("POST", "/simulate/xid")
        conn.endheaders()  # no Content-Length
        assert conn.getresponse().status == 411
        conn.close()
        code, _, hdrs = post(addr, "/simulate/xid", None, method="GET")
        assert code == 405 and hdrs["Allow"] == "POST"
        code, _, hdrs = post(addr, "/healthz", b"{}")
        assert code == 405 and hdrs["Allow"] == "GET, HEAD"
        code, _, hdrs = post(addr, "/simulate/xid", b"{}", method="DELETE")
        assert code == 405 and hdrs["Allow"] == "POST"
        assert post(addr, "/nowhere", b"{}")[0] == 404
        assert injected == [("GPU-a", 79)]  # nothing bad reached the callback
        assert get(addr, "/healthz") == (200, "ok\n")
    finally:
        h.stop()


def test_simulate_xid_absent_without_a_simulated_node() -> None:
    h = HealthServer("127.0.0.1:0", dict, dict)  # what the daemon builds with NVML
    addr = h.start()
    try:
        code, body, _ = post(addr, "/simulate/xid", json.dumps({"gpu_uuid": "GPU-a", "xid": 79}).encode())
        assert code == 404 and "--simulate-node" in body
        assert post(addr, "/simulate/xid", None, method="GET")[0] == 404
    finally:
        h.stop()


# ---- hardening (attack reproductions in /tmp/fpatk, 2026-11-29) ---------------------------------
def test_deeply_nested_xid_body_is_400_not_500() -> None:
    from fracplugin.health import BadRequest, parse_xid_body

    deep = b"[" * 2000 + b"]" * 2000  # 4000 bytes: under MAX_BODY, over the decoder's recursion limit
    with pytest.raises(BadRequest, match="nested too deeply") as exc:
        parse_xid_body(deep)
    assert exc.value.code == 400
    h = HealthServer("127.0.0.1:0", dict, dict, simulate_xid=lambda u, x: None)
    addr = h.start()
    try:
        code, body, _ = post(addr, "/simulate/xid", deep)
        assert code == 400 and "nested too deeply" in body
    finally:
        h.stop()


def _closed_by_peer(s: socket.socket, wait_s: float) -> bool:
    import select

    r, _, _ = select.select([s], [], [], wait_s)
    if not r:
        return False
    try:
        return s.recv(4096) == b""
    except OSError:  # reset
        return True


def test_request_deadline_covers_the_whole_request_not_each_read() -> None:
    """A client sending a header line every 0.15 s never trips a per-read
    timeout; the whole-request deadline (0.6 s here, 10 s by default) cuts it off."""
    h = HealthServer("127.0.0.1:0", dict, dict)
    h.request_deadline_s = 0.6
    addr = h.start()
    s = socket.create_connection(addr, timeout=5)
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        closed = False
        for _ in range(60):  # up to ~9 s, far beyond the deadline
            if _closed_by_peer(s, 0.15):
                closed = True
                break
            try:
                s.sendall(b"X-Drip: 1\r\n")
            except OSError:
                closed = True
                break
        assert closed, "the server kept a dripping request open past its whole-request deadline"
        assert get(addr, "/healthz") == (200, "ok\n")
    finally:
        s.close()
        h.stop()


def test_handler_threads_are_bounded_and_healthz_still_answers() -> None:
    h = HealthServer("127.0.0.1:0", dict, dict)
    h.request_deadline_s, h.max_handlers = 30, 4
    addr = h.start()
    socks = []
    try:
        for _ in range(12):  # slowloris: request line, then nothing
            s = socket.create_connection(addr, timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
            socks.append(s)
        assert get(addr, "/healthz") == (200, "ok\n")
        st = h.stats()
        assert st["peak"] <= 4, st
        assert st["evicted"] >= 8, st  # the slow clients made way
    finally:
        for s in socks:
            s.close()
        h.stop()


def test_client_gone_before_the_reply_is_debug_without_traceback(caplog: pytest.LogCaptureFixture,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    import struct
    import threading

    entered, release = threading.Event(), threading.Event()

    def status() -> dict[str, Any]:
        entered.set()
        release.wait(5)
        return {"blob": "x" * (4 << 20)}  # more than any socket buffer: the write must hit the reset

    caplog.set_level(logging.DEBUG, logger="fracplugin.health")
    h = HealthServer("127.0.0.1:0", dict, status)
    addr = h.start()
    try:
        s = socket.create_connection(addr, timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(scaled(5))
        s.close()
        release.set()
        wait_until(lambda: h.stats()["active"] == 0, 5, lambda: f"no active connection: {h.stats()}")
        assert get(addr, "/healthz") == (200, "ok\n")
    finally:
        release.set()
        h.stop()
    recs = [r for r in caplog.records if r.name == "fracplugin.health"]
    assert not [r for r in recs if r.levelno >= logging.WARNING], [r.getMessage() for r in recs]
    assert any("gone before the reply" in r.getMessage() and r.levelno == logging.DEBUG for r in recs)
    assert "Traceback" not in capfd.readouterr().err


def test_pods_file_with_malformed_pods_and_deep_nesting(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "pods.yaml"
    bad = ("kind: Pod\nmetadata: {name: b, namespace: d, uid: ub}\n"
           "spec: {nodeName: n1, containers: 'abc'}\nstatus: {phase: Pending}\n")
    f.write_text(bad + "---\n" + yaml.safe_dump(_pod("a", "1")))
    caplog.set_level(logging.WARNING)
    assert [p["metadata"]["name"] for p in read_pods_file(str(f))] == ["a"]
    assert any("d/b" in r.getMessage() and str(f) in r.getMessage() and "containers" in r.getMessage()
               for r in caplog.records)
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 800 + "]" * 800)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_pods_file(str(deep))

    # At start: a file that cannot be parsed is no pods, never an exception (the daemon starts).
    src = InMemoryPodSource("n1")
    w = PodsFileWatcher(str(deep), src, poll_s=60)
    try:
        w.start()
        assert len(src) == 0
    finally:
        w.stop()
    # Running: a good file, then a bad one: the pods read before stay.
    w = PodsFileWatcher(str(f), src)
    assert w.sync() is True and [p["metadata"]["name"] for p in src.pods()] == ["a"]
    f.write_text("[" * 800 + "]" * 800)
    assert w.sync() is False
    assert [p["metadata"]["name"] for p in src.pods()] == ["a"]
    assert any("nested too deeply" in r.getMessage() and "keeping the 1 pods" in r.getMessage()
               for r in caplog.records)


def test_device_unit_too_small_for_kubelet_fails_start_naming_the_flag(node_file: Path) -> None:
    import subprocess
    import sys
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fpu", dir="/tmp"))
    d.chmod(0o755)  # the MPS root must be reachable by other users (issue 12)
    try:
        out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(node_file),
                              "--no-nri", "--no-mps", "--state-dir", str(d / "s"), "--device-unit-mib", "1",
                              "--device-plugin-dir", str(d / "dp"), "--health-address", "127.0.0.1:0",
                              "--metrics-address", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stderr
        assert "--device-unit-mib 1" in out.stderr and "326236 devices" in out.stderr
        assert "at least" in out.stderr and "Traceback" not in out.stderr + out.stdout
        assert not list((d / "dp").glob("*.sock"))
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
