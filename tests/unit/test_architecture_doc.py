"""``docs/architecture.md`` cannot drift from the package (issue 26): every
module path it names (a ``.py`` path in backticks, relative to
``src/fracplugin``, or ``fracplugin_demo/...`` relative to ``src``) exists,
and every module of ``src/fracplugin`` and of the demo's
``src/fracplugin_demo`` except the generated ``_proto`` package and the
``__init__`` files is named in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "fracplugin"
DEMO = "fracplugin_demo/"
DOC = ROOT / "docs" / "architecture.md"

MODULE = re.compile(r"`([A-Za-z_][\w/]*\.py)`")


def _named() -> set[str]:
    return set(MODULE.findall(DOC.read_text(encoding="utf-8")))


def _path(name: str) -> Path:
    return SRC.parent / name if name.startswith(DEMO) else SRC / name


def _modules() -> set[str]:
    product = {
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if "_proto" not in p.relative_to(SRC).parts and p.name != "__init__.py"
    }
    demo = {p.relative_to(SRC.parent).as_posix() for p in (SRC.parent / DEMO).rglob("*.py") if p.name != "__init__.py"}
    return product | demo


def test_every_module_the_page_names_exists() -> None:
    assert sorted(n for n in _named() if not _path(n).is_file()) == []


def test_every_module_of_the_package_is_named_on_the_page() -> None:
    assert sorted(_modules() - _named()) == []


def test_the_page_is_linked_from_the_readme_layout() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Where to read next"):]
    assert "docs/architecture.md" in layout


def test_the_page_links_resolve() -> None:
    """Relative links (``reference/...``, ``adr/...``) name files that exist."""
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", DOC.read_text(encoding="utf-8"))
    assert links, "the page links the reference notes and the ADRs"
    assert sorted(l for l in links if not (DOC.parent / l).exists()) == []
