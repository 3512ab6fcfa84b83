#!/usr/bin/env python3
"""NRI benchmark (issue 3 item 5): CreateContainer round-trip latency measured
from the Go runtime side, and the daemon's resident memory after 10,000
creations + removals. Merges its keys into build/bench.json (flat JSON object,
read-modify-write).

How it measures:
  * tests/interop/nri-v012/cmd/nri-runtime (containerd/nri pkg/adaptation
    v0.12.5, the code containerd 2.3 embeds) in -bench mode: for each
    concurrency c in 1, 16, 64, c goroutines issue CreateContainer calls
    (1000 per level after 50 unmeasured warm-up calls); the latency of a
    call is the wall time of Adaptation.CreateContainer. The adaptation holds
    one mutex per call, as in containerd, so concurrent calls queue: at c=64
    the p99 is roughly 64 x the per-call service time. The same harness, in
    the same run, measures the Go template plugin (stub-based stand-in for
    containerd/nri's plugins/template, which the Go proxy does not serve).
  * Pods: 64 pods, pod i pinned to GPU i % 4 of examples/nodes/
    gpu-node-1.yaml, container "app", time-slicing, request 1Gi, limit 2Gi
    (16 tenants per GPU at most; within the 48-client MPS limit).
  * RSS: -churn 10000 sequential create+remove pairs; the daemon's RSS is
    read with psutil at every 1000 (after 1000 and after 10000 are kept).
  * State dir (``--state-dir``, the ledger file): on tmpfs (/dev/shm) for the
    headline keys, as production keeps it on tmpfs (/run/fracplugin/state);
    the latency levels are run a second time with the state dir on the disk
    (/tmp) for the ``nri.create.disk_state.*`` keys, which add the ledger's
    two fsyncs per change (``--state {tmpfs,disk,both}``, default both).

Keys: nri.create.c1.p50_ms, nri.create.c1.p99_ms, nri.create.c16.p99_ms,
nri.create.c64.p50_ms, nri.create.c64.p99_ms, nri.create.c64.p99_go_template_ms,
nri.create.c64.p99_ratio_vs_go_template, nri.rss_after_10k_creates_mib, plus
nri.rss_after_1k_creates_mib, nri.create.errors (calls that failed) and
nri.create.c64.service_ms / nri.create.c64.service_go_template_ms (wall time of
the c=64 level divided by its calls: the per-call service time, since the
adaptation serialises calls) and their ratio
nri.create.c64.service_ratio_vs_go_template (issue 14 target <= 1.5);
nri.create.cpu_ms_per_call / nri.create.cpu_ms_per_call_go_template /
nri.create.noop_stub.cpu_ms_per_call (the plugin process's CPU time, user +
system, per measured CreateContainer over the whole run: robust where wall
times are not, on a loaded machine); nri.create.noop_stub.* (fracplugin's stub
answering empty on its reader thread: the floor of the Python transport).
The raw harness output is saved to build/bench-nri-raw.json.

Usage: python tests/bench/bench_nri.py [--calls N] [--churn N] [--state tmpfs|disk|both]
No assertions on the figures: targets are read by people (issue 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "interop"))

import interop_util as iu  # noqa: E402  (helpers shared with the interop tests)

REPORT = REPO / "build" / "bench.json"
RAW = REPO / "build" / "bench-nri-raw.json"
PREFIX = "nvidia.com/container.app."
TMPFS = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
"""Parent of the work dirs (and so of the daemon's --state-dir) for the headline figures."""


def bench_pods(n: int = 64) -> list[dict]:
    gpus = [g["uuid"] for g in iu.load_yaml(iu.NODE_YAML)["gpus"]]
    return [{
        "name": f"bench-{i}", "namespace": "bench", "uid": f"bench-uid-{i:03d}",
        "annotations": {
            PREFIX + "gpu-memory.request": "1Gi", PREFIX + "gpu-memory.limit": "2Gi",
            PREFIX + "gpu-compute.mode": "time-slicing", PREFIX + "gpus.devices": gpus[i % len(gpus)],
        },
        "containers": [{"name": "app"}],
    } for i in range(n)]


def merge_report(values: dict[str, float]) -> None:
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(REPORT.read_text())
        if not isinstance(doc, dict):
            doc = {}
    except (OSError, ValueError):
        doc = {}
    doc.update(values)
    fd, tmp = tempfile.mkstemp(prefix=".bench.", dir=REPORT.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, REPORT)


def wait_ready(state_dir: Path, timeout: float = 60.0) -> None:
    """Wait until the daemon's /readyz answers 200 (address from endpoints.json)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            addr = json.loads((state_dir / "endpoints.json").read_text()).get("health")
            if addr:
                with urllib.request.urlopen(f"http://{addr}/readyz", timeout=2) as rsp:
                    if rsp.status == 200:
                        return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit("bench_nri: the daemon never became ready")


class Run:
    """One harness run with one plugin; processes are stopped by close()."""

    def __init__(self, workdir: Path, args: list[str], scenario: dict) -> None:
        # The daemon refuses an MPS root under a directory others cannot
        # traverse (issue 12); TemporaryDirectory makes 0700 ones.
        workdir.chmod(0o755)
        self.workdir = workdir
        self.procs: list[iu.Proc] = []
        self.sock = workdir / "nri.sock"
        self.rt = iu.start_runtime(self.procs, "v012", workdir, scenario, socket=self.sock,
                                   extra=["-gate", *args], stdin=True)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def fail(msg: str, *procs: iu.Proc) -> None:
    raise SystemExit("bench_nri: " + msg + "".join(p.stderr_tail() for p in procs))


def run_bench(workdir: Path, plugin: str, calls: int) -> dict[int, dict]:
    """One harness run of ``plugin`` (fracplugin, noop or template): the bench
    event of each concurrency level, keyed by concurrency; each also carries
    ``cpu_ms_per_call``, the plugin process's CPU time (user + system,
    children excluded: the fake MPS binary's own runs are not the hook's) from
    the first measured level to the end of the run, over the CreateContainer
    calls measured (the same removals and warm-ups ride along for every
    plugin)."""
    args = ["-bench", "-bench-levels", "1,16,64", "-bench-calls", str(calls), "-bench-warmup", "50"]
    run = Run(workdir, args, {"pods": bench_pods()})
    try:
        if plugin == "fracplugin":
            proc = iu.start_fracplugin(run.procs, workdir, nri_socket=run.sock)
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
            wait_ready(workdir / "state")
        elif plugin == "noop":
            proc = iu.Proc([sys.executable, __file__, "--serve-noop-plugin", str(run.sock)],
                           stderr_path=workdir / "noop.log")
            run.procs.append(proc)
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
        else:
            proc = iu.Proc([str(iu.template_bin("v012")), "-socket", str(run.sock), "-idx", "10"],
                           stderr_path=workdir / "template.log")
            run.procs.append(proc)
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
        ps = psutil.Process(proc.p.pid)
        cpu0 = ps.cpu_times()
        run.rt.send_line()
        events = run.rt.finish(900)
        cpu1 = ps.cpu_times()
        if any(e.get("event") == "fatal" for e in events):
            daemon = proc if plugin != "template" else None
            fail(f"{plugin}: {[e for e in events if e.get('event') == 'fatal']}", run.rt, *(d for d in [daemon] if d))
        levels = {e["concurrency"]: e for e in events if e.get("event") == "bench"}
        cpu_ms = 1000 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / sum(b["calls"] for b in levels.values())
        for b in levels.values():
            b["cpu_ms_per_call"] = round(cpu_ms, 3)
        return levels
    finally:
        run.close()


def serve_noop_plugin(socket_path: str) -> int:
    """The stub floor: fracplugin's NriStub/transport with a handler that
    answers every CreateContainer with an empty adjustment (no planner, no
    ledger). Runs until SIGTERM."""
    import signal
    import threading

    from fracplugin.nri.stub import NriStub

    class Noop:
        """CreateContainer | StopContainer | RemoveContainer (mask 0x608), as
        fracplugin; nothing of it waits, so the stub serves it on its reader
        thread (``may_block``), as it serves fracplugin's CreateContainer."""

        def create_container(self, pod, container, ctx):
            return None

        def stop_container(self, pod, container, ctx):
            return None

        def remove_container(self, pod, container, ctx):
            return None

        def may_block(self, method):
            return False

    stub = NriStub(Noop(), socket_path=socket_path, plugin_name="noop", plugin_idx="50").start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    stub.stop()
    return 0


def run_churn(workdir: Path, n: int) -> tuple[dict[int, float], int]:
    """RSS (MiB) of the daemon after each 1000 create+remove pairs, and the failed creations."""
    run = Run(workdir, ["-churn", str(n), "-checkpoint-every", "1000", "-pause"], {"pods": bench_pods()})
    try:
        daemon = iu.start_fracplugin(run.procs, workdir, nri_socket=run.sock)
        run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
        wait_ready(workdir / "state")
        proc = psutil.Process(daemon.p.pid)
        run.rt.send_line()
        rss: dict[int, float] = {0: proc.memory_info().rss / 2**20}
        for k in range(1, n // 1000 + 1):
            ev = run.rt.wait_event(lambda e: e["event"] in ("checkpoint", "fatal"), timeout=600, nth=k)
            if ev["event"] == "fatal":
                fail(ev["error"], run.rt, daemon)
            rss[ev["done"]] = proc.memory_info().rss / 2**20
            run.rt.send_line()
        events = run.rt.finish(300)
        churn = next(e for e in events if e.get("event") == "churn")
        if churn["errors"]:
            print(f"bench_nri: churn: {churn['errors']} failed creations, first: {churn['first_error']}")
        return rss, int(churn["errors"])
    finally:
        run.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000, help="CreateContainer calls per concurrency level")
    ap.add_argument("--churn", type=int, default=10000, help="create+remove pairs for the RSS figure")
    ap.add_argument("--state", choices=("tmpfs", "disk", "both"), default="both",
                    help="where the daemon's state dir (ledger) lives for the latency runs")
    ap.add_argument("--serve-noop-plugin", metavar="SOCKET", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_noop_plugin:
        return serve_noop_plugin(a.serve_noop_plugin)
    t0 = time.monotonic()
    iu.build_module("nri-v012")
    raw: dict = {}
    ours: dict[int, dict] = {}
    disk: dict[int, dict] = {}
    if a.state in ("tmpfs", "both"):
        with tempfile.TemporaryDirectory(prefix="fpb", dir=TMPFS) as d1:
            ours = run_bench(Path(d1), "fracplugin", a.calls)
    if a.state in ("disk", "both"):
        with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d1:
            disk = run_bench(Path(d1), "fracplugin", a.calls)
    if not ours:  # --state disk: the disk figures are the only ones
        ours = disk
    with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d2:
        tmpl = run_bench(Path(d2), "template", a.calls)
    with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d4:
        noop = run_bench(Path(d4), "noop", a.calls)
    with tempfile.TemporaryDirectory(prefix="fpb", dir=TMPFS if a.state != "disk" else "/tmp") as d3:
        rss, churn_errors = run_churn(Path(d3), a.churn)
    raw = {"fracplugin": ours, "fracplugin_disk_state": disk, "go_template": tmpl, "python_noop_stub": noop,
           "rss_mib": rss,
           "state": a.state}
    RAW.parent.mkdir(parents=True, exist_ok=True)
    RAW.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    errors = sum(b["errors"] for b in ours.values()) + (sum(b["errors"] for b in disk.values()) if disk is not ours else 0)
    values = {
        "nri.create.c1.p50_ms": ours[1]["p50_ms"],
        "nri.create.c1.p99_ms": ours[1]["p99_ms"],
        "nri.create.c16.p99_ms": ours[16]["p99_ms"],
        "nri.create.c64.p50_ms": ours[64]["p50_ms"],
        "nri.create.c64.p99_ms": ours[64]["p99_ms"],
        "nri.create.c64.p99_go_template_ms": tmpl[64]["p99_ms"],
        "nri.create.c64.p99_ratio_vs_go_template": round(ours[64]["p99_ms"] / tmpl[64]["p99_ms"], 2),
        "nri.rss_after_10k_creates_mib": round(rss[max(rss)], 1),
        "nri.rss_after_1k_creates_mib": round(rss.get(1000, rss[0]), 1),
        "nri.create.errors": errors + churn_errors,
        # wall time / calls at c=64: the per-call service time behind the adaptation's mutex
        "nri.create.c64.service_ms": round(ours[64]["per_call_ms"], 3),
        "nri.create.c64.service_go_template_ms": round(tmpl[64]["per_call_ms"], 3),
        # issue 14's headline: per-call service time over the Go template's, same run
        "nri.create.c64.service_ratio_vs_go_template": round(ours[64]["per_call_ms"] / tmpl[64]["per_call_ms"], 2),
    }
    values.update({
        # the plugin process's own CPU per CreateContainer (issue 14's "CPU per call")
        "nri.create.cpu_ms_per_call": ours[64]["cpu_ms_per_call"],
        "nri.create.cpu_ms_per_call_go_template": tmpl[64]["cpu_ms_per_call"],
        "nri.create.noop_stub.cpu_ms_per_call": noop[64]["cpu_ms_per_call"],
        "nri.create.noop_stub.c1.p50_ms": noop[1]["p50_ms"],
        "nri.create.noop_stub.c64.p99_ms": noop[64]["p99_ms"],
        "nri.create.noop_stub.c64.service_ms": round(noop[64]["per_call_ms"], 3),
    })
    if disk:
        values.update({
            "nri.create.disk_state.c1.p50_ms": disk[1]["p50_ms"],
            "nri.create.disk_state.c64.p99_ms": disk[64]["p99_ms"],
            "nri.create.disk_state.c64.service_ms": round(disk[64]["per_call_ms"], 3),
        })
    merge_report(values)
    print(json.dumps(values, indent=1, sort_keys=True))
    print(f"bench_nri: done in {time.monotonic() - t0:.0f}s; raw figures in {RAW.relative_to(REPO)}")
    if errors:
        first = next((b["first_error"] for b in [*ours.values(), *disk.values()] if b["errors"]), "")
        print(f"bench_nri: {errors} CreateContainer calls failed, e.g. {first}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
