"""The demo's simulated container runtime (the runtime side of NRI): what
``fracplugin demo`` uses to act as containerd towards the daemon's NRI plugin.
Not used by ``fracplugin run``; the component tests use their own peer
(``tests/peers/nri_runtime.py``, with its own wire code).

It listens on a unix socket (as the runtime does at ``/var/run/nri/nri.sock``),
accepts one plugin connection at a time (a new one replaces the old), serves
``Runtime`` on mux conn 2 (``RegisterPlugin``, ``UpdateContainers``) and calls
``Plugin`` on conn 1 (docs/reference/nri-protocol.md sections 1.1, 1.6): after RegisterPlugin
it calls Configure, checks the event mask against the version's
``ValidEvents`` (0x3FFF for v0.12, 0x7FF for v0.8 and older: section 1.4) and
then Synchronizes (``initial_sync``); afterwards the caller drives
CreateContainer / StopContainer / RemoveContainer. Event RPCs use the v0.12
dedicated methods and fall back to ``StateChange`` for good after an
UNIMPLEMENTED (section 1.7); a v0.8 runtime sends ``StateChange`` only. A call
that outlives the request timeout is fatal for the connection (section 1.8).

Built on fracplugin's sans-I/O mux/ttrpc layers through ``NriTransport``. It
is a driver for the demo and benchmarks, not a claim of interop (the Go
interop suite drives the real adaptation).

Concurrency model: threads. One accept thread; one reader thread per
connection (``NriTransport``), which only answers RegisterPlugin and hands
Configure/Synchronize to a short-lived setup thread (the reader must never
block on its own calls); every other call runs on the caller's thread. Shared
state sits under one condition variable.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fracplugin import __version__
from fracplugin._proto import nri_pb2
from fracplugin.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from fracplugin.nri.transport import ConnectionClosed, NriTransport
from fracplugin.nri.ttrpc import Code, RequestReceived, RpcError
from .nri_driver import _PluginDriver

log = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
VALID_EVENTS_V012 = 0x3FFF  # (1 << (LAST-1)) - 1 with LAST = 15 (docs/reference/nri-protocol.md 1.4)
VALID_EVENTS_V08 = 0x7FF  # the same with LAST = 12

# Events carried by StateChange where no dedicated RPC is used (docs/reference/nri-protocol.md 1.7).
STATE_CHANGE_EVENTS = {
    "RunPodSandbox": nri_pb2.RUN_POD_SANDBOX,
    "StopPodSandbox": nri_pb2.STOP_POD_SANDBOX,
    "RemovePodSandbox": nri_pb2.REMOVE_POD_SANDBOX,
    "PostCreateContainer": nri_pb2.POST_CREATE_CONTAINER,
    "StartContainer": nri_pb2.START_CONTAINER,
    "PostStartContainer": nri_pb2.POST_START_CONTAINER,
    "PostUpdateContainer": nri_pb2.POST_UPDATE_CONTAINER,
    "RemoveContainer": nri_pb2.REMOVE_CONTAINER,
}


def valid_events(nri_version: str) -> int:
    """The ``ValidEvents`` mask a runtime of ``nri_version`` accepts from
    Configure (docs/reference/nri-protocol.md 1.4): 0x7FF up to v0.8, 0x3FFF from v0.12."""
    return VALID_EVENTS_V08 if nri_version.startswith(("v0.8", "v0.7", "v0.6", "v0.4", "v0.3")) else VALID_EVENTS_V012


@dataclass(frozen=True)
class PluginInfo:
    """A registered plugin: name, index and the event mask it subscribed."""

    name: str
    idx: str
    events: int


class PluginConn:
    """One plugin connection: its transport, what RegisterPlugin said, the
    ``PluginInfo`` once Configure succeeded (``ready`` set after setup) and
    whether events already fell back to StateChange (sticky per connection)."""

    def __init__(self, transport: NriTransport) -> None:
        self.transport = transport
        self.info: PluginInfo | None = None
        self.name = ""
        self.idx = ""
        self.ready = threading.Event()
        self.state_change_fallback = False


class NriRuntimeServer(_PluginDriver):
    """Listen on ``socket_path`` and drive the plugin that connects.

    Args:
        socket_path: the NRI socket to create (a stale file is removed).
        request_timeout_s: per-call timeout, seconds (NRI default 2 s); a call
            that exceeds it is fatal for the connection, as in the runtime.
        registration_timeout_s: sent in ConfigureRequest (ms on the wire).
        runtime_name, runtime_version, nri_version, config: sent in
            ConfigureRequest; ``nri_version`` also picks ValidEvents and the
            event RPCs ("v0.8..." sends StateChange only).
        initial_sync: ``(pods, containers)`` to Synchronize right after every
            Configure; None skips it (the caller synchronizes).
        backlog: the listen backlog.
    """

    label = "nri-runtime"

    def __init__(self, socket_path: str, *, request_timeout_s: float = 2.0, registration_timeout_s: float = 5.0,
                 runtime_name: str = "fracplugin-demo", runtime_version: str = __version__,
                 nri_version: str = "v0.12.2", config: str = "",
                 initial_sync: tuple[Sequence[Any], Sequence[Any]] | None = ([], []),
                 backlog: int = 4) -> None:
        self.socket_path = str(socket_path)
        self.request_timeout_s = request_timeout_s
        self.registration_timeout_s = registration_timeout_s
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self.nri_version = nri_version
        self.config = config
        self.initial_sync = initial_sync
        self.backlog = backlog
        self.valid_events = valid_events(nri_version)
        self.sync_updates: list[Any] = []
        """The ContainerUpdates the plugin answered to the last initial Synchronize."""
        self.connections = 0
        """Plugin connections accepted so far."""
        self.disconnects = 0
        """Current plugin connections that closed."""
        self._cond = threading.Condition()
        self._conn: PluginConn | None = None
        self._closed = False
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> "NriRuntimeServer":
        """Create the socket and accept plugins in the background. Raises OSError."""
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.socket_path)
        s.listen(self.backlog)
        self._listener = s
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"{self.label}-accept", daemon=True)
        self._accept_thread.start()
        return self

    def close(self) -> None:
        """Close the plugin connection and the listener; remove the socket
        file when this server created it. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conn = self._conn
            self._cond.notify_all()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if conn is not None:
            conn.transport.close("runtime shutting down")
            conn.transport.join(2.0)
        if self._accept_thread is not None:
            self._accept_thread.join(2.0)
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "NriRuntimeServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def adopt(self, sock: socket.socket) -> bool:
        """Serve a plugin on an already connected socket (what the accept
        loop does; also one end of a socketpair whose other end the plugin got
        as fd 3). It replaces the current connection. Returns False when the
        server is closed (the socket is closed then)."""
        with self._cond:
            if self._closed:
                sock.close()
                return False
            old = self._conn
            self.connections += 1
            n = self.connections
        if old is not None:
            old.transport.close("replaced by a new plugin connection")
        box: list[PluginConn] = []
        transport = NriTransport(
            sock, serve_conn=RUNTIME_SERVICE_CONN, call_conn=PLUGIN_SERVICE_CONN,
            on_request=lambda ev: self._on_request(box[0], ev),
            on_closed=lambda reason: self._on_closed(box[0], reason),
            label=f"{self.label}-{n}")
        conn = PluginConn(transport)
        box.append(conn)
        with self._cond:
            self._conn = conn
            self._cond.notify_all()
        transport.start()
        return True

    # ---- observing -----------------------------------------------------------------
    @property
    def transport(self) -> NriTransport | None:
        """The current (or last) plugin connection's transport; None before any."""
        with self._cond:
            return self._conn.transport if self._conn else None

    @property
    def plugin(self) -> PluginInfo | None:
        """The registered plugin of the open connection, or None."""
        with self._cond:
            conn = self._conn
            return conn.info if conn is not None and self._ready(conn) else None

    def wait_registered(self, timeout_s: float = 10.0) -> PluginInfo:
        """Block until a plugin registered, was configured and (with
        ``initial_sync``) synchronized, on a still open connection.
        Raises TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready(self._conn), timeout_s):
                raise TimeoutError(f"no NRI plugin registered on {self.socket_path} within {timeout_s} s")
            conn = self._conn
            assert conn is not None and conn.info is not None
            return conn.info

    # ---- driving the plugin: the events are in nri_driver.py -------------------
    def synchronize(self, pods: Sequence[Any], containers: Sequence[Any], *, parts: int = 1) -> list[Any]:
        """Send Synchronize, split into ``parts`` messages (all but the last
        with ``more = true``; the plugin must answer those ``{more: true}``).
        Returns the plugin's ContainerUpdates. Raises RpcError /
        ConnectionClosed / TimeoutError / AssertionError (a split answered
        wrongly: the connection is closed then)."""
        return self._synchronize(self._current(), pods, containers, parts)

    # ---- internals -----------------------------------------------------------------
    @staticmethod
    def _ready(conn: PluginConn | None) -> bool:
        return conn is not None and conn.ready.is_set() and not conn.transport.closed.is_set()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not self.adopt(sock):
                return

    def _on_closed(self, conn: PluginConn, reason: str) -> None:
        with self._cond:
            if self._conn is conn:
                self.disconnects += 1
            self._cond.notify_all()
        log.debug("%s: plugin connection closed: %s", self.label, reason)

    def _on_request(self, conn: PluginConn, ev: RequestReceived) -> None:
        # Runs on the reader thread: answer at once, never block.
        t = conn.transport
        if ev.service != RUNTIME_SERVICE:
            t.respond(ev.stream_id, code=Code.UNIMPLEMENTED, message=f"service {ev.service}")
        elif ev.method == "RegisterPlugin":
            req = nri_pb2.RegisterPluginRequest.FromString(ev.payload)
            conn.name, conn.idx = req.plugin_name, req.plugin_idx
            self._on_register(conn, ev.stream_id)
        elif ev.method == "UpdateContainers":
            self._on_update_containers(nri_pb2.UpdateContainersRequest.FromString(ev.payload))
            t.respond(ev.stream_id, nri_pb2.UpdateContainersResponse().SerializeToString())
        else:
            t.respond(ev.stream_id, code=Code.UNIMPLEMENTED, message=f"method {ev.method}")

    def _on_register(self, conn: PluginConn, stream_id: int) -> None:
        """Answer RegisterPlugin, then configure on a setup thread (the
        runtime's order). Runs on the reader thread."""
        conn.transport.respond(stream_id, b"")
        threading.Thread(target=self._setup, args=(conn,), name=f"{self.label}-setup", daemon=True).start()

    def _on_update_containers(self, req: Any) -> None:
        """Hook: an unsolicited UpdateContainersRequest arrived (reader thread)."""

    def _on_registered(self, info: PluginInfo) -> None:
        """Hook: a plugin finished setup (called under the condition lock)."""

    def _setup(self, conn: PluginConn, register_stream: int | None = None) -> None:
        """Configure, check the event mask, Synchronize ``initial_sync``; then
        mark the connection ready. ``register_stream``: a RegisterPlugin still
        unanswered, answered once Configure returned. Any failure closes the
        connection."""
        try:
            req = nri_pb2.ConfigureRequest(
                config=self.config, runtime_name=self.runtime_name, runtime_version=self.runtime_version,
                registration_timeout=int(round(self.registration_timeout_s * 1000)),
                request_timeout=int(round(self.request_timeout_s * 1000)), NRI_version=self.nri_version)
            resp = self._call_on(conn, "Configure", req, nri_pb2.ConfigureResponse)
            if register_stream is not None:
                conn.transport.respond(register_stream, b"")
            events = resp.events or self.valid_events
            if events & ~self.valid_events:
                raise RpcError(Code.INVALID_ARGUMENT, f"invalid plugin events: 0x{events & ~self.valid_events:x}")
            conn.info = PluginInfo(conn.name, conn.idx, events)
            if self.initial_sync is not None:
                self.sync_updates = self._synchronize(conn, self.initial_sync[0], self.initial_sync[1], 1)
        except Exception as exc:
            log.warning("%s: closing plugin %s: %s", self.label, conn.name, exc)
            conn.transport.close(f"plugin setup failed: {exc}")
            return
        with self._cond:
            self._on_registered(conn.info)
            conn.ready.set()
            self._cond.notify_all()

    def _synchronize(self, conn: PluginConn, pods: Sequence[Any], containers: Sequence[Any], parts: int) -> list[Any]:
        parts = max(1, parts)
        pod_chunks = [list(pods[i::parts]) for i in range(parts)]
        ctr_chunks = [list(containers[i::parts]) for i in range(parts)]
        for i in range(parts):
            more = i < parts - 1
            req = nri_pb2.SynchronizeRequest(pods=pod_chunks[i], containers=ctr_chunks[i], more=more)
            resp = self._call_on(conn, "Synchronize", req, nri_pb2.SynchronizeResponse)
            if more and not (resp.more and not resp.update):
                conn.transport.close("plugin does not handle split sync requests")
                raise AssertionError("plugin does not handle split sync requests")
        return list(resp.update)

    def _current(self) -> PluginConn:
        with self._cond:
            conn = self._conn
        if not self._ready(conn):
            raise ConnectionClosed(f"no NRI plugin is registered on {self.socket_path}")
        assert conn is not None
        return conn

    def _call(self, method: str, req: Any, resp_cls: Any) -> Any:
        return self._call_on(self._current(), method, req, resp_cls)

    def _record_call(self, method: str, req: Any) -> None:
        """Hook: a Plugin-service call is about to be sent."""

    def _call_on(self, conn: PluginConn, method: str, req: Any, resp_cls: Any) -> Any:
        self._record_call(method, req)
        t = conn.transport
        try:
            payload = t.call(PLUGIN_SERVICE, method, req.SerializeToString(), self.request_timeout_s)
        except TimeoutError:
            t.close(f"{method} timed out")  # deadline exceeded is fatal (docs/reference/nri-protocol.md 1.8)
            raise TimeoutError(f"{method}: plugin did not answer within {self.request_timeout_s} s") from None
        return resp_cls.FromString(payload)

    def _event(self, method: str, pod: Any, container: Any) -> None:
        conn = self._current()
        if not (self.valid_events == VALID_EVENTS_V08 or conn.state_change_fallback):
            cls = getattr(nri_pb2, method + "Request")
            req = cls(pod=pod) if container is None else cls(pod=pod, container=container)
            try:
                self._call_on(conn, method, req, getattr(nri_pb2, method + "Response"))
                return
            except RpcError as exc:
                if exc.code != Code.UNIMPLEMENTED:
                    raise
                conn.state_change_fallback = True  # sticky, like the v0.12 adaptation
        ev = nri_pb2.StateChangeEvent(event=STATE_CHANGE_EVENTS[method], pod=pod)
        if container is not None:
            ev.container.CopyFrom(container)
        self._call_on(conn, "StateChange", ev, nri_pb2.Empty)


# ---- message builders ---------------------------------------------------------------
def sandbox_msg(name: str, namespace: str, uid: str, sandbox_id: str, annotations: Mapping[str, str],
                labels: Mapping[str, str]) -> Any:
    """A ``PodSandbox`` as containerd sends it: the pod's annotations plus
    containerd's own ``io.kubernetes.cri.*`` keys (docs/reference/nri-protocol.md 1.11)."""
    ann = dict(annotations)
    ann.update({
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-id": sandbox_id,
        "io.kubernetes.cri.sandbox-name": name,
        "io.kubernetes.cri.sandbox-namespace": namespace,
        "io.kubernetes.cri.sandbox-uid": uid,
    })
    return nri_pb2.PodSandbox(id=sandbox_id, name=name, uid=uid, namespace=namespace, labels=dict(labels),
                              annotations=ann)


def pod_sandbox(manifest: Mapping[str, Any], sandbox_id: str = "") -> Any:
    """A ``PodSandbox`` for a Pod manifest dict (see ``sandbox_msg``); a
    random sandbox ID unless given."""
    md = manifest.get("metadata") or {}
    return sandbox_msg(str(md.get("name", "")), str(md.get("namespace", "default")), str(md.get("uid", "")),
                       sandbox_id or uuid.uuid4().hex,
                       {str(k): str(v) for k, v in (md.get("annotations") or {}).items()},
                       {str(k): str(v) for k, v in (md.get("labels") or {}).items()})


def container_msg(pod: Any, spec: Mapping[str, Any], container_id: str = "") -> Any:
    """A ``Container`` for one container spec of a pod (env from the spec)."""
    env = [f"{e['name']}={e.get('value', '')}" for e in spec.get("env") or [] if isinstance(e, dict) and "name" in e]
    return nri_pb2.Container(
        id=container_id or uuid.uuid4().hex, pod_sandbox_id=pod.id, name=str(spec.get("name", "")),
        annotations={"io.kubernetes.cri.container-name": str(spec.get("name", "")),
                     "io.kubernetes.cri.container-type": "container",
                     "io.kubernetes.cri.sandbox-id": pod.id},
        env=env, args=[str(a) for a in spec.get("command") or []])


def effective_env(container: Any, adjustment: Any) -> dict[str, str]:
    """The env a container ends up with: its own, then the adjustment's
    (set by value; ``-KEY`` removals are not applied to spec env, as the real
    merge does not forward them: docs/reference/nri-protocol.md 1.8)."""
    env: dict[str, str] = {}
    for kv in container.env:
        k, _, v = kv.partition("=")
        env[k] = v
    for kv in adjustment.env:
        if not kv.key.startswith("-"):
            env[kv.key] = kv.value
    return env
