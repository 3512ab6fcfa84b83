"""die_with_parent / with_fd_as_3: children started without a Python preexec_fn."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import psutil

from fracplugin_demo.subproc import die_with_parent, with_fd_as_3
from tests.helpers import wait_until

PARENT = """
import subprocess, sys, time
from fracplugin_demo.subproc import die_with_parent
argv = ["sleep", "60"]
child = subprocess.Popen({wrap}(argv))
print(child.pid, flush=True)
time.sleep(60)
"""


def _kill_parent(wrap: str) -> tuple[int, psutil.Process]:
    """Start a parent that starts ``sleep 60`` through ``wrap``, SIGKILL the
    parent and reap it. Returns (the parent's pid, the child). By then the
    kernel has reparented the child and sent its parent-death signal, if it
    had one (both happen in the parent's exit, before it can be reaped)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(wrap=wrap)], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    return parent.pid, child


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_child_dies_with_its_parent():
    _, child = _kill_parent("die_with_parent")
    wait_until(lambda: _gone(child), 10, "the child to end on its parent-death signal")


def test_without_it_the_child_would_be_orphaned():
    parent_pid, child = _kill_parent("list")
    try:
        assert child.ppid() != parent_pid  # reparented: its parent's exit is over, and no signal came
        assert not _gone(child) and child.status() != psutil.STATUS_STOPPED
    finally:
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
