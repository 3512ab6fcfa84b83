"""The device plugin's pipe-mount warnings name a remedy that can work
(issue 24 item 6; ADR 0008 decision 7, ADR 0011 decision 6).

``--secure-pipe-mount`` needs mount(2), i.e. CAP_SYS_ADMIN in the host mount
namespace; under the chart's DaemonSet (no SYS_ADMIN, no Bidirectional
propagation) it always fails, and the warning used to recommend the very flag
that had just failed. Here the daemon's check runs in a child process that
really lacks CAP_SYS_ADMIN (``setpriv`` drops it from the bounding set when the
suite runs as root; a non-root suite lacks it anyway), on a directory whose
filesystem is not nosuid,nodev, so mount(2) really fails with EPERM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from fracplugin import mountflags

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, logging, sys
    from fracplugin.gpu.simulated import SimulatedInventory
    from fracplugin.kubelet import DevicePluginServer
    from fracplugin.ledger import Ledger
    from fracplugin.mps.layout import MpsLayout
    from fracplugin.planner import PlannerConfig

    node_file, root, state, secure = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.WARNING)
    inv = SimulatedInventory(node_file)
    node = inv.node()
    ledger = Ledger(node, state + "/ledger.json")
    ledger.load()
    s = DevicePluginServer(node, ledger, PlannerConfig(layout=MpsLayout(root)), inv, pod_source=None,
                           plugin_dir=state, podresources_socket=None, secure_pipe_mount=secure)
    s._check_pipe_mount()
    print(json.dumps({"startup_warnings": s.startup_warnings, "log": records,
                      "secured": s._secured_root is not None}))
    """
)


def _without_sys_admin() -> list[str]:
    """argv prefix that runs a child without CAP_SYS_ADMIN."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop CAP_SYS_ADMIN for the child"
    return [setpriv, "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--"]


def _check(node_file: Path, root: Path, state: Path, secure: bool) -> dict:
    r = subprocess.run(
        _without_sys_admin() + [sys.executable, "-c", CHILD, str(node_file), str(root), str(state), "1" if secure else "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def plain_root():
    """A short MPS root (socket paths must fit 108 bytes) on a filesystem
    without nosuid,nodev: the case where mount(2) is needed."""
    base = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    try:
        if {"nosuid", "nodev"} <= mountflags.flags(base):
            pytest.fail(f"{base} is on a nosuid,nodev filesystem: the test needs one without those flags")
        root = Path(base) / "mps"
        root.mkdir()
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_failed_secure_pipe_mount_does_not_recommend_itself(node_file: Path, plain_root: Path, tmp_path: Path) -> None:
    out = _check(node_file, plain_root, tmp_path, secure=True)
    assert out["secured"] is False
    [msg] = out["startup_warnings"]
    assert "--secure-pipe-mount could not make it a nosuid,nodev mount" in msg, msg
    assert "Operation not permitted" in msg, msg  # the real EPERM of mount(2)
    assert "CAP_SYS_ADMIN" in msg and "Bidirectional" in msg, msg
    assert "use --secure-pipe-mount" not in msg, msg
    assert "drop --secure-pipe-mount" in msg and "nosuid,nodev" in msg, msg
    assert msg in out["log"]


def test_missing_flags_warning_says_where_the_flag_works(node_file: Path, plain_root: Path, tmp_path: Path) -> None:
    out = _check(node_file, plain_root, tmp_path, secure=False)
    assert out["startup_warnings"] == []
    [msg] = [m for m in out["log"] if "without nosuid,nodev" in m]
    assert "use --secure-pipe-mount" not in msg, msg
    assert "mount the MPS root's host filesystem nosuid,nodev" in msg, msg
    assert "not in the chart's DaemonSet" in msg, msg
