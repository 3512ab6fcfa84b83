"""fracplugin's device plugin against a kubelet built from the upstream API
stubs (issue 4 item 7).

tests/interop/kubelet/cmd/kubelet-sim uses k8s.io/kubelet
pkg/apis/deviceplugin/v1beta1 and behaves like kubelet's device manager
(reference docs/reference/kubelet-device-plugin.md A.5): Registration served on a temporary
kubelet.sock, dial back to the plugin's endpoint with :authority "localhost"
and a 10 s blocking dial, GetDevicePluginOptions then ListAndWatch,
GetPreferredAllocation + Allocate like admission, and a kubelet restart that
deletes every socket and re-creates kubelet.sock. The daemon finds pods
through the simulated API (--pods-file). Node: examples/nodes/gpu-node-1.yaml.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from interop_util import NODE_YAML, Proc, build_module, check_no_fatal, load_yaml, start_fracplugin

pytestmark = pytest.mark.interop

RESOURCE = "fracplugin.io/gpu-memory"  # the daemon's default (fracplugin run --help)
UNIT_MIB = 1024
PREFIX = "nvidia.com/container.app."


def node_gpus() -> list[dict[str, Any]]:
    return list(load_yaml(NODE_YAML)["gpus"])


def dp_pod(name: str, uid: str, devices: int, annotations: dict[str, str]) -> dict[str, Any]:
    """A pending pod bound to gpu-node-1 asking `devices` units of our resource."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": uid, "annotations": annotations,
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"nodeName": "gpu-node-1", "containers": [{
            "name": "app", "image": "nvcr.io/nvidia/cuda:13.0.2-base-ubuntu24.04",
            "resources": {"limits": {RESOURCE: str(devices)}, "requests": {RESOURCE: str(devices)}}}]},
        "status": {"phase": "Pending"},
    }


def health_address(state_dir: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    path = state_dir / "endpoints.json"
    while time.monotonic() < deadline:
        try:
            addr = json.loads(path.read_text()).get("health")
            if addr:
                return addr
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    pytest.fail(f"no health address in {path}")


def inject_xid(state_dir: Path, gpu_uuid: str, xid: int) -> None:
    """Inject an XID into the daemon's simulated inventory.

    The daemon's contract in --simulate-node mode (src/fracplugin/health.py):
    POST http://<health address>/simulate/xid with JSON
    {"gpu_uuid": ..., "xid": ...} -> 202 (400 bad body, 404 unknown GPU;
    the route does not exist without a simulated node).
    """
    addr = health_address(state_dir)
    req = urllib.request.Request(f"http://{addr}/simulate/xid", method="POST",
                                 data=json.dumps({"gpu_uuid": gpu_uuid, "xid": xid}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as rsp:
        assert rsp.status == 202, rsp.status


def run_kubelet(procs: list[Proc], sdir: Path, steps: list[dict[str, Any]], pods: list[dict[str, Any]] = (),
                on_pause: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """kubelet-sim first (it wipes stale sockets like kubelet), then the daemon.

    The script starts by waiting until every device is Healthy (the daemon
    may report a GPU Unhealthy while its MPS daemon is still starting)."""
    steps = [{"op": "wait_all_healthy", "timeout_s": 30, "label": "initial"}, *steps]
    out = build_module("kubelet")
    dp = sdir / "dp"
    pods_file = sdir / "pods.yaml"
    pods_file.write_text(yaml.safe_dump_all(list(pods)) if pods else "")
    (sdir / "script.json").write_text(json.dumps({"steps": steps}))
    ks = Proc([str(out / "kubelet-sim"), "-dir", str(dp), "-script", str(sdir / "script.json"),
               "-register-timeout", "60s"], stdin=True, stderr_path=sdir / "kubelet-sim.log")
    procs.append(ks)
    ks.wait_event(lambda e: e["event"] == "ready")
    daemon = start_fracplugin(procs, sdir, nri_socket=None, extra=[
        "--no-nri", "--device-plugin-dir", str(dp), "--pods-file", str(pods_file), "--node-name", "gpu-node-1",
        "--pod-resources-socket", str(sdir / "podres.sock")])
    for n in range(1, 1 + sum(1 for s in steps if s["op"] == "pause")):
        ev = ks.wait_event(lambda e: e["event"] in ("pause", "fatal"), timeout=90, nth=n)
        if ev["event"] == "fatal":
            break
        if on_pause is not None:
            on_pause(ev["name"])
        ks.send_line()
    events = ks.finish(120)
    check_no_fatal(events, ks, daemon)
    assert one(events, event="all_healthy", label="initial")["ok"], "devices never all Healthy" + daemon.stderr_tail()
    return events


def one(events, **match):
    found = [e for e in events if all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_registration_and_device_list(sdir, procs):
    events = run_kubelet(procs, sdir, [{"op": "list", "label": "all"}])
    reg = [e for e in events if e["event"] == "register"][0]
    assert reg["ok"], reg
    assert reg["version"] == "v1beta1" and reg["resource_name"] == RESOURCE
    assert "/" not in reg["endpoint"] and reg["endpoint"].endswith(".sock")
    assert reg["plugin_options"]["get_preferred_allocation_available"] is True
    # RegisterRequest.options and GetDevicePluginOptions agree (A.5)
    assert bool((reg.get("options") or {}).get("get_preferred_allocation_available")) is True
    lst = one(events, event="list", label="all")
    gpus = node_gpus()
    expected = {g["uuid"]: g["memory_mib"] // UNIT_MIB for g in gpus}
    assert lst["count"] == sum(expected.values())
    assert {u: c["Healthy"] for u, c in lst["by_gpu"].items()} == expected
    assert lst["unhealthy"] == 0 and lst["unique"] and lst["max_id_len"] <= 63
    for dev_id in lst["ids"]:
        uuid, _, n = dev_id.rpartition("::")
        assert uuid in expected and n.isdigit() and int(n) < expected[uuid], dev_id


def test_twenty_devices_land_on_one_gpu(sdir, procs):
    events = run_kubelet(procs, sdir, [{"op": "preferred", "size": 20, "label": "p20"}])
    p = one(events, event="preferred", label="p20")
    assert p["ok"], p
    assert len(p["ids"]) == 20 and p["unique"]
    assert len(p["by_gpu"]) == 1, p["by_gpu"]


def test_allocate_env_for_pod_with_limit_and_sm_sharing(sdir, procs):
    pod = dp_pod("dp-inference", "uid-dp-inference", 20, {
        PREFIX + "gpu-memory.limit": "30Gi",
        PREFIX + "gpu-compute.mode": "sm-sharing",
        PREFIX + "gpu-compute.portion": "0.5",
    })
    events = run_kubelet(procs, sdir, [{"op": "allocate", "size": 20, "label": "a20"}], pods=[pod])
    a = one(events, event="allocate", label="a20")
    assert a["ok"], a
    assert a["container_responses"] == 1 and len(a["by_gpu"]) == 1
    (gpu,) = a["by_gpu"]
    env = a["envs"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == str(20 * UNIT_MIB)
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "30720"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu}=30720M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    # MPS v3 (the simulated node's driver): Allocate carries no pipe-directory mount; the
    # NRI door mounts the container's own namespace leaf read-only (ADR 0009), so no
    # daemon's control socket ever reaches a container through kubelet.
    assert "/tmp/nvidia-mps" not in [m["container_path"] for m in a["mounts"] or []]


def test_kubelet_restart_reregisters(sdir, procs):
    events = run_kubelet(procs, sdir, [
        {"op": "list", "label": "before"},
        {"op": "restart", "gap_ms": 0, "timeout_s": 20},
        {"op": "list", "label": "after"},
    ])
    r = one(events, event="restart")
    assert r["ok"], r
    assert any(name.endswith(".sock") for name in r["removed"]), r["removed"]
    regs = [e for e in events if e["event"] == "register"]
    assert len(regs) == 2 and all(x["ok"] for x in regs)
    assert one(events, label="after")["ids"] == one(events, label="before")["ids"]


def test_xid_flips_all_fractions_of_one_gpu(sdir, procs):
    gpu = node_gpus()[1]["uuid"]
    state = sdir / "state"
    events = run_kubelet(procs, sdir, [
        {"op": "pause", "name": "xid"},
        {"op": "wait_health", "gpu": gpu, "health": "Unhealthy", "timeout_s": 20, "label": "down"},
    ], on_pause=lambda _name: inject_xid(state, gpu, 79))
    h = one(events, event="health", label="down")
    assert h["ok"], h
    per = h["list"]["by_gpu"]
    assert per[gpu]["Healthy"] == 0 and per[gpu]["Unhealthy"] == node_gpus()[1]["memory_mib"] // UNIT_MIB
    assert all(c["Unhealthy"] == 0 for u, c in per.items() if u != gpu)
    # one update flipped them all: no ListAndWatch list ever showed a GPU half-healthy
    for e in events:
        if e["event"] == "list_and_watch":
            for u, c in e["by_gpu"].items():
                assert c["Healthy"] == 0 or c["Unhealthy"] == 0, (u, c)
