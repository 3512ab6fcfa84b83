"""Build the compiled fake MPS client (``mps_client.c`` beside this file).

``build_mps_client()`` compiles it with gcc into
``build/fake-mps/<hash>/nvidia-cuda-mps-control`` (``<hash>``: SHA-256 of the
source, the compiler flags and the Python fake's path, baked in as
``PY_FAKE``) on first use and returns that path afterwards; concurrent
builders are safe (each compiles to a private temporary name, then renames).
The binary answers client invocations itself and ``execv``s the Python fake
(``nvidia-cuda-mps-control`` beside this file) for everything else, so it can
stand wherever the Python fake does (``--mps-control-binary``). Why: a Python
client costs 25-100 ms of CPU per control command, the real binary about 1 ms
(docs/benchmarks.md, "The MPS work round"); benchmarks that compare the hook
with a Go plugin use this one so the fake's start-up is not counted as the
hook's.

Stdlib only: the bench and the tests import it by path or as ``tests.fakes.mps_client``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SOURCE = HERE / "mps_client.c"
PY_FAKE = HERE / "nvidia-cuda-mps-control"
OUT_ROOT = REPO / "build" / "fake-mps"
CFLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra", "-Werror")


class BuildError(RuntimeError):
    """gcc is missing or the compile failed (the message carries gcc's output)."""


def build_mps_client(out_root: Path = OUT_ROOT) -> Path:
    """Compile (once per source hash) and return the path of the compiled
    client, an executable named ``nvidia-cuda-mps-control``.

    Raises BuildError when no C compiler (``$CC``, else ``gcc``, else ``cc``)
    is found or it fails."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise BuildError("no C compiler: the compiled fake MPS client needs gcc (or $CC)")
    src = SOURCE.read_bytes()
    define = f'-DPY_FAKE="{PY_FAKE}"'
    key = hashlib.sha256(b"\0".join([src, define.encode(), " ".join(CFLAGS).encode()])).hexdigest()[:16]
    out = out_root / key / "nvidia-cuda-mps-control"
    if os.access(out, os.X_OK):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cc.", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, define, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise BuildError(f"{cc} failed on {SOURCE} (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def fake_control_binary() -> Path:
    """The fake ``nvidia-cuda-mps-control`` tests and the demo should run: the
    compiled client (``build_mps_client()``) when a C compiler is there, else
    the Python fake. Why: on a loaded machine (load far above the cores) a
    Python client can take seconds to start, longer than the supervisor's
    probe timeout, so a healthy fake daemon looks hung; the compiled one
    starts in about a millisecond, like the real binary."""
    try:
        return build_mps_client()
    except (BuildError, OSError, subprocess.SubprocessError):
        return PY_FAKE


if __name__ == "__main__":
    print(build_mps_client())
