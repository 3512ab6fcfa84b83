#!/usr/bin/env python3
"""/metrics scrape cost as the node grows (issue 14). Merges into
build/bench.json (benchjson.merge):

- ``metrics.scrape_p99_ms_16x48`` (target < 50) and ``metrics.scrape_ms_16x48``
  (median), plus the same for 4x48 and 8x48 (the growth table of
  docs/benchmarks.md): N GPUs x 48 MPS clients, one tenancy and one client
  process per client, one MPS server process per GPU.
- ``metrics.over_limit_poll_ms`` (median, target <= 20) and
  ``metrics.over_limit_poll_p99_ms`` at 16x48: one usage poll
  (``Metrics.poll``: the NVML sample attributed to the tenancies, then the
  over-limit watch's comparison, issue 35 item 3) with every 8th client
  above its limit (its episode started at the unmeasured first poll, so no
  Event is queued in the measured ones), 60 polls.

How it measures: ``Metrics.render()`` (the body /metrics serves: every
family collected and rendered to text format 0.0.4) in this process, on a
simulated node of N H100 80 GB GPUs, a real in-memory ``Ledger`` holding the
N x 48 tenancies, and an inventory whose ``processes()`` returns the N x 49
NVML samples. PIDs are joined to containers through a proc tree in a temp
dir laid out as /proc: ``<pid>/cgroup`` (systemd-driver containerd path),
``<pid>/stat`` (with its start time, field 22, as the kernel writes it) and,
for the MPS servers, ``<pid>/exe``. One unmeasured scrape first (it fills the
per-PID cache, as the first scrape after a start does), then 60 measured;
p99 is the 60th of 60 sorted (the worst), median the middle.

Usage: python tests/bench/bench_metrics_scale.py
No assertions on the figures: targets are read by people.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchjson  # noqa: E402

from fracplugin.gpu.inventory import ProcessSample  # noqa: E402
from fracplugin.events import NullEventRecorder  # noqa: E402
from fracplugin.ledger import Ledger  # noqa: E402
from fracplugin.metrics import MIB, Metrics  # noqa: E402
from fracplugin.model import ComputeMode, GpuInfo, NodeInfo, Tenancy  # noqa: E402
from fracplugin.overlimit import OverLimitWatch  # noqa: E402

CLIENTS = 48
SCRAPES = 60


def stat_line(pid: int, comm: str, start: int) -> str:
    """A /proc/<pid>/stat line (52 fields, proc(5)); ``start`` is field 22."""
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 12 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def scenario(root: Path, n_gpus: int) -> Metrics:
    gpus = tuple(GpuInfo(index=i, uuid=f"GPU-00000000-0000-0000-0000-{i:012x}", name="NVIDIA H100 80GB HBM3",
                         memory_mib=81559, minor=i) for i in range(n_gpus))
    node = NodeInfo(name="bench", driver_version="615.71.09", cuda_driver_version=13040, gpus=gpus)
    proc = root / "proc"
    tenancies, samples = [], []
    pid = 1000

    def add_proc(pid: int, cgroup: str, comm: str, exe: str | None = None) -> None:
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "cgroup").write_text(cgroup)
        (d / "stat").write_text(stat_line(pid, comm, 500000 + pid))
        if exe:
            os.symlink(exe, d / "exe")

    for g in gpus:
        mode = ComputeMode.SM_SHARING if g.index % 2 else ComputeMode.TIME_SLICING
        for c in range(CLIENTS):
            pid += 1
            uid = f"{g.index:08x}-0000-4000-8000-{c:012x}"
            cid = f"{g.index:02x}{c:02x}".ljust(64, "0")
            tenancies.append(Tenancy(pod_uid=uid, namespace="bench", pod_name=f"p-{g.index}-{c}", container="c",
                                     gpu_uuid=g.uuid, request_mib=1024, limit_mib=1536, mode=mode, container_id=cid,
                                     active_thread_percentage=2 if mode is ComputeMode.SM_SHARING else None))
            add_proc(pid, f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}"
                          f".slice/cri-containerd-{cid}.scope\n", "python3")
            samples.append(ProcessSample(g.uuid, pid, (2048 if c % 8 == 0 else 700) * MIB, 1.5))
        pid += 1
        add_proc(pid, "0::/system.slice/fracplugin.service\n", "nvidia-cuda-mps", exe="/usr/bin/nvidia-cuda-mps-server")
        samples.append(ProcessSample(g.uuid, pid, 2048 * MIB, 70.0))
    ledger = Ledger(node, max_clients_per_gpu=CLIENTS)
    ledger.replace_all(tenancies)

    class Inv:
        def node(self) -> NodeInfo:
            return node

        def processes(self) -> list[ProcessSample]:
            return list(samples)

    return Metrics(ledger=ledger, inventory=Inv(), node=node, proc_root=str(proc))


def bench(n_gpus: int) -> tuple[float, float]:
    root = Path(tempfile.mkdtemp(prefix="fpm", dir="/tmp"))
    try:
        metrics = scenario(root, n_gpus)
        body = metrics.render()
        n = body.count(b"fracplugin_container_gpu_memory_used_bytes{")
        if n != n_gpus * CLIENTS:
            raise SystemExit(f"bench_metrics_scale: {n} usage series, expected {n_gpus * CLIENTS}")
        times = []
        for _ in range(SCRAPES):
            t0 = time.perf_counter()
            metrics.render()
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_poll(n_gpus: int) -> tuple[float, float]:
    """Median and worst of ``Metrics.poll`` with the over-limit watch (module docstring)."""
    root = Path(tempfile.mkdtemp(prefix="fpm", dir="/tmp"))
    try:
        metrics = scenario(root, n_gpus)
        metrics.watch = watch = OverLimitWatch("report", NullEventRecorder())
        logging.getLogger("fracplugin.overlimit").setLevel(logging.ERROR)  # one warning per episode started
        metrics.poll()
        if len(watch.over()) != n_gpus * CLIENTS // 8:
            raise SystemExit(f"bench_metrics_scale: {len(watch.over())} over limit, expected {n_gpus * CLIENTS // 8}")
        times = []
        for _ in range(SCRAPES):
            t0 = time.perf_counter()
            metrics.poll()
            times.append((time.perf_counter() - t0) * 1000)
        if watch.episodes != n_gpus * CLIENTS // 8:
            raise SystemExit(f"bench_metrics_scale: {watch.episodes} episodes, expected one per container over")
        times.sort()
        return statistics.median(times), times[-1]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    values: dict[str, float] = {}
    for n in (4, 8, 16):
        med, p99 = bench(n)
        values[f"metrics.scrape_ms_{n}x{CLIENTS}"] = med
        values[f"metrics.scrape_p99_ms_{n}x{CLIENTS}"] = p99
    values["metrics.over_limit_poll_ms"], values["metrics.over_limit_poll_p99_ms"] = bench_poll(16)
    benchjson.merge(values)
    print(json.dumps({k: round(v, 3) for k, v in values.items()}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
