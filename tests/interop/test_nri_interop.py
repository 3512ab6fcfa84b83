"""fracplugin's NRI plugin against the real runtime side (issue 3 item 4).

The Go harness (tests/interop/nri-*/cmd/nri-runtime) embeds containerd/nri
pkg/adaptation, the code containerd embeds, at v0.12.5 (containerd 2.3) and
v0.8.0 (containerd 1.7.26+/2.0/2.1). It plays the runtime, our daemon is the
plugin, and every assertion is on the JSON of the merged adjustment the real
adaptation produced. Expected values: issue 3 / docs/reference/design.md section 4 for the
bound seed pod examples/pods/inference-sm-sharing-4gpu.bound.yaml.
"""

from __future__ import annotations

import copy
import json
import urllib.request

import pytest

from interop_util import (
    NRI_LINES,
    Proc,
    adjustment_is_empty,
    check_no_fatal,
    creates,
    endpoints_file,
    env_of,
    fracplugin_argv,
    mounts_of,
    seed_pod,
    start_fracplugin,
    start_runtime,
    template_bin,
    wrapper_script,
)

pytestmark = pytest.mark.interop

LINES = sorted(NRI_LINES)
PREFIX = "nvidia.com/container.app."
UUIDS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]
PIPE_DIR = "/tmp/nvidia-mps"

# What the bound inference pod's container must get (issue 3 item 4).
BOUND_ENV = {
    "NVIDIA_VISIBLE_DEVICES": ",".join(UUIDS),
    "NVIDIA_GPU_MEMORY_REQUEST": "40960",
    "NVIDIA_GPU_MEMORY_LIMIT": "61440",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{u}=61440M" for u in UUIDS),  # UUID keys (issue 35)
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
    "CUDA_MPS_PIPE_DIRECTORY": PIPE_DIR,
}


def bound_pod(**kw):
    return seed_pod("inference-sm-sharing-4gpu.bound.yaml", **kw)


def assert_bound_adjustment(c):
    assert c["ok"], c.get("error")
    env = env_of(c)
    for k, v in BOUND_ENV.items():
        assert env.get(k) == v, (k, env.get(k), v)
    dests = [m["destination"] for m in mounts_of(c)]
    assert PIPE_DIR in dests, dests


def small_pod(name, uid, gpu_uuid):
    """A bound sm-sharing pod on one GPU: 1 GiB request, 2 GiB limit, portion 0.25."""
    return {
        "name": name, "namespace": "default", "uid": uid,
        "annotations": {
            PREFIX + "gpu-memory.request": "1Gi", PREFIX + "gpu-memory.limit": "2Gi",
            PREFIX + "gpu-compute.mode": "sm-sharing", PREFIX + "gpu-compute.portion": "0.25",
            PREFIX + "gpus.devices": gpu_uuid,
        },
        "containers": [{"name": "app"}],
    }


def run_with_daemon(procs, sdir, line, scenario, *, extra=None, templates=(), wait=None):
    """Start the runtime harness, then our daemon (and template plugins), and
    return the harness events once it finished. The harness runs the scenario
    only once the daemon's /readyz says ready, and retries a create/start
    answered UNAVAILABLE like kubelet (reported as warnings)."""
    sock = sdir / "nri.sock"
    rt = start_runtime(procs, line, sdir, scenario, socket=sock, wait_plugins=wait or 1 + len(templates),
                       extra=extra, ready_endpoints=endpoints_file(sdir))
    for idx, env in templates:
        procs.append(Proc([str(template_bin(line)), "-socket", str(sock), "-idx", idx, "-name", f"template{idx}",
                           "-env", env], stderr_path=sdir / f"template{idx}.log"))
    daemon = start_fracplugin(procs, sdir, nri_socket=sock)
    events = rt.finish(120)
    check_no_fatal(events, rt, daemon)
    assert any(e["event"] == "daemon_ready" for e in events), "the scenario ran before the daemon was ready"
    return events


@pytest.mark.parametrize("line", LINES)
def test_bound_inference_pod_gets_contract_env_and_pipe_mount(line, sdir, procs):
    # the pod spec itself sets a wrong ATP: our value must override it by value
    pod = bound_pod(containers=[{"name": "app", "env": ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100"]}])
    events = run_with_daemon(procs, sdir, line, {"pods": [pod]})
    (c,) = creates(events)
    assert_bound_adjustment(c)
    assert not (c["adjust"].get("linux") or {}).get("devices"), "no device nodes unless configured"
    lifecycle = [e for e in events if e["event"] in ("run_pod", "start", "stop", "remove", "stop_pod", "remove_pod")]
    assert len(lifecycle) == 6 and all(e["ok"] for e in lifecycle), lifecycle


@pytest.mark.parametrize("line", LINES)
def test_refused_pod_limit_below_request_fails_create(line, sdir, procs):
    pod = bound_pod()
    pod["annotations"][PREFIX + "gpu-memory.limit"] = "30Gi"  # request is 40Gi
    events = run_with_daemon(procs, sdir, line, {"pods": [pod]})
    (c,) = creates(events)
    assert not c["ok"]
    assert "nvidia.com/container.app.gpu-memory.limit" in c["error"], c["error"]
    assert "InvalidArgument" in c["error"], c["error"]


@pytest.mark.parametrize("line", LINES)
def test_pod_without_fraction_annotations_is_untouched(line, sdir, procs):
    pod = {"name": "plain", "namespace": "default", "uid": "uid-plain",
           "annotations": {"example.com/team": "a"}, "containers": [{"name": "app", "env": ["NVIDIA_VISIBLE_DEVICES=none"]}]}
    events = run_with_daemon(procs, sdir, line, {"pods": [pod]})
    (c,) = creates(events)
    assert c["ok"] and adjustment_is_empty(c["adjust"]), c["adjust"]


@pytest.mark.parametrize("line", LINES)
def test_large_pod_hundreds_of_annotations(line, sdir, procs):
    pod = bound_pod()
    for i in range(400):
        pod["annotations"][f"example.com/large-{i:03d}"] = f"{i:03d}-" + "v" * 96
    events = run_with_daemon(procs, sdir, line, {"pods": [pod]})
    (c,) = creates(events)
    assert_bound_adjustment(c)


@pytest.mark.parametrize("line", LINES)
def test_next_to_template_plugins_in_index_order(line, sdir, procs):
    events = run_with_daemon(procs, sdir, line, {"pods": [bound_pod()]},
                             templates=(("10", "TEMPLATE_EARLY=10"), ("90", "TEMPLATE_LATE=90")))
    order = next(e for e in events if e["event"] == "plugin_order")["plugins"]
    names = [o.split(":", 1)[1].split("[")[0] for o in order]
    assert len(names) == 3 and names == sorted(names), names
    assert names[0] == "10-template10" and names[2] == "90-template90" and "fracplugin" in names[1], names
    (c,) = creates(events)
    assert_bound_adjustment(c)
    env = env_of(c)
    assert env["TEMPLATE_EARLY"] == "10" and env["TEMPLATE_LATE"] == "90"
    keys = [kv["key"] for kv in c["adjust"]["env"]]
    assert keys.index("TEMPLATE_EARLY") < keys.index("NVIDIA_VISIBLE_DEVICES") < keys.index("TEMPLATE_LATE")


@pytest.mark.parametrize("line", LINES)
def test_launched_from_plugin_dir_on_fd3(line, sdir, procs):
    pdir, cdir = sdir / "plugins", sdir / "conf.d"
    pdir.mkdir()
    cdir.mkdir()
    # --no-mps: the runtime SIGKILLs launched plugins, so no MPS children are left behind
    argv = [a for a in fracplugin_argv(sdir, nri_socket=None, mps=False)] + ["--no-device-plugin"]
    wrapper_script(pdir / "50-fracplugin", argv, sdir / "fracplugin.log")
    rt = start_runtime(procs, line, sdir, {"pods": [bound_pod()]}, plugin_dir=pdir, config_dir=cdir, wait_plugins=0,
                       ready_endpoints=endpoints_file(sdir))
    events = rt.finish(120)
    check_no_fatal(events, rt)
    order = next(e for e in events if e["event"] == "plugin_order")["plugins"]
    assert len(order) == 1 and order[0].startswith("pre-connected:50-fracplugin"), (
        order, (sdir / "fracplugin.log").read_text(errors="replace")[-3000:])
    (c,) = creates(events)
    assert_bound_adjustment(c)


@pytest.mark.parametrize("line", LINES)
def test_runtime_goes_away_and_comes_back(line, sdir, procs):
    first = bound_pod()
    later = small_pod("later", "uid-later", UUIDS[0])
    scenario = {"pods": [first], "after_reconnect": [later]}
    events = run_with_daemon(procs, sdir, line, scenario, extra=["-reconnect", "-restart-gap", "500ms"])
    assert next(e for e in events if e["event"] == "runtime_stopped")["closed_connections"] == 1
    assert next(e for e in events if e["event"] == "restart")["ok"]
    sync2 = [e for e in events if e["event"] == "synchronized" and e["round"] == 2 and not e["preinstalled"]]
    assert len(sync2) == 1 and sync2[0]["ok"]
    assert sync2[0]["container_ids"] == [creates(events, 1)[0]["id"]]
    assert_bound_adjustment(creates(events, 1)[0])
    (c2,) = creates(events, 2)
    assert c2["ok"], c2.get("error")
    env = env_of(c2)
    assert env["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "2048" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    teardown = [e for e in events if e["event"] in ("stop", "remove", "stop_pod", "remove_pod")]
    assert teardown and all(e["ok"] for e in teardown), teardown


@pytest.mark.parametrize("line", LINES)
def test_synchronize_with_preexisting_fractional_container(line, sdir, procs):
    """A running fractional container reported in Synchronize holds its share:
    a second pod that would need the same memory on the same GPUs is refused
    (81559 MiB per GPU; 40960 MiB held + 40960 MiB asked > 81559)."""
    running = bound_pod()
    rival = copy.deepcopy(bound_pod())
    rival.update(name="rival", uid="uid-rival")
    events = run_with_daemon(procs, sdir, line, {"sync": [running], "pods": [rival]})
    sync = next(e for e in events if e["event"] == "synchronized" and not e["preinstalled"])
    assert sync["ok"] and sync["containers"] == 1
    (c,) = creates(events)
    assert not c["ok"], "the ledger rebuilt from Synchronize must hold the running container's memory"


@pytest.mark.parametrize("line", LINES)
def test_namespace_is_made_at_run_pod_sandbox_through_the_adaptation(line, sdir, procs):
    """ADR 0030: containerd/nri's adaptation delivers RunPodSandbox (v0.12 its
    RPC, v0.8 StateChange) and RemovePodSandbox to the plugin's 0x62d mask;
    the pod's namespace is queued at RunPodSandbox and CreateContainer and
    StartContainer reuse it (no ensure of their own); nothing fails the pod."""
    events = run_with_daemon(procs, sdir, line, {"pods": [small_pod("early", "uid-early", UUIDS[0])]})
    (c,) = creates(events)
    assert c["ok"], c.get("error")
    lifecycle = [e for e in events if e["event"] in ("run_pod", "start", "stop", "remove", "stop_pod", "remove_pod")]
    assert len(lifecycle) == 6 and all(e["ok"] for e in lifecycle), lifecycle
    addr = json.loads(endpoints_file(sdir).read_text())["health"]
    with urllib.request.urlopen(f"http://{addr}/status", timeout=10) as rsp:
        nri = json.load(rsp)["nri"]
    assert nri["events"] == "0x62d"
    early = nri["early_namespaces"]
    assert (early["pending"], early["queued"], early["used"], early["mismatched"]) == (0, 1, 1, 0), early
