"""The image ``make image`` built: what is in it, and that it runs.

``make image-test`` (after ``make image``; needs root and runc, as ``.ci/run``
has them) reads the OCI archive that ``make image`` wrote under
``build/image/`` (or ``$FRACPLUGIN_IMAGE_ARCHIVE``): one OCI image index with
an image for linux/amd64 and one for linux/arm64 (``scripts/image_sbom.py``
``read_index``, the reader the release's SBOM uses). For each image it unpacks
the layers in order with ``tarfile`` (OCI whiteouts applied) into a root
filesystem, and checks:

- the image config: ENTRYPOINT ``["fracplugin", "run"]``, ``/opt/venv/bin``
  first on PATH, the Dockerfile's ENV (MALLOC_ARENA_MAX, NVIDIA_*), root user,
  the index's architecture;
- every ELF file (programs, shared libraries, the wheels' native modules) is
  for that architecture: ``e_machine`` of its ELF header (62 x86-64, 183
  AArch64; System V ABI, ELF header), read with Python, no ``file`` needed;
- the contents: the ``fracplugin`` entry point in the virtualenv, no
  compiler, no pip, no uv, nothing under ``/var/lib/apt/lists``, no NVML or
  MPS binaries (they come from the host driver through the NVIDIA container
  toolkit: ADR 0002, 0027);
- the size of each image (printed; bounded so that a build that drags in a
  toolchain fails);
- the SBOM ``scripts/image_sbom.py`` writes for it lists the image's Debian
  packages and Python distributions with their architecture and versions.

The image of the machine's own architecture runs: ``fracplugin version`` and
an import of every module the daemon loads in the unpacked root filesystem
under runc with the DaemonSet's settings (read-only root, every capability
dropped and the chart's set added back, no new privileges), and once by
chroot; ``fracplugin run`` on the simulated node in the same container:
/healthz, /readyz, /metrics and ``fracplugin status`` answer, SIGTERM ends it
with 0. The other architecture's image runs ``fracplugin version`` and the
same imports by chroot under qemu-user-static (binfmt_misc; ``make image``
registers the handler it needs).

Nothing is skipped: a missing archive, architecture, runc, emulation or root
is a failure naming what to run (ADR 0027).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
IMAGE_DIR = REPO / "build" / "image"
VALUES = REPO / "deploy" / "helm" / "fracplugin" / "values.yaml"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# One image's gzip layers measured 73 MB with Debian bookworm's python3.11
# (docs/e2e.md); a compiler (gcc alone: ~40 MB compressed) or a second
# interpreter would pass this bound.
MAX_IMAGE_BYTES = 100 * 1024 * 1024
# What make image builds, and each one's ELF e_machine (System V ABI: EM_X86_64, EM_AARCH64).
ARCHES = ("amd64", "arm64")
E_MACHINE = {"amd64": 62, "arm64": 183}
NATIVE_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]
PYTHON_VERSION = re.search(r"^ARG PYTHON_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.M).group(1)  # type: ignore[union-attr]
RUN_TIMEOUT_S = 120  # a bound on a hung runc, not a wait: each command returns when it exits

COMPILER = re.compile(r"^(usr/)?(local/)?bin/((x86_64|aarch64)-linux-gnu-)?(gcc|g\+\+|cc|c\+\+|clang|clang\+\+|cpp|ld|as)(-[0-9.]+)?$")
PIP = re.compile(r"(^|/)(site|dist)-packages/pip/|(^|/)bin/pip[0-9.]*$")


def archive_path() -> Path:
    """``$FRACPLUGIN_IMAGE_ARCHIVE``, else ``build/image/fracplugin-<version>.oci.tar``."""
    env = os.environ.get("FRACPLUGIN_IMAGE_ARCHIVE")
    path = Path(env) if env else IMAGE_DIR / f"fracplugin-{VERSION}.oci.tar"
    if not path.is_file():
        pytest.fail(f"no image archive at {path}: run `make image` first (its last line is the archive's path)")
    return path


def _load_sbom_module() -> Any:
    spec = importlib.util.spec_from_file_location("image_sbom", REPO / "scripts" / "image_sbom.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["image_sbom"] = mod  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


image_sbom = _load_sbom_module()


def unpack(layers: list[bytes], root: Path) -> None:
    """Apply the layers in order (OCI image spec, "Applying changesets"):
    ``.wh.<name>`` deletes ``<name>`` of the lower layers, ``.wh..wh..opq``
    empties its directory of them; device nodes and FIFOs are left out (the
    runtime provides /dev)."""
    import io

    root.mkdir(parents=True, exist_ok=True)
    for data in layers:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as t:
            members = t.getmembers()
            keep = []
            for m in members:
                name = m.name.lstrip("./").lstrip("/")
                base, parent = os.path.basename(name), os.path.dirname(name)
                if base == ".wh..wh..opq":
                    d = root / parent
                    if d.is_dir():
                        for child in d.iterdir():
                            if child.is_dir() and not child.is_symlink():
                                shutil.rmtree(child)
                            else:
                                child.unlink()
                elif base.startswith(".wh."):
                    target = root / parent / base[len(".wh."):]
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target)
                    elif target.exists() or target.is_symlink():
                        target.unlink()
                elif not (m.ischr() or m.isblk() or m.isfifo()):
                    keep.append(m)
            for m in keep:  # a file replacing a directory or a link of a lower layer
                dest = root / m.name.lstrip("./").lstrip("/")
                if (dest.is_symlink() or dest.exists()) and not (m.isdir() and dest.is_dir() and not dest.is_symlink()):
                    if dest.is_dir() and not dest.is_symlink():
                        shutil.rmtree(dest)
                    else:
                        dest.unlink()
            kw: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
            t.extractall(root, members=keep, numeric_owner=True, **kw)  # our own build's archive


def files_of(root: Path) -> list[str]:
    """Every path of the unpacked tree, relative, without following links."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for n in dirnames + filenames:
            out.append(n if rel == "." else f"{rel}/{n}")
    return sorted(out)


def elf_machine(head: bytes) -> int | None:
    """``e_machine`` of an ELF header (its first 20 bytes or more), in the
    byte order EI_DATA names (1 little, 2 big endian); None if ``head`` is not
    ELF (no ``\\x7fELF`` magic). System V ABI, "ELF Header"."""
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")


def elf_files(root: Path, files: list[str]) -> dict[str, int]:
    """Every regular file of the tree that is ELF, with its ``e_machine``."""
    out = {}
    for f in files:
        p = root / f
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as fh:
                m = elf_machine(fh.read(20))
            if m is not None:
                out[f] = m
    return out


_unpacked: dict[str, dict[str, Any]] = {}


def load_image(arch: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The ``arch`` image of the archive, unpacked once per test session:
    path, config, root, files, layer count, layer bytes, manifest digest."""
    if arch not in _unpacked:
        path = archive_path()
        images = image_sbom.read_index(path)
        assert arch in images, f"{path}: no linux/{arch} image in the index (has {sorted(images)}): run `make image`"
        img = images[arch]
        root = tmp_path_factory.mktemp(f"image-{arch}") / "rootfs"
        unpack(img.layers, root)
        _unpacked[arch] = {"path": path, "arch": arch, "config": img.config, "root": root, "files": files_of(root),
                           "layers": len(img.layers), "layer_bytes": sum(len(x) for x in img.layers), "oci": img}
    return _unpacked[arch]


@pytest.fixture(scope="module", params=ARCHES)
def image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each architecture's image in turn."""
    return load_image(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The image of this machine's architecture (the one runc runs)."""
    return load_image(NATIVE_ARCH, tmp_path_factory)


def test_archive_is_one_index_of_both_architectures() -> None:
    path = archive_path()
    images = image_sbom.read_index(path)
    assert sorted(images) == sorted(ARCHES), f"{path}: index has {sorted(images)}, want {sorted(ARCHES)}"
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB, " + ", ".join(
        f"linux/{a} {images[a].manifest_digest[:19]}" for a in images))


def test_image_config(image: dict[str, Any]) -> None:
    cfg = image["config"]["config"]
    env = dict(e.split("=", 1) for e in cfg.get("Env", []))
    assert cfg.get("Entrypoint") == ["fracplugin", "run"]
    assert env["PATH"].split(":")[0] == "/opt/venv/bin", env["PATH"]
    assert "/usr/bin" in env["PATH"].split(":"), env["PATH"]  # the base's PATH is kept after the venv
    assert env.get("MALLOC_ARENA_MAX") == "2"
    assert env.get("NVIDIA_DRIVER_CAPABILITIES") == "compute,utility"
    assert cfg.get("User") in ("0:0", "0")
    assert image["config"]["architecture"] == image["arch"] and image["config"]["os"] == "linux"


def test_every_binary_is_for_the_image_architecture(image: dict[str, Any]) -> None:
    elves = elf_files(image["root"], image["files"])
    want = E_MACHINE[image["arch"]]
    wrong = {f: m for f, m in elves.items() if m != want}
    print(f"linux/{image['arch']}: {len(elves)} ELF files, all e_machine {want}" if not wrong else "")
    assert not wrong, f"linux/{image['arch']}: {len(wrong)} of {len(elves)} ELF files are not e_machine {want}: " + \
        ", ".join(f"/{f} ({m})" for f, m in sorted(wrong.items())[:20])
    # the interpreter, the C library and a wheel's native module are among those checked
    native_modules = [f for f in elves if f.startswith("opt/venv/") and f.endswith(".so")]
    assert f"usr/bin/python{PYTHON_VERSION}" in elves and native_modules, sorted(elves)[:40]
    assert any(re.search(r"(^|/)libc\.so\.6$", f) for f in elves), "no libc.so.6 among the ELF files"
    assert any("/grpc/" in f for f in native_modules), native_modules


def test_elf_machine_reads_the_header() -> None:
    """The header reader on made-up headers: both byte orders, both machines
    the images are built for, and files that are not ELF."""
    def header(machine: int, data: int) -> bytes:
        order = "little" if data == 1 else "big"
        return b"\x7fELF" + bytes([2, data, 1, 0]) + bytes(8) + (2).to_bytes(2, order) + machine.to_bytes(2, order)
    assert elf_machine(header(62, 1)) == 62 and elf_machine(header(183, 1)) == 183
    assert elf_machine(header(183, 2)) == 183
    assert elf_machine(b"#!/bin/sh\n" + bytes(20)) is None and elf_machine(b"\x7fELF") is None


def content_problems(root: Path, files: list[str]) -> list[str]:
    """What must not be in the final image (ADR 0027): a compiler, pip, uv,
    anything under /var/lib/apt/lists, NVML or MPS binaries (the host
    driver's, injected by the NVIDIA container toolkit)."""
    problems = [f"compiler: /{f}" for f in files if COMPILER.match(f)]
    problems += [f"pip: /{f}" for f in files if PIP.search(f + ("/" if (root / f).is_dir() else ""))]
    problems += [f"uv: /{f}" for f in files if re.search(r"(^|/)bin/uvx?$", f)]
    problems += [f"apt package lists: /{f}" for f in files if f.startswith("var/lib/apt/lists/")]
    problems += [f"driver binary (must come from the host): /{f}" for f in files
                 if re.search(r"(^|/)(libnvidia-ml\.so[.0-9]*|nvidia-cuda-mps-(control|server)|nvidia-smi)$", f)]
    return problems


def test_image_contents(image: dict[str, Any]) -> None:
    root: Path = image["root"]
    entry = root / "opt/venv/bin/fracplugin"
    assert entry.is_file() and os.access(entry, os.X_OK), "the fracplugin entry point is missing from /opt/venv/bin"
    assert "fracplugin.cli" in entry.read_text(), entry.read_text()
    python = root / "opt/venv/bin/python"
    assert python.is_symlink() or python.is_file(), "the virtualenv has no python"
    assert content_problems(root, image["files"]) == []


def _layer(entries: dict[str, bytes | None]) -> bytes:
    """A gzip tar layer: name -> file content, or None for a directory."""
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                t.addfile(info)
            else:
                info.size, info.mode = len(data), 0o755
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_unpack_applies_whiteouts_and_the_checks_see_what_is_left(tmp_path: Path) -> None:
    """The unpacker and the content checks on made-up layers: a lower layer's
    compiler removed by a whiteout is gone, an opaque directory hides the lower
    layer's lists, and what is left is reported."""
    lower = _layer({"usr/": None, "usr/bin/": None, "usr/bin/gcc-12": b"elf", "usr/bin/pip3": b"#!",
                    "var/lib/apt/lists/": None, "var/lib/apt/lists/deb_Packages": b"x",
                    "opt/venv/lib/python3.11/site-packages/pip/": None,
                    "opt/venv/lib/python3.11/site-packages/pip/__init__.py": b""})
    upper = _layer({"usr/bin/.wh.gcc-12": b"", "var/lib/apt/lists/.wh..wh..opq": b"",
                    "var/lib/apt/lists/lock": b"", "usr/local/bin/": None, "usr/local/bin/uv": b"elf"})
    root = tmp_path / "rootfs"
    unpack([lower, upper], root)
    files = files_of(root)
    assert "usr/bin/gcc-12" not in files and "var/lib/apt/lists/deb_Packages" not in files
    assert sorted(content_problems(root, files)) == [
        "apt package lists: /var/lib/apt/lists/lock",
        "pip: /opt/venv/lib/python3.11/site-packages/pip",
        "pip: /opt/venv/lib/python3.11/site-packages/pip/__init__.py",
        "pip: /usr/bin/pip3",
        "uv: /usr/local/bin/uv",
    ]
    unpack([_layer({"usr/": None, "usr/bin/": None, "usr/bin/x86_64-linux-gnu-gcc-12": b"elf"})], tmp_path / "cc")
    assert content_problems(tmp_path / "cc", files_of(tmp_path / "cc")) == ["compiler: /usr/bin/x86_64-linux-gnu-gcc-12"]


def test_image_size(image: dict[str, Any]) -> None:
    size = image["layer_bytes"]
    print(f"linux/{image['arch']}: {size / 1e6:.1f} MB of gzip layers, {image['layers']} layers,"
          f" {len(image['files'])} paths")
    assert size <= MAX_IMAGE_BYTES, f"linux/{image['arch']} is {size / 1e6:.1f} MB, over {MAX_IMAGE_BYTES / 1e6:.0f} MB"


def test_sbom_lists_the_image_packages(image: dict[str, Any]) -> None:
    """scripts/image_sbom.py on this image: every Debian package dpkg lists as
    installed and every distribution in the virtualenv, with the image's
    architecture and the versions the image holds."""
    doc = image_sbom.sbom(image["oci"], VERSION)
    arch, root = image["arch"], image["root"]
    purls = {p["name"]: p["externalRefs"][0]["referenceLocator"] for p in doc["packages"]}
    assert doc["spdxVersion"] == "SPDX-2.3" and doc["name"] == f"fracplugin-{VERSION}-linux-{arch}"
    status = (root / "var/lib/dpkg/status").read_text()
    installed = re.findall(r"^Package: (\S+)\n(?:.+\n)*?Status: install ok installed", status, re.M)
    debs = {n for n, u in purls.items() if u.startswith("pkg:deb/")}
    assert debs == set(installed), set(installed) ^ debs
    py = re.search(rf"^Package: python{PYTHON_VERSION}\n(?:.+\n)*?Version: (\S+)", status, re.M)
    assert py and purls[f"python{PYTHON_VERSION}"].endswith(f"?arch={arch}"), purls[f"python{PYTHON_VERSION}"]
    dists = sorted(p.name for p in root.glob("opt/venv/lib/python*/site-packages/*.dist-info"))
    pypi = [u for u in purls.values() if u.startswith("pkg:pypi/")]
    assert len(pypi) == len(dists) and f"pkg:pypi/fracplugin@{VERSION}" in pypi, (pypi, dists)
    assert any(u.startswith("pkg:pypi/grpcio@") for u in pypi), pypi
    assert len(doc["relationships"]) == len(doc["packages"]) - 1


def chart_capabilities() -> list[str]:
    """The capabilities the chart's securityContext adds back (values.yaml)."""
    values = yaml.safe_load(VALUES.read_text())
    sc = values["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] is True
    return [f"CAP_{c}" for c in sc["capabilities"]["add"]]


def runc_run(image: dict[str, Any], args: list[str], bundle: Path,
             binds: dict[str, Path] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in the unpacked root filesystem under runc as the
    DaemonSet runs the container: uid 0, the image's Env, read-only root,
    only the chart's capabilities, no new privileges, a tmpfs /tmp;
    ``binds``: container path -> host directory, read-only."""
    runc = shutil.which("runc")
    assert runc, "runc not found: apt-get install -y runc (make image-test runs the image under runc)"
    assert os.geteuid() == 0, "make image-test runs the image under runc as root"
    bundle.mkdir(parents=True, exist_ok=True)
    subprocess.run([runc, "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    caps = chart_capabilities()
    spec["root"] = {"path": str(image["root"]), "readonly": True}
    spec["process"].update(terminal=False, args=args, env=image["config"]["config"].get("Env", []), cwd="/",
                           noNewPrivileges=True, user={"uid": 0, "gid": 0},
                           capabilities={k: caps for k in ("bounding", "effective", "permitted")})
    spec["process"]["capabilities"]["inheritable"] = []
    spec["process"]["capabilities"]["ambient"] = []
    spec["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                           "options": ["nosuid", "nodev", "size=65536k"]})
    for dest, src in (binds or {}).items():
        spec["mounts"].append({"destination": dest, "type": "bind", "source": str(src), "options": ["rbind", "ro"]})
    spec["hostname"] = "fracplugin-image-test"
    (bundle / "config.json").write_text(json.dumps(spec))
    cid = f"fpimg-{uuid.uuid4().hex[:8]}"
    try:
        return subprocess.run([runc, "run", "--bundle", str(bundle), cid], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    finally:
        subprocess.run([runc, "delete", "--force", cid], capture_output=True)


def test_fracplugin_version_under_runc(native: dict[str, Any], tmp_path: Path) -> None:
    r = runc_run(native, ["fracplugin", "version"], tmp_path / "bundle")
    assert r.returncode == 0, f"fracplugin version under runc: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert VERSION in r.stdout, r.stdout


# Every module `fracplugin run` loads.
IMPORTS = ("import importlib\n"
           "for m in ('fracplugin.cli', 'fracplugin.daemon', 'grpc', 'google.protobuf', 'kubernetes', 'pynvml',"
           " 'prometheus_client', 'yaml', 'tenacity', 'ssl'):\n"
           "    importlib.import_module(m)\n"
           "print('ok')\n")


def test_daemon_modules_import_under_runc(native: dict[str, Any], tmp_path: Path) -> None:
    """Every module ``fracplugin run`` loads imports in the image (the
    wheels' native parts match the base's glibc and Python)."""
    r = runc_run(native, ["python", "-c", IMPORTS], tmp_path / "bundle")
    assert r.returncode == 0 and r.stdout.strip() == "ok", f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"


# Inside the container: start the daemon on the simulated node (no doors, no
# MPS: no runtime, kubelet or driver here), wait for /healthz, then read
# /healthz, /readyz, /metrics and `fracplugin status` as the probes, Prometheus
# and `kubectl exec` would, and stop it with SIGTERM as kubelet does.
DAEMON_PROBE = """
import json, signal, subprocess, sys, time, urllib.error, urllib.request
d = subprocess.Popen(["fracplugin", "run", "--simulate-node", "/sim/gpu-node-1.yaml", "--no-nri",
                      "--no-device-plugin", "--no-mps", "--state-dir", "/tmp/state", "--mps-root", "/tmp/mps",
                      "--health-address", "127.0.0.1:8080", "--metrics-address", "127.0.0.1:2112"])
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)
deadline = time.monotonic() + 90
while get("http://127.0.0.1:8080/healthz")[0] != 200:
    if d.poll() is not None or time.monotonic() > deadline:
        print(json.dumps({"error": "daemon not healthy", "exit": d.poll()})); sys.exit(1)
    time.sleep(0.1)
out = {k: get("http://127.0.0.1:" + u) for k, u in
       (("healthz", "8080/healthz"), ("readyz", "8080/readyz"), ("metrics", "2112/metrics"))}
st = subprocess.run(["fracplugin", "status", "--output", "json", "--state-dir", "/tmp/state"],
                    capture_output=True, text=True)
out["status"] = [st.returncode, st.stdout, st.stderr[-2000:]]
d.send_signal(signal.SIGTERM)
out["exit"] = d.wait(60)
print(json.dumps(out))
"""


def test_daemon_serves_under_runc_with_the_daemonset_settings(native: dict[str, Any], tmp_path: Path) -> None:
    """``fracplugin run`` in the image under the chart's capabilities and a
    read-only root: health, readiness, /metrics and ``fracplugin status``
    answer, and SIGTERM ends it cleanly."""
    r = runc_run(native, ["python", "-c", DAEMON_PROBE], tmp_path / "bundle",
                 binds={"/sim": REPO / "examples" / "nodes"})
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["healthz"][0] == 200, out["healthz"]
    assert out["readyz"][0] == 200, out["readyz"]
    assert out["metrics"][0] == 200 and "fracplugin_" in out["metrics"][1], out["metrics"][0]
    rc, stdout, stderr = out["status"]
    assert rc == 0, stderr
    node = yaml.safe_load((REPO / "examples" / "nodes" / "gpu-node-1.yaml").read_text())
    assert [g["uuid"] for g in json.loads(stdout)["gpus"]] == [g["uuid"] for g in node["gpus"]], stdout
    assert out["exit"] == 0, r.stderr[-4000:]


def chroot_run(image: dict[str, Any], args: list[str]) -> subprocess.CompletedProcess[str]:
    """``args`` run by chroot into the unpacked tree (root), with the image's environment."""
    assert os.geteuid() == 0, "make image-test chroots into the image as root"
    env = dict(e.split("=", 1) for e in image["config"]["config"].get("Env", []))
    return subprocess.run(["chroot", str(image["root"]), *args], capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S)


def test_fracplugin_version_by_chroot(native: dict[str, Any]) -> None:
    """The same without a runtime: chroot into the unpacked tree (root), with
    the image's environment."""
    r = chroot_run(native, ["/opt/venv/bin/fracplugin", "version"])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert VERSION in r.stdout, r.stdout


@pytest.mark.parametrize("arch", [a for a in ARCHES if a != NATIVE_ARCH])
def test_foreign_image_runs_under_emulation(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The other architecture's image, by chroot under qemu-user-static
    (binfmt_misc, the handler ``make image`` registered): its interpreter,
    ``fracplugin version`` and an import of every module the daemon loads,
    so its wheels' native modules load on its own glibc."""
    machine = {"amd64": "x86_64", "arm64": "aarch64"}[arch]
    handler = Path(f"/proc/sys/fs/binfmt_misc/qemu-{machine}")
    assert handler.is_file() and handler.read_text().startswith("enabled"), (
        f"no enabled binfmt_misc handler {handler}: apt-get install -y qemu-user-static arch-test, then"
        " `make image` registers it")
    image = load_image(arch, tmp_path_factory)
    r = chroot_run(image, ["/opt/venv/bin/fracplugin", "version"])
    assert r.returncode == 0 and VERSION in r.stdout, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    r = chroot_run(image, ["/opt/venv/bin/python", "-c", IMPORTS + "import platform; print(platform.machine())\n"])
    assert r.returncode == 0 and r.stdout.split() == ["ok", machine], f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
