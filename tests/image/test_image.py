"""The image ``make image`` built: what is in it, and that it runs.

``make image-test`` (after ``make image``; needs root and runc, as ``.ci/run``
has them) reads the OCI archive that ``make image`` wrote under
``build/image/`` (or ``$FRACPLUGIN_IMAGE_ARCHIVE``), unpacks its layers in
order with ``tarfile`` (OCI whiteouts applied) into a root filesystem, and
checks:

- the image config: ENTRYPOINT ``["fracplugin", "run"]``, ``/opt/venv/bin``
  first on PATH, the Dockerfile's ENV (MALLOC_ARENA_MAX, NVIDIA_*), root user;
- the contents: the ``fracplugin`` entry point in the virtualenv, no
  compiler, no pip, no uv, nothing under ``/var/lib/apt/lists``, no NVML or
  MPS binaries (they come from the host driver through the NVIDIA container
  toolkit: ADR 0002, 0027);
- the size of the archive (printed; bounded so that a build that drags in a
  toolchain fails);
- ``fracplugin version`` and an import of every module the daemon loads, run
  in the unpacked root filesystem under runc with the DaemonSet's settings
  (read-only root, every capability dropped and the chart's set added back,
  no new privileges), and once by chroot;
- ``fracplugin run`` on the simulated node in the same container: /healthz,
  /readyz, /metrics and ``fracplugin status`` answer, SIGTERM ends it with 0.

Nothing is skipped: a missing archive, runc or root is a failure naming what
to run (ADR 0027).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
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
# The archive measured 73 MB with Debian bookworm's python3.11 (docs/e2e.md);
# a compiler (gcc alone: ~40 MB compressed) or a second interpreter would
# pass this bound.
MAX_ARCHIVE_BYTES = 100 * 1024 * 1024
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


def read_oci(path: Path) -> tuple[dict[str, Any], list[bytes]]:
    """(image config, layer blobs in order) of an OCI archive (OCI image
    layout in a tar: index.json -> manifest [-> nested index] -> config and
    layers, blobs at blobs/<alg>/<hex>). Raises AssertionError on a layout that
    is not one image for linux/amd64."""
    with tarfile.open(path) as t:
        def blob(digest: str) -> bytes:
            alg, _, hexd = digest.partition(":")
            f = t.extractfile(f"blobs/{alg}/{hexd}")
            assert f is not None, f"{path}: blob {digest} missing"
            return f.read()

        index = json.loads(t.extractfile("index.json").read())  # type: ignore[union-attr]
        descs = index["manifests"]
        assert len(descs) == 1, f"{path}: want one image in index.json, found {len(descs)}"
        doc = json.loads(blob(descs[0]["digest"]))
        while "manifests" in doc:  # a nested index: pick linux/amd64
            picks = [d for d in doc["manifests"] if d.get("platform", {}).get("architecture") in (None, "amd64")]
            doc = json.loads(blob(picks[0]["digest"]))
        config = json.loads(blob(doc["config"]["digest"]))
        layers = [blob(d["digest"]) for d in doc["layers"]]
    return config, layers


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


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = archive_path()
    config, layers = read_oci(path)
    root = tmp_path_factory.mktemp("image") / "rootfs"
    unpack(layers, root)
    return {"path": path, "config": config, "root": root, "files": files_of(root), "layers": len(layers)}


def test_image_config(image: dict[str, Any]) -> None:
    cfg = image["config"]["config"]
    env = dict(e.split("=", 1) for e in cfg.get("Env", []))
    assert cfg.get("Entrypoint") == ["fracplugin", "run"]
    assert env["PATH"].split(":")[0] == "/opt/venv/bin", env["PATH"]
    assert "/usr/bin" in env["PATH"].split(":"), env["PATH"]  # the base's PATH is kept after the venv
    assert env.get("MALLOC_ARENA_MAX") == "2"
    assert env.get("NVIDIA_DRIVER_CAPABILITIES") == "compute,utility"
    assert cfg.get("User") in ("0:0", "0")
    assert image["config"]["architecture"] == "amd64" and image["config"]["os"] == "linux"


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
    size = image["path"].stat().st_size
    print(f"{image['path']}: {size / 1e6:.1f} MB, {image['layers']} layers, {len(image['files'])} paths")
    assert size <= MAX_ARCHIVE_BYTES, f"{image['path']} is {size / 1e6:.1f} MB, over {MAX_ARCHIVE_BYTES / 1e6:.0f} MB"


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


def test_fracplugin_version_under_runc(image: dict[str, Any], tmp_path: Path) -> None:
    r = runc_run(image, ["fracplugin", "version"], tmp_path / "bundle")
    assert r.returncode == 0, f"fracplugin version under runc: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert VERSION in r.stdout, r.stdout


def test_daemon_modules_import_under_runc(image: dict[str, Any], tmp_path: Path) -> None:
    """Every module ``fracplugin run`` loads imports in the image (the
    wheels' native parts match the base's glibc and Python)."""
    code = ("import importlib\n"
            "for m in ('fracplugin.cli', 'fracplugin.daemon', 'grpc', 'google.protobuf', 'kubernetes', 'pynvml',"
            " 'prometheus_client', 'yaml', 'tenacity', 'ssl'):\n"
            "    importlib.import_module(m)\n"
            "print('ok')\n")
    r = runc_run(image, ["python", "-c", code], tmp_path / "bundle")
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
out["status"] = [st.returncode, st.stdout[-4000:], st.stderr[-2000:]]
d.send_signal(signal.SIGTERM)
out["exit"] = d.wait(60)
print(json.dumps(out))
"""


def test_daemon_serves_under_runc_with_the_daemonset_settings(image: dict[str, Any], tmp_path: Path) -> None:
    """``fracplugin run`` in the image under the chart's capabilities and a
    read-only root: health, readiness, /metrics and ``fracplugin status``
    answer, and SIGTERM ends it cleanly."""
    r = runc_run(image, ["python", "-c", DAEMON_PROBE], tmp_path / "bundle",
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


def test_fracplugin_version_by_chroot(image: dict[str, Any]) -> None:
    """The same without a runtime: chroot into the unpacked tree (root), with
    the image's environment."""
    assert os.geteuid() == 0, "make image-test chroots into the image as root"
    env = dict(e.split("=", 1) for e in image["config"]["config"].get("Env", []))
    r = subprocess.run(["chroot", str(image["root"]), "/opt/venv/bin/fracplugin", "version"], capture_output=True,
                       text=True, env=env, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert VERSION in r.stdout, r.stdout
