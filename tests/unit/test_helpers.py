"""tests.helpers.wait_until: returns the value that ended the wait, fails on timeout."""

from __future__ import annotations

import pytest

from tests.helpers import wait_for, wait_until


def test_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", {"pods": 1}])
    assert wait_until(lambda: next(values)) == {"pods": 1}


def test_timeout_fails_naming_what_and_the_last_value() -> None:
    held = {"GPU-1": 0}
    with pytest.raises(AssertionError, match=r"waiting for GPU-1 to be held; last value: 0\Z"):
        wait_until(lambda: held["GPU-1"], 0, "GPU-1 to be held")


def test_without_what_the_predicate_source_is_named_and_a_callable_what_is_read_at_timeout() -> None:
    with pytest.raises(AssertionError, match=r"waiting for .*lambda: \[\]"):
        wait_for(lambda: [], 0)
    log = ["starting"]

    def ready() -> bool:
        log.append("crashed")  # what the log says only once the wait has begun
        return False

    with pytest.raises(AssertionError, match=r"waiting for readiness \(log: starting, crashed\); last value: False"):
        wait_until(ready, 0, lambda: f"readiness (log: {', '.join(log)})")


def test_bounds_are_scaled_for_a_loaded_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.helpers as h

    monkeypatch.setattr(h, "WAIT_SCALE", 3.0)
    assert h.scaled(5) == 15.0
    with pytest.raises(AssertionError, match=r"timed out after 0\.03 s waiting for nothing"):
        h.wait_until(lambda: 0, 0.01, "nothing")
