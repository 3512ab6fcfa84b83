"""The kubelet door's asyncio loop: one thread that runs every gRPC call of the door.

The device plugin server, the Registration client and the PodResources client
speak gRPC through grpclib (asyncio + h2, ADR 0018), so their I/O runs on one
asyncio event loop. That loop lives on one daemon thread owned by the door
(``LoopThread``); everything else in fracplugin is synchronous and calls into
the loop through ``LoopThread.call``, which is
``asyncio.run_coroutine_threadsafe(...).result(timeout)``.

Rules:

* never block the loop thread: the door's synchronous work (the allocator's
  ledger fsync, watch-cache waits, PodResources lookups made by the
  allocator) runs in ``LoopThread.executor``, a small thread pool;
* never call ``LoopThread.call`` from the loop thread itself: the coroutine
  could never run while the caller waits for it. ``call`` refuses with
  ``RuntimeError`` instead of deadlocking.

Concurrency model: one loop thread (``fracplugin-grpc``) plus up to
``workers`` executor threads (``fracplugin-dp_<n>``, started on demand by
``concurrent.futures.ThreadPoolExecutor``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Callable, Coroutine, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopStopped(RuntimeError):
    """The loop is not running, or stopped while a call waited for it."""


class LoopThread:
    """One asyncio event loop running on one daemon thread, plus a small executor.

    Args:
        name: the loop thread's name (``fracplugin-grpc``).
        workers: threads of ``executor`` (the synchronous work of handlers);
            at least 1.

    Raises:
        ValueError: ``workers`` < 1.
    """

    def __init__(self, name: str = "fracplugin-grpc", workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"executor workers {workers} must be at least 1")
        self.name = name
        self.workers = workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop. Raises RuntimeError when not started."""
        loop = self._loop
        if loop is None:
            raise RuntimeError(f"{self.name}: event loop not started")
        return loop

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The pool that runs handlers' blocking work. Raises RuntimeError when not started."""
        ex = self._executor
        if ex is None:
            raise RuntimeError(f"{self.name}: event loop not started")
        return ex

    def running(self) -> bool:
        """True between ``start`` and ``stop``."""
        return self._thread is not None and self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        """True when the caller runs on the loop thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def start(self) -> "LoopThread":
        """Start the thread and its loop (idempotent); returns self once the loop runs."""
        with self._lock:
            if self.running():
                return self
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                try:
                    loop.run_forever()
                finally:
                    try:
                        _cancel_all(loop)
                    finally:
                        loop.close()

            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.workers, thread_name_prefix="fracplugin-dp")
            self._loop = loop
            self._thread = threading.Thread(target=run, name=self.name, daemon=True)
            self._thread.start()
            started.wait()
            return self

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout_s``
        seconds (None: no limit; the coroutine is then expected to carry its own
        deadline). On timeout the coroutine is cancelled.

        Raises:
            RuntimeError: called from the loop thread (it would wait for
                itself forever);
            LoopStopped (a RuntimeError): the loop is not running, or stopped
                during the call;
            TimeoutError: ``timeout_s`` passed;
            whatever the coroutine raises.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(f"{self.name}: a blocking call into the event loop from the loop thread itself "
                               "would deadlock; await the coroutine instead")
        loop = self._loop
        if loop is None or not self.running():
            coro.close()
            raise LoopStopped(f"{self.name}: event loop not running")
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # closed between the check and now
            coro.close()
            raise LoopStopped(f"{self.name}: event loop not running") from None
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{self.name}: no answer within {timeout_s} s") from None
        except concurrent.futures.CancelledError:
            raise LoopStopped(f"{self.name}: event loop stopped during the call") from None

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Await ``fn(*args)`` run in ``executor`` (from a coroutine on the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Cancel what still runs on the loop, stop it and join the thread (at
        most ``timeout_s`` seconds; the thread is a daemon). The executor's
        threads finish their current job and exit."""
        with self._lock:
            loop, t, ex = self._loop, self._thread, self._executor
            self._thread = None
            self._executor = None
        if loop is not None and t is not None and t.is_alive():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed already
                pass
            if t is not threading.current_thread():
                t.join(timeout_s)
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._thread is None:
                self._loop = None


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task still pending on ``loop`` and let them unwind (bounded: one run)."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
    try:
        loop.run_until_complete(loop.shutdown_asyncgens())
    except Exception:  # a broken generator must not keep the thread alive
        log.debug("shutdown_asyncgens failed", exc_info=True)
