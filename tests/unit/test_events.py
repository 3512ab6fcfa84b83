"""EventRecorder against a tiny fake Kubernetes API server (http.server on
127.0.0.1:0 in a thread): the kubernetes client's CoreV1Api makes real HTTP
requests, the server records what was POSTed to
/api/v1/namespaces/<ns>/events."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from fracplugin.events import MAX_MESSAGE, REASON_REFUSED, EventRecorder, NullEventRecorder
from fracplugin.model import FractionError, PodRef
from tests.helpers import wait_until

_EVENTS_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")

POD = PodRef("team-a", "trainer-0", "uid-1234")
ERR = FractionError("nvidia.com/container.app.gpu-memory.limit", "20Gi",
                    "is below the request 40Gi: the limit must be >= the request", "limit_below_request")


class FakeApi:
    """Records POST /api/v1/namespaces/<ns>/events; ``status`` is the answer's
    HTTP status (201 = created, echoing the body); while ``gate`` is set to an
    unset Event, requests wait on it (a hanging API server)."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []
        self.status = 201
        self.gate: threading.Event | None = None
        self.arrived = threading.Condition()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                m = _EVENTS_PATH.match(self.path)
                if m is None:
                    self._answer(404, {"kind": "Status", "code": 404})
                    return
                doc = json.loads(body)
                with api.arrived:
                    api.posts.append((m.group(1), doc))
                    api.arrived.notify_all()
                gate = api.gate
                if gate is not None:
                    gate.wait(30)
                if api.status == 201:
                    self._answer(201, doc)
                else:
                    self._answer(api.status, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                              "code": api.status, "message": "no"})

            def _answer(self, code, doc):
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_posts(self, n: int, timeout_s: float = 10.0) -> list[tuple[str, dict]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.posts) >= n, timeout_s), self.posts
            return list(self.posts)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api():
    a = FakeApi()
    yield a
    a.close()


def _core(url: str) -> client.CoreV1Api:
    cfg = client.Configuration()
    cfg.host = url
    return client.CoreV1Api(client.ApiClient(cfg))


@pytest.fixture
def recorders():
    made: list[EventRecorder] = []
    yield made
    for r in made:
        r.stop(2.0)


def _recorder(made, api_obj, **kw) -> EventRecorder:
    r = type("Recorder", (EventRecorder,), kw)(api_obj, "gpu-node-1")  # kw: class attributes, shortened
    made.append(r)
    return r.start()


def _wait_stats(r: EventRecorder, key: str, n: int) -> dict:
    return wait_until(lambda: (s := r.stats())[key] >= n and s, 10, lambda: f"{key} to reach {n}: {r.stats()}")


def test_refusal_becomes_a_warning_event_on_the_pod(api, recorders):
    r = _recorder(recorders, _core(api.url))
    r.refused(POD, "app", ERR, door="nri")
    ((ns, ev),) = api.wait_posts(1)
    assert ns == "team-a"
    assert ev["type"] == "Warning" and ev["reason"] == REASON_REFUSED == "FractionRefused"
    assert ev["message"] == ERR.message
    assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "team-a", "name": "trainer-0",
                                    "uid": "uid-1234", "fieldPath": "spec.containers{app}"}
    assert ev["source"] == {"component": "fracplugin", "host": "gpu-node-1"}
    assert ev["reportingComponent"] == "fracplugin" and ev["reportingInstance"] == "gpu-node-1"
    assert ev["action"] == "CreateContainer" and ev["count"] == 1
    assert ev["metadata"]["namespace"] == "team-a" and ev["metadata"]["name"].startswith("trainer-0.")
    assert ev["firstTimestamp"] == ev["lastTimestamp"] and ev["firstTimestamp"].endswith(("Z", "+00:00"))
    assert _wait_stats(r, "sent", 1)["failed"] == 0


def test_an_api_client_is_accepted_and_doors_name_the_action(api, recorders):
    cfg = client.Configuration()
    cfg.host = api.url
    r = _recorder(recorders, client.ApiClient(cfg), component="fp-test")
    r.refused(POD, "app", ERR, door="deviceplugin")
    other = PodRef("team-b", "nb", "uid-9")
    r.refused(other, "side", FractionError("k", "v", "is long" * 1000, "invalid"), door="nri")
    posts = api.wait_posts(2)
    assert [(ns, e["action"], e["source"]["component"]) for ns, e in posts] == [
        ("team-a", "Allocate", "fp-test"), ("team-b", "CreateContainer", "fp-test")]
    assert len(posts[1][1]["message"]) == MAX_MESSAGE
    assert posts[0][1]["metadata"]["name"] != posts[1][1]["metadata"]["name"]


def test_repeats_within_the_window_are_suppressed_but_other_containers_are_not(api, recorders):
    r = _recorder(recorders, _core(api.url), repeat_window_s=600)
    for _ in range(3):
        r.refused(POD, "app", ERR, door="nri")  # kubelet retrying the same creation
    r.refused(POD, "sidecar", ERR, door="nri")
    s = _wait_stats(r, "sent", 2)
    _wait_stats(r, "suppressed", 2)
    assert [e["involvedObject"]["fieldPath"] for _, e in api.wait_posts(2)] == [
        "spec.containers{app}", "spec.containers{sidecar}"]
    assert s["failed"] == 0 and len(api.posts) == 2


def test_api_errors_are_counted_and_logged_not_raised(api, recorders, caplog):
    api.status = 403
    r = _recorder(recorders, _core(api.url), repeat_window_s=0)
    r.refused(POD, "app", ERR, door="nri")
    r.refused(POD, "app", ERR, door="nri")
    s = _wait_stats(r, "failed", 2)
    assert s["sent"] == 0 and len(api.posts) == 2
    assert any("kubernetes event not created" in rec.getMessage() and getattr(rec, "reason", "").startswith("HTTP 403")
               for rec in caplog.records)
    api.status = 201  # the thread survived the errors
    r.refused(POD, "app", ERR, door="nri")
    _wait_stats(r, "sent", 1)


def test_unreachable_api_is_a_counted_failure(recorders):
    # A port nothing listens on: connection refused.
    from tests.helpers import free_port

    port = free_port()  # the harnesses' one port chooser (never the same port twice)
    r = _recorder(recorders, _core(f"http://127.0.0.1:{port}"), request_timeout_s=2.0)
    r.refused(POD, "app", ERR, door="nri")
    assert _wait_stats(r, "failed", 1)["sent"] == 0


def test_a_full_queue_drops_and_counts_instead_of_blocking(api, recorders):
    api.gate = threading.Event()  # the API server hangs: the first event stays in flight
    r = _recorder(recorders, _core(api.url), queue_size=3, repeat_window_s=0, request_timeout_s=30)
    r.refused(POD, "app", ERR, door="nri")
    api.wait_posts(1)  # the thread is now stuck in its request
    for _ in range(3 + 5):
        r.refused(POD, "app", ERR, door="nri")  # returns at once even now
    s = r.stats()
    assert (s["queued"], s["dropped"], s["sent"]) == (3, 5, 0)
    api.gate.set()
    assert _wait_stats(r, "sent", 4)["dropped"] == 5


def test_stop_ends_the_thread_and_later_refusals_are_dropped(api, recorders):
    r = _recorder(recorders, _core(api.url))
    r.refused(POD, "app", ERR, door="nri")
    assert r.stop(5.0) is True
    assert r.stats()["sent"] + r.stats()["dropped"] == 1  # sent while stopping, or dropped at the deadline
    r.refused(POD, "app2", ERR, door="nri")
    assert r.stats()["dropped"] >= 1
    assert r.stop(1.0) is True  # idempotent


def test_null_recorder_does_nothing():
    r = NullEventRecorder().start()
    r.refused(POD, "app", ERR, door="nri")
    assert r.stats() == {"queued": 0, "sent": 0, "failed": 0, "dropped": 0, "suppressed": 0}
    assert r.stop() is True

