#!/usr/bin/env python3
"""Benchmark (issue 28): the whole node's memory, a burst of new pods through
the split layout, and the MPS role's CPU per control command.

Merges into build/bench.json (flat JSON object, read-modify-write under an
exclusive ``flock``, other keys kept):

- ``node.rss_mib_split``: VmRSS summed over every process of a ready split
  node: the ``--role doors`` process (NRI door + device plugin door on
  grpcio, against ``KubeletSim``) and every process of the ``--role mps``
  role (the role process and its descendants), MiB. The MPS control daemons
  are not fracplugin's (here Python fakes standing in for NVIDIA's binary):
  they are left out and reported as ``node.rss_mib_fake_mps_daemons``. Pages shared between processes
  (libraries, the interpreter) count once per process, as VmRSS does;
  ``node.pss_mib_split`` is the same sum of PSS (shared pages divided among
  their users), the figure that adds up;
- ``node.rss_mib_single`` / ``node.pss_mib_single``: the same for one ready
  ``--role all`` process and its descendants, MiB;
- ``nri.burst64.start_wait_p50_ms`` (and ``_p99_ms``, ``_max_ms``): a burst of
  64 new sm-sharing pods against the split node: 64 threads, one per pod, each
  sends RunPodSandbox (delivered only when the plugin subscribed it, as
  containerd does), waits ``--pull-ms`` (the image pull between the sandbox and
  the container; 0 by default: a cached image, the least time for early work),
  then calls CreateContainer then StartContainer, every call under one lock (as
  containerd holds its NRI lock per call); a StartContainer's wait is its own
  round trip (how long that call held the lock), ms; ``_sum_ms``: all of
  them added (the time starts held the lock), ``_over_5ms``: how many waited
  longer than 5 ms; ``nri.burst64.pull_ms`` says which pull time the figures
  are for;
- ``nri.burst64.refused``: StartContainers answered with an error (ADR 0028:
  none while MPS is merely slow);
- ``nri.burst64.ready_ratio``: time from the first CreateContainer to the last
  pod's StartContainer answer / (MPS control commands the burst caused x the
  measured wall time of one command + 64 x the median CreateContainer round
  trip); 1.0 = the pods were ready as soon as the MPS work and the hooks
  alone allow, run back to back (below 1.0 when MPS work done during the
  pull, after RunPodSandbox, no longer stands between create and start);
- ``nri.burst64.mps_commands``, ``mps.command_wall_ms`` (median wall time of
  one ``server list`` through the client binary, measured after the burst);
- ``mps.cpu_ms_per_command``: CPU (user + system) of every fracplugin process
  of the MPS role during the burst (the role process and its descendants,
  with the client commands they reaped) / the control commands the daemons
  answered (probes included), ms; ``mps.fake_daemon_cpu_ms_per_command``: the
  fake control daemons' own (a Python script here, not NVIDIA's binary).

MPS: the compiled fake client (``tests/fakes/mps_client.c``, ~the real
binary's cost per command); the daemons are the Python fake.

``--quick`` (or env ``BENCH_NODE_QUICK=1``): a burst of 8 pods and one layout
of each kind, to check that the script runs; the keys then carry the burst
size it really ran (``nri.burst8.*``), so a quick figure never stands for the
64-pod one. No assertions on the numbers (speed is reported, not tested).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
IMAGE_ENV = {"MALLOC_ARENA_MAX": "2"}  # the Dockerfile's ENV that bears on memory
FAST_PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
P = "nvidia.com/container."

from fracplugin.model import ComputeMode  # noqa: E402
from fracplugin.mps.layout import MpsLayout  # noqa: E402
from fracplugin_demo.kubelet import KubeletSim  # noqa: E402
from fracplugin_demo.nri_runtime import NriRuntimeServer  # noqa: E402
from benchjson import merge  # noqa: E402
from tests.fakes.mps_client import build_mps_client  # noqa: E402
from tests.helpers import kill_leftovers  # noqa: E402
from tests.peers.nri_runtime import FakeNriRuntime, RpcError, make_container, make_pod  # noqa: E402


def _ready(health: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{health}/readyz", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def _find(root: Path, name: str) -> list[Path]:
    return [Path(d) / name for d, _, files in os.walk(root) if name in files]


def _control_daemons(mps_root: Path) -> list[psutil.Process]:
    out = []
    for pidfile in _find(mps_root, "nvidia-cuda-mps-control.pid"):
        try:
            out.append(psutil.Process(int(pidfile.read_text().split()[0])))
        except (OSError, ValueError, IndexError, psutil.Error):
            continue
    return out


def _mps_commands(root: Path) -> int:
    """Control commands the fake daemons under ``root`` answered (their
    control.log lines other than their own start and exit)."""
    n = 0
    for log in _find(root, "control.log"):
        try:
            n += sum(1 for line in log.read_text(errors="replace").splitlines()
                     if "control daemon (fake)" not in line)
        except OSError:
            continue
    return n


def _tree(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and all their descendants, each once."""
    seen: dict[int, psutil.Process] = {}
    for p in procs:
        try:
            for q in [p, *p.children(recursive=True)]:
                seen.setdefault(q.pid, q)
        except psutil.Error:
            continue
    return list(seen.values())


def _memory_mib(procs: list[psutil.Process]) -> tuple[float, float]:
    """(sum of VmRSS, sum of PSS) of ``procs``, MiB."""
    rss = pss = 0.0
    for p in procs:
        try:
            full = p.memory_full_info()
        except psutil.Error:
            continue
        rss += full.rss
        pss += getattr(full, "pss", full.rss)
    return rss / 2**20, pss / 2**20


def _cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs``, their reaped children included."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class Node:
    """One node layout (``split``: ``--role mps`` + ``--role doors``; else
    ``--role all``) in a work dir, with ``KubeletSim`` and an NRI runtime."""

    def __init__(self, split: bool, client: Path, burst_runtime: bool) -> None:
        self.split = split
        self.client = client
        self.work = Path(tempfile.mkdtemp(prefix="fpn", dir="/tmp"))
        self.work.chmod(0o755)  # the daemon refuses an MPS root others cannot traverse (issue 12)
        self.mps_root = self.work / "mps"
        self.sock = self.work / "nri.sock"
        self.kubelet = KubeletSim(str(self.work / "dp")).start()
        self.rt: Any = (FakeNriRuntime(str(self.sock), initial_sync=([], [])) if burst_runtime
                        else NriRuntimeServer(str(self.sock)).start())
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _start(self, role: str, *args: str) -> None:
        state = self.work / f"{role}-state"
        endpoints = state / ("endpoints-mps.json" if role == "mps" else "endpoints.json")
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--role", role, "--simulate-node", str(NODE),
               "--state-dir", str(state), "--mps-root", str(self.mps_root),
               "--mps-control-binary", str(self.client), "--health-address", "127.0.0.1:0",
               "--metrics-address", "127.0.0.1:0", "--log-level", "warning", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PATH": FAST_PATH, **IMAGE_ENV}
        log = open(self.work / f"{role}.log", "ab")
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        log.close()
        t0 = time.monotonic()
        while not endpoints.exists():
            if self.procs[role].poll() is not None or time.monotonic() - t0 > 90:
                raise RuntimeError(f"{role} role did not start:\n" + self.logs(role))
            time.sleep(0.02)
        health = json.loads(endpoints.read_text())["health"]
        while not _ready(health):
            if self.procs[role].poll() is not None or time.monotonic() - t0 > 90:
                raise RuntimeError(f"{role} role not ready within 90 s:\n" + self.logs(role))
            time.sleep(0.02)

    def logs(self, role: str) -> str:
        p = self.work / f"{role}.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def start(self) -> "Node":
        doors = ("--nri-socket", str(self.sock), "--device-plugin-dir", str(self.work / "dp"),
                 "--pod-resources-socket", str(self.work / "pr.sock"))
        if self.split:
            self._start("mps")
            self._start("doors", *doors)
        else:
            self._start("all", *doors)
        return self

    def fake_daemons(self) -> list[psutil.Process]:
        """The fake MPS control daemons (Python scripts standing in for
        NVIDIA's ``nvidia-cuda-mps-control``) and their children."""
        return _tree(_control_daemons(self.mps_root))

    def _ours(self, roles: list[str]) -> list[psutil.Process]:
        """The processes of ``roles`` and their descendants, without the fake
        MPS control daemons (not fracplugin's code; ``fake_daemons``)."""
        fake = {p.pid for p in self.fake_daemons()}
        return [p for p in _tree([psutil.Process(self.procs[r].pid) for r in roles]) if p.pid not in fake]

    def mps_processes(self) -> list[psutil.Process]:
        """Every fracplugin process of the MPS role (split) or the whole
        daemon (``--role all``, which is also the doors)."""
        return self._ours(["mps" if self.split else "all"])

    def all_processes(self) -> list[psutil.Process]:
        """Every fracplugin process of the node (both roles when split)."""
        return self._ours(list(self.procs))

    def close(self) -> None:
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(30)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
                    p.wait(10)
        try:
            self.rt.close()
        finally:
            self.kubelet.stop()
            kill_leftovers(self.work)  # the MPS role's control daemons outlive it by design (ADR 0009)
            shutil.rmtree(self.work, ignore_errors=True)


def command_wall_ms(node: Node, n: int = 20) -> float:
    """Median wall time of one control command (``server list``) through the
    client binary against the sm-sharing daemon, ms. The pipe directory is
    the layout's (``MpsLayout.pipe_dir``: ``<root>/sm``). Raises
    RuntimeError when a command fails: a failed command ("Cannot find MPS
    control daemon process") costs a fraction of a real one, so its time
    must never stand for one."""
    pipe = MpsLayout(str(node.mps_root)).pipe_dir(ComputeMode.SM_SHARING)
    env = {**os.environ, "PATH": FAST_PATH, "CUDA_MPS_PIPE_DIRECTORY": pipe}
    env.pop("CUDA_MPS_PROTOCOL_VERSION", None)
    walls = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc = subprocess.run([str(node.client), "server", "list", "--format=csv,noheader"], capture_output=True,
                              env=env, timeout=20, check=False)
        walls.append((time.perf_counter() - t0) * 1000)
        if proc.returncode != 0:
            raise RuntimeError(f"server list against {pipe} failed (exit {proc.returncode}): "
                               f"{(proc.stdout + proc.stderr).decode(errors='replace').strip()}")
    return statistics.median(walls)


def burst(node: Node, pods: int, pull_ms: float = 0.0) -> dict[str, float]:
    """``pods`` new sm-sharing pods at once against ``node``, ``pull_ms``
    between each pod's RunPodSandbox and its CreateContainer (see the module
    docstring). Returns the ``nri.burst<N>.*`` and ``mps.*`` figures."""
    rt = node.rt
    rt.wait_registered(60)
    lock = threading.Lock()  # containerd's NRI lock: one plugin call at a time
    creates: list[float] = []
    starts: list[float] = []
    refused: list[str] = []
    ends: list[float] = []
    first: list[float] = []  # when each CreateContainer was sent
    mps, fake = node.mps_processes(), node.fake_daemons()
    cpu0, fake0, cmds0 = _cpu_s(mps), _cpu_s(fake), _mps_commands(node.work)
    go = threading.Event()

    def one(i: int) -> None:
        pod = make_pod(f"burst-{i}", uid=f"burst-uid-{i:03d}", pod_id=f"burst-sandbox-{i}", annotations={
            P + "app.gpu-memory.request": "1Gi", P + "app.gpu-memory.limit": "2Gi",
            P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": "0.25"})
        ctr = make_container(pod, "app", container_id=f"burst-ctr-{i}")
        go.wait()
        with lock:
            if rt.run_pod_sandbox(pod) is not None:
                refused.append("run_pod_sandbox")
        if pull_ms > 0:
            time.sleep(pull_ms / 1000)  # the image pull (a bench, not a test: a modelled delay)
        with lock:
            t0 = time.perf_counter()
            first.append(t0)
            out = rt.create_container(pod, ctr)
            creates.append((time.perf_counter() - t0) * 1000)
        if isinstance(out, RpcError):
            refused.append(f"create: {out}")
            return
        with lock:
            t0 = time.perf_counter()
            err = rt.start_container(pod, ctr)
            t1 = time.perf_counter()
        starts.append((t1 - t0) * 1000)
        ends.append(t1)
        if err is not None:
            refused.append(f"start: {err}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(pods)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(600)
    # the background MPS work the burst queued (namespaces still being made after their starts) ends here
    deadline = time.monotonic() + 120
    last = -1
    while time.monotonic() < deadline:
        now = _mps_commands(node.work)
        if now == last:
            break
        last = now
        time.sleep(1.0)
    cpu1, cmds1 = _cpu_s(_tree(node.mps_processes() + mps)), _mps_commands(node.work)  # each process once
    fake1 = _cpu_s(_tree(node.fake_daemons() + fake))
    cmds = max(1, cmds1 - cmds0)
    wall_cmd = command_wall_ms(node)
    ideal_ms = cmds * wall_cmd + pods * statistics.median(creates)
    ready_ms = ((max(ends) - min(first)) * 1000) if ends else float("nan")
    key = f"nri.burst{pods}"
    starts.sort()
    return {
        f"{key}.start_wait_p50_ms": statistics.median(starts),
        f"{key}.start_wait_p99_ms": starts[min(len(starts) - 1, int(0.99 * len(starts)))],
        f"{key}.start_wait_max_ms": starts[-1],
        f"{key}.start_wait_sum_ms": sum(starts),
        f"{key}.start_wait_over_5ms": float(sum(1 for s in starts if s > 5.0)),
        f"{key}.refused": float(len(refused)),
        f"{key}.ready_ratio": round(ready_ms / ideal_ms, 2),
        f"{key}.mps_commands": float(cmds1 - cmds0),
        f"{key}.pull_ms": float(pull_ms),
        "mps.command_wall_ms": wall_cmd,
        "mps.cpu_ms_per_command": 1000 * (cpu1 - cpu0) / cmds,
        "mps.fake_daemon_cpu_ms_per_command": 1000 * (fake1 - fake0) / cmds,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_NODE_QUICK") == "1",
                    help="a burst of 8 pods, to check that the script runs (keys nri.burst8.*)")
    ap.add_argument("--pods", type=int, default=None, help="pods in the burst (default 64; 8 with --quick)")
    ap.add_argument("--pull-ms", type=float, default=0.0,
                    help="ms between a pod's RunPodSandbox and its CreateContainer (the image pull; default 0)")
    ap.add_argument("--burst-only", action="store_true",
                    help="only the split node's burst (no --role all node, no memory keys)")
    a = ap.parse_args(argv)
    pods = a.pods or (8 if a.quick else 64)
    compileall.compile_dir(str(REPO / "src" / "fracplugin"), quiet=1)  # as the image: bytecode compiled beforehand
    client = build_mps_client()
    results: dict[str, float] = {}
    node = Node(split=True, client=client, burst_runtime=True).start()
    try:
        results["node.rss_mib_split"], results["node.pss_mib_split"] = _memory_mib(node.all_processes())
        results["node.rss_mib_fake_mps_daemons"] = _memory_mib(node.fake_daemons())[0]
        results.update(burst(node, pods, a.pull_ms))
    finally:
        node.close()
    if a.burst_only:
        merge(results)
        for k, v in sorted(results.items()):
            print(f"{k} = {v:.3f}")
        return 0
    node = Node(split=False, client=client, burst_runtime=False).start()
    try:
        results["node.rss_mib_single"], results["node.pss_mib_single"] = _memory_mib(node.all_processes())
    finally:
        node.close()
    merge(results)
    for k, v in sorted(results.items()):
        print(f"{k} = {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
