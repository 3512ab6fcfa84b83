"""Issue 26 item 2 for ``fracplugin.mps`` (ADR 0022): no module over 800
lines, no class with more than 25 methods, no import circle inside the
package, and the rest of the daemon reaches the supervisor only through
``MpsSupervisor`` (and the ``make_dir`` helper it re-exports)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "fracplugin"
MPS = SRC / "mps"
PARTS = {"state", "lifecycle", "probing", "namespaces", "drain", "procs"}


def _tree(p: Path) -> ast.Module:
    return ast.parse(p.read_text(), str(p))


def test_every_mps_module_is_under_800_lines() -> None:
    big = {p.name: n for p in MPS.glob("*.py") if (n := len(p.read_text().splitlines())) > 800}
    assert big == {}


def test_no_mps_class_has_more_than_25_methods() -> None:
    fat = {
        f"{p.name}:{c.name}": n
        for p in MPS.glob("*.py")
        for c in ast.walk(_tree(p))
        if isinstance(c, ast.ClassDef)
        and (n := sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in c.body)) > 25
    }
    assert fat == {}


def _mps_imports(p: Path) -> set[str]:
    """Sibling modules of ``fracplugin.mps`` that ``p`` imports (``from .x import``)."""
    return {n.module.split(".")[0] for n in ast.walk(_tree(p))
            if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}


def test_no_import_circle_inside_mps() -> None:
    graph = {p.stem: _mps_imports(p) for p in MPS.glob("*.py")}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                circles.append(path[path.index(dep):] + [dep])
            else:
                visit(dep, path + [dep])

    for mod in graph:
        visit(mod, [mod])
    assert circles == []


def test_only_the_supervisor_reaches_into_its_parts() -> None:
    outside = {
        f"{p.relative_to(SRC)}: {n.module}"
        for p in SRC.rglob("*.py")
        if "_proto" not in p.parts and p.parent != MPS
        for n in ast.walk(_tree(p))
        if isinstance(n, ast.ImportFrom) and n.module
        and n.module.split(".")[-1] in PARTS and "mps" in n.module.split(".")
    }
    assert outside == set()
