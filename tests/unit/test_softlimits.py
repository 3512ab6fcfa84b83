"""Soft limits that must not outlive their container (issue 35 item 5, ADR 0036):
the fake NVML's model of the driver's parent reservations (through the real
pynvml), the drift computed from it, the leaf watch (on a real cgroup v2
hierarchy when this machine has a writable one, and on the test tree's
``cgroup.events`` file), and the enforcer zeroing a soft limit when its leaf empties."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fracplugin.enforce.memlimits import LIMIT_MAX, MIB, LimitError, MemoryLimitEnforcer, MemoryLimitMode, NvmlLimits
from fracplugin.enforce.softlimits import LeafWatch, ancestors, reservation_drift
from fracplugin.gpu.simulated import load_node
from tests.fakes import nvml as fake
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
NODE_YAML = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
CID = "c" * 64
POD = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice"


@pytest.fixture
def backend(tmp_path, monkeypatch):
    lib = fake.build_fake_nvml()
    ctypes.CDLL(str(lib / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    node = yaml.safe_load(NODE_YAML.read_text())
    monkeypatch.setenv("FAKE_NVML_NODE", str(fake.node_file(tmp_path / "node", node)))
    monkeypatch.setenv("FAKE_NVML_LIMITS", str(tmp_path / "limits"))
    b = NvmlLimits()
    yield b
    b.close()


def _tree(root: Path, name: str, events: str | None = "populated 1\nfrozen 0\n") -> Path:
    leaf = root / POD / name
    leaf.mkdir(parents=True)
    if events is not None:
        (leaf / "cgroup.events").write_text(events)
    return leaf


def _soft(b: NvmlLimits, uuid: str, cg: Path | str) -> int:
    return b.get(uuid, str(cg)).soft


def test_fake_driver_keeps_a_deleted_leafs_soft_limit_on_its_parents(tmp_path, backend):
    """NVIDIA: "The driver adds each soft limit to the parent cgroups'
    reservations. Deleting a cgroup without zeroing its soft limit leaves that
    reservation on the parents." Zeroing first leaves nothing."""
    u = load_node(str(NODE_YAML)).gpus[0].uuid
    cg = tmp_path / "cg"
    a, b = _tree(cg, "a", None), _tree(cg, "b", None)
    parents = ancestors(str(a), str(cg))
    assert [os.path.relpath(p, cg) for p in parents] == ["kubepods.slice", "kubepods.slice/kubepods-burstable.slice",
                                                          POD]
    backend.set(u, str(a), 4 * MIB, 8 * MIB)
    backend.set(u, str(b), 2 * MIB, 8 * MIB)
    assert [_soft(backend, u, p) for p in parents] == [6 * MIB] * 3 and _soft(backend, u, a) == 4 * MIB
    backend.set(u, str(b), 0, 8 * MIB)  # zeroed, then deleted: nothing stays
    b.rmdir()
    a.rmdir()  # deleted with its soft limit
    assert [_soft(backend, u, p) for p in parents] == [4 * MIB] * 3
    with pytest.raises(LimitError) as err:
        backend.get(u, str(a))  # the leaf's own entry went with it
    assert err.value.code == "not_found"
    soft_of = lambda g, c: _soft(backend, g, c)  # noqa: E731
    rows = reservation_drift(soft_of, [u], parents)
    assert [(os.path.relpath(str(r["cgroup"]), cg), r["drift"]) for r in rows] == [
        ("kubepods.slice", 0), ("kubepods.slice/kubepods-burstable.slice", 0), (POD, 4 * MIB)]
    (cg / POD).rmdir()  # the pod goes: the reservation shows one level up
    rows = reservation_drift(soft_of, [u], parents)
    assert [(os.path.relpath(str(r["cgroup"]), cg), r["drift"]) for r in rows] == [
        ("kubepods.slice", 0), ("kubepods.slice/kubepods-burstable.slice", 4 * MIB)]


def _cgroup2_mount() -> str | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        f = line.split()
        if f[2] == "cgroup2" and os.access(f[1], os.W_OK):
            return f[1]
    return None


def test_leaf_watch_fires_when_a_real_cgroup_v2_leaf_empties():
    """The kernel's notification: a process killed in a real cgroup v2 leaf
    makes ``cgroup.events`` read ``populated 0`` and the watch fire, while
    the leaf still exists (before anyone removes it)."""
    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip("no writable cgroup v2 hierarchy on this machine (the tree-file test below covers the watch)")
    leaf = Path(mount) / f"fracplugin-test-{os.getpid()}"
    leaf.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    fired: list[tuple[str, bool]] = []
    w = LeafWatch(lambda key: fired.append((key, leaf.is_dir())))
    try:
        (leaf / "cgroup.procs").write_text(str(proc.pid))
        assert w.watch("k", str(leaf)) and w.watched() == 1 and not fired
        proc.kill()
        wait_until(lambda: fired, 10, "the watch fires")
        assert fired == [("k", True)] and w.watched() == 0
    finally:
        proc.kill()
        proc.wait()
        w.close()
        leaf.rmdir()


def test_leaf_watch_on_tree_files_empty_gone_unwatched(tmp_path):
    """On the test tree (what the component tests' runtime writes): a write of
    ``populated 0`` fires, a leaf removed fires, an unwatched one never does, a
    leaf without ``cgroup.events`` is not watchable, an empty one fires at once."""
    fired: list[str] = []
    w = LeafWatch(fired.append)
    try:
        a, b, c = (_tree(tmp_path, n) for n in "abc")
        assert all(w.watch(k, str(d)) for k, d in (("a", a), ("b", b), ("c", c)))
        assert not w.watch("x", str(_tree(tmp_path, "x", None)))
        w.unwatch("c")
        (c / "cgroup.events").write_text("populated 0\n")
        (a / "cgroup.events").write_text("populated 0\nfrozen 0\n")
        wait_until(lambda: fired == ["a"], 10)
        shutil.rmtree(b)
        wait_until(lambda: fired == ["a", "b"], 10)
        assert w.watch("c", str(c)) and fired == ["a", "b", "c"] and w.watched() == 0
    finally:
        w.close()


def test_enforcer_zeroes_the_soft_limit_when_the_leaf_empties(tmp_path, backend):
    """Apply, then the leaf empties: soft 0 (hard kept) on every GPU before the
    leaf goes; RemoveContainer after the runtime deleted it sets nothing more.
    A second container whose leaf is deleted before it empties counts leaf_gone
    and its reservation is the parents' drift."""
    gpus = [g.uuid for g in load_node(str(NODE_YAML)).gpus]
    cg = tmp_path / "cg"
    a, b = _tree(cg, CID), _tree(cg, "d" * 64)
    e = MemoryLimitEnforcer(MemoryLimitMode.APPLY, backend, cgroup_root=str(cg))
    try:
        for leaf in (a, b):
            res = e.start(leaf.name, f"/{POD}/{leaf.name}", [(u, 1024, 2048) for u in gpus])
            assert res is not None and res.enforced == "yes", res.to_dict()
        (a / "cgroup.events").write_text("populated 0\n")
        wait_until(lambda: e.zeroing["zeroed"] == 4, 10)
        assert all((backend.get(u, str(a)).soft, backend.get(u, str(a)).hard) == (0, 2048 * MIB) for u in gpus)
        shutil.rmtree(a)
        e.remove(CID)
        gone = tmp_path / "gone"
        b.rename(gone)  # deleted by the runtime before it emptied (a cgroup directory goes at once, files and all)
        shutil.rmtree(gone)
        wait_until(lambda: e.zeroing["leaf_gone"] == 4, 10)
        e.remove("d" * 64)
        assert e.zeroing == {"zeroed": 4, "leaf_gone": 4, "failed": 0}
        rows = reservation_drift(lambda g, c: _soft(backend, g, c), gpus, e.parents())
        assert {(os.path.relpath(str(r["cgroup"]), cg), r["drift"]) for r in rows if r["drift"]} == {(POD, 1024 * MIB)}
        assert all(backend.get(u, str(cg / POD)).hard == LIMIT_MAX for u in gpus)
    finally:
        e.close()
