"""The MPS role's keeper: the container's main process around ``fracplugin run
--role mps`` (ADR 0009 decision 2).

The MPS control daemons live in the container's cgroup, so they end with the
container whatever the fracplugin process does. The keeper makes the two ways
the container can end distinct:

- the fracplugin process dies of anything but our own stop (a crash): the
  keeper restarts it in place 1 s later, and the new process adopts the
  running daemons (every MPS client keeps its server);
- the keeper itself gets SIGTERM/SIGINT: the container is being stopped (pod
  deletion: `kubectl delete pod`, a node drain, the DaemonSet controller when
  the node stops matching the pod's affinity, as in a GPU Operator driver
  upgrade). The runtime kills every process left in the cgroup once the
  keeper exits, so MPS is stopped **on purpose** first: the keeper asks the
  running process, through its API socket (the call ``fracplugin mps-quit``
  makes), to ``quit`` every control daemon (servers end with their daemon,
  the sockets are removed, clients get an error rather than a SIGKILLed
  server), logs it, then forwards the signal and exits with the process's
  status. If the process cannot be asked (not up yet, already stopping) the
  keeper logs that MPS ends with the container instead. Source: ADR 0008
  decision 13 (the driver-unload path) and ADR 0009.

SIGHUP is forwarded (reload).

Concurrency model: single-threaded. Signal handlers only record the signal
(or forward SIGHUP with ``os.kill``); they take no lock: the main thread may
hold ``Popen``'s wait lock when one runs. The main thread sleeps in
``select`` on the child's pidfd and a wake pipe that is the interpreter's
wakeup fd, so a signal wakes it and the quit runs on the main thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Callable

log = logging.getLogger("fracplugin.daemon")

#: set in the child's environment: that process is the MPS role itself, not a keeper
KEEPER_ENV = "FRACPLUGIN_MPS_ROLE_CHILD"


def quit_through_api(api_socket: str, timeout_s: float) -> Callable[[], None]:
    """A quit function for ``keep``: ``quit_daemons(timeout_s)`` through the
    MPS role's API socket ``api_socket`` (the daemons get ``timeout_s``
    seconds before they are SIGKILLed; the call itself is bounded by
    ``timeout_s`` + 5 s). The returned function raises MpsError/ValueError
    when the role cannot be asked or refuses."""
    def quit_() -> None:
        from .rpc import RemoteMps

        RemoteMps(api_socket).quit_daemons(timeout_s)
    return quit_


def keep(quit_mps: Callable[[], None] | None = None, argv: list[str] | None = None) -> int:
    """Run the MPS role (``argv``, default this process's own command line
    re-run with ``python -m fracplugin.cli``) as a child with ``KEEPER_ENV=1``
    and keep it (module docstring). ``quit_mps`` stops MPS on purpose before
    a SIGTERM/SIGINT is forwarded (``quit_through_api``); None skips that
    step. Returns the exit status for the container: the child's after our
    own stop (0 when a signal ended it), 1 or 2 when the child reports a bad
    setting or a part that cannot start (no restart), 0 when a stop lands
    during the restart back-off."""
    argv = argv or [sys.executable, "-m", "fracplugin.cli", *sys.argv[1:]]
    env = {**os.environ, KEEPER_ENV: "1"}
    stopping: list[int] = []  # a list, not an Event: the handlers must take no lock
    child: list[subprocess.Popen[bytes]] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)

    def record(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    def reload(signum: int, _frame: Any) -> None:
        if child and child[0].returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0].pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, record)
    signal.signal(signal.SIGHUP, reload)
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        while True:
            proc = subprocess.Popen(argv, env=env)
            child[:] = [proc]
            rc = _supervise(proc, stopping, wake_r, quit_mps)
            if stopping:
                return rc if rc >= 0 else 0
            if rc in (1, 2):  # a bad setting or a part that cannot start: let the pod report it
                return rc
            log.error("the MPS role process exited with status %s; restarting it in place (it adopts the "
                      "running MPS daemons)", rc)
            select.select([wake_r], [], [], 1.0)  # the back-off; a signal meanwhile wakes it and ends the keeper
            if stopping:
                return 0
    finally:
        signal.set_wakeup_fd(old_wakeup)
        os.close(wake_r)
        os.close(wake_w)


def _supervise(proc: subprocess.Popen[bytes], stopping: list[int], wake_r: int,
               quit_mps: Callable[[], None] | None) -> int:
    """Wait for ``proc`` to exit; on the first recorded stop signal quit MPS
    on purpose, then forward that signal. Returns ``proc``'s exit status."""
    pidfd = os.pidfd_open(proc.pid)
    forwarded = False
    try:
        while True:
            if stopping and not forwarded:
                forwarded = True
                name = signal.Signals(stopping[-1]).name
                if quit_mps is not None and proc.poll() is None:
                    _quit_on_purpose(quit_mps, name)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, stopping[-1])
            ready, _, _ = select.select([pidfd, wake_r], [], [])
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
            if pidfd in ready:
                return proc.wait()
    finally:
        os.close(pidfd)


def _quit_on_purpose(quit_mps: Callable[[], None], signame: str) -> None:
    from .api import MpsError

    log.info("received %s: the MPS role's container is stopping (pod deletion), so MPS is stopped on purpose "
             "before it ends with the container: quitting every MPS control daemon", signame)
    t0 = time.monotonic()
    try:
        quit_mps()
    except (MpsError, ValueError, OSError) as e:
        log.warning("could not quit MPS on purpose (%s); its daemons end with the container", e)
        return
    log.info("MPS stopped on purpose: every MPS control daemon quit",
             extra={"elapsed_ms": round((time.monotonic() - t0) * 1000, 1)})
