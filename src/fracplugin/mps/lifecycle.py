"""Daemon process lifecycle of the MPS supervisor: start, restart with
backoff, hard kill, leftover servers, shutdown.

``DaemonProcesses`` spawns ``nvidia-cuda-mps-control`` (``-f`` as our child,
or ``-d`` detached in the MPS role, ADR 0009) after preparing the pipe and log
directories (0755 whatever the umask, stale sockets and released namespace
leaves removed); plans the next start after an exit or a confirmed hang
(tenacity backoff; ``max_restarts`` only decides when the daemon is reported
``failed``, it is retried forever, issue 12); SIGKILLs a hung daemon with its
servers; and stops every daemon on ``stop()``/``quit_daemons()`` (``quit``,
wait, SIGKILL, then leftover ``nvidia-cuda-mps-server`` processes whose pipe
directory lies under our MPS root). Called from the supervisor thread, and
from the caller's thread for the shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from typing import IO, Any

from ..atomicfile import write_atomically
from ..model import ComputeMode
from .api import RESOURCE_ERRNOS, MpsError
from .control import render_config_toml
from .layout import SM_SERVER
from .procs import PID_FILE, DetachedProc, live_daemon, make_dir, read_pid, root_problem, unlink_socket
from .state import DaemonState, SupervisorCore, control_log_size

log = logging.getLogger("fracplugin.mps.supervisor")


class DaemonProcesses:
    """Starts, kills and stops the control daemons of one supervisor (state in ``c``)."""

    def __init__(self, c: SupervisorCore) -> None:
        self.c = c

    def prepare_dirs(self, d: DaemonState) -> None:
        """Pipe and log directories 0755 whatever the umask (chmod, not
        makedirs' mode), every directory from the root down traversable.
        Raises OSError naming the directory when an ancestor of the root is not
        traversable by other users: containers (any UID) could not reach their
        pipes, so the daemon must not be reported ready."""
        problem = root_problem(self.c.layout.root)
        if problem:
            raise OSError(problem)
        for path in (d.pipe_dir, d.log_dir):
            make_dir(path, self.c.layout.root)

    def command_line(self, d: DaemonState) -> list[str]:
        """The daemon's argv (v3: writes ``<log dir>/mps-control.toml`` first: ``-p 3 -m -f|-d -a <toml>``; v2:
        ``-f|-d``). Raises OSError."""
        if self.c.protocol >= 3:
            cfg = os.path.join(d.log_dir, "mps-control.toml")
            sm = d.mode is ComputeMode.SM_SHARING
            text = render_config_toml(sm_sharing=sm, servers=(SM_SERVER,))
            write_atomically(cfg, text, mode=0o644)
            # -m (multiuser) on both daemons: root-owned named servers that
            # clients of any UID attach to (docs/reference/mps-nvml.md 1.6, 2.3); context-share
            # (config above) is what makes one sm-sharing and the other time-sliced.
            argv = [self.c.control_binary, "-p", "3", "-m"]
            return argv + ["-d" if self.c.detached else "-f", "-a", cfg]
        return [self.c.control_binary, "-d" if self.c.detached else "-f"]

    def start_daemon(self, d: DaemonState) -> None:
        """Start the daemon of ``d`` (directories, stale sockets and servers cleaned first); state ``starting``.
        A failed start schedules the next one (a resource error of ours spends no budget). Never raises for
        OSError/ValueError."""
        now = self.c.clock()
        try:
            self.prepare_dirs(d)
            if self.c.detached:
                self.kill_unanswering(d)
            self.clean_stale_leaves(d)
            for leaf in ("control", PID_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(d.pipe_dir, leaf))  # stale socket of a dead daemon
            self.kill_servers(d, scan=False)
            argv = self.command_line(d)
            env = d.control.env  # with CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY
            d.log_offset = control_log_size(d)
            proc: Any
            with open(os.path.join(d.log_dir, "daemon.out"), "ab") as out:  # the daemon writes through its own fd
                if self.c.detached:
                    proc = self.spawn_detached(d, argv, env, out)
                else:
                    proc = subprocess.Popen(
                        argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                        env=env, close_fds=True, start_new_session=True, umask=0o022,
                    )
        except (OSError, ValueError) as e:
            log.error("cannot start MPS %s daemon: %s", d.mode.value, e)
            resource = isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS
            with self.c.lock:
                d.last_error = f"start: {e}"
                if resource:
                    d.resource_errors += 1
            # Out of descriptors/memory is this process's fault, not the daemon's: retry after the
            # longest backoff without spending the restart budget (issue 13 item 1).
            self.schedule_restart(d, f"start failed: {e}", consume_budget=not resource,
                                   delay_s=self.c.resource_retry_s if resource else None)
            return
        with self.c.lock:
            abort = self.c.stopping.is_set()
            if not abort:
                if d.starts:
                    d.restarts += 1
                d.starts += 1
                d.proc = proc
        if abort:  # stop() began while we were spawning: undo
            proc.kill()
            proc.wait()
            return
        with self.c.lock:
            d.state = "starting"
            d.started_at = now
            d.ready_at = None
            d.probe_failures = 0
        threading.Thread(target=self.waiter, args=(proc,), name=f"mps-wait-{proc.pid}", daemon=True).start()
        log.info("started MPS %s daemon pid %d: %s", d.mode.value, proc.pid, " ".join(argv))

    def clean_stale_leaves(self, d: DaemonState) -> None:
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
        with self.c.lock:
            keep = {n for n, r in self.c.namespaces.items() if r.mode is d.mode}
        for leaf in [server_dir] + [e.path for e in entries if e.is_dir(follow_symlinks=False)]:
            unlink_socket(os.path.join(leaf, "control"))
            if leaf != server_dir and os.path.basename(leaf) not in keep:
                with contextlib.suppress(OSError):
                    os.rmdir(leaf)

    def kill_unanswering(self, d: DaemonState) -> None:
        """Before a detached start: a control daemon of ours still alive (it
        failed adoption or a probe) is SIGKILLed with its servers, so that two
        daemons never share a pipe directory."""
        pid = live_daemon(d.pipe_dir, self.c.control_binary)
        if pid is not None and pid != os.getpid():
            with self.c.lock:
                d.server_pids |= self.child_servers(pid)
            self.sigkill(d, DetachedProc(pid))
            self.kill_servers(d, scan=False)

    def spawn_detached(self, d: DaemonState, argv: list[str], env: dict[str, str], out: IO[bytes]) -> DetachedProc:
        """``nvidia-cuda-mps-control -d``: the daemon forks into its own session
        and the launcher exits once the socket is up; its PID is read from
        ``<pipe>/nvidia-cuda-mps-control.pid`` (docs/reference/mps-nvml.md 1.4). Raises OSError."""
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                               close_fds=True, start_new_session=True, timeout=self.c.start_timeout_s,
                               umask=0o022)
        except subprocess.TimeoutExpired:
            raise OSError(f"{' '.join(argv)} did not return within {self.c.start_timeout_s:g}s") from None
        if r.returncode != 0:
            raise OSError(f"{' '.join(argv)} exited with status {r.returncode} (see {d.log_dir}/daemon.out)")
        deadline = time.monotonic() + min(5.0, self.c.start_timeout_s)
        while (pid := read_pid(d.pipe_dir)) is None:
            if time.monotonic() >= deadline:
                raise OSError(f"{d.pipe_dir}/{PID_FILE} did not appear after the daemon started")
            time.sleep(0.01)
        return DetachedProc(pid)

    def waiter(self, proc: "subprocess.Popen[bytes] | DetachedProc") -> None:
        """Body of the per-daemon waiter thread: block until ``proc`` exits (reaping it), then wake the
        supervisor thread."""
        try:
            proc.wait()
        finally:
            self.c.wake.set()

    def release_proc(self, d: DaemonState) -> None:
        """Forget ``d``'s process (closing its stdin); state ``stopped``, unhealthy."""
        with self.c.lock:
            proc = d.proc
            d.proc = None
            d.state = "stopped"
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        self.c.set_health(d, False)

    def release_all(self) -> None:
        """Forget the daemons without stopping them (detached stop)."""
        with self.c.lock:
            for d in self.c.daemons.values():
                d.proc = None
                d.state = "stopped"
                d.healthy = False

    def child_servers(self, pid: int) -> set[int]:
        """PIDs of ``nvidia-cuda-mps-server`` processes whose parent is ``pid``."""
        return {p for p in self.c.procfs.pids_by_exe(self.c.server_exe) if self.c.procfs.ppid(p) == pid}

    def sigkill(self, d: DaemonState, proc: "subprocess.Popen[bytes] | DetachedProc") -> None:
        """SIGKILL ``proc`` (``d``'s daemon) and wait up to 5 s for it to go (logged when it does not)."""
        with contextlib.suppress(OSError):
            proc.kill()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            log.error("MPS %s daemon pid %d did not die after SIGKILL", d.mode.value, proc.pid)

    def hard_kill(self, d: DaemonState) -> None:
        """SIGKILL the daemon and its servers (wedged/hung daemon)."""
        proc = d.proc
        if proc is not None:
            with self.c.lock:
                d.server_pids |= self.child_servers(proc.pid)
            self.sigkill(d, proc)
        self.release_proc(d)
        self.kill_servers(d, scan=False)

    def kill_servers(self, d: DaemonState | None, scan: bool) -> list[int]:
        """SIGKILL servers known for ``d`` (verified by exe basename), or with
        ``scan`` every process whose ``/proc/<pid>/exe`` basename is the server's
        and whose ``CUDA_MPS_PIPE_DIRECTORY`` (inherited from our control
        daemon) lies under our MPS root: another MPS stack on the node (NVIDIA's
        device plugin, a user's daemon) is never touched."""
        with self.c.lock:
            pids = set(d.server_pids) if d is not None else set()
            if d is not None:
                d.server_pids.clear()
        if scan:
            root = self.c.layout.root.rstrip("/") + "/"
            pids |= {
                p for p in self.c.procfs.pids_by_exe(self.c.server_exe)
                if (self.c.procfs.environ_value(p, "CUDA_MPS_PIPE_DIRECTORY") or "").startswith(root)
            }
        killed = []
        for pid in sorted(pids):
            if self.c.procfs.exe_basename(pid) != self.c.server_exe:
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
            while time.monotonic() < deadline and any(self.c.procfs.exe_basename(p) == self.c.server_exe for p in killed):
                time.sleep(0.01)
        return killed

    def schedule_restart(self, d: DaemonState, reason: str, consume_budget: bool,
                          delay_s: float | None = None) -> None:
        """Plan the next start of ``d``: after the backoff of its budget, or
        after ``delay_s`` seconds when given with ``consume_budget=False``."""
        now = self.c.clock()
        with self.c.lock:
            d.last_error = reason
            if self.c.stopping.is_set():
                d.state = "stopped"
                return
            state = "backoff"
            if consume_budget:
                d.budget_used += 1
                delay = self.c.backoff_s(d.budget_used)
                if self.c.max_restarts and d.budget_used > self.c.max_restarts:
                    # The budget only decides when the daemon is reported failed:
                    # it is retried forever at the capped backoff (issue 12).
                    if d.state != "failed":
                        log.error("MPS %s daemon: %d restarts failed, reported failed, retrying every %gs: %s",
                                  d.mode.value, self.c.max_restarts, delay, reason)
                    state = "failed"
            else:
                delay = 0.0 if delay_s is None else max(0.0, float(delay_s))
            d.state = state
            d.next_start_at = now + delay
        self.c.set_health(d, False)
        self.c.wake.set()

    def shutdown_all(self, timeout_s: float) -> None:
        """Stop every daemon within ``timeout_s`` seconds (one shutdown at a time; see ``shutdown_locked``)."""
        with self.c.shutdown_lock:
            self.shutdown_locked(timeout_s)

    def shutdown_locked(self, timeout_s: float) -> None:
        """``quit`` (stdin, or the control socket when detached), wait until the deadline, SIGKILL, kill leftover
        servers, remove stale ``control`` sockets (and, of a daemon that is gone, its server and namespace
        sockets: ``clean_stale_leaves``). Caller holds ``shutdown_lock``."""
        deadline = time.monotonic() + timeout_s
        daemons = list(self.c.daemons.values())
        with self.c.lock:
            procs = {d.mode: d.proc for d in daemons}
        for d in daemons:
            proc = procs[d.mode]
            if proc is None and self.c.detached:
                # quit_daemons() after a detached stop: find the daemon again.
                pid = live_daemon(d.pipe_dir, self.c.control_binary)
                if pid is not None:
                    procs[d.mode] = proc = DetachedProc(pid)
            if proc is None or proc.poll() is not None:
                continue
            with self.c.lock:
                d.server_pids |= self.child_servers(proc.pid)
            if proc.stdin is None:  # detached: quit through the control socket
                try:
                    d.control.quit(max(0.5, min(self.c.probe_timeout_s, deadline - time.monotonic())))
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
                self.sigkill(d, proc)
            self.release_proc(d)
        for d in daemons:
            self.kill_servers(d, scan=False)
        self.kill_servers(None, scan=True)
        for d in daemons:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d.pipe_dir, "control"))
            proc = procs[d.mode]
            if proc is None or proc.poll() is not None:
                # A daemon that died uncleanly (SIGKILLed here, or hard-killed by a confirmed hang and
                # not restarted yet) left its server and namespace sockets: nothing serves them now.
                self.clean_stale_leaves(d)
            with self.c.lock:
                d.state = "stopped"

