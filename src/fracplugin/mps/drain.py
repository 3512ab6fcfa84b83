"""Drain: terminate the MPS clients of a stopping container (NRI StopContainer);
the rules are ``Drainer.drain``'s. Called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from ..model import ComputeMode
from ..procfs import container_id_matches
from .api import DrainResult, MpsError, MpsResourceError, MpsTimeout
from .state import DaemonState, SupervisorCore

log = logging.getLogger("fracplugin.mps.supervisor")


class Drainer:
    """Drains containers' MPS clients (state in ``c``)."""

    def __init__(self, c: SupervisorCore) -> None:
        self.c = c

    def drain_one(
        self, d: DaemonState, cid: str, deadline: float, clients: list[int], terminated: list[int], errors: list[str]
    ) -> bool:
        """Drain one daemon; returns True when a step timed out or failed (the
        daemon is then marked slow/unhealthy and probed at once)."""

        def left() -> float:
            return deadline - time.monotonic()

        pairs: list[tuple[int | None, int]]
        try:
            if self.c.protocol >= 3:
                pairs = [(None, r.pid) for r in d.control.client_list(left())]
            else:
                pairs = []
                for server in d.control.get_server_list(left()):
                    pairs += [(server, c) for c in d.control.get_client_list(server, left())]
        except MpsTimeout as e:
            errors.append(f"{d.mode.value}: client list: {e}")
            self.mark_slow(d, f"drain: client list timed out: {e}")
            return True
        except MpsError as e:
            errors.append(f"{d.mode.value}: client list: {e}")
            return False
        mine: list[tuple[int | None, int]] = []
        for spid, pid in pairs:
            ref = self.c.procfs.container_of(pid)
            if ref is not None and container_id_matches(ref.container_id, cid):
                mine.append((spid, pid))
        clients.extend(pid for _, pid in mine)
        for spid, pid in mine:
            try:
                if spid is None:
                    d.control.client_terminate(pid, left())
                else:
                    d.control.terminate_client(spid, pid, left())
                terminated.append(pid)
            except MpsResourceError as e:  # we could not even run the command: no sign of a wedge
                errors.append(f"{d.mode.value}: terminate {pid}: {e}")
                return False
            except MpsError as e:
                if not isinstance(e, MpsTimeout) and not self.still_client(d, spid, pid, left):
                    terminated.append(pid)  # it exited or detached on its own meanwhile
                    continue
                errors.append(f"{d.mode.value}: terminate {pid}: {e}")
                self.mark_slow(d, f"drain: terminate {pid}: {e}")
                return True
        return False

    def mark_slow(self, d: DaemonState, reason: str) -> None:
        """A drain step of ``d`` ran out of time or failed: unhealthy now, probe
        at once; the probe decides whether it is a hang (restart) or slowness
        (healthy again on the next answered probe)."""
        with self.c.lock:
            d.wedges += 1
            d.slow = reason
            d.last_error = reason
            d.next_probe_at = self.c.clock()
        log.warning("MPS %s daemon %s; probing it now", d.mode.value, reason)
        self.c.set_health(d, False)
        self.c.wake.set()

    def still_client(self, d: DaemonState, spid: int | None, pid: int, left: Callable[[], float]) -> bool:
        """After a refused terminate: is ``pid`` still an MPS client of ``d``?
        (A refusal for a client that has just gone is no wedge.) Unknown -> True."""
        if self.c.procfs.cgroup_text(pid) is None:
            return False
        try:
            if spid is None:
                return pid in {r.pid for r in d.control.client_list(left())}
            return pid in d.control.get_client_list(spid, left())
        except MpsError:
            return True

    def drain(self, container_id: str, timeout_s: float,
              modes: Iterable[ComputeMode] | None = None) -> DrainResult:
        """Terminate the MPS clients of a stopping container (NRI StopContainer).

        Only the daemons that can hold the container's clients are asked:
        ``modes`` (the container's compute mode, from the ledger); None = every
        running daemon (container unknown to the ledger). Each daemon gets its
        own budget of ``timeout_s`` (they are drained concurrently), so a slow
        daemon never eats another's time. Clients come from v3 ``client list
        --format=csv,noheader`` / v2 ``get_server_list`` + ``get_client_list``,
        joined with ``/proc/<pid>/cgroup`` (procfs.container_id_matches); each is
        terminated (v3 ``client terminate <pid>``, v2 ``terminate_client``).

        Slowness is not a hang (issue 12): a command that runs out of time marks
        that daemon unhealthy ("slow") and asks for a probe at once; only the
        probe confirms a hang and hard-restarts the daemon. ``wedged`` then
        means "a drain step timed out or failed".

        Never blocks past ``timeout_s`` (plus process start jitter); never raises
        for MPS errors (they are in ``DrainResult.errors``). A second drain of the
        same container while one runs returns ``skipped=True`` at once.
        """
        t0 = time.monotonic()
        want = None if modes is None else {ComputeMode(m) for m in modes}
        with self.c.lock:
            if container_id in self.c.draining:
                return DrainResult(container_id, skipped=True, errors=("a drain of this container is in progress",))
            self.c.draining.add(container_id)
            daemons = [d for d in self.c.daemons.values()
                       if d.proc is not None and d.state in ("ready", "unhealthy")
                       and (want is None or d.mode in want)]
        clients: list[int] = []
        terminated: list[int] = []
        errors: list[str] = []
        slow: list[ComputeMode] = []
        try:
            deadline = t0 + max(0.0, float(timeout_s))
            if len(daemons) == 1:
                if self.drain_one(daemons[0], container_id, deadline, clients, terminated, errors):
                    slow.append(daemons[0].mode)
            elif daemons:
                out: dict[ComputeMode, bool] = {}

                def one(d: DaemonState) -> None:
                    out[d.mode] = self.drain_one(d, container_id, deadline, clients, terminated, errors)

                threads = [threading.Thread(target=one, args=(d,), name=f"mps-drain-{d.mode.value}", daemon=True)
                           for d in daemons]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(max(0.0, deadline - time.monotonic()) + 1.0)
                slow = [m for m, bad in out.items() if bad]
        finally:
            with self.c.lock:
                self.c.draining.discard(container_id)
        return DrainResult(
            container_id=container_id,
            clients=tuple(clients),
            terminated=tuple(terminated),
            wedged=bool(slow),
            restarted=(),
            skipped=not daemons,
            errors=tuple(errors),
            elapsed_s=time.monotonic() - t0,
        )
