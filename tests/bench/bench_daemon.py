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
- ``daemon.rss_anon_mib`` / ``daemon.rss_file_mib``: the same split into
  anonymous memory (Python heap, stacks) and mapped files
  (shared libraries and extension modules: pages of the page cache, shared
  with other processes mapping the same file; how many a fault maps depends
  on the kernel's page-cache folio size), MiB;
- ``daemon.rss_mib_nri_only``: VmRSS of a ready ``--no-device-plugin``
  daemon (NRI, MPS, metrics, health: no gRPC library at all), MiB;
- ``daemon.rss_mib_mps_role``: VmRSS of a ready ``--role mps`` process, MiB;
- ``demo.wall_s``: one ``fracplugin demo`` run, seconds.

The daemons run as the image runs them (Dockerfile): bytecode compiled
beforehand (the image's ``UV_COMPILE_BYTECODE=1``; here ``compileall`` of
``src/`` into the git-ignored ``__pycache__``, as a developer shell often
sets ``PYTHONDONTWRITEBYTECODE=1`` and the daemon would otherwise compile
every module at start, about 2.5 MiB more heap) and ``MALLOC_ARENA_MAX=2``
(the image's env). Memory split and levers: docs/benchmarks.md, memory.

No assertions on the numbers (speed is reported, not tested).
"""

from __future__ import annotations

import compileall
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
sys.path.insert(0, str(REPO))
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
REPORT = REPO / "build" / "bench.json"
REPEAT = int(os.environ.get("BENCH_DAEMON_REPEAT", "3"))
IMAGE_ENV = {"MALLOC_ARENA_MAX": "2"}  # the Dockerfile's ENV that bears on memory

from fracplugin_demo.kubelet import KubeletSim  # noqa: E402
from fracplugin_demo.nri_runtime import NriRuntimeServer  # noqa: E402
from benchjson import merge  # noqa: E402
from tests.helpers import kill_leftovers  # noqa: E402


def ready(health: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{health}/readyz", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of ``pid`` (KiB, /proc/<pid>/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1])
    return out


def one_run(*extra: str, nri: bool = True, kubelet: bool = True,
            endpoints_name: str = "endpoints.json") -> dict[str, float]:
    """Start the daemon with ``extra`` arguments, wait for /readyz 200, read
    its memory, SIGTERM it. Returns startup/shutdown (ms) and memory (MiB)."""
    work = Path(tempfile.mkdtemp(prefix="fpb", dir="/tmp"))
    work.chmod(0o755)
    rt = NriRuntimeServer(str(work / "nri.sock")).start() if nri else None
    kl = KubeletSim(str(work / "dp")).start() if kubelet else None
    proc = None
    try:
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
               "--state-dir", str(work / "state"), "--nri-socket", str(work / "nri.sock"),
               "--device-plugin-dir", str(work / "dp"), "--pod-resources-socket", str(work / "pr.sock"),
               "--mps-root", str(work / "mps"), "--mps-control-binary", str(FAKE_MPS),
               "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0", "--log-level", "warning",
               *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **IMAGE_ENV}
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        ep = work / "state" / endpoints_name
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
        mem = memory_kib(proc.pid)
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        shutdown_ms = (time.monotonic() - t1) * 1000
        if rc != 0:
            raise RuntimeError(f"daemon exited {rc}")
        return {"startup_ms": startup_ms, "startup_internal_ms": float(endpoints.get("startup_ms", 0.0)),
                "shutdown_ms": shutdown_ms, "rss_mib": mem["VmRSS"] / 1024,
                "rss_anon_mib": mem["RssAnon"] / 1024, "rss_file_mib": mem["RssFile"] / 1024}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if rt is not None:
            rt.close()
        if kl is not None:
            kl.stop()
        kill_leftovers(work)  # the MPS role's control daemons outlive it by design (ADR 0009)
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
    compileall.compile_dir(str(REPO / "src" / "fracplugin"), quiet=1)  # as the image: bytecode compiled beforehand
    runs = [one_run() for _ in range(REPEAT)]
    results = {f"daemon.{k}": statistics.median(r[k] for r in runs) for k in runs[0]}
    results["daemon.rss_mib_nri_only"] = statistics.median(
        one_run("--no-device-plugin", kubelet=False)["rss_mib"] for _ in range(REPEAT))
    results["daemon.rss_mib_mps_role"] = statistics.median(
        one_run("--role", "mps", nri=False, kubelet=False, endpoints_name="endpoints-mps.json")["rss_mib"]
        for _ in range(REPEAT))
    results["demo.wall_s"] = demo_wall_s()
    merge(results)
    for k, v in sorted(results.items()):
        print(f"{k} = {v:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
