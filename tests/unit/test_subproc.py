"""die_with_parent: a child started with it ends when its parent is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

PARENT = """
import subprocess, sys, time
from fracplugin.subproc import die_with_parent
child = subprocess.Popen(["sleep", "60"], preexec_fn={preexec})
print(child.pid, flush=True)
time.sleep(60)
"""


def _orphan_after_parent_killed(preexec: str, wait_s: float) -> psutil.Process | None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(preexec=preexec)], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            child = psutil.Process(child_pid)
            if child.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            return None
        time.sleep(0.05)
    return child


def test_child_dies_with_its_parent():
    assert _orphan_after_parent_killed("die_with_parent", 5.0) is None


def test_without_it_the_child_would_be_orphaned():
    child = _orphan_after_parent_killed("None", 0.5)
    try:
        assert child is not None and child.is_running()
    finally:
        if child is not None:
            child.kill()
