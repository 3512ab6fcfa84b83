"""Generic NRI plugin runtime: register, configure, synchronize, serve events,
reconnect. Knows nothing about GPUs; the behaviour lives in a handler object.

Concurrency model: threads.

- one *run* thread (``NriStub.start``) connects, registers and waits for the
  connection to end, then reconnects with backoff (tenacity);
- one *reader* thread per connection (``transport.NriTransport``) parses
  frames and routes each request through the dispatch table. It serves a
  request itself when nothing in it can wait: a method the handler does not
  implement (an empty answer), or one the handler's ``may_block(method)``
  says will not wait now (``interfaces.MayBlockInterface``). Its answer is
  written without blocking (``NriTransport.answer_nowait``): when another
  thread is writing, or the runtime does not read fast enough, the rest of
  the write goes to a handler thread, so the reader never stops reading
  (the bounds below keep working against a runtime that never reads);
- a fixed pool of handler threads (``_Workers``, ``max_workers``, default 16)
  runs every other handler call (all of them for a handler without
  ``may_block``), so requests that wait (on MPS, on a drain) are served
  concurrently and RegisterPlugin never blocks the reader (Configure can
  arrive before the register reply, nri-protocol.md section 1.6);
- one *watchdog* thread bounds every handler, wherever it runs: when a
  handler has not answered within its budget (``budget_fraction`` x the
  request timeout, 0.75 x 2 s = 1.5 s by default, and the same fraction of
  the request's own ``timeout_nano``), the stub answers ``UNAVAILABLE``
  itself and discards the late result, calling the handler's optional
  ``abandoned(method, request, response)`` so it can undo side effects. A
  late reply would otherwise make the runtime drop the whole plugin (section
  1.8, "Errors and timeouts").

Why the reader serves (issue 14, ADR "nri-reader-thread-serving"): handing a
request from the reader to a pool thread costs two thread wake-ups and a GIL
hand-off per call (90-170 us end to end on the 2-core bench machine, a third
of a CreateContainer), and containerd's NRI adaptation sends one
CreateContainer at a time anyway. A handler that may wait keeps the pool:
while the reader runs a handler no other request of that connection is read.

Protocol rules followed (nri-protocol.md):

- external mode: connect to ``socket_path`` (default ``/var/run/nri/nri.sock``);
  runtime-launched mode: use the socket on fd ``NRI_PLUGIN_SOCKET`` with
  ``NRI_PLUGIN_NAME`` / ``NRI_PLUGIN_IDX`` (section 1.5). In fd mode EOF ends
  the stub (the runtime would relaunch us); in external mode EOF means the
  runtime went away and we reconnect until the socket is back (section 1.9).
- ``ConfigureResponse.events`` is an explicit mask within 0x7FF, valid on every
  runtime since NRI v0.3 (section 1.4).
- Synchronize parts with ``more = true`` are answered ``{more: true}``; the
  handler sees all pods and containers at once on the last part (section 1.6).
- both the v0.12 dedicated event RPCs and ``StateChange`` reach the same
  handler method (section 1.7). Unknown services/methods are answered
  ``UNIMPLEMENTED`` "service X" / "method X" (section 1.3).
- ``Shutdown`` is answered with Empty (section 1.9).

Handler: any object implementing some of the interfaces of
``fracplugin.nri.interfaces`` (one typed Protocol per NRI request or event,
as containerd/nri ``pkg/stub``: ``CreateContainerInterface.create_container(
pod, container, ctx)`` and so on; ``ctx`` is a ``CallContext``). The
dispatch table (``Dispatcher.routes``) is built once per connection from the
methods the handler has; an absent method answers an empty response. The
subscription mask follows from the same methods (``handler_mask``) unless a
mask is configured (the ``events`` argument, else the handler's ``events``
attribute), and, as in the Go stub, a configured mask may not name events the
handler does not implement. Optional stub hooks: ``abandoned``,
``may_block``, ``close``.

A handler raises ``ttrpc.RpcError(code, message)`` to answer with an error
status; any other exception is logged and answered ``INTERNAL``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import os
import queue
import re
import socket
import threading
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from tenacity import Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential, wait_random

from .._proto import nri_pb2
from ..safetext import escape_controls, quote
from .interfaces import EVENTS, CallContext, EventSpec, check_handler, event_mask, handler_mask, implements
from .mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from .transport import BUSY, SPILLED, ConnectionClosed, NriTransport
from .ttrpc import Code, RequestReceived, RpcError, unimplemented_method, unimplemented_service

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "MAX_SYNC_BYTES",
    "MAX_SYNC_PARTS",
    "MAX_UNANSWERED",
    "PLUGIN_SERVICE",
    "RUNTIME_SERVICE",
    "VALID_EVENTS_MASK",
    "CallContext",
    "Dispatcher",
    "NriStub",
    "event_mask",
]

log = logging.getLogger(__name__)

DEFAULT_SOCKET_PATH = "/var/run/nri/nri.sock"
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
VALID_EVENTS_MASK = 0x7FF
"""Events every runtime since NRI v0.3 accepts (``ValidEvents`` up to v0.9)."""
DEFAULT_REQUEST_TIMEOUT_S = 2.0
DEFAULT_REGISTRATION_TIMEOUT_S = 5.0

# Bounds on what a runtime can make the plugin hold (issue 13 item 5). A runtime
# splits Synchronize only to stay under ttrpc's 4 MiB message limit
# (nri-protocol.md 1.6), so a real node needs a handful of parts: a node at
# kubelet's 110-pod default with a few containers each is well under 1 MiB.
MAX_SYNC_PARTS = 64
"""Most ``more=true`` Synchronize parts held before the last one."""
MAX_SYNC_BYTES = 16 << 20
"""Most encoded bytes (16 MiB) of Synchronize parts held before the last one."""
MAX_UNANSWERED = 1024
"""Most requests of one connection read but not yet answered on the wire. A
runtime that sends requests and never reads the answers makes them pile up
(a blocked write holds every later answer); past this bound the connection
is closed (the stub reconnects)."""

_NAME_RE = re.compile(r"^[a-zA-Z0-9_.+-]+$")
_IDX_RE = re.compile(r"^[0-9]{2}$")

E = nri_pb2

Serve = Callable[[Any, CallContext], Any]
"""A route's work: (decoded request, ctx) -> the response message."""


class _Route(NamedTuple):
    """One entry of the dispatch table: the request class, what serves it,
    and whether that runs handler code (then ``may_block`` is asked)."""

    request: Any
    serve: Serve
    runs_handler: bool


def _checked(result: Any, resp_cls: Any, attr: str | None) -> Any:
    """``result`` as the response: None -> empty ``resp_cls``; another type is
    a handler bug (TypeError, answered INTERNAL)."""
    if result is None:
        return resp_cls()
    if not isinstance(result, resp_cls):
        raise TypeError(f"{attr} returned {type(result).__name__}, expected {resp_cls.__name__}")
    return result


def _empty(spec: EventSpec) -> Serve:
    resp = spec.response
    return lambda req, ctx: resp()


def _pod_event(spec: EventSpec, fn: Callable[..., Any]) -> Serve:
    resp = spec.response

    def serve(req: Any, ctx: CallContext) -> Any:
        fn(req.pod, ctx)
        return resp()
    return serve


def _container_event(spec: EventSpec, fn: Callable[..., Any]) -> Serve:
    resp = spec.response

    def serve(req: Any, ctx: CallContext) -> Any:
        fn(req.pod, req.container, ctx)
        return resp()
    return serve


def _whole_request(spec: EventSpec, fn: Callable[..., Any]) -> Serve:
    return lambda req, ctx: _checked(fn(req, ctx), spec.response, spec.attr)


def _create_container(spec: EventSpec, fn: Callable[..., Any]) -> Serve:
    def serve(req: Any, ctx: CallContext) -> Any:
        result = fn(req.pod, req.container, ctx)
        if isinstance(result, E.ContainerAdjustment):
            return E.CreateContainerResponse(adjust=result)
        return _checked(result, E.CreateContainerResponse, spec.attr)
    return serve


def _update_container(spec: EventSpec, fn: Callable[..., Any]) -> Serve:
    return lambda req, ctx: _checked(fn(req.pod, req.container, req.linux_resources, ctx), spec.response, spec.attr)


def _stop_container(spec: EventSpec, fn: Callable[..., Any]) -> Serve:
    def serve(req: Any, ctx: CallContext) -> Any:
        result = fn(req.pod, req.container, ctx)
        if isinstance(result, (list, tuple)):
            return E.StopContainerResponse(update=list(result))
        return _checked(result, E.StopContainerResponse, spec.attr)
    return serve


_ADAPTERS: dict[str, Callable[[EventSpec, Callable[..., Any]], Serve]] = {
    "pod": _pod_event, "container": _container_event, "request": _whole_request,
    "create": _create_container, "update": _update_container, "stop": _stop_container,
}
"""How a handler method of each ``EventSpec.shape`` is called."""

_STATE_CHANGE_SHAPES = ("pod", "container")
"""Events a v0.8 runtime delivers as ``StateChange`` (nri-protocol.md 1.7)."""


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
    """One thread that answers calls whose handler overran its budget.

    Cheap on the hot path: ``add`` only wakes the thread when the new call's
    deadline is earlier than every deadline it already waits for (with equal
    budgets, only the first call after an idle spell), and the thread wakes
    at most once per ``tick_s`` (a finished call is simply skipped when its
    deadline passes). An overrun is therefore answered at most ``tick_s``
    late (20 ms against a 0.5 s margin before the runtime's own timeout).
    """

    def __init__(self, on_expired: Callable[[_Call], None], tick_s: float = 0.02) -> None:
        self._on_expired = on_expired
        self._tick_s = tick_s
        self._heap: list[tuple[float, int, _Call]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._wake_at: float | None = None  # when the thread will next look; None = idle
        self._thread = threading.Thread(target=self._run, name="nri-watchdog", daemon=True)
        self._thread.start()

    def add(self, call: _Call) -> None:
        deadline = call.ctx.deadline
        with self._cond:
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
                try:
                    self._on_expired(call)
                except Exception:
                    log.exception("nri watchdog failed to answer an expired call")


class _Workers:
    """A fixed set of handler threads fed by one ``queue.SimpleQueue``.

    Leaner than ``ThreadPoolExecutor`` on the per-request path: ``submit`` is
    one C-level ``put`` (no Future, no idle semaphore), which matters because
    the reader thread hands every request over here. Threads are started up
    front (``n`` of them, blocked in ``get`` until work arrives).
    ``shutdown`` drops queued work and ends the threads once their current
    item is done; ``submit`` raises RuntimeError afterwards.
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


class Dispatcher:
    """Per-connection request handling without I/O: check, decode, route
    through the dispatch table, build the response message. ``NriStub`` runs
    one per connection; tests can drive it directly with ``RequestReceived``
    events.

    ``routes`` (method -> ``_Route``) is built once from the methods
    ``handler`` implements (``interfaces.EVENTS``); ``Configure``,
    ``Synchronize``, ``Shutdown``, ``StateChange`` and the empty-id check of
    ``CreateContainer`` are the stub's own around the handler's method.

    State kept per connection (nri-protocol.md 1.5, 1.6): the request and
    registration timeouts from ConfigureRequest (seconds; 2 s / 5 s until
    Configure says otherwise), the runtime's name and version, and the parts
    of a split Synchronize. Thread-safe.
    """

    def __init__(self, handler: object, events: int, plugin_name: str = "plugin", *,
                 max_sync_parts: int = MAX_SYNC_PARTS, max_sync_bytes: int = MAX_SYNC_BYTES,
                 on_bound: Callable[[str], None] | None = None) -> None:
        self.handler = handler
        self.max_sync_parts = max_sync_parts
        self.max_sync_bytes = max_sync_bytes
        self._on_bound = on_bound
        self._sync_parts = 0
        self._sync_bytes = 0
        self.events = events
        self.plugin_name = plugin_name
        self.request_timeout_s = DEFAULT_REQUEST_TIMEOUT_S
        self.registration_timeout_s = DEFAULT_REGISTRATION_TIMEOUT_S
        self.runtime_name = ""
        self.runtime_version = ""
        self.configured = False
        self._sync_pods: list[Any] = []
        self._sync_containers: list[Any] = []
        self._lock = threading.Lock()
        fns = {s.method: getattr(handler, s.attr) for s in EVENTS if implements(handler, s) and s.attr}
        self._fns = fns
        self._changes: dict[int, Callable[[Any, CallContext], Any]] = {
            s.event: _ADAPTERS[s.shape](s, fns[s.method])
            for s in EVENTS if s.shape in _STATE_CHANGE_SHAPES and s.event is not None and s.method in fns}
        """StateChange event -> the handler's method for it."""
        self.routes: dict[str, _Route] = {s.method: self._route(s) for s in EVENTS}
        """The dispatch table: ttrpc method -> ``_Route``."""
        may_block = getattr(handler, "may_block", None)
        self._may_block: Callable[[str], bool] | None = may_block if callable(may_block) else None

    def _route(self, spec: EventSpec) -> _Route:
        """The table entry of ``spec``: the stub's own route for Configure,
        Synchronize, Shutdown and StateChange, else the handler's method
        through its adapter (``_ADAPTERS``), else an empty answer."""
        own: dict[str, Serve] = {"configure": self._configure, "synchronize": self._synchronize,
                                 "shutdown": self._shutdown, "state_change": self._state_change}
        fn = self._fns.get(spec.method)
        if spec.shape in own:
            runs = fn is not None or (spec.shape == "state_change" and bool(self._changes))
            serve = own[spec.shape]
        else:
            runs = fn is not None
            serve = _ADAPTERS[spec.shape](spec, fn) if fn is not None else _empty(spec)
        if spec.method == "CreateContainer":
            serve = functools.partial(self._refuse_empty_id, serve)
        return _Route(spec.request, serve, runs)

    def check(self, ev: RequestReceived) -> RpcError | None:
        """The UNIMPLEMENTED error for an unknown service or method, else None."""
        if ev.service != PLUGIN_SERVICE:
            return unimplemented_service(ev.service)
        if ev.method not in self.routes:
            return unimplemented_method(ev.method)
        return None

    def inline(self, method: str) -> bool:
        """Whether ``method`` (known to ``routes``) may be served on the reader
        thread: no handler code runs, or the handler's ``may_block(method)``
        says it will not wait (a failing ``may_block`` counts as "may block")."""
        if not self.routes[method].runs_handler:
            return True
        if self._may_block is None:
            return False
        try:
            return not self._may_block(method)
        except Exception:
            log.exception("nri handler may_block() failed; served on a handler thread", extra={"method": method})
            return False

    def context(self, ev: RequestReceived, budget_fraction: float, now: float | None = None) -> CallContext:
        """The ``CallContext`` of a request: budget = ``budget_fraction`` x the
        smaller of the request timeout and the request's ``timeout_nano``."""
        limit = self.request_timeout_s
        if ev.timeout_nano > 0:
            limit = min(limit, ev.timeout_nano / 1e9)
        budget = limit * budget_fraction
        now = time.monotonic() if now is None else now
        return CallContext(ev.method, ev.stream_id, self.request_timeout_s, budget, now + budget,
                           self.runtime_name, self.runtime_version)

    def decode(self, ev: RequestReceived) -> Any:
        """The request message of ``ev``; raises RpcError INVALID_ARGUMENT
        (or UNIMPLEMENTED for an unknown method)."""
        err = self.check(ev)
        if err is not None:
            raise err
        try:
            return self.routes[ev.method].request.FromString(ev.payload)
        except Exception as exc:
            raise RpcError(Code.INVALID_ARGUMENT, f"cannot decode {ev.method} request: {exc}") from None

    def handle(self, method: str, req: Any, ctx: CallContext) -> Any:
        """Run the route of ``method`` for one decoded request; return the
        response message. Raises RpcError (the handler's or the stub's), or
        TypeError for a handler result of the wrong type (a bug, answered
        INTERNAL by the caller); KeyError for a method not in ``routes``."""
        return self.routes[method].serve(req, ctx)

    # ------------------------------------------------------ the stub's own routes

    def _configure(self, req: Any, ctx: CallContext) -> Any:
        with self._lock:
            if req.request_timeout > 0:
                self.request_timeout_s = req.request_timeout / 1000.0
            if req.registration_timeout > 0:
                self.registration_timeout_s = req.registration_timeout / 1000.0
            self.runtime_name, self.runtime_version = req.runtime_name, req.runtime_version
            self.configured = True
        ctx.request_timeout_s = self.request_timeout_s
        ctx.runtime_name, ctx.runtime_version = self.runtime_name, self.runtime_version
        log.info("nri configured", extra={
            "runtime": f"{req.runtime_name} {req.runtime_version}", "nri_version": req.NRI_version,
            "request_timeout_ms": req.request_timeout, "registration_timeout_ms": req.registration_timeout,
            "events": f"0x{self.events:x}"})
        fn = self._fns.get("Configure")
        if fn is not None:
            fn(req, ctx)
        return E.ConfigureResponse(events=self.events)

    def _synchronize(self, req: Any, ctx: CallContext) -> Any:
        """Hold ``more=true`` parts (bounded: RESOURCE_EXHAUSTED past
        ``max_sync_parts`` / ``max_sync_bytes``, the parts dropped), hand
        everything to the handler with the last part."""
        with self._lock:
            parts, size = self._sync_parts + 1, self._sync_bytes + req.ByteSize()
            if parts > self.max_sync_parts or size > self.max_sync_bytes:
                self._sync_pods, self._sync_containers = [], []
                self._sync_parts = self._sync_bytes = 0
                bound = "sync_parts" if parts > self.max_sync_parts else "sync_bytes"
            else:
                bound = ""
                self._sync_parts, self._sync_bytes = parts, size
                self._sync_pods.extend(req.pods)
                self._sync_containers.extend(req.containers)
                if req.more:
                    return E.SynchronizeResponse(more=True)
                pods, containers = self._sync_pods, self._sync_containers
                self._sync_pods, self._sync_containers = [], []
                self._sync_parts = self._sync_bytes = 0
        if bound:
            msg = (f"{self.plugin_name}: Synchronize split into {parts} parts / {size} bytes so far, above the "
                   f"bound of {self.max_sync_parts} parts / {self.max_sync_bytes} bytes; parts dropped")
            log.error("nri Synchronize too large; refused", extra={"bound": bound, "parts": parts, "bytes": size})
            if self._on_bound is not None:
                self._on_bound(bound)
            raise RpcError(Code.RESOURCE_EXHAUSTED, msg)
        fn = self._fns.get("Synchronize")
        result = fn(pods, containers, ctx) if fn is not None else None
        if isinstance(result, E.SynchronizeResponse):
            result.more = False
            return result
        return E.SynchronizeResponse(update=list(result or ()))

    def _shutdown(self, req: Any, ctx: CallContext) -> Any:
        log.info("nri runtime announced shutdown")
        fn = self._fns.get("Shutdown")
        if fn is not None:
            fn(ctx)
        return E.Empty()

    def _state_change(self, req: Any, ctx: CallContext) -> Any:
        """A v0.8 event: the handler's method for ``req.event`` (pod and
        container events only; others are logged and answered Empty)."""
        serve = self._changes.get(req.event)
        if serve is None:
            if not any(s.event == req.event and s.shape in _STATE_CHANGE_SHAPES for s in EVENTS):
                log.info("nri StateChange for an event without a state-change handler", extra={"event": req.event})
            return E.Empty()
        serve(req, ctx)
        return E.Empty()

    def _refuse_empty_id(self, serve: Serve, req: Any, ctx: CallContext) -> Any:
        if not req.container.id:
            # Nothing could ever release what were admitted under an empty id (RemoveContainer names it).
            raise RpcError(Code.INVALID_ARGUMENT, f"{self.plugin_name}: CreateContainer of container "
                           f"{quote(req.container.name)} in pod {quote(req.pod.namespace)}/{quote(req.pod.name)} "
                           "has an empty container id; refused (a container is identified by its id)")
        return serve(req, ctx)


def _subscription(handler: object, events: int | None) -> int:
    """The subscription mask: ``events``, else the handler's ``events``
    attribute, else the events of the interfaces it implements. Raises
    ValueError for a handler method that cannot take its interface's
    arguments (``interfaces.check_handler``), a mask that is not an integer,
    is 0, beyond ``VALID_EVENTS_MASK``, or names events the handler does not
    implement (containerd/nri ``pkg/stub`` Configure: "Only allow plugins to
    subscribe to events they can handle"), and, with no mask configured, for a
    handler implementing events beyond ``VALID_EVENTS_MASK`` (naming them)."""
    check_handler(handler)
    implemented = handler_mask(handler)
    if events is None:
        events = getattr(handler, "events", None)
    if events is None:
        beyond = implemented & ~VALID_EVENTS_MASK
        if beyond:
            raise ValueError(f"the handler implements {', '.join(_event_names(beyond))}, beyond the events every "
                             f"runtime accepts (0x{VALID_EVENTS_MASK:x}, NRI v0.3 to v0.9): configure an explicit "
                             f"event mask within 0x{VALID_EVENTS_MASK:x}")
        events = implemented
    if isinstance(events, bool) or not isinstance(events, int):
        raise ValueError(f"event mask {events!r} must be an integer bit mask (interfaces.event_mask)")
    if events == 0 or events & ~VALID_EVENTS_MASK:
        raise ValueError(f"event mask 0x{events:x} must be non-zero and within 0x{VALID_EVENTS_MASK:x}")
    unhandled = events & ~implemented
    if unhandled:
        raise ValueError(f"event mask 0x{events:x} subscribes to events the handler does not implement: "
                         f"{', '.join(_event_names(unhandled))} (containerd/nri pkg/stub: only events a plugin "
                         f"handles)")
    return events


def _event_names(mask: int) -> list[str]:
    """The ``nri_pb2.Event`` names of the bits of ``mask`` (bit ``event - 1``)."""
    return [E.Event.Name(i + 1) for i in range(mask.bit_length()) if mask >> i & 1]


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


class NriStub:
    """Runs one NRI plugin (``handler``) against a runtime, for its whole life.

    Args:
        handler: the plugin's behaviour (see the module docstring).
        socket_path: the runtime's NRI socket (external mode).
        plugin_name: NRI plugin name, ``[a-zA-Z0-9_.+-]+`` (NRI v0.12 rule).
        plugin_idx: two digits; plugins are invoked in ascending index order.
        env: environment to read ``NRI_PLUGIN_SOCKET`` / ``NRI_PLUGIN_NAME`` /
            ``NRI_PLUGIN_IDX`` from (default ``os.environ``); when the socket
            variable is set the stub runs in fd mode and those values win.
        events: subscription mask; default: the handler's ``events`` attribute,
            else the events of the interfaces it implements
            (``interfaces.handler_mask``). Must be non-zero, within 0x7FF and
            name only events the handler implements (ValueError otherwise).
        max_workers: handler threads.
        budget_fraction: share of the request timeout a handler may use.
        registration_timeout_s: how long to wait for the RegisterPlugin reply.
        reconnect_initial_s / reconnect_max_s: reconnection backoff (seconds,
            exponential with jitter).
        connect_timeout_s: timeout of one ``connect()``.
        max_sync_parts / max_sync_bytes: bounds on the parts of one split
            Synchronize held until its last part (``MAX_SYNC_PARTS``,
            ``MAX_SYNC_BYTES``); past either, that Synchronize is answered
            RESOURCE_EXHAUSTED and its parts are dropped.
        max_unanswered: most requests of one connection read but not answered
            on the wire yet (``MAX_UNANSWERED``); past it the connection is
            closed (a runtime that never reads its answers).
        on_bound: ``f(bound)`` called each time a bound is hit, ``bound`` one
            of ``sync_parts``, ``sync_bytes``, ``unanswered`` (the daemon counts
            them in ``fracplugin_nri_bounds_exceeded_total``); ``bounds_exceeded``
            keeps the same counts.

    Raises ValueError for a bad name, index, mask or fd.
    """

    def __init__(
        self,
        handler: object,
        socket_path: str = DEFAULT_SOCKET_PATH,
        plugin_name: str = "fracplugin",
        plugin_idx: str = "50",
        *,
        env: Mapping[str, str] | None = None,
        events: int | None = None,
        max_workers: int = 16,
        budget_fraction: float = 0.75,
        registration_timeout_s: float = DEFAULT_REGISTRATION_TIMEOUT_S,
        reconnect_initial_s: float = 0.1,
        reconnect_max_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        max_sync_parts: int = MAX_SYNC_PARTS,
        max_sync_bytes: int = MAX_SYNC_BYTES,
        max_unanswered: int = MAX_UNANSWERED,
        on_bound: Callable[[str], None] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        self.handler = handler
        self.socket_path = socket_path
        self.fd: int | None = None
        if env.get("NRI_PLUGIN_SOCKET"):
            try:
                self.fd = int(env["NRI_PLUGIN_SOCKET"])
            except ValueError:
                raise ValueError(f"NRI_PLUGIN_SOCKET={env['NRI_PLUGIN_SOCKET']!r} is not a file descriptor") from None
            plugin_name = env.get("NRI_PLUGIN_NAME") or plugin_name
            plugin_idx = env.get("NRI_PLUGIN_IDX") or plugin_idx
        if not _NAME_RE.match(plugin_name):
            raise ValueError(f"plugin name {plugin_name!r} must match [a-zA-Z0-9_.+-]+")
        if not _IDX_RE.match(plugin_idx):
            raise ValueError(f"plugin index {plugin_idx!r} must be exactly two digits")
        self.plugin_name = plugin_name
        self.plugin_idx = plugin_idx
        self.events = _subscription(handler, events)
        if not 0 < budget_fraction < 1:
            raise ValueError("budget_fraction must be in (0, 1)")
        self.budget_fraction = budget_fraction
        self.registration_timeout_s = registration_timeout_s
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.connect_timeout_s = connect_timeout_s
        self._max_workers = max_workers
        if min(max_sync_parts, max_sync_bytes, max_unanswered) < 1:
            raise ValueError("max_sync_parts, max_sync_bytes and max_unanswered must be >= 1")
        self.max_sync_parts = max_sync_parts
        self.max_sync_bytes = max_sync_bytes
        self.max_unanswered = max_unanswered
        self._on_bound = on_bound
        self.bounds_exceeded: dict[str, int] = {"sync_parts": 0, "sync_bytes": 0, "unanswered": 0}
        """How often each bound was hit, since start."""
        self._stop_ev = threading.Event()
        self._exited = threading.Event()
        self._synced = threading.Event()
        self._session: _Session | None = None
        self._session_lock = threading.Lock()
        self._sessions = itertools.count(1)
        self._pool: _Workers | None = None
        self._watchdog: _Watchdog | None = None
        self._thread: threading.Thread | None = None
        self.sessions_started = 0
        """Connections that reached RegisterPlugin, since start."""
        self.synchronize_count = 0
        """Completed Synchronize exchanges, since start."""

    # --------------------------------------------------------------- public

    @property
    def fd_mode(self) -> bool:
        """True when the runtime launched us and handed over fd ``NRI_PLUGIN_SOCKET``."""
        return self.fd is not None

    def start(self) -> "NriStub":
        """Start the run thread (returns at once). Raises RuntimeError when
        already started."""
        if self._thread is not None:
            raise RuntimeError("NriStub already started")
        self._pool = _Workers(self._max_workers, "nri-handler")
        self._watchdog = _Watchdog(self._expired)
        self._thread = threading.Thread(target=self._run, name="nri-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop: close the connection, end the threads. Returns True when the
        run thread ended within ``timeout_s`` seconds. Idempotent."""
        self._stop_ev.set()
        with self._session_lock:
            session = self._session
        if session is not None and session.transport is not None:
            session.transport.close("plugin stopping")
            session.transport.join(timeout_s)
        ended = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            ended = not self._thread.is_alive()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._pool is not None:
            self._pool.shutdown()
        closer = getattr(self.handler, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception:
                log.exception("nri handler close() failed")
        self._exited.set()
        return ended

    def ready(self) -> bool:
        """True when the current connection is registered and has completed a
        Synchronize (readiness is per runtime session: a reconnection that
        never synchronized is not ready, whatever an earlier one did)."""
        with self._session_lock:
            s = self._session
        return bool(s is not None and s.synchronized and s.transport is not None
                    and not s.transport.closed.is_set())

    def ever_synchronized(self) -> bool:
        """True once any connection completed a Synchronize since start."""
        return self._synced.is_set()

    def _bound_hit(self, bound: str) -> None:
        self.bounds_exceeded[bound] = self.bounds_exceeded.get(bound, 0) + 1
        if self._on_bound is not None:
            try:
                self._on_bound(bound)
            except Exception:
                log.exception("nri on_bound callback failed")

    def connected(self) -> bool:
        """True while a connection is open and RegisterPlugin succeeded."""
        with self._session_lock:
            s = self._session
        return bool(s and s.transport and not s.transport.closed.is_set() and s.registered.is_set())

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until a Synchronize completed (``ever_synchronized()``) or
        ``timeout_s``; returns ``ever_synchronized()``."""
        return self._synced.wait(timeout_s)

    def wait_exit(self, timeout_s: float | None = None) -> bool:
        """Block until the stub has ended (``stop()``, or EOF in fd mode)."""
        return self._exited.wait(timeout_s)

    @property
    def exited(self) -> bool:
        """True once the stub has ended."""
        return self._exited.is_set()

    def update_containers(
        self, updates: Sequence[Any] = (), evictions: Sequence[Any] = (), timeout_s: float = 2.0
    ) -> list[Any]:
        """Unsolicited ``Runtime/UpdateContainers`` (nri-protocol.md 1.6 step 7):
        ``updates`` are ``ContainerUpdate``s, ``evictions`` ``ContainerEviction``s.
        Returns the updates the runtime reports as failed. Raises
        ``ConnectionClosed`` when not connected, ``RpcError``, ``TimeoutError``."""
        with self._session_lock:
            s = self._session
        if s is None or s.transport is None or not s.registered.is_set():
            raise ConnectionClosed("not registered with a runtime")
        req = nri_pb2.UpdateContainersRequest(update=list(updates), evict=list(evictions))
        payload = s.transport.call(RUNTIME_SERVICE, "UpdateContainers", req.SerializeToString(), timeout_s)
        return list(nri_pb2.UpdateContainersResponse.FromString(payload).failed)

    def status(self) -> dict[str, Any]:
        """JSON-able state for ``fracplugin status`` / ``/status``:
        ``{"connected", "ready", "exited", "mode", "socket", "plugin_name",
        "plugin_idx", "events", "sessions", "synchronize_count",
        "request_timeout_s", "runtime"}`` (``runtime`` is "<name> <version>"
        of the current connection, "" when none)."""
        with self._session_lock:
            s = self._session
        d = s.dispatcher if s is not None else None
        return {
            "connected": self.connected(),
            "ready": self.ready(),
            "exited": self.exited,
            "mode": "fd" if self.fd_mode else "socket",
            "socket": self.socket_path if self.fd is None else f"fd {self.fd}",
            "plugin_name": self.plugin_name,
            "plugin_idx": self.plugin_idx,
            "events": f"0x{self.events:x}",
            "sessions": self.sessions_started,
            "synchronize_count": self.synchronize_count,
            "bounds_exceeded": dict(self.bounds_exceeded),
            "request_timeout_s": d.request_timeout_s if d is not None else None,
            "runtime": f"{d.runtime_name} {d.runtime_version}".strip() if d is not None else "",
        }

    # ------------------------------------------------------------- run loop

    def _run(self) -> None:
        penalty = self.reconnect_initial_s
        try:
            while not self._stop_ev.is_set():
                session = self._open_session()
                if session is None:
                    break
                assert session.transport is not None
                # Wait until the runtime goes away (EOF, protocol error) or stop().
                while not session.transport.closed.wait(0.5):
                    if self._stop_ev.is_set():
                        break
                session.transport.close("session ended")
                session.transport.join(2.0)
                log.info(
                    "nri connection closed",
                    extra={
                        "session": session.number,
                        "reason": session.transport.close_reason,
                        "synchronized": session.synchronized,
                    },
                )
                with self._session_lock:
                    if self._session is session:
                        self._session = None
                if self.fd_mode:
                    log.info("nri runtime closed the launched plugin's socket; stopping", extra={"fd": self.fd})
                    break
                if self._stop_ev.is_set():
                    break
                # A session that never synchronized (rejected registration,
                # immediate close) must not turn into a busy loop.
                if session.synchronized:
                    penalty = self.reconnect_initial_s
                else:
                    self._stop_ev.wait(penalty)
                    penalty = min(penalty * 2, self.reconnect_max_s)
        except Exception:
            log.exception("nri stub run loop failed")
        finally:
            self._stop_ev.set()
            if self._watchdog is not None:
                self._watchdog.stop()
            self._exited.set()

    def _open_session(self) -> _Session | None:
        """Connect and register, retrying with backoff; None when stopping."""
        if self.fd_mode:
            try:
                sock = socket.socket(fileno=self.fd)
            except OSError as exc:
                log.error("nri: cannot use the runtime's socket fd", extra={"fd": self.fd, "reason": str(exc)})
                return None
            try:
                return self._register(sock)
            except (ConnectionError, TimeoutError, RpcError) as exc:
                log.error("nri registration failed on the launched socket", extra={"reason": str(exc)})
                return None
        retrying = Retrying(
            retry=retry_if_exception_type((OSError, TimeoutError, RpcError)),
            wait=wait_exponential(multiplier=self.reconnect_initial_s, max=self.reconnect_max_s)
            + wait_random(0, self.reconnect_initial_s),
            stop=stop_when_event_set(self._stop_ev),
            sleep=self._pause,
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            return retrying(self._connect_and_register)
        except (OSError, TimeoutError, RpcError):
            return None  # stopped while retrying

    def _pause(self, seconds: float) -> None:
        """tenacity's sleep: the backoff pause, cut short by ``stop()``."""
        self._stop_ev.wait(seconds)

    def _log_retry(self, state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.info(
            "nri runtime not reachable, retrying",
            extra={"socket": self.socket_path, "attempt": state.attempt_number, "reason": str(exc)},
        )

    def _connect_and_register(self) -> _Session:
        if self._stop_ev.is_set():
            raise ConnectionAbortedError("stopping")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout_s)
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        return self._register(sock)

    def _register(self, sock: socket.socket) -> _Session:
        session = _Session(next(self._sessions), Dispatcher(
            self.handler, self.events, self.plugin_name, max_sync_parts=self.max_sync_parts,
            max_sync_bytes=self.max_sync_bytes, on_bound=self._bound_hit))
        transport = NriTransport(
            sock,
            serve_conn=PLUGIN_SERVICE_CONN,
            call_conn=RUNTIME_SERVICE_CONN,
            on_request=lambda ev: self._dispatch(session, ev),
            label=f"nri-{session.number}",
        )
        session.transport = transport
        with self._session_lock:
            self._session = session
        transport.start()
        req = nri_pb2.RegisterPluginRequest(plugin_name=self.plugin_name, plugin_idx=self.plugin_idx)
        try:
            transport.call(RUNTIME_SERVICE, "RegisterPlugin", req.SerializeToString(), self.registration_timeout_s)
        except BaseException:
            transport.close("registration failed")
            with self._session_lock:
                if self._session is session:
                    self._session = None
            raise
        session.registered.set()
        self.sessions_started += 1
        log.info(
            "nri plugin registered",
            extra={
                "plugin_name": self.plugin_name,
                "plugin_idx": self.plugin_idx,
                "session": session.number,
                "socket": self.socket_path if self.fd is None else f"fd {self.fd}",
            },
        )
        return session

    # ------------------------------------------------------------- dispatch

    def _dispatch(self, session: _Session, ev: RequestReceived) -> None:
        """Reader thread: route one request. Served here when nothing in it
        can wait (``Dispatcher.inline``), else handed to the pool; never
        blocks on the socket either way."""
        transport = session.transport
        assert transport is not None
        dispatcher = session.dispatcher
        err = dispatcher.check(ev)
        if err is not None:
            log.warning("nri call for an unknown service or method", extra={"service": ev.service, "method": ev.method})
            transport.respond_error(ev.stream_id, err.code, err.message)
            return
        if not self._count_unanswered(session, transport):
            return
        call = _Call(session, ev, dispatcher.context(ev, self.budget_fraction))
        assert self._watchdog is not None and self._pool is not None
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
        ``max_unanswered`` close the connection (False: do not serve it)."""
        with session.lock:
            if session.closing:  # already over the bound and being closed: read, not served
                return False
            session.unanswered += 1
            over = session.unanswered > self.max_unanswered
            session.closing = over
        if over:
            log.error("nri runtime does not read the plugin's answers: %d requests unanswered (bound %d); "
                      "closing the connection", session.unanswered, self.max_unanswered,
                      extra={"session": session.number, "bound": "unanswered"})
            self._bound_hit("unanswered")
            transport.close(f"{session.unanswered} requests unanswered: the runtime does not read the answers "
                            f"(bound {self.max_unanswered})")
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
                    if not self._hand_over(functools.partial(self._send, call, payload, error)):
                        self._send(call, payload, error)  # stopping: no pool left, wait here
                elif outcome == SPILLED:
                    counted = False
            elif code is not None:
                transport.respond_error(call.stream_id, code, message)
            else:
                transport.respond(call.stream_id, payload or b"")
        except (ConnectionClosed, ValueError) as exc:
            log.info(
                "nri answer not sent: connection gone",
                extra={"method": call.method, "stream_id": call.stream_id, "reason": str(exc)},
            )
        finally:
            if counted:
                self._answered(call.session)

    def _hand_over(self, job: Callable[[], None]) -> bool:
        """Run ``job`` on a handler thread; False when the pool is shut down."""
        try:
            assert self._pool is not None
            self._pool.submit(job)
        except RuntimeError:
            return False
        return True

    def _finish_answer(self, session: _Session, write_rest: Callable[[], None]) -> None:
        """``NriTransport.answer_nowait``'s ``finish``: the rest of an answer
        is written (and counted) on a handler thread. Raises RuntimeError when
        the pool is shut down (the transport then closes the connection)."""
        def job() -> None:
            try:
                write_rest()
            finally:
                self._answered(session)
        if not self._hand_over(job):
            raise RuntimeError("handler pool is shut down")

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
            response = call.session.dispatcher.handle(method, call.request, call.ctx)
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
                self.synchronize_count += 1
                self._synced.set()
            self._send(call, payload, error, inline)
            return
        log.warning("nri handler result arrived after its budget and was dropped", extra={"method": method})
        abandoned = getattr(self.handler, "abandoned", None)
        if callable(abandoned):
            try:
                abandoned(method, call.request, response if error is None else error)
            except Exception:
                log.exception("nri abandoned() hook failed", extra={"method": method})
