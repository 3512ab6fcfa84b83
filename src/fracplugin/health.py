"""HTTP health and status endpoint of the daemon: ``/healthz``, ``/readyz``, ``/status``.

- ``GET /healthz``: 200 ``ok`` while the process is alive and not shutting
  down (liveness probe); 503 with the reason otherwise.
- ``GET /readyz``: 200 when every enabled part is ready (NRI synchronized,
  device plugin registered, MPS healthy), else 503; the body is JSON
  ``{"ready": bool, "checks": {part: {"ready": bool, "detail": str}}}``.
- ``GET /status``: 200, the daemon's status document as JSON (what
  ``fracplugin status`` prints).
- ``POST /simulate/xid`` (only when the server is given ``simulate_xid``,
  which the daemon does with ``--simulate-node`` and never with NVML; 404
  otherwise): body ``{"gpu_uuid": str, "xid": int}`` (JSON object, at most
  4096 bytes, no other keys; xid in 1..2**32-1, NVML's event data is
  unsigned) queues that XID on the simulated GPU, as NVML's event set would
  deliver it. 202 ``{"injected": {...}}``; 400 with the reason for a bad
  body; 404 for a GPU the node does not have; 411/413 for a missing or too
  large body; 405 for other methods on the path. Tests and demos use it to
  drive the XID health path (issue 4 item 3) from outside the process.

Concurrency: ``http.server.ThreadingHTTPServer`` serving on its own thread,
one short-lived thread per request (daemon threads). The callbacks it is
given are called from those threads and must be thread-safe and quick.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

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
_XID_USAGE = 'expected a JSON object {"gpu_uuid": "<GPU UUID>", "xid": <positive integer>}'


class BadRequest(ValueError):
    """A request the health server answers with ``code`` (4xx) and the message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_xid_body(body: bytes) -> tuple[str, int]:
    """Validate a ``POST /simulate/xid`` body: returns (gpu_uuid, xid).

    Raises:
        BadRequest(400): not UTF-8 JSON, not an object, unknown keys, a
            missing/empty/non-string ``gpu_uuid``, or an ``xid`` that is not an
            integer in 1..2**32-1 (booleans and floats are refused).
    """
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(400, f"body is not valid JSON ({exc}); {_XID_USAGE}") from None
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
        OSError from ``start`` when the address cannot be bound.
    """

    def __init__(self, address: str, checks: ReadyFn, status: Callable[[], Mapping[str, Any]],
                 alive: Callable[[], str | None] = lambda: None,
                 simulate_xid: SimulateXidFn | None = None) -> None:
        self._address = parse_address(address)
        self._simulate_xid = simulate_xid
        self._checks = checks
        self._status = status
        self._alive = alive
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def bound(self) -> tuple[str, int]:
        """(host, port) actually bound; raises RuntimeError before ``start``."""
        if self._server is None:
            raise RuntimeError("health server not started")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def readiness(self) -> dict[str, Any]:
        """``{"ready": bool, "checks": {...}}`` (the /readyz body)."""
        checks = {k: dict(v) for k, v in self._checks().items()}
        return {"ready": all(bool(c.get("ready")) for c in checks.values()), "checks": checks}

    def start(self) -> tuple[str, int]:
        """Bind and serve on a daemon thread; returns the bound (host, port)."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "fracplugin"
            timeout = 10.0  # seconds a client may take to send its request (no thread is held for good)

            def log_message(self, fmt: str, *args: Any) -> None:  # keep access logs at debug
                log.debug("health http: " + fmt, *args)

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, code: int, doc: Any) -> None:
                self._send(code, (json.dumps(doc, indent=1, default=str) + "\n").encode(), "application/json")

            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                try:
                    if path == "/healthz":
                        reason = outer._alive()
                        if reason is None:
                            self._send(200, b"ok\n", "text/plain")
                        else:
                            self._send(503, f"not alive: {reason}\n".encode(), "text/plain")
                    elif path == "/readyz":
                        r = outer.readiness()
                        self._json(200 if r["ready"] else 503, r)
                    elif path == "/status":
                        self._json(200, outer._status())
                    elif path == "/simulate/xid" and outer._simulate_xid is not None:
                        self._text(405, "/simulate/xid answers POST only", {"Allow": "POST"})
                    else:
                        self._send(404, b"not found: try /healthz, /readyz, /status\n", "text/plain")
                except Exception as exc:  # a broken callback answers 500, never kills the server
                    log.exception("health endpoint %s failed", path)
                    self._send(500, f"internal error: {exc}\n".encode(), "text/plain")

            do_HEAD = do_GET

            def _text(self, code: int, msg: str, headers: Mapping[str, str] | None = None) -> None:
                body = (msg.rstrip("\n") + "\n").encode()
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

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

            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                try:
                    if path == "/simulate/xid" and outer._simulate_xid is not None:
                        uuid, xid = parse_xid_body(self._read_body())
                        try:
                            outer._simulate_xid(uuid, xid)
                        except LookupError as exc:
                            self._text(404, f"unknown GPU: {exc.args[0] if exc.args else exc}")
                            return
                        log.warning("simulated XID %d injected on %s", xid, uuid,
                                    extra={"gpu_uuid": uuid, "xid": xid, "client": self.client_address[0]})
                        self._json(202, {"injected": {"gpu_uuid": uuid, "xid": xid}})
                    elif path in _GET_PATHS:
                        self._text(405, f"{path} answers GET and HEAD only", {"Allow": "GET, HEAD"})
                    elif path == "/simulate/xid":
                        self._text(404, "not found: /simulate/xid exists only on a simulated node (--simulate-node)")
                    else:
                        self._text(404, "not found")
                except BadRequest as exc:
                    self._text(exc.code, f"bad request: {exc}" if exc.code == 400 else str(exc))
                except Exception as exc:  # a broken callback answers 500, never kills the server
                    log.exception("health endpoint POST %s failed", path)
                    self._text(500, f"internal error: {exc}")

            def _other_method(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                if path == "/simulate/xid" and outer._simulate_xid is not None:
                    self._text(405, "/simulate/xid answers POST only", {"Allow": "POST"})
                elif path in _GET_PATHS:
                    self._text(405, f"{path} answers GET and HEAD only", {"Allow": "GET, HEAD"})
                else:
                    self._text(404, "not found")

            do_PUT = do_DELETE = do_PATCH = _other_method

        server_cls = ThreadingHTTPServer
        if ":" in self._address[0]:  # an IPv6 literal ([::]:8080)
            server_cls = type("ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        server = server_cls(self._address, Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health-http", daemon=True)
        self._thread.start()
        return self.bound

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop serving and close the socket (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)
