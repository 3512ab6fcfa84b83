"""The MPS role's API (fracplugin.mps.rpc) on a real unix socket, with a
stand-in MPS object: versioning, peer check, bad input, errors mapped back to
the exceptions the supervisor raises, and what the doors see while the MPS
role is unreachable."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from fracplugin.model import ComputeMode
from fracplugin.mps.api import DrainResult, MpsError, MpsTimeout
from fracplugin.mps.rpc import MAX_REQUEST_BYTES, MpsApiServer, RemoteMps
from fracplugin.mps.rpcwire import API_VERSION

TS, SM = ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING


class StandIn:
    protocol = 3

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def status(self) -> dict[str, Any]:
        return {"enabled": True, "protocol": 3, "ready": False, "daemons": [
            {"mode": "time-slicing", "healthy": True, "state": "ready", "reason": ""},
            {"mode": "sm-sharing", "healthy": False, "state": "failed", "reason": "failed after 5 restarts"}]}

    def ensure_namespace(self, pod_uid, container, atp, timeout_s, mode=SM, pinned_limit_mib=None):
        self.calls.append(("ensure", (pod_uid, container, atp, mode, pinned_limit_mib)))
        if container == "slow":
            raise MpsTimeout("namespace set timed out after 1s")
        if container == "bad":
            raise ValueError("active thread percentage must be 1..100, got 0")
        if mode is SM:
            raise MpsError("the sm-sharing MPS daemon is not ready (failed after 5 restarts)")
        return f"/run/fracplugin/mps/ts/shared/{pod_uid}"

    def release_namespace(self, pod_uid, container, timeout_s=None):
        self.calls.append(("release", (pod_uid, container, timeout_s)))
        return True

    def drain(self, container_id, timeout_s, modes=None):
        self.calls.append(("drain", (container_id, modes)))
        return DrainResult(container_id, clients=(12,), terminated=(12,), elapsed_s=0.1)

    def quit_daemons(self, timeout_s=10.0):
        self.calls.append(("quit", timeout_s))


@pytest.fixture
def served():
    d = tempfile.mkdtemp(prefix="fpa", dir="/tmp")
    path = os.path.join(d, "api", "api.sock")
    mps = StandIn()
    server = MpsApiServer(mps, path)
    server.start()
    try:
        yield mps, server, RemoteMps(path, modes=(TS, SM))
    finally:
        server.stop()
        os.rmdir(os.path.dirname(path))
        os.rmdir(d)


def raw(path: str, payload: bytes) -> dict[str, Any]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(payload)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    return json.loads(buf)


def test_socket_is_root_only(served) -> None:
    _, server, _ = served
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(server.path)).st_mode) == 0o700


def test_calls_round_trip_with_errors_mapped(served) -> None:
    mps, _, remote = served
    assert remote.ensure_namespace("p1", "app", None, 2.0, mode=TS, pinned_limit_mib=4096) == \
        "/run/fracplugin/mps/ts/shared/p1"
    assert mps.calls[-1] == ("ensure", ("p1", "app", None, TS, 4096))
    with pytest.raises(MpsTimeout, match="timed out"):
        remote.ensure_namespace("p1", "slow", 30, 2.0)
    with pytest.raises(ValueError, match="1..100"):
        remote.ensure_namespace("p1", "bad", 0, 2.0)
    with pytest.raises(MpsError, match="not ready"):
        remote.ensure_namespace("p1", "app", 30, 2.0, mode=SM)
    assert remote.release_namespace("p1", "app", timeout_s=1.0) is True
    res = remote.drain("c1", 2.0, modes=[TS])
    assert res.clients == (12,) and res.ok and mps.calls[-1] == ("drain", ("c1", [TS]))
    remote.quit_daemons(3.0)
    assert mps.calls[-1] == ("quit", 3.0)


def test_health_comes_from_the_polled_status(served) -> None:
    _, _, remote = served
    remote.refresh()
    assert remote.healthy(TS) and not remote.healthy(SM) and not remote.ready()
    assert remote.unhealthy_reason(SM) == "failed after 5 restarts" and remote.protocol == 3


def test_version_bad_json_unknown_op_and_oversized_requests_are_refused(served) -> None:
    _, server, _ = served
    r = raw(server.path, json.dumps({"v": API_VERSION + 1, "op": "status"}).encode() + b"\n")
    assert r["ok"] is False and r["error"]["kind"] == "version" and f"speaks v{API_VERSION}" in r["error"]["message"]
    r = raw(server.path, b"{not json\n")
    assert r["error"]["kind"] == "bad_request"
    r = raw(server.path, json.dumps({"v": API_VERSION, "op": "format_disk"}).encode() + b"\n")
    assert r["error"]["kind"] == "value" and "unknown op 'format_disk'" in r["error"]["message"]
    r = raw(server.path, json.dumps({"v": API_VERSION, "op": "ensure_namespace", "args": {"pod_uid": "x"}}).encode()
            + b"\n")
    assert r["error"]["kind"] == "value" and "container" in r["error"]["message"]
    r = raw(server.path, b"x" * (MAX_REQUEST_BYTES + 10))
    assert r["error"]["kind"] == "bad_request"
    r = raw(server.path, json.dumps({"v": API_VERSION, "op": "hello"}).encode() + b"\n")
    assert r["ok"] and r["result"]["api"] == API_VERSION  # still serving


def test_a_peer_that_is_not_root_is_denied() -> None:
    d = tempfile.mkdtemp(prefix="fpa", dir="/tmp")
    path = os.path.join(d, "api.sock")
    server = MpsApiServer(StandIn(), path, allowed_uids=(os.geteuid() + 4242,))
    server.start()
    try:
        r = raw(path, json.dumps({"v": API_VERSION, "op": "status"}).encode() + b"\n")
        assert r["ok"] is False and r["error"]["kind"] == "denied"
    finally:
        server.stop()
        os.rmdir(d)


def test_unreachable_mps_role_means_every_mode_down_with_the_reason(tmp_path: Path) -> None:
    remote = RemoteMps(str(tmp_path / "nothing.sock"), modes=(TS, SM))
    changes: list[tuple[ComputeMode, bool]] = []
    remote.subscribe(lambda m, h: changes.append((m, h)))
    remote.refresh()
    st = remote.status()
    assert st["reachable"] is False and "not reachable" in st["error"]
    assert not remote.healthy(TS) and not remote.ready()
    assert remote.unhealthy_reason(TS).startswith("MPS role unreachable")
    with pytest.raises(MpsError, match="not reachable"):
        remote.ensure_namespace("p", "c", None, 1.0)
    assert remote.drain("c1", 1.0).errors and changes == []  # never healthy: no change to report


def test_every_op_leaves_a_line_naming_its_peer(served, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 34 item 6: ``quit_daemons`` (it stops every tenant's server) and every other op are logged with
    the peer's pid and uid (``SO_PEERCRED``); the doors' status polls at debug only."""
    import logging

    _, _, remote = served
    with caplog.at_level(logging.DEBUG, logger="fracplugin.mps.rpc"):
        remote.quit_daemons(3.0)
        remote.status()
    ops = [r for r in caplog.records if r.getMessage().startswith("MPS API op ")]
    quit_ = [r for r in ops if r.op == "quit_daemons"]  # type: ignore[attr-defined]
    assert quit_ and quit_[0].levelno == logging.INFO, [r.getMessage() for r in ops]
    assert quit_[0].peer_pid == os.getpid() and quit_[0].peer_uid == os.geteuid()  # type: ignore[attr-defined]
    assert all(r.levelno == logging.DEBUG for r in ops if r.op == "status")  # type: ignore[attr-defined]
