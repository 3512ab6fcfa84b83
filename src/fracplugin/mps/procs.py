"""Process primitives of the MPS supervisor: control daemons that are not our
children, liveness by ``/proc``, and the MPS root's directories.

Used by ``lifecycle`` (start, adopt, kill), ``probing`` (adoption) and
``namespaces`` (leaf directories); nothing here holds supervisor state.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import subprocess
import time

SERVER_EXE = "nvidia-cuda-mps-server"
"""Basename of the MPS server binary (``/proc/<pid>/exe``), for leftover-server cleanup."""
PID_FILE = "nvidia-cuda-mps-control.pid"
"""The control daemon's PID file in its pipe directory (docs/reference/mps-nvml.md 1.4)."""


class DetachedProc:
    """A control daemon that is not our child: started with ``-d`` (it
    daemonizes into its own session) or adopted from a previous fracplugin.
    Offers the ``Popen`` subset the supervisor uses. ``returncode`` is -1 once
    the process is gone (its real status belongs to its parent, not to us)."""

    def __init__(self, pid: int) -> None:
        self.pid = int(pid)
        self.returncode: int | None = None
        self.stdin = None
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(self.pid)

    def poll(self) -> int | None:
        """The exit status (-1 once gone), or None while it runs."""
        if self.returncode is None and not pid_alive(self.pid):
            self.returncode = -1
            self._close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL it (nothing when it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Block until it is gone (pidfd, else polling /proc) or ``timeout`` seconds; returns -1. Raises
        subprocess.TimeoutExpired."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            fd = self._pidfd
            if fd is not None:
                try:
                    select.select([fd], [], [], 0.2 if left is None else min(0.2, left))
                    continue
                except (OSError, ValueError):
                    pass
            time.sleep(0.02)
        return self.returncode if self.returncode is not None else -1

    def _close(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (``/proc/<pid>/stat`` state)."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError, ValueError):
        return False


def is_control_daemon(pid: int, control_binary: str) -> bool:
    """``pid``'s command line runs ``control_binary`` (basename of argv[0] or
    argv[1], so that a script run by its interpreter matches too). False when
    the process is gone or unreadable."""
    want = os.path.basename(control_binary)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return False
    return any(os.path.basename(a) == want for a in argv[:2])


def read_pid(pipe_dir: str) -> int | None:
    """The PID in ``<pipe_dir>/PID_FILE`` (None when absent or unreadable)."""
    try:
        with open(os.path.join(pipe_dir, PID_FILE), encoding="utf-8") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def live_daemon(pipe_dir: str, control_binary: str) -> int | None:
    """``read_pid``'s PID when that process is alive and runs ``control_binary``, else None."""
    pid = read_pid(pipe_dir)
    return pid if pid is not None and pid_alive(pid) and is_control_daemon(pid, control_binary) else None


def unlink_socket(path: str) -> None:
    """Remove ``path`` when it is a socket (a dead daemon's ``control``); OSError ignored."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def make_dir(path: str, root: str) -> None:
    """``mkdir -p path``, then chmod 0755 each directory from ``root`` down to
    ``path`` (``root`` alone when ``path`` is not under it), whatever the process
    umask (``os.makedirs(mode=)`` is masked by it: under ``umask 077`` it makes
    0700 directories that a non-root container cannot enter; containers run as
    any UID and must traverse to the socket). Directories above ``root`` are
    left alone. Raises OSError."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    root, path = os.path.normpath(root), os.path.normpath(path)
    parts = path[len(root) + 1:].split(os.sep) if path.startswith(root + os.sep) else []
    for p in [root] + [os.path.join(root, *parts[:i + 1]) for i in range(len(parts))]:
        if stat.S_IMODE(os.stat(p).st_mode) != 0o755:
            os.chmod(p, 0o755)


def root_problem(root: str) -> str:
    """"" when every existing ancestor of ``root`` is traversable by other users
    (o+x), else a sentence naming the first one that is not (containers run as
    any UID and must reach ``<root>/.../control``)."""
    parent = os.path.dirname(os.path.normpath(root))
    chain = []
    while parent and parent != "/":
        chain.append(parent)
        parent = os.path.dirname(parent)
    for p in reversed(chain):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            break
        except OSError as e:
            return f"MPS root {root}: cannot stat {p}: {e.strerror or e}"
        if not st.st_mode & 0o001:
            return (f"MPS root {root}: directory {p} is mode {stat.S_IMODE(st.st_mode):04o}, not traversable "
                    f"by other users (o+x): containers could not reach their MPS pipe directories")
    return ""
