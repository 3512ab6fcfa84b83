#!/usr/bin/env python3
"""Benchmark: MPS supervisor recovery and probe, metrics scrape cost.

Merges into build/bench.json (flat JSON object, read-modify-write under an
exclusive flock, other keys kept):

- ``mps.recover_after_crash_ms``: median over ``REPEAT`` runs of: SIGKILL of
  the (fake) sm-sharing control daemon -> the supervisor reports it healthy
  again with a new PID and its recorded (capped) namespace re-created (target
  < 2000). Each crash follows a stable period (the restart budget has reset),
  so it measures the immediate first retry, not the backoff of a crash loop;
- ``mps.probe_ms``: median duration of one active probe (v3 ``server list
  --format=csv,noheader`` through the fake binary: a Python process start + a
  socket round trip; the fake runs on this interpreter, put first on PATH),
  over 20 probes;
- ``metrics.scrape_ms`` / ``metrics.scrape_p99_ms``: one ``/metrics`` render on a
  simulated node of 8 GPUs x 48 clients (384 tenancies, 384 client processes
  joined through cgroup files, plus one MPS server PID per GPU), median and
  p99 over 50 scrapes (target < 50).

No assertions on the numbers (speed is reported, not tested).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
FAKE_MPS = str(REPO / "tests" / "fakes" / "nvidia-cuda-mps-control")
REPORT = REPO / "build" / "bench.json"
REPEAT = int(os.environ.get("BENCH_MPS_REPEAT", "5"))

from fracplugin.gpu.inventory import ProcessSample  # noqa: E402
from fracplugin.ledger import Ledger  # noqa: E402
from fracplugin.metrics import MIB, Metrics  # noqa: E402
from fracplugin.model import ComputeMode, GpuInfo, NodeInfo, Tenancy  # noqa: E402
from fracplugin.mps.layout import MpsLayout  # noqa: E402
from fracplugin.mps.supervisor import MpsSupervisor  # noqa: E402
from benchjson import merge  # noqa: E402

SM = ComputeMode.SM_SHARING




def _pid(sup: MpsSupervisor) -> int | None:
    return next(d["pid"] for d in sup.status()["daemons"] if d["mode"] == SM.value)


def bench_mps() -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="fpb", dir="/tmp")
    sup = MpsSupervisor(MpsLayout(os.path.join(root, "mps")), FAKE_MPS, None, "615.71.09", {SM},
                        probe_interval_s=5.0, probe_timeout_s=2.0, max_restarts=0, stable_uptime_s=0.5,
                        env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    recover: list[float] = []
    probes: list[float] = []
    try:
        sup.start()
        if not sup.wait_ready(30):
            raise RuntimeError(f"supervisor not ready: {sup.status()}")
        ns_dir = sup.ensure_namespace("bench-pod", "bench", 50, timeout_s=10)
        for _ in range(REPEAT):
            old = _pid(sup)
            assert old is not None
            t0 = time.perf_counter()
            os.kill(old, signal.SIGKILL)
            while True:
                pid = _pid(sup)
                if pid not in (None, old) and sup.healthy(SM) and os.path.exists(os.path.join(ns_dir, "control")):
                    break
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError(f"no recovery: {sup.status()}")
                time.sleep(0.001)
            recover.append((time.perf_counter() - t0) * 1000)
            # let the restart budget reset (stable_uptime_s) so every sample is a
            # first crash (immediate retry), not a crash loop under backoff
            while next(d["restart_budget_used"] for d in sup.status()["daemons"]):
                time.sleep(0.05)
        control = sup._daemons[SM].control  # the same client the probe uses
        for _ in range(20):
            probes.append(control.probe(2.0) * 1000)
    finally:
        sup.stop(timeout_s=5)
        shutil.rmtree(root, ignore_errors=True)
    return {"mps.recover_after_crash_ms": statistics.median(recover),
            "mps.probe_ms": statistics.median(probes)}


def bench_scrape(n_gpus: int = 8, clients: int = 48, scrapes: int = 50) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="fpb", dir="/tmp")
    try:
        gpus = tuple(GpuInfo(index=i, uuid=f"GPU-00000000-0000-0000-0000-{i:012x}", name="NVIDIA H100 80GB HBM3",
                             memory_mib=81559, minor=i) for i in range(n_gpus))
        node = NodeInfo(name="bench", driver_version="615.71.09", cuda_driver_version=13040, gpus=gpus)
        proc = Path(root) / "proc"
        tenancies = []
        samples = []
        pid = 1000
        for g in gpus:
            mode = SM if g.index % 2 else ComputeMode.TIME_SLICING
            for c in range(clients):
                pid += 1
                uid = f"{g.index:08x}-0000-4000-8000-{c:012x}"
                cid = f"{g.index:02x}{c:02x}".ljust(64, "0")
                tenancies.append(Tenancy(pod_uid=uid, namespace="bench", pod_name=f"p-{g.index}-{c}", container="c",
                                         gpu_uuid=g.uuid, request_mib=1024, limit_mib=1536, mode=mode,
                                         container_id=cid, active_thread_percentage=2 if mode is SM else None))
                d = proc / str(pid)
                d.mkdir(parents=True)
                (d / "cgroup").write_text(
                    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
                    f"cri-containerd-{cid}.scope\n")
                samples.append(ProcessSample(g.uuid, pid, 700 * MIB, 1.5))
            pid += 1
            d = proc / str(pid)
            d.mkdir(parents=True)
            (d / "cgroup").write_text("0::/system.slice/fracplugin.service\n")
            os.symlink("/usr/bin/nvidia-cuda-mps-server", d / "exe")
            samples.append(ProcessSample(g.uuid, pid, 2048 * MIB, 70.0))
        ledger = Ledger(node)
        ledger.replace_all(tenancies)

        class Inv:
            def node(self) -> NodeInfo:
                return node

            def processes(self) -> list[ProcessSample]:
                return list(samples)

        metrics = Metrics(ledger=ledger, inventory=Inv(), node=node, proc_root=str(proc))
        body = metrics.render()
        assert body.count(b"fracplugin_container_gpu_memory_used_bytes{") == n_gpus * clients
        times = []
        for _ in range(scrapes):
            t0 = time.perf_counter()
            metrics.render()
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        return {"metrics.scrape_ms": statistics.median(times),
                "metrics.scrape_p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    results = {}
    results.update(bench_scrape())
    results.update(bench_mps())
    merge(results)
    print(json.dumps({k: round(v, 3) for k, v in results.items()}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
