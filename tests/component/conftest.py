"""Fixtures shared by the component tests (short socket directories, teardown of NRI stubs and runtimes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from fracplugin.nri.stub import NriStub
from tests.leakguard import no_child_process_left_behind  # noqa: F401  (autouse: every test here)


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


@pytest.fixture
def pipe():
    """``(root, procs)`` for tests that run the fake ``nvidia-cuda-mps-control``:
    a private /tmp directory and a list the test appends its Popen objects to.
    Teardown closes their stdin (a ``-f`` daemon exits on EOF), kills what is
    still running after 5 s, kills a ``-d`` daemon left under ``<root>/p``
    (``no_child_process_left_behind`` then fails the test if a child is left)."""
    root = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    procs: list[subprocess.Popen] = []
    yield root, procs
    for p in procs:
        if p.poll() is None:
            try:
                p.stdin.close()
            except (OSError, AttributeError):  # AttributeError: started without a stdin pipe
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    pidfile = os.path.join(root, "p", "nvidia-cuda-mps-control.pid")
    if os.path.exists(pidfile):  # a -d daemon the test did not stop
        os.kill(int(open(pidfile).read()), 9)
    shutil.rmtree(root, ignore_errors=True)
