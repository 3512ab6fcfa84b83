"""The MPS supervisor: owns one ``nvidia-cuda-mps-control`` per compute mode.

``MpsSupervisor`` is the one interface (``MpsApi``) the rest of the daemon
uses; it runs the supervisor thread and hands each job to one part: state,
lifecycle, probing, namespaces, drain, procs (ADR 0022; docs/architecture.md
section 3 lists what each holds). Imports go one way: procs <- state <-
lifecycle, namespaces, drain <- probing <- supervisor.

Concurrency model
-----------------
* One dedicated supervisor thread (``fracplugin-mps-supervisor``) starts the
  daemons, watches them, probes them, restarts them and stops them. It never
  waits on anything without a timeout: control commands are subprocesses with
  timeouts (mps/control.py), so it keeps running even when a daemon, a server or
  another fracplugin thread is stuck.
* One tiny waiter thread per running daemon blocks in ``Popen.wait()`` (which
  also reaps it) and wakes the supervisor thread the moment the daemon exits.
* Public methods (``ensure_namespace``, ``release_namespace``, ``drain``,
  ``healthy``, ``ready``, ``status``) are called from any thread (the NRI and
  device-plugin handlers). They read shared state under ``self.lock`` (held
  for microseconds, never across a subprocess) and run their own control
  commands bounded by the ``timeout_s`` they are given. Namespace changes on
  one daemon are serialised by a per-daemon lock acquired with a timeout.
* Health-change callbacks run on the supervisor thread; they must not block.

What each part does (start, probes, restarts with backoff, namespaces restored
after every restart, drain, stop): its module's docstring (facts:
docs/reference/mps-nvml.md sections 1.2-1.8, 2.7).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any, Iterable

from ..logs import guarded
from ..model import ComputeMode
from .api import DrainResult, HealthCallback
from .control import set_exclusive_process
from .drain import Drainer
from .lifecycle import DaemonProcesses
from .namespaces import NamespaceBook
from .probing import DaemonProber
from .procs import make_dir as make_dir  # make_dir: re-exported (tests/unit/test_mps_rooms.py)
from .state import DaemonState, SupervisorCore

log = logging.getLogger(__name__)


class MpsSupervisor(SupervisorCore):
    """Owns the MPS control daemons of this node (one per compute mode in ``modes``).

    Args:
        layout: where pipe and log directories live (``MpsLayout``).
        control_binary: path of ``nvidia-cuda-mps-control`` (or the fake).
        protocol: 2 or 3; ``None`` = choose from ``driver_version`` (major >= 615 -> 3, else 2).
        driver_version: the driver version the inventory reports (e.g. ``"615.71.09"``).
        modes: the compute modes whose daemons to run.
        probe_interval_s: seconds between active probes of a ready daemon.
        probe_timeout_s: timeout of one probe (and of post-start commands).
        max_restarts: consecutive restarts allowed before giving up (0 = unlimited).
        stable_uptime_s: healthy uptime after which the restart budget resets.
        clock: monotonic clock (seconds) for uptime, probe schedule and backoff.
        proc_root: proc filesystem for PID -> cgroup and exe lookups (tests).
        env: extra environment for the daemons and control commands.
        start_timeout_s: a daemon not ready this long after start is killed and restarted.
        probe_failure_threshold: consecutive failed probes that trigger a restart
            (default 2: a restart kills every client's GPU work, so one slow answer
            on a loaded node is not enough). A refused probe reports unhealthy at once; timed-out
            probes only at the threshold, each one doubling the next probe's timeout (``probing``).
        backoff_base_s, backoff_max_s: exponential backoff after the immediate first retry.
        exclusive_process_gpus: GPU UUIDs put in EXCLUSIVE_PROCESS compute mode via
            NVML at ``start()`` (errors are logged, never fatal).
        detached: the MPS role (``fracplugin run --role mps``, ADR 0009): daemons
            started with ``-d`` (their own session), a running one adopted at
            start (pid file + live process + answered probe), left running by
            ``stop()``; only ``quit_daemons()`` stops MPS on purpose. Its recorded
            namespaces are kept in ``<root>/namespaces.json`` (JSON, atomic rename
            + fsync) so that a restarted MPS role knows whose they are.
        crash_loop_exits, crash_loop_window_s: this many non-zero server exits in
            ``control.log`` within the window make the daemon unhealthy
            ("server crash loop") until the window passes without them.

    Raises ValueError for an empty ``modes`` or a bad protocol.
    """

    def _build(self) -> None:
        self._thread: threading.Thread | None = None
        # The parts (one responsibility each; see the module docstring).
        self.procs = DaemonProcesses(self)
        self.book = NamespaceBook(self)
        self.prober = DaemonProber(self, self.procs, self.book)
        self.drainer = Drainer(self)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the supervisor thread; it starts the daemons at once. Idempotent.
        Returns immediately (``ready()`` says when the daemons are up)."""
        with self.lock:
            if self._thread is not None:
                return
            self.stopping.clear()
            self._thread = threading.Thread(target=self._run, name="fracplugin-mps-supervisor", daemon=True)
        self.book.load_state()
        if self.shared_pipe_exposure:
            log.warning("MPS exposure: %s", self.shared_pipe_exposure)
        if self.exclusive_process_gpus:
            set_exclusive_process(self.exclusive_process_gpus)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every daemon gracefully and end the thread.

        Per daemon: write ``quit`` to its stdin, wait up to ``timeout_s`` (all
        daemons together), SIGKILL what is left, then SIGKILL every leftover
        ``nvidia-cuda-mps-server`` (matched by ``/proc/<pid>/exe`` basename) and
        remove stale ``control`` sockets. Blocks at most about ``timeout_s`` + 5 s.
        """
        timeout_s = max(0.0, float(timeout_s))
        deadline = time.monotonic() + timeout_s
        thread = self._thread
        self.stopping.set()
        self.wake.set()
        if not self.detached:
            # Shut down from the caller's thread: the supervisor thread may be in
            # the middle of a probe (bounded by probe_timeout_s) and must not
            # delay the stop; it starts nothing once _stopping is set.
            self.procs.shutdown_all(timeout_s)
        if thread is not None and thread.is_alive():
            thread.join(max(0.5, deadline - time.monotonic()))
        if self.detached:
            # The MPS role: daemons and servers outlive us (ADR 0009); the next
            # MPS role adopts them. Only quit_daemons() stops MPS on purpose.
            self.procs.release_all()
        with self.lock:
            self._thread = None

    def quit_daemons(self, timeout_s: float = 10.0) -> None:
        """Stop MPS on purpose (uninstall, ``fracplugin mps-quit``): supervision
        ends, every daemon gets ``quit`` (through its control socket), what is
        left after ``timeout_s`` is SIGKILLed with its servers, and the recorded
        namespaces are forgotten. Running clients lose their server."""
        self.stopping.set()
        self.wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(max(0.5, self.probe_timeout_s + 1.0))
        with self.lock:
            self._thread = None
            self.namespaces.clear()
        self.book.save_state()
        self.procs.shutdown_all(timeout_s)

    def healthy(self, mode: ComputeMode) -> bool:
        """True when the daemon serving ``mode`` is running, answered its last
        probe and has every recorded namespace in place. False for a mode that
        is not supervised."""
        d = self.daemons.get(mode)  # ComputeMode is a str enum: its value finds it too
        if d is None:
            ComputeMode(mode)  # ValueError for a value that names no mode, as before
            return False
        return d.healthy  # one bool, written under the lock: read atomically (NRI hot path)

    def ready(self) -> bool:
        """Every supervised daemon is healthy."""
        with self.lock:
            return all(d.healthy for d in self.daemons.values())

    def subscribe(self, callback: HealthCallback) -> None:
        """``callback(mode, healthy)`` on every health change of a daemon (from
        the supervisor thread; exceptions are logged and ignored)."""
        with self.lock:
            self.subscribers.append(callback)

    def status(self) -> dict[str, Any]:
        """JSON-able state for ``fracplugin status``, metrics and device health::

            {"enabled": True, "protocol": 3, "driver_version": "615.71.09", "ready": bool,
             "daemons": [{"mode": "sm-sharing", "state": "ready", "healthy": True,
                          "pid": 1234 | None, "uptime_s": 12.5 | None,
                          "restarts": 1, "restart_budget_used": 1, "wedges": 0,
                          "last_probe_s": 0.05 | None, "last_probe_ok": True | None,
                          "last_probe_age_s": 1.2 | None, "last_error": "",
                          "pipe_dir": "...", "log_dir": "...", "server_pids": [..],
                          "namespaces": [{"name", "pod_uid", "container", "mode",
                                          "active_thread_percentage", "pinned_limit_mib"}],
                          "repairing": [name], "orphans": [{"name", "capped"}]}]}

        ``restarts`` counts every restart (crash, hang, wedge); ``wedges`` the
        drains that timed out; ``last_probe_s`` is the last probe's duration;
        ``repairing`` the namespaces of a ready daemon whose create or set timed
        out, being finished; ``orphans`` the namespaces it holds that no tenant
        owns (ADR 0034).
        """
        now = self.clock()
        with self.lock:
            daemons = []
            for d in self.daemons.values():
                running = d.proc is not None and d.proc.returncode is None
                ns = [{"name": n, **asdict(r)} for n, r in sorted(self.namespaces.items()) if r.mode is d.mode]
                daemons.append({
                    "mode": d.mode.value,
                    "state": d.state,
                    "healthy": d.healthy,
                    "pid": d.proc.pid if running and d.proc is not None else None,
                    "uptime_s": (now - d.started_at) if running and d.started_at is not None else None,
                    "restarts": d.restarts,
                    "restart_budget_used": d.budget_used,
                    "resource_errors": d.resource_errors,
                    "wedges": d.wedges,
                    "last_probe_s": d.last_probe_s,
                    "last_probe_ok": d.last_probe_ok,
                    "last_probe_age_s": (now - d.last_probe_at) if d.last_probe_at is not None else None,
                    "last_error": d.last_error,
                    "pipe_dir": d.pipe_dir,
                    "log_dir": d.log_dir,
                    "server_pids": sorted(d.server_pids),
                    "namespaces": ns,
                    # ADR 0034: timed-out namespaces still being finished; namespaces no tenant owns
                    "repairing": sorted(d.restore_pending) if d.state == "ready" else [],
                    "orphans": [{"name": n, "capped": c} for n, c in sorted(d.orphans.items())],
                    "adopted": d.adopted,
                    "crash_loop": d.crash_loop,
                    "server_exits_recent": len(d.server_exits),
                    "slow": d.slow,
                    "reason": self.reason(d),
                })
            return {
                "enabled": True,
                "detached": self.detached,
                "exposure": self.shared_pipe_exposure,
                "protocol": self.protocol,
                "driver_version": self.driver_version,
                "ready": all(d.healthy for d in self.daemons.values()),
                "daemons": daemons,
            }

    def unhealthy_reason(self, mode: ComputeMode) -> str:
        """Why the daemon of ``mode`` is not healthy ("" when it is, or "not
        supervised" for a mode without a daemon)."""
        d = self.daemons.get(ComputeMode(mode))
        if d is None:
            return f"no {ComputeMode(mode).value} MPS daemon is supervised"
        with self.lock:
            return self.reason(d)

    # ------------------------------------------------------------------ namespaces and drain

    def ensure_namespace(
        self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float,
        mode: ComputeMode = ComputeMode.SM_SHARING, pinned_limit_mib: int | None = None,
    ) -> str:
        """``NamespaceBook.ensure``: the container's namespace pipe directory. Raises MpsError, MpsTimeout,
        ValueError."""
        return self.book.ensure(pod_uid, container, active_thread_percentage, timeout_s, mode, pinned_limit_mib)

    def release_namespace(self, pod_uid: str, container: str, timeout_s: float | None = None) -> bool:
        """``NamespaceBook.release``: True when the namespace is gone now. Never raises for MPS errors."""
        return self.book.release(pod_uid, container, timeout_s)

    def drain(self, container_id: str, timeout_s: float,
              modes: Iterable[ComputeMode] | None = None) -> DrainResult:
        """``Drainer.drain``: terminate a stopping container's MPS clients. Never raises for MPS errors."""
        return self.drainer.drain(container_id, timeout_s, modes)

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                for d in self.daemons.values():  # keep supervising whatever happens
                    guarded(log, f"MPS supervisor step for {d.mode.value}", self._step, d)
                self.wake.wait(self._next_wait())
                self.wake.clear()
        finally:
            if not self.detached:
                self.procs.shutdown_all(0.0)  # anything started while stop() was running

    def _next_wait(self) -> float:
        now = self.clock()
        waits = [0.5]
        with self.lock:
            for d in self.daemons.values():
                if d.state == "starting":
                    waits.append(0.02)
                elif d.state in ("backoff", "failed"):
                    waits.append(d.next_start_at - now)
                elif d.state in ("ready", "unhealthy"):
                    waits.append(d.next_probe_at - now)
                    if self.pending_delete:
                        waits.append(self.probe_interval_s)
        return min(max(w, 0.005) for w in waits)

    def _step(self, d: DaemonState) -> None:
        now = self.clock()
        if self.detached and not d.adopt_tried and d.proc is None:
            d.adopt_tried = True
            if self.prober.try_adopt(d):
                return
        proc = d.proc
        if proc is not None and proc.poll() is not None:
            rc = proc.returncode
            self.procs.release_proc(d)
            reason = f"daemon exited with status {rc}"
            log.warning("MPS %s %s", d.mode.value, reason)
            self.procs.kill_servers(d, scan=False)
            self.procs.schedule_restart(d, reason, consume_budget=True)
            return
        if d.proc is None and d.state in ("stopped", "backoff", "failed") and now >= d.next_start_at:
            self.procs.start_daemon(d)
            return
        if d.state == "starting":
            self.prober.check_starting(d, now)
            return
        if d.state in ("ready", "unhealthy"):
            if d.ready_at is not None and d.budget_used and now - d.ready_at >= self.stable_uptime_s and d.healthy:
                with self.lock:
                    d.budget_used = 0
            if now >= d.next_probe_at:
                self.prober.probe(d, now)
