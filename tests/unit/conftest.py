"""Fixtures for the unit tests: each test ends with no child process left behind."""

from __future__ import annotations

import psutil
import pytest

from tests.helpers import children_left_since


@pytest.fixture(autouse=True)
def no_child_process_left_behind():
    """Every test ends with no child process of the test run that it started
    (alive or a zombie nobody waited for): a leak fails the test that made it,
    is killed and reaped there, and so cannot fail the tests after it."""
    before = {c.pid for c in psutil.Process().children()}
    yield
    left = children_left_since(before)
    assert not left, f"child processes this test left behind (now killed and reaped): {left}"
