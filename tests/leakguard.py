"""The unit and component tests' guard against leaked child processes
(``no_child_process_left_behind``, autouse where a conftest imports it)."""

from __future__ import annotations

import os
import time
from typing import Iterator

import psutil
import pytest

from tests.helpers import scaled

#: Directories of longer-lived (module-scoped) fixtures whose own processes
#: may start or restart during any test of the module (an in-process daemon's
#: MPS control daemons, restarted by its supervisor after a hung probe): a
#: child whose command line or environment names one of them is the
#: fixture's, not the test's. A fixture adds its directory while it lives.
LONG_LIVED_ROOTS: set[str] = set()


def _long_lived(c: psutil.Process) -> bool:
    if not LONG_LIVED_ROOTS:
        return False
    try:
        text = " ".join(c.cmdline()) + " " + " ".join(f"{k}={v}" for k, v in c.environ().items())
    except psutil.Error:  # a zombie: nobody reaped it, whoever started it
        return False
    return any(root in text for root in LONG_LIVED_ROOTS)


def children_left_since(before: set[int], timeout_s: float = 5) -> list[str]:
    """The test run's own child processes that were not there in ``before``
    (a set of PIDs) and are still there, zombies included, once each has had
    up to ``timeout_s`` seconds (scaled, as every wait) to exit and be reaped
    by whoever started it; a longer-lived fixture's processes
    (``LONG_LIVED_ROOTS``) do not count. Those left are killed and reaped
    here, so that one test's leak fails that test and no other (a zombie child
    counts in every later leftover check). Returns ``"PID status cmdline"``
    per process left (``not reaped`` added when it could not be reaped within
    5 s), ``[]`` when none."""
    me = psutil.Process()

    def new() -> list[psutil.Process]:
        return [c for c in me.children() if c.pid not in before and not _long_lived(c)]

    deadline = time.monotonic() + scaled(timeout_s)
    while new() and time.monotonic() < deadline:
        time.sleep(0.02)
    left = []
    for c in new():
        said = [str(c.pid)]
        for part in (c.status, lambda: " ".join(c.cmdline())[:120]):
            try:
                said.append(part())
            except psutil.Error:  # a zombie has no command line
                pass
        try:
            c.kill()
        except psutil.Error:
            pass
        if not _reap(c.pid, 5.0):
            said.append("(not reaped)")
        left.append(" ".join(said))
    return left


def _reap(pid: int, timeout_s: float) -> bool:
    """Reap child ``pid`` (polling, never blocking past ``timeout_s``
    seconds, scaled); True when it is gone (reaped here or by its Popen)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:  # reaped meanwhile by its Popen
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def no_child_process_left_behind() -> Iterator[None]:
    """Every test ends with no child process of the test run that it started
    (alive or a zombie nobody waited for). A leak fails the test that made it,
    is killed and reaped there, and so cannot fail the tests after it."""
    before = {c.pid for c in psutil.Process().children()}
    yield
    left = children_left_since(before)
    assert not left, f"child processes this test left behind (now killed and reaped): {left}"
