"""How the NRI stub serves one request in flight: the call record (``_Call``),
the watchdog (``_Watchdog``), the handler threads (``_Workers``), one
connection's state (``_Session``) and the serving path (``_Server``). The
concurrency model: ``nri/stub.py``'s module docstring.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable

from ..safetext import escape_controls
from .dispatch import BUDGET_FRACTION, MAX_UNANSWERED, MAX_WORKERS, Dispatcher
from .interfaces import CallContext
from .transport import BUSY, SPILLED, ConnectionClosed, NriTransport
from .ttrpc import Code, RequestReceived, RpcError
from ..logs import guarded

log = logging.getLogger("fracplugin.nri.stub")  # the stub's log

_PENDING, _DONE, _EXPIRED = 0, 1, 2


class _Call:
    """One request in flight. The watchdog keeps a reference until the call's
    deadline even when it finished long before, so ``_serve`` drops the
    request bytes and message as soon as it is done with them."""

    __slots__ = ("session", "ev", "method", "stream_id", "ctx", "request", "_lock", "state")

    def __init__(self, session: "_Session", ev: RequestReceived, ctx: CallContext) -> None:
        self.session = session
        self.ev: RequestReceived | None = ev
        self.method = ev.method
        self.stream_id = ev.stream_id
        self.ctx = ctx
        self.request: Any = None
        self._lock = threading.Lock()
        self.state = _PENDING

    def claim(self, state: int) -> bool:
        with self._lock:
            if self.state != _PENDING:
                return False
            self.state = state
            return True


class _Watchdog:
    """One thread that answers calls whose handler overran its budget. ``add``
    only wakes it for a deadline earlier than every one it waits for, and it
    wakes at most once per ``tick_s`` (finished calls are skipped when their
    deadline passes): an overrun is answered at most ``tick_s`` late (20 ms
    against a 0.5 s margin before the runtime's own timeout).
    """

    def __init__(self, on_expired: Callable[[_Call], None], tick_s: float = 0.02) -> None:
        self._on_expired = on_expired
        self._tick_s = tick_s
        self._heap: list[tuple[float, int, _Call]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()  # taken directly in add: Condition's own __enter__ is Python code
        self._cond = threading.Condition(self._lock)
        self._stopped = False
        self._wake_at: float | None = None  # when the thread will next look; None = idle
        self._thread = threading.Thread(target=self._run, name="nri-watchdog", daemon=True)
        self._thread.start()

    def add(self, call: _Call) -> None:
        deadline = call.ctx.deadline
        with self._lock:
            heapq.heappush(self._heap, (deadline, next(self._seq), call))
            if self._wake_at is None or deadline < self._wake_at:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            expired: list[_Call] = []
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                heap = self._heap
                while heap and heap[0][0] <= now:
                    call = heapq.heappop(heap)[2]
                    if call.state == _PENDING:
                        expired.append(call)
                if not expired:
                    if heap:
                        self._wake_at = max(heap[0][0], now + self._tick_s)
                        self._cond.wait(self._wake_at - now)
                    else:
                        self._wake_at = None
                        self._cond.wait()
                    continue
            for call in expired:
                guarded(log, "nri watchdog answering an expired call", self._on_expired, call)


class _Workers:
    """``n`` handler threads, started up front, fed by one ``queue.SimpleQueue``:
    ``submit`` is one C-level ``put`` (no Future, no idle semaphore, as in
    ``ThreadPoolExecutor``) on the per-request path. ``shutdown`` drops queued
    work and ends the threads after their current item; ``submit`` then
    raises RuntimeError.
    """

    def __init__(self, n: int, name: str) -> None:
        if n < 1:
            raise ValueError("need at least one handler thread")
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("handler pool is shut down")
        self._q.put(fn)

    def shutdown(self) -> None:
        self._closed = True
        while True:  # drop what is queued
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._q.put(None)

    def _run(self) -> None:
        get = self._q.get
        while True:
            fn = get()
            if fn is None or self._closed:
                return
            try:
                fn()
            except Exception:  # _serve handles its own errors; never lose a thread
                log.exception("nri handler thread: unexpected error")


class _Session:
    """One connection to the runtime."""

    def __init__(self, number: int, dispatcher: Dispatcher) -> None:
        self.number = number
        self.dispatcher = dispatcher
        self.transport: NriTransport | None = None
        self.registered = threading.Event()
        self.synchronized = False
        self.unanswered = 0  # requests read, answer not written yet
        self.closing = False  # a bound closed this connection: later requests on it are dropped
        self.lock = threading.Lock()


class _Server:
    """The serving path of ``NriStub``: count a request, route it to the
    reader thread or the handler threads, answer it (or let the watchdog
    answer it when its budget is spent). Owns the handler threads and the
    watchdog; made by ``NriStub.start``. ``on_bound(name)``: a bound was hit
    (``unanswered``); ``on_synchronized()``: a Synchronize exchange completed
    (called before its answer leaves)."""

    def __init__(self, handler: object, plugin_name: str, *,
                 on_bound: Callable[[str], None], on_synchronized: Callable[[], None]) -> None:
        self.handler = handler
        self.plugin_name = plugin_name
        self._on_bound = on_bound
        self._on_synchronized = on_synchronized
        self._pool = _Workers(MAX_WORKERS, "nri-handler")
        self._watchdog = _Watchdog(self._expired)

    def stop(self, pool: bool = True) -> None:
        """Stop the watchdog and (``pool``) the handler threads."""
        self._watchdog.stop()
        if pool:
            self._pool.shutdown()

    def dispatch(self, session: _Session, ev: RequestReceived) -> None:
        """Reader thread: route one request. Served here when nothing in it
        can wait (``Dispatcher.inline``), else handed to the pool; never
        blocks on the socket either way."""
        transport = session.transport
        assert transport is not None
        dispatcher = session.dispatcher
        err = dispatcher.check(ev)
        if err is not None:
            log.warning("nri call for an unknown service or method", extra={"service": ev.service, "method": ev.method})
            transport.respond(ev.stream_id, code=err.code, message=err.message)
            return
        if not self._count_unanswered(session, transport):
            return
        call = _Call(session, ev, dispatcher.context(ev, BUDGET_FRACTION))
        self._watchdog.add(call)
        if dispatcher.inline(ev.method):
            self._serve(call, inline=True)
            return
        try:
            self._pool.submit(functools.partial(self._serve, call))
        except RuntimeError:  # pool shut down: stopping
            if call.claim(_DONE):
                self._send(call, None, RpcError(Code.UNAVAILABLE, "plugin is stopping"))

    def _count_unanswered(self, session: _Session, transport: NriTransport) -> bool:
        """Count one more request read and not answered; past
        ``MAX_UNANSWERED`` close the connection (False: do not serve it)."""
        with session.lock:
            if session.closing:  # already over the bound and being closed: read, not served
                return False
            session.unanswered += 1
            over = session.unanswered > MAX_UNANSWERED
            session.closing = over
        if over:
            log.error("nri runtime does not read the plugin's answers: %d requests unanswered (bound %d); "
                      "closing the connection", session.unanswered, MAX_UNANSWERED,
                      extra={"session": session.number, "bound": "unanswered"})
            self._on_bound("unanswered")
            transport.close(f"{session.unanswered} requests unanswered: the runtime does not read the answers "
                            f"(bound {MAX_UNANSWERED})")
            return False
        return True

    @staticmethod
    def _answered(session: _Session) -> None:
        with session.lock:
            session.unanswered -= 1

    def _expired(self, call: _Call) -> None:
        if not call.claim(_EXPIRED):
            return
        msg = f"{self.plugin_name}: {call.method} did not finish within its budget of {call.ctx.budget_s:.2f} s"
        log.warning(
            "nri handler overran its budget; answered UNAVAILABLE",
            extra={"method": call.method, "stream_id": call.stream_id, "seconds": call.ctx.budget_s},
        )
        self._send(call, None, RpcError(Code.UNAVAILABLE, msg))

    def _send(self, call: _Call, payload: bytes | None, error: RpcError | None, inline: bool = False) -> None:
        """Write the answer of ``call``. ``inline`` (the reader thread): never
        block; a write another thread holds, or one the runtime does not take
        at once, is finished on a handler thread."""
        transport = call.session.transport
        assert transport is not None
        # The runtime shows error messages (kubectl describe): no forged lines.
        message = escape_controls(error.message) if error is not None else ""
        code = error.code if error is not None else None
        counted = True  # False: a handler thread finishes the write and counts it
        try:
            if inline:
                outcome = transport.answer_nowait(call.stream_id, payload or b"", code, message,
                                                  finish=functools.partial(self._finish_answer, call.session))
                if outcome == BUSY:  # another thread writes: a handler thread waits for the lock instead
                    counted = False  # that _send counts it
                    try:
                        self._pool.submit(functools.partial(self._send, call, payload, error))
                    except RuntimeError:  # stopping: no pool left, wait here
                        self._send(call, payload, error)
                elif outcome == SPILLED:
                    counted = False
            else:
                transport.respond(call.stream_id, payload or b"", code, message)
        except (ConnectionClosed, ValueError) as exc:
            log.info(
                "nri answer not sent: connection gone",
                extra={"method": call.method, "stream_id": call.stream_id, "reason": str(exc)},
            )
        finally:
            if counted:
                self._answered(call.session)

    def _finish_answer(self, session: _Session, write_rest: Callable[[], None]) -> None:
        """``NriTransport.answer_nowait``'s ``finish``: the rest of an answer
        is written (and counted) on a handler thread. Raises RuntimeError when
        the pool is shut down (the transport then closes the connection)."""
        def job() -> None:
            try:
                write_rest()
            finally:
                self._answered(session)
        self._pool.submit(job)

    def _serve(self, call: _Call, inline: bool = False) -> None:
        """Run the handler and answer, unless the watchdog did (a pool thread,
        or the reader thread with ``inline``)."""
        if call.state != _PENDING:
            return  # expired while queued: never run it
        method = call.method
        response: Any = None
        error: RpcError | None = None
        try:
            ev, call.ev = call.ev, None
            assert ev is not None
            call.request = call.session.dispatcher.decode(ev)
            del ev
            response = call.session.dispatcher.routes[method].serve(call.request, call.ctx)
        except RpcError as exc:
            error = exc
        except Exception as exc:
            log.exception("nri handler failed", extra={"method": method, "stream_id": call.stream_id})
            error = RpcError(Code.INTERNAL, f"{self.plugin_name}: {method} failed: {type(exc).__name__}: {exc}")
        payload = None
        if error is None:
            try:
                payload = response.SerializeToString()
            except Exception as exc:
                log.exception("nri response does not encode", extra={"method": method})
                error = RpcError(Code.INTERNAL, f"{self.plugin_name}: {method} response does not encode: {exc}")
        if call.claim(_DONE):
            call.request = None
            if method == "Synchronize" and error is None and not response.more:
                # Counted before the answer leaves: the runtime proceeds on it.
                call.session.synchronized = True
                self._on_synchronized()
            self._send(call, payload, error, inline)
            return
        log.warning("nri handler result arrived after its budget and was dropped", extra={"method": method})
        abandoned = getattr(self.handler, "abandoned", None)
        if callable(abandoned):
            guarded(log, "nri abandoned() hook", abandoned, method, call.request,
                    response if error is None else error, extra={"method": method})
