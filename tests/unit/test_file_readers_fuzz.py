"""Issue 13 item 4, the other file readers: the daemon's ``--config`` file and
``fracplugin status --state-dir`` (endpoints.json). Malformed input is a
``ConfigError`` / exit 2 with one line naming the file, never a traceback.
A hypothesis property over random YAML (the shipped ConfigMap's config.yaml
with random subtrees replaced) and random bytes, and the cases found by hand
(not UTF-8, deep nesting, an infinite timeout, a list where an object goes).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fracplugin import config as configmod
from fracplugin.config import ConfigError

from test_explain_fuzz import mutated

REPO = Path(__file__).resolve().parents[2]
CONFIGMAP = yaml.safe_load((REPO / "daemonset" / "configmap.yaml").read_text())
SHIPPED = yaml.safe_load(CONFIGMAP["data"]["config.yaml"])
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"


def _load(path: Path) -> Any:
    parser = argparse.ArgumentParser()
    configmod.add_arguments(parser)
    args = parser.parse_args(["--config", str(path)])
    return configmod.load(args, env={})


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(text=st.one_of(mutated(SHIPPED), st.binary(max_size=200), st.text(max_size=200)))
def test_random_config_files_are_a_config_error_or_a_config(tmp_path: Path, text: Any) -> None:
    path = tmp_path / "config.yaml"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)  # type: ignore[operator]
    try:
        cfg, _ = _load(path)
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg.strip() and "config" in msg, msg
        return
    assert 0 < cfg.shutdown_timeout_s <= 3600 and 0 < cfg.allocate_deadline_s <= 3600


CASES = [
    ("not UTF-8", b"log_level: \xff\n", "is not UTF-8 text"),
    ("deep nesting", ("log_level: " + "[" * 5000 + "]" * 5000 + "\n").encode(), "nested too deeply"),
    ("infinite timeout", b"shutdown_timeout: .inf\n", "at most 3600"),
    ("a list", b"[1, 2]\n", "must hold a mapping"),
]


@pytest.mark.parametrize(("content", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_run_with_a_malformed_config_exits_2_in_one_line(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    r = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--config", str(path), "--simulate-node",
                        str(NODE), "--no-nri", "--no-device-plugin", "--no-mps", "--state-dir", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "config.yaml" in lines[0], r.stderr


@pytest.mark.parametrize("content", [b"[1]", b'{"health": 5}', b"\xff", b"[" * 5000])
def test_status_with_a_malformed_endpoints_file_exits_2(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "endpoints.json").write_bytes(content)
    r = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "endpoints.json" in r.stderr
