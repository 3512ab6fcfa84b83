"""A stand-in for the API server's ``resource.k8s.io/v1`` paths the DRA door
uses, for the tests (an HTTP peer like the node condition test's fake API;
nothing from ``fracplugin``).

* ``GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>``:
  the claims in ``claims`` (keyed ``(ns, name)``), 404 otherwise;
* ``GET|PUT|DELETE /apis/resource.k8s.io/v1/resourceslices/<name>`` and
  ``POST /apis/resource.k8s.io/v1/resourceslices``: cluster-scoped
  ResourceSlices kept in ``slices`` with a ``resourceVersion`` that grows on
  each write; a PUT with a stale ``resourceVersion`` is 409, a POST of an
  existing name 409 (as the API server does);
* ``GET /api/v1/nodes/<name>``: the Node documents in ``nodes`` (the
  daemon's cordon annotation is read from its own Node), 404 otherwise;
* anything else: 404 (the daemon's pod watch and events tolerate it).

``serve(root)`` starts it on 127.0.0.1:0 and writes a kubeconfig. Shared
state is under one lock; ``wait_for`` waits on a condition of it.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from tests.helpers import scaled

__all__ = ["ResourceApi", "claim_doc"]

BASE = "/apis/resource.k8s.io/v1"
DRIVER = "gpu-memory.fracplugin.io"


def claim_doc(ns: str, name: str, uid: str, *, node: str = "gpu-node-1", device: str = "gpu-0",
              memory: str | None = "20Gi", parameters: Any = None, driver: str = DRIVER,
              extra_results: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An allocated ResourceClaim as the scheduler leaves it (one result of
    ``driver`` on ``device`` with ``consumedCapacity.memory`` = ``memory``,
    and ``parameters`` as a claim opaque config when given)."""
    result: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": node, "device": device}
    if memory is not None:
        result["consumedCapacity"] = {"memory": memory}
        result["shareID"] = f"share-{uid[:8]}"
    config = []
    if parameters is not None:
        config.append({"source": "FromClaim", "requests": ["gpu"],
                       "opaque": {"driver": driver, "parameters": parameters}})
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": ns, "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
            "status": {"allocation": {"devices": {"results": [result, *(extra_results or [])], "config": config}}}}


class ResourceApi:
    """The stand-in (module docstring)."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.cond = threading.Condition()
        self._rv = 0
        self.server: ThreadingHTTPServer | None = None

    def annotate_node(self, name: str, annotations: dict[str, str | None]) -> None:
        """Set (a None value: remove) annotations of node ``name`` (made when missing)."""
        with self.cond:
            node = self.nodes.setdefault(name, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
            have = node["metadata"].setdefault("annotations", {})
            for k, v in annotations.items():
                if v is None:
                    have.pop(k, None)
                else:
                    have[k] = v

    def wait_for(self, pred: Callable[["ResourceApi"], bool], timeout_s: float = 20.0) -> bool:
        deadline = time.monotonic() + scaled(timeout_s)  # a test wait (tests.helpers.scaled)
        with self.cond:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def _handler(self) -> type:
        api = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _reply(self, code: int, doc: Any) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> Any:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")

            def _route(self, method: str) -> None:
                path = self.path.split("?")[0]
                body = self._body() if method in ("POST", "PUT") else None
                with api.cond:
                    api.requests.append((method, path))
                    code, doc = api._serve(method, path, body)
                    api.cond.notify_all()
                self._reply(code, doc)

            def do_GET(self) -> None:  # noqa: N802
                self._route("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._route("POST")

            def do_PUT(self) -> None:  # noqa: N802
                self._route("PUT")

            def do_DELETE(self) -> None:  # noqa: N802
                self._route("DELETE")

            def do_PATCH(self) -> None:  # noqa: N802
                self._route("PATCH")

        return H

    def _serve(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        missing = {"kind": "Status", "code": 404, "reason": "NotFound"}
        parts = path.split("/")
        if path.startswith(BASE + "/namespaces/") and len(parts) == 8 and parts[6] == "resourceclaims":
            doc = self.claims.get((parts[5], parts[7]))
            return (200, copy.deepcopy(doc)) if method == "GET" and doc is not None else (404, missing)
        if path.startswith("/api/v1/nodes/") and len(parts) == 5 and method == "GET":
            node = self.nodes.get(parts[4])
            return (200, copy.deepcopy(node)) if node is not None else (404, missing)
        if path == BASE + "/resourceslices" and method == "POST":
            name = body["metadata"]["name"]
            if name in self.slices:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
            return 201, self._store(name, body)
        if path.startswith(BASE + "/resourceslices/"):
            name = path.rsplit("/", 1)[1]
            have = self.slices.get(name)
            if method == "GET":
                return (200, copy.deepcopy(have)) if have else (404, missing)
            if method == "DELETE":
                return (200, self.slices.pop(name)) if have else (404, missing)
            if method == "PUT":
                if have is None:
                    return 404, missing
                if body["metadata"].get("resourceVersion") != have["metadata"]["resourceVersion"]:
                    return 409, {"kind": "Status", "code": 409, "reason": "Conflict"}
                return 200, self._store(name, body)
        return 404, missing

    def _store(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        doc = copy.deepcopy(body)
        doc["metadata"]["resourceVersion"] = str(self._rv)
        self.slices[name] = doc
        return copy.deepcopy(doc)

    def serve(self, root: Path) -> Path:
        """Serve on 127.0.0.1:0 in a thread; write ``root/kubeconfig``; return its path."""
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        kubeconfig = root / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{self.server.server_address[1]}"}}],
            "users": [{"name": "t", "user": {"token": "x"}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
        return kubeconfig

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
