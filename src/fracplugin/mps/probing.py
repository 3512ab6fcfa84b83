"""Probing and health of the MPS supervisor's daemons.

``DaemonProber`` decides when a started (or adopted) daemon is ready and
whether a ready one is still healthy:

* ready when the ``control`` socket exists and a real command answers; then
  recorded namespaces are restored (``namespaces``);
* an active probe every ``probe_interval_s`` (v3 ``server list``, v2
  ``get_default_active_thread_percentage``) bounded by ``probe_timeout_s``;
  ``probe_failure_threshold`` consecutive failures confirm a hang: the daemon
  is hard-killed and restarted (``lifecycle``);
* a *refused* probe (an error answer, a socket gone or replaced, the client
  exiting non-zero) reports the daemon unhealthy at once; a *timed-out* one
  (on a starved host a live daemon answers late) only once
  ``probe_failure_threshold`` in a row confirm a hang, and each doubles the
  next timeout, up to 8 x ``probe_timeout_s`` (``probe_timeout_for``); while
  the host is CPU-starved (``/proc/pressure/cpu`` "some avg10" at least
  ``STARVED_CPU_PRESSURE_PCT``; Linux PSI, kernel docs ``accounting/psi.rst``)
  a timed-out probe below that cap is not counted at all: a restart kills
  every client's GPU work, so there only 8x probes confirm a hang;
* the probe first checks that ``<pipe>/control`` is still the socket the
  daemon created (owner, inode, directory writable by us only): a replaced
  socket is never talked to;
* non-zero server exits in ``control.log`` (``crash_loop_exits`` within
  ``crash_loop_window_s``) make the daemon unhealthy ("server crash loop");
* a probe or start this process could not even run (EMFILE, ENOMEM: an
  ``MpsResourceError``) is no probe failure and spends no budget (issue 13).

Runs on the supervisor thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time

from .api import MpsError, MpsResourceError, MpsTimeout
from .lifecycle import DaemonProcesses
from .namespaces import NamespaceBook
from .procs import DetachedProc, live_daemon, unlink_socket
from .state import SERVER_EXIT_RE, DaemonState, SupervisorCore, control_log_size

log = logging.getLogger("fracplugin.mps.supervisor")

MAX_TIMEOUT_DOUBLINGS = 3
"""A probe after n consecutive timed-out ones waits ``probe_timeout_s * 2**min(n, 3)`` (at most 8x)."""


STARVED_CPU_PRESSURE_PCT = 50.0
"""CPU pressure (PSI "some avg10", percent) from which the host counts as starved (module docstring)."""


def cpu_pressure_pct(proc_root: str = "/proc") -> float | None:
    """Linux PSI ``<proc_root>/pressure/cpu`` "some avg10": the percentage of the
    last 10 s in which at least one runnable task waited for a CPU. None when
    the file is missing or unreadable (kernel without PSI, ``psi=0``)."""
    try:
        with open(os.path.join(proc_root, "pressure", "cpu"), encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("some "):
                    for field in line.split()[1:]:
                        if field.startswith("avg10="):
                            return float(field[len("avg10="):])
    except (OSError, ValueError):
        return None
    return None


def probe_timeout_for(base_s: float, timeouts: int) -> float:
    """Timeout (seconds) of the next probe after ``timeouts`` consecutive timed-out probes:
    ``base_s`` doubled per timeout, at most ``MAX_TIMEOUT_DOUBLINGS`` times (module docstring)."""
    return base_s * float(1 << min(max(0, timeouts), MAX_TIMEOUT_DOUBLINGS))


class DaemonProber:
    """Readiness, probes, adoption and crash-loop detection (state in ``c``)."""

    def __init__(self, c: SupervisorCore, procs: DaemonProcesses, book: NamespaceBook) -> None:
        self.c = c
        self.procs = procs
        self.book = book

    def check_starting(self, d: DaemonState, now: float) -> None:
        """A ``starting`` daemon: ready once ``<pipe>/control`` exists and a probe answers; killed and restarted
        after ``start_timeout_s``."""
        if os.path.exists(os.path.join(d.pipe_dir, "control")):
            try:
                # the escalated timeout, but never past the start timeout (the supervisor thread waits on it)
                left = (self.c.start_timeout_s - (now - d.started_at)) if d.started_at is not None else 0.0
                timeout = min(probe_timeout_for(self.c.probe_timeout_s, d.probe_timeouts),
                              max(self.c.probe_timeout_s, left))
                dur = d.control.probe(timeout)
            except MpsResourceError as e:
                # Our process cannot run the probe (EMFILE, ...): the start timeout counts from when it
                # can again, so starvation never kills the daemon nor spends the budget (issue 13 item 1).
                with self.c.lock:
                    d.resource_errors += 1
                    d.last_error = f"probe not run: {e}"
                    d.started_at = now
                return
            except MpsError as e:
                with self.c.lock:
                    d.last_error = f"not ready: {e}"
                    d.probe_timeouts = d.probe_timeouts + 1 if isinstance(e, MpsTimeout) else 0
            else:
                self.after_ready(d, dur)
                return
        if d.started_at is not None and now - d.started_at > self.c.start_timeout_s:
            reason = f"not ready within {self.c.start_timeout_s:g}s"
            self.procs.hard_kill(d)
            self.procs.schedule_restart(d, reason, consume_budget=True)

    def try_adopt(self, d: DaemonState) -> bool:
        """MPS role start: adopt a control daemon left running by a previous
        fracplugin (pid file names a live process whose command line is the
        control binary, and a real probe answers through ``<pipe>/control``).
        Its servers, namespaces and clients are kept; recorded namespaces that
        are missing are re-created. Returns True when adopted."""
        pid = live_daemon(d.pipe_dir, self.c.control_binary)
        if pid is None:
            return False
        try:
            dur = d.control.probe(self.c.probe_timeout_s)
        except MpsError as e:
            log.warning("MPS %s daemon pid %d found but not answering (%s): starting a new one", d.mode.value, pid, e)
            return False
        proc = DetachedProc(pid)
        with self.c.lock:
            d.proc = proc
            d.adopted = True
            d.starts += 1
            d.started_at = self.c.clock()
            d.state = "starting"
        threading.Thread(target=self.procs.waiter, args=(proc,), name=f"mps-wait-{pid}", daemon=True).start()
        log.info("adopted running MPS %s daemon pid %d", d.mode.value, pid)
        self.after_ready(d, dur, fresh=False)
        return True

    def control_identity(self, d: DaemonState) -> tuple[int, int] | None:
        """(device, inode) of ``<pipe>/control`` when it is a socket owned by us
        in a directory only we can write; None otherwise."""
        try:
            st_dir = os.stat(d.pipe_dir)
            st = os.lstat(os.path.join(d.pipe_dir, "control"))
        except OSError:
            return None
        me = os.geteuid()
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != me or st_dir.st_uid != me or st_dir.st_mode & 0o022:
            return None
        return (st.st_dev, st.st_ino)

    def after_ready(self, d: DaemonState, probe_s: float, fresh: bool = True) -> None:
        """The daemon answered: state ``ready``; drop namespaces released meanwhile (fresh daemon), remember the
        control socket's identity, restore recorded namespaces, then report health."""
        now = self.c.clock()
        with self.c.lock:
            if self.c.stopping.is_set() or d.proc is None:
                return
            d.state = "ready"
            d.ready_at = now
            d.last_probe_s = probe_s
            d.last_probe_ok = True
            d.last_probe_at = now
            d.probe_failures = 0
            d.probe_timeouts = 0
            d.next_probe_at = now + self.c.probe_interval_s
            d.slow = ""
            d.control_id = None
            d.restore_pending = {n for n, r in self.c.namespaces.items() if r.mode is d.mode}
            d.applied.clear()  # a new (or adopted) daemon process: known only once re-applied
            dropped = []
            if fresh:  # a fresh daemon has no namespaces
                for n in [n for n, m in self.c.pending_delete.items() if m is d.mode]:
                    del self.c.pending_delete[n]
                    dropped.append(n)
        for n in dropped:  # released while the daemon (re)started: nothing will bind there again
            leaf = self.c.layout.namespace_pipe_dir(n, d.mode)
            unlink_socket(os.path.join(leaf, "control"))
            with contextlib.suppress(OSError):
                os.rmdir(leaf)
        d.control_id = self.control_identity(d)
        if d.log_offset is None:
            d.log_offset = control_log_size(d)
        self.book.restore(d, fresh=fresh)
        self.c.set_health(d, not d.restore_pending and d.control_id is not None)
        if d.control_id is None:
            with self.c.lock:
                d.last_error = f"{d.pipe_dir}/control is not a socket of ours in a directory only we can write"
        self.update_servers(d)
        log.info("MPS %s daemon ready (pid %s)", d.mode.value, d.proc.pid if d.proc else None)

    def ask(self, d: DaemonState) -> tuple[bool, bool, str] | None:
        """Run one probe command of ``d``: ``(ok, timed_out, error)``; None when this process could not even
        run it (an ``MpsResourceError``: recorded, the next probe is at the next interval, never a failure)."""
        if d.control_id is not None and self.control_identity(d) != d.control_id:
            # Someone replaced the daemon's control socket: never talk to it.
            return False, False, f"{d.pipe_dir}/control was replaced (not the socket the daemon created)"
        try:
            d.control.probe(probe_timeout_for(self.c.probe_timeout_s, d.probe_timeouts))
        except MpsResourceError as e:
            # The probe could not even be run (EMFILE, ...): says nothing about the daemon. Retry
            # at the next interval; never a probe failure, never a restart (issue 13 item 1).
            with self.c.lock:
                d.resource_errors += 1
                d.last_error = f"probe not run: {e}"
                d.next_probe_at = self.c.clock() + self.c.probe_interval_s
            log.warning("MPS %s probe not run (this process is out of a resource): %s", d.mode.value, e)
            return None
        except MpsError as e:
            return False, isinstance(e, MpsTimeout), str(e)
        if d.control_id is not None and self.control_identity(d) != d.control_id:
            # replaced while the probe ran: whoever answered, it is not to be trusted
            return False, False, f"{d.pipe_dir}/control was replaced during the probe"
        return True, False, ""

    def probe(self, d: DaemonState, now: float) -> None:
        """One active probe of a ready/unhealthy daemon (module docstring): a refused probe reports it
        unhealthy at once; a timed-out one only when it is the ``probe_failure_threshold``-th failure in a
        row, which also hard-restarts it."""
        t0 = time.monotonic()
        asked = self.ask(d)
        if asked is None:
            return
        ok, timed_out, err = asked
        dur = time.monotonic() - t0
        starved: float | None = None
        if timed_out:
            pct = cpu_pressure_pct(self.c.procfs.root)
            starved = pct if pct is not None and pct >= STARVED_CPU_PRESSURE_PCT else None
        t = self.c.clock()
        with self.c.lock:
            d.last_probe_at = t
            d.last_probe_ok = ok
            d.last_probe_s = dur
            # a failed probe is repeated soon: a hang is confirmed (or not) quickly
            d.next_probe_at = t + (self.c.probe_interval_s if ok else min(self.c.probe_interval_s, 1.0))
            if ok:
                d.probe_failures = 0
                d.probe_timeouts = 0
                d.state = "ready"
                d.slow = ""
            else:
                # a timed-out probe on a starved host, whose timeout can still grow, is no evidence of a hang
                excused = (timed_out and starved is not None and d.probe_timeouts < MAX_TIMEOUT_DOUBLINGS)
                if not excused:
                    d.probe_failures += 1
                d.probe_timeouts = d.probe_timeouts + 1 if timed_out else 0
                d.last_error = f"probe: {err}" + (f" (host CPU-starved: pressure {starved:g}%; not counted)"
                                                   if excused else "")
            failures = d.probe_failures
            # a late answer alone (a starved host) is no verdict until the threshold confirms a hang
            suspect_only = timed_out and failures < self.c.probe_failure_threshold and d.healthy
            if not ok and not suspect_only:
                d.state = "unhealthy"
        if ok:
            if d.restore_pending:
                self.book.restore(d)
            self.book.sweep_deletes(d)
            self.book.audit(d)
            self.update_servers(d)
            loop = self.check_crash_loop(d)
            self.c.set_health(d, not d.restore_pending and not loop)
            return
        if d.proc is not None and d.proc.poll() is not None:
            self.c.set_health(d, False)
            return  # it died meanwhile: the exit path restarts it on the next step
        if suspect_only:
            log.warning("MPS %s probe timed out (%d of %d before it counts as hung; next timeout %.3gs): %s",
                        d.mode.value, failures, self.c.probe_failure_threshold,
                        probe_timeout_for(self.c.probe_timeout_s, d.probe_timeouts), err)
            return
        self.c.set_health(d, False)
        log.warning("MPS %s probe failed (%d): %s", d.mode.value, failures, err)
        if failures >= self.c.probe_failure_threshold:
            self.procs.hard_kill(d)
            self.procs.schedule_restart(d, f"probe failed: {err}", consume_budget=True)

    def check_crash_loop(self, d: DaemonState) -> bool:
        """Read what ``control.log`` gained since the last probe; count non-zero
        server exits (``SERVER_EXIT_RE``) in the last ``crash_loop_window_s``.
        Returns True (and sets ``crash_loop``) while there are at least
        ``crash_loop_exits`` of them: the control daemon answers, but no client
        can keep a server."""
        path = os.path.join(d.log_dir, "control.log")
        now = self.c.clock()
        try:
            size = os.path.getsize(path)
            off = d.log_offset or 0
            if size < off:
                off = 0  # rotated or truncated
            text = ""
            if size > off:
                with open(path, "rb") as f:
                    f.seek(off)
                    text = f.read(min(size - off, 4 << 20)).decode("utf-8", "replace")
                off += len(text.encode("utf-8", "replace"))
            d.log_offset = off
        except OSError:
            text = ""
        exits = [m for m in SERVER_EXIT_RE.finditer(text) if m.group(1) != "0"]
        with self.c.lock:
            d.server_exits.extend([now] * len(exits))
            d.server_exits = [t for t in d.server_exits if now - t < self.c.crash_loop_window_s]
            n = len(d.server_exits)
            was = d.crash_loop
            d.crash_loop = (f"MPS server crash loop: {n} server exits with non-zero status in the last "
                            f"{self.c.crash_loop_window_s:g}s (control.log)") if n >= self.c.crash_loop_exits else ""
            if d.crash_loop:
                d.last_error = d.crash_loop
            loop = bool(d.crash_loop)
        if loop and not was:
            log.error("MPS %s daemon: %s", d.mode.value, d.crash_loop)
        return loop

    def update_servers(self, d: DaemonState) -> None:
        """Remember server PIDs (v3 ``server list``, v2 ``get_server_list``) so a
        hard restart can kill them (only PIDs whose exe is a server are killed)."""
        pids: set[int] = set()
        with contextlib.suppress(MpsError):
            pids = ({r.pid for r in d.control.server_list(self.c.probe_timeout_s) if r.pid} if self.c.protocol >= 3
                    else set(d.control.get_server_list(self.c.probe_timeout_s)))
        with self.c.lock:
            d.server_pids |= pids
