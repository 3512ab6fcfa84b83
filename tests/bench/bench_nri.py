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
  * MPS: the daemon runs the compiled fake MPS client (tests/fakes/
    mps_client.c, built into build/fake-mps/ on first use): a control
    command costs about what the real binary's does (~1 ms of CPU) instead of
    a Python start (25-100 ms); the daemon side stays the Python fake. The
    run with the Python fake client is kept beside it (``*_python_fake_mps``
    keys): there the namespace commands are so slow that most of them never
    run (an ensure still pending when its containers go is replaced by the
    release, nsqueue.py), so it does less MPS work than a node with the real
    binary would (``nri.create.mps_commands*``).
  * Go template, two runs: the empty answer (the stock template's, the
    issue-14 headline ratio) and the same answer as fracplugin's for the
    bench pods (``*_same_answer``: fracplugin's answer for bench pod 0 is
    captured first and given back by the template with ``-env``/``-mount``,
    checked equal in bytes), so containerd's side merges as much for both.
  * RSS: -churn 10000 sequential create+remove pairs; the daemon's RSS is
    read with psutil at every 1000 (after 1000 and after 10000 are kept).
  * State dir (``--state-dir``, the ledger file): on tmpfs (/dev/shm) for the
    headline keys, as production keeps it on tmpfs (/run/fracplugin/state);
    the latency levels are run a second time with the state dir on the disk
    (/tmp) for the ``nri.create.disk_state.*`` keys, which add the ledger's
    two fsyncs per change (``--state {tmpfs,disk,both}``, default both).
  * Order in one invocation: answer capture (fracplugin, template), fracplugin
    (compiled client, tmpfs), template (empty), template (same answer),
    fracplugin (Python fake client), fracplugin (disk state), no-op stub,
    churn. Ratios are taken within one invocation.

Keys (ms unless named otherwise; c = calls queued at once):
  StartContainer's CUDA memory limits (issue 23, ``bench_memory_limits``;
  ``--only-memory-limits`` runs just this part):
    nri.start.memory_limits.p50_ms, nri.start.memory_limits.p99_ms (apply),
    nri.start.memory_limits.verify.p50_ms, nri.start.memory_limits.verify.p99_ms.
  fracplugin, compiled fake MPS client:
    nri.create.c1.p50_ms, nri.create.c1.p99_ms, nri.create.c16.p99_ms,
    nri.create.c64.p50_ms, nri.create.c64.p99_ms;
    nri.create.c64.service_ms (wall time of the c=64 level / its calls: the
    per-call service time, since the adaptation serialises calls);
    nri.create.cpu_ms_per_call (the plugin process's CPU, user + system, per
    measured CreateContainer over the whole run, children excluded);
    nri.create.fake_mps_cpu_ms_per_call (fake MPS client runs + fake MPS
    daemon), nri.create.harness_cpu_ms_per_call (the Go harness),
    nri.create.mps_commands (fake MPS control commands in the run);
    nri.create.errors (failed calls, all fracplugin runs and the churn);
    nri.rss_after_10k_creates_mib, nri.rss_after_1k_creates_mib.
  Go template, empty answer (issue 14's headline comparison):
    nri.create.c64.p99_go_template_ms, nri.create.c64.service_go_template_ms,
    nri.create.cpu_ms_per_call_go_template,
    nri.create.harness_cpu_ms_per_call_go_template;
    nri.create.c64.service_ratio_vs_go_template (issue 14 target <= 1.5),
    nri.create.c64.p99_ratio_vs_go_template.
  Go template, same answer as fracplugin's:
    nri.create.c64.service_go_template_same_answer_ms,
    nri.create.c64.p99_go_template_same_answer_ms,
    nri.create.cpu_ms_per_call_go_template_same_answer,
    nri.create.harness_cpu_ms_per_call_go_template_same_answer,
    nri.create.c64.service_ratio_vs_go_template_same_answer,
    nri.create.c64.p99_ratio_vs_go_template_same_answer,
    nri.create.cpu_ratio_vs_go_template_same_answer (CPU per call, c=64 run),
    nri.create.c1.p50_ratio_vs_go_template_same_answer (issue 28's targets:
    <= 1.5 for the c64 service ratio, <= 2.0 for these two).
  fracplugin with the Python fake MPS client (what these keys measured before):
    nri.create.c1.p50_ms_python_fake_mps, nri.create.c64.service_python_fake_mps_ms,
    nri.create.c64.service_ratio_vs_go_template_python_fake_mps,
    nri.create.c64.p99_ratio_vs_go_template_python_fake_mps,
    nri.create.cpu_ms_per_call_python_fake_mps,
    nri.create.fake_mps_cpu_ms_per_call_python_fake_mps,
    nri.create.mps_commands_python_fake_mps.
  No-op stub (fracplugin's stub answering empty on its reader thread: the
  floor of the Python transport): nri.create.noop_stub.cpu_ms_per_call,
  nri.create.noop_stub.c1.p50_ms, nri.create.noop_stub.c64.p99_ms,
  nri.create.noop_stub.c64.service_ms.
  Disk state (compiled client): nri.create.disk_state.c1.p50_ms,
  nri.create.disk_state.c64.p99_ms, nri.create.disk_state.c64.service_ms.
The raw harness output (every level, both answers, the template's flags) is
saved to build/bench-nri-raw.json.

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


def _find(root: Path, name: str) -> list[Path]:
    """Files called ``name`` under ``root``; directories that vanish during
    the walk (namespaces the daemon releases meanwhile) are skipped."""
    return [Path(d) / name for d, _, files in os.walk(root) if name in files]


def _mps_daemon_cpu_s(workdir: Path) -> float:
    """User + system CPU seconds of the fake MPS control daemons (pid files
    under the daemon's --mps-root) alive now; they are neither the plugin's
    children nor ours."""
    total = 0.0
    for pidfile in _find(workdir / "mps", "nvidia-cuda-mps-control.pid"):
        try:
            t = psutil.Process(int(pidfile.read_text().split()[0])).cpu_times()
        except (OSError, ValueError, IndexError, psutil.Error):
            continue
        total += t.user + t.system
    return total


def _mps_commands(workdir: Path) -> int:
    """Control commands the fake MPS daemons under ``workdir`` answered so far
    (lines of their control.log other than their own start and exit)."""
    n = 0
    for log in _find(workdir, "control.log"):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        n += sum(1 for line in text.splitlines() if "control daemon (fake)" not in line)
    return n


def run_bench(workdir: Path, plugin: str, calls: int, *, mps_binary: Path | None = None,
              template_args: list[str] | None = None) -> dict[int, dict]:
    """One harness run of ``plugin`` (fracplugin, noop or template): the bench
    event of each concurrency level, keyed by concurrency.

    ``mps_binary``: the fake MPS the daemon runs (``--mps-control-binary``;
    default the Python fake); ``template_args``: extra template-plugin flags
    (``-env``, ``-mount``: the equal-answer run). Each level also carries CPU
    per measured CreateContainer (ms; from the first measured level to the
    end of the run; the same removals and warm-ups ride along for every
    plugin): ``cpu_ms_per_call`` the plugin process's own (user + system,
    children excluded: the fake MPS binary's runs are not the hook's),
    ``mps_client_cpu_ms_per_call`` its reaped children's (the fake MPS client
    commands the daemon ran), ``mps_daemon_cpu_ms_per_call`` the fake MPS
    control daemons' (alive at both ends of the run), and
    ``harness_cpu_ms_per_call`` the Go harness's (containerd's adaptation and
    the bench goroutines; its whole life less its CPU before the gate);
    ``mps_commands``: the control commands the fake MPS answered in that
    window (how much MPS work the run really did)."""
    args = ["-bench", "-bench-levels", "1,16,64", "-bench-calls", str(calls), "-bench-warmup", "50"]
    run = Run(workdir, args, {"pods": bench_pods()})
    try:
        if plugin == "fracplugin":
            proc = iu.start_fracplugin(run.procs, workdir, nri_socket=run.sock, mps_binary=mps_binary)
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
            wait_ready(workdir / "state")
        elif plugin == "noop":
            proc = iu.Proc([sys.executable, __file__, "--serve-noop-plugin", str(run.sock)],
                           stderr_path=workdir / "noop.log")
            run.procs.append(proc)
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
        else:
            proc = iu.Proc([str(iu.template_bin("v012")), "-socket", str(run.sock), "-idx", "10",
                            *(template_args or [])], stderr_path=workdir / "template.log")
            run.procs.append(proc)
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
        ps = psutil.Process(proc.p.pid)
        rt_before_gate = psutil.Process(run.rt.p.pid).cpu_times()
        ours0 = os.times()
        mps0 = _mps_daemon_cpu_s(workdir)
        cmds0 = _mps_commands(workdir)
        cpu0 = ps.cpu_times()
        run.rt.send_line()
        events = run.rt.finish(900)
        cpu1 = ps.cpu_times()
        mps1 = _mps_daemon_cpu_s(workdir)
        cmds1 = _mps_commands(workdir)
        ours1 = os.times()  # the harness was reaped in finish(): its whole life's CPU is in our children's
        if any(e.get("event") == "fatal" for e in events):
            daemon = proc if plugin != "template" else None
            fail(f"{plugin}: {[e for e in events if e.get('event') == 'fatal']}", run.rt, *(d for d in [daemon] if d))
        levels = {e["concurrency"]: e for e in events if e.get("event") == "bench"}
        n = sum(b["calls"] for b in levels.values())
        cpu = {
            "cpu_ms_per_call": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
            "mps_client_cpu_ms_per_call": ((cpu1.children_user - cpu0.children_user)
                                           + (cpu1.children_system - cpu0.children_system)),
            "mps_daemon_cpu_ms_per_call": max(0.0, mps1 - mps0),
            "harness_cpu_ms_per_call": ((ours1.children_user - ours0.children_user)
                                        + (ours1.children_system - ours0.children_system)
                                        - (rt_before_gate.user + rt_before_gate.system)),
        }
        for b in levels.values():
            b.update({k: round(1000 * v / n, 3) for k, v in cpu.items()})
            b["mps_commands"] = cmds1 - cmds0
        return levels
    finally:
        run.close()


def capture_answer(workdir: Path, plugin: str, *, mps_binary: Path | None = None,
                   template_args: list[str] | None = None) -> dict:
    """The merged adjustment (the harness's ``create`` event: ``adjust``,
    ``adjust_bytes``) that ``plugin`` (fracplugin or template) gives the first
    bench pod, in a plain (non-bench) run of the harness with bench pod 0."""
    run = Run(workdir, [], {"pods": bench_pods()[:1]})
    try:
        if plugin == "fracplugin":
            iu.start_fracplugin(run.procs, workdir, nri_socket=run.sock, mps_binary=mps_binary)
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
            wait_ready(workdir / "state")
        else:
            run.procs.append(iu.Proc([str(iu.template_bin("v012")), "-socket", str(run.sock), "-idx", "10",
                                      *(template_args or [])], stderr_path=workdir / "template.log"))
            run.rt.wait_event(lambda e: e["event"] in ("gate", "fatal"), timeout=90)
        run.rt.send_line()
        events = run.rt.finish(120)
        created = [e for e in events if e.get("event") == "create"]
        if len(created) != 1 or not created[0]["ok"]:
            fail(f"{plugin}: the answer for bench pod 0: {created or events[-5:]}", run.rt)
        return {"adjust": created[0]["adjust"], "adjust_bytes": created[0].get("adjust_bytes", 0)}
    finally:
        run.close()


def same_answer_args(adjust: dict) -> list[str]:
    """template-plugin flags (``-env K=V``, ``-mount SRC:DST:OPTS``) that make
    it answer every CreateContainer with the env entries and bind mounts of
    ``adjust`` (fracplugin's answer for bench pod 0: the bench pods' answers
    differ only in values of the same length). Fails on an answer with parts
    the template cannot give (anything but env and bind mounts)."""
    args: list[str] = []
    for kv in adjust.get("env") or []:
        args += ["-env", f"{kv['key']}={kv.get('value', '')}"]
    for m in adjust.get("mounts") or []:
        if m.get("type") != "bind" or ":" in m["source"] + m["destination"]:
            fail(f"the template cannot give the mount {m}")
        args += ["-mount", f"{m['source']}:{m['destination']}:{','.join(m.get('options') or [])}"]
    rest = {k: v for k, v in adjust.items() if k not in ("env", "mounts")}
    if not iu.adjustment_is_empty(rest):
        fail(f"fracplugin's answer has parts the template cannot give: {rest}")
    return args


def serve_noop_plugin(socket_path: str) -> int:
    """The stub floor: fracplugin's NriStub/transport with a handler that
    answers every CreateContainer with an empty adjustment (no planner, no
    ledger). Runs until SIGTERM."""
    import signal
    import threading

    from fracplugin.nri.stub import NriStub

    class Noop:
        """CreateContainer | StopContainer | RemoveContainer (mask 0x608;
        fracplugin's 0x62d adds StartContainer and the pod sandbox events);
        nothing of it waits, so the stub serves it on its reader thread
        (``may_block``), as it serves fracplugin's CreateContainer."""

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


def run_churn(workdir: Path, n: int, mps_binary: Path | None = None) -> tuple[dict[int, float], int]:
    """RSS (MiB) of the daemon after each 1000 create+remove pairs, and the failed creations."""
    run = Run(workdir, ["-churn", str(n), "-checkpoint-every", "1000", "-pause"], {"pods": bench_pods()})
    try:
        daemon = iu.start_fracplugin(run.procs, workdir, nri_socket=run.sock, mps_binary=mps_binary)
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


def bench_memory_limits(n: int = 500) -> dict[str, float]:
    """StartContainer's cost of CUDA memory limits (issue 23; target <= 5 ms
    with the fake library): ``NriMemoryLimits.start`` as the NRI door calls
    it, in this process, through the real pynvml on the fake
    ``libnvidia-ml.so.1`` (tests/fakes/nvml, preloaded by soname), a cgroup v2
    test tree with one leaf per container and the capability gate. Each
    container has the 4 GPUs of the seed inference pod (soft 40960 MiB, hard
    61440 MiB): apply = Get + Set + Get per GPU; verify = Get per GPU (limits
    already in place). Keys: nri.start.memory_limits.p50_ms / .p99_ms (apply),
    nri.start.memory_limits.verify.p50_ms / .p99_ms."""
    import ctypes
    import shutil
    import types

    import yaml

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))

    from fracplugin.enforce.memlimits import LimitPolicy, MemoryLimitMode
    from fracplugin.enforce.wiring import MemoryLimits
    from fracplugin.gpu.simulated import load_node
    from fracplugin.model import Tenancy, ComputeMode
    from tests.fakes import nvml as fake

    node_yaml = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
    node = load_node(str(node_yaml))
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fpbm", dir="/tmp") as d:
        root = Path(d)
        cg = root / "cgroup"
        cg.mkdir()
        (cg / "cgroup.controllers").write_text("memory dmem\n")
        (cg / "dmem.capacity").write_text("".join(f"nvidia/{g.pci_bus_id[4:].lower()}/vidmem {g.memory_mib << 20}\n"
                                                  for g in node.gpus))
        lib = fake.build_fake_nvml()
        ctypes.CDLL(str(lib / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
        os.environ["FAKE_NVML_NODE"] = str(fake.node_file(root / "node", yaml.safe_load(node_yaml.read_text())))
        # the fake keeps its limits in a file (what tests read): on tmpfs, as the driver keeps them in memory
        shm = tempfile.mkdtemp(prefix="fpbm", dir=TMPFS)
        os.environ["FAKE_NVML_LIMITS"] = str(Path(shm) / "limits")
        for mode in (MemoryLimitMode.APPLY, MemoryLimitMode.VERIFY):
            ml = MemoryLimits(mode, LimitPolicy.WARN, str(cg), node, mps_protocol=lambda: 3)
            pod = types.SimpleNamespace(namespace="default", name="inference", uid="u")
            times = []
            for i in range(n):
                cid = f"{i:064x}"
                (cg / "kubepods" / "podu" / cid).mkdir(parents=True, exist_ok=True)
                held = [Tenancy("u", "default", "inference", "app", g.uuid, 40960, 61440, ComputeMode.SM_SHARING,
                                container_id=cid) for g in node.gpus]
                ledger = types.SimpleNamespace(find_container_id=lambda _cid, held=held: held)
                c = types.SimpleNamespace(id=cid, name="app",
                                          linux=types.SimpleNamespace(cgroups_path=f"/kubepods/podu/{cid}"))
                t0 = time.perf_counter()
                res = ml.nri.start(pod, c, ledger)
                times.append((time.perf_counter() - t0) * 1000)
                if res is None or res.enforced != "yes":
                    ml.close()
                    fail(f"memory limits {mode.value}: not enforced: {res.to_dict() if res else None}")
            ml.close()
            times.sort()
            key = "nri.start.memory_limits" + ("" if mode is MemoryLimitMode.APPLY else ".verify")
            out[f"{key}.p50_ms"] = round(times[len(times) // 2], 3)
            out[f"{key}.p99_ms"] = round(times[min(len(times) - 1, int(len(times) * 0.99))], 3)
        shutil.rmtree(shm, ignore_errors=True)
    return out


def same_answer_ratios(ours: dict[int, dict], same: dict[int, dict]) -> dict[str, float]:
    """Issue 28's ratios against the Go template giving fracplugin's answer,
    from one invocation's levels (``run_bench`` results keyed by concurrency):
    ``nri.create.cpu_ratio_vs_go_template_same_answer`` (the plugin process's
    CPU per call over the template's, c=64 run; target <= 2.0) and
    ``nri.create.c1.p50_ratio_vs_go_template_same_answer`` (c=1 median round
    trip over the template's; target <= 2.0). The c=64 service ratio
    (``nri.create.c64.service_ratio_vs_go_template_same_answer``, <= 1.5) is
    in ``main``'s table."""
    return {
        "nri.create.cpu_ratio_vs_go_template_same_answer":
            round(ours[64]["cpu_ms_per_call"] / same[64]["cpu_ms_per_call"], 2),
        "nri.create.c1.p50_ratio_vs_go_template_same_answer": round(ours[1]["p50_ms"] / same[1]["p50_ms"], 2),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000, help="CreateContainer calls per concurrency level")
    ap.add_argument("--churn", type=int, default=10000, help="create+remove pairs for the RSS figure")
    ap.add_argument("--state", choices=("tmpfs", "disk", "both"), default="both",
                    help="where the daemon's state dir (ledger) lives for the latency runs")
    ap.add_argument("--serve-noop-plugin", metavar="SOCKET", help=argparse.SUPPRESS)
    ap.add_argument("--only-memory-limits", action="store_true",
                    help="run only the StartContainer memory-limits part (nri.start.memory_limits.*)")
    a = ap.parse_args(argv)
    if a.serve_noop_plugin:
        return serve_noop_plugin(a.serve_noop_plugin)
    if a.only_memory_limits:
        ml_values = bench_memory_limits()
        merge_report(ml_values)
        print(json.dumps(ml_values, indent=1, sort_keys=True))
        return 0
    t0 = time.monotonic()
    iu.build_module("nri-v012")
    cclient = iu.fake_mps_client()
    headline_dir = TMPFS if a.state != "disk" else "/tmp"
    # the equal-answer template: fracplugin's own answer for a bench pod, given back by the template
    with tempfile.TemporaryDirectory(prefix="fpb", dir=headline_dir) as d0:
        answer = capture_answer(Path(d0), "fracplugin", mps_binary=cclient)
    same_args = same_answer_args(answer["adjust"])
    with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d0:
        tmpl_answer = capture_answer(Path(d0), "template", template_args=same_args)
    if tmpl_answer["adjust_bytes"] != answer["adjust_bytes"]:
        fail(f"the equal-answer template answers {tmpl_answer['adjust_bytes']} bytes, fracplugin "
             f"{answer['adjust_bytes']}: {tmpl_answer['adjust']} vs {answer['adjust']}")
    ours: dict[int, dict] = {}
    pyfake: dict[int, dict] = {}
    disk: dict[int, dict] = {}
    if a.state in ("tmpfs", "both"):
        with tempfile.TemporaryDirectory(prefix="fpb", dir=TMPFS) as d1:
            ours = run_bench(Path(d1), "fracplugin", a.calls, mps_binary=cclient)
    with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d2:
        tmpl = run_bench(Path(d2), "template", a.calls)
    with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d2:
        same = run_bench(Path(d2), "template", a.calls, template_args=same_args)
    with tempfile.TemporaryDirectory(prefix="fpb", dir=headline_dir) as d1:
        pyfake = run_bench(Path(d1), "fracplugin", a.calls, mps_binary=iu.FAKE_MPS)
    if a.state in ("disk", "both"):
        with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d1:
            disk = run_bench(Path(d1), "fracplugin", a.calls, mps_binary=cclient)
    if not ours:  # --state disk: the disk figures are the only ones
        ours = disk
    with tempfile.TemporaryDirectory(prefix="fpb", dir="/tmp") as d4:
        noop = run_bench(Path(d4), "noop", a.calls)
    with tempfile.TemporaryDirectory(prefix="fpb", dir=headline_dir) as d3:
        rss, churn_errors = run_churn(Path(d3), a.churn, cclient)
    raw = {"fracplugin": ours, "fracplugin_python_fake_mps": pyfake, "fracplugin_disk_state": disk,
           "go_template": tmpl, "go_template_same_answer": same, "python_noop_stub": noop,
           "answers": {"fracplugin": answer, "go_template_same_answer": tmpl_answer,
                       "go_template_same_answer_args": same_args},
           "fake_mps_client": str(cclient), "rss_mib": rss, "state": a.state}
    RAW.parent.mkdir(parents=True, exist_ok=True)
    RAW.write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    runs = [ours, pyfake] + ([disk] if disk is not ours else [])
    errors = sum(b["errors"] for r in runs for b in r.values())
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
        # issue 14's headline: per-call service time over the (empty-answer) Go template's, same run
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
        # the CPU beside the plugin's: fake MPS client runs, fake MPS daemon, the Go harness
        "nri.create.fake_mps_cpu_ms_per_call": round(ours[64]["mps_client_cpu_ms_per_call"]
                                                     + ours[64]["mps_daemon_cpu_ms_per_call"], 3),
        "nri.create.harness_cpu_ms_per_call": ours[64]["harness_cpu_ms_per_call"],
        "nri.create.mps_commands": ours[64]["mps_commands"],
        "nri.create.harness_cpu_ms_per_call_go_template": tmpl[64]["harness_cpu_ms_per_call"],
        # the same, with the Python fake MPS client (the figures before the compiled client)
        "nri.create.c1.p50_ms_python_fake_mps": pyfake[1]["p50_ms"],
        "nri.create.c64.service_python_fake_mps_ms": round(pyfake[64]["per_call_ms"], 3),
        "nri.create.c64.service_ratio_vs_go_template_python_fake_mps":
            round(pyfake[64]["per_call_ms"] / tmpl[64]["per_call_ms"], 2),
        "nri.create.c64.p99_ratio_vs_go_template_python_fake_mps": round(pyfake[64]["p99_ms"] / tmpl[64]["p99_ms"], 2),
        "nri.create.cpu_ms_per_call_python_fake_mps": pyfake[64]["cpu_ms_per_call"],
        "nri.create.mps_commands_python_fake_mps": pyfake[64]["mps_commands"],
        "nri.create.fake_mps_cpu_ms_per_call_python_fake_mps": round(pyfake[64]["mps_client_cpu_ms_per_call"]
                                                                     + pyfake[64]["mps_daemon_cpu_ms_per_call"], 3),
        # the Go template answering what fracplugin answers (same env entries and mount): same merge work
        "nri.create.c64.service_go_template_same_answer_ms": round(same[64]["per_call_ms"], 3),
        "nri.create.c64.p99_go_template_same_answer_ms": same[64]["p99_ms"],
        "nri.create.c64.service_ratio_vs_go_template_same_answer": round(ours[64]["per_call_ms"] / same[64]["per_call_ms"], 2),
        "nri.create.c64.p99_ratio_vs_go_template_same_answer": round(ours[64]["p99_ms"] / same[64]["p99_ms"], 2),
        "nri.create.cpu_ms_per_call_go_template_same_answer": same[64]["cpu_ms_per_call"],
        "nri.create.harness_cpu_ms_per_call_go_template_same_answer": same[64]["harness_cpu_ms_per_call"],
    })
    values.update(same_answer_ratios(ours, same))
    if disk:
        values.update({
            "nri.create.disk_state.c1.p50_ms": disk[1]["p50_ms"],
            "nri.create.disk_state.c64.p99_ms": disk[64]["p99_ms"],
            "nri.create.disk_state.c64.service_ms": round(disk[64]["per_call_ms"], 3),
        })
    values.update(bench_memory_limits())
    merge_report(values)
    print(json.dumps(values, indent=1, sort_keys=True))
    print(f"bench_nri: done in {time.monotonic() - t0:.0f}s; raw figures in {RAW.relative_to(REPO)}")
    if errors:
        first = next((b["first_error"] for r in runs for b in r.values() if b["errors"]), "")
        print(f"bench_nri: {errors} CreateContainer calls failed, e.g. {first}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
