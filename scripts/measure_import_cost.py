#!/usr/bin/env python3
"""What importing a module costs a fresh interpreter: wall time and resident
memory (VmRSS) over a bare ``python -c pass`` start (ADR 0029, issue 26).

Usage: python scripts/measure_import_cost.py [--python PY] [--runs N] MODULE...
(``MODULE`` may be ``a+b`` to import several in one process). Prints one
line per module: median wall ms over N fresh processes (interleaved with the
baseline) and median VmRSS KiB gained; no assertions.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_PROBE = ("import sys\n"
          "def rss():\n"
          "    for l in open('/proc/self/status'):\n"
          "        if l.startswith('VmRSS:'): return int(l.split()[1])\n"
          "a = rss()\n"
          "for m in sys.argv[1:]: __import__(m)\n"
          "print(rss() - a)\n")


def run(py: str, mods: list[str]) -> tuple[float, int]:
    """Seconds of one fresh process importing ``mods``, and its VmRSS gain (KiB)."""
    t0 = time.perf_counter()
    out = subprocess.run([py, "-c", _PROBE, *mods], capture_output=True, text=True, check=True).stdout
    return time.perf_counter() - t0, int(out.strip())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("modules", nargs="+")
    a = ap.parse_args(argv)
    for spec in a.modules:
        mods = spec.split("+")
        base, cost, rss = [], [], []
        for _ in range(a.runs):
            base.append(run(a.python, [])[0])
            t, r = run(a.python, mods)
            cost.append(t)
            rss.append(r)
        print(f"{spec:45s} {1e3 * (statistics.median(cost) - statistics.median(base)):7.1f} ms "
              f"{statistics.median(rss) / 1024:6.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
