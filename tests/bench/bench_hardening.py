#!/usr/bin/env python3
"""Benchmark: idle connections on the metrics port with a 1024 open-file limit.

Starts ``fracplugin run`` on the simulated node (MPS on, with the fake control
binary) under ``prlimit --nofile=1024:1024`` (so the daemon cannot raise it),
then opens idle TCP connections to ``/metrics`` (never sending a byte) and
keeps every one of them open on the client side, in batches of 500. After
each batch: ``/healthz`` answers 200, a ``/metrics`` scrape answers 200, the
MPS daemons are healthy, the daemon is alive. Merged into build/bench.json:

- ``metrics.idle_connections_survived``: idle connections held open when the
  last batch whose checks all passed ended (target >= 10000; capped by
  ``BENCH_IDLE_CONNECTIONS``, default 10000, and this process's own limit);
- ``metrics.idle_connections_daemon_fds_max``: most descriptors the daemon
  held meanwhile (/proc/<pid>/fd);
- ``metrics.scrape_with_idle_ms``: wall time of the last ``/metrics`` scrape
  made with every idle connection open;
- ``metrics.idle_connections_per_s``: idle connections opened per second.

No assertions on the numbers (reported, not tested; the pass/fail version
with 2,000 connections is tests/component/test_hardening.py).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
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
TARGET = int(os.environ.get("BENCH_IDLE_CONNECTIONS", "10000"))
BATCH = 500
FD_LIMIT = 1024

from benchjson import merge  # noqa: E402


def get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:  # type: ignore[attr-defined]
        return e.code, e.read()
    except OSError:
        return 0, b""


def main() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = hard if hard != resource.RLIM_INFINITY else TARGET + 1000
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
    target = min(TARGET, room - 200)
    work = Path(tempfile.mkdtemp(prefix="fpbh", dir="/tmp"))
    work.chmod(0o755)  # the MPS root must be traversable, or the daemon is never ready (issue 12)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    cmd = ["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "--", sys.executable, "-m", "fracplugin.cli", "run",
           "--simulate-node", str(NODE), "--no-nri", "--no-device-plugin",
           "--mps-control-binary", str(FAKE_MPS), "--state-dir", str(work / "state"),
           "--mps-root", str(work / "mps"), "--health-address", "127.0.0.1:0",
           "--metrics-address", "127.0.0.1:0", "--log-format", "json"]
    log = open(work / "daemon.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    socks: list[socket.socket] = []
    survived, fds_max, scrape_ms, rate = 0, 0, float("nan"), 0.0
    try:
        ep = work / "state" / "endpoints.json"
        deadline = time.monotonic() + 60
        while not ep.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        endpoints = json.loads(ep.read_text())
        health, metrics = endpoints["health"], endpoints["metrics"]
        while get(f"http://{health}/readyz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        if get(f"http://{health}/readyz")[0] != 200:
            tail = (work / "daemon.log").read_text(errors="replace").splitlines()[-5:]
            print("bench_hardening: the daemon never became ready; log tail:", *tail, sep="\n", file=sys.stderr)
            return 1
        host, port = metrics.rsplit(":", 1)
        t0 = time.monotonic()
        while len(socks) < target:
            for _ in range(min(BATCH, target - len(socks))):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.settimeout(5)
                try:
                    s.connect((host, int(port)))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
            fds_max = max(fds_max, len(os.listdir(f"/proc/{proc.pid}/fd")))
            t1 = time.monotonic()
            code_m, body = get(f"http://{metrics}/metrics")
            scrape_ms = (time.monotonic() - t1) * 1000
            code_h, _ = get(f"http://{health}/healthz")
            code_s, st = get(f"http://{health}/status")
            mps_ok = code_s == 200 and all(d.get("healthy") for d in json.loads(st)["mps"]["daemons"])
            ok = proc.poll() is None and code_m == 200 and b"fracplugin_ledger_entries" in body \
                and code_h == 200 and mps_ok
            print(f"{len(socks)} idle connections: metrics {code_m} healthz {code_h} mps healthy {mps_ok} "
                  f"daemon fds {fds_max} scrape {scrape_ms:.1f} ms", flush=True)
            if not ok:
                break
            survived = len(socks)
        rate = len(socks) / max(time.monotonic() - t0, 1e-9)
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    results = {"metrics.idle_connections_survived": survived, "metrics.idle_connections_daemon_fds_max": fds_max,
               "metrics.scrape_with_idle_ms": scrape_ms, "metrics.idle_connections_per_s": rate}
    print(json.dumps(results, indent=2))
    merge(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
