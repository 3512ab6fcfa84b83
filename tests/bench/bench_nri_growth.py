#!/usr/bin/env python3
"""How the NRI CreateContainer cost grows with the tenancies on the node
(issue 14). Merges into build/bench.json (benchjson.merge):

- ``nri.create.service_growth_1_to_768_tenancies``: time per CreateContainer
  with 768 tenancies on the node over time per call with 1 (target <= 1.2).
- ``nri.create.service_growth_1_to_768_tenancies_min``: the same from the
  fastest round of each size (less sensitive to a loaded machine).
- ``nri.create.service_us_1_tenancy`` / ``nri.create.service_us_768_tenancies``:
  the two times per call (microseconds, median of the rounds).
- ``nri.create.service_us_192_tenancies``: a middle point (the growth table
  of docs/benchmarks.md).

How it measures: in one process, one ``FracNriPlugin`` per size over a
real ``Ledger`` whose snapshot and journal live on tmpfs (/dev/shm, as in
production: /run/fracplugin/state), on a simulated 16-GPU node (gpu-node-1's
H100 80 GB repeated: 16 x 48 = 768 MPS clients). The ledger is filled with
N-1 tenancies (1 GiB, time-slicing, spread over the GPUs, GPU 15 left one
short); each measured call is the handler's ``create_container`` for a
container pinned to GPU 15 (annotations parsed, planned, guarded, admitted
and journaled, adjustment built): the N-th tenancy; ``remove_container``
then releases it, untimed. Rounds of 200 calls alternate between the sizes
(interleaved, order rotated each round, so machine noise hits all); the figure per size is the median
over 15 rounds of (round wall time / calls). The socket, ttrpc framing and the
runtime are left out on purpose: they do not depend on N (bench_nri
measures them).

Usage: python tests/bench/bench_nri_growth.py [--rounds R] [--calls N]
No assertions on the figures: targets are read by people.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchjson  # noqa: E402

from fracplugin._proto import nri_pb2  # noqa: E402
from fracplugin.gpu.simulated import load_node  # noqa: E402
from fracplugin.ledger import Ledger  # noqa: E402
from fracplugin.model import NodeInfo, PodRef  # noqa: E402
from fracplugin.mps.layout import MpsLayout  # noqa: E402
from fracplugin.nri.plugin import FracNriPlugin  # noqa: E402
from fracplugin.planner import PlannerConfig  # noqa: E402
from tests.helpers import plan_container  # noqa: E402
from tests.helpers import node_rules  # noqa: E402

TMPFS = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
GPUS = 16
SIZES = (1, 192, 768)


def node16() -> NodeInfo:
    base = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    g0 = base.gpus[0]
    gpus = tuple(dataclasses.replace(g0, index=i, minor=i, uuid=f"GPU-00000000-0000-4000-8000-{i:012d}")
                 for i in range(GPUS))
    return dataclasses.replace(base, name="bench-node-16", gpus=gpus)


def annotations(gpu: int) -> dict[str, str]:
    p = "nvidia.com/container.app."
    return {p + "gpu-memory.request": "1Gi", p + "gpu-compute.mode": "time-slicing", p + "gpus.devices": str(gpu)}


def make_plugin(node: NodeInfo, n: int, state: Path) -> FracNriPlugin:
    """A plugin whose ledger holds n-1 tenancies (GPU 15 gets the fewest).
    The MPS root (where each new pod's pipe directory is made: every measured
    call is a new pod) is under ``state`` on tmpfs, as /run is in production;
    it used to be the default /run/fracplugin/mps, so the bench wrote 9,150
    directories into the host's own MPS root (on the disk on the development
    machine) and left them there. Measured A/B: that did not change the
    per-call figure (the dirs existed from earlier runs)."""
    config = PlannerConfig(layout=MpsLayout(str(state / "mps")))
    ledger = Ledger(node, state / "ledger.json", max_clients_per_gpu=config.max_clients_per_gpu)
    for i in range(n - 1):
        gpu = i % (GPUS - 1) if i < (GPUS - 1) * 48 else GPUS - 1
        p = plan_container(annotations(gpu), "app", PodRef("fill", f"fill-{i}", f"fill-{i}"), node, ledger, config)
        ledger.admit(p, container_id=f"fill-{i}")
    assert len(ledger.tenancies()) == n - 1, (n, len(ledger.tenancies()))
    return FracNriPlugin(node_rules(node, ledger, config))


def run_round(plugin: FracNriPlugin, calls: int, seq: list[int]) -> float:
    """Seconds per create_container over ``calls`` calls (removal untimed)."""
    total = 0.0
    for _ in range(calls):
        seq[0] += 1
        k = seq[0]
        pod = nri_pb2.PodSandbox(id=f"sb-{k}", name=f"m-{k}", uid=f"m-{k}", namespace="bench",
                                 annotations=annotations(GPUS - 1))
        ctr = nri_pb2.Container(id=f"ctr-{k}", pod_sandbox_id=pod.id, name="app",
                                env=["PATH=/usr/bin"])
        t0 = time.perf_counter()
        resp = plugin.create_container(pod, ctr)
        total += time.perf_counter() - t0
        if resp is None or not resp.HasField("adjust"):
            raise SystemExit(f"bench_nri_growth: create_container gave no adjustment ({len(plugin.rules.ledger.tenancies())})")
        plugin.remove_container(pod, ctr)
    return total / calls


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args(argv)
    node = node16()
    with tempfile.TemporaryDirectory(prefix="fpg", dir=TMPFS) as d:
        plugins = {}
        for n in SIZES:
            (Path(d) / str(n)).mkdir()
            plugins[n] = make_plugin(node, n, Path(d) / str(n))
        seq = [0]
        for n in SIZES:  # warm-up
            run_round(plugins[n], 50, seq)
        per: dict[int, list[float]] = {n: [] for n in SIZES}
        for r in range(a.rounds):
            for n in SIZES[r % len(SIZES):] + SIZES[:r % len(SIZES)]:  # rotated: no size always first
                per[n].append(run_round(plugins[n], a.calls, seq))
        for p in plugins.values():
            p.rules.ledger.close()
    med = {n: statistics.median(v) * 1e6 for n, v in per.items()}
    values = {
        "nri.create.service_us_1_tenancy": med[1],
        "nri.create.service_us_192_tenancies": med[192],
        "nri.create.service_us_768_tenancies": med[768],
        "nri.create.service_growth_1_to_768_tenancies": med[768] / med[1],
        "nri.create.service_growth_1_to_768_tenancies_min": min(per[768]) / min(per[1]),
    }
    benchjson.merge(values)
    print(json.dumps({k: round(v, 3) for k, v in values.items()}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
