#!/usr/bin/env python3
"""The DRA door's Prepare in process (issue 33 item 5). Merges into
build/bench.json (benchjson.merge):

- ``dra.prepare.p50_ms`` / ``dra.prepare.p99_ms``: one ``Preparer.prepare``
  of a claim not prepared yet (the full path: the claim read from a stand-in
  ``ClaimSource``, plan, ledger admission, CDI spec written, answer with the
  GPU's own CDI device), 64 claims of 1Gi on the simulated node
  examples/nodes/gpu-node-1.yaml (16 per GPU), 10 rounds of 64 Prepares then
  64 Unprepares (Unprepare not timed): 640 samples. The ledger (with its
  journal) and the claim CDI specs on tmpfs (/dev/shm, as production keeps
  /run/fracplugin/state and /var/run/cdi), the node's CDI specs from
  tests/fixtures/cdi/with-hook; no MPS (the namespace is the MPS layer's
  cost, bench_mps) and no API round trip (the stand-in answers from a dict).
- ``dra.prepare.repeat_p50_ms``: the same claims prepared again (kubelet's
  retry): answered from the record.

Usage: python tests/bench/bench_dra.py. No assertions on the figures.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))

from benchjson import merge  # noqa: E402

from fracplugin.cdi import CdiRegistry  # noqa: E402
from fracplugin.dra.prepare import Preparer
from fracplugin.noderules import NodeRules  # noqa: E402
from fracplugin.gpu.simulated import load_node  # noqa: E402
from fracplugin.ledger import Ledger  # noqa: E402
from fracplugin.planner import PlannerConfig  # noqa: E402
from tests.peers.resource_api import claim_doc  # noqa: E402

CLAIMS = 64
ROUNDS = 10


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(p / 100.0 * len(s) + 0.5)) - 1))]


def main() -> int:
    node = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    uids = [f"0b7c1e9a-{i:04x}-4a55-9d0e-000000000000" for i in range(CLAIMS)]
    docs = {("bench", u): claim_doc("bench", u, u, memory="1Gi", device=f"gpu-{i % 4}") for i, u in enumerate(uids)}

    class Claims:
        def get(self, namespace: str, name: str) -> dict[str, Any]:
            return docs[(namespace, name)]

    work = Path(tempfile.mkdtemp(prefix="fpdra", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        ledger = Ledger(node, work / "ledger.json")
        cdi = CdiRegistry([str(REPO / "tests" / "fixtures" / "cdi" / "with-hook")], node.gpus)
        p = Preparer(NodeRules(node, ledger, PlannerConfig()), Claims(), str(work / "cdi"), cdi=cdi)
        first_ms: list[float] = []
        repeat_ms: list[float] = []
        for _ in range(ROUNDS):
            for timings in (first_ms, repeat_ms):
                for u in uids:
                    t0 = time.perf_counter()
                    answer = p.prepare("bench", u, u)
                    timings.append((time.perf_counter() - t0) * 1000)
                    assert answer.error == "", answer.error
            for u in uids:
                assert p.unprepare("bench", u, u) == ""
        ledger.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {"dra.prepare.p50_ms": statistics.median(first_ms), "dra.prepare.p99_ms": pct(first_ms, 99),
               "dra.prepare.repeat_p50_ms": statistics.median(repeat_ms)}
    print(json.dumps(results, indent=2))
    merge(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
