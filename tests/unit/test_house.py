"""House rules of issue 15 that a code walk can check: every function in
``src/fracplugin`` (and the demo's ``src/fracplugin_demo``) is under 80
lines, the daemon holds no ``Any``-typed part and reads no part by
reflection, and no child process is started with a Python ``preexec_fn``.
The generated ``_proto`` package is not ours and is left out."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "fracplugin"
MAX_FUNCTION_LINES = 80


def _modules() -> list[tuple[Path, ast.Module]]:
    """The modules of ``src/fracplugin`` and of the demo's ``src/fracplugin_demo``."""
    files = sorted(SRC.rglob("*.py")) + sorted((SRC.parent / "fracplugin_demo").rglob("*.py"))
    return [(p, ast.parse(p.read_text(), str(p))) for p in files if "_proto" not in p.parts]


def test_every_function_in_src_is_under_80_lines() -> None:
    long = [
        f"{p.relative_to(SRC.parent)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for p, tree in _modules()
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno is not None
        and n.end_lineno - n.lineno + 1 >= MAX_FUNCTION_LINES
    ]
    assert long == []


DAEMON_MODULES = ("daemon.py", "builders.py")
"""The daemon and what builds its parts (``builders.Builder``)."""


def test_the_daemon_holds_no_any_typed_part() -> None:
    for module, name in (("daemon.py", "Daemon"), ("builders.py", "Builder")):
        tree = ast.parse((SRC / module).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        any_attrs = [
            ast.unparse(n.target)
            for n in ast.walk(cls)
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Attribute)
            and "Any" in ast.unparse(n.annotation)
        ]
        assert any_attrs == [], name


def test_the_daemon_reads_no_part_by_reflection() -> None:
    """``hasattr``/``inspect``/``callable(getattr(...))`` on parts were the old
    probing; the one ``getattr`` allowed reads configuration fields by name."""
    for name in DAEMON_MODULES:
        tree = ast.parse((SRC / name).read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        assert [ast.unparse(c) for c in calls if c.func.id in ("hasattr", "callable")] == [], name
        getattrs = [ast.unparse(c) for c in calls if c.func.id == "getattr"]
        assert all(g.startswith("getattr(self.cfg,") for g in getattrs), (name, getattrs)
        imports = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        assert "inspect" not in imports, name


def test_no_child_process_is_started_with_a_preexec_fn() -> None:
    uses = [
        f"{p.relative_to(SRC.parent)}:{n.lineno}"
        for p, tree in _modules()
        for n in ast.walk(tree)
        if isinstance(n, ast.keyword) and n.arg == "preexec_fn"
    ]
    assert uses == []
