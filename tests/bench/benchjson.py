"""The one report every benchmark adds to: build/bench.json, a flat JSON
object of numbers. Imported by the bench_*.py scripts (run as scripts, so
this directory is on sys.path)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

REPORT = Path(__file__).resolve().parents[2] / "build" / "bench.json"


def merge(results: dict[str, float], report: Path = REPORT) -> None:
    """Read-modify-write ``report`` under an exclusive flock: our keys
    (rounded to 3 decimals) replace theirs, every other key is kept."""
    report.parent.mkdir(parents=True, exist_ok=True)
    with open(report.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            doc = json.loads(report.read_text()) if report.exists() else {}
        except ValueError:
            doc = {}
        doc.update({k: round(float(v), 3) for k, v in results.items()})
        tmp = report.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, report)
