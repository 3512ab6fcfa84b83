"""A tenant cannot control MPS (issue 12, "No container ever reaches a daemon's
control socket").

The tenant is a real process running as ``nobody`` with
``CUDA_MPS_PIPE_DIRECTORY`` set to the pipe directory the planner mounts for
it (its own namespace leaf, in every mode); the fake control binary enforces
what the real daemon enforces (docs/reference/mps-nvml.md 1.6: non-owner UIDs cannot set,
create, delete; client sockets are not control sockets). The read-only bind
mount is made for real in a private mount namespace (``unshare -m``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import wait_for

from fracplugin.model import ComputeMode
from fracplugin.mps.layout import MpsLayout, namespace_name
from fracplugin.mps.supervisor import MpsSupervisor

FAKE = str(Path(__file__).resolve().parents[1] / "fakes" / "nvidia-cuda-mps-control")
FAST_PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
TS, SM = ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING
NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

needs_root = pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                                reason="runs the tenant as another UID (needs root and a system python3)")


@pytest.fixture
def sup():
    root = tempfile.mkdtemp(prefix="fpi", dir="/tmp")
    os.chmod(root, 0o755)
    s = MpsSupervisor(MpsLayout(os.path.join(root, "mps")), FAKE, None, "615.71.09", {TS, SM},
                      probe_interval_s=0.3, probe_timeout_s=2.0, backoff_base_s=0.05,
                      env={"PATH": FAST_PATH})
    s.start()
    try:
        wait_for(s.ready, 20)
        yield s
    finally:
        s.stop(timeout_s=2.0)
        shutil.rmtree(root, ignore_errors=True)


_TENANT_FAKE: list[str] = []


def tenant_binary() -> str:
    """A copy of the fake control binary that ``nobody`` can read: the checkout
    may lie under a directory only root can traverse (a ``mktemp -d`` clone)."""
    if not _TENANT_FAKE:
        d = tempfile.mkdtemp(prefix="fp-tenant-bin", dir="/tmp")
        os.chmod(d, 0o755)
        dst = os.path.join(d, "nvidia-cuda-mps-control")
        shutil.copy(FAKE, dst)
        os.chmod(dst, 0o755)
        _TENANT_FAKE.append(dst)
    return _TENANT_FAKE[0]


@pytest.fixture(scope="module", autouse=True)
def _remove_tenant_binary():
    yield
    while _TENANT_FAKE:
        shutil.rmtree(os.path.dirname(_TENANT_FAKE.pop()), ignore_errors=True)


def as_tenant(pipe_dir: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The control binary run by the tenant (uid nobody, system python3) with its pipe directory."""
    env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
    return subprocess.run([SYSTEM_PYTHON, tenant_binary(), *args], input=stdin, capture_output=True, text=True, env=env,
                          timeout=20, user=NOBODY, group=NOBODY)


def owner_state(s: MpsSupervisor, mode: ComputeMode) -> dict:
    env = {**os.environ, "PATH": FAST_PATH, "CUDA_MPS_PIPE_DIRECTORY": s.layout.pipe_dir(mode)}
    return json.loads(subprocess.run([FAKE, "fake-state"], capture_output=True, text=True, env=env,
                                     timeout=20, check=True).stdout)


@needs_root
def test_a_tenant_cannot_list_set_quit_or_replace_anything(sup: MpsSupervisor) -> None:
    leaves = {
        TS: sup.ensure_namespace("pod-ts", "app", None, 5, mode=TS, pinned_limit_mib=10240),
        SM: sup.ensure_namespace("pod-sm", "app", 30, 5, mode=SM, pinned_limit_mib=12288),
    }
    before = {m: owner_state(sup, m) for m in (TS, SM)}
    pids = {m: sup.status()["daemons"][0]["pid"] for m in (TS,)}
    for mode, leaf in leaves.items():
        assert leaf == sup.layout.namespace_pipe_dir(namespace_name(f"pod-{'ts' if mode is TS else 'sm'}", "app"), mode)
        # its pipe directory is a leaf: the daemon's control socket is not in it
        assert os.listdir(leaf) == ["control"] and not leaf.rstrip("/").endswith(("/ts", "/sm"))
        attempts = [
            ("server", "list", "--format=csv,noheader"),
            ("namespace", "list", "--format=csv,noheader"),
            ("namespace", "set", os.path.basename(leaf), "--server=shared", "--pinned-memory-limit=1000G"),
            ("namespace", "delete", os.path.basename(leaf), "--server=shared", "--force"),
            ("client", "list", "--format=csv,noheader"),
            ("-q",),
        ]
        for args in attempts:
            r = as_tenant(leaf, *args)
            assert r.returncode != 0 and "client socket" in (r.stdout + r.stderr), (args, r.stdout, r.stderr)
        for line in ("get_server_list", "set_default_device_pinned_mem_limit 0 1000G", "quit", "quit", "quit"):
            r = as_tenant(leaf, stdin=line + "\n")
            assert r.returncode != 0, (line, r.stdout)
        # replace: neither its leaf socket nor the daemon's control socket (directories are root's, 0755)
        code = (
            "import os, socket, sys\n"
            "errs = []\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n"
            "        os.unlink(p); errs.append('unlinked ' + p)\n"
            "    except PermissionError:\n"
            "        pass\n"
            "    try:\n"
            "        s = socket.socket(socket.AF_UNIX); s.bind(p + '.x'); errs.append('bound ' + p)\n"
            "    except PermissionError:\n"
            "        pass\n"
            "print(errs)\n"
        )
        daemon_ctl = os.path.join(sup.layout.pipe_dir(mode), "control")
        r = subprocess.run([SYSTEM_PYTHON, "-c", code, os.path.join(leaf, "control"), daemon_ctl],
                           capture_output=True, text=True, timeout=20, user=NOBODY, group=NOBODY)
        assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    # nothing changed: same daemons, same caps, still healthy
    assert {m: owner_state(sup, m) for m in (TS, SM)} == before
    assert before[SM]["namespaces"][f"shared/{namespace_name('pod-sm', 'app')}"]["pinned_memory_limit"] == "12288M"
    assert sup.status()["daemons"][0]["pid"] == pids[TS]
    assert sup.healthy(TS) and sup.healthy(SM)


@needs_root
def test_read_only_mount_lets_a_client_connect_but_not_unlink(sup: MpsSupervisor, tmp_path: Path) -> None:
    leaf = sup.ensure_namespace("pod-ro", "app", None, 5, mode=TS, pinned_limit_mib=4096)
    target = tmp_path / "nvidia-mps"
    target.mkdir()
    script = (
        f"mount --bind {leaf} {target} && mount -o remount,bind,ro {target} && "
        f"{sys.executable} -c \"import socket; s = socket.socket(socket.AF_UNIX); s.connect('{target}/control'); "
        f"print('connected')\" && "
        f"(rm -f {target}/control 2>&1 || true) && ls {target}"
    )
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=30)
    if r.returncode != 0 and "mount" in r.stderr and "permission" in r.stderr.lower():
        pytest.skip(f"bind mounts not permitted here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    assert "connected" in r.stdout and "Read-only file system" in r.stdout and "control" in r.stdout.split()[-1]
    assert os.path.exists(os.path.join(leaf, "control"))


def test_probe_is_never_answered_by_a_replaced_control_socket(sup: MpsSupervisor) -> None:
    # root in a container (the old attack) replaced the daemon's control socket with its own listener
    old = next(d for d in sup.status()["daemons"] if d["mode"] == TS.value)["pid"]
    seen: list[tuple[bool, object]] = []  # (healthy, pid) at every health change of the ts daemon
    sup.subscribe(lambda m, h: seen.append((h, next(d for d in sup.status()["daemons"]
                                                    if d["mode"] == TS.value)["pid"])) if m is TS else None)
    ctl = os.path.join(sup.layout.pipe_dir(TS), "control")
    os.unlink(ctl)
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind(ctl)
    impostor.listen(8)
    impostor.setblocking(False)
    try:
        wait_for(lambda: not sup.healthy(TS), what="ts unhealthy")
        d = next(d for d in sup.status()["daemons"] if d["mode"] == TS.value)
        assert "replaced" in d["last_error"]
        # the probe failures confirm it: a hard restart puts a real daemon back
        wait_for(lambda: sup.healthy(TS) and next(x for x in sup.status()["daemons"]
                                                   if x["mode"] == TS.value)["pid"] not in (None, old),
                 timeout_s=20, what="a new ts daemon")
    finally:
        impostor.close()
    # never reported healthy while the impostor held the path: only the new daemon is
    assert seen[0] == (False, old) and all(pid != old for h, pid in seen if h)
    assert sup.healthy(SM)


@needs_root
def test_protocol_2_shares_the_directory_says_so_and_non_root_tenants_cannot_change_anything() -> None:
    root = tempfile.mkdtemp(prefix="fpi", dir="/tmp")
    os.chmod(root, 0o755)
    s = MpsSupervisor(MpsLayout(os.path.join(root, "mps")), FAKE, 2, "550.54.15", {TS},
                      probe_interval_s=0.3, backoff_base_s=0.05, env={"PATH": FAST_PATH})
    s.start()
    try:
        wait_for(s.ready, 20)
        st = s.status()
        assert st["protocol"] == 2 and "share that daemon's pipe directory" in st["exposure"]
        shared = s.layout.pipe_dir(TS)
        assert as_tenant(shared, stdin="get_server_list\n").returncode == 0  # listing is open (info disclosure)
        for line in ("set_default_device_pinned_mem_limit 0 1000G", "set_default_active_thread_percentage 5",
                     "quit"):
            r = as_tenant(shared, stdin=line + "\n")
            assert r.returncode != 0 and "Insufficient privileges" in r.stdout, (line, r.stdout)
        assert s.healthy(TS) and owner_state(s, TS)["pinned"] == {}
    finally:
        s.stop(timeout_s=2.0)
        shutil.rmtree(root, ignore_errors=True)
