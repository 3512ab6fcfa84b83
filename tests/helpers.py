"""Small helpers shared by the test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(pred: Callable[[], Any], timeout_s: float = 15.0, what: str = "condition", step_s: float = 0.01) -> Any:
    """Poll ``pred()`` until it returns a truthy value and return that value;
    raise AssertionError naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step_s)
