"""An in-process fake of the runtime side of NRI (what containerd embeds),
written on fracplugin's own sans-I/O mux/ttrpc layer, on a real unix socket.

It is a test and demo double, not a proof of interop (the Go interop suite is):
it follows the runtime's behaviour described in nri-protocol.md sections
1.2-1.9 -- it serves ``Runtime`` on mux conn 2 and calls ``Plugin`` on conn 1,
answers RegisterPlugin then calls Configure, rejects event masks outside the
version's ``ValidEvents`` (0x7FF for v0.8, 0x3FFF for v0.12), reads mux frames
into a 4096-byte buffer like a Go peer (a bigger frame drops the plugin),
sends v0.12 dedicated event RPCs (falling back to StateChange for good after
one UNIMPLEMENTED) or, as ``nri_version="v0.8.0"``, StateChange, and treats
a call that outlives the request timeout as fatal (closes the plugin).

Concurrency model: threads. One accept thread, one reader thread per plugin
connection (``NriTransport``), and the caller's thread for each call. One
plugin connection at a time: a new one replaces the old.

Usage::

    rt = FakeNriRuntime("/tmp/fpXYZ/nri.sock")
    ... start the plugin against that path ...
    info = rt.wait_registered()            # PluginInfo(name, idx, events)
    rt.synchronize([pod], [container])     # -> list[ContainerUpdate]
    adj = rt.create_container(pod, ctr)    # -> ContainerAdjustment | RpcError
    rt.stop_container(pod, ctr); rt.remove_container(pod, ctr)
    rt.close()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from fracplugin._proto import nri_pb2
from fracplugin.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from fracplugin.nri.transport import ConnectionClosed, NriTransport
from fracplugin.nri.ttrpc import Code, RequestReceived, RpcError

__all__ = [
    "FakeNriRuntime",
    "PluginInfo",
    "make_pod",
    "make_container",
    "pod_from_manifest",
    "effective_env",
]

log = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"

_STATE_CHANGE_EVENTS = {
    "RunPodSandbox": nri_pb2.RUN_POD_SANDBOX,
    "StopPodSandbox": nri_pb2.STOP_POD_SANDBOX,
    "RemovePodSandbox": nri_pb2.REMOVE_POD_SANDBOX,
    "PostCreateContainer": nri_pb2.POST_CREATE_CONTAINER,
    "StartContainer": nri_pb2.START_CONTAINER,
    "PostStartContainer": nri_pb2.POST_START_CONTAINER,
    "PostUpdateContainer": nri_pb2.POST_UPDATE_CONTAINER,
    "RemoveContainer": nri_pb2.REMOVE_CONTAINER,
}


@dataclass(frozen=True)
class PluginInfo:
    """A registered plugin: its name, index and subscribed event mask."""

    name: str
    idx: str
    events: int


class _PluginConn:
    def __init__(self, transport: NriTransport) -> None:
        self.transport = transport
        self.info: PluginInfo | None = None
        self.name = ""
        self.idx = ""
        self.ready = threading.Event()
        self.state_change_fallback = False


class FakeNriRuntime:
    """The runtime end of NRI, listening on ``socket_path``.

    Args:
        socket_path: where to listen (a stale file is removed first).
        nri_version: "v0.12.2" (dedicated event RPCs, ValidEvents 0x3FFF) or
            "v0.8.0" (StateChange events, ValidEvents 0x7FF).
        request_timeout_ms / registration_timeout_ms: sent in ConfigureRequest;
            the request timeout also bounds every call made here.
        config: ConfigureRequest.config.
        initial_sync: ``(pods, containers)`` to Synchronize right after every
            Configure (what a real runtime does with its running containers);
            None leaves synchronizing to ``synchronize()``.
        max_read_frame: the mux frame size the runtime can read (bytes).
        configure_before_register_reply: call Configure and wait for its
            answer *before* answering RegisterPlugin (a plugin whose reader
            blocks on its own register reply deadlocks here).
        listen: False to skip the listener (use ``adopt`` with a socketpair,
            like a runtime that launched the plugin with fd 3).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        nri_version: str = "v0.12.2",
        runtime_name: str = "fake-nri-runtime",
        runtime_version: str = "v0.0.0-test",
        request_timeout_ms: int = 2000,
        registration_timeout_ms: int = 5000,
        config: str = "",
        initial_sync: tuple[Sequence[Any], Sequence[Any]] | None = None,
        max_read_frame: int = 4096,
        configure_before_register_reply: bool = False,
        listen: bool = True,
    ) -> None:
        self.socket_path = str(socket_path)
        self.nri_version = nri_version
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self.request_timeout_ms = request_timeout_ms
        self.registration_timeout_ms = registration_timeout_ms
        self.config = config
        self.initial_sync = initial_sync
        self.max_read_frame = max_read_frame
        self.configure_before_register_reply = configure_before_register_reply
        self.valid_events = 0x7FF if nri_version.startswith(("v0.8", "v0.7", "v0.6", "v0.4", "v0.3")) else 0x3FFF
        self.connections = 0
        """Plugin connections accepted so far."""
        self.registrations: list[PluginInfo] = []
        """Every successful registration, in order."""
        self.unsolicited: list[Any] = []
        """UpdateContainersRequests the plugin sent, in order."""
        self.calls: list[str] = []
        """Plugin-service methods called, in order (StateChange as 'StateChange:<event>')."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._conn: _PluginConn | None = None
        self._closed = False
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        if listen:
            path = Path(self.socket_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() or path.is_symlink():
                path.unlink()
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self.socket_path)
            self._listener.listen(8)
            self._accept_thread = threading.Thread(target=self._accept_loop, name="fake-nri-accept", daemon=True)
            self._accept_thread.start()

    # ---------------------------------------------------------------- public

    @property
    def timeout_s(self) -> float:
        return self.request_timeout_ms / 1000.0

    @property
    def transport(self) -> NriTransport | None:
        """The current plugin connection's transport (None when none)."""
        with self._lock:
            return self._conn.transport if self._conn else None

    def wait_registered(self, timeout_s: float = 10.0) -> PluginInfo:
        """Wait until a plugin registered and answered Configure (and the
        ``initial_sync`` ran); return it. Raises TimeoutError."""
        with self._changed:
            ok = self._changed.wait_for(
                lambda: self._conn is not None and self._conn.ready.is_set() and not self._conn.transport.closed.is_set(),
                timeout_s,
            )
            if not ok:
                raise TimeoutError(f"no plugin registered on {self.socket_path} within {timeout_s} s")
            assert self._conn is not None and self._conn.info is not None
            return self._conn.info

    def wait_disconnected(self, timeout_s: float = 10.0) -> str | None:
        """Wait until the current plugin connection is closed; returns its
        close reason (None when there was no connection). Raises TimeoutError."""
        t = self.transport
        if t is None:
            return None
        if not t.closed.wait(timeout_s):
            raise TimeoutError("plugin connection still open")
        return t.close_reason

    def synchronize(
        self, pods: Sequence[Any], containers: Sequence[Any], *, parts: int = 1
    ) -> list[Any]:
        """Send Synchronize, split into ``parts`` messages (all but the last
        with ``more = true``, checking the plugin answers ``{more: true}``).
        Returns the plugin's ContainerUpdates. Raises RpcError / ConnectionClosed
        / TimeoutError / AssertionError (a split answered wrongly)."""
        conn = self._current()
        return self._synchronize(conn, pods, containers, parts)

    def create_container(self, pod: Any, container: Any) -> Any:
        """CreateContainer: the plugin's ContainerAdjustment (empty when it left
        the container alone), or the RpcError it answered. Raises
        ConnectionClosed / TimeoutError (the connection is closed then)."""
        req = nri_pb2.CreateContainerRequest(pod=pod, container=container)
        out = self._call("CreateContainer", req, nri_pb2.CreateContainerResponse)
        return out if isinstance(out, RpcError) else out.adjust

    def update_container(self, pod: Any, container: Any) -> Any:
        req = nri_pb2.UpdateContainerRequest(pod=pod, container=container)
        out = self._call("UpdateContainer", req, nri_pb2.UpdateContainerResponse)
        return out if isinstance(out, RpcError) else list(out.update)

    def stop_container(self, pod: Any, container: Any) -> Any:
        """StopContainer: the plugin's ContainerUpdates, or its RpcError."""
        req = nri_pb2.StopContainerRequest(pod=pod, container=container)
        out = self._call("StopContainer", req, nri_pb2.StopContainerResponse)
        return out if isinstance(out, RpcError) else list(out.update)

    def remove_container(self, pod: Any, container: Any) -> RpcError | None:
        """RemoveContainer (dedicated RPC on v0.12, StateChange on v0.8)."""
        return self._event("RemoveContainer", pod, container)

    def start_container(self, pod: Any, container: Any) -> RpcError | None:
        return self._event("StartContainer", pod, container)

    def run_pod_sandbox(self, pod: Any) -> RpcError | None:
        return self._event("RunPodSandbox", pod, None)

    def stop_pod_sandbox(self, pod: Any) -> RpcError | None:
        return self._event("StopPodSandbox", pod, None)

    def remove_pod_sandbox(self, pod: Any) -> RpcError | None:
        return self._event("RemovePodSandbox", pod, None)

    def call_raw(self, service: str, method: str, payload: bytes, timeout_s: float | None = None) -> Any:
        """Any request on the Plugin conn; returns the ``ResponseReceived``."""
        t = self._current().transport
        fut = t.call_async(service, method, payload, timeout_nano=int(self.timeout_s * 1e9))
        return fut.result(timeout_s or self.timeout_s)

    def disconnect(self) -> None:
        """Close the current plugin connection (the listener stays)."""
        t = self.transport
        if t is not None:
            t.close("runtime closed the plugin connection")
            t.join(2.0)

    def close(self) -> None:
        """Close the connection and the listener and remove the socket file
        (a runtime going away). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conn = self._conn
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

    def __enter__(self) -> "FakeNriRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- internals

    def _current(self) -> _PluginConn:
        with self._lock:
            conn = self._conn
        if conn is None or conn.transport.closed.is_set() or not conn.ready.is_set():
            raise ConnectionClosed("no registered plugin")
        return conn

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not self.adopt(sock):
                return

    def adopt(self, sock: socket.socket) -> bool:
        """Serve a plugin on an already connected socket (e.g. one end of a
        socketpair whose other end the plugin got as fd 3). Returns False when
        the runtime is closed (the socket is closed then)."""
        with self._lock:
            if self._closed:
                sock.close()
                return False
            old = self._conn
            self.connections += 1
        if old is not None:
            old.transport.close("replaced by a new plugin connection")
        conn_box: list[_PluginConn] = []
        transport = NriTransport(
            sock,
            serve_conn=RUNTIME_SERVICE_CONN,
            call_conn=PLUGIN_SERVICE_CONN,
            on_request=lambda ev, box=conn_box: self._on_request(box[0], ev),
            on_closed=lambda reason: self._notify(),
            max_read_frame=self.max_read_frame,
            label=f"fake-runtime-{self.connections}",
        )
        conn = _PluginConn(transport)
        conn_box.append(conn)
        with self._changed:
            self._conn = conn
            self._changed.notify_all()
        transport.start()
        return True

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _on_request(self, conn: _PluginConn, ev: RequestReceived) -> None:
        t = conn.transport
        if ev.service != RUNTIME_SERVICE:
            t.respond_error(ev.stream_id, Code.UNIMPLEMENTED, f"service {ev.service}")
            return
        if ev.method == "RegisterPlugin":
            req = nri_pb2.RegisterPluginRequest.FromString(ev.payload)
            conn.name, conn.idx = req.plugin_name, req.plugin_idx
            if self.configure_before_register_reply:
                threading.Thread(
                    target=self._configure, args=(conn, ev.stream_id), name="fake-nri-configure", daemon=True
                ).start()
            else:
                t.respond(ev.stream_id, b"")
                threading.Thread(target=self._configure, args=(conn,), name="fake-nri-configure", daemon=True).start()
        elif ev.method == "UpdateContainers":
            req = nri_pb2.UpdateContainersRequest.FromString(ev.payload)
            with self._lock:
                self.unsolicited.append(req)
            t.respond(ev.stream_id, nri_pb2.UpdateContainersResponse().SerializeToString())
        else:
            t.respond_error(ev.stream_id, Code.UNIMPLEMENTED, f"method {ev.method}")

    def _configure(self, conn: _PluginConn, register_stream: int | None = None) -> None:
        req = nri_pb2.ConfigureRequest(
            config=self.config,
            runtime_name=self.runtime_name,
            runtime_version=self.runtime_version,
            registration_timeout=self.registration_timeout_ms,
            request_timeout=self.request_timeout_ms,
            NRI_version=self.nri_version,
        )
        try:
            resp = self._call_on(conn, "Configure", req, nri_pb2.ConfigureResponse)
            if isinstance(resp, RpcError):
                raise resp
            if register_stream is not None:
                conn.transport.respond(register_stream, b"")
            events = resp.events or self.valid_events
            if events & ~self.valid_events:
                raise RpcError(Code.INVALID_ARGUMENT, f"invalid plugin events: 0x{events & ~self.valid_events:x}")
            conn.info = PluginInfo(conn.name, conn.idx, events)
            if self.initial_sync is not None:
                self._synchronize(conn, self.initial_sync[0], self.initial_sync[1], 1)
        except Exception as exc:
            log.warning("fake runtime: closing plugin %s: %s", conn.name, exc)
            conn.transport.close(f"plugin setup failed: {exc}")
            return
        with self._changed:
            self.registrations.append(conn.info)
            conn.ready.set()
            self._changed.notify_all()

    def _synchronize(self, conn: _PluginConn, pods: Sequence[Any], containers: Sequence[Any], parts: int) -> list[Any]:
        parts = max(1, parts)
        pod_chunks = [list(pods[i::parts]) for i in range(parts)]
        ctr_chunks = [list(containers[i::parts]) for i in range(parts)]
        for i in range(parts):
            more = i < parts - 1
            req = nri_pb2.SynchronizeRequest(pods=pod_chunks[i], containers=ctr_chunks[i], more=more)
            resp = self._call_on(conn, "Synchronize", req, nri_pb2.SynchronizeResponse)
            if isinstance(resp, RpcError):
                raise resp
            if more and not (resp.more and not resp.update):
                conn.transport.close("plugin does not handle split sync requests")
                raise AssertionError("plugin does not handle split sync requests")
        return list(resp.update)

    def _event(self, method: str, pod: Any, container: Any) -> RpcError | None:
        conn = self._current()
        use_state_change = self.valid_events == 0x7FF or conn.state_change_fallback
        if not use_state_change:
            cls = getattr(nri_pb2, method + "Request")
            req = cls(pod=pod) if container is None else cls(pod=pod, container=container)
            out = self._call_on(conn, method, req, getattr(nri_pb2, method + "Response"))
            if not (isinstance(out, RpcError) and out.code == Code.UNIMPLEMENTED):
                return out if isinstance(out, RpcError) else None
            conn.state_change_fallback = True  # sticky, like the v0.12 adaptation
        ev = nri_pb2.StateChangeEvent(event=_STATE_CHANGE_EVENTS[method], pod=pod)
        if container is not None:
            ev.container.CopyFrom(container)
        out = self._call_on(conn, "StateChange", ev, nri_pb2.Empty)
        return out if isinstance(out, RpcError) else None

    def _call(self, method: str, req: Any, resp_cls: Any) -> Any:
        return self._call_on(self._current(), method, req, resp_cls)

    def _call_on(self, conn: _PluginConn, method: str, req: Any, resp_cls: Any) -> Any:
        label = method if method != "StateChange" else f"StateChange:{nri_pb2.Event.Name(req.event)}"
        with self._lock:
            self.calls.append(label)
        fut = conn.transport.call_async(
            PLUGIN_SERVICE, method, req.SerializeToString(), timeout_nano=int(self.timeout_s * 1e9)
        )
        try:
            resp = fut.result(self.timeout_s)
        except TimeoutError:
            # Deadline exceeded is fatal for the runtime: it drops the plugin.
            conn.transport.close(f"{method} timed out")
            raise TimeoutError(f"{method}: plugin did not answer within {self.timeout_s} s") from None
        if not resp.ok:
            return RpcError(resp.code, resp.message)
        return resp_cls.FromString(resp.payload)


# ------------------------------------------------------------------ builders


def make_pod(
    name: str,
    namespace: str = "default",
    uid: str = "",
    annotations: Mapping[str, str] | None = None,
    *,
    pod_id: str = "",
    labels: Mapping[str, str] | None = None,
) -> Any:
    """A ``PodSandbox`` as containerd sends it: the pod's annotations plus
    containerd's ``io.kubernetes.cri.*`` keys (nri-protocol.md section 1.11)."""
    uid = uid or f"uid-{namespace}-{name}"
    pod_id = pod_id or f"sandbox-{uid}"
    ann = dict(annotations or {})
    ann.update(
        {
            "io.kubernetes.cri.sandbox-id": pod_id,
            "io.kubernetes.cri.sandbox-name": name,
            "io.kubernetes.cri.sandbox-namespace": namespace,
            "io.kubernetes.cri.sandbox-uid": uid,
            "io.kubernetes.cri.container-type": "sandbox",
        }
    )
    return nri_pb2.PodSandbox(
        id=pod_id, name=name, uid=uid, namespace=namespace, annotations=ann, labels=dict(labels or {})
    )


def make_container(
    pod: Any,
    name: str,
    *,
    container_id: str = "",
    env: Mapping[str, str] | Iterable[str] | None = None,
    state: int = 0,
) -> Any:
    """A ``Container`` of ``pod`` (state 0 as in CreateContainer, or e.g.
    ``nri_pb2.CONTAINER_RUNNING`` for Synchronize)."""
    container_id = container_id or f"ctr-{pod.uid}-{name}"
    if env is None:
        env_list = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    elif isinstance(env, Mapping):
        env_list = [f"{k}={v}" for k, v in env.items()]
    else:
        env_list = list(env)
    return nri_pb2.Container(
        id=container_id,
        pod_sandbox_id=pod.id,
        name=name,
        state=state,
        env=env_list,
        annotations={"io.kubernetes.cri.container-name": name, "io.kubernetes.cri.container-type": "container"},
    )


def pod_from_manifest(manifest: Mapping[str, Any] | str | os.PathLike[str], *, pod_id: str = "") -> tuple[Any, list[Any]]:
    """``(PodSandbox, [Container...])`` from a Pod manifest (a dict, or a YAML
    file path such as ``shared/examples/pods/*.yaml``). Container env comes
    from ``spec.containers[].env[].value``."""
    if not isinstance(manifest, Mapping):
        import yaml

        manifest = yaml.safe_load(Path(manifest).read_text())
    meta = manifest.get("metadata", {})
    pod = make_pod(
        meta.get("name", "pod"),
        meta.get("namespace", "default"),
        meta.get("uid", ""),
        {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
        pod_id=pod_id,
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
    )
    containers = []
    for c in manifest.get("spec", {}).get("containers", []):
        env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        env += [f"{e['name']}={e.get('value', '')}" for e in c.get("env") or [] if "name" in e]
        containers.append(make_container(pod, c["name"], env=env))
    return pod, containers


def effective_env(container: Any, adjustment: Any) -> dict[str, str]:
    """The env the container ends up with after one plugin's adjustment, as
    the runtime applies it: set-by-value wins; a ``-KEY`` removal does *not*
    delete a var the pod spec set (nri-protocol.md section 1.8, env caveat)."""
    env: dict[str, str] = {}
    for kv in container.env:
        k, _, v = kv.partition("=")
        env[k] = v
    for kv in adjustment.env:
        if kv.key.startswith("-"):
            continue
        env[kv.key] = kv.value
    return env
