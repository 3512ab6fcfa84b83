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

import pytest

from interop_util import (
    NRI_LINES,
    Proc,
    adjustment_is_empty,
    build_module,
    check_no_fatal,
    creates,
    env_of,
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
