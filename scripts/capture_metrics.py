#!/usr/bin/env python3
"""Capture what a running fracplugin daemon really exports on /metrics.

    .venv/bin/python scripts/capture_metrics.py [OUT]   (default tests/fixtures/metrics/daemon-metrics.txt)

Runs ``fracplugin demo``'s scenario (the real daemon as a subprocess on the
simulated node examples/nodes/gpu-node-1.yaml with the fake
nvidia-cuda-mps-control, driven through its real NRI and device plugin
sockets: tenants placed, a mode conflict and a limit-below-request refused, an
Allocate), then, with the daemon still running, GETs /metrics and writes the
exposition text to OUT. The alert tests (tests/chart, promtool) and the
dashboard check use this capture as the series the daemon emits;
tests/component/test_metrics_capture.py re-captures and fails when the
fixture's series (names and label names) are no longer what the daemon emits.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"


def capture() -> str:
    """Run the demo scenario and return the daemon's /metrics text (UTF-8).

    Raises RuntimeError when a demo step fails (its output names the step)."""
    sys.path.insert(0, str(REPO / "src"))
    from fracplugin.demo import Demo, find_examples, find_fake_mps

    captured: dict[str, str] = {}

    class CaptureDemo(Demo):
        def metrics(self) -> None:  # the demo's last step, daemon still running
            with urllib.request.urlopen(f"http://{self.endpoints['metrics']}/metrics", timeout=10) as r:
                captured["text"] = r.read().decode("utf-8")

    demo = CaptureDemo(find_examples(None), find_fake_mps(None))
    demo.out = lambda *a, **k: None  # type: ignore[assignment,method-assign]
    demo.out.block = lambda *a, **k: None  # type: ignore[attr-defined]
    status = demo.run()
    if status != 0 or "text" not in captured:
        raise RuntimeError(f"the demo scenario failed (status {status}); run `fracplugin demo` to see which step")
    return captured["text"]


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    text = capture()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
