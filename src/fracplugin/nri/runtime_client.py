"""The runtime side of NRI, small and reusable: what ``fracplugin demo`` uses
to act as containerd towards the daemon's NRI plugin.

It listens on a unix socket (as the runtime does at ``/var/run/nri/nri.sock``),
accepts one plugin connection at a time, serves ``Runtime`` on mux conn 2
(``RegisterPlugin``, ``UpdateContainers``) and calls ``Plugin`` on conn 1
(nri-protocol.md sections 1.1, 1.6): after RegisterPlugin it calls Configure,
checks the event mask against the NRI v0.12 ``ValidEvents`` (0x3FFF) and then
Synchronize; afterwards the caller drives CreateContainer / StopContainer /
RemoveContainer. Event RPCs use the v0.12 dedicated methods and fall back to
``StateChange`` for good after an UNIMPLEMENTED (section 1.7).

Built on fracplugin's sans-I/O mux/ttrpc layers through ``NriTransport``. It
is a driver for demos and tests, not a claim of interop (the Go interop suite
drives the real adaptation).

Concurrency model: threads. One accept thread; one reader thread per
connection (``NriTransport``), which only answers RegisterPlugin and hands
Configure/Synchronize to a short-lived setup thread (the reader must never
block on its own calls); every other call runs on the caller's thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .. import __version__
from .._proto import nri_pb2
from .mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from .transport import NriTransport
from .ttrpc import Code, RequestReceived, RpcError

log = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
VALID_EVENTS_V012 = 0x3FFF  # (1 << (LAST-1)) - 1 with LAST = 15 (nri-protocol.md 1.4)

_STATE_CHANGE = {
    "StopContainer": None,  # dedicated RPC on every version
    "RemoveContainer": nri_pb2.REMOVE_CONTAINER,
    "StartContainer": nri_pb2.START_CONTAINER,
    "RemovePodSandbox": nri_pb2.REMOVE_POD_SANDBOX,
    "StopPodSandbox": nri_pb2.STOP_POD_SANDBOX,
    "RunPodSandbox": nri_pb2.RUN_POD_SANDBOX,
}


@dataclass(frozen=True)
class PluginInfo:
    """A registered plugin: name, index and the event mask it subscribed."""

    name: str
    idx: str
    events: int


class NriRuntimeServer:
    """Listen on ``socket_path`` and drive the plugin that connects.

    Args:
        socket_path: the NRI socket to create (a stale file is removed).
        request_timeout_s: per-call timeout, seconds (NRI default 2 s); a call
            that exceeds it is fatal for the connection, as in the runtime.
        registration_timeout_s: sent in ConfigureRequest (ms on the wire).
        runtime_name, runtime_version, nri_version: sent in ConfigureRequest.
    """

    def __init__(self, socket_path: str, *, request_timeout_s: float = 2.0, registration_timeout_s: float = 5.0,
                 runtime_name: str = "fracplugin-demo", runtime_version: str = __version__,
                 nri_version: str = "v0.12.2") -> None:
        self.socket_path = socket_path
        self.request_timeout_s = request_timeout_s
        self.registration_timeout_s = registration_timeout_s
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self.nri_version = nri_version
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._transport: NriTransport | None = None
        self._info: PluginInfo | None = None
        self._state_change_fallback = False
        self._cond = threading.Condition()
        self._closing = False
        self.sync_pods: list[Any] = []
        self.sync_containers: list[Any] = []
        self.sync_updates: list[Any] = []
        self.disconnects = 0

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
        s.listen(4)
        self._listener = s
        self._accept_thread = threading.Thread(target=self._accept_loop, name="nri-runtime-accept", daemon=True)
        self._accept_thread.start()
        return self

    def close(self) -> None:
        """Close the plugin connection and the listener; remove the socket file."""
        with self._cond:
            self._closing = True
            t, self._transport = self._transport, None
            self._cond.notify_all()
        if t is not None:
            t.close("runtime closing")
            t.join(2.0)
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
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

    def wait_registered(self, timeout_s: float = 10.0) -> PluginInfo:
        """Block until a plugin registered, was configured and synchronized.
        Raises TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._info is not None, timeout_s):
                raise TimeoutError(f"no NRI plugin registered on {self.socket_path} within {timeout_s} s")
            assert self._info is not None
            return self._info

    @property
    def plugin(self) -> PluginInfo | None:
        return self._info

    # ---- driving the plugin ------------------------------------------------------
    def set_sync_state(self, pods: Sequence[Any], containers: Sequence[Any]) -> None:
        """What the next Synchronize (after a (re)connection) carries."""
        self.sync_pods, self.sync_containers = list(pods), list(containers)

    def create_container(self, pod: Any, container: Any) -> Any:
        """CreateContainer: returns the ``CreateContainerResponse``. Raises
        ``RpcError`` when the plugin refuses (e.g. INVALID_ARGUMENT)."""
        req = nri_pb2.CreateContainerRequest(pod=pod, container=container)
        return self._call("CreateContainer", req, nri_pb2.CreateContainerResponse)

    def start_container(self, pod: Any, container: Any) -> None:
        """StartContainer (v0.12 RPC, StateChange fallback). Raises RpcError
        (e.g. UNAVAILABLE: the runtime fails the start, kubelet retries)."""
        self._event("StartContainer", pod, container)

    def stop_container(self, pod: Any, container: Any) -> Any:
        """StopContainer: returns the ``StopContainerResponse``. Raises RpcError."""
        req = nri_pb2.StopContainerRequest(pod=pod, container=container)
        return self._call("StopContainer", req, nri_pb2.StopContainerResponse)

    def remove_container(self, pod: Any, container: Any) -> None:
        """RemoveContainer (v0.12 RPC, StateChange fallback). Raises RpcError."""
        self._event("RemoveContainer", pod, container)

    def remove_pod_sandbox(self, pod: Any) -> None:
        """RemovePodSandbox (v0.12 RPC, StateChange fallback). Raises RpcError."""
        self._event("RemovePodSandbox", pod, None)

    # ---- internals -----------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            transport = self._make_transport(conn)
            with self._cond:
                if self._closing:
                    conn.close()
                    return
                old, self._transport, self._info = self._transport, transport, None
                self._state_change_fallback = False
            if old is not None:
                old.close("replaced by a new plugin connection")
            transport.start()

    def _make_transport(self, conn: socket.socket) -> NriTransport:
        box: list[NriTransport] = []

        def on_request(ev: RequestReceived) -> None:
            self._on_request(box[0], ev)

        def on_closed(reason: str) -> None:
            with self._cond:
                if box and self._transport is box[0]:
                    self._transport, self._info = None, None
                    self.disconnects += 1
                self._cond.notify_all()
            log.debug("nri runtime: plugin connection closed: %s", reason)

        box.append(NriTransport(conn, serve_conn=RUNTIME_SERVICE_CONN, call_conn=PLUGIN_SERVICE_CONN,
                                on_request=on_request, on_closed=on_closed, label="nri-runtime"))
        return box[0]

    def _on_request(self, t: NriTransport, ev: RequestReceived) -> None:
        # Runs on the reader thread: answer at once, never block.
        if ev.service != RUNTIME_SERVICE:
            t.respond_error(ev.stream_id, Code.UNIMPLEMENTED, f"service {ev.service}")
        elif ev.method == "RegisterPlugin":
            req = nri_pb2.RegisterPluginRequest.FromString(ev.payload)
            t.respond(ev.stream_id, b"")
            threading.Thread(target=self._setup, args=(t, req.plugin_name, req.plugin_idx),
                             name="nri-runtime-setup", daemon=True).start()
        elif ev.method == "UpdateContainers":
            t.respond(ev.stream_id, nri_pb2.UpdateContainersResponse().SerializeToString())
        else:
            t.respond_error(ev.stream_id, Code.UNIMPLEMENTED, f"method {ev.method}")

    def _setup(self, t: NriTransport, name: str, idx: str) -> None:
        try:
            req = nri_pb2.ConfigureRequest(
                runtime_name=self.runtime_name, runtime_version=self.runtime_version,
                registration_timeout=int(self.registration_timeout_s * 1000),
                request_timeout=int(self.request_timeout_s * 1000), NRI_version=self.nri_version)
            resp = self._call_on(t, "Configure", req, nri_pb2.ConfigureResponse)
            events = resp.events or VALID_EVENTS_V012
            if events & ~VALID_EVENTS_V012:
                raise RpcError(Code.INVALID_ARGUMENT, f"invalid plugin events: 0x{events & ~VALID_EVENTS_V012:x}")
            sync = nri_pb2.SynchronizeRequest(pods=self.sync_pods, containers=self.sync_containers, more=False)
            self.sync_updates = list(self._call_on(t, "Synchronize", sync, nri_pb2.SynchronizeResponse).update)
        except Exception as exc:
            log.warning("nri runtime: closing plugin %s: %s", name, exc)
            t.close(f"plugin setup failed: {exc}")
            return
        with self._cond:
            if self._transport is t:
                self._info = PluginInfo(name, idx, events)
            self._cond.notify_all()

    def _current(self) -> NriTransport:
        with self._cond:
            if self._transport is None or self._info is None:
                raise ConnectionError(f"no NRI plugin is registered on {self.socket_path}")
            return self._transport

    def _call(self, method: str, req: Any, resp_cls: Any) -> Any:
        return self._call_on(self._current(), method, req, resp_cls)

    def _call_on(self, t: NriTransport, method: str, req: Any, resp_cls: Any) -> Any:
        try:
            payload = t.call(PLUGIN_SERVICE, method, req.SerializeToString(), self.request_timeout_s)
        except TimeoutError:
            t.close(f"{method} timed out")  # deadline exceeded is fatal (nri-protocol.md 1.8)
            raise
        return resp_cls.FromString(payload)

    def _event(self, method: str, pod: Any, container: Any) -> None:
        t = self._current()
        if not self._state_change_fallback:
            cls = getattr(nri_pb2, method + "Request")
            req = cls(pod=pod) if container is None else cls(pod=pod, container=container)
            try:
                self._call_on(t, method, req, getattr(nri_pb2, method + "Response"))
                return
            except RpcError as exc:
                if exc.code != Code.UNIMPLEMENTED:
                    raise
                self._state_change_fallback = True
        ev = nri_pb2.StateChangeEvent(event=_STATE_CHANGE[method], pod=pod)
        if container is not None:
            ev.container.CopyFrom(container)
        self._call_on(t, "StateChange", ev, nri_pb2.Empty)


# ---- message builders ---------------------------------------------------------------
def pod_sandbox(manifest: Mapping[str, Any], sandbox_id: str = "") -> Any:
    """A ``PodSandbox`` for a Pod manifest dict, as containerd sends it: the
    pod's annotations plus containerd's own ``io.kubernetes.cri.*`` keys
    (nri-protocol.md 1.11)."""
    md = manifest.get("metadata") or {}
    sid = sandbox_id or uuid.uuid4().hex
    ann = {str(k): str(v) for k, v in (md.get("annotations") or {}).items()}
    ann.update({
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-id": sid,
        "io.kubernetes.cri.sandbox-name": str(md.get("name", "")),
        "io.kubernetes.cri.sandbox-namespace": str(md.get("namespace", "default")),
        "io.kubernetes.cri.sandbox-uid": str(md.get("uid", "")),
    })
    return nri_pb2.PodSandbox(
        id=sid, name=str(md.get("name", "")), uid=str(md.get("uid", "")),
        namespace=str(md.get("namespace", "default")),
        labels={str(k): str(v) for k, v in (md.get("labels") or {}).items()}, annotations=ann)


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
    merge does not forward them: nri-protocol.md 1.8)."""
    env: dict[str, str] = {}
    for kv in container.env:
        k, _, v = kv.partition("=")
        env[k] = v
    for kv in adjustment.env:
        if not kv.key.startswith("-"):
            env[kv.key] = kv.value
    return env
