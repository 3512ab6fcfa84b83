"""The MPS supervisor: owns one ``nvidia-cuda-mps-control`` per compute mode.

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
  device-plugin handlers). They read shared state under ``self._lock`` (held
  for microseconds, never across a subprocess) and run their own control
  commands bounded by the ``timeout_s`` they are given. Namespace changes on
  one daemon are serialised by a per-daemon lock acquired with a timeout.
* Health-change callbacks run on the supervisor thread; they must not block.

What it does (issue 5; mps-nvml.md sections 1.2-1.8, 2.7;
gpu-fractioning-reference.md section 4):
* start: pipe/log directories from ``MpsLayout``, 0755 whatever the umask
  (an MPS root under a directory others cannot traverse is a start failure
  naming it), stale ``control`` socket removed; v3: ``-p 3 -m -f|-d -a
  <log dir>/mps-control.toml`` (memacct on; both daemons with a
  ``[servers.shared]`` whose namespaces are the tenants' leaf pipe
  directories; context-share on for sm-sharing only); v2: ``-f|-d`` plus
  ``set_default_active_thread_percentage`` / ``set_default_device_pinned_mem_limit``
  when configured. ``-f`` (role all: a child, stdin kept open, quit on stop)
  or ``-d`` (``detached``, role mps: its own session, adopted by the next
  supervisor, left running on stop; ADR 0009);
* ready when the ``control`` socket exists and a real command answers;
* an active probe every ``probe_interval_s`` (v3 ``server list``, v2
  ``get_default_active_thread_percentage``) with ``probe_timeout_s``; a hung
  daemon fails it and is killed and restarted;
* the probe first checks that ``<pipe>/control`` is still the socket the
  daemon created (owner, inode, directory writable by us only): a replaced
  socket is never talked to; server crash loops (non-zero server exits in
  ``control.log``) make the daemon unhealthy;
* restarts with exponential backoff (tenacity ``wait_chain(wait_none(),
  wait_exponential)``: the first retry is immediate) capped at
  ``backoff_max_s`` and retried forever; ``max_restarts`` consecutive
  restarts (reset after ``stable_uptime_s`` of healthy uptime) only decide
  when the daemon is reported ``failed`` (issue 12);
* recorded namespaces (both modes, with active thread percentage and pinned
  memory limit) are re-created and re-capped after every restart;
* drain: only the daemons of the container's mode; a container's clients (v3
  ``client list`` / v2 ``get_client_list``) joined with ``/proc/<pid>/cgroup``
  are terminated within the caller's budget, per daemon; a timeout marks the
  daemon slow (unhealthy) and probes it at once: only failed probes (a
  confirmed hang) hard-restart it (SIGKILL daemon + its servers);
* stop (role all): ``quit`` on stdin, wait, SIGKILL, then SIGKILL every
  leftover ``nvidia-cuda-mps-server`` found by ``/proc/<pid>/exe`` basename;
  ``quit_daemons()`` does the same on purpose in role mps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Mapping, Protocol, Sequence

import tenacity

from ..model import ComputeMode
from ..procfs import ProcFs, container_id_matches
from .api import RESOURCE_ERRNOS, DrainResult, HealthCallback, MpsError, MpsResourceError, MpsTimeout
from .control import MpsControl, choose_protocol, render_config_toml, set_exclusive_process
from .layout import SM_SERVER, MpsLayout, namespace_name

__all__ = ["MpsSupervisor", "SERVER_EXE", "STATES", "DaemonState"]

log = logging.getLogger(__name__)

SERVER_EXE = "nvidia-cuda-mps-server"
_SHARED_PIPE_EXPOSURE = (
    "MPS protocol 2 has no namespaces: tenants of a mode share that daemon's pipe directory "
    "(read-only mount) and can reach its control socket (list, and as root set/quit)")

STATES = ("stopped", "starting", "ready", "unhealthy", "backoff", "failed")
"""Values of ``status()["daemons"][i]["state"]``."""


class _AttachMps(Protocol):
    """What the supervisor asks of a metrics object: ``attach_mps(self)``."""

    def attach_mps(self, mps: Any) -> None: ...


@dataclass
class _NsRecord:
    pod_uid: str
    container: str
    active_thread_percentage: int | None
    mode: ComputeMode = ComputeMode.SM_SHARING
    pinned_limit_mib: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pod_uid": self.pod_uid, "container": self.container, "mode": self.mode.value,
                "active_thread_percentage": self.active_thread_percentage,
                "pinned_limit_mib": self.pinned_limit_mib}


SERVER_EXIT_RE = re.compile(r"server(?:\s+\S+)?\s+exited with status (-?\d+)", re.IGNORECASE)
"""A server exit in ``control.log`` (what the control daemon logs when one of its
``nvidia-cuda-mps-server`` processes dies; mps-nvml.md 1.4: control.log holds
server status). A non-zero status counts towards a crash loop."""


class _DetachedProc:
    """A control daemon that is not our child: started with ``-d`` (it
    daemonizes into its own session) or adopted from a previous fracplugin.
    Offers the ``Popen`` subset the supervisor uses. ``returncode`` is -1 once
    the process is gone (its real status belongs to its parent, not to us)."""

    def __init__(self, pid: int) -> None:
        self.pid = int(pid)
        self.returncode: int | None = None
        self.stdin = None
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None and not _pid_alive(self.pid):
            self.returncode = -1
            self._close()
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
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
            try:
                os.close(fd)
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (``/proc/<pid>/stat`` state)."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError, ValueError):
        return False


@dataclass
class DaemonState:
    """Mutable per-daemon bookkeeping (guarded by the supervisor's lock).

    ``state`` is one of stopped, starting, ready, unhealthy (probe failing),
    backoff (waiting to restart), failed (retry budget exhausted).
    """

    mode: ComputeMode
    pipe_dir: str
    log_dir: str
    control: MpsControl
    proc: "subprocess.Popen[bytes] | _DetachedProc | None" = None
    stdout: IO[bytes] | None = None
    state: str = "stopped"
    healthy: bool = False
    started_at: float | None = None
    ready_at: float | None = None
    starts: int = 0
    restarts: int = 0
    budget_used: int = 0
    resource_errors: int = 0  # starts/probes not run for lack of descriptors/memory (no budget spent)
    wedges: int = 0
    probe_failures: int = 0
    last_probe_s: float | None = None
    last_probe_ok: bool | None = None
    last_probe_at: float | None = None
    next_probe_at: float = 0.0
    next_start_at: float = 0.0
    restart_request: str | None = None
    last_error: str = ""
    server_pids: set[int] = field(default_factory=set)
    restore_pending: set[str] = field(default_factory=set)
    applied: dict[str, "_NsRecord"] = field(default_factory=dict)
    """Namespaces this daemon process was seen to hold with these caps (a
    create/set/list that succeeded since it became ready): an ensure of the
    same record skips the control commands (issue 14). Emptied when the daemon
    becomes ready again (a restart or an adoption re-applies every recorded
    namespace first) and per name on a release or a failed apply."""
    ns_lock: threading.Lock = field(default_factory=threading.Lock)
    adopted: bool = False
    adopt_tried: bool = False
    control_id: tuple[int, int] | None = None
    log_offset: int | None = None
    server_exits: list[float] = field(default_factory=list)
    crash_loop: str = ""
    slow: str = ""


class MpsSupervisor:
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
            on a loaded node is not enough; the first failure already reports unhealthy).
        backoff_base_s, backoff_max_s: exponential backoff after the immediate first retry.
        server_exe: basename of MPS server binaries (leftover-server cleanup).
        default_active_thread_percentage: v2 only: ``set_default_active_thread_percentage``
            applied after each start of the sm-sharing daemon.
        default_pinned_mem_limits_mib: v2 only: ``{device: MiB}`` applied with
            ``set_default_device_pinned_mem_limit`` after each start of every daemon.
        exclusive_process_gpus: GPU UUIDs put in EXCLUSIVE_PROCESS compute mode via
            NVML at ``start()`` (errors are logged, never fatal).
        metrics: a ``fracplugin.metrics.Metrics``; when given, the supervisor
            attaches itself (``metrics.attach_mps(self)``) so scrapes read ``status()``.
        detached: the MPS role (``fracplugin run --role mps``, ADR 0009): daemons
            are started with ``-d`` (they daemonize into their own session, not
            our children, no parent-death signal), a daemon found running at
            start (pid file + live process + answered probe) is adopted instead
            of replaced, and ``stop()`` leaves them running; only
            ``quit_daemons()`` stops MPS on purpose.
        state_file: where the recorded namespaces are kept (JSON, atomic rename
            + fsync) so that a restarted MPS role knows whose they are; default
            ``<root>/namespaces.json`` when ``detached``, none otherwise.
        crash_loop_exits, crash_loop_window_s: this many non-zero server exits in
            ``control.log`` within the window make the daemon unhealthy
            ("server crash loop") until the window passes without them.

    Raises ValueError for an empty ``modes`` or a bad protocol.
    """

    def __init__(
        self,
        layout: MpsLayout,
        control_binary: str,
        protocol: int | None,
        driver_version: str,
        modes: Iterable[ComputeMode],
        probe_interval_s: float = 5.0,
        probe_timeout_s: float = 2.0,
        max_restarts: int = 5,
        stable_uptime_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        proc_root: str = "/proc",
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 30.0,
        probe_failure_threshold: int = 2,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        server_exe: str = SERVER_EXE,
        default_active_thread_percentage: int | None = None,
        default_pinned_mem_limits_mib: Mapping[str, int] | None = None,
        exclusive_process_gpus: Sequence[str] = (),
        metrics: _AttachMps | None = None,
        detached: bool = False,
        state_file: str | None = None,
        crash_loop_exits: int = 3,
        crash_loop_window_s: float = 60.0,
    ) -> None:
        modes = frozenset(ComputeMode(m) for m in modes)
        if not modes:
            raise ValueError("MpsSupervisor needs at least one compute mode")
        self.layout = layout
        self.control_binary = control_binary
        self.driver_version = driver_version
        self.protocol = choose_protocol(driver_version, protocol)
        self.modes = modes
        self.probe_interval_s = float(probe_interval_s)
        self.probe_timeout_s = float(probe_timeout_s)
        self.max_restarts = int(max_restarts)
        self.stable_uptime_s = float(stable_uptime_s)
        self.start_timeout_s = float(start_timeout_s)
        self.probe_failure_threshold = max(1, int(probe_failure_threshold))
        self.server_exe = server_exe
        self.default_atp = default_active_thread_percentage
        self.default_pinned = dict(default_pinned_mem_limits_mib or {})
        self.exclusive_process_gpus = tuple(exclusive_process_gpus)
        self.detached = bool(detached)
        self.state_file = state_file if state_file is not None else (
            os.path.join(layout.root, "namespaces.json") if self.detached else None)
        self.crash_loop_exits = max(1, int(crash_loop_exits))
        self.crash_loop_window_s = float(crash_loop_window_s)
        self.shared_pipe_exposure = _SHARED_PIPE_EXPOSURE if self.protocol < 3 else ""
        self._clock = clock
        self._procfs = ProcFs(proc_root)
        self._env = dict(os.environ)
        self._env.pop("CUDA_MPS_PROTOCOL_VERSION", None)
        if env:
            self._env.update(env)
        self.resource_retry_s = min(1.0, float(backoff_max_s))  # retry after EMFILE & co (no budget spent)
        self._wait = tenacity.wait_chain(
            tenacity.wait_none(), tenacity.wait_exponential(multiplier=backoff_base_s, max=backoff_max_s)
        )
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._shutdown_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._subscribers: list[HealthCallback] = []
        self._namespaces: dict[str, _NsRecord] = {}
        self._pending_delete: dict[str, ComputeMode] = {}
        self._draining: set[str] = set()
        self._daemons = self._make_daemons(env)
        if metrics is not None:
            metrics.attach_mps(self)

    def _make_daemons(self, env: Mapping[str, str] | None) -> dict[ComputeMode, DaemonState]:
        """One ``DaemonState`` per supervised mode, time-slicing first."""
        daemons: dict[ComputeMode, DaemonState] = {}
        for mode in sorted(self.modes, key=lambda m: m.value, reverse=True):
            pipe, logd = self.layout.pipe_dir(mode), self.layout.log_dir(mode)
            daemons[mode] = DaemonState(mode=mode, pipe_dir=pipe, log_dir=logd,
                                        control=MpsControl(self.control_binary, pipe, self.protocol, logd, env=env))
        return daemons

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the supervisor thread; it starts the daemons at once. Idempotent.
        Returns immediately (use ``ready()`` / ``wait_ready()`` to wait)."""
        with self._lock:
            if self._thread is not None:
                return
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="fracplugin-mps-supervisor", daemon=True)
        self._load_state()
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
        self._stopping.set()
        self._wake.set()
        if self.detached:
            # The MPS role: daemons and servers outlive us (ADR 0009); the next
            # MPS role adopts them. Only quit_daemons() stops MPS on purpose.
            if thread is not None and thread.is_alive():
                thread.join(max(0.5, deadline - time.monotonic()))
            self._release_all()
            with self._lock:
                self._thread = None
            return
        # Shut down from the caller's thread: the supervisor thread may be in
        # the middle of a probe (bounded by probe_timeout_s) and must not
        # delay the stop; it starts nothing once _stopping is set.
        self._shutdown_all(timeout_s)
        if thread is not None and thread.is_alive():
            thread.join(max(0.5, deadline - time.monotonic()))
        with self._lock:
            self._thread = None

    def quit_daemons(self, timeout_s: float = 10.0) -> None:
        """Stop MPS on purpose (uninstall, ``fracplugin mps-quit``): supervision
        ends, every daemon gets ``quit`` (through its control socket), what is
        left after ``timeout_s`` is SIGKILLed with its servers, and the recorded
        namespaces are forgotten. Running clients lose their server."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(max(0.5, self.probe_timeout_s + 1.0))
        with self._lock:
            self._thread = None
            self._namespaces.clear()
        self._save_state()
        self._shutdown_all(timeout_s)

    def _release_all(self) -> None:
        """Forget the daemons without stopping them (detached stop)."""
        for d in self._daemons.values():
            with self._lock:
                out = d.stdout
                d.proc = None
                d.stdout = None
                d.state = "stopped"
                d.healthy = False
            if out is not None:
                out.close()

    def _load_state(self) -> None:
        if not self.state_file:
            return
        try:
            with open(self.state_file, encoding="utf-8") as f:
                doc = json.load(f)
            recs = {}
            for name, r in (doc.get("namespaces") or {}).items():
                recs[name] = _NsRecord(str(r["pod_uid"]), str(r["container"]),
                                       None if r.get("active_thread_percentage") is None
                                       else int(r["active_thread_percentage"]),
                                       ComputeMode(r.get("mode", ComputeMode.SM_SHARING.value)),
                                       None if r.get("pinned_limit_mib") is None else int(r["pinned_limit_mib"]))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("MPS namespace state %s unreadable, starting without it: %s", self.state_file, e)
            return
        with self._lock:
            for name, rec in recs.items():
                self._namespaces.setdefault(name, rec)

    def _save_state(self) -> None:
        """Write the recorded namespaces atomically (tmp + fsync + rename)."""
        if not self.state_file:
            return
        with self._lock:
            doc = {"version": 1, "namespaces": {n: r.to_dict() for n, r in sorted(self._namespaces.items())}}
        tmp = f"{self.state_file}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(self.state_file) or ".", exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.state_file)
        except OSError as e:
            log.error("cannot write MPS namespace state %s: %s", self.state_file, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until ``ready()`` or ``timeout_s`` elapsed (real time); returns ``ready()``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    # ------------------------------------------------------------------ queries

    def healthy(self, mode: ComputeMode) -> bool:
        """True when the daemon serving ``mode`` is running, answered its last
        probe and has every recorded namespace in place. False for a mode that
        is not supervised."""
        d = self._daemons.get(mode)  # ComputeMode is a str enum: its value finds it too
        if d is None:
            ComputeMode(mode)  # ValueError for a value that names no mode, as before
            return False
        return d.healthy  # one bool, written under the lock: read atomically (NRI hot path)

    def ready(self) -> bool:
        """Every supervised daemon is healthy."""
        with self._lock:
            return all(d.healthy for d in self._daemons.values())

    def subscribe(self, callback: HealthCallback) -> None:
        """``callback(mode, healthy)`` on every health change of a daemon (from
        the supervisor thread; exceptions are logged and ignored)."""
        with self._lock:
            self._subscribers.append(callback)

    def status(self) -> dict[str, Any]:
        """JSON-able state for ``fracplugin status``, metrics and device health::

            {"enabled": True, "protocol": 3, "driver_version": "615.71.09", "ready": bool,
             "daemons": [{"mode": "sm-sharing", "state": "ready", "healthy": True,
                          "pid": 1234 | None, "uptime_s": 12.5 | None,
                          "restarts": 1, "restart_budget_used": 1, "wedges": 0,
                          "last_probe_s": 0.05 | None, "last_probe_ok": True | None,
                          "last_probe_age_s": 1.2 | None, "last_error": "",
                          "pipe_dir": "...", "log_dir": "...", "server_pids": [..],
                          "namespaces": [{"name", "pod_uid", "container",
                                          "active_thread_percentage"}]}]}

        ``restarts`` counts every restart (crash, hang, wedge); ``wedges`` the
        drains that timed out; ``last_probe_s`` is the last probe's duration.
        """
        now = self._clock()
        with self._lock:
            daemons = []
            for d in self._daemons.values():
                running = d.proc is not None and d.proc.returncode is None
                ns = [
                    {"name": n, "pod_uid": r.pod_uid, "container": r.container,
                     "active_thread_percentage": r.active_thread_percentage,
                     "pinned_limit_mib": r.pinned_limit_mib}
                    for n, r in sorted(self._namespaces.items()) if r.mode is d.mode
                ]
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
                    "adopted": d.adopted,
                    "crash_loop": d.crash_loop,
                    "server_exits_recent": len(d.server_exits),
                    "slow": d.slow,
                    "reason": self._reason(d),
                })
            return {
                "enabled": True,
                "detached": self.detached,
                "exposure": self.shared_pipe_exposure,
                "protocol": self.protocol,
                "driver_version": self.driver_version,
                "ready": all(d.healthy for d in self._daemons.values()),
                "daemons": daemons,
            }

    def _reason(self, d: DaemonState) -> str:
        """Why ``d`` is not healthy, in words ("" when it is). Caller holds the lock."""
        if d.healthy:
            return ""
        if d.crash_loop:
            return d.crash_loop
        if d.state == "failed":
            return f"failed after {d.budget_used} restarts, retrying every {self._backoff_s(10**6):g}s: {d.last_error}"
        if d.state in ("backoff", "stopped"):
            return f"down ({d.state}): {d.last_error}" if d.last_error else f"down ({d.state})"
        if d.state == "starting":
            return "starting"
        if d.restore_pending:
            return f"restoring {len(d.restore_pending)} namespace(s)"
        return f"{d.state}: {d.last_error}" if d.last_error else d.state

    def unhealthy_reason(self, mode: ComputeMode) -> str:
        """Why the daemon of ``mode`` is not healthy ("" when it is, or "not
        supervised" for a mode without a daemon)."""
        d = self._daemons.get(ComputeMode(mode))
        if d is None:
            return f"no {ComputeMode(mode).value} MPS daemon is supervised"
        with self._lock:
            return self._reason(d)

    # ------------------------------------------------------------------ namespaces

    def ensure_namespace(
        self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float,
        mode: ComputeMode = ComputeMode.SM_SHARING, pinned_limit_mib: int | None = None,
    ) -> str:
        """Create and cap the MPS v3 namespace of a container, before it starts;
        return its host pipe directory (``layout.namespace_pipe_dir(ns, mode)``).

        The namespace is ``namespace_name(pod_uid, container)`` on server
        ``shared`` of the daemon of ``mode`` (time-slicing containers get one too,
        so that no container needs a daemon's ``control`` socket: issue 12).
        Caps: ``--active-thread-percentage`` when a percentage is given (None =
        the server's 100 %), ``--pinned-memory-limit=<MiB>M`` when
        ``pinned_limit_mib`` is given (the container's limit per GPU: each client
        process of the namespace is capped to it on each device, mps-nvml.md 1.6).
        Idempotent: an existing namespace with the same caps is left alone
        (one the supervisor applied with these caps on the daemon's current
        process costs no control command at all: another container of the same
        pod and name, issue 14); different caps are re-set (which MPS refuses
        while a client is attached: MpsError). The request is recorded (and persisted in the MPS role) and
        re-applied after every daemon restart until ``release_namespace``.

        Never blocks past ``timeout_s``. Raises MpsError (no daemon for the mode,
        protocol 2, daemon not ready, command refused), MpsTimeout, ValueError
        (percentage outside 1..100, pinned limit below 1 MiB).
        """
        t_deadline = time.monotonic() + float(timeout_s)
        mode = ComputeMode(mode)
        if active_thread_percentage is not None and not 1 <= int(active_thread_percentage) <= 100:
            raise ValueError(f"active thread percentage must be 1..100, got {active_thread_percentage!r}")
        if pinned_limit_mib is not None and int(pinned_limit_mib) < 1:
            raise ValueError(f"pinned memory limit must be >= 1 MiB, got {pinned_limit_mib!r}")
        d = self._daemons.get(mode)
        if d is None:
            raise MpsError(f"no {mode.value} MPS daemon is supervised on this node")
        if self.protocol < 3:
            raise MpsError("per-container MPS namespaces need MPS v3 (driver r615+); this node runs protocol 2")
        name = namespace_name(pod_uid, container)
        rec = _NsRecord(pod_uid, container, None if active_thread_percentage is None else int(active_thread_percentage),
                        mode, None if pinned_limit_mib is None else int(pinned_limit_mib))
        with self._lock:
            prev = self._namespaces.get(name)
            self._namespaces[name] = rec
            self._pending_delete.pop(name, None)
            up = d.healthy and d.proc is not None
            why = self._reason(d)
            # Applied with these caps on this daemon process (it has been
            # healthy since: every restart re-applies before it is): nothing to
            # ask MPS. A new container of the same pod and name (a restart, the
            # runtime's retries) costs no control command (issue 14).
            current = up and prev == rec and d.applied.get(name) == rec
        try:
            if not up:
                raise MpsError(f"the {mode.value} MPS daemon is not ready ({why})")
            if not current:
                # A brand-new container's namespace cannot exist yet: create without
                # listing first (one control command less on the way to StartContainer).
                self._apply_namespace(d, name, rec, t_deadline, fresh=prev is None)
        except BaseException:
            with self._lock:
                if self._namespaces.get(name) is rec:
                    if prev is None:
                        del self._namespaces[name]
                    else:
                        self._namespaces[name] = prev
            raise
        path = self.layout.namespace_pipe_dir(name, mode)
        try:
            make_dir(path, self.layout.root)  # 0755 whatever umask the daemon ran with
        except OSError as e:
            log.warning("cannot set the mode of %s: %s", path, e)
        if prev != rec:
            self._save_state()
        return path

    def release_namespace(self, pod_uid: str, container: str, timeout_s: float | None = None) -> bool:
        """Forget the container's namespace and delete it from its daemon
        (``namespace delete``, bounded by ``timeout_s``, default ``probe_timeout_s``).
        MPS refuses the delete while a client is attached: then the delete is
        retried after each probe. Returns True when the namespace is gone now.
        Never raises for MPS errors."""
        name = namespace_name(pod_uid, container)
        with self._lock:
            rec = self._namespaces.pop(name, None)
            mode = rec.mode if rec is not None else ComputeMode.SM_SHARING
            d = self._daemons.get(mode)
            self._pending_delete[name] = mode
            known = d is not None and d.applied.get(name) is not None
            for dd in self._daemons.values():
                dd.applied.pop(name, None)
        if rec is not None:
            self._save_state()
        if d is None or self.protocol < 3:
            with self._lock:
                self._pending_delete.pop(name, None)
            return True
        budget = self.probe_timeout_s if timeout_s is None else max(0.0, float(timeout_s))
        return self._try_delete(d, name, time.monotonic() + budget, known=known)

    def _try_delete(self, d: DaemonState, name: str, deadline: float, known: bool = False) -> bool:
        """``namespace delete`` of ``name`` on ``d`` if it is still to be
        deleted. ``known``: the daemon's current process holds it (we applied
        it), so it is deleted without listing first (one control command
        instead of two, issue 14); a failed delete is retried after the next
        probes, which list first."""
        try:
            if not d.ns_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                with self._lock:
                    if self._pending_delete.get(name) is not d.mode:
                        return name not in self._namespaces
                if known or any(r.name == name
                                for r in d.control.namespace_list(SM_SERVER, deadline - time.monotonic())):
                    d.control.namespace_delete(name, SM_SERVER, deadline - time.monotonic())
            finally:
                d.ns_lock.release()
        except (MpsError, ValueError) as e:
            log.info("namespace %s not deleted yet: %s", name, e)
            return False
        with self._lock:
            if self._pending_delete.get(name) is d.mode:
                del self._pending_delete[name]
        return True

    def _apply_namespace(self, d: DaemonState, name: str, rec: _NsRecord, deadline: float,
                         fresh: bool = False) -> None:
        def left() -> float:
            return deadline - time.monotonic()

        if not d.ns_lock.acquire(timeout=max(0.0, left())):
            raise MpsTimeout(f"namespace {name}: another namespace operation is still running")
        with self._lock:
            d.applied.pop(name, None)  # unknown until this apply succeeds
        try:
            row = None
            if not fresh:
                rows = d.control.namespace_list(SM_SERVER, left())
                row = next((r for r in rows if r.name == name), None)
            atp, pinned = rec.active_thread_percentage, rec.pinned_limit_mib
            if row is None:
                try:
                    d.control.namespace_create(name, SM_SERVER, left())
                except MpsTimeout:
                    raise
                except MpsError:
                    if not fresh:
                        raise
                    # "fresh" was a guess (a namespace left from before): look
                    rows = d.control.namespace_list(SM_SERVER, left())
                    row = next((r for r in rows if r.name == name), None)
                    if row is None:
                        raise
            if row is None:
                if atp is not None or pinned is not None:
                    try:
                        d.control.namespace_set_caps(name, SM_SERVER, atp, pinned, left())
                    except MpsError:
                        # Never leave an uncapped namespace behind.
                        try:
                            d.control.namespace_delete(name, SM_SERVER, max(left(), 0.5), force=True)
                        except MpsError as e2:
                            log.warning("could not remove uncapped namespace %s: %s", name, e2)
                        raise
            else:
                d.control.namespace_set_caps(
                    name, SM_SERVER,
                    atp if atp is not None and row.active_thread_percentage != atp else None,
                    pinned if pinned is not None and _mib(row.pinned_memory_limit) != pinned else None,
                    left())
            with self._lock:
                if self._namespaces.get(name) == rec:  # not released meanwhile
                    d.applied[name] = rec
        finally:
            d.ns_lock.release()

    # ------------------------------------------------------------------ drain

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

        Slowness is not a hang: a command that runs out of time marks that
        daemon unhealthy ("slow") and asks for a probe at once; only the probe
        (``probe_failure_threshold`` consecutive failures) confirms a hang and
        hard-restarts the daemon (issue 12: one slow answer killed every
        client's work). ``wedged`` in the result then means "a drain step timed
        out or failed"; ``restarted`` stays empty (the restart, if any, is the
        probe's decision).

        Never blocks past ``timeout_s`` (plus process start jitter); never raises
        for MPS errors (they are in ``DrainResult.errors``). A second drain of the
        same container while one runs returns ``skipped=True`` at once.
        """
        t0 = time.monotonic()
        want = None if modes is None else {ComputeMode(m) for m in modes}
        with self._lock:
            if container_id in self._draining:
                return DrainResult(container_id, skipped=True, errors=("a drain of this container is in progress",))
            self._draining.add(container_id)
            daemons = [d for d in self._daemons.values()
                       if d.proc is not None and d.state in ("ready", "unhealthy")
                       and (want is None or d.mode in want)]
        clients: list[int] = []
        terminated: list[int] = []
        errors: list[str] = []
        slow: list[ComputeMode] = []
        try:
            deadline = t0 + max(0.0, float(timeout_s))
            if len(daemons) == 1:
                if self._drain_one(daemons[0], container_id, deadline, clients, terminated, errors):
                    slow.append(daemons[0].mode)
            elif daemons:
                out: dict[ComputeMode, bool] = {}

                def one(d: DaemonState) -> None:
                    out[d.mode] = self._drain_one(d, container_id, deadline, clients, terminated, errors)

                threads = [threading.Thread(target=one, args=(d,), name=f"mps-drain-{d.mode.value}", daemon=True)
                           for d in daemons]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(max(0.0, deadline - time.monotonic()) + 1.0)
                slow = [m for m, bad in out.items() if bad]
        finally:
            with self._lock:
                self._draining.discard(container_id)
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

    def _drain_one(
        self, d: DaemonState, cid: str, deadline: float, clients: list[int], terminated: list[int], errors: list[str]
    ) -> bool:
        """Drain one daemon; returns True when a step timed out or failed (the
        daemon is then marked slow/unhealthy and probed at once)."""

        def left() -> float:
            return deadline - time.monotonic()

        pairs: list[tuple[int | None, int]]
        try:
            if self.protocol >= 3:
                pairs = [(None, r.pid) for r in d.control.client_list(left())]
            else:
                pairs = []
                for server in d.control.get_server_list(left()):
                    pairs += [(server, c) for c in d.control.get_client_list(server, left())]
        except MpsTimeout as e:
            errors.append(f"{d.mode.value}: client list: {e}")
            self._mark_slow(d, f"drain: client list timed out: {e}")
            return True
        except MpsError as e:
            errors.append(f"{d.mode.value}: client list: {e}")
            return False
        mine: list[tuple[int | None, int]] = []
        for spid, pid in pairs:
            ref = self._procfs.container_of(pid)
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
                if not isinstance(e, MpsTimeout) and not self._still_client(d, spid, pid, left):
                    terminated.append(pid)  # it exited or detached on its own meanwhile
                    continue
                errors.append(f"{d.mode.value}: terminate {pid}: {e}")
                self._mark_slow(d, f"drain: terminate {pid}: {e}")
                return True
        return False

    def _mark_slow(self, d: DaemonState, reason: str) -> None:
        """A drain step of ``d`` ran out of time or failed: unhealthy now, probe
        at once; the probe decides whether it is a hang (restart) or slowness
        (healthy again on the next answered probe)."""
        with self._lock:
            d.wedges += 1
            d.slow = reason
            d.last_error = reason
            d.next_probe_at = self._clock()
        log.warning("MPS %s daemon %s; probing it now", d.mode.value, reason)
        self._set_health(d, False)
        self._wake.set()

    def _still_client(self, d: DaemonState, spid: int | None, pid: int, left: Callable[[], float]) -> bool:
        """After a refused terminate: is ``pid`` still an MPS client of ``d``?
        (A refusal for a client that has just gone is no wedge.) Unknown -> True."""
        if self._procfs.cgroup_text(pid) is None:
            return False
        try:
            if spid is None:
                return pid in {r.pid for r in d.control.client_list(left())}
            return pid in d.control.get_client_list(spid, left())
        except MpsError:
            return True

    def _request_restart(self, d: DaemonState, reason: str) -> None:
        with self._lock:
            d.wedges += 1
            d.restart_request = reason
            d.last_error = reason
        log.warning("MPS %s daemon %s; hard restart", d.mode.value, reason)
        self._wake.set()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                for d in self._daemons.values():
                    try:
                        self._step(d)
                    except Exception:  # keep supervising whatever happens
                        log.exception("MPS supervisor step failed for %s", d.mode.value)
                self._wake.wait(self._next_wait())
                self._wake.clear()
        finally:
            if not self.detached:
                self._shutdown_all(0.0)  # anything started while stop() was running

    def _next_wait(self) -> float:
        now = self._clock()
        waits = [0.5]
        with self._lock:
            for d in self._daemons.values():
                if d.state == "starting" or d.restart_request:
                    waits.append(0.02)
                elif d.state in ("backoff", "failed"):
                    waits.append(d.next_start_at - now)
                elif d.state in ("ready", "unhealthy"):
                    waits.append(d.next_probe_at - now)
                    if self._pending_delete:
                        waits.append(self.probe_interval_s)
        return min(max(w, 0.005) for w in waits)

    def _step(self, d: DaemonState) -> None:
        now = self._clock()
        if self.detached and not d.adopt_tried and d.proc is None:
            d.adopt_tried = True
            if self._try_adopt(d):
                return
        proc = d.proc
        if proc is not None and proc.poll() is not None:
            rc = proc.returncode
            self._release_proc(d)
            reason = f"daemon exited with status {rc}"
            log.warning("MPS %s %s", d.mode.value, reason)
            self._kill_servers(d, scan=False)
            self._schedule_restart(d, reason, consume_budget=True)
            return
        if d.restart_request and proc is not None:
            reason = d.restart_request
            self._hard_kill(d)
            with self._lock:
                d.restart_request = None
            self._schedule_restart(d, reason, consume_budget=False)
            return
        if d.proc is None and d.state in ("stopped", "backoff", "failed") and now >= d.next_start_at:
            with self._lock:
                d.restart_request = None
            self._start_daemon(d)
            return
        if d.state == "starting":
            self._check_starting(d, now)
            return
        if d.state in ("ready", "unhealthy"):
            if d.ready_at is not None and d.budget_used and now - d.ready_at >= self.stable_uptime_s and d.healthy:
                with self._lock:
                    d.budget_used = 0
            if now >= d.next_probe_at:
                self._probe(d, now)

    def _check_starting(self, d: DaemonState, now: float) -> None:
        if os.path.exists(os.path.join(d.pipe_dir, "control")):
            try:
                dur = d.control.probe(self.probe_timeout_s)
            except MpsResourceError as e:
                # Our process cannot run the probe (EMFILE, ...): the start timeout counts from when it
                # can again, so starvation never kills the daemon nor spends the budget (issue 13 item 1).
                with self._lock:
                    d.resource_errors += 1
                    d.last_error = f"probe not run: {e}"
                    d.started_at = now
                return
            except MpsError as e:
                with self._lock:
                    d.last_error = f"not ready: {e}"
            else:
                self._after_ready(d, dur)
                return
        if d.started_at is not None and now - d.started_at > self.start_timeout_s:
            reason = f"not ready within {self.start_timeout_s:g}s"
            self._hard_kill(d)
            self._schedule_restart(d, reason, consume_budget=True)

    def _try_adopt(self, d: DaemonState) -> bool:
        """MPS role start: adopt a control daemon left running by a previous
        fracplugin (pid file names a live process whose command line is the
        control binary, and a real probe answers through ``<pipe>/control``).
        Its servers, namespaces and clients are kept; recorded namespaces that
        are missing are re-created. Returns True when adopted."""
        try:
            with open(os.path.join(d.pipe_dir, "nvidia-cuda-mps-control.pid"), encoding="utf-8") as f:
                pid = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        if not _pid_alive(pid) or not self._is_control_daemon(pid):
            return False
        try:
            dur = d.control.probe(self.probe_timeout_s)
        except MpsError as e:
            log.warning("MPS %s daemon pid %d found but not answering (%s): starting a new one", d.mode.value, pid, e)
            return False
        proc = _DetachedProc(pid)
        with self._lock:
            d.proc = proc
            d.adopted = True
            d.starts += 1
            d.started_at = self._clock()
            d.state = "starting"
        threading.Thread(target=self._waiter, args=(proc,), name=f"mps-wait-{pid}", daemon=True).start()
        log.info("adopted running MPS %s daemon pid %d", d.mode.value, pid)
        self._after_ready(d, dur, fresh=False)
        return True

    def _is_control_daemon(self, pid: int) -> bool:
        want = os.path.basename(self.control_binary)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
        except OSError:
            return False
        return any(os.path.basename(a) == want for a in argv[:2])

    def _control_identity(self, d: DaemonState) -> tuple[int, int] | None:
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

    def _after_ready(self, d: DaemonState, probe_s: float, fresh: bool = True) -> None:
        now = self._clock()
        with self._lock:
            if self._stopping.is_set() or d.proc is None:
                return
            d.state = "ready"
            d.ready_at = now
            d.last_probe_s = probe_s
            d.last_probe_ok = True
            d.last_probe_at = now
            d.probe_failures = 0
            d.next_probe_at = now + self.probe_interval_s
            d.slow = ""
            d.control_id = None
            d.restore_pending = {n for n, r in self._namespaces.items() if r.mode is d.mode}
            d.applied.clear()  # a new (or adopted) daemon process: known only once re-applied
            dropped = []
            if fresh:  # a fresh daemon has no namespaces
                for n in [n for n, m in self._pending_delete.items() if m is d.mode]:
                    del self._pending_delete[n]
                    dropped.append(n)
        for n in dropped:  # released while the daemon (re)started: nothing will bind there again
            leaf = self.layout.namespace_pipe_dir(n, d.mode)
            try:
                if stat.S_ISSOCK(os.lstat(os.path.join(leaf, "control")).st_mode):
                    os.unlink(os.path.join(leaf, "control"))
            except OSError:
                pass
            try:
                os.rmdir(leaf)
            except OSError:
                pass
        d.control_id = self._control_identity(d)
        if d.log_offset is None:
            d.log_offset = self._log_size(d)
        self._apply_defaults(d)
        self._restore(d, fresh=fresh)
        self._set_health(d, not d.restore_pending and d.control_id is not None)
        if d.control_id is None:
            with self._lock:
                d.last_error = f"{d.pipe_dir}/control is not a socket of ours in a directory only we can write"
        self._update_servers(d)
        log.info("MPS %s daemon ready (pid %s)", d.mode.value, d.proc.pid if d.proc else None)

    def _apply_defaults(self, d: DaemonState) -> None:
        if self.protocol >= 3:
            return
        try:
            if self.default_atp is not None and d.mode is ComputeMode.SM_SHARING:
                d.control.set_default_active_thread_percentage(self.default_atp, self.probe_timeout_s)
            for dev, mib in self.default_pinned.items():
                d.control.set_default_device_pinned_mem_limit(dev, mib, self.probe_timeout_s)
        except MpsError as e:
            with self._lock:
                d.last_error = f"defaults: {e}"
            log.warning("MPS %s defaults not applied: %s", d.mode.value, e)

    def _restore(self, d: DaemonState, fresh: bool = False) -> None:
        """Re-create recorded namespaces (after a (re)start, and retried after probes).
        ``fresh``: the daemon has just started, so it has no namespaces yet (CLI
        changes are not persisted, mps-nvml.md 1.7): skip the listing."""
        if self.protocol < 3:
            with self._lock:
                d.restore_pending.clear()
            return
        for name in sorted(d.restore_pending):
            with self._lock:
                rec = self._namespaces.get(name)
            if rec is None or rec.mode is not d.mode:
                with self._lock:
                    d.restore_pending.discard(name)
                continue
            try:
                self._apply_namespace(d, name, rec,
                                      time.monotonic() + max(self.probe_timeout_s, 1.0) * 2, fresh=fresh)
            except (MpsError, ValueError) as e:
                with self._lock:
                    d.last_error = f"restore {name}: {e}"
                log.warning("MPS namespace %s not restored yet: %s", name, e)
                continue
            with self._lock:
                d.restore_pending.discard(name)

    def _probe(self, d: DaemonState, now: float) -> None:
        ok = True
        err = ""
        t0 = time.monotonic()
        ident = self._control_identity(d)
        if d.control_id is not None and ident != d.control_id:
            # Someone replaced the daemon's control socket: never talk to it.
            ok = False
            err = f"{d.pipe_dir}/control was replaced (not the socket the daemon created)"
        else:
            try:
                d.control.probe(self.probe_timeout_s)
            except MpsResourceError as e:
                # The probe could not even be run (EMFILE, ...): says nothing about the daemon. Retry
                # at the next interval; never a probe failure, never a restart (issue 13 item 1).
                with self._lock:
                    d.resource_errors += 1
                    d.last_error = f"probe not run: {e}"
                    d.next_probe_at = self._clock() + self.probe_interval_s
                log.warning("MPS %s probe not run (this process is out of a resource): %s", d.mode.value, e)
                return
            except MpsError as e:
                ok = False
                err = str(e)
            if ok and d.control_id is not None and self._control_identity(d) != d.control_id:
                ok = False  # replaced while the probe ran: whoever answered, it is not to be trusted
                err = f"{d.pipe_dir}/control was replaced during the probe"
        dur = time.monotonic() - t0
        t = self._clock()
        with self._lock:
            d.last_probe_at = t
            d.last_probe_ok = ok
            d.last_probe_s = dur
            # a failed probe is repeated soon: a hang is confirmed (or not) quickly
            d.next_probe_at = t + (self.probe_interval_s if ok else min(self.probe_interval_s, 1.0))
            if ok:
                d.probe_failures = 0
                d.state = "ready"
                d.slow = ""
            else:
                d.probe_failures += 1
                d.state = "unhealthy"
                d.last_error = f"probe: {err}"
            failures = d.probe_failures
        if ok:
            if d.restore_pending:
                self._restore(d)
            self._sweep_deletes(d)
            self._update_servers(d)
            loop = self._check_crash_loop(d)
            self._set_health(d, not d.restore_pending and not loop)
            return
        self._set_health(d, False)
        if d.proc is not None and d.proc.poll() is not None:
            return  # it died meanwhile: the exit path restarts it on the next step
        log.warning("MPS %s probe failed (%d): %s", d.mode.value, failures, err)
        if failures >= self.probe_failure_threshold:
            self._hard_kill(d)
            self._schedule_restart(d, f"probe failed: {err}", consume_budget=True)

    def _log_size(self, d: DaemonState) -> int:
        try:
            return os.path.getsize(os.path.join(d.log_dir, "control.log"))
        except OSError:
            return 0

    def _check_crash_loop(self, d: DaemonState) -> bool:
        """Read what ``control.log`` gained since the last probe; count non-zero
        server exits (``SERVER_EXIT_RE``) in the last ``crash_loop_window_s``.
        Returns True (and sets ``crash_loop``) while there are at least
        ``crash_loop_exits`` of them: the control daemon answers, but no client
        can keep a server."""
        path = os.path.join(d.log_dir, "control.log")
        now = self._clock()
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
        with self._lock:
            d.server_exits.extend([now] * len(exits))
            d.server_exits = [t for t in d.server_exits if now - t < self.crash_loop_window_s]
            n = len(d.server_exits)
            was = d.crash_loop
            d.crash_loop = (f"MPS server crash loop: {n} server exits with non-zero status in the last "
                            f"{self.crash_loop_window_s:g}s (control.log)") if n >= self.crash_loop_exits else ""
            if d.crash_loop:
                d.last_error = d.crash_loop
            loop = bool(d.crash_loop)
        if loop and not was:
            log.error("MPS %s daemon: %s", d.mode.value, d.crash_loop)
        return loop

    def _sweep_deletes(self, d: DaemonState) -> None:
        if self.protocol < 3:
            return
        with self._lock:
            names = sorted(n for n, m in self._pending_delete.items() if m is d.mode)
        for name in names:
            self._try_delete(d, name, time.monotonic() + self.probe_timeout_s)

    def _update_servers(self, d: DaemonState) -> None:
        """Remember server PIDs (v3 ``server list``, v2 ``get_server_list``) so a
        hard restart can kill them (only PIDs whose exe is a server are killed)."""
        pids: set[int] = set()
        try:
            if self.protocol >= 3:
                pids |= {r.pid for r in d.control.server_list(self.probe_timeout_s) if r.pid}
            else:
                pids |= set(d.control.get_server_list(self.probe_timeout_s))
        except MpsError:
            pass
        with self._lock:
            d.server_pids |= pids

    # ------------------------------------------------------------------ processes

    def _prepare_dirs(self, d: DaemonState) -> None:
        """Pipe and log directories 0755 whatever the umask (chmod, not
        makedirs' mode), every directory from the root down traversable.
        Raises OSError naming the directory when an ancestor of the root is not
        traversable by other users: containers (any UID) could not reach their
        pipes, so the daemon must not be reported ready."""
        problem = root_problem(self.layout.root)
        if problem:
            raise OSError(problem)
        for path in (d.pipe_dir, d.log_dir):
            make_dir(path, self.layout.root)

    def root_problem(self) -> str:
        """"" when containers can reach the MPS root, else why not (naming the directory)."""
        return root_problem(self.layout.root)

    def _argv(self, d: DaemonState) -> list[str]:
        if self.protocol >= 3:
            cfg = os.path.join(d.log_dir, "mps-control.toml")
            sm = d.mode is ComputeMode.SM_SHARING
            text = render_config_toml(sm_sharing=sm, servers=(SM_SERVER,))
            tmp = cfg + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, cfg)
            # -m (multiuser) on both daemons: root-owned named servers that
            # clients of any UID attach to (mps-nvml.md 1.6, 2.3); context-share
            # (config above) is what makes one sm-sharing and the other time-sliced.
            argv = [self.control_binary, "-p", "3", "-m"]
            return argv + ["-d" if self.detached else "-f", "-a", cfg]
        return [self.control_binary, "-d" if self.detached else "-f"]

    def _start_daemon(self, d: DaemonState) -> None:
        now = self._clock()
        try:
            self._prepare_dirs(d)
            if self.detached:
                self._kill_unanswering(d)
            self._clean_stale_leaves(d)
            for leaf in ("control", "nvidia-cuda-mps-control.pid"):
                try:
                    os.unlink(os.path.join(d.pipe_dir, leaf))  # stale socket of a dead daemon
                except FileNotFoundError:
                    pass
            self._kill_servers(d, scan=False)
            argv = self._argv(d)
            env = dict(self._env)
            env["CUDA_MPS_PIPE_DIRECTORY"] = d.pipe_dir
            env["CUDA_MPS_LOG_DIRECTORY"] = d.log_dir
            d.log_offset = self._log_size(d)
            out: IO[bytes] | None = open(os.path.join(d.log_dir, "daemon.out"), "ab")
            assert out is not None
            proc: Any
            try:
                if self.detached:
                    proc = self._spawn_detached(d, argv, env, out)
                    out.close()
                    out = None
                else:
                    proc = subprocess.Popen(
                        argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                        env=env, close_fds=True, start_new_session=True, umask=0o022,
                    )
            except BaseException:
                if out is not None:
                    out.close()
                raise
        except (OSError, ValueError) as e:
            log.error("cannot start MPS %s daemon: %s", d.mode.value, e)
            resource = isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS
            with self._lock:
                d.last_error = f"start: {e}"
                if resource:
                    d.resource_errors += 1
            # Out of descriptors/memory is this process's fault, not the daemon's: retry after the
            # longest backoff without spending the restart budget (issue 13 item 1).
            self._schedule_restart(d, f"start failed: {e}", consume_budget=not resource,
                                   delay_s=self.resource_retry_s if resource else None)
            return
        with self._lock:
            abort = self._stopping.is_set()
            if not abort:
                if d.starts:
                    d.restarts += 1
                d.starts += 1
                d.proc = proc
        if abort:  # stop() began while we were spawning: undo
            proc.kill()
            proc.wait()
            if out is not None:
                out.close()
            return
        with self._lock:
            d.stdout = out
            d.state = "starting"
            d.started_at = now
            d.ready_at = None
            d.probe_failures = 0
        threading.Thread(target=self._waiter, args=(proc,), name=f"mps-wait-{proc.pid}", daemon=True).start()
        log.info("started MPS %s daemon pid %d: %s", d.mode.value, proc.pid, " ".join(argv))

    def _clean_stale_leaves(self, d: DaemonState) -> None:
        """Before a fresh daemon starts (none is running): remove the sockets a
        dead daemon left in ``<pipe>/shared[/<ns>]/control``, and the directories
        of namespaces nobody holds any more (released while the daemon was
        dying). Directories of recorded namespaces stay: they are bind-mount
        sources of running containers, and the new daemon binds its socket in
        the same directory (same inode), which those containers then see."""
        server_dir = os.path.join(d.pipe_dir, SM_SERVER)
        try:
            entries = list(os.scandir(server_dir))
        except OSError:
            return
        with self._lock:
            keep = {n for n, r in self._namespaces.items() if r.mode is d.mode}
        for leaf in [server_dir] + [e.path for e in entries if e.is_dir(follow_symlinks=False)]:
            sock = os.path.join(leaf, "control")
            try:
                if stat.S_ISSOCK(os.lstat(sock).st_mode):
                    os.unlink(sock)
            except OSError:
                pass
            if leaf != server_dir and os.path.basename(leaf) not in keep:
                try:
                    os.rmdir(leaf)
                except OSError:
                    pass

    def _kill_unanswering(self, d: DaemonState) -> None:
        """Before a detached start: a control daemon of ours still alive (it
        failed adoption or a probe) is SIGKILLed with its servers, so that two
        daemons never share a pipe directory."""
        try:
            with open(os.path.join(d.pipe_dir, "nvidia-cuda-mps-control.pid"), encoding="utf-8") as f:
                pid = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return
        if pid != os.getpid() and _pid_alive(pid) and self._is_control_daemon(pid):
            with self._lock:
                d.server_pids |= self._child_servers(pid)
            old = _DetachedProc(pid)
            old.kill()
            try:
                old.wait(5.0)
            except subprocess.TimeoutExpired:
                log.error("MPS %s daemon pid %d did not die after SIGKILL", d.mode.value, pid)
            self._kill_servers(d, scan=False)

    def _spawn_detached(self, d: DaemonState, argv: list[str], env: dict[str, str], out: IO[bytes]) -> _DetachedProc:
        """``nvidia-cuda-mps-control -d``: the daemon forks into its own session
        and the launcher exits once the socket is up; its PID is read from
        ``<pipe>/nvidia-cuda-mps-control.pid`` (mps-nvml.md 1.4). Raises OSError."""
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                               close_fds=True, start_new_session=True, timeout=self.start_timeout_s,
                               umask=0o022)
        except subprocess.TimeoutExpired:
            raise OSError(f"{' '.join(argv)} did not return within {self.start_timeout_s:g}s") from None
        if r.returncode != 0:
            raise OSError(f"{' '.join(argv)} exited with status {r.returncode} (see {d.log_dir}/daemon.out)")
        pidfile = os.path.join(d.pipe_dir, "nvidia-cuda-mps-control.pid")
        deadline = time.monotonic() + min(5.0, self.start_timeout_s)
        while True:
            try:
                with open(pidfile, encoding="utf-8") as f:
                    return _DetachedProc(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                if time.monotonic() >= deadline:
                    raise OSError(f"{pidfile} did not appear after the daemon started") from None
                time.sleep(0.01)

    def _waiter(self, proc: "subprocess.Popen[bytes] | _DetachedProc") -> None:
        try:
            proc.wait()
        finally:
            self._wake.set()

    def _release_proc(self, d: DaemonState) -> None:
        with self._lock:
            proc, out = d.proc, d.stdout
            d.proc = None
            d.stdout = None
            d.state = "stopped"
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if out is not None:
            out.close()
        self._set_health(d, False)

    def _child_servers(self, pid: int) -> set[int]:
        return {p for p in self._procfs.pids_by_exe(self.server_exe) if self._procfs.ppid(p) == pid}

    def _hard_kill(self, d: DaemonState) -> None:
        """SIGKILL the daemon and its servers (wedged/hung daemon)."""
        proc = d.proc
        if proc is not None:
            with self._lock:
                d.server_pids |= self._child_servers(proc.pid)
            try:
                proc.kill()
            except OSError:
                pass
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                log.error("MPS %s daemon pid %d did not die after SIGKILL", d.mode.value, proc.pid)
        self._release_proc(d)
        self._kill_servers(d, scan=False)

    def _kill_servers(self, d: DaemonState | None, scan: bool) -> list[int]:
        """SIGKILL servers known for ``d`` (verified by exe basename), or with
        ``scan`` every process whose ``/proc/<pid>/exe`` basename is the server's
        and whose ``CUDA_MPS_PIPE_DIRECTORY`` (inherited from our control
        daemon) lies under our MPS root: another MPS stack on the node (NVIDIA's
        device plugin, a user's daemon) is never touched."""
        with self._lock:
            pids = set(d.server_pids) if d is not None else set()
            if d is not None:
                d.server_pids.clear()
        if scan:
            root = self.layout.root.rstrip("/") + "/"
            pids |= {
                p for p in self._procfs.pids_by_exe(self.server_exe)
                if (self._procfs.environ_value(p, "CUDA_MPS_PIPE_DIRECTORY") or "").startswith(root)
            }
        killed = []
        for pid in sorted(pids):
            if self._procfs.exe_basename(pid) != self.server_exe:
                continue  # gone, or the PID was reused by something else
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
            except PermissionError as e:
                log.error("cannot kill leftover MPS server %d: %s", pid, e)
        if killed:
            log.warning("killed leftover MPS servers %s", killed)
            deadline = time.monotonic() + 2.0  # SIGKILL is asynchronous: see them gone
            while time.monotonic() < deadline and any(self._procfs.exe_basename(p) == self.server_exe for p in killed):
                time.sleep(0.01)
        return killed

    def _schedule_restart(self, d: DaemonState, reason: str, consume_budget: bool,
                          delay_s: float | None = None) -> None:
        """Plan the next start of ``d``: after the backoff of its budget, or
        after ``delay_s`` seconds when given with ``consume_budget=False``."""
        now = self._clock()
        with self._lock:
            d.last_error = reason
            if self._stopping.is_set():
                d.state = "stopped"
                return
            state = "backoff"
            if consume_budget:
                d.budget_used += 1
                delay = self._backoff_s(d.budget_used)
                if self.max_restarts and d.budget_used > self.max_restarts:
                    # The budget only decides when the daemon is reported failed:
                    # it is retried forever at the capped backoff (issue 12).
                    if d.state != "failed":
                        log.error("MPS %s daemon: %d restarts failed, reported failed, retrying every %gs: %s",
                                  d.mode.value, self.max_restarts, delay, reason)
                    state = "failed"
            else:
                delay = 0.0 if delay_s is None else max(0.0, float(delay_s))
            d.state = state
            d.next_start_at = now + delay
        self._set_health(d, False)
        self._wake.set()

    def _backoff_s(self, attempt: int) -> float:
        """Delay before restart ``attempt`` (1-based): 0 for the first, then
        ``backoff_base_s * 2**(attempt-1)`` capped at ``backoff_max_s`` (tenacity)."""
        rs = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        rs.attempt_number = max(1, attempt)
        return float(self._wait(rs))

    def _shutdown_all(self, timeout_s: float) -> None:
        with self._shutdown_lock:
            self._shutdown_locked(timeout_s)

    def _shutdown_locked(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        daemons = list(self._daemons.values())
        with self._lock:
            procs = {d.mode: d.proc for d in daemons}
        for d in daemons:
            proc = procs[d.mode]
            if proc is None and self.detached:
                # quit_daemons() after a detached stop: find the daemon again.
                try:
                    with open(os.path.join(d.pipe_dir, "nvidia-cuda-mps-control.pid"), encoding="utf-8") as f:
                        pid = int(f.read().split()[0])
                    if _pid_alive(pid) and self._is_control_daemon(pid):
                        procs[d.mode] = proc = _DetachedProc(pid)  # type: ignore[assignment]
                except (OSError, ValueError, IndexError):
                    pass
            if proc is None or proc.poll() is not None:
                continue
            with self._lock:
                d.server_pids |= self._child_servers(proc.pid)
            if proc.stdin is None:  # detached: quit through the control socket
                try:
                    d.control.quit(max(0.5, min(self.probe_timeout_s, deadline - time.monotonic())))
                except MpsError as e:
                    log.warning("MPS %s quit failed: %s", d.mode.value, e)
                continue
            try:
                proc.stdin.write(b"quit\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                pass
        for d in daemons:
            proc = procs[d.mode]
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("MPS %s daemon ignored quit; SIGKILL", d.mode.value)
                proc.kill()
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    log.error("MPS %s daemon pid %d survived SIGKILL", d.mode.value, proc.pid)
            self._release_proc(d)
        for d in daemons:
            self._kill_servers(d, scan=False)
        self._kill_servers(None, scan=True)
        for d in daemons:
            try:
                os.unlink(os.path.join(d.pipe_dir, "control"))
            except OSError:
                pass
            with self._lock:
                d.state = "stopped"

    # ------------------------------------------------------------------ health

    def _set_health(self, d: DaemonState, healthy: bool) -> None:
        with self._lock:
            if healthy and (self._stopping.is_set() or d.proc is None):
                healthy = False  # a step that raced stop() must not report a dead daemon healthy
            if d.healthy == healthy:
                return
            d.healthy = healthy
            subs = list(self._subscribers)
        for cb in subs:
            try:
                cb(d.mode, healthy)
            except Exception:
                log.exception("MPS health callback failed")


def _chain(root: str, leaf: str) -> list[str]:
    """Directories from ``root`` down to ``leaf`` (inclusive), when leaf is under root."""
    root = os.path.normpath(root)
    leaf = os.path.normpath(leaf)
    out = [root]
    if leaf == root or not leaf.startswith(root + os.sep):
        return out
    cur = root
    for part in leaf[len(root) + 1:].split(os.sep):
        cur = os.path.join(cur, part)
        out.append(cur)
    return out


def _mib(value: str) -> int | None:
    """``"12288M"`` / ``"12G"`` / ``"1024K"`` -> MiB (None for ``-`` / empty / unknown)."""
    m = re.match(r"^\s*(\d+)\s*([KMG])?i?B?\s*$", value or "", re.IGNORECASE)
    if not m:
        return None
    n, unit = int(m.group(1)), (m.group(2) or "M").upper()
    return {"K": n // 1024, "M": n, "G": n * 1024}[unit]


def make_dir(path: str, root: str | None = None, mode: int = 0o755) -> None:
    """``mkdir -p path`` and chmod ``mode`` on each directory it created and on
    ``path`` itself, whatever the process umask (``os.makedirs(mode=)`` is
    masked by it: under ``umask 077`` it makes 0700 directories that a
    non-root container cannot enter). Directories above ``root`` are left alone.
    Raises OSError."""
    path = os.path.normpath(path)
    todo = []
    cur = path
    while not os.path.isdir(cur):
        todo.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    os.makedirs(path, mode=mode, exist_ok=True)
    floor = os.path.normpath(root) if root else None
    for p in set(todo) | {path} | set(_chain(floor, path) if floor else ()):
        if floor and not (p == floor or p.startswith(floor + os.sep)):
            continue
        st = os.stat(p)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(p, mode)


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
