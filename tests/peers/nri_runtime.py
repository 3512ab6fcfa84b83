"""The runtime side of NRI (what containerd embeds) for the component tests,
on a real unix socket, with its own wire code (``ttrpc_wire``): nothing here
comes from ``fracplugin.nri``, so a framing or registration bug in the
product's stub cannot be mirrored on this side and pass.

Behaviour, from the NRI reference notes (docs/reference/nri-protocol.md sections 1.1-1.9,
containerd/nri ``pkg/adaptation``):

* mux conn 2 serves ``Runtime`` (``RegisterPlugin``, ``UpdateContainers``),
  mux conn 1 calls ``Plugin`` with odd, increasing stream ids and a
  ``timeout_nano`` of the request timeout (1.1, 1.3);
* a request on conn 2 with an even or non-increasing stream id is answered
  ``INVALID_ARGUMENT`` with the Go messages; an unknown service / method
  ``UNIMPLEMENTED`` "service <name>" / "method <name>"; a request that does
  not decode ``INVALID_ARGUMENT`` (1.3);
* RegisterPlugin: ``plugin_idx`` must be two digits and, from v0.12, the
  name must match ``[a-zA-Z0-9_.+-]+`` (1.5; refused with ``UNKNOWN``, a
  plain Go error); then the answer, then Configure (or, with
  ``configure_before_register_reply``, Configure first), then the event mask
  check against the version's ``ValidEvents`` -- 0x7FF up to v0.9, 0x3FFF
  from v0.10 (1.4) -- then Synchronize ``initial_sync`` (1.6);
* mux frames are read into a 4096-byte buffer like a Go peer: a bigger frame
  drops the plugin (1.2, "critical interop rule"); frames written are at most
  4096 bytes;
* v0.12 runtimes send the dedicated event RPCs and fall back to StateChange
  for good after one ``UNIMPLEMENTED``; ``nri_version="v0.8.0"`` sends
  StateChange only (1.7);
* pod and container events (those ``STATE_CHANGE_EVENTS`` names: RunPodSandbox,
  RemovePodSandbox, StartContainer, RemoveContainer, ...) reach the plugin
  only when its Configure mask subscribed them (0 = everything): containerd/nri
  ``pkg/adaptation`` skips a plugin whose ``events`` lacks the event's bit
  (1.4); the event is then recorded in ``skipped`` and the call returns None;
* a call that outlives the request timeout is fatal: the connection is
  closed (1.8).

Test additions: fault injection (``transport.send_raw``, ``send_raw_on``,
``call_async_body(check_size=False)``, ``call_raw``, ``disconnect``), and
recording (``registrations``, ``calls``, ``unsolicited``, ``connections``).

Concurrency model: threads. One accept thread; one reader thread per plugin
connection (``PeerConnection``), which answers requests itself and never
waits for the plugin (Configure and Synchronize run on a short-lived setup
thread); every other call runs on the caller's thread. One plugin connection
at a time: a new one replaces the old. Shared state sits under one condition
variable; socket writes under one lock per connection (so stream ids reach
the wire in order).

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

import enum
import logging
import os
import re
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from google.protobuf.message import DecodeError

from fracplugin._proto import nri_pb2
from tests.helpers import scaled

from . import ttrpc_wire as w

__all__ = [
    "Code",
    "ConnectionClosed",
    "FakeNriRuntime",
    "PeerConnection",
    "PluginInfo",
    "RpcError",
    "effective_env",
    "make_container",
    "make_pod",
    "pod_from_manifest",
    "valid_events",
]

log = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
VALID_EVENTS_V012 = 0x3FFF  # (1 << (LAST-1)) - 1, LAST = 15 from v0.10 (docs/reference/nri-protocol.md 1.4)
VALID_EVENTS_V08 = 0x7FF  # the same with LAST = 12, up to v0.9
_PLUGIN_NAME = re.compile(r"[a-zA-Z0-9_.+-]+")  # pkg/api/plugin.go, v0.12.0+
_PLUGIN_IDX = re.compile(r"[0-9]{2}")

# Events that travel as StateChange where no dedicated RPC is used (docs/reference/nri-protocol.md 1.7).
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


class Code(enum.IntEnum):
    """gRPC status codes (google.rpc.Code), as they travel in ttrpc statuses."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RpcError(Exception):
    """The plugin answered a call with an error status (``code``: int,
    ``message``: str)."""

    def __init__(self, code: int, message: str) -> None:
        try:
            name = Code(code).name
        except ValueError:
            name = f"code {code}"
        super().__init__(f"{name}: {message}")
        self.code = int(code)
        self.message = message


class ConnectionClosed(ConnectionError):
    """The plugin connection is closed (EOF, protocol error, close())."""


def valid_events(nri_version: str) -> int:
    """The ``ValidEvents`` mask a runtime of ``nri_version`` accepts from
    Configure (docs/reference/nri-protocol.md 1.4): 0x7FF up to v0.9, 0x3FFF from v0.10."""
    m = re.match(r"v?0\.(\d+)", nri_version)
    return VALID_EVENTS_V08 if m and int(m.group(1)) < 10 else VALID_EVENTS_V012


@dataclass(frozen=True)
class PluginInfo:
    """A registered plugin: name, index and the event mask it subscribed."""

    name: str
    idx: str
    events: int


# ------------------------------------------------------------ the connection


class PeerConnection:
    """One plugin connection seen from the runtime: a ttrpc client on mux
    conn 1 and a ttrpc server on mux conn 2 over one socket.

    Args:
        sock: a connected stream socket; owned (and closed) from now on.
        on_request: ``f(conn, stream_id, Request)`` run on the reader thread
            for each valid request on conn 2; it must answer with
            ``respond``/``respond_error`` without waiting for the plugin.
        on_closed: ``f(conn, reason)`` run once when the connection closes.
        max_read_frame: the largest mux frame read, bytes (header included);
            None: up to the mux limit. A bigger frame closes the connection.
        max_write_frame: the largest mux frame written, bytes.
        label: names the reader thread.
    """

    def __init__(self, sock: socket.socket, *, on_request: Callable[["PeerConnection", int, w.Request], None],
                 on_closed: Callable[["PeerConnection", str], None], max_read_frame: int | None = 4096,
                 max_write_frame: int = 4096, label: str = "fake-runtime") -> None:
        self._sock = sock
        self._sock.settimeout(None)
        self._on_request = on_request
        self._on_closed = on_closed
        self._mux = w.MuxReader(max_read_frame)
        self._client = w.TtrpcReader()  # conn 1: our calls' answers
        self._server = w.TtrpcReader()  # conn 2: the plugin's calls
        self._max_write_frame = max_write_frame
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next_stream = 1
        self._pending: dict[int, Future[w.Response]] = {}
        self._last_served = 0
        self._awaiting: set[int] = set()
        self._closed = threading.Event()
        self.close_reason: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name=f"{label}-reader", daemon=True)

    # ---- lifecycle
    def start(self) -> "PeerConnection":
        self._reader.start()
        return self

    @property
    def closed(self) -> threading.Event:
        """Set once the connection is closed."""
        return self._closed

    def close(self, reason: str = "closed by the runtime") -> None:
        """Close (idempotent): pending calls fail with ConnectionClosed, the
        socket is shut down, ``on_closed`` runs once."""
        with self._lock:
            if self._closed.is_set():
                return
            self.close_reason = reason
            self._closed.set()
            pending, self._pending = self._pending, {}
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionClosed(reason))
        if not self._reader.is_alive():
            self._sock.close()
        self._on_closed(self, reason)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the reader thread to end (after ``close`` or EOF)."""
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout_s)

    # ---- writing
    def _send(self, data: bytes) -> None:
        # Caller holds _write_lock.
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self.close(f"write failed: {exc}")
            raise ConnectionClosed(f"write failed: {exc}") from exc

    def call_async_body(self, body: bytes, *, check_size: bool = True) -> "Future[w.Response]":
        """Send an encoded ttrpc ``Request`` on conn 1 (next odd stream id);
        the future resolves with the plugin's ``Response``. ``check_size=False``
        sends a body above 4 MiB (a test of the plugin's limit). Raises
        ValueError (too large), ConnectionClosed."""
        if check_size and len(body) > w.TTRPC_MAX_DATA:
            raise ValueError(f"request of {len(body)} bytes exceeds the ttrpc limit of {w.TTRPC_MAX_DATA}")
        fut: Future[w.Response] = Future()
        with self._write_lock:
            with self._lock:
                if self._closed.is_set():
                    raise ConnectionClosed(self.close_reason or "closed")
                sid = self._next_stream
                self._next_stream += 2
                self._pending[sid] = fut
            self._send(w.mux_frames(w.PLUGIN_SERVICE_CONN, w.ttrpc_frame(sid, w.REQUEST, body),
                                    self._max_write_frame))
        return fut

    def call_async(self, service: str, method: str, payload: bytes, *,
                   timeout_nano: int = 0) -> "Future[w.Response]":
        """Send ``service/method(payload)`` on conn 1; see ``call_async_body``."""
        return self.call_async_body(w.encode_request(w.Request(service, method, payload, timeout_nano)))

    def call(self, service: str, method: str, payload: bytes, timeout_s: float) -> bytes:
        """Blocking call: the response payload. Raises RpcError (error status),
        TimeoutError (no answer within ``timeout_s`` seconds), ConnectionClosed."""
        fut = self.call_async(service, method, payload, timeout_nano=int(timeout_s * 1e9))
        try:
            resp = fut.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{method}: no answer within {timeout_s} s") from None
        if resp.code != Code.OK:
            raise RpcError(resp.code, resp.message)
        return resp.payload

    def respond(self, stream_id: int, payload: bytes) -> None:
        """Answer request ``stream_id`` on conn 2 with OK. Raises ValueError
        (not awaiting an answer), ConnectionClosed."""
        self._answer(stream_id, w.Response(payload=payload))

    def respond_error(self, stream_id: int, code: int, message: str) -> None:
        """Answer request ``stream_id`` on conn 2 with an error status."""
        self._answer(stream_id, w.Response(code=int(code), message=message))

    def _answer(self, stream_id: int, resp: w.Response, *, check: bool = True) -> None:
        with self._write_lock:
            with self._lock:
                if self._closed.is_set():
                    raise ConnectionClosed(self.close_reason or "closed")
                if check:
                    if stream_id not in self._awaiting:
                        raise ValueError(f"stream {stream_id} is not awaiting an answer")
                    self._awaiting.discard(stream_id)
            self._send(w.mux_frames(w.RUNTIME_SERVICE_CONN, w.ttrpc_frame(stream_id, w.RESPONSE,
                                                                           w.encode_response(resp)),
                                    self._max_write_frame))

    def send_raw(self, data: bytes) -> None:
        """Write ``data`` to the socket as is (garbage for tests). Raises ConnectionClosed."""
        with self._write_lock:
            self._send(data)

    def send_raw_on(self, conn_id: int, data: bytes, max_frame: int | None = None) -> None:
        """Write raw ttrpc bytes ``data`` in mux frames on ``conn_id``."""
        with self._write_lock:
            self._send(w.mux_frames(conn_id, data, max_frame or self._max_write_frame))

    # ---- reading
    def _read_loop(self) -> None:
        reason = "EOF from the plugin"
        try:
            while not self._closed.is_set():
                try:
                    data = self._sock.recv(65536)
                except OSError as exc:
                    reason = f"read failed: {exc}"
                    break
                if not data:
                    break
                for conn_id, payload in self._mux.feed(data):
                    if conn_id == w.PLUGIN_SERVICE_CONN:
                        for m in self._client.feed(payload):
                            self._on_answer(m)
                    elif conn_id == w.RUNTIME_SERVICE_CONN:
                        for m in self._server.feed(payload):
                            self._on_call(m)
                    # other conn ids: dropped, as the Go mux does
        except w.WireError as exc:
            reason = f"protocol error: {exc}"
        except ConnectionClosed as exc:
            reason = str(exc)
        except Exception as exc:  # a bug in this peer: say so in the close reason
            log.exception("fake runtime reader failed")
            reason = f"internal error: {exc!r}"
        finally:
            self.close(reason)
            self._sock.close()

    def _on_answer(self, m: w.TtrpcMessage) -> None:
        if m.msg_type != w.RESPONSE:
            return  # the runtime's client ignores anything but responses
        with self._lock:
            fut = self._pending.pop(m.stream_id, None)
        if fut is None or fut.done():
            return
        if m.data is None:
            fut.set_result(w.Response(Code.RESOURCE_EXHAUSTED, f"message length {m.length} exceed maximum "
                                      f"message size of {w.TTRPC_MAX_DATA}", has_status=True))
            return
        try:
            fut.set_result(w.decode_response(m.data))
        except w.WireError as exc:
            fut.set_result(w.Response(Code.INTERNAL, f"unmarshal response error: {exc}", has_status=True))

    def _on_call(self, m: w.TtrpcMessage) -> None:
        if m.msg_type != w.REQUEST:
            return
        if m.stream_id % 2 == 0:
            self._answer(m.stream_id, w.Response(Code.INVALID_ARGUMENT,
                                                 "StreamID must be odd for client initiated streams"), check=False)
            return
        if m.stream_id <= self._last_served:
            self._answer(m.stream_id, w.Response(Code.INVALID_ARGUMENT,
                                                 "StreamID cannot be re-used and must increment"), check=False)
            return
        self._last_served = m.stream_id
        if m.data is None:
            self._answer(m.stream_id, w.Response(Code.RESOURCE_EXHAUSTED, f"message length {m.length} exceed "
                                                 f"maximum message size of {w.TTRPC_MAX_DATA}"), check=False)
            return
        try:
            req = w.decode_request(m.data)
        except w.WireError as exc:
            self._answer(m.stream_id, w.Response(Code.INVALID_ARGUMENT, f"unmarshal request error: {exc}"),
                         check=False)
            return
        with self._lock:
            self._awaiting.add(m.stream_id)
        self._on_request(self, m.stream_id, req)


# ----------------------------------------------------------------- the runtime


class _Plugin:
    """One plugin connection's registration state."""

    def __init__(self, conn: PeerConnection) -> None:
        self.conn = conn
        self.name = ""
        self.idx = ""
        self.info: PluginInfo | None = None
        self.ready = threading.Event()
        self.state_change_fallback = False


class FakeNriRuntime:
    """The runtime end of NRI, listening on ``socket_path``; calls return the
    plugin's ``RpcError`` instead of raising it.

    Args:
        socket_path: where to listen (a stale file is removed first).
        nri_version: "v0.12.2" (dedicated event RPCs, ValidEvents 0x3FFF) or
            e.g. "v0.8.0" (StateChange events, ValidEvents 0x7FF).
        runtime_name, runtime_version, config: sent in ConfigureRequest.
        request_timeout_ms / registration_timeout_ms: sent in
            ConfigureRequest (ms); the request timeout also bounds every call
            made here, and a call that exceeds it closes the connection.
        initial_sync: ``(pods, containers)`` to Synchronize right after every
            Configure (what a real runtime does with its running containers);
            None leaves synchronizing to ``synchronize()``.
        max_read_frame: the mux frame size the runtime can read (bytes).
        configure_before_register_reply: call Configure and wait for its
            answer *before* answering RegisterPlugin (a plugin whose reader
            blocks on its own register reply deadlocks here).
        listen: False to skip the listener (use ``adopt`` with a socketpair,
            like a runtime that launched the plugin with fd 3).
    Raises OSError when the socket cannot be created.
    """

    label = "fake-runtime"

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
        max_read_frame: int | None = 4096,
        configure_before_register_reply: bool = False,
        listen: bool = True,
    ) -> None:
        self.socket_path = str(socket_path)
        self.nri_version = nri_version
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self.request_timeout_s = request_timeout_ms / 1000.0
        self.registration_timeout_s = registration_timeout_ms / 1000.0
        self.config = config
        self.initial_sync = initial_sync
        self.max_read_frame = max_read_frame
        self.configure_before_register_reply = configure_before_register_reply
        self.valid_events = valid_events(nri_version)
        self.registrations: list[PluginInfo] = []
        """Every successful registration, in order."""
        self.unsolicited: list[Any] = []
        """UpdateContainersRequests the plugin sent, in order."""
        self.calls: list[str] = []
        """Plugin-service methods called, in order (StateChange as 'StateChange:<event>')."""
        self.skipped: list[str] = []
        """Pod and container events not sent: the plugin did not subscribe them (method names, in order)."""
        self.register_refusals: list[str] = []
        """RegisterPlugin requests refused (bad name or index), their messages."""
        self.sync_updates: list[Any] = []
        """The ContainerUpdates the plugin answered to the last initial Synchronize."""
        self.connections = 0
        """Plugin connections accepted so far."""
        self.disconnects = 0
        """Current plugin connections that closed."""
        self._cond = threading.Condition()
        self._plugin: _Plugin | None = None
        self._closed = False
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        if listen:
            self.start()

    # ---- lifecycle
    def start(self) -> "FakeNriRuntime":
        """Create the socket and accept plugins in the background. Raises OSError."""
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.socket_path)
        s.listen(8)
        self._listener = s
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"{self.label}-accept", daemon=True)
        self._accept_thread.start()
        return self

    def close(self) -> None:
        """Close the plugin connection and the listener; remove the socket
        file when this runtime created it. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            plugin = self._plugin
            self._cond.notify_all()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if plugin is not None:
            plugin.conn.close("runtime shutting down")
            plugin.conn.join(2.0)
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

    def adopt(self, sock: socket.socket) -> bool:
        """Serve a plugin on an already connected socket (one end of a
        socketpair whose other end the plugin got as fd 3). It replaces the
        current connection. Returns False when the runtime is closed (the
        socket is closed then)."""
        with self._cond:
            if self._closed:
                sock.close()
                return False
            old = self._plugin
            self.connections += 1
            n = self.connections
        if old is not None:
            old.conn.close("replaced by a new plugin connection")
        conn = PeerConnection(sock, on_request=self._on_request, on_closed=self._on_closed,
                              max_read_frame=self.max_read_frame, label=f"{self.label}-{n}")
        with self._cond:
            self._plugin = _Plugin(conn)
            self._cond.notify_all()
        conn.start()
        return True

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not self.adopt(sock):
                return

    # ---- observing
    @property
    def request_timeout_ms(self) -> int:
        return int(round(self.request_timeout_s * 1000))

    @property
    def registration_timeout_ms(self) -> int:
        return int(round(self.registration_timeout_s * 1000))

    @property
    def timeout_s(self) -> float:
        """The request timeout, seconds."""
        return self.request_timeout_s

    @property
    def transport(self) -> PeerConnection | None:
        """The current (or last) plugin connection; None before any."""
        with self._cond:
            return self._plugin.conn if self._plugin else None

    @property
    def plugin(self) -> PluginInfo | None:
        """The registered plugin of the open connection, or None."""
        with self._cond:
            p = self._plugin
            return p.info if p is not None and self._ready(p) else None

    def wait_registered(self, timeout_s: float = 10.0) -> PluginInfo:
        """Block until a plugin registered, was configured and (with
        ``initial_sync``) synchronized, on a still open connection.
        Raises TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready(self._plugin), scaled(timeout_s)):
                raise TimeoutError(f"no NRI plugin registered on {self.socket_path} within {scaled(timeout_s):g} s")
            p = self._plugin
            assert p is not None and p.info is not None
            return p.info

    def wait_disconnected(self, timeout_s: float = 10.0) -> str | None:
        """Wait until the current plugin connection is closed; returns its
        close reason (None when there was no connection). Raises TimeoutError."""
        t = self.transport
        if t is None:
            return None
        if not t.closed.wait(scaled(timeout_s)):
            raise TimeoutError("plugin connection still open")
        return t.close_reason

    # ---- driving the plugin
    def set_sync_state(self, pods: Sequence[Any], containers: Sequence[Any]) -> None:
        """What the next Synchronize (after a (re)connection) carries."""
        self.initial_sync = (list(pods), list(containers))

    def create_container(self, pod: Any, container: Any) -> Any:
        """CreateContainer: the plugin's ContainerAdjustment (empty when it
        left the container alone), or the RpcError it answered. Raises
        ConnectionClosed / TimeoutError (the connection is closed then)."""
        out = _answer(self._call, "CreateContainer", nri_pb2.CreateContainerRequest(pod=pod, container=container),
                      nri_pb2.CreateContainerResponse)
        return out if isinstance(out, RpcError) else out.adjust

    def update_container(self, pod: Any, container: Any) -> Any:
        """UpdateContainer: the plugin's ContainerUpdates, or its RpcError."""
        out = _answer(self._call, "UpdateContainer", nri_pb2.UpdateContainerRequest(pod=pod, container=container),
                      nri_pb2.UpdateContainerResponse)
        return out if isinstance(out, RpcError) else list(out.update)

    def stop_container(self, pod: Any, container: Any) -> Any:
        """StopContainer: the plugin's ContainerUpdates, or its RpcError."""
        out = _answer(self._call, "StopContainer", nri_pb2.StopContainerRequest(pod=pod, container=container),
                      nri_pb2.StopContainerResponse)
        return out if isinstance(out, RpcError) else list(out.update)

    def remove_container(self, pod: Any, container: Any) -> RpcError | None:
        """RemoveContainer (dedicated RPC on v0.12, StateChange on v0.8)."""
        return _answer(self._event, "RemoveContainer", pod, container)

    def start_container(self, pod: Any, container: Any) -> RpcError | None:
        """StartContainer (dedicated RPC on v0.12, StateChange on v0.8)."""
        return _answer(self._event, "StartContainer", pod, container)

    def run_pod_sandbox(self, pod: Any) -> RpcError | None:
        """RunPodSandbox (dedicated RPC on v0.12, StateChange on v0.8; not sent unless subscribed)."""
        return _answer(self._event, "RunPodSandbox", pod, None)

    def stop_pod_sandbox(self, pod: Any) -> RpcError | None:
        return _answer(self._event, "StopPodSandbox", pod, None)

    def remove_pod_sandbox(self, pod: Any) -> RpcError | None:
        """RemovePodSandbox (dedicated RPC on v0.12, StateChange on v0.8; not sent unless subscribed)."""
        return _answer(self._event, "RemovePodSandbox", pod, None)

    def synchronize(self, pods: Sequence[Any], containers: Sequence[Any], *, parts: int = 1) -> list[Any]:
        """Send Synchronize, split into ``parts`` messages (all but the last
        with ``more = true``; the plugin must answer those ``{more: true}``).
        Returns the plugin's ContainerUpdates. Raises RpcError /
        ConnectionClosed / TimeoutError / AssertionError (a split answered
        wrongly: the connection is closed then)."""
        return self._synchronize(self._current(), pods, containers, parts)

    def call_raw(self, service: str, method: str, payload: bytes, timeout_s: float | None = None) -> w.Response:
        """Any request on the Plugin conn; returns the plugin's ttrpc
        ``Response`` (``code``, ``message``, ``payload``, ``ok``)."""
        t = self._current().conn
        fut = t.call_async(service, method, payload, timeout_nano=int(self.timeout_s * 1e9))
        return fut.result(timeout_s or self.timeout_s)

    def disconnect(self) -> None:
        """Close the current plugin connection (the listener stays)."""
        t = self.transport
        if t is not None:
            t.close("runtime closed the plugin connection")
            t.join(2.0)

    # ---- internals
    @staticmethod
    def _ready(p: _Plugin | None) -> bool:
        return p is not None and p.ready.is_set() and not p.conn.closed.is_set()

    def _current(self) -> _Plugin:
        with self._cond:
            p = self._plugin
        if p is None or not self._ready(p):
            raise ConnectionClosed(f"no NRI plugin is registered on {self.socket_path}")
        return p

    def _on_closed(self, conn: PeerConnection, reason: str) -> None:
        with self._cond:
            if self._plugin is not None and self._plugin.conn is conn:
                self.disconnects += 1
            self._cond.notify_all()
        log.debug("%s: plugin connection closed: %s", self.label, reason)

    def _on_request(self, conn: PeerConnection, stream_id: int, req: w.Request) -> None:
        # Reader thread: answer at once, never wait for the plugin.
        with self._cond:
            p = self._plugin
        if p is None or p.conn is not conn:
            conn.respond_error(stream_id, Code.UNAVAILABLE, "connection replaced")
        elif req.service != RUNTIME_SERVICE:
            conn.respond_error(stream_id, Code.UNIMPLEMENTED, f"service {req.service}")
        elif req.method not in ("RegisterPlugin", "UpdateContainers"):
            conn.respond_error(stream_id, Code.UNIMPLEMENTED, f"method {req.method}")
        elif req.method == "RegisterPlugin":
            try:
                reg = nri_pb2.RegisterPluginRequest.FromString(req.payload)
            except DecodeError as exc:
                conn.respond_error(stream_id, Code.INVALID_ARGUMENT, f"unmarshal RegisterPluginRequest: {exc}")
                return
            self._register(p, stream_id, reg)
        else:
            try:
                msg = nri_pb2.UpdateContainersRequest.FromString(req.payload)
            except DecodeError as exc:
                conn.respond_error(stream_id, Code.INVALID_ARGUMENT, f"unmarshal UpdateContainersRequest: {exc}")
                return
            with self._cond:
                self.unsolicited.append(msg)
            conn.respond(stream_id, nri_pb2.UpdateContainersResponse().SerializeToString())

    def _register(self, p: _Plugin, stream_id: int, req: Any) -> None:
        problem = None
        if not _PLUGIN_IDX.fullmatch(req.plugin_idx):
            problem = f"invalid plugin index {req.plugin_idx!r}, must be 2 digits"
        elif self.valid_events == VALID_EVENTS_V012 and not _PLUGIN_NAME.fullmatch(req.plugin_name):
            problem = f"invalid plugin name {req.plugin_name!r}"
        if problem:
            with self._cond:
                self.register_refusals.append(problem)
            p.conn.respond_error(stream_id, Code.UNKNOWN, problem)  # a plain Go error: UNKNOWN
            return
        p.name, p.idx = req.plugin_name, req.plugin_idx
        if self.configure_before_register_reply:
            threading.Thread(target=self._setup, args=(p, stream_id), name=f"{self.label}-configure",
                             daemon=True).start()
        else:
            p.conn.respond(stream_id, b"")
            threading.Thread(target=self._setup, args=(p,), name=f"{self.label}-setup", daemon=True).start()

    def _setup(self, p: _Plugin, register_stream: int | None = None) -> None:
        """Configure, check the event mask, Synchronize ``initial_sync``; then
        mark the plugin ready. ``register_stream``: a RegisterPlugin still
        unanswered, answered once Configure returned. Any failure closes the
        connection."""
        try:
            req = nri_pb2.ConfigureRequest(
                config=self.config, runtime_name=self.runtime_name, runtime_version=self.runtime_version,
                registration_timeout=self.registration_timeout_ms, request_timeout=self.request_timeout_ms,
                NRI_version=self.nri_version)
            resp = self._call_on(p, "Configure", req, nri_pb2.ConfigureResponse)
            if register_stream is not None:
                p.conn.respond(register_stream, b"")
            events = resp.events or self.valid_events  # 0: everything
            if events & ~self.valid_events:
                raise RpcError(Code.INVALID_ARGUMENT, f"invalid plugin events: 0x{events & ~self.valid_events:x}")
            p.info = PluginInfo(p.name, p.idx, events)
            if self.initial_sync is not None:
                self.sync_updates = self._synchronize(p, self.initial_sync[0], self.initial_sync[1], 1)
        except Exception as exc:
            log.warning("%s: closing plugin %s: %s", self.label, p.name, exc)
            p.conn.close(f"plugin setup failed: {exc}")
            return
        with self._cond:
            self.registrations.append(p.info)
            p.ready.set()
            self._cond.notify_all()

    def _synchronize(self, p: _Plugin, pods: Sequence[Any], containers: Sequence[Any], parts: int) -> list[Any]:
        parts = max(1, parts)
        pod_chunks = [list(pods[i::parts]) for i in range(parts)]
        ctr_chunks = [list(containers[i::parts]) for i in range(parts)]
        resp: Any = None
        for i in range(parts):
            more = i < parts - 1
            req = nri_pb2.SynchronizeRequest(pods=pod_chunks[i], containers=ctr_chunks[i], more=more)
            resp = self._call_on(p, "Synchronize", req, nri_pb2.SynchronizeResponse)
            if more and not (resp.more and not resp.update):
                p.conn.close("plugin does not handle split sync requests")
                raise AssertionError("plugin does not handle split sync requests")
        return list(resp.update)

    def _call(self, method: str, req: Any, resp_cls: Any) -> Any:
        return self._call_on(self._current(), method, req, resp_cls)

    def _call_on(self, p: _Plugin, method: str, req: Any, resp_cls: Any) -> Any:
        label = method if method != "StateChange" else f"StateChange:{nri_pb2.Event.Name(req.event)}"
        with self._cond:
            self.calls.append(label)
        try:
            payload = p.conn.call(PLUGIN_SERVICE, method, req.SerializeToString(), self.request_timeout_s)
        except TimeoutError:
            p.conn.close(f"{method} timed out")  # deadline exceeded is fatal (docs/reference/nri-protocol.md 1.8)
            raise TimeoutError(f"{method}: plugin did not answer within {self.request_timeout_s} s") from None
        return resp_cls.FromString(payload)

    def _event(self, method: str, pod: Any, container: Any) -> None:
        p = self._current()
        events = p.info.events if p.info is not None else self.valid_events
        if not events & (1 << (STATE_CHANGE_EVENTS[method] - 1)):
            with self._cond:
                self.skipped.append(method)  # not subscribed: the adaptation skips this plugin
            return
        if not (self.valid_events == VALID_EVENTS_V08 or p.state_change_fallback):
            cls = getattr(nri_pb2, method + "Request")
            req = cls(pod=pod) if container is None else cls(pod=pod, container=container)
            try:
                self._call_on(p, method, req, getattr(nri_pb2, method + "Response"))
                return
            except RpcError as exc:
                if exc.code != Code.UNIMPLEMENTED:
                    raise
                p.state_change_fallback = True  # sticky, like the v0.12 adaptation
        ev = nri_pb2.StateChangeEvent(event=STATE_CHANGE_EVENTS[method], pod=pod)
        if container is not None:
            ev.container.CopyFrom(container)
        self._call_on(p, "StateChange", ev, nri_pb2.Empty)


def _answer(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, with the plugin's RpcError returned instead of raised."""
    try:
        return call(*args)
    except RpcError as exc:
        return exc


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
    containerd's ``io.kubernetes.cri.*`` keys (docs/reference/nri-protocol.md 1.11)."""
    uid = uid or f"uid-{namespace}-{name}"
    pod_id = pod_id or f"sandbox-{uid}"
    ann = dict(annotations or {})
    ann.update({
        "io.kubernetes.cri.container-type": "sandbox",
        "io.kubernetes.cri.sandbox-id": pod_id,
        "io.kubernetes.cri.sandbox-name": name,
        "io.kubernetes.cri.sandbox-namespace": namespace,
        "io.kubernetes.cri.sandbox-uid": uid,
    })
    return nri_pb2.PodSandbox(id=pod_id, name=name, uid=uid, namespace=namespace, labels=dict(labels or {}),
                              annotations=ann)


def make_container(
    pod: Any,
    name: str,
    *,
    container_id: str = "",
    env: Mapping[str, str] | Iterable[str] | None = None,
    state: Any = 0,
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
    file path such as ``examples/pods/*.yaml``). Container env comes from
    ``spec.containers[].env[].value``."""
    if isinstance(manifest, Mapping):
        doc: Mapping[str, Any] = manifest
    else:
        import yaml

        doc = yaml.safe_load(Path(manifest).read_text())
    meta = doc.get("metadata", {})
    pod = make_pod(
        meta.get("name", "pod"),
        meta.get("namespace", "default"),
        meta.get("uid", ""),
        {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
        pod_id=pod_id,
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
    )
    containers = []
    for c in doc.get("spec", {}).get("containers", []):
        env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        env += [f"{e['name']}={e.get('value', '')}" for e in c.get("env") or [] if "name" in e]
        containers.append(make_container(pod, c["name"], env=env))
    return pod, containers


def effective_env(container: Any, adjustment: Any) -> dict[str, str]:
    """The env a container ends up with: its own, then the adjustment's (set
    by value; ``-KEY`` removals are not applied to spec env, as the runtime's
    merge does not forward them: docs/reference/nri-protocol.md 1.8)."""
    env: dict[str, str] = {}
    for kv in container.env:
        k, _, v = kv.partition("=")
        env[k] = v
    for kv in adjustment.env:
        if not kv.key.startswith("-"):
            env[kv.key] = kv.value
    return env
