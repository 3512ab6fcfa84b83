"""HTTP health and status endpoint of the daemon: ``/healthz``, ``/readyz``, ``/status``.

- ``GET /healthz``: 200 ``ok`` while the process is alive and not shutting
  down (liveness probe); 503 with the reason otherwise.
- ``GET /readyz``: 200 when every enabled part is ready (NRI synchronized,
  device plugin registered, MPS healthy), else 503; the body is JSON
  ``{"ready": bool, "checks": {part: {"ready": bool, "detail": str}}}``.
- ``GET /status``: 200, the daemon's status document as JSON (what
  ``fracplugin status`` prints), to loopback clients only: it names every
  tenant (namespace, pod, UID, container ID) and the configuration, so any
  other peer (another pod) gets 404 with the reason (issue 13 item 2,
  docs/adr/0008-least-privilege-daemonset.md).
- ``POST /simulate/xid`` (only when the server is given ``simulate_xid``,
  which the daemon does with ``--simulate-node`` and never with NVML; 404
  otherwise): body ``{"gpu_uuid": str, "xid": int}`` (JSON object, at most
  4096 bytes, no other keys; xid in 1..2**32-1, NVML's event data is
  unsigned) queues that XID on the simulated GPU, as NVML's event set would
  deliver it. 202 ``{"injected": {...}}``; 400 with the reason for a bad
  body; 404 for a GPU the node does not have; 411/413 for a missing or too
  large body; 405 for other methods on the path. Tests and demos use it to
  drive the XID health path (issue 4 item 3) from outside the process.

``BoundedHTTPServer`` and ``BoundedHandler`` are the bounded server that every
listening HTTP surface of the daemon uses (``/metrics`` too: metrics.py).

Concurrency: ``BoundedHTTPServer`` serving on its own thread, one short-lived thread per connection, at most
``MAX_HANDLERS`` at once, each request within ``REQUEST_DEADLINE_S`` in all. The callbacks it is given are
called from the handler threads and must be thread-safe and quick.
"""

from __future__ import annotations

import contextlib
import errno
import io
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

from .config import parse_address

log = logging.getLogger(__name__)

ReadyFn = Callable[[], Mapping[str, Mapping[str, Any]]]
"""Returns {part: {"ready": bool, "detail": str}} for the enabled parts."""

SimulateXidFn = Callable[[str, int], None]
"""Queues XID ``xid`` on GPU ``gpu_uuid``; raises LookupError for a GPU the
node does not have (the server answers 404 with the message)."""

MAX_BODY = 4096
"""Largest request body (bytes) the health server reads."""

XID_MAX = 2**32 - 1
_GET_PATHS = ("/healthz", "/readyz", "/status")
STATUS_NOT_HERE = ("not found: /status names every tenant of the node and is served only to loopback clients "
                   "(run `fracplugin status` inside the daemon's pod)\n")
_XID_USAGE = 'expected a JSON object {"gpu_uuid": "<GPU UUID>", "xid": <positive integer>}'


REQUEST_DEADLINE_S = 10.0
"""Seconds a client has to send one whole request (line, headers, body)."""

MAX_HANDLERS = 32
"""Most concurrent handler threads of the health server."""

RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""errnos that mean this process (or the node) ran out of a resource, not that
the peer misbehaved: never a reason to give up on a part (issue 13 item 1)."""

_ACCEPT_ERROR_PAUSE_S = 0.05
"""Pause after an accept() that failed for lack of file descriptors."""

_SLOT_WAIT_S = 0.5
"""How long a new connection waits for a handler slot after evicting a slow one."""


class _DeadlineReader(io.RawIOBase):
    """The handler's socket as a raw stream whose every read gets only the time
    left before the handler's ``deadline`` (whole-request deadline, not a
    per-recv timeout). Raises TimeoutError past the deadline, which
    ``BaseHTTPRequestHandler.handle_one_request`` turns into a dropped
    connection."""

    def __init__(self, handler: Any) -> None:
        super().__init__()
        self._h = handler

    def readable(self) -> bool:
        return True

    def readinto(self, b: WriteableBuffer) -> int:
        left = self._h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not received within {self._h.server.request_deadline_s:g} s")
        sock: socket.socket = self._h.connection
        sock.settimeout(left)
        try:
            return sock.recv_into(b)
        finally:
            sock.settimeout(self._h.timeout)  # writes get the per-send timeout


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most ``max_handlers`` handler threads.

    A connection arriving with every slot busy first evicts the handler that
    has been waiting longest for its request (slowloris clients, idle
    keep-alive connections: shut down, so its read ends), then waits up to
    ``_SLOT_WAIT_S`` for a slot; with none it is closed unanswered. A probe's
    quick request therefore always finds a slot. ``handle_error`` logs through
    the module logger (never a bare traceback on stderr); a client that went
    away is DEBUG.
    """

    daemon_threads = True
    request_queue_size = 128  # listen backlog: a burst of connections is queued, not SYN-dropped (1 s retry)

    def __init__(self, address: Any, handler: Any, *, max_handlers: int, request_deadline_s: float,
                 label: str = "health http") -> None:
        self.label = label
        self.request_deadline_s = request_deadline_s
        self.max_handlers = max_handlers
        self._slots = threading.BoundedSemaphore(max_handlers)
        self.lock = threading.Lock()
        self._reading: dict[Any, float] = {}  # socket -> when it began waiting for a request
        self._evicted: set[Any] = set()
        self.active = self.peak = self.evicted = self.refused = self.accept_errors = 0
        self.thread: threading.Thread | None = None  # set by ``serve``
        super().__init__(address, handler)

    def reading(self, conn: Any, on: bool) -> None:
        """Mark connection ``conn`` as waiting for its request (evictable) or not."""
        with self.lock:
            if on:
                self._reading[conn] = time.monotonic()
            else:
                self._reading.pop(conn, None)

    def was_evicted(self, conn: Any) -> bool:
        with self.lock:
            return conn in self._evicted

    def _evict_oldest_reader(self) -> None:
        with self.lock:
            if not self._reading:
                return
            conn = min(self._reading, key=self._reading.__getitem__)
            del self._reading[conn]
            self._evicted.add(conn)
            self.evicted += 1
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        log.debug("%s: all %d handler slots busy; dropped the request waiting longest", self.label, self.max_handlers)

    def get_request(self) -> Any:
        """``accept()``; out of file descriptors (EMFILE/ENFILE) or memory, it
        evicts the oldest idle connection to free one, counts ``accept_errors``,
        pauses ``_ACCEPT_ERROR_PAUSE_S`` (the listening socket stays readable:
        no busy loop) and re-raises (socketserver drops the attempt)."""
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                with self.lock:
                    self.accept_errors += 1
                    n = self.accept_errors
                if n == 1 or n % 1000 == 0:
                    log.warning("%s: accept failed (%s); evicting the oldest idle connection (%d such errors)",
                                self.label, errno.errorcode.get(exc.errno or 0, exc), n)
                self._evict_oldest_reader()
                time.sleep(_ACCEPT_ERROR_PAUSE_S)
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._evict_oldest_reader()
            if not self._slots.acquire(timeout=_SLOT_WAIT_S):
                with self.lock:
                    self.refused += 1
                log.debug("%s: all %d handler slots busy; closed the connection from %s",
                          self.label, self.max_handlers, client_address[0])
                self.shutdown_request(request)
                return
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
            self._reading[request] = time.monotonic()  # evictable until its headers are in
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def _release(self, request: Any) -> None:
        with self.lock:
            self.active -= 1
            self._reading.pop(request, None)
            self._evicted.discard(request)
        self._slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    @property
    def bound(self) -> tuple[str, int]:
        """(host, port) actually bound."""
        host, port = self.server_address[:2]
        return str(host), int(port)

    def close(self, timeout_s: float) -> None:
        """Stop serving, close the listening socket and join the serving thread."""
        self.shutdown()
        self.server_close()
        if self.thread is not None:
            self.thread.join(timeout_s)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("%s: connection from %s ended: %r", self.label, client_address[0], exc)
        else:
            log.error("%s: request from %s failed", self.label, client_address[0], exc_info=True)


class BoundedHandler(BaseHTTPRequestHandler):
    """Request handler for a ``BoundedHTTPServer``: the whole-request deadline
    on reads (``_DeadlineReader``), evictable while it waits for a request line
    and headers, access log at DEBUG. Subclasses add ``do_GET`` etc."""

    server_version = "fracplugin"
    timeout = 10.0  # seconds one send may block (the read side has the whole-request deadline)
    server: "BoundedHTTPServer"

    def setup(self) -> None:
        super().setup()
        self.deadline = time.monotonic() + self.server.request_deadline_s
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle_one_request(self) -> None:
        # One deadline for the request line, headers and body of each request.
        self.deadline = time.monotonic() + self.server.request_deadline_s
        self.server.reading(self.connection, True)
        try:
            super().handle_one_request()
        finally:
            self.server.reading(self.connection, False)

    def send_body(self, code: int, body: bytes, ctype: str, headers: Mapping[str, str] | None = None) -> None:
        """Answer ``code`` with ``body`` (bytes, ``Content-Type: ctype``) and
        ``headers``; no body for HEAD. Raises OSError when the client has gone away."""
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.reading(self.connection, False)  # headers are in: no longer evictable
        if self.server.was_evicted(self.connection):  # shut down for a newer client: what we read is cut short
            self.close_connection = True
            return False
        return ok

    def log_message(self, fmt: str, *args: Any) -> None:  # keep access logs at debug
        log.debug(self.server.label + ": " + fmt, *args)

    def peer_is_loopback(self) -> bool:
        """True when the client connected from a loopback address (127.0.0.0/8,
        ::1, an IPv4-mapped loopback): a process in the daemon's own network
        namespace (``kubectl exec``), never another pod."""
        host = str(self.client_address[0]) if self.client_address else ""
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        mapped = getattr(ip, "ipv4_mapped", None)
        return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def serve(address: str, handler: type[BaseHTTPRequestHandler], *, max_handlers: int, request_deadline_s: float,
          label: str, thread_name: str) -> "BoundedHTTPServer":
    """Bind a ``BoundedHTTPServer`` on ``HOST:PORT`` (``config.parse_address``;
    empty host = all interfaces, IPv6 when the host is an IPv6 literal) and serve
    it on a daemon thread named ``thread_name`` until ``close``. Raises
    ValueError (bad address) and OSError (cannot bind)."""
    host, port = parse_address(address)
    cls: type[BoundedHTTPServer] = BoundedHTTPServer
    if ":" in host:  # an IPv6 literal ([::]:8080)
        cls = type("BoundedHTTPServer6", (BoundedHTTPServer,), {"address_family": socket.AF_INET6})
    server = cls((host or "0.0.0.0", port), handler, max_handlers=max_handlers,
                 request_deadline_s=request_deadline_s, label=label)
    server.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                     name=thread_name, daemon=True)
    server.thread.start()
    return server


class BadRequest(ValueError):
    """A request the health server answers with ``code`` (4xx) and the message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_xid_body(body: bytes) -> tuple[str, int]:
    """Validate a ``POST /simulate/xid`` body: returns (gpu_uuid, xid).

    Raises:
        BadRequest(400): not UTF-8 JSON (nesting too deep included), not an object, unknown keys, a
            missing/empty/non-string ``gpu_uuid``, or an ``xid`` that is not an
            integer in 1..2**32-1 (booleans and floats are refused).
    """
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(400, f"body is not valid JSON ({exc}); {_XID_USAGE}") from None
    except RecursionError:  # deep nesting fits in 4096 bytes ("[" * 2000)
        raise BadRequest(400, f"body is nested too deeply; {_XID_USAGE}") from None
    except Exception as exc:  # the decoder's other failures are still the body's fault
        raise BadRequest(400, f"body is not valid JSON ({type(exc).__name__}); {_XID_USAGE}") from None
    if not isinstance(doc, dict):
        raise BadRequest(400, f"body is a JSON {type(doc).__name__}; {_XID_USAGE}")
    unknown = sorted(set(doc) - {"gpu_uuid", "xid"})
    if unknown:
        raise BadRequest(400, f"unknown field(s) {', '.join(map(repr, unknown))}; {_XID_USAGE}")
    uuid = doc.get("gpu_uuid")
    if not isinstance(uuid, str) or not uuid.strip():
        raise BadRequest(400, f"gpu_uuid must be a non-empty string, got {uuid!r}; {_XID_USAGE}")
    xid = doc.get("xid")
    if isinstance(xid, bool) or not isinstance(xid, int) or not 1 <= xid <= XID_MAX:
        raise BadRequest(400, f"xid must be an integer in 1..{XID_MAX}, got {xid!r}; {_XID_USAGE}")
    return uuid.strip(), xid


class _HealthHandler(BoundedHandler):
    """The health server's handler: ``/healthz``, ``/readyz``, ``/status``,
    ``POST /simulate/xid`` and the 404/405 answers of every other method and
    path (module docstring). ``owner`` (the ``HealthServer`` whose callbacks
    answer) is set on the per-server subclass that ``HealthServer.start`` makes."""

    owner: "HealthServer"

    def _json(self, code: int, doc: Any) -> None:
        self.send_body(code, (json.dumps(doc, indent=1, default=str) + "\n").encode(), "application/json")

    def _text(self, code: int, msg: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_body(code, (msg.rstrip("\n") + "\n").encode(), "text/plain", headers)

    def _serve(self) -> None:
        """Every method: route, answer; a client gone before the reply is
        logged at DEBUG, a failing callback answers 500 (never kills the server)."""
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        simulated = path == "/simulate/xid" and self.owner._simulate_xid is not None
        try:
            if self.command in ("GET", "HEAD") and path in _GET_PATHS:
                self._get(path)
            elif simulated and self.command == "POST":
                self._inject_xid()
            elif simulated:
                self._text(405, "/simulate/xid answers POST only", {"Allow": "POST"})
            elif path in _GET_PATHS:
                self._text(405, f"{path} answers GET and HEAD only", {"Allow": "GET, HEAD"})
            elif path == "/simulate/xid" and self.command == "POST":
                self._text(404, "not found: /simulate/xid exists only on a simulated node (--simulate-node)")
            else:
                self._text(404, "not found: try /healthz, /readyz, /status" if self.command in ("GET", "HEAD")
                           else "not found")
        except BadRequest as exc:
            self._try_text(exc.code, f"bad request: {exc}" if exc.code == 400 else str(exc))
        except TimeoutError:
            raise  # the body did not arrive in time: handle_one_request drops the connection
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            self._gone(exc)
        except Exception as exc:
            log.exception("health endpoint %s %s failed", self.command, path)
            self._try_text(500, f"internal error: {exc}")

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

    def _get(self, path: str) -> None:
        if path == "/healthz":
            reason = self.owner._alive()
            if reason is None:
                self._text(200, "ok")
            else:
                self._text(503, f"not alive: {reason}")
        elif path == "/readyz":
            r = self.owner.readiness()
            self._json(200 if r["ready"] else 503, r)
        elif self.peer_is_loopback():  # /status names every tenant: this node's own processes only
            self._json(200, self.owner._status())
        else:
            self._text(404, STATUS_NOT_HERE)

    def _inject_xid(self) -> None:
        assert self.owner._simulate_xid is not None
        uuid, xid = parse_xid_body(self._read_body())
        try:
            self.owner._simulate_xid(uuid, xid)
        except LookupError as exc:
            self._text(404, f"unknown GPU: {exc.args[0] if exc.args else exc}")
            return
        log.warning("simulated XID %d injected on %s", xid, uuid,
                    extra={"gpu_uuid": uuid, "xid": xid, "client": self.client_address[0]})
        self._json(202, {"injected": {"gpu_uuid": uuid, "xid": xid}})

    def _gone(self, exc: BaseException) -> None:
        """The client went away before the reply: nothing to answer."""
        log.debug("health http: client %s gone before the reply to %s %s: %s",
                  self.client_address[0], self.command, self.path, exc)
        self.close_connection = True

    def _try_text(self, code: int, msg: str) -> None:
        """Answer an error; a client that is gone by now is logged at DEBUG."""
        try:
            self._text(code, msg)
        except OSError as exc:
            self._gone(exc)

    def _read_body(self) -> bytes:
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise BadRequest(411, "a Content-Length header is required")
        try:
            n = int(raw)
        except ValueError:
            raise BadRequest(400, f"bad Content-Length {raw!r}") from None
        if n < 0:
            raise BadRequest(400, f"bad Content-Length {raw!r}")
        if n > MAX_BODY:
            self.close_connection = True  # the unread body must not be parsed as a request
            raise BadRequest(413, f"body of {n} bytes is larger than {MAX_BODY}")
        return self.rfile.read(n)


class HealthServer:
    """The health/status HTTP server.

    Args:
        address: ``HOST:PORT`` to bind (port 0 = any free port; empty host = all interfaces).
        checks: readiness checks, see ``ReadyFn``.
        status: returns the JSON-able status document.
        alive: returns None when live, or the reason the daemon is not (e.g. "shutting down").
        simulate_xid: enables ``POST /simulate/xid`` (simulated node only),
            see ``SimulateXidFn``; None = the path answers 404.
    Raises:
        ValueError for a bad address; OSError from ``start`` when the address cannot be bound.
    """

    request_deadline_s = REQUEST_DEADLINE_S
    max_handlers = MAX_HANDLERS

    def __init__(self, address: str, checks: ReadyFn, status: Callable[[], Mapping[str, Any]],
                 alive: Callable[[], str | None] = lambda: None,
                 simulate_xid: SimulateXidFn | None = None) -> None:
        parse_address(address)
        self._address = address
        self._simulate_xid = simulate_xid
        self._checks = checks
        self._status = status
        self._alive = alive
        self._server: BoundedHTTPServer | None = None

    @property
    def bound(self) -> tuple[str, int]:
        """(host, port) actually bound; raises RuntimeError before ``start``."""
        if self._server is None:
            raise RuntimeError("health server not started")
        return self._server.bound

    def readiness(self) -> dict[str, Any]:
        """``{"ready": bool, "checks": {...}}`` (the /readyz body)."""
        checks = {k: dict(v) for k, v in self._checks().items()}
        return {"ready": all(bool(c.get("ready")) for c in checks.values()), "checks": checks}

    def start(self) -> tuple[str, int]:
        """Bind and serve on a daemon thread; returns the bound (host, port).
        Raises OSError when the address cannot be bound."""
        handler = type("HealthHandler", (_HealthHandler,), {"owner": self})
        self._server = serve(self._address, handler, max_handlers=self.max_handlers,
                             request_deadline_s=self.request_deadline_s, label="health http", thread_name="health-http")
        return self.bound

    def stats(self) -> dict[str, int]:
        """Connection counters: ``active`` handler threads now, ``peak`` (most
        at once), ``evicted`` (slow requests shut down for a newer client),
        ``refused`` (connections closed with every slot busy)."""
        srv = self._server
        if srv is None:
            return {"active": 0, "peak": 0, "evicted": 0, "refused": 0}
        with srv.lock:
            return {"active": srv.active, "peak": srv.peak, "evicted": srv.evicted, "refused": srv.refused}

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop serving and close the socket (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.close(timeout_s)
