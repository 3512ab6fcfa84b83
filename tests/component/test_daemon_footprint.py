"""What a ``fracplugin run`` process loads (issue 14, docs/benchmarks.md memory).

grpc (its Cython core, asyncio and OpenSSL) is about 28 MiB of resident
memory. Only the device plugin door speaks gRPC, so a process without it
(``--no-device-plugin``, the MPS role) must never map grpc's core library:
checked on the real daemon process through ``/proc/<pid>/maps``, with a
positive control that the same check sees grpc where the door's code is
loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import kill_leftovers, wait_until

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
GRPC_CORE = "cygrpc"  # grpc/_cython/cygrpc.cpython-*.so: grpc's C core, mapped by `import grpc`


@pytest.fixture
def root() -> Iterator[Path]:
    """A short work directory (MPS pipe directories must fit a unix socket path)."""
    d = Path(tempfile.mkdtemp(prefix="fpf", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        kill_leftovers(d)  # the MPS role's control daemons outlive it by design (ADR 0009)
        shutil.rmtree(d, ignore_errors=True)


def mapped_files(pid: int) -> set[str]:
    """Paths of the files mapped into process ``pid`` (``/proc/<pid>/maps``, column 6)."""
    out = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            out.add(parts[5])
    return out


def ready(health: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{health}/readyz", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def run_ready(work: Path, *args: str, endpoints: str = "endpoints.json") -> subprocess.Popen[bytes]:
    """Start ``fracplugin run`` on the simulated node with ``args``; return it once /readyz answers 200."""
    cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE),
           "--state-dir", str(work / "state"), "--mps-root", str(work / "mps"),
           "--mps-control-binary", str(FAKE_MPS), "--health-address", "127.0.0.1:0",
           "--metrics-address", "127.0.0.1:0", "--log-format", "json", "--shutdown-timeout", "5", *args]
    log = open(work / "daemon.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(work),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    log.close()
    ep = work / "state" / endpoints
    try:
        wait_until(lambda: ep.exists() or proc.poll() is not None, 30, what="daemon endpoints")
        assert proc.poll() is None, (work / "daemon.log").read_text()
        health = json.loads(ep.read_text())["health"]
        wait_until(lambda: ready(health) or proc.poll() is not None, 30, what="/readyz 200")
        assert proc.poll() is None, (work / "daemon.log").read_text()
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def grpc_mapped(pid: int) -> list[str]:
    return sorted(p for p in mapped_files(pid) if GRPC_CORE in p)


def test_the_check_sees_grpc_where_the_device_plugin_code_is_loaded() -> None:
    """Positive control: resolving ``fracplugin.kubelet.DevicePluginServer`` maps grpc's core."""
    code = ("import os, sys, fracplugin.kubelet as k; before = 'grpc' in sys.modules; k.DevicePluginServer; "
            "maps = open('/proc/self/maps').read(); print(before, 'grpc' in sys.modules, %r in maps)" % GRPC_CORE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


@pytest.mark.timeout(120)
def test_daemon_without_the_device_plugin_door_never_maps_grpc(root: Path) -> None:
    proc = run_ready(root, "--no-nri", "--no-device-plugin")
    try:
        files = mapped_files(proc.pid)
        assert any("libpython" in f or "python3" in f for f in files)  # the listing is the daemon's own
        assert grpc_mapped(proc.pid) == []
    finally:
        stop(proc)


@pytest.mark.timeout(120)
def test_mps_role_never_maps_grpc(root: Path) -> None:
    proc = run_ready(root, "--role", "mps", endpoints="endpoints-mps.json")
    try:
        assert grpc_mapped(proc.pid) == []
    finally:
        stop(proc)


def test_kubelet_package_exports_resolve_to_their_submodules() -> None:
    import fracplugin.kubelet as k
    from fracplugin.kubelet import deviceplugin, devices, podlookup, podresources, registration

    for name, mod in (("DevicePluginServer", deviceplugin), ("DEFAULT_RESOURCE_NAME", devices),
                      ("InMemoryPodSource", podlookup), ("devices_for", podresources),
                      ("DEFAULT_PLUGIN_DIR", registration)):
        assert getattr(k, name) is getattr(mod, name)
        assert name in dir(k) and name in k.__all__
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        k.NoSuchThing  # noqa: B018
