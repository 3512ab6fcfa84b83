"""Issue 25 item 8: the MPS role's API socket against careless and hostile
clients, through the real unix socket (``MpsApiServer`` with a stand-in MPS,
``RemoteMps`` as the doors use it, raw sockets as the other clients).

* idle connections beyond the limit never keep the doors' status poll and
  namespace calls out (the oldest idle one is evicted, answered ``busy``);
* a client that trickles its request is cut at the whole-request deadline
  however it paces its bytes (the server's clock is injected: no test waits
  on wall-clock time);
* every malformed request (JSON nested 10,000 deep, ``Infinity``/``NaN``
  timeouts, wrong types, unknown fields) is answered with an error naming the
  field, nothing reaches the MPS object, nothing is logged with a traceback,
  and the server keeps serving;
* one peer process cannot take every op slot: its surplus is ``busy``,
  another process's call and everyone's ``status`` still go through.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers import wait_until

from fracplugin.model import ComputeMode
from fracplugin.mps.api import DrainResult, MpsError
from fracplugin.mps.rpcwire import API_VERSION
from fracplugin.mps.rpc import (MAX_CONNECTIONS, MAX_RUNNING_PER_PEER, REQUEST_DEADLINE_S,
                                MpsApiServer, RemoteMps)

TS, SM = ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING
SRC = str(Path(__file__).resolve().parents[2] / "src")


class StandIn:
    """An MPS object that records calls; ``ensure_namespace`` of container
    ``block`` waits until ``release`` is set."""

    protocol = 3

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.release = threading.Event()
        self.lock = threading.Lock()

    def status(self) -> dict[str, Any]:
        return {"enabled": True, "protocol": 3, "ready": True, "daemons": [
            {"mode": "time-slicing", "healthy": True, "state": "ready", "reason": ""},
            {"mode": "sm-sharing", "healthy": True, "state": "ready", "reason": ""}]}

    def ensure_namespace(self, pod_uid, container, atp, timeout_s, mode=SM, pinned_limit_mib=None):
        with self.lock:
            self.calls.append(("ensure", (pod_uid, container, atp, timeout_s, mode, pinned_limit_mib)))
        if container == "block":
            self.release.wait(30)
        return f"/run/fracplugin/mps/{mode.value}/shared/{pod_uid}"

    def release_namespace(self, pod_uid, container, timeout_s=None):
        self.calls.append(("release", (pod_uid, container, timeout_s)))
        return True

    def drain(self, container_id, timeout_s, modes=None):
        self.calls.append(("drain", (container_id, timeout_s, modes)))
        return DrainResult(container_id)

    def quit_daemons(self, timeout_s=10.0):
        self.calls.append(("quit", timeout_s))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, s: float) -> None:
        with self.lock:
            self.now += s


@pytest.fixture
def api() -> Iterator[tuple[StandIn, MpsApiServer, FakeClock]]:
    d = tempfile.mkdtemp(prefix="fph", dir="/tmp")
    path = os.path.join(d, "api.sock")
    mps, clock = StandIn(), FakeClock()
    server = MpsApiServer(mps, path, clock=clock)  # type: ignore[arg-type]
    server.start()
    try:
        yield mps, server, clock
    finally:
        mps.release.set()
        server.stop()
        os.rmdir(d)


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)  # blocking: waits for room in the listen backlog, as a patient client would
    s.settimeout(20)  # bounds a broken test only; every read below ends when the server answers
    return s


def read_reply(s: socket.socket) -> dict[str, Any]:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    return json.loads(buf)


def ask(path: str, payload: bytes) -> dict[str, Any]:
    s = connect(path)
    s.sendall(payload)
    return read_reply(s)


def req(op: str, **args: Any) -> bytes:
    return json.dumps({"v": API_VERSION, "op": op, "args": args}).encode() + b"\n"


def test_idle_connections_never_keep_the_doors_out(api) -> None:
    mps, server, _ = api
    idle = [connect(server.path) for _ in range(MAX_CONNECTIONS + 16)]
    try:
        wait_until(lambda: server.evicted >= 16, what=lambda: f"evicted {server.evicted}, {server.connections()}")
        remote = RemoteMps(server.path, modes=(TS, SM))
        remote.refresh()  # the doors' status poll: hello + status on fresh connections
        assert remote.status()["reachable"] is True and remote.ready() and remote.healthy(SM)
        assert remote.ensure_namespace("p1", "app", 50, 2.0, mode=SM) == "/run/fracplugin/mps/sm-sharing/shared/p1"
        assert mps.calls[-1][0] == "ensure"
        first = read_reply(idle[0])  # the oldest idle connection was evicted, with a reason
        assert first["ok"] is False and first["error"]["kind"] == "busy" and "evicted" in first["error"]["message"]
        assert server.connections()["reading"] <= MAX_CONNECTIONS
    finally:
        for s in idle:
            s.close()


def test_a_trickling_client_is_cut_at_the_whole_request_deadline(api) -> None:
    mps, server, clock = api
    s = connect(server.path)
    wait_until(lambda: server.connections()["reading"] == 1)
    for piece in (b'{"v": 1, ', b'"op": "sta'):  # each gap shorter than the deadline, the sum longer
        s.sendall(piece)
        clock.advance(REQUEST_DEADLINE_S * 0.8)
    r = read_reply(s)
    assert r["ok"] is False and r["error"]["kind"] == "timeout"
    assert "whole-request deadline" in r["error"]["message"]
    assert server.connections() == {"reading": 0, "running": 0, "writing": 0} and mps.calls == []
    assert ask(server.path, req("hello"))["ok"] is True  # still serving


DEEP = b'{"v": 1, "op": "status", "args": ' + b"[" * 10_000 + b"]" * 10_000 + b"}\n"
ENSURE = '{"v": 1, "op": "ensure_namespace", "args": {"pod_uid": "p", "container": "c", %s}}\n'


@pytest.mark.parametrize("payload, kind, names", [
    (DEEP, "bad_request", "deeper than 8 levels"),
    ((ENSURE % '"timeout_s": Infinity').encode(), "value", "args.timeout_s=Infinity"),
    ((ENSURE % '"timeout_s": -Infinity').encode(), "value", "args.timeout_s=-Infinity"),
    ((ENSURE % '"timeout_s": NaN').encode(), "value", "args.timeout_s=NaN"),
    ((ENSURE % '"timeout_s": 1e400').encode(), "value", "args.timeout_s=Infinity"),
    ((ENSURE % '"timeout_s": "2"').encode(), "value", 'args.timeout_s="2"'),
    ((ENSURE % '"timeout_s": 2, "active_thread_percentage": true').encode(), "value",
     "args.active_thread_percentage=true"),
    ((ENSURE % '"timeout_s": 2, "active_thread_percentage": 101').encode(), "value",
     "args.active_thread_percentage=101"),
    ((ENSURE % '"timeout_s": 2, "pinned_limit_mib": 0').encode(), "value", "args.pinned_limit_mib=0"),
    ((ENSURE % '"timeout_s": 2, "mode": "turbo"').encode(), "value", 'args.mode="turbo"'),
    ((ENSURE % '"timeout_s": 2, "gpu": 0').encode(), "value", "args.gpu is not an argument"),
    (b'{"v": 1, "op": "drain", "args": {"container_id": "c", "timeout_s": 1, "modes": ["x"]}}\n', "value",
     'args.modes[0]="x"'),
    (b'{"v": 1, "op": "drain", "args": {"container_id": "c", "timeout_s": 1, "modes": "sm-sharing"}}\n', "value",
     'args.modes="sm-sharing"'),
    (b'{"v": 1, "op": "drain", "args": {"container_id": 7, "timeout_s": 1}}\n', "value", "args.container_id=7"),
    (b'{"v": 1, "op": "quit_daemons", "args": {"timeout_s": Infinity}}\n', "value", "args.timeout_s=Infinity"),
    (b'{"v": 1, "op": "release_namespace", "args": {"pod_uid": "", "container": "c"}}\n', "value",
     'args.pod_uid=""'),
    (b'{"v": 1, "op": 5}\n', "bad_request", "op=5"),
    (b'{"v": 1, "op": "status", "args": []}\n', "bad_request", "args=[]"),
    (b'{"v": 1, "op": "status", "debug": true}\n', "bad_request", 'field "debug"'),
    (b'{"v": NaN, "op": "status"}\n', "version", "vNaN"),
    (b'[1, 2]\n', "bad_request", "not a JSON object but list"),
    (b'{"v": 1, "op": "status", "args": {"x": ' + b"9" * 5000 + b"}}\n", "bad_request", "request is not JSON"),
    (b'\xff\xfe{"v": 1}\n', "bad_request", "request is not JSON"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_a_malformed_request_is_answered_naming_the_field(api, caplog, payload, kind, names) -> None:
    mps, server, _ = api
    caplog.set_level(logging.DEBUG)
    r = ask(server.path, payload)
    assert r["ok"] is False and r["error"]["kind"] == kind, r
    assert names in r["error"]["message"], r
    assert mps.calls == []  # refused before anything ran
    assert [rec for rec in caplog.records if rec.exc_info] == []  # no traceback anywhere
    assert ask(server.path, req("hello"))["ok"] is True  # the server keeps serving


def test_a_wrong_argument_reaches_the_doors_as_a_value_error_naming_it(api) -> None:
    _, server, _ = api
    remote = RemoteMps(server.path, modes=(TS, SM))
    with pytest.raises(ValueError, match="args.active_thread_percentage=0"):
        remote.ensure_namespace("p", "c", 0, 2.0)


def test_one_peer_cannot_take_every_op_slot(api) -> None:
    mps, server, _ = api
    held = []
    for i in range(MAX_RUNNING_PER_PEER):
        s = connect(server.path)
        s.sendall(req("ensure_namespace", pod_uid=f"p{i}", container="block", timeout_s=30))
        held.append(s)
    try:
        wait_until(lambda: server.connections()["running"] == MAX_RUNNING_PER_PEER,
                   what=lambda: server.connections())
        over = ask(server.path, req("ensure_namespace", pod_uid="px", container="block", timeout_s=30))
        assert over["error"]["kind"] == "busy" and f"pid {os.getpid()}" in over["error"]["message"]
        st = ask(server.path, req("status"))  # answered at once while this peer's ops run
        assert st["ok"] and st["result"]["ready"] is True
        # Another process (the doors) is not this peer: its call goes through.
        code = ("import sys; sys.path.insert(0, sys.argv[2]); from fracplugin.mps.rpc import RemoteMps; "
                "print(RemoteMps(sys.argv[1]).ensure_namespace('doors', 'app', None, 10.0))")
        out = subprocess.run([sys.executable, "-c", code, server.path, SRC], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "/run/fracplugin/mps/sm-sharing/shared/doors"
    finally:
        mps.release.set()
    for s in held:
        assert read_reply(s)["ok"] is True
    wait_until(lambda: server.connections()["running"] == 0)


def test_a_peer_that_leaves_while_its_op_runs_costs_nothing(api) -> None:
    mps, server, _ = api
    s = connect(server.path)
    s.sendall(req("ensure_namespace", pod_uid="gone", container="block", timeout_s=30))
    wait_until(lambda: server.connections()["running"] == 1)
    s.close()
    assert ask(server.path, req("hello"))["ok"] is True  # the serving thread is not spinning on it
    mps.release.set()
    wait_until(lambda: server.connections() == {"reading": 0, "running": 0, "writing": 0},
               what=lambda: server.connections())


def test_unreachable_after_stop_is_an_mps_error(api) -> None:
    _, server, _ = api
    path = server.path
    server.stop()
    with pytest.raises(MpsError, match="not reachable"):
        RemoteMps(path).ensure_namespace("p", "c", None, 1.0)
    server.start()  # the fixture stops it again
