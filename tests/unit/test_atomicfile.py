"""``fracplugin.atomicfile.write_atomically``: the one way the daemon replaces
a file whole (ledger snapshot, MPS state and config, reservation proofs,
endpoints.json, CDI specs)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fracplugin import atomicfile
from fracplugin.atomicfile import write_atomically


def test_replaces_content_with_the_mode_asked_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    p.write_text("old")
    os.chmod(p, 0o666)
    assert write_atomically(p, '{"new": 1}', mode=0o600) == p
    assert p.read_text() == '{"new": 1}'
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]


def test_bytes_and_parents(tmp_path: Path) -> None:
    p = tmp_path / "a" / "b" / "spec.json"
    with pytest.raises(FileNotFoundError):
        write_atomically(p, b"x")
    write_atomically(p, b"\x00\x01", make_parents=True)
    assert p.read_bytes() == b"\x00\x01"
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_a_failed_write_keeps_the_old_content_and_removes_the_temporary(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "ledger.json"
    p.write_text("old")

    def no_rename(src: str, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomicfile.os, "replace", no_rename)
    with pytest.raises(OSError, match="No space"):
        write_atomically(p, "new")
    assert p.read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ledger.json"]
