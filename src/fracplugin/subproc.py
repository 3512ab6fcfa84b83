"""Child processes that never outlive the process that started them.

``die_with_parent`` is a ``preexec_fn`` for ``subprocess.Popen``: it asks the
Linux kernel (``prctl(PR_SET_PDEATHSIG, SIGTERM)``) to send the child SIGTERM
when its parent dies, so a demo or a test killed with SIGKILL does not leave a
daemon (and its MPS children) running. Linux only; elsewhere a no-op.

Caveat (prctl(2)): the signal fires when the parent *thread* that forked the
child exits, so spawn from a thread that lives as long as the child (the main
thread in the demo and in tests).
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: deliver SIGTERM to this child when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
