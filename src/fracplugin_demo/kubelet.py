"""The demo's simulated kubelet (the kubelet side of the device plugin API):
what ``fracplugin demo`` uses to act as kubelet towards the daemon. Not used by
``fracplugin run``; the component tests use their own kubelet
(``tests/peers/kubelet.py``).

``Kubelet`` serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` and, on
``Register``, does what kubelet does before answering
(docs/reference/kubelet-device-plugin.md A.5): checks the version and the resource name,
dials ``<dir>/<endpoint>`` with ``:authority`` ``localhost`` (A.8), calls
``GetDevicePluginOptions`` and starts consuming ``ListAndWatch``; a
re-registration of a resource replaces its endpoint. ``KubeletSim`` adds the
one-resource client the demo drives: ``pick(n)`` healthy device IDs (asking
``GetPreferredAllocation`` when the plugin offers it) and ``allocate`` with
one container request, as kubelet does per container.

What a real kubelet does and this one copies (issue 11, seen with kubelet
v1.35.4 and v1.37.2 built from k8s.io/kubernetes; ``docs/e2e.md``):

* D2: ``semantics="1.37"`` (default) keys endpoints by socket path: a Register
  on a path whose connection is still open is refused ("device plugin already
  connected: <path>") and that path is refused for good until a restart
  (kubelet 1.37 drops its client of the live connection on the failed
  attempt, so the disconnect that would free the path never comes);
  ``semantics="1.35"`` replaces the resource's endpoint (1.35, 1.36);
* D3: Register errors are gRPC UNKNOWN (kubelet returns plain Go errors);
* D4: ``stop(leave_socket=True)`` leaves a dead kubelet.sock behind, as a
  kubelet stopped by SIGTERM does;
* D5: ListAndWatch starts after Register has returned;
* D6: ``pick`` passes ``must_include`` device IDs to GetPreferredAllocation
  (kubelet hands an init container's devices to the next app container);
* D7: when a plugin's stream ends and no other endpoint serves the resource,
  every device of the resource turns Unhealthy (allocatable 0).

A driver for the demo and benchmarks, not kubelet: no checkpoint, no pod admission.

Transport: grpcio (as the daemon's door, ADR 0021; client options from
``kubelet.grpcopts``). The component tests' kubelet
(``tests/peers/kubelet.py``) is written apart from this one, so a bug here
cannot hide the same bug there; a real kubelet (grpc-go, ``make
kubelet-e2e``) is the independent gRPC implementation.

Concurrency model: grpcio's thread pool serves Registration; one thread
consumes each ListAndWatch stream; shared state sits under one condition
variable. Client calls (``pick``, ``allocate``) run on the caller's thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

import grpc

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import deviceplugin_pb2_grpc as pb_grpc
from fracplugin.kubelet import grpcopts

log = logging.getLogger(__name__)

VERSION = "v1beta1"
HEALTHY = "Healthy"


def serve_unix(socket_path: str, add: Callable[[grpc.Server], None], workers: int = 4) -> grpc.Server:
    """Start a grpcio server on unix socket ``socket_path`` with the services
    ``add(server)`` registers; the parent directory is created and a stale
    file removed. Raises OSError when the socket cannot be bound."""
    os.makedirs(os.path.dirname(socket_path) or ".", exist_ok=True)
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kubelet-sim"),
                         options=grpcopts.server_options())
    add(server)
    try:
        bound = server.add_insecure_port("unix:" + socket_path)
    except RuntimeError:
        bound = 0
    if bound == 0:
        server.stop(grace=0)
        raise OSError(f"cannot listen on {socket_path}")
    server.start()
    return server


def stop_unix(server: grpc.Server | None, socket_path: str) -> None:
    """Stop ``server`` at once (its calls cancelled, waiting up to 2 s) and remove ``socket_path``."""
    if server is not None:
        server.stop(grace=0).wait(2.0)
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass


@dataclass
class Registration:
    """One Register call kubelet accepted (``at``: time.monotonic())."""

    resource_name: str
    endpoint: str
    options: pb.DevicePluginOptions
    at: float


@dataclass(eq=False)
class Endpoint:
    """A registered plugin of one resource: its channel and stub, its
    ListAndWatch call, the last device list (ID -> health), every list
    received in order, how many, and whether the stream is still open."""

    resource_name: str
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    stream: Any = None
    devices: dict[str, str] = field(default_factory=dict)
    history: list[dict[str, str]] = field(default_factory=list)
    updates: int = 0
    open: bool = True
    path: str = ""

    def drop(self) -> None:
        """End the stream and close the channel (kubelet dropping the plugin); from any thread."""
        self.open = False
        if self.stream is not None:
            self.stream.cancel()
        self.channel.close()


class _RegistrationService(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: "Kubelet") -> None:
        self.kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:  # noqa: N802
        return self.kubelet._register(request, context)


class Kubelet:
    """Registration server + device plugin client, per resource.

    Args:
        plugin_dir: the device plugin directory; ``kubelet.sock`` is created there.
        dial_timeout_s: how long Register waits to reach the plugin (kubelet: 10 s).
        semantics: ``"1.37"`` (endpoints per socket path, a second Register on a
            connected path refused) or ``"1.35"`` (a Register replaces the
            resource's endpoint); see the module docstring.
    """

    def __init__(self, plugin_dir: str, dial_timeout_s: float = 10.0, semantics: str = "1.37") -> None:
        if semantics not in ("1.37", "1.35"):
            raise ValueError(f"semantics {semantics!r} must be '1.37' or '1.35'")
        self.plugin_dir = plugin_dir
        self.socket_path = os.path.join(plugin_dir, "kubelet.sock")
        self.dial_timeout_s = dial_timeout_s
        self.semantics = semantics
        self.registrations: list[Registration] = []
        """Every accepted Register, in order."""
        self.refusals: list[str] = []
        """The message of every refused Register, in order."""
        self._cond = threading.Condition()
        self._endpoints: dict[str, Endpoint] = {}
        self._by_path: dict[str, Endpoint] = {}
        self._poisoned: set[str] = set()
        self._server: grpc.Server | None = None

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> "Kubelet":
        """Serve Registration on ``kubelet.sock`` (a stale file is removed). Raises OSError."""
        service = _RegistrationService(self)
        self._server = serve_unix(self.socket_path, lambda s: pb_grpc.add_RegistrationServicer_to_server(service, s))
        return self

    def stop(self, leave_socket: bool = False) -> None:
        """Stop serving, drop every plugin connection, remove kubelet.sock
        (``leave_socket``: leave a dead kubelet.sock file, as SIGTERM does, D4).
        A later ``start`` forgets every endpoint (a new kubelet process)."""
        with self._cond:
            eps = list(self._endpoints.values()) + list(self._by_path.values())
            self._endpoints.clear()
            self._by_path.clear()
            self._poisoned.clear()
            self._cond.notify_all()
        for ep in eps:
            ep.drop()
        server, self._server = self._server, None
        stop_unix(server, self.socket_path)
        if leave_socket:
            import socket as _socket

            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                s.bind(self.socket_path)  # the file stays; nobody listens
            finally:
                s.close()

    # ---- Registration service ------------------------------------------------------
    def _refuse(self, context: grpc.ServicerContext, message: str) -> NoReturn:
        """Record and answer a refusal (raises: ``context.abort``)."""
        with self._cond:
            self.refusals.append(message)
            self._cond.notify_all()
        context.abort(grpc.StatusCode.UNKNOWN, message)  # D3: kubelet answers plain errors
        raise AssertionError("unreachable: context.abort raises")

    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        """Register: check, dial, get options, answer; ListAndWatch starts once
        the answer is on its way (D5). Answers UNKNOWN (bad version or
        resource name, plugin unreachable within ``dial_timeout_s``, path
        already connected under 1.37 semantics)."""
        if request.version != VERSION:
            self._refuse(context, f"requested API version {request.version!r} is not supported by kubelet. "
                                  f"Supported versions are ['{VERSION}']")
        if "/" not in request.resource_name or request.resource_name.startswith("kubernetes.io/"):
            self._refuse(context, f"the ResourceName {request.resource_name!r} is invalid")
        target = os.path.join(self.plugin_dir, request.endpoint)
        channel = grpcopts.unix_channel(target)
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            channel.close()
            self._refuse(context, f"failed to dial device plugin: cannot reach the plugin at {target}: {exc}")
        ep = Endpoint(request.resource_name, channel, stub, path=target)
        old: Endpoint | None = None
        with self._cond:
            refused = self.semantics == "1.37" and (target in self._by_path or target in self._poisoned)
            if refused:
                self._poisoned.add(target)
            else:
                old = self._endpoints.get(request.resource_name) if self.semantics == "1.35" else None
                self._endpoints[request.resource_name] = ep
                self._by_path[target] = ep
                self.registrations.append(Registration(request.resource_name, request.endpoint, options,
                                                       time.monotonic()))
                self._cond.notify_all()
        if refused:
            channel.close()
            self._refuse(context, f"device plugin already connected: {target}")
        # D5: ListAndWatch only once the answer is complete (the RPC ended).
        context.add_callback(lambda: threading.Thread(target=self._consume, args=(ep,), name="kubelet-sim-lw",
                                                      daemon=True).start())
        if old is not None and old is not ep:  # 1.35: re-registration replaces the endpoint
            old.drop()
        return pb.Empty()

    def _consume(self, ep: Endpoint) -> None:
        try:
            if not ep.open:
                return
            ep.stream = ep.stub.ListAndWatch(pb.Empty())
            for resp in ep.stream:
                with self._cond:
                    ep.devices = {d.ID: d.health for d in resp.devices}
                    ep.history.append(ep.devices)
                    ep.updates += 1
                    self._cond.notify_all()
        except (grpc.RpcError, ValueError):  # the stream ended: refused, cancelled, channel closed
            pass
        finally:
            with self._cond:
                ep.open = False
                if self._by_path.get(ep.path) is ep and ep.path not in self._poisoned:
                    del self._by_path[ep.path]
                # D7: the last endpoint of the resource gone -> every device Unhealthy
                others = [e for e in self._by_path.values() if e.resource_name == ep.resource_name and e.open]
                if not others and ep.devices:
                    ep.devices = {d: "Unhealthy" for d in ep.devices}
                    ep.history.append(ep.devices)
                self._cond.notify_all()

    # ---- observing -----------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait until ``predicate()`` (evaluated under the lock) is true."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout=timeout_s)

    def endpoint(self, resource_name: str) -> Endpoint | None:
        """The current endpoint of ``resource_name`` (None when not registered)."""
        with self._cond:
            return self._endpoints.get(resource_name)



class KubeletSim(Kubelet):
    """``Kubelet`` driving one resource (the last registered), as the demo needs."""

    def __init__(self, plugin_dir: str, dial_timeout_s: float = 10.0) -> None:
        super().__init__(plugin_dir, dial_timeout_s)
        self.allocated: set[str] = set()

    def start(self) -> "KubeletSim":
        super().start()
        return self

    def _current(self) -> Endpoint | None:
        with self._cond:
            return self._endpoints.get(self.registrations[-1].resource_name) if self.registrations else None

    @property
    def resource_name(self) -> str | None:
        """The last registered resource name."""
        with self._cond:
            return self.registrations[-1].resource_name if self.registrations else None

    @property
    def options(self) -> pb.DevicePluginOptions | None:
        """The options of the last registration."""
        with self._cond:
            return self.registrations[-1].options if self.registrations else None

    @property
    def devices(self) -> dict[str, str]:
        """Device ID -> health of the open stream ({} when none)."""
        ep = self._current()
        return dict(ep.devices) if ep is not None and ep.open else {}

    @property
    def stream_open(self) -> bool:
        ep = self._current()
        return bool(ep and ep.open)

    def wait_registered(self, timeout_s: float = 10.0) -> str:
        """Block until a plugin registered and sent its device list; returns the
        resource name. Raises TimeoutError."""
        def done() -> bool:
            ep = self._endpoints.get(self.registrations[-1].resource_name) if self.registrations else None
            return ep is not None and ep.open and ep.updates > 0

        if not self.wait_for(done, timeout_s):
            raise TimeoutError(f"no device plugin registered on {self.socket_path} within {timeout_s} s")
        name = self.resource_name
        assert name is not None
        return name

    def pick(self, n: int, must_include: list[str] | tuple[str, ...] = ()) -> list[str]:
        """``n`` healthy device IDs, as kubelet chooses them: ``must_include``
        (devices an init container of the pod got, which kubelet reuses for
        the next container, D6) plus unallocated ones; the plugin's preference
        when it offers GetPreferredAllocation (asked with available +
        must_include + size), else ``must_include`` then the first free in
        order. Raises ValueError when fewer than ``n`` are available."""
        ep, options = self._current(), self.options
        must = list(must_include)
        with self._cond:
            free = sorted(d for d, h in self.devices.items()
                          if h == HEALTHY and (d not in self.allocated or d in must))
        if len(free) < n or not set(must) <= set(free):
            raise ValueError(f"{n} devices requested, {len(free)} healthy and free")
        if len(must) >= n:
            return must[:n]
        if ep is not None and options is not None and options.get_preferred_allocation_available:
            req = pb.PreferredAllocationRequest(container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=free, must_include_deviceIDs=must,
                                                       allocation_size=n)])
            resp = ep.stub.GetPreferredAllocation(req, timeout=5.0)
            ids = list(resp.container_responses[0].deviceIDs) if resp.container_responses else []
            if len(ids) == n and set(ids) <= set(free) and set(must) <= set(ids):
                return ids
        return must + [d for d in free if d not in must][: n - len(must)]

    def allocate(self, device_ids: list[str], timeout_s: float = 10.0) -> pb.ContainerAllocateResponse:
        """``Allocate`` with one container request (as kubelet sends it).
        Returns the container response; raises ``grpc.RpcError``
        (``code()``, ``details()``) on refusal, ConnectionError when no plugin
        registered."""
        ep = self._current()
        if ep is None:
            raise ConnectionError("no device plugin registered")
        resp: pb.AllocateResponse = ep.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)]),
            timeout=timeout_s)
        if not resp.container_responses:
            raise ValueError("Allocate answered no container response (kubelet treats this as an error)")
        with self._cond:
            self.allocated.update(device_ids)
        return resp.container_responses[0]

    def release(self, device_ids: list[str]) -> None:
        """Forget an allocation (the pod is gone)."""
        with self._cond:
            self.allocated.difference_update(device_ids)
