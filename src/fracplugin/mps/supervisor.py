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
* start: pipe/log directories from ``MpsLayout`` (ancestors made traversable),
  stale ``control`` socket removed, stdin kept open (``-f`` exits on EOF);
  v3: ``-p 3 [-m] -f -a <log dir>/mps-control.toml`` (memacct on; the
  sm-sharing daemon with ``-m`` and a ``[servers.shared]`` server); v2: ``-f``
  plus ``set_default_active_thread_percentage`` /
  ``set_default_device_pinned_mem_limit`` when configured;
* ready when the ``control`` socket exists and a real command answers;
* an active probe every ``probe_interval_s`` (v3 ``server list``, v2
  ``get_default_active_thread_percentage``) with ``probe_timeout_s``; a hung
  daemon fails it and is killed and restarted;
* restarts with exponential backoff (tenacity ``wait_chain(wait_none(),
  wait_exponential)``: the first retry is immediate), a budget of
  ``max_restarts`` consecutive restarts (0 = unlimited) that resets after
  ``stable_uptime_s`` of healthy uptime; an exhausted budget leaves the daemon
  ``failed`` (unhealthy) until ``stop``;
* recorded sm-sharing namespaces are re-created and re-capped after every restart;
* drain: a container's clients (v3 ``client list`` / v2 ``get_client_list``)
  joined with ``/proc/<pid>/cgroup`` are terminated within the caller's budget;
  a timeout or failure marks the daemon wedged: it is hard-restarted (SIGKILL
  daemon + its servers) by the supervisor thread and ``wedges`` is counted;
* stop: ``quit`` on stdin, wait, SIGKILL, then SIGKILL every leftover
  ``nvidia-cuda-mps-server`` found by ``/proc/<pid>/exe`` basename.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Mapping, Sequence

import tenacity

from ..model import ComputeMode
from ..procfs import ProcFs, container_id_matches
from .api import RESOURCE_ERRNOS, DrainResult, HealthCallback, MpsError, MpsResourceError, MpsTimeout
from .control import MpsControl, choose_protocol, render_config_toml, set_exclusive_process
from .layout import SM_SERVER, MpsLayout, namespace_name

__all__ = ["MpsSupervisor", "SERVER_EXE", "STATES", "DaemonState"]

log = logging.getLogger(__name__)

SERVER_EXE = "nvidia-cuda-mps-server"
STATES = ("stopped", "starting", "ready", "unhealthy", "backoff", "failed")
"""Values of ``status()["daemons"][i]["state"]``."""


@dataclass
class _NsRecord:
    pod_uid: str
    container: str
    active_thread_percentage: int | None


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
    proc: subprocess.Popen[bytes] | None = None
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
    ns_lock: threading.Lock = field(default_factory=threading.Lock)


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
        metrics: Any = None,
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
        self._pending_delete: set[str] = set()
        self._draining: set[str] = set()
        self._daemons: dict[ComputeMode, DaemonState] = {}
        for mode in sorted(modes, key=lambda m: m.value, reverse=True):  # time-slicing first
            pipe, logd = layout.pipe_dir(mode), layout.log_dir(mode)
            self._daemons[mode] = DaemonState(
                mode=mode, pipe_dir=pipe, log_dir=logd,
                control=MpsControl(control_binary, pipe, self.protocol, logd, env=env),
            )
        if metrics is not None and hasattr(metrics, "attach_mps"):
            metrics.attach_mps(self)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the supervisor thread; it starts the daemons at once. Idempotent.
        Returns immediately (use ``ready()`` / ``wait_ready()`` to wait)."""
        with self._lock:
            if self._thread is not None:
                return
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="fracplugin-mps-supervisor", daemon=True)
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
        # Shut down from the caller's thread: the supervisor thread may be in
        # the middle of a probe (bounded by probe_timeout_s) and must not
        # delay the stop; it starts nothing once _stopping is set.
        self._shutdown_all(timeout_s)
        if thread is not None and thread.is_alive():
            thread.join(max(0.5, deadline - time.monotonic()))
        with self._lock:
            self._thread = None

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
        d = self._daemons.get(ComputeMode(mode))
        if d is None:
            return False
        with self._lock:
            return d.healthy

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
                ns = []
                if d.mode is ComputeMode.SM_SHARING:
                    ns = [
                        {"name": n, "pod_uid": r.pod_uid, "container": r.container,
                         "active_thread_percentage": r.active_thread_percentage}
                        for n, r in sorted(self._namespaces.items())
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
                })
            return {
                "enabled": True,
                "protocol": self.protocol,
                "driver_version": self.driver_version,
                "ready": all(d.healthy for d in self._daemons.values()),
                "daemons": daemons,
            }

    # ------------------------------------------------------------------ namespaces

    def ensure_namespace(
        self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float
    ) -> str:
        """Create and cap the MPS v3 namespace of an sm-sharing container, before
        it starts; return its host pipe directory (``layout.namespace_pipe_dir``).

        The namespace is ``namespace_name(pod_uid, container)`` on server
        ``shared`` of the sm-sharing daemon, capped with ``namespace set
        --active-thread-percentage`` when a percentage is given (None = the
        server's 100 %). Idempotent: an existing namespace with the same cap is
        left alone; a different cap is re-set (which MPS refuses while a client
        is attached: MpsError). The request is recorded and re-applied after every
        daemon restart until ``release_namespace``.

        Never blocks past ``timeout_s``. Raises MpsError (no sm-sharing daemon,
        protocol 2, daemon not ready, command refused), MpsTimeout, ValueError
        (percentage outside 1..100).
        """
        t_deadline = time.monotonic() + float(timeout_s)
        if active_thread_percentage is not None and not 1 <= int(active_thread_percentage) <= 100:
            raise ValueError(f"active thread percentage must be 1..100, got {active_thread_percentage!r}")
        d = self._daemons.get(ComputeMode.SM_SHARING)
        if d is None:
            raise MpsError("no sm-sharing MPS daemon is supervised on this node")
        if self.protocol < 3:
            raise MpsError("per-container MPS namespaces need MPS v3 (driver r615+); this node runs protocol 2")
        name = namespace_name(pod_uid, container)
        rec = _NsRecord(pod_uid, container, None if active_thread_percentage is None else int(active_thread_percentage))
        with self._lock:
            prev = self._namespaces.get(name)
            self._namespaces[name] = rec
            self._pending_delete.discard(name)
            up = d.state == "ready" and d.proc is not None
        try:
            if not up:
                raise MpsError(f"the sm-sharing MPS daemon is not ready (state {d.state})")
            self._apply_namespace(d, name, rec.active_thread_percentage, t_deadline)
        except BaseException:
            with self._lock:
                if self._namespaces.get(name) is rec:
                    if prev is None:
                        del self._namespaces[name]
                    else:
                        self._namespaces[name] = prev
            raise
        return self.layout.namespace_pipe_dir(name)

    def release_namespace(self, pod_uid: str, container: str) -> bool:
        """Forget the container's namespace and delete it from the daemon
        (``namespace delete``, bounded by ``probe_timeout_s``). MPS refuses the
        delete while a client is attached: then the delete is retried after each
        probe. Returns True when the namespace is gone now. Never raises for MPS errors."""
        name = namespace_name(pod_uid, container)
        d = self._daemons.get(ComputeMode.SM_SHARING)
        with self._lock:
            self._namespaces.pop(name, None)
            self._pending_delete.add(name)
        if d is None or self.protocol < 3:
            with self._lock:
                self._pending_delete.discard(name)
            return True
        return self._try_delete(d, name, time.monotonic() + self.probe_timeout_s)

    def _try_delete(self, d: DaemonState, name: str, deadline: float) -> bool:
        try:
            if not d.ns_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                with self._lock:
                    if name not in self._pending_delete:
                        return name not in self._namespaces
                rows = d.control.namespace_list(SM_SERVER, deadline - time.monotonic())
                if any(r.name == name for r in rows):
                    d.control.namespace_delete(name, SM_SERVER, deadline - time.monotonic())
            finally:
                d.ns_lock.release()
        except (MpsError, ValueError) as e:
            log.info("namespace %s not deleted yet: %s", name, e)
            return False
        with self._lock:
            self._pending_delete.discard(name)
        return True

    def _apply_namespace(self, d: DaemonState, name: str, atp: int | None, deadline: float,
                         fresh: bool = False) -> None:
        def left() -> float:
            return deadline - time.monotonic()

        if not d.ns_lock.acquire(timeout=max(0.0, left())):
            raise MpsTimeout(f"namespace {name}: another namespace operation is still running")
        try:
            row = None
            if not fresh:
                rows = d.control.namespace_list(SM_SERVER, left())
                row = next((r for r in rows if r.name == name), None)
            if row is None:
                d.control.namespace_create(name, SM_SERVER, left())
                if atp is not None:
                    try:
                        d.control.namespace_set_atp(name, SM_SERVER, atp, left())
                    except MpsError:
                        # Never leave an uncapped namespace behind.
                        try:
                            d.control.namespace_delete(name, SM_SERVER, max(left(), 0.5), force=True)
                        except MpsError as e2:
                            log.warning("could not remove uncapped namespace %s: %s", name, e2)
                        raise
            elif atp is not None and row.active_thread_percentage != atp:
                d.control.namespace_set_atp(name, SM_SERVER, atp, left())
        finally:
            d.ns_lock.release()

    # ------------------------------------------------------------------ drain

    def drain(self, container_id: str, timeout_s: float) -> DrainResult:
        """Terminate the MPS clients of a stopping container (NRI StopContainer).

        Clients come from every running daemon (v3 ``client list --all
        --format=csv,noheader``; v2 ``get_server_list`` + ``get_client_list``),
        joined with ``/proc/<pid>/cgroup`` (procfs.container_id_matches). Each
        is terminated (v3 ``client terminate <pid>``, v2 ``terminate_client``)
        within what is left of ``timeout_s``. A timeout or failure means the
        daemon is wedged: ``wedges`` is counted and a hard restart is handed to
        the supervisor thread (this call does not wait for it).

        Never blocks past ``timeout_s`` (plus process start jitter); never raises
        for MPS errors (they are in ``DrainResult.errors``). A second drain of the
        same container while one runs returns ``skipped=True`` at once.
        """
        t0 = time.monotonic()
        deadline = t0 + max(0.0, float(timeout_s))
        with self._lock:
            if container_id in self._draining:
                return DrainResult(container_id, skipped=True, errors=("a drain of this container is in progress",))
            self._draining.add(container_id)
            daemons = [d for d in self._daemons.values() if d.proc is not None and d.state in ("ready", "unhealthy")]
        clients: list[int] = []
        terminated: list[int] = []
        errors: list[str] = []
        restarted: list[ComputeMode] = []
        try:
            for d in daemons:
                if self._drain_one(d, container_id, deadline, clients, terminated, errors):
                    restarted.append(d.mode)
        finally:
            with self._lock:
                self._draining.discard(container_id)
        return DrainResult(
            container_id=container_id,
            clients=tuple(clients),
            terminated=tuple(terminated),
            wedged=bool(restarted),
            restarted=tuple(restarted),
            skipped=not daemons,
            errors=tuple(errors),
            elapsed_s=time.monotonic() - t0,
        )

    def _drain_one(
        self, d: DaemonState, cid: str, deadline: float, clients: list[int], terminated: list[int], errors: list[str]
    ) -> bool:
        """Drain one daemon; returns True when it was declared wedged."""

        def left() -> float:
            return deadline - time.monotonic()

        try:
            if self.protocol >= 3:
                pairs = [(None, r.pid) for r in d.control.client_list(left())]
            else:
                pairs = []
                for spid in d.control.get_server_list(left()):
                    pairs += [(spid, c) for c in d.control.get_client_list(spid, left())]
        except MpsTimeout as e:
            errors.append(f"{d.mode.value}: client list: {e}")
            self._request_restart(d, "wedged: client list timed out")
            return True
        except MpsError as e:
            errors.append(f"{d.mode.value}: client list: {e}")
            return False
        mine = []
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
                self._request_restart(d, f"wedged: terminate {pid}: {e}")
                return True
        return False

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
            self._shutdown_all(0.0)  # anything started while stop() was running

    def _next_wait(self) -> float:
        now = self._clock()
        waits = [0.5]
        with self._lock:
            for d in self._daemons.values():
                if d.state == "starting" or d.restart_request:
                    waits.append(0.02)
                elif d.state == "backoff":
                    waits.append(d.next_start_at - now)
                elif d.state in ("ready", "unhealthy"):
                    waits.append(d.next_probe_at - now)
                    if self._pending_delete:
                        waits.append(self.probe_interval_s)
        return min(max(w, 0.005) for w in waits)

    def _step(self, d: DaemonState) -> None:
        now = self._clock()
        if d.state == "failed":
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
        if d.proc is None and d.state in ("stopped", "backoff") and now >= d.next_start_at:
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

    def _after_ready(self, d: DaemonState, probe_s: float) -> None:
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
            if d.mode is ComputeMode.SM_SHARING:
                d.restore_pending = set(self._namespaces)
                self._pending_delete.clear()  # a fresh daemon has no namespaces
        self._apply_defaults(d)
        self._restore(d, fresh=True)
        self._set_health(d, not d.restore_pending)
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
        if d.mode is not ComputeMode.SM_SHARING or self.protocol < 3:
            return
        for name in sorted(d.restore_pending):
            with self._lock:
                rec = self._namespaces.get(name)
            if rec is None:
                with self._lock:
                    d.restore_pending.discard(name)
                continue
            try:
                self._apply_namespace(d, name, rec.active_thread_percentage,
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
        dur = time.monotonic() - t0
        t = self._clock()
        with self._lock:
            d.last_probe_at = t
            d.last_probe_ok = ok
            d.last_probe_s = dur
            d.next_probe_at = t + self.probe_interval_s
            if ok:
                d.probe_failures = 0
                d.state = "ready"
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
            self._set_health(d, not d.restore_pending)
            return
        self._set_health(d, False)
        if d.proc is not None and d.proc.poll() is not None:
            return  # it died meanwhile: the exit path restarts it on the next step
        log.warning("MPS %s probe failed (%d): %s", d.mode.value, failures, err)
        if failures >= self.probe_failure_threshold:
            self._hard_kill(d)
            self._schedule_restart(d, f"probe failed: {err}", consume_budget=True)

    def _sweep_deletes(self, d: DaemonState) -> None:
        if d.mode is not ComputeMode.SM_SHARING or self.protocol < 3:
            return
        with self._lock:
            names = sorted(self._pending_delete)
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
        root = self.layout.root
        for path in (d.pipe_dir, d.log_dir):
            os.makedirs(path, mode=0o755, exist_ok=True)
        # Containers run as any UID: every directory from the root down to the
        # pipe directory must be traversable (o+x) and the pipe dir readable.
        for path in _chain(root, d.pipe_dir):
            try:
                st = os.stat(path)
                if st.st_mode & 0o005 != 0o005:
                    os.chmod(path, stat.S_IMODE(st.st_mode) | 0o755)
            except OSError as e:
                log.warning("cannot make %s traversable: %s", path, e)
        parent = os.path.dirname(root.rstrip("/"))
        while parent and parent != "/":
            try:
                if not os.stat(parent).st_mode & 0o001:
                    log.warning("%s is not traversable by other users; containers cannot reach %s", parent, root)
                    break
            except OSError:
                break
            parent = os.path.dirname(parent)

    def _argv(self, d: DaemonState) -> list[str]:
        if self.protocol >= 3:
            cfg = os.path.join(d.log_dir, "mps-control.toml")
            sm = d.mode is ComputeMode.SM_SHARING
            text = render_config_toml(sm_sharing=sm, servers=(SM_SERVER,))
            tmp = cfg + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, cfg)
            argv = [self.control_binary, "-p", "3"]
            if sm:
                argv.append("-m")
            return argv + ["-f", "-a", cfg]
        return [self.control_binary, "-f"]

    def _start_daemon(self, d: DaemonState) -> None:
        now = self._clock()
        try:
            self._prepare_dirs(d)
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
            out = open(os.path.join(d.log_dir, "daemon.out"), "ab")
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                    env=env, close_fds=True, start_new_session=True,
                )
            except BaseException:
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

    def _waiter(self, proc: subprocess.Popen[bytes]) -> None:
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
            if consume_budget:
                d.budget_used += 1
                if self.max_restarts and d.budget_used > self.max_restarts:
                    d.state = "failed"
                    log.error("MPS %s daemon: retry budget (%d) exhausted: %s", d.mode.value, self.max_restarts, reason)
                    delay = None
                else:
                    delay = self._backoff_s(d.budget_used)
            else:
                delay = 0.0 if delay_s is None else max(0.0, float(delay_s))
            if delay is not None:
                d.state = "backoff"
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
            if proc is None or proc.poll() is not None:
                continue
            with self._lock:
                d.server_pids |= self._child_servers(proc.pid)
            try:
                assert proc.stdin is not None
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
