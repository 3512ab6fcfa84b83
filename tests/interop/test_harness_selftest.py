"""Self-tests of the Go interop harnesses, independent of fracplugin.

They prove the harnesses themselves against plugins built on the stock Go
libraries: the NRI runtime harness (containerd/nri pkg/adaptation, v0.12.5 and
v0.8.0) against template-plugin (containerd/nri pkg/stub of the same line),
and kubelet-sim (k8s.io/kubelet deviceplugin v1beta1) against a tiny Go
device plugin. If these fail, a failure of the fracplugin interop tests says
nothing about fracplugin.
"""

from __future__ import annotations

import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from interop_util import (
    NRI_LINES,
    InteropRetryWarning,
    Proc,
    adjustment_is_empty,
    build_module,
    check_no_fatal,
    creates,
    env_of,
    mounts_of,
    start_runtime,
    template_bin,
    wrapper_script,
)

pytestmark = pytest.mark.interop

LINES = sorted(NRI_LINES)


def _pod(name: str, **kw):
    return {"name": name, "namespace": "default", "uid": f"uid-{name}", "containers": [{"name": "app"}], **kw}


@pytest.mark.parametrize("line", LINES)
def test_external_plugins_merge_in_index_order_and_sync(line, sdir, procs):
    sock = sdir / "nri.sock"
    scenario = {
        "sync": [_pod("old")],
        "pods": [_pod("p1"), _pod("plain")],
    }
    rt = start_runtime(procs, line, sdir, scenario, socket=sock, wait_plugins=2)
    for idx, env in (("90", "LATE=90"), ("10", "EARLY=10")):
        procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", idx, "-name", f"tmpl{idx}",
                           "-env", env], stderr_path=sdir / f"tmpl{idx}.log"))
    events = rt.finish(60)
    check_no_fatal(events, rt)
    syncs = [e for e in events if e["event"] == "synchronized" and not e["preinstalled"]]
    assert len(syncs) == 2 and all(s["ok"] for s in syncs)
    assert all(s["container_ids"] == ["ctr-default-old-app-r0"] for s in syncs)
    order = next(e for e in events if e["event"] == "plugin_order")["plugins"]
    assert [o.split(":", 1)[1].split("[")[0] for o in order] == ["10-tmpl10", "90-tmpl90"]
    c = creates(events)
    assert [e["ok"] for e in c] == [True, True]
    assert env_of(c[0]) == {"EARLY": "10", "LATE": "90"}
    # merged in index order
    assert [kv["key"] for kv in c[0]["adjust"]["env"]] == ["EARLY", "LATE"]
    assert all(e["ok"] for e in events if e["event"] in ("run_pod", "start", "stop", "remove", "stop_pod", "remove_pod"))


@pytest.mark.parametrize("line", LINES)
def test_empty_adjustment_recognised(line, sdir, procs):
    sock = sdir / "nri.sock"
    rt = start_runtime(procs, line, sdir, {"pods": [_pod("p")]}, socket=sock)
    procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", "10"], stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    check_no_fatal(events, rt)
    (c,) = creates(events)
    assert c["ok"] and adjustment_is_empty(c["adjust"]), c


@pytest.mark.parametrize("line", LINES)
def test_template_mount_flag(line, sdir, procs):
    """-mount SRC:DST[:OPTS] adds a bind mount to every created container
    (the bench's equal-answer template run relies on it)."""
    sock = sdir / "nri.sock"
    rt = start_runtime(procs, line, sdir, {"pods": [_pod("p"), _pod("q")]}, socket=sock)
    procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", "10", "-env", "K=0=2G",
                       "-mount", "/src/a:/dst/a:rbind,ro,nosuid", "-mount", "/src/b:/dst/b"],
                      stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    check_no_fatal(events, rt)
    c = creates(events)
    assert len(c) == 2 and all(e["ok"] for e in c), c
    for e in c:
        assert env_of(e) == {"K": "0=2G"}
        assert sorted(mounts_of(e), key=lambda m: m["source"]) == [
            {"source": "/src/a", "destination": "/dst/a", "type": "bind", "options": ["rbind", "ro", "nosuid"]},
            {"source": "/src/b", "destination": "/dst/b", "type": "bind"},
        ]


@pytest.mark.parametrize("line", LINES)
def test_large_request_and_adjustment(line, sdir, procs):
    """Hundreds of annotations (request > 16 KB, sent in frames > 4096 bytes)
    and an adjustment > 8 KB pass through the harness."""
    sock = sdir / "nri.sock"
    ann = {f"example.com/key-{i:03d}": "v" * 80 for i in range(300)}
    rt = start_runtime(procs, line, sdir, {"pods": [_pod("big", annotations=ann)]}, socket=sock)
    big = "x" * 9000
    procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", "10", "-env", f"BIG={big}"],
                      stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    check_no_fatal(events, rt)
    (c,) = creates(events)
    assert c["ok"], c
    assert env_of(c)["BIG"] == big and c["adjust_bytes"] > 8192


@pytest.mark.parametrize("line", LINES)
def test_preinstalled_plugin_launched_from_plugin_dir(line, sdir, procs):
    pdir, cdir = sdir / "plugins", sdir / "conf.d"
    pdir.mkdir()
    cdir.mkdir()
    wrapper_script(pdir / "20-pre", [str(template_bin(line)), "-env", "PRE=1"], sdir / "pre.log")
    (cdir / "20-pre.conf").write_text("cfgParam1: x\n")
    rt = start_runtime(procs, line, sdir, {"pods": [_pod("p")]}, plugin_dir=pdir, config_dir=cdir, wait_plugins=0)
    events = rt.finish(60)
    check_no_fatal(events, rt)
    order = next(e for e in events if e["event"] == "plugin_order")["plugins"]
    assert len(order) == 1 and order[0].startswith("pre-connected:20-pre"), order
    (c,) = creates(events)
    assert env_of(c) == {"PRE": "1"}
    log = (sdir / "pre.log").read_text()
    assert "config 13 bytes" in log  # the .conf content reached Configure


@pytest.mark.parametrize("line", LINES)
def test_runtime_restart_reconnect_and_resync(line, sdir, procs):
    sock = sdir / "nri.sock"
    scenario = {"pods": [_pod("before")], "after_reconnect": [_pod("after")]}
    rt = start_runtime(procs, line, sdir, scenario, socket=sock, extra=["-reconnect", "-restart-gap", "300ms"])
    procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", "10", "-env", "T=1", "-reconnect"],
                      stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    check_no_fatal(events, rt)
    stopped = next(e for e in events if e["event"] == "runtime_stopped")
    assert stopped["closed_connections"] == 1
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["ok"]
    sync2 = [e for e in events if e["event"] == "synchronized" and e["round"] == 2 and not e["preinstalled"]]
    assert len(sync2) == 1 and sync2[0]["container_ids"] == ["ctr-default-before-app-r1"]
    assert [env_of(c) for c in creates(events, 2)] == [{"T": "1"}]


@pytest.mark.parametrize("line", LINES)
def test_unavailable_create_and_start_are_retried_and_reported(line, sdir, procs):
    """A plugin answering UNAVAILABLE is retried like kubelet would; each
    retry is an event, listed on the create/start event and a pytest warning."""
    sock = sdir / "nri.sock"
    rt = start_runtime(procs, line, sdir, {"pods": [_pod("p")]}, socket=sock, retries=3, retry_interval="50ms")
    procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", "10", "-env", "T=1",
                       "-unavailable-creates", "1", "-unavailable-starts", "2"], stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    with pytest.warns(InteropRetryWarning, match="answered unavailable") as caught:
        check_no_fatal(events, rt)
    assert len([w for w in caught if issubclass(w.category, InteropRetryWarning)]) == 3
    (c,) = creates(events)
    assert c["ok"] and c["attempts"] == 2 and env_of(c) == {"T": "1"}, c
    (start,) = [e for e in events if e["event"] == "start"]
    assert start["ok"] and start["attempts"] == 3, start
    retries = [e for e in events if e["event"] == "retry"]
    assert [(e["op"], e["attempt"]) for e in retries] == [("create", 1), ("start", 1), ("start", 2)]
    assert all("Unavailable" in e["error"] for e in retries), retries


@pytest.mark.parametrize("line", LINES)
def test_retries_are_bounded(line, sdir, procs):
    sock = sdir / "nri.sock"
    rt = start_runtime(procs, line, sdir, {"pods": [_pod("p")]}, socket=sock, retries=1, retry_interval="10ms")
    procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", "10", "-unavailable-starts", "5"],
                      stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    with pytest.warns(InteropRetryWarning):
        check_no_fatal(events, rt)
    (start,) = [e for e in events if e["event"] == "start"]
    assert not start["ok"] and start["attempts"] == 2 and "Unavailable" in start["error"], start


class _Readyz:
    """A stand-in daemon health server: /readyz answers 503 `not_ready` times, then 200."""

    def __init__(self, not_ready: int) -> None:
        outer = self
        self.calls = 0

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.calls += 1
                ok = self.path == "/readyz" and outer.calls > not_ready
                body = json.dumps({"ready": ok}).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def write_endpoints(self, path):
        path.write_text(json.dumps({"health": f"127.0.0.1:{self.server.server_address[1]}"}))

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def readyz():
    made = []

    def make(not_ready):
        made.append(_Readyz(not_ready))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_scenario_waits_for_daemon_readyz(sdir, procs, readyz):
    sock, ep = sdir / "nri.sock", sdir / "endpoints.json"
    server = readyz(3)
    rt = start_runtime(procs, "v012", sdir, {"pods": [_pod("p")]}, socket=sock, ready_endpoints=ep)
    procs.append(Proc([str(template_bin("v012")), "-socket", str(sock), "-idx", "10"], stderr_path=sdir / "t.log"))
    server.write_endpoints(ep)  # written late, like a daemon that is still starting
    events = rt.finish(60)
    check_no_fatal(events, rt)
    names = [e["event"] for e in events]
    assert names.index("daemon_ready") < names.index("run_pod"), names
    assert next(e for e in events if e["event"] == "daemon_ready")["polls"] == 4
    assert server.calls == 4


def test_daemon_never_ready_is_fatal(sdir, procs, readyz):
    sock, ep = sdir / "nri.sock", sdir / "endpoints.json"
    readyz(10**6).write_endpoints(ep)
    rt = start_runtime(procs, "v012", sdir, {"pods": [_pod("p")]}, socket=sock, ready_endpoints=ep,
                       extra=["-ready-timeout", "1s"])
    procs.append(Proc([str(template_bin("v012")), "-socket", str(sock), "-idx", "10"], stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    fatal = [e for e in events if e["event"] == "fatal"]
    assert fatal and "not ready" in fatal[0]["error"] and "503" in fatal[0]["error"], events[-3:]
    assert not creates(events)


def test_bench_mode_reports_percentiles(sdir, procs):
    sock = sdir / "nri.sock"
    pods = [_pod(f"b{i}") for i in range(4)]
    rt = start_runtime(procs, "v012", sdir, {"pods": pods}, socket=sock,
                       extra=["-bench", "-bench-levels", "1,4", "-bench-calls", "40", "-bench-warmup", "5"])
    procs.append(Proc([str(template_bin("v012")), "-socket", str(sock), "-idx", "10"], stderr_path=sdir / "t.log"))
    events = rt.finish(60)
    check_no_fatal(events, rt)
    bench = [e for e in events if e["event"] == "bench"]
    assert [b["concurrency"] for b in bench] == [1, 4]
    for b in bench:
        assert b["calls"] == 40 and b["errors"] == 0
        assert 0 < b["p50_ms"] <= b["p99_ms"] <= b["max_ms"]


def test_kubelet_sim_against_go_device_plugin(sdir, procs):
    out = build_module("kubelet")
    dp = sdir / "dp"
    script = {"steps": [
        {"op": "list", "label": "initial"},
        {"op": "allocate", "size": 3, "label": "three"},
        {"op": "restart", "gap_ms": 50},
        {"op": "list", "label": "after-restart"},
        {"op": "pause", "name": "unhealthy"},
        {"op": "wait_health", "gpu": "GPU-a", "health": "Unhealthy", "timeout_s": 10},
    ]}
    (sdir / "script.json").write_text(json.dumps(script))
    ks = Proc([str(out / "kubelet-sim"), "-dir", str(dp), "-script", str(sdir / "script.json")], stdin=True,
              stderr_path=sdir / "kubelet.log")
    procs.append(ks)
    ks.wait_event(lambda e: e["event"] == "ready")
    fake = Proc([str(out / "fake-deviceplugin"), "-dir", str(dp), "-gpus", "GPU-a,GPU-b", "-per-gpu", "4"],
                stderr_path=sdir / "fake.log")
    procs.append(fake)
    ks.wait_event(lambda e: e["event"] == "pause")
    fake.p.send_signal(signal.SIGUSR1)
    ks.send_line()
    events = ks.finish(60)
    check_no_fatal(events, ks)
    regs = [e for e in events if e["event"] == "register"]
    assert len(regs) == 2 and all(r["ok"] and r["version"] == "v1beta1" for r in regs)
    assert regs[0]["plugin_options"]["get_preferred_allocation_available"] is True
    initial = next(e for e in events if e.get("label") == "initial")
    assert initial["count"] == 8 and initial["unique"]
    alloc = next(e for e in events if e["event"] == "allocate")
    assert alloc["ok"] and alloc["used_preferred"] and list(alloc["by_gpu"]) == ["GPU-a"]
    assert alloc["envs"]["FAKE_DEVICES"] == ",".join(alloc["ids"])
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["ok"] and "fake.sock" in restart["removed"]
    after = next(e for e in events if e.get("label") == "after-restart")
    assert after["ids"] == initial["ids"]
    health = next(e for e in events if e["event"] == "health")
    assert health["ok"] and health["list"]["by_gpu"]["GPU-a"] == {"Healthy": 0, "Unhealthy": 4}
