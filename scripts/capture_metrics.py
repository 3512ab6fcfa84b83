#!/usr/bin/env python3
"""Capture what a running fracplugin daemon really exports on /metrics.

    .venv/bin/python scripts/capture_metrics.py [OUT]   (default tests/fixtures/metrics/daemon-metrics.txt)

Runs ``fracplugin demo``'s scenario (the real daemon as a subprocess on the
simulated node examples/nodes/gpu-node-1.yaml with the fake
nvidia-cuda-mps-control, driven through its real NRI and device plugin
sockets: tenants placed, a mode conflict and a limit-below-request refused, an
Allocate), then, with the daemon still running, GETs /metrics and writes the
exposition text to OUT. Then the memory-limit families (issue 23), which the
demo's daemon does not export (memory limits off): a second daemon with
``--memory-limits apply`` on the fake ``libnvidia-ml.so.1`` (tests/fakes/nvml)
and a cgroup v2 test tree starts the seed inference container through its NRI
socket (NVML refuses to set the limit on its last GPU, NO_PERMISSION, with
``--memory-limits-policy warn``: the capture holds a container that is not
enforced, on one GPU, beside three that are); its memory-limit families are appended. The alert tests (tests/chart, promtool) and the
dashboard check use this capture as the series the daemon emits;
tests/component/test_metrics_capture.py re-captures and fails when the
fixture's series (names and label names) are no longer what the daemon emits.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"


def capture() -> str:
    """Run the demo scenario and return the daemon's /metrics text (UTF-8).

    Raises RuntimeError when a demo step fails (its output names the step)."""
    sys.path.insert(0, str(REPO / "src"))
    from fracplugin_demo.demo import Demo, find_examples, find_fake_mps

    captured: dict[str, str] = {}

    class CaptureDemo(Demo):
        def metrics(self) -> None:  # the demo's last step, daemon still running
            with urllib.request.urlopen(f"http://{self.endpoints['metrics']}/metrics", timeout=10) as r:
                captured["text"] = r.read().decode("utf-8")

    demo = CaptureDemo(find_examples(None), find_fake_mps(None))
    demo.out = lambda *a, **k: None  # type: ignore[assignment,method-assign]
    demo.out.block = lambda *a, **k: None  # type: ignore[attr-defined]
    status = demo.run()
    if status != 0 or "text" not in captured:
        raise RuntimeError(f"the demo scenario failed (status {status}); run `fracplugin demo` to see which step")
    return captured["text"]


MEMORY_LIMIT_FAMILIES = ("fracplugin_node_capability", "fracplugin_memory_limits_",
                         "fracplugin_container_cuda_memory_limit")


def capture_memory_limits() -> str:
    """The memory-limit families of a daemon that applied one container's
    limits (see the module docstring). Raises RuntimeError when a step fails."""
    import json
    import os
    import shutil
    import subprocess
    import tempfile
    import time

    import yaml

    sys.path.insert(0, str(REPO))
    from tests.fakes import nvml as fake
    from tests.peers.nri_runtime import FakeNriRuntime, pod_from_manifest

    node_yaml = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
    root = Path(tempfile.mkdtemp(prefix="fpc", dir="/tmp"))
    proc = None
    rt = None
    try:
        cg = root / "cgroup"
        cg.mkdir()
        (cg / "cgroup.controllers").write_text("cpu memory pids dmem\n")
        node = yaml.safe_load(node_yaml.read_text())
        (cg / "dmem.capacity").write_text("".join(
            f"nvidia/{g['pci_bus_id'][4:].lower()}/vidmem {g['memory_mib'] << 20}\n" for g in node["gpus"]))
        lib = fake.build_fake_nvml()
        # one GPU where the limit cannot be set: the not-enforced series (issue 36 item 5, the dashboard)
        nf = fake.node_file(root / "nvml-node", node,
                            fail=[("SetMemoryLimits", node["gpus"][-1]["uuid"], fake.NVML_ERROR_NO_PERMISSION)])
        rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(node_yaml),
               "--state-dir", str(root / "state"), "--health-address", "127.0.0.1:0",
               "--metrics-address", "127.0.0.1:0", "--no-device-plugin", "--no-mps", "--mps-root", str(root / "mps"),
               "--nri-socket", str(root / "nri.sock"), "--memory-limits", "apply", "--memory-limits-policy", "warn", "--cgroup-root", str(cg)]
        env = {**os.environ, **fake.env(lib, nf, root / "limits"),
               "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(root))
        rt.wait_registered(30)
        pod, ctrs = pod_from_manifest(REPO / "examples" / "pods" / "inference-sm-sharing-4gpu.bound.yaml")
        c = ctrs[0]
        c.linux.cgroups_path = f"/kubepods/pod{pod.uid}/{c.id}"
        leaf = cg / "kubepods" / f"pod{pod.uid}" / c.id
        leaf.mkdir(parents=True)
        (leaf / "dmem.current").write_text("".join(  # the kernel's own count of the container's device memory
            f"nvidia/{g['pci_bus_id'][4:].lower()}/vidmem {(1024 + 256 * g['index']) << 20}\n" for g in node["gpus"]))
        if hasattr(rt.create_container(pod, c), "code") or rt.start_container(pod, c) is not None:
            raise RuntimeError("the memory-limits daemon refused the seed inference container")
        ep = root / "state" / "endpoints.json"
        deadline = time.monotonic() + 30
        while not ep.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        metrics = json.loads(ep.read_text())["metrics"]
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            text = r.read().decode("utf-8")
    finally:
        if rt is not None:
            rt.close()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)
    keep = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else line.split("{")[0].split(" ")[0]
        if name.startswith(MEMORY_LIMIT_FAMILIES):
            keep.append(line)
    if not keep:
        raise RuntimeError("the memory-limits daemon exported no memory-limit family")
    return "\n".join(keep) + "\n"


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if not a.startswith("--")]
    out = Path(args[0]) if args else DEFAULT_OUT
    text = capture() + ("" if "--no-memory-limits" in argv else capture_memory_limits())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
