#!/usr/bin/env python3
"""The CDI part of CreateContainer while the node's specs keep changing (issue 34
item 5). Merges into build/bench.json (benchjson.merge):

- ``nri.create.cdi_refresh.p99_ms`` / ``.p50_ms``: one ``with_node_cdi_devices``
  (the CDI step of CreateContainer: the plan's GPUs -> the node's CDI devices)
  of a 4-GPU plan, while 300 spec files of ~12 KB (296 of other vendors' kinds,
  the NVIDIA device plugin's spec, three toolkit specs) sit in the spec directory
  and one of them is rewritten every second, with the registry's watcher
  re-reading them in the background (``CdiRegistry.start``, checked every
  0.2 s); 6 s of calls. Target <= 5 ms (issue 34).
- ``cdi.reread_ms``: one background re-read of those 300 specs (the watcher's
  cost, off the request path), median of 5.

Usage: python tests/bench/bench_cdi.py. No assertions on the figures.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))

from benchjson import merge  # noqa: E402

from fracplugin.cdi import CdiRegistry, with_node_cdi_devices  # noqa: E402
from fracplugin.gpu.simulated import load_node  # noqa: E402
from fracplugin.model import PodRef  # noqa: E402
from fracplugin.planner import EmptyLedger  # noqa: E402
from tests.helpers import plan_container  # noqa: E402

SPECS = 300
RUN_S = 6.0


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(p / 100.0 * len(s) + 0.5)) - 1))]


def spec_dir(base: Path) -> Path:
    d = base / "cdi"
    d.mkdir()
    fix = REPO / "tests" / "fixtures" / "cdi"
    shutil.copy(fix / "with-hook" / "k8s.device-plugin.nvidia.com-gpu.yaml", d / "k8s.device-plugin.nvidia.com-gpu.yaml")
    for f in (fix / "toolkit").iterdir():
        shutil.copy(f, d / f"toolkit-{f.name}")
    filler = "\n".join(f"  - name: dev{i}\n    containerEdits: {{env: [X_{i}={'y' * 100}]}}" for i in range(80))
    for i in range(SPECS - 4):
        (d / f"vendor{i:03d}.yaml").write_text(f'cdiVersion: "0.6.0"\nkind: vendor{i}.example/fpga\ndevices:\n{filler}\n')
    return d


def main() -> int:
    node = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    ann = {"nvidia.com/container.app.gpu-memory.request": "8Gi",
           "nvidia.com/container.app.gpus.devices": ",".join(g.uuid for g in node.gpus)}
    plan = plan_container(ann, "app", PodRef("bench", "p", "uid"), node, EmptyLedger())
    assert plan is not None
    base = Path(tempfile.mkdtemp(prefix="fpbcdi", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        d = spec_dir(base)
        reg = CdiRegistry([str(d)], node.gpus)
        reg.file_check_s = 0.2
        rereads = []
        for _ in range(5):
            t0 = time.perf_counter()
            reg.refresh(force=True)
            rereads.append((time.perf_counter() - t0) * 1000)
        reg.start()
        stop = threading.Event()

        def churn() -> None:
            i = 0
            while not stop.wait(1.0):
                f = d / f"vendor{i % (SPECS - 4):03d}.yaml"
                f.write_text(f.read_text() + f"# {i}\n")
                i += 1

        toucher = threading.Thread(target=churn, daemon=True)
        toucher.start()
        samples = []
        end = time.monotonic() + RUN_S
        while time.monotonic() < end:
            t0 = time.perf_counter()
            out = with_node_cdi_devices(plan, reg)
            samples.append((time.perf_counter() - t0) * 1000)
            assert len(out.cdi_devices) == 4
            time.sleep(0.002)
        stop.set()
        toucher.join(5)
        reg.stop()
        res = {"nri.create.cdi_refresh.p99_ms": pct(samples, 99), "nri.create.cdi_refresh.p50_ms": pct(samples, 50),
               "cdi.reread_ms": statistics.median(rereads)}
        print(res, f"({len(samples)} calls, {reg.reads} reads)")
        merge(res)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
