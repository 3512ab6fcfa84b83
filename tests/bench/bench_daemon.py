#!/usr/bin/env python3
"""Benchmark: ``fracplugin run`` start-up, readiness, shutdown and memory; the demo's wall time.

Runs the real daemon as a subprocess on the simulated four-GPU node with every
door on (NRI against ``NriRuntimeServer``, the device plugin against
``KubeletSim``, MPS with the fake control binary), ``REPEAT`` times, and
merges the medians into ``build/bench.json`` (a flat JSON object,
read-modify-write under an exclusive ``flock``):

- ``daemon.startup_ms``: spawn of the process to ``/readyz`` answering 200
  (interpreter start, imports, every part started, NRI synchronized, device
  plugin registered, both MPS daemons healthy);
- ``daemon.startup_internal_ms``: the daemon's own measure (first line of
  ``Daemon.start`` to endpoints written), from ``endpoints.json``;
- ``daemon.shutdown_ms``: SIGTERM to process exit;
- ``daemon.rss_mib``: resident memory of the ready daemon (VmRSS), MiB;
- ``demo.wall_s``: one ``fracplugin demo`` run, seconds.

No assertions on the numbers (speed is reported, not tested).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
REPORT = REPO / "build" / "bench.json"
REPEAT = int(os.environ.get("BENCH_DAEMON_REPEAT", "3"))

from fracplugin.sim.kubelet import KubeletSim  # noqa: E402
from fracplugin.sim.nri_runtime import NriRuntimeServer  # noqa: E402
from benchjson import merge  # noqa: E402


def ready(health: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{health}/readyz", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def one_run() -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="fpb", dir="/tmp"))
    work.chmod(0o755)
    rt = NriRuntimeServer(str(work / "nri.sock")).start()
    kl = KubeletSim(str(work / "dp")).start()
    proc = None
    try:
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
               "--state-dir", str(work / "state"), "--nri-socket", str(work / "nri.sock"),
               "--device-plugin-dir", str(work / "dp"), "--pod-resources-socket", str(work / "pr.sock"),
               "--mps-root", str(work / "mps"), "--mps-control-binary", str(FAKE_MPS),
               "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0", "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        ep = work / "state" / "endpoints.json"
        while not ep.exists():
            if proc.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError("daemon did not start")
            time.sleep(0.005)
        endpoints = json.loads(ep.read_text())
        while not ready(endpoints["health"]):
            if time.monotonic() - t0 > 60:
                raise RuntimeError("daemon not ready within 60 s")
            time.sleep(0.005)
        startup_ms = (time.monotonic() - t0) * 1000
        rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:"))
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        shutdown_ms = (time.monotonic() - t1) * 1000
        if rc != 0:
            raise RuntimeError(f"daemon exited {rc}")
        return {"daemon.startup_ms": startup_ms, "daemon.startup_internal_ms": float(endpoints["startup_ms"]),
                "daemon.shutdown_ms": shutdown_ms, "daemon.rss_mib": rss_kib / 1024}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        rt.close()
        kl.stop()
        shutil.rmtree(work, ignore_errors=True)


def demo_wall_s() -> float:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "demo"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src"), },
                         timeout=120, cwd=str(REPO))
    if out.returncode != 0:
        raise RuntimeError("demo failed:\n" + out.stdout[-2000:])
    return time.monotonic() - t0




def main() -> int:
    runs = [one_run() for _ in range(REPEAT)]
    results = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    results["demo.wall_s"] = demo_wall_s()
    merge(results)
    for k, v in sorted(results.items()):
        print(f"{k} = {v:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
