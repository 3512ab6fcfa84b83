"""Size limits of issue 26 item 2 that a code walk can check, over every
module of ``src/fracplugin`` except the generated ``_proto`` package:

- no module is longer than ``MAX_MODULE_LINES`` (800) lines;
- no class defines more than ``MAX_CLASS_METHODS`` (25) methods in its own
  body (``def`` / ``async def`` directly in the class, properties and static
  methods included; methods a class inherits are counted where they are
  defined, so a class split into mixins counts each mixin on its own);
- no import cycle among the modules of ``fracplugin``.

Which imports make an edge: every ``import`` / ``from ... import`` at module
level, *including* those under ``if TYPE_CHECKING:`` (a cycle that only the
type checker walks is still a circle a reader has to hold in their head, and
was the one issue 26 named: ``parts.py`` <-> ``kubelet/deviceplugin.py``).
Imports inside a function or method body are *not* edges: they run late, on
purpose (to keep a library such as grpc or kubernetes out of processes that do
not need it, ADR 0016), and cannot make an import-time cycle. An import names
the module it loads: ``from .a import b`` is an edge to ``a.b`` when that is a
module, else to ``a``; a package's ``__init__`` is not implied by importing
one of its submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "fracplugin"
MAX_MODULE_LINES = 800
MAX_CLASS_METHODS = 25

ALLOWED_OVERSIZE = {
    # kubelet/* was house-grpc's this session (the door back on grpcio, issue 26
    # item 1, merged): DevicePluginServer still has 32 methods, Allocator 26.
    # Splitting them is follow-up work; the lead removes these two entries then.
    "kubelet/deviceplugin.py",
    "kubelet/allocator.py",
}
"""Modules exempt from both size limits, each with the reason."""


def _files() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if "_proto" not in p.relative_to(SRC).parts]


def _name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports outside any function body (module level, class bodies, and
    ``if`` / ``try`` blocks such as ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _graph() -> dict[str, set[str]]:
    files = _files()
    modules = {_name(p): p for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            graph[mod].update(t for t in targets if t in modules and t != mod)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module
    (Tarjan), as a path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_is_over_800_lines() -> None:
    long = [f"{p.relative_to(SRC)} ({n} lines)" for p in _files()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
            and str(p.relative_to(SRC)) not in ALLOWED_OVERSIZE]
    assert long == []


def test_no_class_has_more_than_25_methods() -> None:
    big = []
    for p in _files():
        if str(p.relative_to(SRC)) in ALLOWED_OVERSIZE:
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > MAX_CLASS_METHODS:
                    big.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name} ({n} methods)")
    assert big == []


def test_the_allow_list_names_only_modules_that_still_need_it() -> None:
    """An entry goes once its module is within the limits again."""
    for rel in ALLOWED_OVERSIZE:
        path = SRC / rel
        assert path.exists(), rel
        tree = ast.parse(path.read_text())
        methods = max((sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in n.body)
                       for n in ast.walk(tree) if isinstance(n, ast.ClassDef)), default=0)
        assert len(path.read_text().splitlines()) > MAX_MODULE_LINES or methods > MAX_CLASS_METHODS, rel


def test_there_is_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_a_cycle_and_type_checking_imports() -> None:
    """Positive controls: a two-module circle and a longer one are found, and
    an import under ``if TYPE_CHECKING:`` is an edge while one inside a
    function is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
                     "def f():\n    import y\nclass C:\n    import z\n")
    names = sorted(a.name for n in _top_level_imports(tree) for a in n.names)
    assert names == ["TYPE_CHECKING", "x", "z"]
    graph = _graph()
    assert "fracplugin.ports" in graph["fracplugin.parts"]  # a real edge is seen
