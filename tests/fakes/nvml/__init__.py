"""The fake NVML library (``fake_nvml.c`` beside this file) and its node file.

``build_fake_nvml()`` compiles ``fake_nvml.c`` with gcc into
``build/fake-nvml/<hash>/libnvidia-ml.so.1`` (``<hash>``: SHA-256 of the
source and flags) on first use and returns that directory afterwards (put it
first in ``LD_LIBRARY_PATH``: pynvml loads ``CDLL("libnvidia-ml.so.1")``);
concurrent builders are safe (private temporary name, then rename).

``node_file(path, node, ...)`` writes the node file the library reads
(``$FAKE_NVML_NODE``) from a ``NodeInfo`` or the dict of an
``examples/nodes/*.yaml``; ``env(...)`` gives the environment a process needs
to load the fake; ``read_limits(path)`` parses the limits file
(``$FAKE_NVML_LIMITS``) into ``{(uuid, namespace): (soft bytes, hard bytes)}``.

Stdlib only (plus ``fracplugin.model`` types when given).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
SOURCE = HERE / "fake_nvml.c"
OUT_ROOT = REPO / "build" / "fake-nvml"
CFLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-Wno-format-truncation", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-fvisibility=hidden", "-pthread")

LIMIT_MAX = 0xFFFFFFFFFFFFFFFF
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6


class BuildError(RuntimeError):
    """gcc is missing or the compile failed (the message carries gcc's output)."""


def build_fake_nvml(out_root: Path = OUT_ROOT) -> Path:
    """Compile (once per source hash) and return the directory holding
    ``libnvidia-ml.so.1``. Raises BuildError when no C compiler is found or it fails."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise BuildError("no C compiler: the fake NVML library needs gcc (or $CC)")
    key = hashlib.sha256(SOURCE.read_bytes() + b"\0" + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out = out_root / key / "libnvidia-ml.so.1"
    if out.exists():
        return out.parent
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cc.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise BuildError(f"{cc} failed on {SOURCE} (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out.parent


def _gpus_of(node: Any) -> list[Mapping[str, Any]]:
    if isinstance(node, Mapping):
        return list(node.get("gpus", []))
    return [{"index": g.index, "uuid": g.uuid, "name": g.name, "memory_mib": g.memory_mib, "minor": g.minor,
             "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node, "compute_capability": g.compute_capability,
             "mig_enabled": g.mig_enabled} for g in node.gpus]


def node_file(path: str | os.PathLike[str], node: Any, *, driver: str | None = None, cuda: int | None = None,
              mig: Iterable[int] = (), fail: Iterable[tuple[str, str, int]] = (),
              procs: Iterable[tuple[int, int, int]] = ()) -> Path:
    """Write the fake's node file for ``node`` (a ``NodeInfo`` or an
    examples/nodes dict: memory in MiB, written as bytes) and return its path.

    ``driver``/``cuda`` override the node's versions; ``mig`` lists GPU
    indices in MIG mode; ``fail`` holds ``(function, uuid or "*", nvml code)``
    (functions: SetMemoryLimits, GetMemoryLimits, GetHandleByUUID, MemoryInfo,
    Init); ``procs`` ``(gpu index, pid, used bytes)``."""
    if isinstance(node, Mapping):
        drv = driver or str(node.get("driver_version", "615.71.09"))
        cu = cuda if cuda is not None else int(node.get("cuda_driver_version", 13040))
    else:
        drv = driver or node.driver_version
        cu = cuda if cuda is not None else node.cuda_driver_version
    mig_set = set(mig)
    lines = [f"driver {drv}", f"cuda {cu}"]
    for g in _gpus_of(node):
        cc = str(g.get("compute_capability") or "9.0").split(".")
        numa = g.get("numa_node")
        in_mig = 1 if (int(g["index"]) in mig_set or g.get("mig_enabled")) else 0
        lines.append(f"gpu {int(g['index'])} {g['uuid']} {int(g.get('minor', g['index']))} "
                     f"{g.get('pci_bus_id') or '00000000:00:00.0'} {int(g['memory_mib']) << 20} "
                     f"{-1 if numa is None else int(numa)} {int(cc[0])} {int(cc[1]) if len(cc) > 1 else 0} "
                     f"{in_mig} {g.get('name') or 'NVIDIA H100 80GB HBM3'}")
    for gpu, pid, used in procs:
        lines.append(f"proc {gpu} {pid} {used}")
    for fn, uuid, code in fail:
        lines.append(f"fail {fn} {uuid} {code}")
    p = Path(path)
    p.write_text("\n".join(lines) + "\n")
    return p


def env(lib_dir: Path, node_path: Path, limits_path: Path, calls_path: Path | None = None) -> dict[str, str]:
    """Environment entries that make a process (and pynvml in it) load the fake."""
    out = {"LD_LIBRARY_PATH": f"{lib_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"),
           "FAKE_NVML_NODE": str(node_path), "FAKE_NVML_LIMITS": str(limits_path)}
    if calls_path is not None:
        out["FAKE_NVML_CALLS"] = str(calls_path)
    return out


def read_limits(path: str | os.PathLike[str]) -> dict[tuple[str, str], tuple[int, int]]:
    """The limits the fake holds: ``{(gpu uuid, cgroup dir): (soft bytes, hard bytes)}``
    (a pair with no limit is absent). The file is a journal: the last line of
    a pair wins; soft 0 + hard ``LIMIT_MAX`` clears it."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            key, value = (parts[0], parts[3]), (int(parts[1]), int(parts[2]))
            if value == (0, LIMIT_MAX):
                out.pop(key, None)
            else:
                out[key] = value
    return out
