"""``fracplugin status`` finds the daemon where the DaemonSet configured it,
and refuses a malformed address in one line (exit 2), never a traceback."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fracplugin import status


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(health_address=kw.get("health_address"), state_dir=kw.get("state_dir"),
                              output="table", timeout=1.0)


@pytest.fixture
def no_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("FRACPLUGIN_HEALTH_ADDRESS", raising=False)
    monkeypatch.setattr(status, "DEFAULT_CONFIG", tmp_path / "etc" / "config.yaml")
    monkeypatch.setattr(status, "DEFAULT_STATE_DIR", tmp_path / "state")
    return tmp_path


@pytest.mark.parametrize("bad", ["localhost", "nothost", "127.0.0.1:99999", "127.0.0.1:0",
                                 "http://127.0.0.1:8080", "127.0.0.1:80x"])
def test_malformed_address_is_one_line_exit_2(bad):
    p = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--health-address", bad],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "--health-address" in p.stderr and repr(bad) in p.stderr and "HOST:PORT" in p.stderr


def test_config_file_health_port_is_followed(no_defaults):
    """The chart's ConfigMap moves the port (health.port 9103): plain
    ``fracplugin status`` inside the pod must use it."""
    cfg = status.DEFAULT_CONFIG
    cfg.parent.mkdir()
    cfg.write_text("health_address: 0.0.0.0:9103\nstate_dir: " + str(no_defaults / "nowhere") + "\n")
    assert status.resolve_address(_args()) == "0.0.0.0:9103"
    assert status.url_for("0.0.0.0:9103") == "http://127.0.0.1:9103/status"


def test_config_state_dir_endpoints_win_over_the_configured_port(no_defaults):
    sd = no_defaults / "sd"
    sd.mkdir()
    (sd / "endpoints.json").write_text(json.dumps({"health": "127.0.0.1:41234"}))
    cfg = status.DEFAULT_CONFIG
    cfg.parent.mkdir()
    cfg.write_text(f"health_address: 0.0.0.0:9103\nstate_dir: {sd}\n")
    assert status.resolve_address(_args()) == "127.0.0.1:41234"


def test_default_state_dir_then_default_port(no_defaults):
    assert status.resolve_address(_args()) == "127.0.0.1:8080"
    status.DEFAULT_STATE_DIR.mkdir()
    (status.DEFAULT_STATE_DIR / "endpoints.json").write_text(json.dumps({"health": "127.0.0.1:5555"}))
    assert status.resolve_address(_args()) == "127.0.0.1:5555"


def test_flag_beats_env_beats_config(no_defaults, monkeypatch):
    cfg = status.DEFAULT_CONFIG
    cfg.parent.mkdir()
    cfg.write_text("health_address: 0.0.0.0:9103\n")
    monkeypatch.setenv("FRACPLUGIN_HEALTH_ADDRESS", "127.0.0.1:7000")
    assert status.resolve_address(_args()) == "127.0.0.1:7000"
    assert status.resolve_address(_args(health_address="127.0.0.1:7001")) == "127.0.0.1:7001"
    monkeypatch.setenv("FRACPLUGIN_HEALTH_ADDRESS", "bogus")
    with pytest.raises(OSError, match="env FRACPLUGIN_HEALTH_ADDRESS 'bogus'"):
        status.resolve_address(_args())


def test_explain_with_a_missing_ledger_in_an_existing_state_dir_plans_on_an_empty_node(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    pod = repo / "examples" / "pods" / "notebook-time-slicing-2gpu.yaml"
    node = repo / "examples" / "nodes" / "gpu-node-1.yaml"
    p = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(pod), "--node", str(node),
                        "--ledger", str(tmp_path / "ledger.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "no ledger at" in p.stderr and "empty node" in p.stderr
    p = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(pod), "--node", str(node),
                        "--ledger", str(tmp_path / "nodir" / "ledger.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "does not exist" in p.stderr
