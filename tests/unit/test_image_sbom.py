"""scripts/image_sbom.py on small OCI archives made here: the index reader
``make image-test`` and the release's SBOM share, and the SPDX document it
writes (the real archive is checked by tests/image, ``make image-test``)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("image_sbom", REPO / "scripts" / "image_sbom.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["image_sbom"] = mod
    spec.loader.exec_module(mod)
    return mod


image_sbom = _module()

STATUS = """Package: libc6
Status: install ok installed
Architecture: {arch}
Version: 2.36-9+deb12u10

Package: python3.11
Status: install ok installed
Architecture: {arch}
Version: 3.11.2-6+deb12u6
Description: an interpreter
 with a continuation line: Status: install ok installed

Package: gone
Status: deinstall ok config-files
Architecture: {arch}
Version: 1
"""


def layer(entries: dict[str, bytes | None]) -> bytes:
    """A gzip tar layer: name -> content, None for a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            else:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def meta(name: str, version: str, extra: str = "") -> bytes:
    return f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n{extra}\nA description.\n".encode()


SITE = "opt/venv/lib/python3.11/site-packages"


def image_layers(arch: str) -> list[bytes]:
    return [
        layer({"var/lib/dpkg/status": STATUS.format(arch=arch).encode()}),
        layer({f"{SITE}/grpcio-1.76.0.dist-info/METADATA": meta("grpcio", "1.76.0"),
               f"{SITE}/fracplugin-0.1.0.dist-info/METADATA": meta("fracplugin", "0.1.0",
                                                                  "License-Expression: Apache-2.0"),
               f"{SITE}/pip-25.0.dist-info/METADATA": meta("pip", "25.0"),
               f"{SITE}/Zope.Interface-7.0.dist-info/METADATA": meta("Zope.Interface", "7.0")}),
        layer({f"{SITE}/.wh.pip-25.0.dist-info": b""}),  # a later layer removes pip
    ]


def write_archive(path: Path, images: dict[str, tuple[str, list[bytes]]], top_level: str = "index") -> None:
    """An OCI archive: index.json -> an image index (or, with top_level
    "manifest", one image manifest) -> manifests {arch: (config arch, layers)}."""
    blobs: dict[str, bytes] = {}

    def put(data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    descs = []
    for arch, (config_arch, layers) in images.items():
        config = put(json.dumps({"architecture": config_arch, "os": "linux",
                                 "created": "2026-12-06T21:40:00.123456789Z", "config": {}}).encode())
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
                    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **put(x)}
                               for x in layers]}
        descs.append({"mediaType": manifest["mediaType"], **put(json.dumps(manifest).encode()),
                      "platform": {"os": "linux", "architecture": arch}})
    if top_level == "index":
        top = put(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                              "manifests": descs}).encode())
    else:
        top = {k: v for k, v in descs[0].items() if k != "platform"}
    with tarfile.open(path, "w") as t:
        for name, data in [("index.json", json.dumps({"schemaVersion": 2, "manifests": [top]}).encode()),
                           ("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
                           *[(f"blobs/sha256/{d[7:]}", b) for d, b in blobs.items()]]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def test_read_index_gives_each_architecture(tmp_path: Path) -> None:
    path = tmp_path / "two.oci.tar"
    write_archive(path, {"amd64": ("amd64", image_layers("amd64")), "arm64": ("arm64", image_layers("arm64"))})
    images = image_sbom.read_index(path)
    assert list(images) == ["amd64", "arm64"]
    assert images["arm64"].config["architecture"] == "arm64" and len(images["arm64"].layers) == 3
    assert images["amd64"].manifest_digest != images["arm64"].manifest_digest


@pytest.mark.parametrize("images, top_level, message", [
    ({"amd64": ("amd64", [])}, "manifest", "is a single image, not an image index"),
    ({"arm64": ("amd64", [])}, "index", "linux/arm64 manifest's config says architecture amd64"),
])
def test_read_index_refuses_what_make_image_does_not_write(tmp_path: Path, images: dict[str, Any],
                                                          top_level: str, message: str) -> None:
    path = tmp_path / "bad.oci.tar"
    write_archive(path, images, top_level)
    with pytest.raises(ValueError, match=message):
        image_sbom.read_index(path)


def test_sbom_lists_installed_debs_and_distributions_after_whiteouts(tmp_path: Path) -> None:
    path = tmp_path / "two.oci.tar"
    write_archive(path, {"amd64": ("amd64", image_layers("amd64")), "arm64": ("arm64", image_layers("arm64"))})
    image = image_sbom.read_index(path)["arm64"]
    doc = image_sbom.sbom(image, "0.1.0")
    purls = [p["externalRefs"][0]["referenceLocator"] for p in doc["packages"]]
    assert purls == [
        f"pkg:oci/fracplugin@{image.manifest_digest.replace(':', '%3A')}?arch=arm64",
        "pkg:deb/debian/libc6@2.36-9%2Bdeb12u10?arch=arm64",
        "pkg:deb/debian/python3.11@3.11.2-6%2Bdeb12u6?arch=arm64",
        "pkg:pypi/fracplugin@0.1.0",
        "pkg:pypi/grpcio@1.76.0",
        "pkg:pypi/zope-interface@7.0",
    ]
    licences = {p["name"]: p["licenseDeclared"] for p in doc["packages"]}
    assert licences["fracplugin"] == "Apache-2.0" and licences["grpcio"] == "NOASSERTION"
    assert doc["name"] == "fracplugin-0.1.0-linux-arm64" and doc["documentDescribes"] == [doc["packages"][0]["SPDXID"]]
    assert doc["creationInfo"]["created"] == "2026-12-06T21:40:00Z"
    assert doc["documentNamespace"] == f"urn:fracplugin:image:{image.manifest_digest}"
    assert len({p["SPDXID"] for p in doc["packages"]}) == len(doc["packages"])
    assert {r["relatedSpdxElement"] for r in doc["relationships"]} == {p["SPDXID"] for p in doc["packages"][1:]}


def test_main_writes_one_sbom_per_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "two.oci.tar"
    write_archive(path, {"amd64": ("amd64", image_layers("amd64")), "arm64": ("arm64", image_layers("arm64"))})
    assert image_sbom.main([str(path), str(tmp_path / "out")]) == 0
    written = capsys.readouterr().out.split()
    assert [Path(p).name for p in written] == [f"fracplugin-{VERSION}-linux-amd64.spdx.json",
                                               f"fracplugin-{VERSION}-linux-arm64.spdx.json"]
    assert json.loads(Path(written[0]).read_text())["spdxVersion"] == "SPDX-2.3"
    assert image_sbom.main([str(tmp_path / "missing.tar")]) == 2
    (tmp_path / "empty.tar").write_bytes(b"")
    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    assert image_sbom.main([str(tmp_path / "empty.tar"), str(tmp_path / "out")]) == 1
    assert "no index.json" in capsys.readouterr().err
