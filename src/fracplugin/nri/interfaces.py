"""What an NRI plugin handler may implement: one typed ``Protocol`` per NRI
request or event, and the table that ties each to its ttrpc method.

Shape (containerd/nri ``pkg/stub/stub.go``, v0.12): a plugin implements any
subset of the ``*Interface`` Protocols below (``EVENTS`` lists them with their
ttrpc methods); the stub (``stub.NriStub``) builds
its dispatch table from the ones implemented and subscribes to the events of
exactly those (``handler_mask``), unless a mask is configured explicitly.
Python spells the Go methods in snake case (``CreateContainer`` ->
``create_container``) and passes a ``CallContext`` last instead of Go's
``context.Context`` first. A method that is absent answers the runtime with an
empty response of the right type.

Three optional hooks are the stub's own, not NRI's (``AbandonedInterface``,
``MayBlockInterface``, ``CloseInterface``).

Concurrency model: none (types and constant tables only).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, Union

from .._proto import nri_pb2 as E

@dataclass
class CallContext:
    """What a handler knows about the call it serves.

    ``request_timeout_s`` is the runtime's request timeout (ConfigureRequest,
    2 s by default); ``budget_s`` the time the stub allows this handler;
    ``deadline`` the ``time.monotonic()`` instant the budget ends.
    ``runtime_name`` / ``runtime_version`` come from ConfigureRequest.
    """

    method: str
    stream_id: int
    request_timeout_s: float
    budget_s: float
    deadline: float
    runtime_name: str = ""
    runtime_version: str = ""

    def remaining(self) -> float:
        """Seconds left of the budget (may be negative)."""
        return self.deadline - time.monotonic()


# ------------------------------------------------------------ runtime requests


class ConfigureInterface(Protocol):
    """``Configure``: the runtime's name, version and timeouts (docs/reference/nri-protocol.md
    1.6 step 3). The stub answers with the subscription mask itself."""

    def configure(self, request: E.ConfigureRequest, ctx: CallContext) -> None: ...


SynchronizeResult = Union[Sequence[E.ContainerUpdate], E.SynchronizeResponse, None]


class SynchronizeInterface(Protocol):
    """``Synchronize``: every pod and container the runtime knows, once per
    connection, all parts of a split request at once. Returns container
    updates (or a whole ``SynchronizeResponse``)."""

    def synchronize(self, pods: Sequence[E.PodSandbox], containers: Sequence[E.Container],
                    ctx: CallContext) -> SynchronizeResult: ...


class ShutdownInterface(Protocol):
    """``Shutdown``: the runtime is going away (answered with Empty)."""

    def shutdown(self, ctx: CallContext) -> None: ...


# ------------------------------------------------------------------ pod events


class RunPodInterface(Protocol):
    """``RunPodSandbox`` event."""

    def run_pod_sandbox(self, pod: E.PodSandbox, ctx: CallContext) -> None: ...


class UpdatePodInterface(Protocol):
    """``UpdatePodSandbox`` request (NRI v0.9+)."""

    def update_pod_sandbox(self, request: E.UpdatePodSandboxRequest,
                           ctx: CallContext) -> E.UpdatePodSandboxResponse | None: ...


class StopPodInterface(Protocol):
    """``StopPodSandbox`` event."""

    def stop_pod_sandbox(self, pod: E.PodSandbox, ctx: CallContext) -> None: ...


class RemovePodInterface(Protocol):
    """``RemovePodSandbox`` event."""

    def remove_pod_sandbox(self, pod: E.PodSandbox, ctx: CallContext) -> None: ...


class PostUpdatePodInterface(Protocol):
    """``PostUpdatePodSandbox`` event."""

    def post_update_pod_sandbox(self, pod: E.PodSandbox, ctx: CallContext) -> None: ...


# ------------------------------------------------------------ container events


class CreateContainerInterface(Protocol):
    """``CreateContainer`` request: a response, or just its adjustment."""

    def create_container(self, pod: E.PodSandbox, container: E.Container,
                         ctx: CallContext) -> E.CreateContainerResponse | E.ContainerAdjustment | None: ...


class StartContainerInterface(Protocol):
    """``StartContainer`` event (a raised ``RpcError`` fails the start)."""

    def start_container(self, pod: E.PodSandbox, container: E.Container, ctx: CallContext) -> None: ...


class UpdateContainerInterface(Protocol):
    """``UpdateContainer`` request."""

    def update_container(self, pod: E.PodSandbox, container: E.Container, linux_resources: E.LinuxResources,
                         ctx: CallContext) -> E.UpdateContainerResponse | None: ...


class StopContainerInterface(Protocol):
    """``StopContainer`` request: a response, or the container updates it carries."""

    def stop_container(self, pod: E.PodSandbox, container: E.Container,
                       ctx: CallContext) -> E.StopContainerResponse | Sequence[E.ContainerUpdate] | None: ...


class RemoveContainerInterface(Protocol):
    """``RemoveContainer`` event."""

    def remove_container(self, pod: E.PodSandbox, container: E.Container, ctx: CallContext) -> None: ...


class PostCreateContainerInterface(Protocol):
    """``PostCreateContainer`` event."""

    def post_create_container(self, pod: E.PodSandbox, container: E.Container, ctx: CallContext) -> None: ...


class PostStartContainerInterface(Protocol):
    """``PostStartContainer`` event."""

    def post_start_container(self, pod: E.PodSandbox, container: E.Container, ctx: CallContext) -> None: ...


class PostUpdateContainerInterface(Protocol):
    """``PostUpdateContainer`` event."""

    def post_update_container(self, pod: E.PodSandbox, container: E.Container, ctx: CallContext) -> None: ...


class ValidateContainerAdjustmentInterface(Protocol):
    """``ValidateContainerAdjustment`` request (NRI v0.10+)."""

    def validate_container_adjustment(self, request: E.ValidateContainerAdjustmentRequest,
                                      ctx: CallContext) -> E.ValidateContainerAdjustmentResponse | None: ...


# ---------------------------------------------------------- the stub's own hooks


class AbandonedInterface(Protocol):
    """The stub answered a call itself (budget overrun) and dropped the
    handler's late ``response`` (a message or the ``RpcError``): undo what the
    call did."""

    def abandoned(self, method: str, request: Any, response: Any) -> None: ...


class MayBlockInterface(Protocol):
    """Whether serving ``method`` (a ttrpc method name, ``"StateChange"`` for
    every v0.8 event) may now wait on something outside the process (an MPS
    control daemon, the runtime). False lets the stub serve it on its reader
    thread; True (and every method of a handler without this hook) runs it
    on a handler thread. Called on the reader thread for each request: it
    must answer at once."""

    def may_block(self, method: str) -> bool: ...


class CloseInterface(Protocol):
    """Called once by ``NriStub.stop()``."""

    def close(self) -> None: ...


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class EventSpec:
    """One ttrpc method of the Plugin service.

    ``attr``: the handler method (None: served by the stub alone);
    ``interface``: the Protocol it belongs to; ``request`` / ``response``:
    protobuf classes; ``event``: the ``nri_pb2.Event`` it subscribes to
    (None: always delivered); ``shape``: how the request is handed over:
    ``pod`` (pod, ctx), ``container`` (pod, container, ctx), ``request``
    (request, ctx), or the method's own (``configure``, ``synchronize``,
    ``shutdown``, ``create``, ``update``, ``stop``, ``state_change``)."""

    method: str
    attr: str | None
    interface: type | None
    request: Any
    response: Any
    event: int | None
    shape: str


EVENTS: tuple[EventSpec, ...] = (
    EventSpec("Configure", "configure", ConfigureInterface, E.ConfigureRequest, E.ConfigureResponse, None,
              "configure"),
    EventSpec("Synchronize", "synchronize", SynchronizeInterface, E.SynchronizeRequest, E.SynchronizeResponse,
              None, "synchronize"),
    EventSpec("Shutdown", "shutdown", ShutdownInterface, E.Empty, E.Empty, None, "shutdown"),
    EventSpec("StateChange", None, None, E.StateChangeEvent, E.Empty, None, "state_change"),
    EventSpec("RunPodSandbox", "run_pod_sandbox", RunPodInterface, E.RunPodSandboxRequest,
              E.RunPodSandboxResponse, E.RUN_POD_SANDBOX, "pod"),
    EventSpec("UpdatePodSandbox", "update_pod_sandbox", UpdatePodInterface, E.UpdatePodSandboxRequest,
              E.UpdatePodSandboxResponse, E.UPDATE_POD_SANDBOX, "request"),
    EventSpec("PostUpdatePodSandbox", "post_update_pod_sandbox", PostUpdatePodInterface,
              E.PostUpdatePodSandboxRequest, E.PostUpdatePodSandboxResponse, E.POST_UPDATE_POD_SANDBOX, "pod"),
    EventSpec("StopPodSandbox", "stop_pod_sandbox", StopPodInterface, E.StopPodSandboxRequest,
              E.StopPodSandboxResponse, E.STOP_POD_SANDBOX, "pod"),
    EventSpec("RemovePodSandbox", "remove_pod_sandbox", RemovePodInterface, E.RemovePodSandboxRequest,
              E.RemovePodSandboxResponse, E.REMOVE_POD_SANDBOX, "pod"),
    EventSpec("CreateContainer", "create_container", CreateContainerInterface, E.CreateContainerRequest,
              E.CreateContainerResponse, E.CREATE_CONTAINER, "create"),
    EventSpec("PostCreateContainer", "post_create_container", PostCreateContainerInterface,
              E.PostCreateContainerRequest, E.PostCreateContainerResponse, E.POST_CREATE_CONTAINER, "container"),
    EventSpec("StartContainer", "start_container", StartContainerInterface, E.StartContainerRequest,
              E.StartContainerResponse, E.START_CONTAINER, "container"),
    EventSpec("PostStartContainer", "post_start_container", PostStartContainerInterface,
              E.PostStartContainerRequest, E.PostStartContainerResponse, E.POST_START_CONTAINER, "container"),
    EventSpec("UpdateContainer", "update_container", UpdateContainerInterface, E.UpdateContainerRequest,
              E.UpdateContainerResponse, E.UPDATE_CONTAINER, "update"),
    EventSpec("PostUpdateContainer", "post_update_container", PostUpdateContainerInterface,
              E.PostUpdateContainerRequest, E.PostUpdateContainerResponse, E.POST_UPDATE_CONTAINER, "container"),
    EventSpec("StopContainer", "stop_container", StopContainerInterface, E.StopContainerRequest,
              E.StopContainerResponse, E.STOP_CONTAINER, "stop"),
    EventSpec("RemoveContainer", "remove_container", RemoveContainerInterface, E.RemoveContainerRequest,
              E.RemoveContainerResponse, E.REMOVE_CONTAINER, "container"),
    EventSpec("ValidateContainerAdjustment", "validate_container_adjustment", ValidateContainerAdjustmentInterface,
              E.ValidateContainerAdjustmentRequest, E.ValidateContainerAdjustmentResponse,
              E.VALIDATE_CONTAINER_ADJUSTMENT, "request"),
)
"""Every method of the Plugin service (docs/reference/nri-protocol.md 1.4, 1.7)."""


def event_mask(*events: int) -> int:
    """Subscription mask of NRI ``Event`` values: bit ``1 << (event - 1)``
    (containerd/nri ``pkg/api/event.go``). Raises ValueError for an event
    value <= 0 (``UNKNOWN`` cannot be subscribed to)."""
    mask = 0
    for ev in events:
        if ev <= 0:
            raise ValueError(f"not a subscribable event: {ev}")
        mask |= 1 << (ev - 1)
    return mask


def implements(handler: object, spec: EventSpec) -> bool:
    """True when ``handler`` has the method of ``spec`` (a callable attribute
    of that name: Python's structural typing, as Go's interface check)."""
    return spec.attr is not None and callable(getattr(handler, spec.attr, None))


def handler_mask(handler: object) -> int:
    """The events of the interfaces ``handler`` implements (containerd/nri
    ``stub.setupHandlers``); 0 when it implements none."""
    events = [s.event for s in EVENTS if s.event is not None and implements(handler, s)]
    return event_mask(*events) if events else 0


def check_handler(handler: object) -> None:
    """Raise ValueError when a method of ``handler`` that names an NRI
    interface's method cannot take that interface's arguments (the stub calls
    it positionally: ``create_container(pod, container, ctx)``), so that a
    handler written against another shape fails when the stub is built, naming
    the method, its signature and the interface, instead of answering every
    call of that event INTERNAL (Go's stub gets this check from the compiler).
    A callable whose signature Python cannot read is accepted."""
    for spec in EVENTS:
        if not implements(handler, spec):
            continue
        assert spec.attr is not None and spec.interface is not None
        fn = getattr(handler, spec.attr)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        # what the stub passes: the interface method's parameters, without ``self``
        args = [n for n in inspect.signature(getattr(spec.interface, spec.attr)).parameters if n != "self"]
        try:
            sig.bind(*args)
        except TypeError as exc:
            raise ValueError(
                f"handler {type(handler).__name__}.{spec.attr}{sig} cannot serve {spec.method}: "
                f"{spec.interface.__name__} is called as {spec.attr}({', '.join(args)}) ({exc})") from None
