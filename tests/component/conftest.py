"""Fixtures shared by the component tests (short socket directories, teardown of NRI stubs and runtimes)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from fracplugin.nri.stub import NriStub


@pytest.fixture
def sockpath():
    """A fresh NRI socket path in a private /tmp directory (short: unix socket paths)."""
    d = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    yield os.path.join(d, "nri.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sockdir():
    """A fresh private /tmp directory for unix sockets (short paths), removed after the test."""
    d = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cleanup():
    """``cleanup(x)`` registers a stub (stopped) or runtime/transport (closed) for teardown, last first."""
    items = []
    yield items.append
    for item in reversed(items):
        if isinstance(item, NriStub):
            item.stop(5)
        else:
            item.close()
