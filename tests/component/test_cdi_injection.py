"""CDI-native GPU injection through the daemon's real sockets (issue 23 item 1,
small failing input 1; ADR 0025b): ``fracplugin run --cdi-spec-dirs`` pointed at
a test tree holding ``k8s.device-plugin.nvidia.com-gpu.yaml`` for the four
simulated GPUs; the fake runtime (tests/peers/nri_runtime.py, its own wire
code) sends CreateContainer on the real NRI socket, the fake kubelet calls
Allocate on the real device plugin socket."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from test_daemon import INFERENCE, DaemonProc
from test_daemon import daemon, root  # noqa: F401  pytest fixtures

from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "cdi"
DP = "k8s.device-plugin.nvidia.com/gpu"
UUIDS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]


def spec_tree(root: Path, *fixtures: str) -> tuple[Path, Path]:
    """(etc, run): two spec directories as /etc/cdi and /var/run/cdi; the
    fixture specs go into ``run``."""
    etc, run = root / "etc-cdi", root / "run-cdi"
    etc.mkdir()
    run.mkdir()
    for fx in fixtures:
        for f in (FIX / fx).iterdir():
            shutil.copy(f, run / f.name)
    return etc, run


def nri_daemon(daemon: Callable[..., DaemonProc], root: Path, etc: Path, run: Path, *extra: str) -> DaemonProc:
    return daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"),
                  "--cdi-spec-dirs", f"{etc},{run}", *extra)


def test_bound_inference_pod_gets_the_four_cdi_devices_env_as_today(
        daemon: Callable[..., DaemonProc], root: Path) -> None:
    """Small failing input 1: was no CDI device in the adjustment."""
    from nri_runtime import FakeNriRuntime, effective_env, pod_from_manifest

    etc, run = spec_tree(root, "with-hook")
    assert (run / "k8s.device-plugin.nvidia.com-gpu.yaml").exists()
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = nri_daemon(daemon, root, etc, run)
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        pod, ctrs = pod_from_manifest(INFERENCE)
        adj = rt.create_container(pod, ctrs[0])
        assert [c.name for c in adj.CDI_devices] == [f"{DP}={u}" for u in UUIDS]
        env = effective_env(ctrs[0], adj)
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)  # env as today
        assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960" and env["NVIDIA_GPU_MEMORY_LIMIT"] == "61440"
        cdi = d.get("/status")[1]["cdi"]
        assert cdi["gpus_without_spec"] == [] and cdi["spec_dirs"] == [str(etc), str(run)]
        assert all(cdi["devices"][u]["memory_limit_hook"] for u in UUIDS)
        assert d.terminate() == 0
    finally:
        rt.close()


def test_no_duplicate_when_the_container_has_them_and_a_broken_spec_is_named_once(
        daemon: Callable[..., DaemonProc], root: Path) -> None:
    from nri_runtime import FakeNriRuntime, make_container, pod_from_manifest

    etc, run = spec_tree(root, "no-hook", "broken")
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = nri_daemon(daemon, root, etc, run)
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        pod, _ = pod_from_manifest(INFERENCE)
        # kubelet already requested GPUs 1 and 2 by CDI (Allocate's answer -> Container.CDI_devices),
        # GPU 3 by the CRI annotation form; only GPU 4 is left for fracplugin to request
        ctr = make_container(pod, "app")
        ctr.CDI_devices.add(name=f"{DP}={UUIDS[0]}")
        ctr.CDI_devices.add(name=f"{DP}={UUIDS[1]}")
        ctr.annotations["cdi.k8s.io/kubelet"] = f"{DP}={UUIDS[2]}"
        adj = rt.create_container(pod, ctr)
        assert [c.name for c in adj.CDI_devices] == [f"{DP}={UUIDS[3]}"]
        # the same request again (a retried creation): the same answer, nothing added twice
        assert [c.name for c in rt.create_container(pod, ctr).CDI_devices] == [f"{DP}={UUIDS[3]}"]
        broken = str(run / "vendor.example-gpu.yaml")
        warned = [r for r in d.log_records() if r.get("cdi_spec") == broken]
        assert len(warned) == 1 and "not valid YAML" in warned[0]["reason"], warned
        st = d.get("/status")[1]["cdi"]
        assert [i["path"] for i in st["invalid_specs"]] == [broken]
        assert not any(st["devices"][u]["memory_limit_hook"] for u in UUIDS)  # the no-hook tree
        out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(d.state)],
                             capture_output=True, text=True, timeout=30)
        assert f"ignored spec {broken}" in out.stdout and "NO memory-limit hook" in out.stdout, out.stdout
        assert d.terminate() == 0
        assert len([r for r in d.log_records() if r.get("cdi_spec") == broken]) == 1
    finally:
        rt.close()


def test_gpu_without_spec_keeps_env_and_status_names_it(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """No spec for any GPU: env as today, no CDI device; ``cdi`` in /status
    lists the GPUs without a spec. A spec added later is read without a
    restart."""
    from nri_runtime import FakeNriRuntime, effective_env, pod_from_manifest

    etc, run = spec_tree(root)
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = nri_daemon(daemon, root, etc, run)
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        pod, ctrs = pod_from_manifest(INFERENCE)
        adj = rt.create_container(pod, ctrs[0])
        assert list(adj.CDI_devices) == []
        assert effective_env(ctrs[0], adj)["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)
        assert d.get("/status")[1]["cdi"]["gpus_without_spec"] == UUIDS
        out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(d.state)],
                             capture_output=True, text=True, timeout=30)
        assert "GPUs without a CDI spec (env only, no CDI device): " + ", ".join(UUIDS) in out.stdout, out.stdout
        # the device plugin writes its spec while we run (atomically, as it does): the watcher reads it
        tmp = etc / ".k8s.device-plugin.nvidia.com-gpu.tmp"
        shutil.copy(FIX / "with-hook" / "k8s.device-plugin.nvidia.com-gpu.yaml", tmp)
        tmp.rename(etc / "k8s.device-plugin.nvidia.com-gpu.yaml")
        wait_until(lambda: d.get("/status")[1]["cdi"]["gpus_without_spec"] == [],
                   what=lambda: f"the new spec read: {d.get('/status')[1]['cdi']}")
        _, ctrs2 = pod_from_manifest(INFERENCE)
        adj2 = rt.create_container(pod, ctrs2[0])
        assert [c.name for c in adj2.CDI_devices] == [f"{DP}={u}" for u in UUIDS]
        assert d.terminate() == 0
    finally:
        rt.close()


def test_allocate_answers_cdi_devices(daemon: Callable[..., DaemonProc], root: Path) -> None:
    from fake_kubelet import FakeKubelet

    etc, run = spec_tree(root, "with-hook")
    dp_dir = root / "dp"
    dp_dir.mkdir()
    kubelet = FakeKubelet(str(dp_dir)).start()
    try:
        d = daemon("--no-nri", "--no-mps", "--device-plugin-dir", str(dp_dir),
                   "--pod-resources-socket", str(root / "pr.sock"), "--cdi-spec-dirs", f"{etc},{run}")
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        rn = "fracplugin.io/gpu-memory"
        wait_until(lambda: kubelet.devices(rn))
        r = kubelet.allocate(rn, [f"{UUIDS[1]}::0", f"{UUIDS[1]}::1"]).container_responses[0]
        assert [c.name for c in r.cdi_devices] == [f"{DP}={UUIDS[1]}"]
        assert r.envs["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]  # env as today
        assert d.terminate() == 0
    finally:
        kubelet.stop()


def test_explain_json_lists_each_containers_cdi_devices(root: Path) -> None:
    etc, run = spec_tree(root, "with-hook")
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(INFERENCE), "--node",
                          str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"), "-o", "json",
                          "--cdi-spec-dirs", f"{etc},{run}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    [c] = report["containers"]
    assert c["cdi_devices"] == [f"{DP}={u}" for u in UUIDS]
    assert report["cdi"]["gpus_without_spec"] == []
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(INFERENCE), "--node",
                          str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"), "-o", "json",
                          "--cdi-spec-dirs", str(etc)], capture_output=True, text=True, timeout=60)
    report = json.loads(out.stdout)
    assert report["containers"][0]["cdi_devices"] == [] and report["cdi"]["gpus_without_spec"] == UUIDS


def test_one_cdi_device_per_gpu_and_only_one_the_node_lists(daemon: Callable[..., DaemonProc], root: Path) -> None:
    """Issue 34 input 6: specs of ``k8s.device-plugin.nvidia.com/gpu`` only; ``gpus.devices: nvidia.com/gpu=0``
    gets one CDI device for GPU 0, the node's own (it got that and ``nvidia.com/gpu=0``, which nothing on the
    node resolves); 300 other vendors' specs beside it are not parsed (``/status`` lists them, none invalid)."""
    from nri_runtime import FakeNriRuntime, make_container, make_pod

    etc, run = spec_tree(root, "with-hook")
    filler = "\n".join(f"  - name: dev{i}\n    containerEdits: {{env: [X_{i}={'y' * 100}]}}" for i in range(80))
    for i in range(300):  # ~12 KB each, as a node with many vendors' devices has them
        (etc / f"vendor{i}.yaml").write_text(f'cdiVersion: "0.6.0"\nkind: vendor{i}.example/fpga\ndevices:\n{filler}\n')
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = nri_daemon(daemon, root, etc, run)
        rt.wait_registered(15)
        sandbox = make_pod("one", "team", "uid-one", {"nvidia.com/container.app.gpu-memory.request": "8Gi",
                                                       "nvidia.com/container.app.gpus.devices": "nvidia.com/gpu=0"})
        adj = rt.create_container(sandbox, make_container(sandbox, "app"))
        assert [c.name for c in adj.CDI_devices] == [f"{DP}={UUIDS[0]}"], adj
        cdi = d.get("/status")[1]["cdi"]
        assert len(cdi["specs"]) == 301 and cdi["invalid_specs"] == [], cdi["invalid_specs"]
    finally:
        rt.close()


def test_a_changed_spec_directory_is_reread_in_the_background_and_then_used(
        daemon: Callable[..., DaemonProc], root: Path) -> None:
    """Issue 34 input 7 through the real NRI socket: 300 specs of ~12 KB (other vendors' kinds) in a spec
    directory; the node's own GPU spec appears and one of the 300 is touched; the next CreateContainer is
    answered (from the snapshot the watcher last swapped in: with or without the new device, never an
    error), and once the background re-read ended (``/status`` lists the new spec's devices) the next
    CreateContainer gets the new spec's device for GPU 0. That the answer never waits for the re-read is
    tests/unit/test_cdi.py::test_lookups_never_wait_for_a_reread; its cost is ``nri.create.cdi_refresh.p99_ms``
    (tests/bench/bench_cdi.py)."""
    import os

    from nri_runtime import FakeNriRuntime, make_container, make_pod

    etc, run = spec_tree(root)
    filler = "\n".join(f"  - name: dev{i}\n    containerEdits: {{env: [X_{i}={'y' * 100}]}}" for i in range(80))
    for i in range(300):  # ~12 KB each
        (etc / f"vendor{i}.yaml").write_text(f'cdiVersion: "0.6.0"\nkind: vendor{i}.example/fpga\ndevices:\n{filler}\n')
    assert (etc / "vendor7.yaml").stat().st_size > 11_000
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))

    def create(name: str) -> object:
        sandbox = make_pod(name, "team", f"uid-{name}", {"nvidia.com/container.app.gpu-memory.request": "8Gi",
                                                          "nvidia.com/container.app.gpus.devices": "0"})
        adj = rt.create_container(sandbox, make_container(sandbox, "app"))
        assert getattr(adj, "code", None) is None and hasattr(adj, "env"), adj
        return adj

    try:
        d = nri_daemon(daemon, root, etc, run)
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        assert [c.name for c in create("before").CDI_devices] == []  # no spec of a GPU kind yet
        assert d.get("/status")[1]["cdi"]["gpus_without_spec"] == UUIDS
        shutil.copy(FIX / "with-hook" / "k8s.device-plugin.nvidia.com-gpu.yaml", run / "zz-dp.yaml")
        os.utime(etc / "vendor7.yaml")
        assert [c.name for c in create("during").CDI_devices] in ([], [f"{DP}={UUIDS[0]}"])
        wait_until(lambda: d.get("/status")[1]["cdi"]["gpus_without_spec"] == [], 20,
                   what=lambda: f"the background re-read: {d.get('/status')[1]['cdi']['gpus_without_spec']}")
        assert [c.name for c in create("after").CDI_devices] == [f"{DP}={UUIDS[0]}"]
        cdi = d.get("/status")[1]["cdi"]
        assert len(cdi["specs"]) == 301 and cdi["invalid_specs"] == [], cdi["invalid_specs"]
    finally:
        rt.close()
