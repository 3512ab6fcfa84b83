"""The NRI stub's dispatch table without I/O (``Dispatcher``), the subscription
mask a handler gets (``_subscription``) and the protocol constants (service
names, event mask, bounds). The whole stub and the protocol rules it follows:
``nri/stub.py``'s module docstring.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, NamedTuple

from .._proto import nri_pb2
from ..safetext import quote
from .interfaces import EVENTS, CallContext, EventSpec, check_handler, handler_mask, implements
from .ttrpc import Code, RequestReceived, RpcError

log = logging.getLogger("fracplugin.nri.stub")  # the stub's log

DEFAULT_SOCKET_PATH = "/var/run/nri/nri.sock"
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
VALID_EVENTS_MASK = 0x7FF
"""Events every runtime since NRI v0.3 accepts (``ValidEvents`` up to v0.9)."""
DEFAULT_REQUEST_TIMEOUT_S = 2.0
BUDGET_FRACTION = 0.75
"""Share of the request timeout a handler may use before the stub answers for it."""
DEFAULT_REGISTRATION_TIMEOUT_S = 5.0

# Bounds on what a runtime can make the plugin hold (issue 13 item 5). A runtime splits Synchronize only
# to stay under ttrpc's 4 MiB limit (nri-protocol.md 1.6): 110 pods of a few containers are under 1 MiB.
MAX_SYNC_PARTS = 64
"""Most ``more=true`` Synchronize parts held before the last one."""
MAX_SYNC_BYTES = 16 << 20
"""Most encoded bytes (16 MiB) of Synchronize parts held before the last one."""
MAX_WORKERS = 16
"""Handler threads of the stub (``serving._Workers``)."""
MAX_UNANSWERED = 1024
"""Most requests of one connection read but not yet answered on the wire. A
runtime that sends requests and never reads the answers makes them pile up
(a blocked write holds every later answer); past this bound the connection
is closed (the stub reconnects)."""

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
"""Events a v0.8 runtime delivers as ``StateChange`` (docs/reference/nri-protocol.md 1.7)."""


class Dispatcher:
    """Per-connection request handling without I/O (one per connection):
    ``check``, ``decode``, then the route of ``routes`` (method -> ``_Route``,
    built once from the methods ``handler`` implements, ``interfaces.EVENTS``,
    with the stub's own Configure, Synchronize, Shutdown, StateChange and
    CreateContainer's empty-id check). State (docs/reference/nri-protocol.md
    1.5, 1.6): the request timeout from ConfigureRequest (seconds; 2 s until
    then), the runtime's name and version, the parts of a split Synchronize.
    Thread-safe.
    """

    def __init__(self, handler: object, events: int, plugin_name: str = "plugin", *,
                 on_bound: Callable[[str], None] | None = None) -> None:
        self.handler = handler
        self._on_bound = on_bound
        self._sync_parts = 0
        self._sync_bytes = 0
        self.events = events
        self.plugin_name = plugin_name
        self.request_timeout_s = DEFAULT_REQUEST_TIMEOUT_S
        self.runtime_name = ""
        self.runtime_version = ""
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
        """The UNIMPLEMENTED error for an unknown service or method (the Go
        server's words, docs/reference/nri-protocol.md 1.3), else None."""
        if ev.service != PLUGIN_SERVICE:
            return RpcError(Code.UNIMPLEMENTED, f"service {ev.service}")
        if ev.method not in self.routes:
            return RpcError(Code.UNIMPLEMENTED, f"method {ev.method}")
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
        """The request message of ``ev``, a request ``check`` passed; raises
        RpcError INVALID_ARGUMENT. Its route's ``serve(request, ctx)`` returns
        the response message and raises RpcError (the handler's or the
        stub's), or TypeError for a handler result of the wrong type (a bug,
        answered INTERNAL by the caller)."""
        try:
            return self.routes[ev.method].request.FromString(ev.payload)
        except Exception as exc:
            raise RpcError(Code.INVALID_ARGUMENT, f"cannot decode {ev.method} request: {exc}") from None

    # ------------------------------------------------------ the stub's own routes

    def _configure(self, req: Any, ctx: CallContext) -> Any:
        with self._lock:
            if req.request_timeout > 0:
                self.request_timeout_s = req.request_timeout / 1000.0
            self.runtime_name, self.runtime_version = req.runtime_name, req.runtime_version
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
        ``MAX_SYNC_PARTS`` / ``MAX_SYNC_BYTES``, the parts dropped), hand
        everything to the handler with the last part."""
        with self._lock:
            parts, size = self._sync_parts + 1, self._sync_bytes + req.ByteSize()
            if parts > MAX_SYNC_PARTS or size > MAX_SYNC_BYTES:
                self._sync_pods, self._sync_containers = [], []
                self._sync_parts = self._sync_bytes = 0
                bound = "sync_parts" if parts > MAX_SYNC_PARTS else "sync_bytes"
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
                   f"bound of {MAX_SYNC_PARTS} parts / {MAX_SYNC_BYTES} bytes; parts dropped")
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
        if serve is not None:
            serve(req, ctx)
        elif not any(s.event == req.event and s.shape in _STATE_CHANGE_SHAPES for s in EVENTS):
            log.info("nri StateChange for an event without a state-change handler", extra={"event": req.event})
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


