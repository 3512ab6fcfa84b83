#!/usr/bin/env python3
"""Regenerate fracplugin's protobuf/gRPC Python code from proto/**.

Usage::

    .venv/bin/python scripts/genproto.py            # write src/fracplugin/_proto/
    .venv/bin/python scripts/genproto.py --out DIR  # write into DIR instead
    .venv/bin/python scripts/genproto.py --check    # exit 1 if the committed code is stale

What it does (deterministic: same protos + same grpcio-tools = same bytes):

1. Runs ``grpc_tools.protoc`` (the one installed in the running interpreter)
   with ``-I proto`` over the API files, producing ``*_pb2.py`` and
   ``*_pb2.pyi`` for all of them and ``*_pb2_grpc.py`` for the gRPC APIs
   (device plugin, PodResources, DRA, plugin registration). NRI and the ttrpc envelope travel over
   ttrpc, not gRPC, so they get no ``_grpc`` module.
2. Flattens the output into one package with the module names the rest of
   the code imports (``fracplugin._proto.nri_pb2`` etc.) and rewrites the
   generated absolute imports (``from deviceplugin.v1beta1 import api_pb2``)
   into package-relative ones. The descriptor file names stay the proto paths
   (``nri/v1alpha1/api.proto`` ...), which keeps them unique in the default
   descriptor pool.
3. Writes ``__init__.py``.

Errors: exits non-zero with protoc's message when protoc fails; ``--check``
exits 1 and lists the differing files when the target differs.

Concurrency: a one-shot script; it writes to a temporary directory and
replaces the target files one by one (not atomic as a whole).
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"
DEFAULT_OUT = REPO / "src" / "fracplugin" / "_proto"
PACKAGE = "fracplugin._proto"

# proto path (relative to proto/) -> flat module stem, and whether it is a gRPC API.
PROTOS: dict[str, tuple[str, bool]] = {
    "ttrpc/ttrpc.proto": ("ttrpc", False),
    "nri/v1alpha1/api.proto": ("nri", False),
    "deviceplugin/v1beta1/api.proto": ("deviceplugin", True),
    "podresources/v1/api.proto": ("podresources", True),
    "dra/v1/api.proto": ("dra_v1", True),
    "dra/v1beta1/api.proto": ("dra_v1beta1", True),
    "pluginregistration/v1/api.proto": ("pluginregistration", True),
}

INIT_PY = '''\
"""Generated protobuf / gRPC code for fracplugin. DO NOT EDIT.

Regenerate with ``make proto`` (``.venv/bin/python scripts/genproto.py``) from
the sources in ``proto/``; ``tests/unit/test_proto_current.py`` fails when
this package is stale.

Modules:

- ``ttrpc_pb2``: ttrpc envelope (``Request``, ``Response``, ``KeyValue``,
  ``StringList``, ``Status`` with the google.rpc.Status layout).
- ``nri_pb2``: NRI plugin API, protobuf package ``nri.pkg.api.v1alpha1``.
- ``deviceplugin_pb2`` / ``deviceplugin_pb2_grpc``: kubelet device plugin
  API ``v1beta1``.
- ``podresources_pb2`` / ``podresources_pb2_grpc``: kubelet PodResources
  API ``v1``.
- ``dra_v1_pb2`` / ``dra_v1_pb2_grpc`` and ``dra_v1beta1_pb2`` /
  ``dra_v1beta1_pb2_grpc``: kubelet DRA plugin API
  ``k8s.io.kubelet.pkg.apis.dra.v1`` and ``.v1beta1``.
- ``pluginregistration_pb2`` / ``pluginregistration_pb2_grpc``: kubelet
  plugin registration (``pluginregistration.Registration``).
"""
'''


def _module_of(proto: str) -> str:
    """'nri/v1alpha1/api.proto' -> the protoc-style dotted module 'nri.v1alpha1.api_pb2'."""
    return proto[: -len(".proto")].replace("/", ".") + "_pb2"


def _rewrite(text: str) -> str:
    """Turn protoc's absolute imports and module names into flat, package-relative ones."""
    for proto, (stem, _grpc) in PROTOS.items():
        dotted = _module_of(proto)  # e.g. deviceplugin.v1beta1.api_pb2
        pkg, _, mod = dotted.rpartition(".")
        # `from deviceplugin.v1beta1 import api_pb2 as X` -> `from . import deviceplugin_pb2 as X`
        text = re.sub(
            rf"^from {re.escape(pkg)} import {re.escape(mod)}\b",
            f"from . import {stem}_pb2",
            text,
            flags=re.MULTILINE,
        )
        # `import ttrpc_pb2 as X` style (top-level protos) -> relative
        text = re.sub(
            rf"^import {re.escape(dotted)} as ",
            f"from . import {stem}_pb2 as ",
            text,
            flags=re.MULTILINE,
        )
        # module name recorded on the generated classes
        text = text.replace(f"'{dotted}'", f"'{PACKAGE}.{stem}_pb2'")
    return text


def generate(out_dir: Path) -> list[str]:
    """Generate the package into ``out_dir`` (created if missing).

    Returns the sorted list of file names written. Raises ``RuntimeError``
    when protoc fails (message = protoc's stderr summary).
    """
    from grpc_tools import protoc  # imported late: only needed when generating
    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    with tempfile.TemporaryDirectory(prefix="genproto") as tmp:
        all_protos = list(PROTOS)
        grpc_protos = [p for p, (_s, g) in PROTOS.items() if g]
        args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", *all_protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {all_protos}")
        args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}",
                f"--grpc_python_out={tmp}", *grpc_protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc (grpc) failed for {grpc_protos}")
        for proto, (stem, is_grpc) in PROTOS.items():
            base = Path(tmp) / proto[: -len(".proto")]
            outputs = {f"{stem}_pb2.py": base.parent / (base.name + "_pb2.py"),
                       f"{stem}_pb2.pyi": base.parent / (base.name + "_pb2.pyi")}
            if is_grpc:
                outputs[f"{stem}_pb2_grpc.py"] = base.parent / (base.name + "_pb2_grpc.py")
            for name, src in outputs.items():
                text = _rewrite(src.read_text(encoding="utf-8"))
                (out_dir / name).write_text(text, encoding="utf-8")
                written.append(name)
    (out_dir / "__init__.py").write_text(INIT_PY, encoding="utf-8")
    written.append("__init__.py")
    return sorted(written)


def compare(expected_dir: Path, actual_dir: Path) -> list[str]:
    """Return human-readable differences between two generated trees ([] = same).

    Compares every file the generator writes; extra ``*.py``/``*.pyi`` files in
    ``actual_dir`` (left over from a removed proto) count as differences.
    """
    problems: list[str] = []
    exp = {p.name for p in expected_dir.iterdir() if p.is_file()}
    act = {p.name for p in actual_dir.iterdir()
           if p.is_file() and p.suffix in (".py", ".pyi")} if actual_dir.is_dir() else set()
    for name in sorted(exp - act):
        problems.append(f"missing: {name}")
    for name in sorted(act - exp):
        problems.append(f"unexpected (stale): {name}")
    for name in sorted(exp & act):
        a = (expected_dir / name).read_text(encoding="utf-8")
        b = (actual_dir / name).read_text(encoding="utf-8")
        if a != b:
            diff = difflib.unified_diff(b.splitlines(), a.splitlines(),
                                        f"committed/{name}", f"regenerated/{name}", lineterm="", n=1)
            problems.append(f"differs: {name}\n" + "\n".join(list(diff)[:20]))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output package directory")
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    ns = ap.parse_args(argv)
    if ns.check:
        with tempfile.TemporaryDirectory(prefix="genproto-check") as tmp:
            generate(Path(tmp))
            problems = compare(Path(tmp), ns.out)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("generated code is stale: run `make proto`", file=sys.stderr)
            return 1
        return 0
    with tempfile.TemporaryDirectory(prefix="genproto-out") as tmp:
        names = generate(Path(tmp))
        ns.out.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(Path(tmp) / name, ns.out / name)
    print(f"wrote {len(names)} files to {os.path.relpath(ns.out, Path.cwd())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
