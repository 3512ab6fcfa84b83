"""Generic NRI plugin runtime: register, configure, synchronize, serve events,
reconnect. Knows nothing about GPUs; the behaviour lives in a handler object.

Concurrency model: threads (docs/architecture.md section 1, ADR 0015): one
*run* thread connects, registers, waits for the connection to end and
reconnects with backoff (``_Reconnect``, tenacity); one *reader* thread per
connection (``transport.NriTransport``) serves a request itself when nothing
in it can wait (no handler method, or ``may_block(method)`` false), else
hands it to the handler threads (``serving._Workers``), so RegisterPlugin
never blocks the reader (Configure can arrive before the register reply,
docs/reference/nri-protocol.md section 1.6); one *watchdog* thread answers
``UNAVAILABLE`` for a handler past its budget (``BUDGET_FRACTION`` x the
request timeout or the request's ``timeout_nano``) and discards the late
result, calling the handler's optional ``abandoned(method, request,
response)``: a late reply would make the runtime drop the plugin (1.8).

Protocol rules followed (docs/reference/nri-protocol.md): external mode
connects to ``socket_path``, runtime-launched mode uses fd
``NRI_PLUGIN_SOCKET`` with ``NRI_PLUGIN_NAME`` / ``NRI_PLUGIN_IDX`` (1.5); in fd
mode EOF ends the stub, in external mode we reconnect (1.9). The
``ConfigureResponse.events`` mask is within 0x7FF (1.4). Synchronize parts with
``more = true`` are answered ``{more: true}`` and the handler sees everything
with the last part (1.6). The v0.12 event RPCs and ``StateChange`` reach the
same handler method (1.7); unknown services/methods are answered
``UNIMPLEMENTED`` "service X" / "method X" (1.3); ``Shutdown`` with Empty (1.9).

Handler: any object implementing some of the ``nri.interfaces`` Protocols
(as containerd/nri ``pkg/stub``); absent methods answer an empty response and
the subscription mask follows from the methods present (``dispatch._subscription``).
Optional hooks: ``abandoned``, ``may_block``, ``close``. A handler raises
``ttrpc.RpcError(code, message)`` to answer an error status; any other
exception is logged and answered ``INTERNAL``.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import threading
from typing import Any, Callable, Mapping

from tenacity import Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential, wait_random

from .._proto import nri_pb2
from .dispatch import (
    DEFAULT_REGISTRATION_TIMEOUT_S,
    DEFAULT_SOCKET_PATH,
    RUNTIME_SERVICE,
    Dispatcher,
    _subscription,
)
from .mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from .serving import _Server, _Session
from .transport import NriTransport
from .ttrpc import RpcError
from ..logs import guarded

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
"""Timeout of one ``connect()`` to the runtime's socket, seconds."""
_NAME_RE = re.compile(r"^[a-zA-Z0-9_.+-]+$")
_IDX_RE = re.compile(r"^[0-9]{2}$")


class _Reconnect:
    """How the stub reaches the runtime, and its backoff. In fd mode: the
    launched socket on ``fd``, once (section 1.5). Else ``socket_path``,
    retried with exponential backoff and jitter (``initial_s`` .. ``max_s``)
    until ``stop`` is set; after a session that never synchronized (a rejected
    registration, an immediate close) the next try waits a doubling penalty,
    so such a runtime cannot turn the run loop into a busy loop (section 1.9)."""

    def __init__(self, socket_path: str, fd: int | None, initial_s: float, max_s: float,
                 stop: threading.Event) -> None:
        self.socket_path = socket_path
        self.fd = fd
        self.initial_s = initial_s
        self.max_s = max_s
        self._stop = stop
        self._penalty = initial_s

    def open(self, register: Callable[[socket.socket], _Session]) -> _Session | None:
        """Connect and ``register``, retrying with backoff; None when stopping
        (or, in fd mode, when the launched socket cannot be used)."""
        if self.fd is not None:
            try:
                sock = socket.socket(fileno=self.fd)
            except OSError as exc:
                log.error("nri: cannot use the runtime's socket fd", extra={"fd": self.fd, "reason": str(exc)})
                return None
            try:
                return register(sock)
            except (ConnectionError, TimeoutError, RpcError) as exc:
                log.error("nri registration failed on the launched socket", extra={"reason": str(exc)})
                return None
        retrying = Retrying(
            retry=retry_if_exception_type((OSError, TimeoutError, RpcError)),
            wait=wait_exponential(multiplier=self.initial_s, max=self.max_s) + wait_random(0, self.initial_s),
            stop=stop_when_event_set(self._stop),
            sleep=self._pause,
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            return retrying(self._connect, register)
        except (OSError, TimeoutError, RpcError):
            return None  # stopped while retrying

    def ended(self, synchronized: bool) -> None:
        """A session ended (external mode): pause before the next try unless it synchronized."""
        if synchronized:
            self._penalty = self.initial_s
        else:
            self._stop.wait(self._penalty)
            self._penalty = min(self._penalty * 2, self.max_s)

    def _pause(self, seconds: float) -> None:
        """tenacity's sleep: the backoff pause, cut short by ``stop()``."""
        self._stop.wait(seconds)

    def _log_retry(self, state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.info(
            "nri runtime not reachable, retrying",
            extra={"socket": self.socket_path, "attempt": state.attempt_number, "reason": str(exc)},
        )

    def _connect(self, register: Callable[[socket.socket], _Session]) -> _Session:
        if self._stop.is_set():
            raise ConnectionAbortedError("stopping")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        return register(sock)


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
        events: subscription mask; default and rules: ``dispatch._subscription``.
        reconnect_initial_s / reconnect_max_s: reconnection backoff (seconds,
            exponential with jitter).
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
        reconnect_initial_s: float = 0.1,
        reconnect_max_s: float = 5.0,
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
        self._on_bound = on_bound
        self.bounds_exceeded: dict[str, int] = {"sync_parts": 0, "sync_bytes": 0, "unanswered": 0}
        """How often each bound was hit, since start."""
        self._stop_ev = threading.Event()
        self._reconnect = _Reconnect(socket_path, self.fd, reconnect_initial_s, reconnect_max_s, self._stop_ev)
        self._exited = threading.Event()
        self._session: _Session | None = None
        self._session_lock = threading.Lock()
        self._sessions = itertools.count(1)
        self._server: _Server | None = None  # the serving path, made by start()
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
        self._server = _Server(self.handler, self.plugin_name, on_bound=self._bound_hit,
                               on_synchronized=self._synchronized)
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
        if self._server is not None:
            self._server.stop()
        closer = getattr(self.handler, "close", None)
        if callable(closer):
            guarded(log, "nri handler close()", closer)
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
        return self.synchronize_count > 0

    def _synchronized(self) -> None:
        """A Synchronize exchange completed (counted before its answer leaves:
        the runtime proceeds on it)."""
        self.synchronize_count += 1

    def _bound_hit(self, bound: str) -> None:
        self.bounds_exceeded[bound] = self.bounds_exceeded.get(bound, 0) + 1
        if self._on_bound is not None:
            guarded(log, "nri on_bound callback", self._on_bound, bound)

    def connected(self) -> bool:
        """True while a connection is open and RegisterPlugin succeeded."""
        with self._session_lock:
            s = self._session
        return bool(s and s.transport and not s.transport.closed.is_set() and s.registered.is_set())

    def wait_exit(self, timeout_s: float | None = None) -> bool:
        """Block until the stub has ended (``stop()``, or EOF in fd mode)."""
        return self._exited.wait(timeout_s)

    @property
    def exited(self) -> bool:
        """True once the stub has ended."""
        return self._exited.is_set()

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
        try:
            while not self._stop_ev.is_set():
                session = self._reconnect.open(self._register)
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
                self._drop(session)
                if self.fd_mode:
                    log.info("nri runtime closed the launched plugin's socket; stopping", extra={"fd": self.fd})
                    break
                if self._stop_ev.is_set():
                    break
                self._reconnect.ended(session.synchronized)
        except Exception:
            log.exception("nri stub run loop failed")
        finally:
            self._stop_ev.set()
            if self._server is not None:
                self._server.stop(pool=False)
            self._exited.set()

    def _drop(self, session: _Session) -> None:
        with self._session_lock:
            if self._session is session:
                self._session = None

    def _register(self, sock: socket.socket) -> _Session:
        server = self._server
        assert server is not None  # made by start(), before the run thread
        session = _Session(next(self._sessions), Dispatcher(self.handler, self.events, self.plugin_name,
                                                            on_bound=self._bound_hit))
        transport = NriTransport(
            sock,
            serve_conn=PLUGIN_SERVICE_CONN,
            call_conn=RUNTIME_SERVICE_CONN,
            on_request=lambda ev: server.dispatch(session, ev),
            label=f"nri-{session.number}",
        )
        session.transport = transport
        with self._session_lock:
            self._session = session
        transport.start()
        req = nri_pb2.RegisterPluginRequest(plugin_name=self.plugin_name, plugin_idx=self.plugin_idx)
        try:
            transport.call(RUNTIME_SERVICE, "RegisterPlugin", req.SerializeToString(), DEFAULT_REGISTRATION_TIMEOUT_S)
        except BaseException:
            transport.close("registration failed")
            self._drop(session)
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
