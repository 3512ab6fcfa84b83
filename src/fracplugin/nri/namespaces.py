"""The NRI door's MPS namespace work: create a container's namespace
in the background, awaited at StartContainer,
the keyed background queue, re-ensuring after a Synchronize, waiting for a
healthy MPS daemon.

Split out of ``nri/plugin.py`` (issue 26, ADR 0023), moved as it was: the
module docstring of ``nri/plugin.py`` describes the behaviour and the
concurrency model; ``FracNriPlugin`` is the one class to use.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping, Sequence

from .._proto import nri_pb2
from ..model import ComputeMode, ContainerPlan, Tenancy
from .interfaces import CallContext
from .nsqueue import KeyedWorkQueue
from .ttrpc import Code, RpcError
from .pluginbase import (_DEFAULT_REQUEST_TIMEOUT_S, _ENSURE, _MARGIN_S, _NS_WORKERS, Owner, _FailOpen, _PluginState,
                         _failed, _ns_settings)

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log, as before the split


class _Namespaces(_PluginState):
    """MPS namespace ensure (a mixin of ``FracNriPlugin``)."""

    def _start_namespace(self, p: ContainerPlan, container_id: str, fields: Mapping[str, Any]) -> None:
        """Create the namespace of ``p`` in the background:
        one queued ensure per owner (``_queue_ensure``). When an ensure of the
        owner already made it with the same settings (compute mode, active
        thread percentage, pinned limit), no release of the owner ran since and
        no job of the owner is queued or running, the container awaits that
        ensure's outcome instead: nothing is queued (issue 14; the MPS layer
        keeps the namespace, and re-applies it after a daemon restart before
        the daemon counts as healthy again, which CreateContainer waited for).

        An early ensure of the owner queued at RunPodSandbox (``nri/early.py``)
        with the same settings that has not failed is awaited the same way;
        the owner leaves the early table whatever its settings (a container
        holds it now). An entry adopted at Synchronize (``nri/orphans.py``:
        the MPS layer held it, no ensure of ours made it) leaves it too and
        the container gets its own ensure."""
        owner = (p.pod.uid, p.container)
        settings = _ns_settings(p)
        with self._ns_lock:
            early = self._ns_early.pop(owner, None)
            # fut None: adopted at Synchronize (nri/orphans.py), no ensure of ours to await: one is queued below
            fut = None if early is None else early[1]
            if early is not None and fut is not None:
                if early[0] == settings and not _failed(fut):
                    self._early_counts["used"] += 1
                    self._ns_pending[container_id] = (owner, fut)
                    if not fut.done() and self._ns_queue is not None:
                        self._ns_queue.promote(("ns", *owner))  # its StartContainer comes next: ahead of early work
                    return
                self._early_counts["mismatched"] += 1
                log.info("nri early MPS namespace not reused", extra={
                    **fields, "reason": "settings differ" if early[0] != settings else "its ensure failed"})
            cur = self._ns_made.get(owner)
            if (cur is not None and cur[0] == settings
                    and self._ns_queue is not None
                    and not self._ns_queue.busy(("ns", *owner))):
                self._ns_pending[container_id] = (owner, cur[1])
                return
            self._queue_ensure(container_id, owner, functools.partial(self._namespace_job, p, dict(fields)))

    def _namespace_job(self, p: ContainerPlan, fields: Mapping[str, Any]) -> str:
        return self._ensure_job((p.pod.uid, p.container), p.active_thread_percentage, fields,
                                p.compute_mode, p.limit_mib)

    def start_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                        ctx: CallContext | None = None) -> None:
        """StartContainer: wait for the container's MPS
        namespace job at most ``_start_wait(ctx)`` seconds (``start_wait_s``,
        never past the handler budget: the runtime's request timeout, 2 s by
        default, docs/reference/nri-protocol.md 1.5, is kept). ADR 0028 tells slow from failed:

        - done: the container starts;
        - failed (the ensure raised, or was cancelled): ``RpcError``
          UNAVAILABLE (the runtime fails the start; kubelet retries and the next
          CreateContainer queues a new ensure), unless ``fail_open``;
        - not done when the wait is spent (queued or running, merely slow): the
          container starts, a warning says the budget was spent and a second
          line says when the job ended; unless the mode's MPS daemon is down
          (not slow: UNAVAILABLE, as CreateContainer's ``_require_mode_up``).

        A container created before a daemon restart (nothing pending, the
        ledger holds its namespace) gets an ensure queued now, awaited the same
        way. With ``memory_limits`` the container's CUDA memory limits are
        applied/verified first (``NriMemoryLimits.start``)."""
        if self.memory_limits is not None:
            self.memory_limits.start(pod, container, self.ledger)
        fields = {"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid, "container": container.name,
                  "container_id": container.id}
        who = f"{pod.namespace}/{pod.name}/{container.name}"
        with self._ns_lock:
            job = self._ns_pending.get(container.id)
        if job is None:
            # Nothing pending: not ours, already awaited, or the daemon restarted
            # between create and start; then queue an ensure and await it.
            held = [t for t in self.ledger.find_container_id(container.id) if t.mps_namespace]
            if not held:
                return None
            t = held[0]
            with self._ns_lock:
                self._ns_made.setdefault(t.owner, None)
                self._queue_ensure(container.id, t.owner, functools.partial(
                    self._ensure_job, t.owner, t.active_thread_percentage, dict(fields), t.mode, t.limit_mib))
                job = self._ns_pending[container.id]
        owner, fut = job
        wait = self._start_wait(ctx)
        began = time.monotonic()
        try:
            fut.result(wait)
        except FutureTimeout:
            return self._start_before_namespace(owner, container.id, fut, fields, who, time.monotonic() - began)
        except Exception as exc:
            self._forget_namespace_job(container.id, fut)
            return self._mps_failed(exc, fields, who)
        self._forget_namespace_job(container.id, fut)
        return None

    def _start_wait(self, ctx: CallContext | None) -> float:
        """Seconds StartContainer may wait for a namespace: ``start_wait_s``,
        never past the handler's budget minus ``_MARGIN_S`` (0 when none is left)."""
        if ctx is None:
            return max(0.0, min(self.start_wait_s, _DEFAULT_REQUEST_TIMEOUT_S * 0.75 - _MARGIN_S))
        return max(0.0, min(self.start_wait_s, ctx.remaining() - _MARGIN_S))

    def _start_before_namespace(self, owner: Owner, container_id: str, fut: Future[Any],
                                fields: Mapping[str, Any], who: str, waited_s: float) -> None:
        """The wait of StartContainer is spent and the namespace job of
        ``owner`` is not done (ADR 0028). A job still queued or running on a
        healthy daemon is slow, not failed: the container starts and the log
        says so (a second line when the job ends, with how long after).
        Raises ``RpcError`` UNAVAILABLE (unless ``fail_open``) when the
        daemon of the owner's mode is down: the job waits for it and may never
        end in time."""
        held = self.ledger.find(*owner)
        mode = held[0].mode if held else ComputeMode.SM_SHARING
        if not self._mps_up(mode):
            why_fn = getattr(self.mps, "unhealthy_reason", None)
            why = why_fn(mode) if callable(why_fn) else "not healthy"
            self._forget_namespace_job(container_id, fut)
            return self._mps_failed(RuntimeError(f"the {mode.value} MPS daemon is down ({why})"), fields, who)
        q = self._ns_queue
        state = "running" if q is not None and q.running(("ns", *owner)) else "queued"
        self._forget_namespace_job(container_id, fut)
        log.warning("nri StartContainer wait spent: container starts before its MPS namespace exists",
                    extra={**fields, "waited_s": round(waited_s, 3), "start_wait_s": self.start_wait_s,
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

    def _mps_up(self, mode: ComputeMode) -> bool:
        """The daemon of ``mode`` answers its probe now (True when the MPS
        layer cannot tell)."""
        healthy = getattr(self.mps, "healthy", None)
        return not callable(healthy) or bool(healthy(mode))

    def _forget_namespace_job(self, container_id: str, fut: Future[Any] | None = None) -> set[Owner]:
        """Stop tracking the namespace job of ``container_id`` (only if it is
        ``fut``, when given). Returns its owner (empty set when none was
        tracked). The job itself is not cancelled here: other containers of
        the same owner may await it; ``_release_owners`` drops it when nothing
        holds the owner."""
        with self._ns_lock:
            cur = self._ns_pending.get(container_id)
            if cur is not None and (fut is None or cur[1] is fut):
                del self._ns_pending[container_id]
                return {cur[0]}
        return set()

    def _mps_failed(self, exc: Exception, fields: Mapping[str, Any], who: str) -> None:
        self.metrics.refusal("mps_unavailable")
        if self.fail_open:
            log.warning("nri fail-open: container runs without its MPS namespace", extra={**fields, "reason": str(exc)})
            return None
        raise RpcError(Code.UNAVAILABLE, f"fracplugin: MPS namespace for {who} is not ready: {exc}")


    def _wait_mps_healthy(self, deadline: float, mode: ComputeMode = ComputeMode.SM_SHARING) -> bool:
        """Absorb a short window where the daemon of ``mode`` is (re)starting:
        when the MPS layer offers ``healthy(mode)``, poll it until ``deadline``
        (the MPS time share of this call). Returns the last answer (True when
        the layer cannot tell); the namespace call reports whatever is still wrong."""
        healthy = getattr(self.mps, "healthy", None)
        if not callable(healthy):
            return True
        pause = 0.01
        while not (ok := bool(healthy(mode))) and time.monotonic() + pause < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        return ok

    def _require_mode_up(self, p: ContainerPlan, ctx: CallContext | None, fields: Mapping[str, Any]) -> None:
        """Refuse (UNAVAILABLE: the runtime retries) a container whose mode's MPS
        daemon is down or crash-looping, after waiting up to half the budget for
        it to come back: without its daemon CUDA runs without MPS and without a
        limit (issue 12). Not with ``fail_open`` (the container runs, warned)."""
        if self._wait_mps_healthy(time.monotonic() + self._mps_timeout(ctx, share=0.5), p.compute_mode):
            return
        why_fn = getattr(self.mps, "unhealthy_reason", None)
        why = why_fn(p.compute_mode) if callable(why_fn) else "not healthy"
        self.metrics.refusal("mps_unavailable")
        log.warning("nri MPS daemon of the container's mode is down", extra={**fields, "mode": p.compute_mode.value,
                                                                           "reason": why})
        if self.fail_open:
            log.warning("nri fail-open: container runs without MPS", extra=dict(fields))
            raise _FailOpen()
        raise RpcError(Code.UNAVAILABLE,
                       f"fracplugin: the {p.compute_mode.value} MPS daemon is down ({why}); "
                       f"{p.pod}/{p.container} is refused until it is back")


    def _ns_work(self) -> KeyedWorkQueue:
        """The background MPS work queue (namespace creations and releases,
        keyed by owner; drains, keyed by container id), made on first use (and
        again after ``close``); the caller holds ``_ns_lock``. Its threads keep
        the daemon's CPU priority: StartContainer awaits their namespace jobs
        within its own budget (ADR 0015 says why not lower)."""
        if self._ns_queue is None:
            self._ns_queue = KeyedWorkQueue(workers=_NS_WORKERS, name="nri-mps-ns")
        return self._ns_queue

    def _queue_ensure(self, container_id: str, owner: Owner, job: Callable[[], Any]) -> None:
        """Queue ``job`` (an ensure of ``owner``'s namespace) as the job
        StartContainer of ``container_id`` awaits; the caller holds
        ``_ns_lock``. An ensure of the owner still queued (another container of
        the same pod and name, or a Synchronize renewal) is replaced by this
        newer one and its waiters get this one's outcome (the namespace is the
        owner's); a queued release is replaced (desired state: the namespace
        exists); a job of the owner that runs now finishes first. The job is
        urgent (a StartContainer awaits it): it runs before the ensures queued
        early at RunPodSandbox that no container awaits yet (ADR 0030)."""
        q = self._ns_work()
        key = ("ns", *owner)
        fut = q.put(key, job, join=q.pending_tag(key) == _ENSURE, tag=_ENSURE, urgent=True)
        self._ns_pending[container_id] = (owner, fut)


    def _renew_namespaces(self, tenancies: Sequence[Tenancy]) -> None:
        """After a (re)synchronization, make sure (in the background) that every
        sm-sharing container's MPS namespace exists again: a restarted daemon's
        MPS layer only re-creates the namespaces it was told about. A container
        created but not yet started awaits its job at StartContainer."""
        seen: set[str] = set()
        with self._ns_lock:  # owners no container holds any more (nor an early entry) will not be released by us
            self._ns_made = {o: v for o, v in self._ns_made.items() if o in self._ns_early or self.ledger.find(*o)}
        for t in tenancies:
            if not t.mps_namespace or not t.container_id or t.container_id in seen:
                continue
            seen.add(t.container_id)
            with self._ns_lock:
                if t.container_id in self._ns_pending:
                    continue
                fields = {"pod_uid": t.pod_uid, "container": t.container, "container_id": t.container_id}
                self._ns_made.setdefault(t.owner, None)  # the MPS layer (a split MPS role) may hold it from before
                self._queue_ensure(t.container_id, t.owner, functools.partial(
                    self._ensure_job, t.owner, t.active_thread_percentage, fields, t.mode, t.limit_mib))

    def _ensure_job(self, owner: Owner, atp: int | None, fields: Mapping[str, Any],
                    mode: ComputeMode, limit_mib: int | None) -> str:
        """A queued namespace creation: from its start the namespace may
        exist (a later release of the owner must then run)."""
        with self._ns_lock:
            self._ns_made[owner] = None  # not known to be made until this ensure succeeds
        path = self._renew_job(owner[0], owner[1], atp, fields, mode, limit_mib)
        done: Future[Any] = Future()
        done.set_result(path)
        with self._ns_lock:
            if owner in self._ns_made:  # not released meanwhile
                self._ns_made[owner] = ((mode, atp, limit_mib), done)
        return path

    def _renew_job(self, pod_uid: str, container: str, atp: int | None, fields: Mapping[str, Any],
                   mode: ComputeMode = ComputeMode.SM_SHARING, limit_mib: int | None = None) -> str:
        deadline = time.monotonic() + self.namespace_timeout_s
        try:
            self._wait_mps_healthy(deadline, mode)
            return self.mps.ensure_namespace(pod_uid, container, atp, max(0.01, deadline - time.monotonic()),
                                             mode=mode, pinned_limit_mib=limit_mib)
        except Exception as exc:
            log.warning("nri MPS namespace creation failed", extra={**fields, "reason": str(exc)})
            raise


    @staticmethod
    def _mps_timeout(ctx: CallContext | None, share: float) -> float:
        """Seconds an MPS call may take: ``share`` of the request timeout,
        never past the handler's budget (minus a margin)."""
        if ctx is None:
            return _DEFAULT_REQUEST_TIMEOUT_S * share
        return max(0.05, min(ctx.request_timeout_s * share, ctx.remaining() - _MARGIN_S))
