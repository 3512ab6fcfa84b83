"""HTTP health and status endpoint of the daemon: ``/healthz``, ``/readyz``, ``/status``.

- ``GET /healthz``: 200 ``ok`` while the process is alive and not shutting
  down (liveness probe); 503 with the reason otherwise.
- ``GET /readyz``: 200 when every enabled part is ready (NRI synchronized,
  device plugin registered, MPS healthy), else 503; the body is JSON
  ``{"ready": bool, "checks": {part: {"ready": bool, "detail": str}}}``.
- ``GET /status``: 200, the daemon's status document as JSON (what
  ``fracplugin status`` prints).

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


class HealthServer:
    """The health/status HTTP server.

    Args:
        address: ``HOST:PORT`` to bind (port 0 = any free port; empty host = all interfaces).
        checks: readiness checks, see ``ReadyFn``.
        status: returns the JSON-able status document.
        alive: returns None when live, or the reason the daemon is not (e.g. "shutting down").
    Raises:
        OSError from ``start`` when the address cannot be bound.
    """

    def __init__(self, address: str, checks: ReadyFn, status: Callable[[], Mapping[str, Any]],
                 alive: Callable[[], str | None] = lambda: None) -> None:
        self._address = parse_address(address)
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
                    else:
                        self._send(404, b"not found: try /healthz, /readyz, /status\n", "text/plain")
                except Exception as exc:  # a broken callback answers 500, never kills the server
                    log.exception("health endpoint %s failed", path)
                    self._send(500, f"internal error: {exc}\n".encode(), "text/plain")

            do_HEAD = do_GET

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
