"""die_with_parent / with_fd_as_3: children started without a Python preexec_fn."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from fracplugin.subproc import die_with_parent, with_fd_as_3

PARENT = """
import subprocess, sys, time
from fracplugin.subproc import die_with_parent
argv = ["sleep", "60"]
child = subprocess.Popen({wrap}(argv))
print(child.pid, flush=True)
time.sleep(60)
"""


def _orphan_after_parent_killed(wrap: str, wait_s: float) -> psutil.Process | None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(wrap=wrap)], stdout=subprocess.PIPE, text=True)
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
    child = _orphan_after_parent_killed("list", 0.5)
    try:
        assert child is not None and child.is_running()
    finally:
        if child is not None:
            child.kill()


def test_wrapper_runs_the_command_with_its_arguments_and_pid():
    p = subprocess.run(die_with_parent(["sh", "-c", 'echo "$0" "$1"', "arg0", "a b"]),
                       capture_output=True, text=True, check=True, timeout=30)
    assert p.stdout == "arg0 a b\n"


def test_child_whose_parent_is_already_gone_does_not_run():
    """The race the wrapper closes: a parent that died before the death signal
    was armed. Simulated by naming a parent pid that is not ours."""
    argv = die_with_parent(["sh", "-c", "echo ran"])
    pid_at = argv.index(str(os.getpid()))
    argv[pid_at] = "1"
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout == ""


def test_fd_becomes_fd_3_in_the_child():
    a, b = socket.socketpair()
    try:
        out = subprocess.run(with_fd_as_3(["sh", "-c", "echo hello >&3"], b.fileno()),
                             pass_fds=(b.fileno(),), check=True, timeout=10)
        assert out.returncode == 0
        assert a.recv(16) == b"hello\n"
    finally:
        a.close()
        b.close()
