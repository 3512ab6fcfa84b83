"""Child processes that never outlive the process that started them.

``die_with_parent(argv)`` wraps a command line so that the Linux kernel sends
the child SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGTERM)``,
prctl(2)): a demo or a test killed with SIGKILL does not leave a daemon (and
its MPS children) running.

The death signal is set in the child by a small Python wrapper (``python -I
-S``, a few milliseconds) that then ``execvp``s the command, keeping the pid.
After the prctl the wrapper checks that its parent is still the process that
started it (the pid is passed in): a parent that died in between, before the
signal was armed, makes the child exit at once instead of running orphaned
(util-linux ``setpriv --pdeathsig`` has no such check, and lost that race
under load).

No Python ``preexec_fn`` is used: a ``preexec_fn`` makes ``subprocess`` fork
the whole interpreter and run Python code in the child, which deadlocks or
aborts when other threads (gRPC's pollers) are running at the time of the
fork (gRPC: "Other threads are currently calling into gRPC, skipping fork()
handlers", then "epoll_wait error: Bad file descriptor").

Caveat (prctl(2)): the signal fires when the parent *thread* that started
the child exits, so start children from a thread that lives as long as they
do (the main thread in the demo and in tests). Linux only; elsewhere the
command is returned unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# argv[1]: the expected parent pid; argv[2:]: the command.
_WRAPPER = ("import ctypes,os,signal,sys;"
            "ctypes.CDLL(None,use_errno=True).prctl(1,int(signal.SIGTERM),0,0,0);"
            "os.getppid()==int(sys.argv[1]) or os._exit(0);"
            "os.execvp(sys.argv[2],sys.argv[2:])")
_FD3_WRAPPER = "import os,sys;os.dup2(int(sys.argv[1]),3);os.execvp(sys.argv[2],sys.argv[2:])"


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """The command line ``argv`` wrapped so the child gets SIGTERM when its parent dies.

    Call it in the process that will start the child (its pid is the parent
    the wrapper checks for).

    Args:
        argv: the program and its arguments, as for ``subprocess.Popen``.
    Returns:
        a new argv (``python -I -S -c WRAPPER PARENT_PID *argv``); ``argv``
        itself off Linux. The child keeps its pid, open file descriptors and
        environment (the wrapper ``execvp``s). If the parent is already gone
        when the signal is armed, the child exits 0 without running ``argv``.
    """
    argv = [str(a) for a in argv]
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _WRAPPER, str(os.getpid()), *argv]


def with_fd_as_3(argv: Sequence[str], fd: int) -> list[str]:
    """``argv`` wrapped so the child sees the parent's ``fd`` as its fd 3.

    Pass ``pass_fds=(fd,)`` to ``Popen`` as well. Used to start a plugin the
    way a runtime launches it over a socketpair (NRI: ``NRI_PLUGIN_SOCKET=3``)
    without a ``preexec_fn``: a small Python wrapper ``dup2``s the descriptor
    to 3 (inheritable), then ``execvp``s the command (same pid).
    """
    return [sys.executable, "-c", _FD3_WRAPPER, str(int(fd)), *[str(a) for a in argv]]
