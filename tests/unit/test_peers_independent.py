"""The component tests' peers (``tests/peers/``, and the ``nri_runtime`` /
``fake_kubelet`` modules the tests import) share no code with the product's
transport and registration (issue 15 item 4): from ``fracplugin`` they may
import only the generated message schemas, never ``fracplugin.nri`` (mux,
ttrpc, transport, stub), ``fracplugin.kubelet`` (registration, device plugin
server) or ``fracplugin_demo`` (the demo's players, built on the product's
transport). The ttrpc envelope is encoded by the peers themselves, so
``ttrpc_pb2`` is off limits too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEER_FILES = sorted((REPO / "tests" / "peers").glob("*.py")) + [
    REPO / "tests" / "component" / "nri_runtime.py",
    REPO / "tests" / "component" / "fake_kubelet.py",
]
ALLOWED = {
    "fracplugin._proto.nri_pb2",
    "fracplugin._proto.deviceplugin_pb2",
    "fracplugin._proto.deviceplugin_pb2_grpc",
    "fracplugin._proto.podresources_pb2",
    "fracplugin._proto.podresources_pb2_grpc",
    "fracplugin._proto.dra_v1_pb2",
    "fracplugin._proto.dra_v1_pb2_grpc",
    "fracplugin._proto.dra_v1beta1_pb2",
    "fracplugin._proto.dra_v1beta1_pb2_grpc",
    "fracplugin._proto.pluginregistration_pb2",
    "fracplugin._proto.pluginregistration_pb2_grpc",
}


PRODUCT = ("fracplugin", "fracplugin_demo")
"""The product package and the demo's (its players use the product's transport)."""


def _product_imports(path: Path) -> list[str]:
    """Every ``fracplugin...`` module (or ``module.name``) a file imports, at any depth in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PRODUCT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PRODUCT:
                # "from fracplugin._proto import nri_pb2" names the module nri_pb2
                found += [f"{node.module}.{a.name}" if node.module in ("fracplugin", "fracplugin._proto")
                          else node.module for a in node.names]
    return found


def test_the_peer_files_exist() -> None:
    names = {p.name for p in PEER_FILES}
    assert {"ttrpc_wire.py", "nri_runtime.py", "kubelet.py", "fake_kubelet.py"} <= names


@pytest.mark.parametrize("path", PEER_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_peers_import_only_message_schemas_from_the_product(path: Path) -> None:
    bad = [m for m in _product_imports(path) if m not in ALLOWED]
    assert bad == [], f"{path.relative_to(REPO)} imports product code: {bad}"


def test_the_checker_sees_product_imports(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("import fracplugin.nri.ttrpc\nfrom fracplugin.kubelet import registration\n"
                 "from fracplugin._proto import ttrpc_pb2, nri_pb2\nfrom fracplugin_demo.kubelet import Kubelet\n"
                 "def f():\n    from fracplugin.nri.transport import NriTransport\n")
    assert [m for m in _product_imports(f) if m not in ALLOWED] == [
        "fracplugin.nri.ttrpc", "fracplugin.kubelet", "fracplugin._proto.ttrpc_pb2", "fracplugin_demo.kubelet",
        "fracplugin.nri.transport"]


def test_importing_the_peers_loads_no_product_transport() -> None:
    # Also what the imports pull in at run time (a module-level import in a schema module, say).
    code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + '/tests/component')\n"
            "import tests.peers.ttrpc_wire, tests.peers.nri_runtime, tests.peers.kubelet, nri_runtime, fake_kubelet\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('fracplugin'))))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    assert loaded - ALLOWED - {"fracplugin", "fracplugin._proto"} == set()


def _absolute_imports(path: Path, package: str) -> list[str]:
    """Modules a source file of ``package`` imports, relative imports resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def test_the_product_never_imports_the_demo() -> None:
    # fracplugin_demo holds the demo and its players (tools, not doors); fracplugin.cli names it as a
    # string and imports it only for `fracplugin demo`, so no module of fracplugin imports it.
    src = REPO / "src" / "fracplugin"
    users = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent)
        package = ".".join(rel.with_suffix("").parts[:-1]) if path.name != "__init__.py" else ".".join(rel.parts[:-1])
        if any(m.split(".")[0] == "fracplugin_demo" for m in _absolute_imports(path, package)):
            users.append(str(rel))
    assert users == []
