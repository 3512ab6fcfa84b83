"""``fracplugin status``'s table for the MPS section (status.render_table)."""

from __future__ import annotations

from fracplugin.status import render_table


def _doc(mps: dict) -> dict:
    return {"node": "n1", "version": "0", "pid": 1, "ready": False, "checks": {}, "doors": {}, "gpus": [], "mps": mps}


def test_an_absent_mps_role_is_said_once_without_a_none_protocol() -> None:
    err = "the MPS role is not reachable at /run/fracplugin/mps/api.sock: No such file or directory"
    out = render_table(_doc({"enabled": True, "remote": "/run/fracplugin/mps/api.sock", "protocol": None,
                             "reachable": False, "error": err, "ready": False, "daemons": []}))
    assert "MPS daemons (protocol unknown) through the MPS role at /run/fracplugin/mps/api.sock, ready: no" in out
    assert f"  MPS role: {err}" in out
    assert "None" not in out and "unreachable" not in out


def test_a_reachable_mps_role_shows_its_protocol() -> None:
    out = render_table(_doc({"enabled": True, "remote": "/run/x/api.sock", "protocol": 3, "reachable": True,
                             "ready": True, "daemons": []}))
    assert "MPS daemons (protocol 3) through the MPS role at /run/x/api.sock, ready: yes" in out
