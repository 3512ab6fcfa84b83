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
- ``mps.recover_after_fault_ms``: median over 3 runs of: a time-slicing daemon
  that cannot start (fault ``fail_start``) has been retried until it is
  reported ``failed``; the fault is cleared -> the supervisor reports it
  healthy (retry forever at a capped backoff, here ``backoff_max_s`` = 1 s:
  the figure is bounded by that cap plus one start; issue 12);
- ``mps.doors_restart_clients_kept``: 1 when, with ``fracplugin run --role mps``
  and ``--role doors`` running as two processes in their own sessions and an
  MPS client registered, SIGKILL of the doors role and its restart leave the
  control daemons' and servers' PIDs unchanged and the client still listed;
  else 0 (issue 12);
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
    os.chmod(root, 0o755)
    sup = MpsSupervisor(MpsLayout(os.path.join(root, "mps")), FAKE_MPS, None, "615.71.09", {SM},
                        probe_interval_s=5.0, probe_timeout_s=2.0, max_restarts=0, stable_uptime_s=0.5,
                        env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    recover: list[float] = []
    probes: list[float] = []
    try:
        sup.start()
        deadline = time.monotonic() + 30
        while not sup.ready():
            if time.monotonic() >= deadline:
                raise RuntimeError(f"supervisor not ready: {sup.status()}")
            time.sleep(0.02)
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
        control = sup.daemons[SM].control  # the same client the probe uses
        for _ in range(20):
            probes.append(control.probe(2.0) * 1000)
    finally:
        sup.stop(timeout_s=5)
        shutil.rmtree(root, ignore_errors=True)
    return {"mps.recover_after_crash_ms": statistics.median(recover),
            "mps.probe_ms": statistics.median(probes)}


def bench_recover_after_fault(runs: int = 3) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="fpb", dir="/tmp")
    os.chmod(root, 0o755)
    layout = MpsLayout(os.path.join(root, "mps"))
    ts = ComputeMode.TIME_SLICING
    fault = os.path.join(layout.pipe_dir(ts), "fake-control.json")
    os.makedirs(layout.pipe_dir(ts))
    out: list[float] = []
    try:
        for _ in range(runs):
            with open(fault, "w") as f:
                json.dump({"fail_start": True}, f)
            sup = MpsSupervisor(layout, FAKE_MPS, None, "615.71.09", {ts}, probe_interval_s=0.5, max_restarts=2,
                                backoff_base_s=0.05, backoff_max_s=1.0,
                                env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
            try:
                sup.start()
                deadline = time.monotonic() + 60
                while sup.status()["daemons"][0]["state"] != "failed":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"never reported failed: {sup.status()}")
                    time.sleep(0.01)
                os.unlink(fault)
                t0 = time.perf_counter()
                while not sup.healthy(ts):
                    if time.perf_counter() - t0 > 60:
                        raise RuntimeError(f"no recovery: {sup.status()}")
                    time.sleep(0.001)
                out.append((time.perf_counter() - t0) * 1000)
            finally:
                sup.stop(timeout_s=5)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"mps.recover_after_fault_ms": statistics.median(out)}


def bench_doors_restart() -> dict[str, float]:
    import subprocess

    sys.path.insert(0, str(REPO))
    from tests.component.test_mps_roles import FAKE, FAST_PATH, Role, mps_pids  # noqa: PLC0415

    root = Path(tempfile.mkdtemp(prefix="fpb", dir="/tmp"))
    root.chmod(0o755)
    (root / "bin").mkdir()
    shutil.copy(shutil.which("sleep"), root / "bin" / "nvidia-cuda-mps-server")
    roles: list[Role] = []
    client = subprocess.Popen(["sleep", "600"])
    kept = 0.0
    try:
        mps = Role(root, "mps", env={"FAKE_MPS_SERVER_BIN": str(root / "bin" / "nvidia-cuda-mps-server")}).start()
        roles.append(mps)
        doors = Role(root, "doors", "--no-nri", "--no-device-plugin").start()
        roles.append(doors)
        deadline = time.monotonic() + 60
        while not (mps.ready() and doors.ready()):
            if time.monotonic() > deadline:
                raise RuntimeError("roles not ready:\n" + mps.logs() + doors.logs())
            time.sleep(0.05)
        env = {**os.environ, "PATH": FAST_PATH, "CUDA_MPS_PIPE_DIRECTORY": str(root / "mps" / "ts")}
        subprocess.run([FAKE, "fake-client", "add", str(client.pid), "--server=shared"], env=env, check=True,
                       capture_output=True, timeout=20)
        before = mps_pids(root)
        doors.stop(signal.SIGKILL)
        doors = Role(root, "doors", "--no-nri", "--no-device-plugin").start()
        roles.append(doors)
        while not doors.ready():
            if time.monotonic() > deadline:
                raise RuntimeError("doors not ready again:\n" + doors.logs())
            time.sleep(0.05)
        listed = subprocess.run([FAKE, "client", "list", "--format=csv,noheader"], env=env, capture_output=True,
                                text=True, timeout=20).stdout
        kept = 1.0 if mps_pids(root) == before and str(client.pid) in listed else 0.0
        doors.stop()
        subprocess.run([sys.executable, "-m", "fracplugin.cli", "mps-quit", "--mps-root", str(root / "mps")],
                       capture_output=True, timeout=60, env={**os.environ, "PATH": FAST_PATH})
        mps.stop()
    finally:
        for r in roles:
            if r.proc is not None and r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
        client.kill()
        client.wait()
        shutil.rmtree(root, ignore_errors=True)
    return {"mps.doors_restart_clients_kept": kept}


def bench_scrape(n_gpus: int = 8, clients: int = 48, scrapes: int = 50) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="fpb", dir="/tmp")
    os.chmod(root, 0o755)
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
    results.update(bench_recover_after_fault())
    results.update(bench_doors_restart())
    merge(results)
    print(json.dumps({k: round(v, 3) for k, v in results.items()}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
