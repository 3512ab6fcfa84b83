#!/usr/bin/env python3
"""Benchmark: the daemon's memory after 10,000 idle connections to its device plugin gRPC socket (issue 34 item 6).

Starts ``fracplugin run`` on the simulated four-GPU node with every door on (NRI against
``NriRuntimeServer``, the device plugin registered with ``KubeletSim``, MPS with the fake control binary),
as the image runs it (bytecode compiled beforehand, the Dockerfile's ``MALLOC_ARENA_MAX=2``), waits for
``/readyz`` 200 and then, ``BENCH_GRPC_IDLE_WAVES`` times (default 8, the waves of issue 34's report),
opens ``BENCH_GRPC_IDLE_CONNECTIONS`` (default 10,000) unix connections to the device plugin socket
(``<device-plugin-dir>/fracplugin.sock``), each sending the HTTP/2 client preface and an empty SETTINGS
frame (what a gRPC channel sends before its first call) and nothing more, keeps every one open on the
client side until the whole wave is open, then closes them all and waits
until the daemon holds no more descriptors than when it was idle (its server has seen every close).
Memory is VmRSS of the daemon (/proc/<pid>/status), MiB. Merged into build/bench.json:

- ``deviceplugin.idle_10k_rss_mib``: VmRSS after the last wave closed, minus VmRSS of the ready idle
  daemon before the first wave (target <= 10: back within 10 MiB of the idle daemon once they close);
- ``deviceplugin.idle_10k_rss_idle_mib`` / ``.rss_after_mib`` / ``.rss_peak_mib``: the idle daemon's
  VmRSS, VmRSS after the last wave, and the most seen while a wave was open;
- ``deviceplugin.idle_10k_rss_after_wave1_mib``: VmRSS after the first wave closed minus the idle
  VmRSS (the first wave's cost, before later waves reuse what it freed);
- ``deviceplugin.idle_10k_daemon_fds_max``: most descriptors the daemon held meanwhile (the server's
  connection cap, ``grpcopts.MAX_CONNECTIONS``, bounds it);
- ``deviceplugin.idle_10k_closed_before_preface``: connections the daemon closed before the
  client wrote its preface (``sendall`` failed; past the cap), over all waves;
- ``deviceplugin.idle_10k_answers_after``: 1 when a GetDevicePluginOptions call on a new channel
  is answered after the last wave closed (the door still serves), else 0;
- ``deviceplugin.idle_10k_answers_while_open``: the share of waves during which such a call on a new
  channel was answered while the wave's connections were held open (0 expected: the server takes at
  most ``MAX_CONNECTIONS`` connections and closes any further one before its handshake; the idle ones
  are closed after ``MAX_CONNECTION_IDLE_MS``);
- ``deviceplugin.idle_10k_earlier_connection_answers``: the same share for a channel connected before the
  first wave (as kubelet's is): 1 expected, the cap turns away new connections only.

``python tests/bench/bench_grpc_idle.py --no-arena-cap`` runs the same without ``MALLOC_ARENA_MAX``
(glibc's default arenas) and prints the figures without merging them (the comparison in
docs/benchmarks.md). No assertions on the numbers (reported, not tested).
"""

from __future__ import annotations

import compileall
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
sys.path.insert(0, str(REPO))
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
CONNECTIONS = int(os.environ.get("BENCH_GRPC_IDLE_CONNECTIONS", "10000"))
WAVES = int(os.environ.get("BENCH_GRPC_IDLE_WAVES", "8"))
IMAGE_ENV = {"MALLOC_ARENA_MAX": "2"}  # the Dockerfile's ENV that bears on memory
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # RFC 9113 3.4 + SETTINGS

import grpc  # noqa: E402

from fracplugin._proto import deviceplugin_pb2, deviceplugin_pb2_grpc  # noqa: E402
from fracplugin.kubelet import grpcopts  # noqa: E402
from fracplugin_demo.kubelet import KubeletSim  # noqa: E402
from fracplugin_demo.nri_runtime import NriRuntimeServer  # noqa: E402
from benchjson import merge  # noqa: E402
from tests.helpers import kill_leftovers  # noqa: E402


def rss_mib(pid: int) -> float:
    """VmRSS of ``pid``, MiB (/proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def ready(health: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{health}/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except Exception:
        return False


def wait_for(cond, what: str, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``cond`` until true; RuntimeError naming ``what`` after ``timeout`` s (a hung bench, not a figure)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.05)


def open_idle(path: str, n: int, deadline_s: float = 120.0) -> tuple[list[socket.socket], int]:
    """Open ``n`` idle HTTP/2 connections to ``path`` (preface + SETTINGS, then nothing). A connect the
    listen backlog turns away (EAGAIN) is tried again; one the server has already closed when the preface
    is written (past its connection cap) is counted and dropped. Returns (the open sockets, how many the
    server closed before the preface was written). RuntimeError after ``deadline_s`` (a hung daemon)."""
    socks: list[socket.socket] = []
    closed = 0
    deadline = time.monotonic() + deadline_s
    while len(socks) + closed < n:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:  # the backlog is full: the server has not accepted the earlier ones yet
            s.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} accepted {len(socks) + closed} of {n} connections") from None
            time.sleep(0.001)
            continue
        try:
            s.sendall(PREFACE)
        except OSError:
            s.close()
            closed += 1
            continue
        socks.append(s)
    return socks, closed


def answers(channel: grpc.Channel) -> bool:
    """Whether a GetDevicePluginOptions call on ``channel`` is answered within 10 s."""
    try:
        deviceplugin_pb2_grpc.DevicePluginStub(channel).GetDevicePluginOptions(deviceplugin_pb2.Empty(), timeout=10)
        return True
    except grpc.RpcError:
        return False


def door_answers(path: str) -> bool:
    """Whether a call on a new channel to ``path`` is answered (a new connection)."""
    channel = grpcopts.unix_channel(path)
    try:
        return answers(channel)
    finally:
        channel.close()


def run(env_extra: dict[str, str]) -> dict[str, float]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    n = min(CONNECTIONS, (hard if hard != resource.RLIM_INFINITY else CONNECTIONS + 1000) - 200)
    work = Path(tempfile.mkdtemp(prefix="fpgi", dir="/tmp"))
    work.chmod(0o755)  # the MPS root must be traversable (issue 12)
    rt = NriRuntimeServer(str(work / "nri.sock")).start()
    kl = KubeletSim(str(work / "dp")).start()
    proc = None
    try:
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
               "--state-dir", str(work / "state"), "--nri-socket", str(work / "nri.sock"),
               "--device-plugin-dir", str(work / "dp"), "--pod-resources-socket", str(work / "pr.sock"),
               "--mps-root", str(work / "mps"), "--mps-control-binary", str(FAKE_MPS),
               "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0", "--log-level", "warning"]
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        env.update({"PYTHONPATH": str(REPO / "src"), **env_extra})
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        ep = work / "state" / "endpoints.json"
        wait_for(lambda: ep.exists() or proc.poll() is not None, "endpoints.json")
        health = json.loads(ep.read_text())["health"]
        wait_for(lambda: ready(health), "/readyz 200")
        sock = str(work / "dp" / "fracplugin.sock")
        if not door_answers(sock):  # the server's first-call costs belong to the idle figure
            raise RuntimeError(f"the device plugin door at {sock} does not answer")
        samples = [rss_mib(proc.pid)]

        def settled() -> bool:  # start-up's transient work (first probes, first reconcile) is over
            time.sleep(0.5)
            samples.append(rss_mib(proc.pid))
            return abs(samples[-1] - samples[-2]) < 0.1
        wait_for(settled, "the idle daemon's VmRSS to settle")
        idle_fds, idle = fds(proc.pid), samples[-1]
        peak, fds_max, refused, after_wave1, served_open, kept_served = idle, idle_fds, 0, 0.0, 0, 0
        kept = grpcopts.unix_channel(sock)  # a connection made before the waves, as kubelet's is
        if not answers(kept):
            raise RuntimeError(f"the device plugin door at {sock} does not answer")
        idle_fds = fds(proc.pid)
        for w in range(WAVES):
            socks, closed = open_idle(sock, n)
            refused += closed
            peak = max(peak, rss_mib(proc.pid))
            fds_max = max(fds_max, fds(proc.pid))
            served = door_answers(sock)
            served_open += served
            kept_served += answers(kept)
            for s in socks:
                s.close()
            wait_for(lambda: fds(proc.pid) <= idle_fds, "the daemon to see every close")
            after = rss_mib(proc.pid)
            if w == 0:
                after_wave1 = after - idle
            print(f"wave {w + 1}: {len(socks)} open at once ({closed} closed before the preface); a new channel "
                  f"answered meanwhile: {served}, the earlier one: {kept_served == w + 1}; VmRSS {after:.1f} MiB "
                  f"after (idle {idle:.1f}, peak {peak:.1f}), daemon fds max {fds_max}", flush=True)
        answered_after = door_answers(sock)
        kept.close()
        after = rss_mib(proc.pid)
        return {"deviceplugin.idle_10k_rss_mib": after - idle, "deviceplugin.idle_10k_rss_idle_mib": idle,
                "deviceplugin.idle_10k_rss_after_mib": after, "deviceplugin.idle_10k_rss_peak_mib": peak,
                "deviceplugin.idle_10k_rss_after_wave1_mib": after_wave1,
                "deviceplugin.idle_10k_daemon_fds_max": fds_max,
                "deviceplugin.idle_10k_closed_before_preface": refused,
                "deviceplugin.idle_10k_answers_after": 1.0 if answered_after else 0.0,
                "deviceplugin.idle_10k_answers_while_open": served_open / WAVES,
                "deviceplugin.idle_10k_earlier_connection_answers": kept_served / WAVES}
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        rt.close()
        kl.stop()
        kill_leftovers(work)  # the MPS role's control daemons outlive it by design (ADR 0009)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    compileall.compile_dir(str(REPO / "src" / "fracplugin"), quiet=1)  # as the image: bytecode compiled beforehand
    results = run({} if "--no-arena-cap" in argv else IMAGE_ENV)
    print(json.dumps(results, indent=2))
    if "--no-arena-cap" not in argv:
        merge(results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
