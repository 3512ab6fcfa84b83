#!/usr/bin/env python3
"""Run every benchmark script in tests/bench (bench_*.py) in turn.

Each script merges its own keys into build/bench.json (a flat JSON object of
numbers). This runner only sequences them and fails when one fails; it makes
no timing assertions. Usage: ``make bench`` (or ``python tests/bench/run_all.py [NAME...]``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REPORT = REPO / "build" / "bench.json"


def main(argv: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(a in s.stem for a in argv)]
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    failed = []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(script)], cwd=REPO)
        print(f"== {script.name}: exit {rc} in {time.monotonic() - t0:.1f}s", flush=True)
        if rc != 0:
            failed.append(script.name)
    if REPORT.exists():
        print(json.dumps(json.loads(REPORT.read_text()), indent=2, sort_keys=True))
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
