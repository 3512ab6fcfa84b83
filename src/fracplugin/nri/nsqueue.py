"""A keyed work queue for the NRI door's background MPS work (ADR 0017):
client-go's ``util/workqueue`` idea (a key has at most one pending job, and a
key a worker runs is not handed to a second worker: a job put meanwhile runs
after it) with a job and a ``Future`` per key; a newer job replaces the pending
one (``put``'s ``join``). Keys: ``("ns", pod UID, container name)``, ``("drain", container id)``.

Memory: at most one pending entry and one running job per key, so what the
queue holds is bounded by the number of distinct keys with work, not by the
rate at which work is put.

Order: FIFO over keys (a key put again while pending keeps its place; one put
while running is queued behind those waiting when its job ends); urgent keys
(``put(..., urgent=True)``, ``promote``: work a caller waits for now) run
first, FIFO among themselves, and non-urgent work waits while urgent work is
ready (ADR 0030 decision 5).

Concurrency: every method may be called from any thread. Jobs run on up to
``workers`` daemon threads, started on demand; a job's exception is set on its
future (never raised in the worker). ``close()`` cancels what is pending and
lets each worker finish the job it runs, then end.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Hashable

@dataclass
class _Entry:
    job: Callable[[], Any]
    future: Future[Any]
    tag: str
    urgent: bool = False


class KeyedWorkQueue:
    """One pending job per key, never two workers on one key (module docstring).

    Args:
        workers: most jobs run at once (threads, started on demand; >= 1).
        name: thread name prefix (``<name>_<n>``).

    Raises ValueError for ``workers < 1``.
    """

    def __init__(self, workers: int = 4, name: str = "keyed-work") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        self.workers = workers
        self.name = name
        self._cv = threading.Condition(threading.Lock())  # workers wait here for a ready key
        self._pending: dict[Hashable, _Entry] = {}
        self._ready: OrderedDict[Hashable, None] = OrderedDict()  # pending keys not running, FIFO
        self._urgent: OrderedDict[Hashable, None] = OrderedDict()  # the same, urgent: taken first
        self._running: dict[Hashable, tuple[Future[Any], str]] = {}
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    # ------------------------------------------------------------- putting

    def put(self, key: Hashable, job: Callable[[], Any], *, join: bool = False, tag: str = "",
            urgent: bool = False) -> Future[Any]:
        """Make ``job`` the pending job of ``key`` and return the future of its
        outcome. ``urgent``: a caller waits for it now; it runs before the
        pending jobs that are not (a pending job of ``key`` it replaces or
        joins becomes urgent; an urgent one stays so).

        A job already pending for ``key`` is replaced: with ``join=False`` its
        future is cancelled and a new one returned; with ``join=True`` its
        future is kept and returned (its waiters get ``job``'s outcome). A job
        of ``key`` that is running is never touched: ``job`` runs after it.
        ``tag`` is a label the caller can read back (``pending_tag``).

        Raises RuntimeError once the queue is closed.
        """
        with self._cv:
            if self._closed:
                raise RuntimeError(f"work queue {self.name} is closed")
            entry = self._pending.get(key)
            if entry is not None and join:
                entry.job, entry.tag = job, tag
                if urgent:
                    self._promote(key, entry)
                return entry.future
            if entry is not None:
                entry.future.cancel()
                urgent = urgent or entry.urgent
            fut: Future[Any] = Future()
            self._pending[key] = _Entry(job, fut, tag, urgent)
            if key not in self._running:
                if urgent and key not in self._urgent:
                    self._ready.pop(key, None)
                    self._urgent[key] = None
                elif not urgent:
                    self._ready[key] = None  # a replaced entry keeps its place
                self._wake()
            return fut

    def promote(self, key: Hashable) -> bool:
        """Make the pending job of ``key`` urgent (it runs before the pending
        jobs that are not, behind the urgent ones already waiting). Returns
        whether a pending job was there."""
        with self._cv:
            entry = self._pending.get(key)
            if entry is None:
                return False
            self._promote(key, entry)
            return True

    def _promote(self, key: Hashable, entry: _Entry) -> None:
        """Caller holds the lock: ``entry`` (pending job of ``key``) becomes urgent."""
        if entry.urgent:
            return
        entry.urgent = True
        if self._ready.pop(key, 0) is None:  # ready (not running): it moves to the urgent line
            self._urgent[key] = None

    def share(self, key: Hashable, job: Callable[[], Any], *, tag: str = "", urgent: bool = False) -> Future[Any]:
        """The future of the job of ``key`` that is pending, else of the one
        running, else of ``job``, queued now (for work whose repetition adds
        nothing, such as a second drain of one container); ``urgent`` as
        ``put`` (a pending job shared is made urgent). Raises RuntimeError
        once the queue is closed."""
        with self._cv:
            entry = self._pending.get(key)
            if entry is not None:
                if urgent:
                    self._promote(key, entry)
                return entry.future
            running = self._running.get(key)
            if running is not None and not self._closed:
                return running[0]
        return self.put(key, job, tag=tag, urgent=urgent)

    def cancel(self, key: Hashable, *, tag: str | None = None, only_idle: bool = False) -> bool:
        """Drop the pending job of ``key`` (its future is cancelled). With
        ``tag``, only a pending job of that tag; with ``only_idle``, only when
        no job of ``key`` is running. Returns True when a pending job was
        dropped: it never started and never will. A running job is never
        interrupted."""
        with self._cv:
            entry = self._pending.get(key)
            if entry is None or (tag is not None and entry.tag != tag) or (only_idle and key in self._running):
                return False
            del self._pending[key]
            self._ready.pop(key, None)
            self._urgent.pop(key, None)
            entry.future.cancel()
            return True

    # ------------------------------------------------------------ looking

    def pending_tag(self, key: Hashable) -> str | None:
        """The tag of the pending job of ``key`` (None when none is pending)."""
        with self._cv:
            entry = self._pending.get(key)
            return None if entry is None else entry.tag

    def busy(self, key: Hashable) -> bool:
        """Whether a job of ``key`` is pending or running now (one lock
        acquisition: for a caller's hot path)."""
        with self._cv:
            return key in self._pending or key in self._running

    def running(self, key: Hashable) -> bool:
        """Whether a worker runs a job of ``key`` now."""
        with self._cv:
            return key in self._running

    def stats(self) -> dict[str, int]:
        """``{"queued": pending jobs, "running": jobs running, "threads":
        worker threads alive}``: the queue's whole footprint is O(queued +
        running), each at most one per key."""
        with self._cv:
            return {"queued": len(self._pending), "running": len(self._running),
                    "threads": sum(1 for t in self._threads if t.is_alive())}

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop taking work: pending jobs are cancelled (their futures too),
        workers end after the job each is running (``join`` waits for that).
        Idempotent."""
        with self._cv:
            self._closed = True
            dropped = list(self._pending.values())
            self._pending.clear()
            self._ready.clear()
            self._urgent.clear()
            self._cv.notify_all()
        for entry in dropped:
            entry.future.cancel()

    def join(self, timeout_s: float) -> bool:
        """After ``close``: wait up to ``timeout_s`` seconds (in all) for the
        workers to end. Returns True when none is alive."""
        with self._cv:
            threads = list(self._threads)
        end = time.monotonic() + max(0.0, timeout_s)
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    # ------------------------------------------------------------ workers

    def _wake(self) -> None:
        """Caller holds the lock: hand the new ready key to an idle worker, and
        start one more (while fewer than ``workers`` run) when the ready keys
        outnumber the idle workers. A worker notified but not yet awake still
        counts as idle, so comparing with the ready keys, not only asking
        whether one is idle, keeps a burst of puts from queueing behind one
        waking worker."""
        if self._idle:
            self._cv.notify()
        if len(self._ready) + len(self._urgent) <= self._idle:
            return
        self._threads = [t for t in self._threads if t.is_alive()]
        if len(self._threads) < self.workers:
            t = threading.Thread(target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._urgent and not self._closed:
                    self._idle += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._idle -= 1
                if self._closed:
                    return
                key, _ = (self._urgent or self._ready).popitem(last=False)
                entry = self._pending.pop(key)
                self._running[key] = (entry.future, entry.tag)
            try:
                if entry.future.set_running_or_notify_cancel():
                    try:
                        result = entry.job()
                    except BaseException as exc:  # the job's failure is its future's, not the worker's
                        entry.future.set_exception(exc)
                    else:
                        entry.future.set_result(result)
            finally:
                with self._cv:
                    del self._running[key]
                    if key in self._pending and not self._closed:
                        # put while it ran: runs after it, behind those waiting (of its urgency)
                        (self._urgent if self._pending[key].urgent else self._ready)[key] = None

