"""The NRI door's MPS namespace table (``Namespaces``): one object owning
the background MPS work queue, the maps of namespace jobs and owners, and
the one lock over them. Its methods are grouped below by the handlers that
call them (CreateContainer / StartContainer, ADR 0028; StopContainer and
RemoveContainer; the early table, ADR 0030; Synchronize's renew and orphans).
How each MPS call is made is ``nri/mpscalls.py``'s. The module docstring of
``nri/plugin.py`` describes the behaviour and the concurrency model.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable, Mapping, Sequence

from .._proto import nri_pb2
from ..ledger import Ledger
from ..model import ComputeMode, ContainerPlan, Tenancy
from ..mps.layout import namespace_name
from . import early
from .interfaces import CallContext
from .mpscalls import MpsCalls
from .nsqueue import KeyedWorkQueue
from .orphans import HeldNamespace, ledger_holds
from .pluginbase import (_DEFAULT_REQUEST_TIMEOUT_S, _DRAIN, _ENSURE, _MARGIN_S, _NS_WORKERS, _RELEASE, DoorSettings,
                         Owner, _failed, _ns_settings)
from ..logs import guarded

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log


def start_wait(ctx: CallContext | None, start_wait_s: float) -> float:
    """Seconds StartContainer may wait for a namespace: ``start_wait_s``,
    never past the handler's budget minus ``_MARGIN_S`` (0 when none is left)."""
    if ctx is None:
        return max(0.0, min(start_wait_s, _DEFAULT_REQUEST_TIMEOUT_S * 0.75 - _MARGIN_S))
    return max(0.0, min(start_wait_s, ctx.remaining() - _MARGIN_S))


class Namespaces:
    """The MPS namespace table and its background work (module docstring)."""

    def __init__(self, ledger: Ledger, calls: MpsCalls, settings: DoorSettings) -> None:
        self.ledger = ledger
        self.calls = calls
        self.settings = settings
        self._lock = threading.Lock()
        # container id -> (owner, future of the namespace job StartContainer awaits)
        self._pending: dict[str, tuple[Owner, Future[Any]]] = {}
        # owners whose namespace may exist (an ensure started, or a Synchronize found
        # it, since their last release) -> (its settings, that ensure's done future),
        # None = not known to be made so; reused by ``start`` (issue 14)
        self._made: dict[Owner, tuple[tuple[Any, ...], Future[Any]] | None] = {}
        # owner -> (settings, future, pod sandbox id) of an ensure queued at
        # RunPodSandbox that no container of the owner has claimed yet
        # (nri/early.py); future None: a namespace the MPS layer held for a live
        # pod, adopted at Synchronize (nri/orphans.py), no ensure of ours
        self._early: dict[Owner, tuple[tuple[Any, ...], Future[Any] | None, str]] = {}
        self._early_counts = {"queued": 0, "used": 0, "mismatched": 0, "released": 0, "adopted": 0,
                              "orphaned": 0}
        self._queue: KeyedWorkQueue | None = None
        self._renewing: set[Future[Any]] = set()  # renew's ensures not done yet (ADR 0034)

    # ------------------------------------------------- CreateContainer, StartContainer

    def start(self, p: ContainerPlan, container_id: str, fields: Mapping[str, Any]) -> None:
        """Create the namespace of ``p`` in the background:
        one queued ensure per owner (``_queue_ensure``). When an ensure of the
        owner already made it with the same settings (compute mode, active
        thread percentage, pinned limit), no release of the owner ran since and
        no job of the owner is queued or running, the container awaits that
        ensure's outcome instead: nothing is queued (issue 14; the MPS layer
        keeps the namespace, and re-applies it after a daemon restart before
        the daemon counts as healthy again, which CreateContainer waited for).
        An early ensure of the owner is awaited or replaced as ADR 0030
        decision 2 says; an entry adopted at Synchronize (``nri/orphans.py``)
        leaves the early table and the container gets its own ensure."""
        owner = (p.pod.uid, p.container)
        settings = _ns_settings(p)
        with self._lock:
            early_entry = self._early.pop(owner, None)
            # fut None: adopted at Synchronize (nri/orphans.py), no ensure of ours to await: one is queued below
            fut = None if early_entry is None else early_entry[1]
            if early_entry is not None and fut is not None:
                if early_entry[0] == settings and not _failed(fut):
                    self._early_counts["used"] += 1
                    self._pending[container_id] = (owner, fut)
                    if not fut.done() and self._queue is not None:
                        self._queue.promote(("ns", *owner))  # its StartContainer comes next: ahead of early work
                    return
                self._early_counts["mismatched"] += 1
                log.info("nri early MPS namespace not reused", extra={
                    **fields, "reason": "settings differ" if early_entry[0] != settings else "its ensure failed"})
            cur = self._made.get(owner)
            if (cur is not None and cur[0] == settings
                    and self._queue is not None
                    and not self._queue.busy(("ns", *owner))):
                self._pending[container_id] = (owner, cur[1])
                return
            self._queue_ensure(container_id, owner, functools.partial(
                self._ensure_job, owner, p.active_thread_percentage, dict(fields), p.compute_mode, p.limit_mib))

    def await_start(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                    ctx: CallContext | None = None) -> None:
        """StartContainer's wait for the container's MPS namespace job, at
        most ``start_wait(ctx)`` seconds; ADR 0028's table says what each state
        of the job answers when the wait ends (done: start; failed, or not done
        while the mode's daemon is down: ``RpcError`` UNAVAILABLE unless
        ``fail_open``; not done on a healthy daemon: start, warned). A container
        created before a daemon restart (nothing pending, the ledger holds its
        namespace) gets an ensure queued now, awaited the same way."""
        fields = {"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid, "container": container.name,
                  "container_id": container.id}
        who = f"{pod.namespace}/{pod.name}/{container.name}"
        with self._lock:
            job = self._pending.get(container.id)
        if job is None:
            # Nothing pending: not ours, already awaited, or the daemon restarted
            # between create and start; then queue an ensure and await it.
            held = [t for t in self.ledger.find_container_id(container.id) if t.mps_namespace]
            if not held:
                return None
            t = held[0]
            with self._lock:
                self._made.setdefault(t.owner, None)
                self._queue_ensure(container.id, t.owner, functools.partial(
                    self._ensure_job, t.owner, t.active_thread_percentage, dict(fields), t.mode, t.limit_mib))
                job = self._pending[container.id]
        owner, fut = job
        wait = start_wait(ctx, self.settings.start_wait_s)
        began = time.monotonic()
        try:
            fut.result(wait)
        except FutureTimeout:
            return self._start_late(owner, container.id, fut, fields, who, time.monotonic() - began)
        except Exception as exc:
            self.forget(container.id, fut)
            return self.calls.failed(exc, fields, who)
        self.forget(container.id, fut)
        return None

    def _start_late(self, owner: Owner, container_id: str, fut: Future[Any],
                    fields: Mapping[str, Any], who: str, waited_s: float) -> None:
        """The wait of StartContainer is spent and the namespace job of
        ``owner`` is not done: slow (start, logged) or its daemon down
        (``RpcError`` UNAVAILABLE unless ``fail_open``), ADR 0028."""
        held = self.ledger.find(*owner)
        mode = held[0].mode if held else ComputeMode.SM_SHARING
        if not self.calls.up(mode):
            why = self.calls.why_down(mode)
            self.forget(container_id, fut)
            return self.calls.failed(RuntimeError(f"the {mode.value} MPS daemon is down ({why})"), fields, who)
        q = self._queue
        state = "running" if q is not None and q.running(("ns", *owner)) else "queued"
        self.forget(container_id, fut)
        log.warning("nri StartContainer wait spent: container starts before its MPS namespace exists",
                    extra={**fields, "waited_s": round(waited_s, 3), "start_wait_s": self.settings.start_wait_s,
                           "namespace_job": state})
        spent_at = time.monotonic()

        def ended(done: Future[Any]) -> None:
            late = {**fields, "after_start_s": round(time.monotonic() - spent_at, 3)}
            if done.cancelled():
                log.warning("nri MPS namespace job cancelled after its container started", extra=late)
            elif done.exception() is not None:
                log.warning("nri MPS namespace failed after its container started",
                            extra={**late, "reason": str(done.exception())})
            else:
                log.info("nri MPS namespace ready after its container started", extra=late)

        fut.add_done_callback(ended)
        return None

    def forget(self, container_id: str, fut: Future[Any] | None = None) -> set[Owner]:
        """Stop tracking the namespace job of ``container_id`` (only if it is
        ``fut``, when given). Returns its owner (empty set when none was
        tracked). The job itself is not cancelled here: other containers of
        the same owner may await it; ``release`` drops it when nothing
        holds the owner."""
        with self._lock:
            cur = self._pending.get(container_id)
            if cur is not None and (fut is None or cur[1] is fut):
                del self._pending[container_id]
                return {cur[0]}
        return set()

    # ------------------------------------------------------------ the queue

    def _work(self) -> KeyedWorkQueue:
        """The background MPS work queue (namespace creations and releases,
        keyed by owner; drains, keyed by container id), made on first use (and
        again after ``close``); the caller holds ``_lock``. Its threads keep
        the daemon's CPU priority: StartContainer awaits their namespace jobs
        within its own budget (ADR 0015 says why not lower)."""
        if self._queue is None:
            self._queue = KeyedWorkQueue(workers=_NS_WORKERS, name="nri-mps-ns")
        return self._queue

    def _queue_ensure(self, container_id: str, owner: Owner, job: Callable[[], Any]) -> None:
        """Queue ``job`` (an ensure of ``owner``'s namespace) as the job
        StartContainer of ``container_id`` awaits; the caller holds ``_lock``.
        It replaces the owner's queued ensure (joining its waiters) or release,
        runs after the owner's running job, and is urgent (ADR 0017, ADR 0030
        decision 5)."""
        q = self._work()
        key = ("ns", *owner)
        fut = q.put(key, job, join=q.pending_tag(key) == _ENSURE, tag=_ENSURE, urgent=True)
        self._pending[container_id] = (owner, fut)

    def _ensure_job(self, owner: Owner, atp: int | None, fields: Mapping[str, Any],
                    mode: ComputeMode, limit_mib: int | None) -> str:
        """A queued namespace creation: from its start the namespace may
        exist (a later release of the owner must then run)."""
        with self._lock:
            self._made[owner] = None  # not known to be made until this ensure succeeds
        path = self.calls.ensure(owner, atp, fields, mode, limit_mib)
        done: Future[Any] = Future()
        done.set_result(path)
        with self._lock:
            if owner in self._made:  # not released meanwhile
                self._made[owner] = ((mode, atp, limit_mib), done)
        return path

    def renew(self, tenancies: Sequence[Tenancy]) -> None:
        """After a (re)synchronization, make sure (in the background) that every
        sm-sharing container's MPS namespace exists again: a restarted daemon's
        MPS layer only re-creates the namespaces it was told about. A container
        created but not yet started awaits its job at StartContainer."""
        seen: set[str] = set()
        with self._lock:  # owners no container holds any more (nor an early entry) will not be released by us
            self._made = {o: v for o, v in self._made.items() if o in self._early or self.ledger.find(*o)}
        for t in tenancies:
            if not t.mps_namespace or not t.container_id or t.container_id in seen:
                continue
            seen.add(t.container_id)
            with self._lock:
                if t.container_id in self._pending:
                    continue
                fields = {"pod_uid": t.pod_uid, "container": t.container, "container_id": t.container_id}
                self._made.setdefault(t.owner, None)  # the MPS layer (a split MPS role) may hold it from before
                self._queue_ensure(t.container_id, t.owner, functools.partial(
                    self._ensure_job, t.owner, t.active_thread_percentage, fields, t.mode, t.limit_mib))
                self._renewing.add(self._pending[t.container_id][1])

    def renewing(self) -> int:
        """``renew``'s namespace ensures not done yet (the door is not ready meanwhile, ADR 0034)."""
        with self._lock:
            self._renewing = {f for f in self._renewing if not f.done()}
            return len(self._renewing)

    def drain(self, container_id: str, job: Callable[[], Any]) -> Future[Any]:
        """Queue (or share: one drain per container, a second StopContainer
        shares the queued or running one) ``job``, the drain of ``container_id``."""
        with self._lock:
            return self._work().share((_DRAIN, container_id), job, tag=_DRAIN, urgent=True)

    def cancel_drain(self, container_id: str) -> None:
        """Drop a drain of ``container_id`` still queued (its processes are gone)."""
        with self._lock:
            if self._queue is not None:
                self._queue.cancel((_DRAIN, container_id))

    # ------------------------------------------------------------ release

    def release(self, owners: set[Owner]) -> None:
        """For each owner nothing in the ledger holds any more: drop its
        queued namespace creation and queue the release of its namespace,
        unless that creation was all there was (nothing to release; ADR 0017).
        A newer container's ensure replaces a queued release, and a release
        that runs skips an owner held again (``_release_job``)."""
        inline: list[Owner] = []
        for owner in owners:
            with self._lock:
                if self.ledger.find(*owner):
                    continue  # a newer container of the same pod/name holds it
                q = self._work()
                key = ("ns", *owner)
                if q.cancel(key, tag=_ENSURE, only_idle=True) and owner not in self._made:
                    continue  # created and removed before MPS got to it
                try:
                    q.put(key, functools.partial(self._release_job, owner), tag=_RELEASE)
                except RuntimeError:  # queue closed meanwhile: release inline
                    inline.append(owner)
        for owner in inline:
            self._release_job(owner)

    def _release_job(self, owner: Owner) -> None:
        """Release ``owner``'s namespace unless a newer container of the same
        pod and name holds it now (MPS errors are logged, never raised)."""
        if self.ledger.find(*owner):
            return
        with self._lock:
            self._made.pop(owner, None)
        self.calls.release(owner)

    # ------------------------------------------------------------ early (nri/early.py)

    def queue_early(self, sandbox_id: str, plans: Sequence[ContainerPlan]) -> None:
        """RunPodSandbox: one ensure per owner of ``plans`` (``nri/early.py``'s
        module docstring), not for an owner a container holds or whose
        namespace an ensure made with the same settings; at most
        ``early.EARLY_MAX`` owners in the early table."""
        for p in plans:
            owner = (p.pod.uid, p.container)
            settings = _ns_settings(p)
            fields = {"pod": str(p.pod), "pod_uid": p.pod.uid, "container": p.container, "early": True}
            with self._lock:
                made = self._made.get(owner)
                q = self._work()
                key = ("ns", *owner)
                if owner in self._early:  # a RunPodSandbox seen twice, or the pod's new sandbox
                    cur = self._early[owner]
                    self._early[owner] = (cur[0], cur[1], sandbox_id)  # the old sandbox's removal keeps it
                    continue
                if self.ledger.find(*owner):
                    continue  # a container already holds it
                if made is not None and made[0] == settings and not q.busy(key):
                    continue  # made with these settings: CreateContainer reuses it as it is
                if len(self._early) >= early.EARLY_MAX:
                    log.info("nri RunPodSandbox: too many early MPS namespaces; made at CreateContainer",
                             extra={**fields, "early_max": early.EARLY_MAX})
                    return
                job = functools.partial(self._ensure_job, owner, p.active_thread_percentage, fields,
                                        p.compute_mode, p.limit_mib)
                fut = q.put(key, job, join=q.pending_tag(key) == _ENSURE, tag=_ENSURE)
                self._early[owner] = (settings, fut, sandbox_id)
                self._early_counts["queued"] += 1

    def release_early(self, gone: Callable[[str, str], bool]) -> None:
        """Drop the early entries for which ``gone(pod UID, sandbox id)`` is
        true and release their namespaces (``release``: a queued
        ensure that never started is dropped, nothing to release)."""
        with self._lock:
            owners = {o for o, e in self._early.items() if gone(o[0], e[2])}
            for o in owners:
                del self._early[o]
            self._early_counts["released"] += len(owners)
        if owners:
            log.info("nri early MPS namespaces released: no container of the pod held them",
                     extra={"owners": len(owners), "pod_uid": ",".join(sorted({o[0] for o in owners}))})
            guarded(log, "nri early MPS namespace release", self.release, owners)

    def early_status(self) -> dict[str, int]:
        """``{"pending": early namespaces no container holds yet, "queued":
        early ensures queued since start, "used": CreateContainers that
        awaited one, "mismatched": CreateContainers whose settings differed
        (or whose early ensure failed) and queued their own, "released":
        early namespaces released at RemovePodSandbox or Synchronize,
        "adopted": namespaces the MPS layer held for a live pod that nothing
        here held, taken into the early table at Synchronize, "orphaned":
        namespaces the MPS layer held for pods the runtime no longer has,
        released at Synchronize (``nri/orphans.py``)}``; counts since start
        except ``pending``."""
        with self._lock:
            return {"pending": len(self._early), **self._early_counts}

    # ------------------------------------------------------------ orphans (nri/orphans.py)

    def adopt(self, found: Iterable[HeldNamespace], live: Mapping[str, str]) -> tuple[dict[str, int],
                                                                                     list[HeldNamespace]]:
        """Sort the MPS layer's namespaces ``found`` against the ledger (read
        once) and ``live`` (pod UID -> its last sandbox id): a held one is
        left, a live pod's that nothing holds is adopted into the early table
        (no ensure of ours to await), the rest are returned as orphans
        (``nri/orphans.py``). Returns (``{"held", "adopted", "orphaned"}``, the orphans)."""
        counts = {"held": 0, "adopted": 0, "orphaned": 0}
        names, owners = ledger_holds(self.ledger)
        orphans: list[HeldNamespace] = []
        with self._lock:
            for ns in found:
                o = ns.owner
                if self._held_locked(ns, names, owners, queued=True):
                    counts["held"] += 1
                elif o[0] not in live:
                    orphans.append(ns)
                elif len(self._early) >= early.EARLY_MAX:  # the early table's bound
                    log.info("nri sync: too many early MPS namespaces; a live pod's namespace not adopted",
                             extra={"pod_uid": o[0], "container": o[1], "early_max": early.EARLY_MAX})
                else:
                    self._early[o] = (ns.settings, None, live[o[0]])
                    self._made.setdefault(o, None)  # may exist: a release of the owner must run
                    counts["adopted"] += 1
            counts["orphaned"] = len(orphans)
            self._early_counts["adopted"] += counts["adopted"]
            self._early_counts["orphaned"] += counts["orphaned"]
        return counts, orphans

    def release_orphan(self, ns: HeldNamespace) -> None:
        """Queue the release of an orphaned namespace on the keyed MPS queue
        (key of its owner, tag ``release``: a later ensure of the owner
        replaces it). Inline when the queue is closed."""
        job = functools.partial(self._orphan_job, ns)
        with self._lock:
            try:
                self._work().put(("ns", *ns.owner), job, tag=_RELEASE)
                return
            except RuntimeError:
                pass  # closed meanwhile
        job()

    def _orphan_job(self, ns: HeldNamespace) -> None:
        """Release ``ns`` unless something here holds it now (a container of
        its owner, a ledger entry naming it, an early entry, an awaited job;
        from inside the owner's own queued job: the queue is not asked); MPS
        errors are logged by ``_release_job``."""
        names, owners = ledger_holds(self.ledger)
        with self._lock:
            held = self._held_locked(ns, names, owners, queued=False)
        if held:
            log.info("nri sync: an orphaned MPS namespace is held again; kept",
                     extra={"pod_uid": ns.owner[0], "container": ns.owner[1]})
            return
        log.info("nri sync: releasing an MPS namespace whose pod the runtime no longer has",
                 extra={"pod_uid": ns.owner[0], "container": ns.owner[1], "mps_namespace": ns.name})
        self._release_job(ns.owner)

    def _held_locked(self, ns: HeldNamespace, names: set[str], owners: set[tuple[str, str]], *,
                     queued: bool) -> bool:
        """The one "held" rule (``nri/orphans.py``): the ledger holds the
        owner (``owners``) or names the namespace (``names``, by its name or
        the owner's derived name), the early table has the owner, a container
        awaits it, or (``queued``) a job of the owner is queued or running.
        The caller holds ``_lock``."""
        o = ns.owner
        if ns.name in names or namespace_name(*o) in names or o in owners or o in self._early:
            return True
        if any(p == o for p, _f in self._pending.values()):
            return True
        q = self._queue
        return queued and q is not None and q.busy(("ns", *o))

    # ------------------------------------------------------------ status, close

    def status(self) -> dict[str, Any]:
        """``{"pending": containers whose namespace job is not done yet,
        "jobs": the queue's {"queued", "running", "threads"}}``."""
        with self._lock:
            pending = sum(1 for _, f in self._pending.values() if not f.done())
            q = self._queue
        return {"pending": pending,
                "jobs": q.stats() if q is not None else {"queued": 0, "running": 0, "threads": 0}}

    def close(self) -> None:
        """Stop the background MPS workers without waiting (queued jobs are
        cancelled; a running one ends within its own budget,
        ``namespace_timeout_s`` or ``drain_timeout_s``). A later call queues on
        a new queue."""
        with self._lock:
            q, self._queue = self._queue, None
            self._pending.clear()
            self._renewing.clear()
            self._made = dict.fromkeys(self._made)  # no queue to have made them any more
        if q is not None:
            q.close()
