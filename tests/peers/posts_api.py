"""A fake API server that records what the daemon POSTs (Events, pod
evictions) and answers each POST 201 with its body; anything else is 501.
Nothing from ``fracplugin``.

``Api(root)`` serves on 127.0.0.1:<free port> and writes ``root/kubeconfig``
naming it; ``posted`` lists (path, body) in order; ``events(reason)`` and
``evictions()`` select from it; ``close()`` stops it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["Api"]


class Api:
    """A fake API server: answers every POST with its body and records (path, body)."""

    def __init__(self, root: Path) -> None:
        self.posted: list[tuple[str, dict[str, Any]]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.posted.append((self.path, body))
                out = json.dumps(body).encode()
                self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.kubeconfig = root / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{self.httpd.server_address[1]}"}}],
            "users": [{"name": "t", "user": {"token": "x"}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))

    def events(self, reason: str) -> list[dict[str, Any]]:
        """The Events posted with ``reason``, in order."""
        return [b for p, b in self.posted if p.endswith("/events") and b.get("reason") == reason]

    def evictions(self) -> list[tuple[str, dict[str, Any]]]:
        """(path, body) of every pod eviction posted, in order."""
        return [(p, b) for p, b in self.posted if p.endswith("/eviction")]

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()
