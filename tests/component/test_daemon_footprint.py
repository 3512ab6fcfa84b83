"""What a ``fracplugin run`` process loads (issue 14, docs/benchmarks.md memory).

ADR 0021: the kubelet door speaks gRPC through grpcio (about 14 MiB of
resident memory, most of it the file-backed text of its core), and grpclib,
the door's library of ADR 0018, is gone: no process imports it or h2.
ADR 0016 still holds: a process without the device plugin door
(``--no-device-plugin``, the MPS role) never loads grpcio. Checked on the
real daemon process through ``/proc/<pid>/maps`` (grpcio's core is a shared
object, mapped by ``import grpc``), with a positive control that the same
check sees grpcio's core where the door runs, and on the run path's imports
through ``sys.modules``.
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


def test_the_check_sees_grpcio_where_grpc_is_imported() -> None:
    """Positive control: ``import grpc`` maps grpcio's core (the test peers' library)."""
    code = ("import sys; before = %r in open('/proc/self/maps').read(); import grpc; "
            "print(before, %r in open('/proc/self/maps').read())" % (GRPC_CORE, GRPC_CORE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_the_run_path_with_every_door_loads_grpcio_and_never_grpclib() -> None:
    """ADR 0021: the daemon's modules, the device plugin door's included
    (server, registration, PodResources), load grpcio, and neither grpclib nor
    h2 (its HTTP/2 layer) nor the door's removed transport modules."""
    code = ("import sys, fracplugin.cli, fracplugin.daemon, fracplugin.nri.plugin; "
            "import fracplugin.kubelet.deviceplugin, fracplugin.kubelet.podresources, fracplugin.kubelet.registration; "
            "print('grpc' in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] in ('grpclib', 'h2') "
            "or m in ('fracplugin.kubelet.grpcwire', 'fracplugin.kubelet.aio')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(maxsplit=1) == ["True", "[]"]


def test_daemon_with_every_door_maps_grpcio(root: Path) -> None:
    """The real daemon, NRI and device plugin doors on and registered with
    peers (the kubelet peer, the NRI runtime peer): the door is served (the
    kubelet peer got its device list) and grpcio's core is mapped, the
    positive control of the two daemons below that must not map it.
    (grpclib is pure Python, never mapped: the import test above covers it.)"""
    from tests.peers.kubelet import FakeKubelet
    from tests.peers.nri_runtime import FakeNriRuntime

    dp = root / "dp"
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    kubelet = FakeKubelet(str(dp)).start()
    try:
        proc = run_ready(root, "--nri-socket", str(root / "nri.sock"), "--device-plugin-dir", str(dp),
                         "--pod-resources-socket", str(root / "pr.sock"))
        try:
            assert rt.wait_registered(15) is not None
            assert kubelet.wait_for(lambda: bool(kubelet.registrations), 15)
            files = mapped_files(proc.pid)
            assert any("libpython" in f or "python3" in f for f in files)  # the listing is the daemon's own
            assert grpc_mapped(proc.pid) != []  # positive control of the two tests below
        finally:
            stop(proc)
    finally:
        kubelet.stop()
        rt.close()


def test_daemon_without_the_device_plugin_door_never_maps_grpc(root: Path) -> None:
    proc = run_ready(root, "--no-nri", "--no-device-plugin")
    try:
        files = mapped_files(proc.pid)
        assert any("libpython" in f or "python3" in f for f in files)  # the listing is the daemon's own
        assert grpc_mapped(proc.pid) == []
    finally:
        stop(proc)


def test_without_the_door_its_grpc_library_is_not_imported() -> None:
    """ADR 0016: config validation and the NRI door import
    ``fracplugin.kubelet.devices`` (pure), never the door's gRPC library."""
    code = ("import sys, fracplugin.cli, fracplugin.daemon, fracplugin.config, fracplugin.nri.plugin, "
            "fracplugin.kubelet.devices, fracplugin.rpcstatus; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'grpclib', 'h2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_mps_role_never_maps_grpc(root: Path) -> None:
    proc = run_ready(root, "--role", "mps", endpoints="endpoints-mps.json")
    try:
        assert grpc_mapped(proc.pid) == []
    finally:
        stop(proc)
