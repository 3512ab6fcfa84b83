"""Per-container MPS namespaces of the supervisor: create, cap, release,
restore after a restart, and the record kept on disk.

``NamespaceBook`` owns ``c.namespaces`` (what the doors asked for: pod UID,
container, mode, active thread percentage, pinned device memory limit in MiB)
and ``c.pending_delete`` (released, still to be deleted from a daemon). The
repair rule (ADR 0034, issue 35 item 4): a ``namespace create`` or ``set`` that
timed out on our side may still be carried out by the daemon, so its record is
kept and the probe thread lists and finishes it (``restore``), or deletes it
once released; after each answered probe ``audit`` counts the namespaces the
daemon holds that no record owns (orphans) and deletes the uncapped ones. A
namespace is ``namespace_name(pod_uid, container)`` on server ``shared`` of
the daemon of its mode (MPS v3, driver r615+). Operations on one daemon are
serialised by its ``ns_lock`` (acquired with a timeout); a create/set that
succeeded on the daemon's current process is remembered in ``d.applied`` so
that an ensure of the same record costs no control command (issue 14). In the
MPS role the records are persisted (``state_file``: JSON, tmp + fsync +
rename) so that a restarted role knows whose namespaces it holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict
import logging
import time

from ..atomicfile import write_atomically
from ..model import ComputeMode
from .api import MpsError, MpsTimeout
from .layout import SM_SERVER, namespace_name
from .procs import make_dir
from .state import DaemonState, NsRecord, SupervisorCore, parse_mib

log = logging.getLogger("fracplugin.mps.supervisor")


class NamespaceBook:
    """The recorded namespaces and their application to the daemons (state in ``c``)."""

    def __init__(self, c: SupervisorCore) -> None:
        self.c = c

    def try_delete(self, d: DaemonState, name: str, deadline: float, known: bool = False) -> bool:
        """``namespace delete`` of ``name`` on ``d`` if it is still to be
        deleted. ``known``: the daemon's current process holds it (we applied
        it), so it is deleted without listing first (one control command
        instead of two, issue 14); a failed delete is retried after the next
        probes, which list first."""
        try:
            if not d.ns_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                with self.c.lock:
                    if self.c.pending_delete.get(name) is not d.mode:
                        return name not in self.c.namespaces
                if known or any(r.name == name
                                for r in d.control.namespace_list(SM_SERVER, deadline - time.monotonic())):
                    d.control.namespace_delete(name, SM_SERVER, deadline - time.monotonic())
            finally:
                d.ns_lock.release()
        except (MpsError, ValueError) as e:
            log.info("namespace %s not deleted yet: %s", name, e)
            return False
        with self.c.lock:
            if self.c.pending_delete.get(name) is d.mode:
                del self.c.pending_delete[name]
        return True

    def apply(self, d: DaemonState, name: str, rec: NsRecord, deadline: float, fresh: bool = False) -> None:
        """Create (``fresh``: without listing first) or re-cap namespace ``name`` on ``d`` as ``rec`` says,
        before ``deadline`` (monotonic). Never leaves an uncapped namespace behind. Raises MpsError,
        MpsTimeout."""
        def left() -> float:
            return deadline - time.monotonic()

        if not d.ns_lock.acquire(timeout=max(0.0, left())):
            raise MpsTimeout(f"namespace {name}: another namespace operation is still running")
        with self.c.lock:
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
            # a namespace we just made, or one a timed-out create left without caps (ADR 0034)
            uncapped = row is None or (row.active_thread_percentage is None
                                       and parse_mib(row.pinned_memory_limit) is None)
            try:
                d.control.namespace_set_caps(
                    name, SM_SERVER,
                    atp if atp is not None and (row is None or row.active_thread_percentage != atp) else None,
                    pinned if pinned is not None and (row is None or parse_mib(row.pinned_memory_limit) != pinned)
                    else None, left())
            except MpsError:
                if uncapped and (atp is not None or pinned is not None):
                    # Never leave an uncapped namespace behind (its clients, if any, run unfenced).
                    try:
                        d.control.namespace_delete(name, SM_SERVER, max(left(), 0.5), force=True)
                    except MpsError as e2:
                        log.warning("could not remove uncapped namespace %s: %s", name, e2)
                raise
            with self.c.lock:
                if self.c.namespaces.get(name) == rec:  # not released meanwhile
                    d.applied[name] = rec
                    d.restore_pending.discard(name)
        finally:
            d.ns_lock.release()

    def restore(self, d: DaemonState, fresh: bool = False) -> None:
        """Re-create recorded namespaces (after a (re)start, and retried after probes).
        ``fresh``: the daemon has just started, so it has no namespaces yet (CLI
        changes are not persisted, docs/reference/mps-nvml.md 1.7): skip the listing."""
        if self.c.protocol < 3:
            with self.c.lock:
                d.restore_pending.clear()
            return
        for name in sorted(d.restore_pending):
            with self.c.lock:
                rec = self.c.namespaces.get(name)
            if rec is not None and rec.mode is d.mode:  # else released meanwhile: nothing to restore
                try:
                    self.apply(d, name, rec, time.monotonic() + max(self.c.probe_timeout_s, 1.0) * 2, fresh=fresh)
                except (MpsError, ValueError) as e:
                    with self.c.lock:
                        d.last_error = f"restore {name}: {e}"
                    log.warning("MPS namespace %s not restored yet: %s", name, e)
                    continue
            with self.c.lock:
                d.restore_pending.discard(name)

    def audit(self, d: DaemonState) -> None:
        """After an answered probe (v3): list ``d``'s namespaces; those no record of ``d``'s mode owns and
        no release is deleting are its orphans (``d.orphans``: name -> capped, i.e. an active thread
        percentage or a pinned limit is set). An uncapped orphan is deleted (never ``--force``: MPS refuses
        while a client is attached; it stays counted, and the node not ready, until it goes). Under
        ``ns_lock``, so no create, set or delete of ours is half done; a busy lock or a failed listing keeps
        the last answer."""
        if self.c.protocol < 3 or not d.ns_lock.acquire(timeout=self.c.probe_timeout_s):
            return
        try:
            rows = d.control.namespace_list(SM_SERVER, self.c.probe_timeout_s)
            with self.c.lock:
                found = {r.name: r.active_thread_percentage is not None or parse_mib(r.pinned_memory_limit) is not None
                         for r in rows if r.name != "default" and r.name not in self.c.pending_delete
                         and getattr(self.c.namespaces.get(r.name), "mode", None) is not d.mode}
            for name in [n for n, capped in found.items() if not capped]:
                try:
                    d.control.namespace_delete(name, SM_SERVER, self.c.probe_timeout_s)
                    del found[name]
                    log.warning("deleted MPS namespace %s: no tenant owns it and it has no caps", name)
                except MpsError as e:
                    if name not in d.orphans:  # once, not at every probe
                        log.warning("MPS namespace %s has no owner and no caps, not deleted yet: %s", name, e)
        except (MpsError, ValueError) as e:
            log.info("MPS %s namespaces not audited: %s", d.mode.value, e)
            return
        finally:
            d.ns_lock.release()
        with self.c.lock:
            d.orphans = found

    def sweep_deletes(self, d: DaemonState) -> None:
        """Retry the deletes of namespaces released on ``d`` that MPS refused (a client was attached); after each
        answered probe."""
        if self.c.protocol < 3:
            return
        with self.c.lock:
            names = sorted(n for n, m in self.c.pending_delete.items() if m is d.mode)
        for name in names:
            self.try_delete(d, name, time.monotonic() + self.c.probe_timeout_s)

    def load_state(self) -> None:
        """Read the recorded namespaces from ``state_file`` (MPS role); an unreadable file is logged and ignored."""
        if not self.c.state_file:
            return
        try:
            with open(self.c.state_file, encoding="utf-8") as f:
                doc = json.load(f)
            recs = {}
            for name, r in (doc.get("namespaces") or {}).items():
                recs[name] = NsRecord(str(r["pod_uid"]), str(r["container"]),
                                       None if r.get("active_thread_percentage") is None
                                       else int(r["active_thread_percentage"]),
                                       ComputeMode(r.get("mode", ComputeMode.SM_SHARING.value)),
                                       None if r.get("pinned_limit_mib") is None else int(r["pinned_limit_mib"]))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("MPS namespace state %s unreadable, starting without it: %s", self.c.state_file, e)
            return
        with self.c.lock:
            for name, rec in recs.items():
                self.c.namespaces.setdefault(name, rec)

    def save_state(self) -> None:
        """Write the recorded namespaces atomically (tmp + fsync + rename)."""
        if not self.c.state_file:
            return
        with self.c.lock:
            doc = {"version": 1, "namespaces": {n: asdict(r) for n, r in sorted(self.c.namespaces.items())}}
        try:
            write_atomically(self.c.state_file, json.dumps(doc, sort_keys=True), mode=0o644, make_parents=True)
        except OSError as e:
            log.error("cannot write MPS namespace state %s: %s", self.c.state_file, e)

    def ensure(
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
        process of the namespace is capped to it on each device, docs/reference/mps-nvml.md 1.6).
        Idempotent: an existing namespace with the same caps is left alone
        (one the supervisor applied with these caps on the daemon's current
        process costs no control command at all: another container of the same
        pod and name, issue 14); different caps are re-set (which MPS refuses
        while a client is attached: MpsError). The request is recorded (and persisted in the MPS role) and
        re-applied after every daemon restart until ``release_namespace``; a
        timed-out one is kept too and finished by the probe thread (ADR 0034).

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
        d = self.c.daemons.get(mode)
        if d is None:
            raise MpsError(f"no {mode.value} MPS daemon is supervised on this node")
        if self.c.protocol < 3:
            raise MpsError("per-container MPS namespaces need MPS v3 (driver r615+); this node runs protocol 2")
        name = namespace_name(pod_uid, container)
        rec = NsRecord(pod_uid, container, None if active_thread_percentage is None else int(active_thread_percentage),
                        mode, None if pinned_limit_mib is None else int(pinned_limit_mib))
        with self.c.lock:
            prev = self.c.namespaces.get(name)
            self.c.namespaces[name] = rec
            self.c.pending_delete.pop(name, None)
            up = d.healthy and d.proc is not None
            why = self.c.reason(d)
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
                self.apply(d, name, rec, t_deadline, fresh=prev is None)
        except BaseException as e:
            timed_out = isinstance(e, MpsTimeout)
            with self.c.lock:
                if self.c.namespaces.get(name) is rec:
                    if timed_out:  # the daemon may still do it: kept, the probe thread finishes it (ADR 0034)
                        d.restore_pending.add(name)
                    elif prev is None:
                        del self.c.namespaces[name]
                    else:
                        self.c.namespaces[name] = prev
            if timed_out and prev != rec:
                self.save_state()
            raise
        path = self.c.layout.namespace_pipe_dir(name, mode)
        try:
            make_dir(path, self.c.layout.root)  # 0755 whatever umask the daemon ran with
        except OSError as e:
            log.warning("cannot set the mode of %s: %s", path, e)
        if prev != rec:
            self.save_state()
        return path

    def release(self, pod_uid: str, container: str, timeout_s: float | None = None) -> bool:
        """Forget the container's namespace and delete it from its daemon
        (``namespace delete``, bounded by ``timeout_s``, default ``probe_timeout_s``).
        MPS refuses the delete while a client is attached: then the delete is
        retried after each probe. Returns True when the namespace is gone now.
        Never raises for MPS errors."""
        name = namespace_name(pod_uid, container)
        with self.c.lock:
            rec = self.c.namespaces.pop(name, None)
            mode = rec.mode if rec is not None else ComputeMode.SM_SHARING
            d = self.c.daemons.get(mode)
            self.c.pending_delete[name] = mode
            known = d is not None and d.applied.get(name) is not None
            for dd in self.c.daemons.values():
                dd.applied.pop(name, None)
        if rec is not None:
            self.save_state()
        if d is None or self.c.protocol < 3:
            with self.c.lock:
                self.c.pending_delete.pop(name, None)
            return True
        budget = self.c.probe_timeout_s if timeout_s is None else max(0.0, float(timeout_s))
        return self.try_delete(d, name, time.monotonic() + budget, known=known)
