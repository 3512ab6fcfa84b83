#!/usr/bin/env python3
"""Profile the daemon's NRI CreateContainer path at 64 calls queued
(issue 28, "where the time goes"; docs/benchmarks.md, "Profile of the c64
CreateContainer path"): ``bench_nri``'s set-up (the Go runtime harness on
containerd/nri's adaptation v0.12.5, the daemon as ``--role all`` with the
compiled fake MPS client, the 64 time-slicing bench pods, the state dir on
tmpfs) with one concurrency level, 64, and py-spy sampling the daemon for
``--duration`` seconds once the level runs (after the 64 pods' RunPodSandbox
and the 50 warm-up calls, read from the daemon's hook counter on /metrics);
the run is then stopped.

Not a ``bench_*`` script: ``make bench`` does not run it, and it merges no
key into ``build/bench.json``. It writes, under ``--out`` (default
``build/profile-nri``):

- ``c64.raw.txt``: py-spy's ``--format raw`` (collapsed stacks, one line per
  distinct stack with its sample count; ``--threads``: thread first);
- ``c64.speedscope.json`` when ``--speedscope`` is given (a second run);
- ``c64.summary.json``: the window (CreateContainers answered, the daemon's
  user and system CPU seconds, wall seconds) and the split (``summarise``).

By default py-spy samples only the thread holding the GIL (``--gil``): the
interpreter's own CPU. Without it (``--all-threads``) py-spy counts every
thread it thinks active, and on a loaded machine a thread woken but waiting
for a CPU counts (the NRI workers' ``queue.get`` came out at 40 %).
``--native`` adds C frames (protobuf's upb, the interpreter), which is what
carves protobuf out of the Python lines that call it. System time (the
calls made with the GIL released) is not in the samples: the window's
``cpu_system_s`` says how much there is, ``--syscalls`` (``strace -c -f``,
which slows the daemon) which calls. ``--compare CALLS`` runs
``bench_nri``'s own comparison, small (fracplugin against the Go template
giving the same answer, ``--rounds`` pairs). Under ``nice`` or on a loaded
machine the absolute times mean nothing; the split is what to read.

Usage::

    nice -n 19 .venv/bin/python tests/bench/profile_nri.py [--duration S] [--rate HZ] [--native]
    nice -n 19 .venv/bin/python tests/bench/profile_nri.py --syscalls --duration 10
    nice -n 19 .venv/bin/python tests/bench/profile_nri.py --compare 2000 --rounds 2
    .venv/bin/python tests/bench/profile_nri.py --summarise build/profile-nri/c64.raw.txt

Needs Go (the harness, built as the interop tests build it), gcc (the
compiled fake MPS client) and py-spy on PATH or in the venv
(``pip install py-spy``; strace for ``--syscalls``); both need ptrace
rights on the daemon (root, or ``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_nri as bn  # noqa: E402  (Run, bench_pods, wait_ready, iu)

iu = bn.iu

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (category, substrings of "function (file)" frames); the innermost frame that matches any decides
    ("logging/metrics", ("logging/__init__.py", "fracplugin/logs.py", "fracplugin/metrics", "prometheus_client")),
    ("interpreter GC", ("gc_collect",)),
    ("protobuf", ("google/protobuf", "_pb2.py", "_message.abi3.so", "upb_", "_upb")),
    ("ledger journal", ("fracplugin/ledger", "ledgerstore.py", "ledgerindex.py")),
    ("annotations", ("fracplugin/annotations", "annotation_lint.py", "quantity.py")),
    ("planner", ("fracplugin/planner.py", "fracplugin/placement", "fracplugin/allocation.py", "fracplugin/model.py")),
    ("MPS", ("fracplugin/mps/", "nri/nsqueue.py", "nri/namespaces.py", "nri/mpscalls.py", "nri/release.py", "nri/early.py",
             "nri/orphans.py")),
    ("plugin (handler)", ("nri/plugin.py", "nri/admission.py", "nri/reconcile.py", "nri/pluginbase.py",
                          "fracplugin/cdi.py", "fracplugin/enforce/")),
    ("stub/transport/ttrpc", ("nri/stub.py", "nri/serving.py", "nri/dispatch.py", "nri/transport.py",
                              "nri/ttrpc.py", "nri/mux.py", "nri/interfaces.py", "socket.py", "selectors.py")),
)
"""Where a sample's CPU goes: the innermost fracplugin-or-library frame that
names one of these decides (so protobuf called by the planner counts as
protobuf, the planner called by the plugin as planner)."""


def py_spy() -> str:
    """The py-spy executable (PATH, else beside this interpreter). Raises SystemExit."""
    for cand in (shutil.which("py-spy"), str(Path(sys.executable).with_name("py-spy"))):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise SystemExit("profile_nri: py-spy not found (pip install py-spy)")


def categorise(stack: str) -> str:
    """The category of one collapsed stack (frames joined by ``;``,
    outermost first; py-spy's ``function (file:line)``): the innermost frame
    matching ``CATEGORIES``, else "other" (the interpreter, threading)."""
    frames = stack.split(";")
    for frame in reversed(frames):
        for name, needles in CATEGORIES:
            if any(n in frame for n in needles):
                return name
    return "other"


def rpc_of(stack: str) -> str:
    """Which NRI call a stack serves (the handler method on it), or what else it is."""
    for method in ("create_container", "remove_container", "stop_container", "start_container",
                   "synchronize"):
        if f"{method} (" in stack:
            return method
    if "nri/" in stack:
        return "transport (no handler on the stack)"
    return "elsewhere in the daemon"


def summarise(raw: Path) -> dict[str, object]:
    """``{"samples", "by_category": {name: share %}, "by_rpc": {...},
    "create_container_by_category": {...}, "by_thread": {...}, "top_frames":
    [[frame, samples %], ...]}`` from a py-spy raw file."""
    by_cat: collections.Counter[str] = collections.Counter()
    by_rpc: collections.Counter[str] = collections.Counter()
    create_cat: collections.Counter[str] = collections.Counter()
    by_thread: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        thread = stack.split(";", 1)[0]  # "thread (TID): NAME" with --threads
        by_thread[re.sub(r"\d+", "N", thread.partition("): ")[2] or thread)] += n
        cat = categorise(stack)
        by_cat[cat] += n
        rpc = rpc_of(stack)
        by_rpc[rpc] += n
        if rpc == "create_container":
            create_cat[cat] += n
        leaf[stack.rsplit(";", 1)[-1]] += n

    def pct(c: collections.Counter[str], of: int) -> dict[str, float]:
        return {k: round(100 * v / max(1, of), 1) for k, v in c.most_common()}

    return {"samples": total, "by_category": pct(by_cat, total), "by_rpc": pct(by_rpc, total),
            "create_container_by_category": pct(create_cat, sum(create_cat.values())),
            "by_thread": pct(by_thread, total),
            "top_frames": [[f, round(100 * n / max(1, total), 1)] for f, n in leaf.most_common(25)]}


def _nri_hooks(state: Path) -> float:
    """CreateContainers the daemon answered so far (``fracplugin_hook_duration_seconds_count{door="nri"}``
    of its /metrics; address from ``endpoints.json``)."""
    addr = json.loads((state / "endpoints.json").read_text())["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as rsp:
        for line in rsp.read().decode().splitlines():
            if line.startswith("fracplugin_hook_duration_seconds_count{") and 'door="nri"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def record(calls: int, duration: float, rate: int, fmt: str, target: Path, spy_flags: list[str]) -> dict[str, float]:
    """One harness run at c=64 with py-spy recording the daemon for
    ``duration`` seconds, started once the c=64 level runs (the first
    CreateContainers after RunPodSandbox of the 64 pods and the 50 warm-up
    calls are left out); the run is stopped after the recording. Returns the
    window's ``{"creates", "cpu_user_s", "cpu_system_s", "children_cpu_s",
    "wall_s"}`` (the daemon process; children: the fake MPS client runs)."""
    with tempfile.TemporaryDirectory(prefix="fpp", dir=bn.TMPFS) as d:
        work = Path(d)
        args = ["-bench", "-bench-levels", "64", "-bench-calls", str(calls), "-bench-warmup", "50"]
        run = bn.Run(work, args, {"pods": bn.bench_pods()})
        try:
            proc = iu.start_fracplugin(run.procs, work, nri_socket=run.sock, mps_binary=iu.fake_mps_client())
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
            bn.wait_ready(work / "state")
            run.rt.send_line()
            deadline = time.monotonic() + 120
            while _nri_hooks(work / "state") < 50 + 64 and time.monotonic() < deadline:
                time.sleep(0.2)  # the 64 pods' first calls and the warm-up are through: the level runs
            ps = psutil.Process(proc.p.pid)
            c0, h0, t0 = ps.cpu_times(), _nri_hooks(work / "state"), time.monotonic()
            if fmt == "strace":  # system calls by name, all threads (-f), for the window
                argv = ["timeout", "-s", "INT", str(int(duration)), "strace", "-c", "-f", "-o", str(target),
                        "-p", str(proc.p.pid)]
            else:
                argv = [py_spy(), "record", "--pid", str(proc.p.pid), "--rate", str(rate), "--duration",
                        str(int(duration)), "--threads", "--format", fmt, "--output", str(target), *spy_flags]
            spy = subprocess.run(argv, capture_output=True, timeout=duration + 120)
            c1, h1, t1 = ps.cpu_times(), _nri_hooks(work / "state"), time.monotonic()
            if (spy.returncode != 0 and fmt != "strace") or not target.exists():
                raise SystemExit(f"profile_nri: py-spy failed ({spy.returncode}): {spy.stderr.decode(errors='replace')}")
            return {"creates": h1 - h0, "cpu_user_s": round(c1.user - c0.user, 3),
                    "cpu_system_s": round(c1.system - c0.system, 3),
                    "children_cpu_s": round(c1.children_user + c1.children_system
                                            - c0.children_user - c0.children_system, 3),
                    "wall_s": round(t1 - t0, 3)}
        finally:
            run.close()


def compare(calls: int, rounds: int) -> dict[str, object]:
    """``bench_nri``'s own comparison, small: ``rounds`` pairs of runs
    (fracplugin with the compiled fake MPS client, then the Go template
    giving fracplugin's answer), ``calls`` per level (1, 16, 64). Returns
    each run's c=64 ``per_call_ms`` (service time) and ``cpu_ms_per_call``
    (the plugin process over the whole run, removals included, as
    ``bench_nri``), and their ratios per pair."""
    client = iu.fake_mps_client()
    with tempfile.TemporaryDirectory(prefix="fpp", dir=bn.TMPFS) as d0:
        answer = bn.capture_answer(Path(d0), "fracplugin", mps_binary=client)
    same_args = bn.same_answer_args(answer["adjust"])
    pairs = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="fpp", dir=bn.TMPFS) as d1:
            ours = bn.run_bench(Path(d1), "fracplugin", calls, mps_binary=client)[64]
        with tempfile.TemporaryDirectory(prefix="fpp", dir="/tmp") as d2:
            same = bn.run_bench(Path(d2), "template", calls, template_args=same_args)[64]
        pairs.append({"fracplugin": {k: ours[k] for k in ("per_call_ms", "cpu_ms_per_call", "p99_ms")},
                      "go_template_same_answer": {k: same[k] for k in ("per_call_ms", "cpu_ms_per_call", "p99_ms")},
                      "service_ratio": round(ours["per_call_ms"] / same["per_call_ms"], 2),
                      "cpu_ratio": round(ours["cpu_ms_per_call"] / same["cpu_ms_per_call"], 2)})
    return {"calls": calls, "pairs": pairs}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100000,
                    help="CreateContainer calls of the c=64 level (more than the recording needs: it is cut)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds py-spy records")
    ap.add_argument("--rate", type=int, default=100, help="samples per second")
    ap.add_argument("--out", type=Path, default=bn.REPO / "build" / "profile-nri")
    ap.add_argument("--speedscope", action="store_true", help="also record a speedscope file (a second run)")
    ap.add_argument("--all-threads", action="store_true",
                    help="sample every thread py-spy thinks active, not only the one holding the GIL (on a "
                         "loaded machine threads woken but waiting for a CPU count as active)")
    ap.add_argument("--native", action="store_true", help="with C frames (protobuf's upb, the interpreter)")
    ap.add_argument("--compare", type=int, metavar="CALLS", default=0,
                    help="instead of profiling: CALLS per level, fracplugin against the same-answer Go template "
                         "(--rounds pairs); writes c64.compare.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--summarise", type=Path, metavar="RAW", help="only summarise an existing raw file")
    ap.add_argument("--syscalls", action="store_true",
                    help="instead of py-spy: strace -c -f over the window (c64.strace.txt; strace slows the "
                         "daemon, the counts per call are what to read)")
    a = ap.parse_args(argv)
    if a.syscalls:
        iu.build_module("nri-v012")
        a.out.mkdir(parents=True, exist_ok=True)
        window = record(a.calls, a.duration, a.rate, "strace", a.out / "c64.strace.txt", [])
        print(json.dumps(window), (a.out / "c64.strace.txt").read_text(), sep="\n")
        return 0
    if a.summarise:
        print(json.dumps(summarise(a.summarise), indent=1))
        return 0
    if a.compare:
        a.out.mkdir(parents=True, exist_ok=True)
        result = compare(a.compare, a.rounds)
        (a.out / "c64.compare.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        return 0
    iu.build_module("nri-v012")
    a.out.mkdir(parents=True, exist_ok=True)
    raw = a.out / "c64.raw.txt"
    flags = ([] if a.all_threads else ["--gil"]) + (["--native"] if a.native else [])
    window = record(a.calls, a.duration, a.rate, "raw", raw, flags)
    if a.speedscope:
        record(a.calls, a.duration, a.rate, "speedscope", a.out / "c64.speedscope.json", flags)
    summary = {"py_spy_flags": flags, "window": window, **summarise(raw)}
    (a.out / "c64.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
