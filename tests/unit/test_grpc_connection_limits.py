"""Issue 34 item 6: the doors' gRPC servers (``kubelet.grpcopts.serve_unix``,
the device plugin and DRA doors) cap their connections and close idle ones,
so a broken peer's idle connections cost nothing for long."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest

from fracplugin.kubelet import grpcopts
from tests.helpers import wait_until


def _serve(path: Path) -> tuple[grpc.Server, object]:
    return grpcopts.serve_unix(str(path), lambda s: None, 2, "t-grpc")


def test_a_connection_past_the_cap_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpcopts, "MAX_CONNECTIONS", 3)
    server, pool = _serve(tmp_path / "s.sock")
    held = []
    try:
        for _ in range(3):
            c = socket.socket(socket.AF_UNIX)
            c.connect(str(tmp_path / "s.sock"))
            held.append(c)
        extra = socket.socket(socket.AF_UNIX)
        extra.connect(str(tmp_path / "s.sock"))
        held.append(extra)
        extra.settimeout(60)
        assert extra.recv(1) == b""  # closed by the server at once (an allowed one would wait for the preface)
    finally:
        for c in held:
            c.close()
        server.stop(0)
        pool.shutdown(wait=False)  # type: ignore[attr-defined]


def test_an_idle_connection_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpcopts, "MAX_CONNECTION_IDLE_MS", 300)
    server, pool = _serve(tmp_path / "s.sock")
    channel = grpcopts.unix_channel(str(tmp_path / "s.sock"))
    states: list[grpc.ChannelConnectivity] = []
    try:
        channel.subscribe(states.append, try_to_connect=True)
        assert wait_until(lambda: grpc.ChannelConnectivity.READY in states, what="the channel to connect")
        # no RPC: the server's GOAWAY takes the channel out of READY
        assert wait_until(lambda: states[-1] is not grpc.ChannelConnectivity.READY,
                          what=lambda: f"the idle connection to be closed: {states}")
    finally:
        channel.close()
        server.stop(0)
        pool.shutdown(wait=False)  # type: ignore[attr-defined]
