"""docs/operator-guide.md's configuration reference is generated from the one
settings table (src/fracplugin/config.py) by scripts/render_config_reference.py:
the committed block is the generator's output, every setting has its row, and
``--check`` fails on a stale copy."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import pytest

from fracplugin import config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "render_config_reference.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_reference_is_the_generated_one() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_every_setting_has_a_row_with_its_flag_env_and_default() -> None:
    mod = _script()
    text = mod.DOC.read_text()
    block = text[text.index(mod.BEGIN):text.index(mod.END)]
    for f in fields(config.Config):
        row = next((ln for ln in block.splitlines() if f"| `{f.name}` |" in ln), None)
        assert row is not None, f"no row for {f.name}"
        assert f"`--{config.flag_name(f.name)}" in row and f"`{config.env_name(f.name)}`" in row, row


def test_check_mode_detects_a_stale_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _script()
    stale = tmp_path / "operator-guide.md"
    # a row for a setting the table no longer has
    stale.write_text(mod.DOC.read_text().replace(mod.END, "| `--gone` | `FRACPLUGIN_GONE` | `gone` | | |\n" + mod.END))
    monkeypatch.setattr(mod, "DOC", stale)
    monkeypatch.setattr(mod, "REPO", tmp_path)
    assert mod.main(["--check"]) == 1
    assert mod.main([]) == 0
    assert mod.main(["--check"]) == 0


def test_a_page_without_the_markers_is_an_error() -> None:
    with pytest.raises(ValueError, match="markers"):
        _script().render("# no block here\n")
