"""Fixtures of the interop tests (helpers live in interop_util.py).

Concurrency: pytest runs these tests serially; the fixtures own the
processes and directories they create and remove them at teardown.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import pytest

from interop_util import Proc, short_dir


@pytest.fixture
def sdir() -> Iterator[Path]:
    """A short temporary directory under /tmp (for unix sockets)."""
    d = Path(short_dir())
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes appended here are stopped at teardown (reverse order)."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()
