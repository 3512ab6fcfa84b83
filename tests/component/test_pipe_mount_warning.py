"""The device plugin door warns when the MPS root's filesystem lacks
nosuid,nodev (kubelet's bind mount from Allocate inherits the source's flags;
issue 11, D9), naming a remedy that works under the chart's DaemonSet: the
host filesystem's flags (issue 24 item 6; ADR 0008 decision 7)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from fracplugin import mountflags
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.kubelet.deviceplugin import DevicePluginServer
from fracplugin.ledger import Ledger
from fracplugin.mps.layout import MpsLayout
from fracplugin.planner import PlannerConfig
from tests.helpers import node_rules


@pytest.fixture
def short() -> Iterator[Path]:
    """A short directory (MPS socket paths must fit 108 bytes)."""
    base = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    try:
        yield Path(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _server(node_file: Path, base: Path) -> DevicePluginServer:
    node = SimulatedInventory(node_file).node()
    (base / "mps").mkdir()
    rules = node_rules(node, Ledger(node, str(base / "ledger.json")), PlannerConfig(layout=MpsLayout(str(base / "mps"))))
    return DevicePluginServer(rules, pod_source=None, plugin_dir=str(base), podresources_socket=None)


def test_flags_are_those_of_the_mount_holding_the_path(tmp_path: Path) -> None:
    f = os.statvfs(tmp_path).f_flag
    assert mountflags.flags(str(tmp_path)) == {n for n, bit in (("ro", os.ST_RDONLY), ("nosuid", os.ST_NOSUID),
                                                                ("nodev", os.ST_NODEV), ("noexec", os.ST_NOEXEC))
                                               if f & bit}


@pytest.mark.parametrize("have", [set(), {"nosuid"}, {"nosuid", "nodev"}])
def test_a_root_without_nosuid_nodev_is_warned_with_the_host_filesystem_remedy(
        node_file: Path, short: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        have: set[str]) -> None:
    monkeypatch.setattr(mountflags, "flags", lambda path: have)
    s = _server(node_file, short)
    with caplog.at_level(logging.WARNING):
        s._check_pipe_mount()
    warned = [r.getMessage() for r in caplog.records if "without nosuid,nodev" in r.getMessage()]
    assert s.startup_warnings == []
    if {"nosuid", "nodev"} <= have:
        assert warned == []
    else:
        [msg] = warned
        assert "mount the MPS root's host filesystem nosuid,nodev" in msg, msg


def test_an_unreadable_root_is_a_startup_warning(node_file: Path, short: Path, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    def fail(path: str) -> set[str]:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(mountflags, "flags", fail)
    s = _server(node_file, short)
    s._check_pipe_mount()
    [msg] = s.startup_warnings
    assert "Permission denied" in msg and "not nosuid,nodev" in msg, msg
