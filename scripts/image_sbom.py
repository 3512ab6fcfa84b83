"""Read the OCI archive ``make image`` writes, and write an SPDX SBOM of each
architecture's image in it.

    python scripts/image_sbom.py ARCHIVE OUTDIR
        -> OUTDIR/fracplugin-<version>-linux-<arch>.spdx.json, one per image in
           the archive's index (<version>: pyproject.toml's); the paths are
           printed, one a line

The archive is an OCI image layout in a tar (OCI image spec, "image layout"):
``index.json`` names one image index (``make image``: ``buildah manifest push
--all``), whose manifests each carry a ``platform``; each manifest names a
config and gzip layers, as blobs at ``blobs/<alg>/<hex>``. ``read_index``
returns them per architecture; ``make image-test`` (tests/image) reads the
archive through it too, so that the SBOM and the test see the same images.

The SBOM (SPDX 2.3, JSON) lists what the image's own package databases say
is installed, read from the layers in order (whiteouts applied to the two
places read):

- Debian packages: ``/var/lib/dpkg/status`` entries whose Status is
  ``install ok installed``, as ``pkg:deb/debian/<name>@<version>?arch=<arch>``;
- Python distributions in the virtualenv: every
  ``/opt/venv/lib/python*/site-packages/*.dist-info/METADATA``, as
  ``pkg:pypi/<name>@<version>`` (name normalised as PEP 503 says), with the
  SPDX licence expression where the metadata has one (``License-Expression``,
  core metadata 2.4), else NOASSERTION.

No file is hashed (``filesAnalyzed: false``); the document's namespace is made
of the image manifest's digest, so the same image gives the same SBOM.
Errors: ValueError for an archive that is not such a layout (a message naming
the archive and what is missing).
"""

from __future__ import annotations

import email.parser
import io
import json
import re
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[1]
TOOL = "fracplugin scripts/image_sbom.py"
DPKG_STATUS = "var/lib/dpkg/status"
DIST_INFO = re.compile(r"^opt/venv/lib/python[0-9.]+/site-packages/([^/]+)\.dist-info/METADATA$")


@dataclass(frozen=True)
class Image:
    """One platform's image of the index: ``arch`` (OCI ``platform.architecture``,
    e.g. amd64, arm64), ``manifest_digest`` (``sha256:<hex>``), the parsed
    ``config``, and the ``layers`` as bytes (gzip tars), bottom first."""

    arch: str
    manifest_digest: str
    config: dict[str, Any]
    layers: list[bytes]


def read_index(path: Path) -> dict[str, Image]:
    """Every image of the OCI archive at ``path``, by architecture, in the
    index's order. ``index.json`` must name exactly one descriptor, an image
    index whose manifests all carry ``platform.os == "linux"`` and distinct
    architectures. Raises ValueError naming the archive and the rule broken."""
    with tarfile.open(path) as t:
        def blob(digest: str) -> bytes:
            alg, _, hexd = digest.partition(":")
            try:
                f = t.extractfile(f"blobs/{alg}/{hexd}")
            except KeyError:
                f = None
            if f is None:
                raise ValueError(f"{path}: blob {digest} missing")
            return f.read()

        try:
            top = t.extractfile("index.json")
        except KeyError:
            top = None
        if top is None:
            raise ValueError(f"{path}: no index.json (not an OCI image layout)")
        descs = json.loads(top.read())["manifests"]
        if len(descs) != 1:
            raise ValueError(f"{path}: index.json must name one image index, names {len(descs)} descriptors")
        index = json.loads(blob(descs[0]["digest"]))
        if "manifests" not in index:
            raise ValueError(f"{path}: {descs[0]['digest']} is a single image, not an image index "
                             f"(mediaType {index.get('mediaType')})")
        images: dict[str, Image] = {}
        for d in index["manifests"]:
            platform = d.get("platform") or {}
            arch = platform.get("architecture")
            if platform.get("os") != "linux" or not arch:
                raise ValueError(f"{path}: manifest {d['digest']} has platform {platform}, want os linux and an architecture")
            if arch in images:
                raise ValueError(f"{path}: two manifests for linux/{arch}")
            manifest = json.loads(blob(d["digest"]))
            config = json.loads(blob(manifest["config"]["digest"]))
            if config.get("architecture") != arch:
                raise ValueError(f"{path}: linux/{arch} manifest's config says architecture {config.get('architecture')}")
            images[arch] = Image(arch, d["digest"], config, [blob(layer["digest"]) for layer in manifest["layers"]])
    return images


def package_databases(layers: list[bytes]) -> tuple[str, dict[str, str]]:
    """(text of /var/lib/dpkg/status, {dist-info name: METADATA text}) as the
    image sees them: layers applied bottom first, a whiteout of a file or of
    a directory above it removes what lower layers gave."""
    status = ""
    metadata: dict[str, str] = {}
    for data in layers:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as t:
            for m in t:
                name = m.name.lstrip("./").lstrip("/")
                base, parent = name.rpartition("/")[2], name.rpartition("/")[0]
                if base.startswith(".wh."):
                    gone = f"{parent}/{base[len('.wh.'):]}" if base != ".wh..wh..opq" else parent
                    if DPKG_STATUS == gone or DPKG_STATUS.startswith(gone + "/"):
                        status = ""
                    for key in [k for k in metadata if f"{k}/".startswith(gone + "/")]:
                        del metadata[key]
                    continue
                if not m.isfile():
                    continue
                if name == DPKG_STATUS:
                    status = t.extractfile(m).read().decode()  # type: ignore[union-attr]
                elif DIST_INFO.match(name):
                    metadata[name.rpartition("/")[0]] = t.extractfile(m).read().decode()  # type: ignore[union-attr]
    return status, metadata


def _deb_packages(status: str) -> list[dict[str, str]]:
    """Installed entries of a dpkg status file: Package, Version, Architecture."""
    out = []
    for para in status.split("\n\n"):
        fields: dict[str, str] = {}
        for line in para.splitlines():
            if line and not line[0].isspace() and ":" in line:
                k, _, v = line.partition(":")
                fields[k] = v.strip()
        if fields.get("Status") == "install ok installed":
            out.append(fields)
    return out


def _spdx_id(kind: str, name: str) -> str:
    return f"SPDXRef-{kind}-" + re.sub(r"[^A-Za-z0-9.-]", "-", name)


def sbom(image: Image, version: str) -> dict[str, Any]:
    """The SPDX 2.3 document (a JSON-ready dict) of one image of fracplugin
    ``version``: the image as the described package, each Debian package and
    Python distribution it contains as a package with a purl."""
    arch = image.arch
    status, metadata = package_databases(image.layers)
    if not status:
        raise ValueError(f"linux/{arch}: no {DPKG_STATUS} in the image")
    if not metadata:
        raise ValueError(f"linux/{arch}: no dist-info METADATA under /opt/venv")
    top = f"SPDXRef-image-fracplugin-{arch}"
    packages: list[dict[str, Any]] = [{
        "name": "fracplugin", "SPDXID": top, "versionInfo": version, "primaryPackagePurpose": "CONTAINER",
        "downloadLocation": "NOASSERTION", "filesAnalyzed": False, "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "NOASSERTION", "checksums": [
            {"algorithm": "SHA256", "checksumValue": image.manifest_digest.partition(":")[2]}],
        "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                          "referenceLocator": f"pkg:oci/fracplugin@{quote(image.manifest_digest)}?arch={arch}"}],
    }]
    for deb in sorted(_deb_packages(status), key=lambda f: f["Package"]):
        name, ver, darch = deb["Package"], deb.get("Version", ""), deb.get("Architecture", arch)
        packages.append({
            "name": name, "SPDXID": _spdx_id("deb", f"{name}-{darch}"), "versionInfo": ver,
            "supplier": "Organization: Debian", "downloadLocation": "NOASSERTION", "filesAnalyzed": False,
            "licenseConcluded": "NOASSERTION", "licenseDeclared": "NOASSERTION",
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:deb/debian/{name}@{quote(ver, safe='')}?arch={darch}"}],
        })
    parser = email.parser.HeaderParser()
    for key in sorted(metadata, key=lambda k: re.sub(r"[-_.]+", "-", k.rpartition("/")[2]).lower()):
        meta = parser.parsestr(metadata[key])
        name, ver = meta["Name"], meta["Version"]
        if not name or not ver:
            raise ValueError(f"linux/{arch}: /{key}/METADATA has no Name or Version")
        norm = re.sub(r"[-_.]+", "-", name).lower()
        packages.append({
            "name": name, "SPDXID": _spdx_id("pypi", norm), "versionInfo": ver,
            "downloadLocation": "NOASSERTION", "filesAnalyzed": False, "licenseConcluded": "NOASSERTION",
            "licenseDeclared": meta.get("License-Expression") or "NOASSERTION",
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:pypi/{norm}@{quote(ver, safe='')}"}],
        })
    return {
        "spdxVersion": "SPDX-2.3", "dataLicense": "CC0-1.0", "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"fracplugin-{version}-linux-{arch}",
        "documentNamespace": f"urn:fracplugin:image:{image.manifest_digest}",
        "creationInfo": {"created": image.config.get("created", "1970-01-01T00:00:00Z")[:19] + "Z",
                         "creators": [f"Tool: {TOOL}"]},
        "documentDescribes": [top],
        "packages": packages,
        "relationships": [{"spdxElementId": top, "relationshipType": "CONTAINS", "relatedSpdxElement": p["SPDXID"]}
                          for p in packages[1:]],
    }


def main(argv: list[str]) -> int:
    """CLI: ``ARCHIVE OUTDIR``; prints each SBOM's path. Exit 2 on bad usage,
    1 on an archive that is not ``make image``'s layout."""
    if len(argv) != 2:
        print("usage: image_sbom.py ARCHIVE OUTDIR", file=sys.stderr)
        return 2
    archive, outdir = Path(argv[0]), Path(argv[1])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    try:
        images = read_index(archive)
        outdir.mkdir(parents=True, exist_ok=True)
        for arch, image in images.items():
            out = outdir / f"fracplugin-{version}-linux-{arch}.spdx.json"
            out.write_text(json.dumps(sbom(image, version), indent=1) + "\n")
            print(out)
    except ValueError as e:
        print(f"image_sbom: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
