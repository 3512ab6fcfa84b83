"""Shared state of the MPS supervisor: per-daemon bookkeeping, the recorded
namespaces and the one lock that guards them.

``SupervisorCore`` is what every part of the supervisor (``lifecycle``,
``probing``, ``namespaces``, ``drain``, and the ``MpsSupervisor`` facade in
``supervisor``) is given: the settings, the clock, ``lock`` (an RLock held
for microseconds, never across a subprocess), ``wake`` (wakes the supervisor
thread), ``stopping``, the daemons by mode, the recorded namespaces, the
namespaces still to delete and the containers being drained. It decides
nothing on its own except the health bit (``set_health`` runs the
subscribers) and the backoff schedule.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import tenacity

from ..model import ComputeMode
from ..procfs import ProcFs
from ..logs import guarded
from .api import HealthCallback
from .control import MpsControl, choose_protocol
from .layout import MpsLayout
from .procs import SERVER_EXE, DetachedProc

log = logging.getLogger("fracplugin.mps.supervisor")  # every part logs as the supervisor

_SHARED_PIPE_EXPOSURE = (
    "MPS protocol 2 has no namespaces: tenants of a mode share that daemon's pipe directory "
    "(read-only mount) and can reach its control socket (list, and as root set/quit)")


@dataclass
class NsRecord:
    """One recorded namespace: whose it is (pod UID, container name), its daemon's
    compute mode and its caps (active thread percentage 1..100 or None = 100 %;
    pinned device memory limit in MiB per GPU or None = none). Written as JSON
    with ``dataclasses.asdict`` (``state_file``, ``status()``)."""

    pod_uid: str
    container: str
    active_thread_percentage: int | None
    mode: ComputeMode = ComputeMode.SM_SHARING
    pinned_limit_mib: int | None = None


SERVER_EXIT_RE = re.compile(r"server(?:\s+\S+)?\s+exited with status (-?\d+)", re.IGNORECASE)
"""A server exit in ``control.log`` (what the control daemon logs when one of its
``nvidia-cuda-mps-server`` processes dies; docs/reference/mps-nvml.md 1.4: control.log holds
server status). A non-zero status counts towards a crash loop."""


def parse_mib(value: str) -> int | None:
    """``"12288M"`` / ``"12G"`` / ``"1024K"`` -> MiB (None for ``-`` / empty / unknown)."""
    m = re.match(r"^\s*(\d+)\s*([KMG])?i?B?\s*$", value or "", re.IGNORECASE)
    if not m:
        return None
    n, unit = int(m.group(1)), (m.group(2) or "M").upper()
    return {"K": n // 1024, "M": n, "G": n * 1024}[unit]


def control_log_size(d: "DaemonState") -> int:
    """Bytes in ``<log dir>/control.log`` (0 when absent): where the crash-loop
    reader starts after a (re)start."""
    try:
        return os.path.getsize(os.path.join(d.log_dir, "control.log"))
    except OSError:
        return 0


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
    proc: "subprocess.Popen[bytes] | DetachedProc | None" = None
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
    probe_timeouts: int = 0  # consecutive probes that timed out (not refused): the next one waits longer
    last_probe_s: float | None = None
    last_probe_ok: bool | None = None
    last_probe_at: float | None = None
    next_probe_at: float = 0.0
    next_start_at: float = 0.0
    last_error: str = ""
    server_pids: set[int] = field(default_factory=set)
    restore_pending: set[str] = field(default_factory=set)
    applied: dict[str, "NsRecord"] = field(default_factory=dict)
    """Namespaces this daemon process was seen to hold with these caps (a
    create/set/list that succeeded since it became ready): an ensure of the
    same record skips the control commands (issue 14). Emptied when the daemon
    becomes ready again (a restart or an adoption re-applies every recorded
    namespace first) and per name on a release or a failed apply."""
    ns_lock: threading.Lock = field(default_factory=threading.Lock)
    orphans: dict[str, bool] = field(default_factory=dict)
    """The daemon's namespaces no record owns at the last audit: name -> capped (``NamespaceBook.audit``)."""
    adopted: bool = False
    adopt_tried: bool = False
    control_id: tuple[int, int] | None = None
    log_offset: int | None = None
    server_exits: list[float] = field(default_factory=list)
    crash_loop: str = ""
    slow: str = ""


class SupervisorCore:
    """Settings and shared mutable state of one ``MpsSupervisor`` (its base;
    the arguments are ``MpsSupervisor``'s, normalised here; the parts get it as
    ``c``). Raises ValueError for an empty ``modes`` or a bad protocol."""

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
        exclusive_process_gpus: Iterable[str] = (),
        detached: bool = False,
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
        self.server_exe = SERVER_EXE
        self.exclusive_process_gpus = tuple(exclusive_process_gpus)
        self.detached = bool(detached)
        self.state_file = os.path.join(layout.root, "namespaces.json") if self.detached else None
        self.crash_loop_exits = max(1, int(crash_loop_exits))
        self.crash_loop_window_s = float(crash_loop_window_s)
        self.shared_pipe_exposure = _SHARED_PIPE_EXPOSURE if self.protocol < 3 else ""
        self.clock = clock
        self.procfs = ProcFs(proc_root)
        self.resource_retry_s = min(1.0, float(backoff_max_s))  # retry after EMFILE & co (no budget spent)
        self.wait = tenacity.wait_chain(
            tenacity.wait_none(), tenacity.wait_exponential(multiplier=backoff_base_s, max=backoff_max_s)
        )
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.shutdown_lock = threading.Lock()
        self.subscribers: list[HealthCallback] = []
        self.namespaces: dict[str, NsRecord] = {}
        self.pending_delete: dict[str, ComputeMode] = {}
        self.draining: set[str] = set()
        self.daemons = self.make_daemons(env)
        self._build()

    def _build(self) -> None:
        """Called last by ``__init__``: ``MpsSupervisor`` builds its parts here."""

    def set_health(self, d: DaemonState, healthy: bool) -> None:
        """Set ``d``'s health bit; on a change, run every subscriber (exceptions logged). Never reports healthy
        once stopping or without a process."""
        with self.lock:
            if healthy and (self.stopping.is_set() or d.proc is None):
                healthy = False  # a step that raced stop() must not report a dead daemon healthy
            if d.healthy == healthy:
                return
            d.healthy = healthy
            subs = list(self.subscribers)
        for cb in subs:
            guarded(log, "MPS health callback", cb, d.mode, healthy)

    def backoff_s(self, attempt: int) -> float:
        """Delay before restart ``attempt`` (1-based): 0 for the first, then
        ``backoff_base_s * 2**(attempt-1)`` capped at ``backoff_max_s`` (tenacity)."""
        rs = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        rs.attempt_number = max(1, attempt)
        return float(self.wait(rs))

    def reason(self, d: DaemonState) -> str:
        """Why ``d`` is not healthy, in words ("" when it is). Caller holds the lock."""
        if d.healthy:
            return ""
        if d.crash_loop:
            return d.crash_loop
        if d.state == "failed":
            return f"failed after {d.budget_used} restarts, retrying every {self.backoff_s(10**6):g}s: {d.last_error}"
        if d.state in ("backoff", "stopped"):
            return f"down ({d.state}): {d.last_error}" if d.last_error else f"down ({d.state})"
        if d.state == "starting":
            return "starting"
        if d.restore_pending:
            return f"restoring {len(d.restore_pending)} namespace(s)"
        return f"{d.state}: {d.last_error}" if d.last_error else d.state

    def make_daemons(self, env: Mapping[str, str] | None) -> dict[ComputeMode, DaemonState]:
        """One ``DaemonState`` per supervised mode, time-slicing first."""
        daemons: dict[ComputeMode, DaemonState] = {}
        for mode in sorted(self.modes, key=lambda m: m.value, reverse=True):
            pipe, logd = self.layout.pipe_dir(mode), self.layout.log_dir(mode)
            daemons[mode] = DaemonState(mode=mode, pipe_dir=pipe, log_dir=logd,
                                        control=MpsControl(self.control_binary, pipe, self.protocol, logd, env=env))
        return daemons
