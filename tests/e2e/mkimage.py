#!/usr/bin/env python3
"""Build a tiny single-layer OCI image archive from a static busybox binary.

No registry, no docker: the archive is an OCI image layout in a tar file
(``oci-layout``, ``index.json``, ``blobs/sha256/...``) plus a docker-style
``manifest.json`` so that ``ctr images import`` accepts it under any name.

Usage::

    mkimage.py OUT.tar NAME [NAME...] [--busybox /bin/busybox]

The first NAME is the image reference written into the archive (both as the
OCI ``org.opencontainers.image.ref.name`` annotation, which ``ctr import``
turns into the image name, and as the docker ``RepoTags`` entry).  Extra names
are written as further index entries pointing at the same manifest, so the
same image can also serve as the pinned sandbox ("pause") image.

Layer contents: ``/bin/busybox`` and one symlink per applet in ``/bin``, and
empty ``/proc /sys /dev /tmp /etc /root /var`` directories.  The image's
default command (used by the sandbox container) is a shell loop that sleeps
forever and exits on SIGTERM, so a stopped sandbox ends promptly.

Concurrency model: none (a one-shot, single-threaded script).
Deterministic: every mtime is 0, so the same busybox gives the same digests.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import tarfile

LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"

# The sandbox ("pause") command: sleeps forever, exits 0 on TERM/INT.
PAUSE_CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]


def _dir(name: str) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE
    ti.mode = 0o1777 if name == "tmp" else 0o755
    return ti


def build_layer(busybox: str) -> bytes:
    """Return the uncompressed layer tar (bytes) holding busybox and its applet links.

    Raises OSError if ``busybox`` cannot be read, CalledProcessError if it
    cannot list its applets.
    """
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "dev", "etc", "proc", "root", "sys", "tmp", "var", "usr", "usr/bin",
                  "sbin"):
            tar.addfile(_dir(d))
        with open(busybox, "rb") as f:
            data = f.read()
        ti = tarfile.TarInfo("bin/busybox")
        ti.size = len(data)
        ti.mode = 0o755
        tar.addfile(ti, io.BytesIO(data))
        for a in sorted(set(applets)):
            if a == "busybox" or "/" in a:
                continue
            ti = tarfile.TarInfo(f"bin/{a}")
            ti.type = tarfile.SYMTYPE
            ti.linkname = "busybox"
            ti.mode = 0o777
            tar.addfile(ti)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n")):
            raw = text.encode()
            ti = tarfile.TarInfo(name)
            ti.size = len(raw)
            ti.mode = 0o644
            tar.addfile(ti, io.BytesIO(raw))
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build_archive(out: str, names: list[str], busybox: str) -> str:
    """Write the image archive to ``out``; return the manifest digest ("sha256:...")."""
    layer = build_layer(busybox)
    layer_digest = _sha(layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin:/sbin:/usr/bin"], "Cmd": PAUSE_CMD, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "fracplugin tests/e2e/mkimage.py"}],
    }
    config_raw = json.dumps(config, sort_keys=True).encode()
    config_digest = _sha(config_raw)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA,
        "config": {"mediaType": CONFIG_MEDIA, "digest": config_digest, "size": len(config_raw)},
        "layers": [{"mediaType": LAYER_MEDIA, "digest": layer_digest, "size": len(layer)}],
    }
    manifest_raw = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = _sha(manifest_raw)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {"mediaType": MANIFEST_MEDIA, "digest": manifest_digest, "size": len(manifest_raw),
             "platform": {"architecture": "amd64", "os": "linux"},
             "annotations": {"io.containerd.image.name": n,
                             "org.opencontainers.image.ref.name": n}}
            for n in names
        ],
    }
    docker_manifest = [{"Config": f"blobs/sha256/{config_digest[7:]}",
                        "RepoTags": names,
                        "Layers": [f"blobs/sha256/{layer_digest[7:]}"]}]
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
        "manifest.json": json.dumps(docker_manifest).encode(),
        f"blobs/sha256/{layer_digest[7:]}": layer,
        f"blobs/sha256/{config_digest[7:]}": config_raw,
        f"blobs/sha256/{manifest_digest[7:]}": manifest_raw,
    }
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            tar.addfile(_dir(d))
        for name, raw in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(raw)
            ti.mode = 0o644
            tar.addfile(ti, io.BytesIO(raw))
    return manifest_digest


def main(argv: list[str] | None = None) -> int:
    """CLI entry: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("names", nargs="+")
    ap.add_argument("--busybox", default="/bin/busybox")
    args = ap.parse_args(argv)
    print(build_archive(args.out, args.names, args.busybox))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
