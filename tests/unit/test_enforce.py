"""The enforce package: leaf cgroups from NRI cgroups paths, the capability
gate, and apply/verify through the real pynvml against the fake libnvidia-ml.so.1
(tests/fakes/nvml; loaded into this process first, so pynvml's
CDLL("libnvidia-ml.so.1") finds it by soname)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import yaml

from fracplugin.enforce.capability import check_capabilities
from fracplugin.enforce.cgroups import CgroupNotFound, leaf_relpath, resolve_leaf
from fracplugin.enforce.memlimits import (LIMIT_MAX, MIB, MemoryLimitEnforcer, MemoryLimitMode, NvmlLimits,
                                          metrics_rows)
from fracplugin.gpu.simulated import load_node
from tests.fakes import nvml as fake

REPO = Path(__file__).resolve().parents[2]
NODE_YAML = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
CID = "a" * 64


@pytest.fixture(scope="module")
def fake_lib():
    lib = fake.build_fake_nvml()
    ctypes.CDLL(str(lib / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    return lib


@pytest.fixture
def nvml_node(tmp_path, fake_lib, monkeypatch):
    """``(write(**node_file kwargs), limits path)``; the backend reads the node file at nvmlInit."""
    limits = tmp_path / "limits"
    node = yaml.safe_load(NODE_YAML.read_text())

    def write(**kw):
        p = fake.node_file(tmp_path / "node", node, **kw)
        monkeypatch.setenv("FAKE_NVML_NODE", str(p))
        monkeypatch.setenv("FAKE_NVML_LIMITS", str(limits))
        return p

    write()
    return write, limits


@pytest.fixture
def backend(nvml_node):
    b = NvmlLimits()
    yield b
    b.close()


def v2_tree(root: Path, leaf: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids dmem\n")
    d = root / leaf
    d.mkdir(parents=True)
    return d


# ------------------------------------------------------------------ cgroups

@pytest.mark.parametrize("path,want", [
    (f"kubepods-burstable-pod1234_ab.slice:cri-containerd:{CID}",
     f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_ab.slice/cri-containerd-{CID}.scope"),
    (f"kubepods-pod99.slice:crio:{CID}", f"kubepods.slice/kubepods-pod99.slice/crio-{CID}.scope"),
    (f"/kubepods/burstable/pod12-34/{CID}", f"kubepods/burstable/pod12-34/{CID}"),
    (f"/kubepods/besteffort/pod12-34/crio-{CID}", f"kubepods/besteffort/pod12-34/crio-{CID}"),
    (f"-.slice:cri-containerd:{CID}", f"cri-containerd-{CID}.scope"),
])
def test_leaf_relpath_systemd_and_cgroupfs(path, want):
    assert leaf_relpath(path) == want


@pytest.mark.parametrize("bad", ["", "a:b", "kubepods.slice:x:../../etc", "/kubepods/../../etc", "bad-slice:x:y"])
def test_leaf_relpath_refuses_malformed(bad):
    with pytest.raises(CgroupNotFound):
        leaf_relpath(bad)


def test_resolve_leaf_names_the_missing_dir(tmp_path):
    with pytest.raises(CgroupNotFound, match=str(tmp_path)):
        resolve_leaf(f"/kubepods/pod1/{CID}", str(tmp_path))


# ------------------------------------------------------------------ gate

def test_gate_cgroup_v1_and_mig_name_the_capability(tmp_path):
    node = load_node(str(NODE_YAML))
    (tmp_path / "memory").mkdir()  # a v1/hybrid root: controllers as directories, no cgroup.controllers
    caps = check_capabilities(node.gpus, node.driver_version, cgroup_root=str(tmp_path), mps_protocol=3)
    assert not caps.can_enforce and "cgroup_v2" in caps.reason
    import dataclasses
    gpus = (dataclasses.replace(node.gpus[0], mig_enabled=True),) + node.gpus[1:]
    v2 = tmp_path / "v2"
    v2_tree(v2, "x")
    (v2 / "dmem.capacity").write_text("".join(f"nvidia/{g.pci_bus_id[4:].lower()}/vidmem {g.memory_mib * MIB}\n"
                                              for g in node.gpus))
    # one GPU in MIG mode is excluded (it takes no fraction, issue 33): the rest of the node enforces
    caps = check_capabilities(gpus, node.driver_version, cgroup_root=str(v2), mps_protocol=3)
    assert caps.can_enforce and gpus[0].uuid in caps.get("mig_off").detail and "excluded" in caps.get("mig_off").detail
    every = tuple(dataclasses.replace(g, mig_enabled=True) for g in node.gpus)
    caps = check_capabilities(every, node.driver_version, cgroup_root=str(v2), mps_protocol=3)
    assert [c.name for c in caps.missing] == ["mig_off"] and gpus[0].uuid in caps.reason
    ok = check_capabilities(node.gpus, node.driver_version, cgroup_root=str(v2), mps_protocol=3)
    assert ok.can_enforce and ok.get("memory_accounting").ok


def test_gate_old_driver_and_protocol_2(tmp_path):
    node = load_node(str(NODE_YAML))
    caps = check_capabilities(node.gpus, "580.95.05", cgroup_root=str(tmp_path), mps_protocol=2,
                              nvml_probe=lambda u: None)
    names = [c.name for c in caps.missing]
    assert "driver" in names and "mps_protocol" in names and "r615" in caps.reason


def test_gate_nvml_probe_stands_in_for_dmem(tmp_path, backend):
    node = load_node(str(NODE_YAML))
    v2_tree(tmp_path, "x")
    caps = check_capabilities(node.gpus, node.driver_version, cgroup_root=str(tmp_path), mps_protocol=3,
                              nvml_probe=lambda u: backend.probe(u, str(tmp_path)))
    assert caps.can_enforce, caps.reason


# ------------------------------------------------------------------ apply / verify

def _plan(node):
    return [(g.uuid, 40960, 61440) for g in node.gpus]


def test_apply_sets_soft_and_hard_on_the_leaf_and_reads_back(tmp_path, nvml_node, backend):
    _write, limits = nvml_node
    node = load_node(str(NODE_YAML))
    leaf = v2_tree(tmp_path / "cg", f"kubepods/burstable/pod1/{CID}")
    e = MemoryLimitEnforcer(MemoryLimitMode.APPLY, backend, cgroup_root=str(tmp_path / "cg"))
    res = e.start(CID, f"/kubepods/burstable/pod1/{CID}", _plan(node), pod="ns/p", container="c")
    assert res is not None and res.enforced == "yes", res.to_dict()
    held = fake.read_limits(limits)
    for g in node.gpus:
        assert held[(g.uuid, str(leaf))] == (40960 * MIB, 61440 * MIB)
    kinds = {(r["kind"], r["source"]) for r, _ in metrics_rows([res])}
    assert {("soft", "planned"), ("hard", "enforced")} <= kinds
    e.remove(CID)
    held = fake.read_limits(limits)
    assert all(held[(g.uuid, str(leaf))] == (0, 61440 * MIB) for g in node.gpus)


def test_verify_reports_unset_limits_without_setting(tmp_path, nvml_node, backend):
    _write, limits = nvml_node
    node = load_node(str(NODE_YAML))
    v2_tree(tmp_path / "cg", f"kubepods/pod1/{CID}")
    e = MemoryLimitEnforcer(MemoryLimitMode.VERIFY, backend, cgroup_root=str(tmp_path / "cg"))
    res = e.start(CID, f"/kubepods/pod1/{CID}", _plan(node))
    assert res.enforced == "no" and "hard max" in res.why and "verify" in res.why
    assert fake.read_limits(limits) == {}


def test_auto_applies_where_hook_absent_verifies_where_present(tmp_path, nvml_node, backend):
    _write, limits = nvml_node
    node = load_node(str(NODE_YAML))
    leaf = v2_tree(tmp_path / "cg", f"kubepods/pod1/{CID}")
    with_hook = {node.gpus[0].uuid}
    e = MemoryLimitEnforcer(MemoryLimitMode.AUTO, backend, cgroup_root=str(tmp_path / "cg"),
                            hook_of=lambda u: u in with_hook)
    res = e.start(CID, f"/kubepods/pod1/{CID}", _plan(node))
    assert [g.action for g in res.gpus] == ["verified", "applied", "applied", "applied"]
    assert (node.gpus[0].uuid, str(leaf)) not in fake.read_limits(limits)
    assert res.gpus[0].enforced is False and all(g.enforced for g in res.gpus[1:])


@pytest.mark.parametrize("code,word", [(fake.NVML_ERROR_NO_PERMISSION, "needs root"),
                                       (fake.NVML_ERROR_NOT_SUPPORTED, "Not Supported")])
def test_nvml_refusal_becomes_the_reason(tmp_path, nvml_node, code, word):
    write, _limits = nvml_node
    write(fail=[("SetMemoryLimits", "*", code)])
    b = NvmlLimits()
    try:
        node = load_node(str(NODE_YAML))
        v2_tree(tmp_path / "cg", f"kubepods/pod1/{CID}")
        e = MemoryLimitEnforcer(MemoryLimitMode.APPLY, b, cgroup_root=str(tmp_path / "cg"))
        res = e.start(CID, f"/kubepods/pod1/{CID}", _plan(node))
        assert res.enforced == "no" and word in res.why
    finally:
        b.close()


def test_missing_cgroup_is_reported_not_raised(tmp_path, backend):
    node = load_node(str(NODE_YAML))
    e = MemoryLimitEnforcer(MemoryLimitMode.APPLY, backend, cgroup_root=str(tmp_path))
    res = e.start(CID, f"kubepods-pod1.slice:cri-containerd:{CID}", _plan(node))
    assert res.enforced == "no" and "does not exist" in res.why and res.cgroup is None


def test_off_does_nothing(tmp_path, backend):
    e = MemoryLimitEnforcer(MemoryLimitMode.OFF, backend, cgroup_root=str(tmp_path))
    assert e.start(CID, "/x", [("GPU-1", 1, 2)]) is None


def test_gate_reason_skips_nvml(tmp_path, nvml_node, backend):
    node = load_node(str(NODE_YAML))
    _w, limits = nvml_node
    v2_tree(tmp_path / "cg", f"kubepods/pod1/{CID}")
    e = MemoryLimitEnforcer(MemoryLimitMode.APPLY, backend, cgroup_root=str(tmp_path / "cg"),
                            can_enforce=lambda: "memory limits cannot be enforced on this node: mig_off (x)")
    res = e.start(CID, f"/kubepods/pod1/{CID}", _plan(node))
    assert res.enforced == "no" and "mig_off" in res.why and fake.read_limits(limits) == {}
    assert LIMIT_MAX == 0xFFFFFFFFFFFFFFFF and os.path.isdir(tmp_path / "cg")


# ------------------------------------------------------------------ the fake library serves the daemon's NVML reads

def test_nvml_inventory_reads_the_simulated_node_through_the_fake(nvml_node):
    """The daemon's real NvmlInventory (gpu/nvml.py) on the fake library:
    the node file's GPUs, a process, an XID event and a re-probe."""
    write, _ = nvml_node
    node = yaml.safe_load(NODE_YAML.read_text())
    p = fake.node_file(write().parent / "node", node, mig=[2], procs=[(1, 4242, 3 << 30)])
    with open(p, "a") as f:
        f.write("xid 3 79\n")
    from fracplugin.gpu.nvml import NvmlInventory

    inv = NvmlInventory()
    try:
        got = inv.node()
        assert got.driver_version == "615.71.09" and got.cuda_driver_version == 13040
        assert [(g.index, g.uuid, g.memory_mib, g.pci_bus_id, g.numa_node, g.compute_capability, g.mig_enabled)
                for g in got.gpus] == [
            (g["index"], g["uuid"], g["memory_mib"], g["pci_bus_id"], g["numa_node"], g["compute_capability"],
             g["index"] == 2) for g in node["gpus"]]
        procs = inv.processes()
        assert [(s.gpu_uuid, s.pid, s.used_memory_bytes) for s in procs] == [(node["gpus"][1]["uuid"], 4242, 3 << 30)]
        events = list(inv.events(1.0))
        assert [(e.gpu_uuid, e.xid) for e in events] == [(node["gpus"][3]["uuid"], 79)]
        assert inv.probe_gpu(node["gpus"][0]["uuid"]) and not inv.probe_gpu("GPU-not-here")
    finally:
        inv.close()


def test_condition_names_memory_limits():
    from fracplugin.nodecondition import condition_from_checks

    st = condition_from_checks({"nri": {"ready": True, "detail": "ok"},
                                "memory_limits": {"ready": False, "detail": "memory limits cannot be enforced on "
                                                  "this node: cgroup_v2 (x)"}})
    assert (st.ready, st.reason) == (False, "MemoryLimitsNotEnforceable") and "cgroup_v2" in st.message


def test_status_table_enforced_column():
    from fracplugin.status import render_memory_limits

    doc = {"mode": "apply", "policy": "warn", "cgroup_root": "/sys/fs/cgroup",
           "node": {"can_enforce": True, "reason": "", "capabilities": [{"name": "cgroup_v2", "ok": True,
                                                                           "detail": "cgroup v2"}]},
           "containers": [{"pod": "ns/p", "container": "c", "reason": "", "gpus": [
               {"gpu": "GPU-a", "planned_soft_bytes": 40960 * MIB, "planned_hard_bytes": 61440 * MIB,
                "read_soft_bytes": 40960 * MIB, "read_hard_bytes": 61440 * MIB, "enforced": True, "reason": "",
                "used_bytes": None},
               {"gpu": "GPU-b", "planned_soft_bytes": 40960 * MIB, "planned_hard_bytes": 61440 * MIB,
                "read_soft_bytes": 0, "read_hard_bytes": LIMIT_MAX, "enforced": False,
                "reason": "read soft 0 MiB / hard max", "used_bytes": None}]}]}
    text = render_memory_limits(doc)
    lines = text.splitlines()
    assert "ENFORCED" in lines[3]
    assert lines[4].split()[-1] == "yes" and "40960/61440" in lines[4]
    assert lines[5].endswith("no (read soft 0 MiB / hard max)") and "0/max" in lines[5]


def test_remove_after_a_restart_zeroes_soft_limits_found_on_the_leaf(tmp_path, nvml_node, backend):
    """A container started before this daemon (no kept result): RemoveContainer
    finds its leaf from the cgroups path and zeroes every soft limit set there."""
    _w, limits = nvml_node
    node = load_node(str(NODE_YAML))
    leaf = v2_tree(tmp_path / "cg", f"kubepods/pod1/{CID}")
    backend.set(node.gpus[1].uuid, str(leaf), 5 * MIB, 9 * MIB)  # as an earlier daemon (or the hook) left it
    e = MemoryLimitEnforcer(MemoryLimitMode.AUTO, backend, cgroup_root=str(tmp_path / "cg"))
    e.remove(CID, f"/kubepods/pod1/{CID}", [g.uuid for g in node.gpus])
    assert fake.read_limits(limits) == {(node.gpus[1].uuid, str(leaf)): (0, 9 * MIB)}


def test_gate_names_gpus_without_cdi_spec_and_those_without_the_hook(tmp_path):
    node = load_node(str(NODE_YAML))
    known = {node.gpus[0].uuid: True, node.gpus[1].uuid: False}
    caps = check_capabilities(node.gpus, node.driver_version, cgroup_root=str(tmp_path), hook_of=known.get)
    c = caps.get("cdi_hook")
    assert c.ok is False and node.gpus[1].uuid in c.detail and node.gpus[0].uuid not in c.detail
    caps = check_capabilities(node.gpus, node.driver_version, cgroup_root=str(tmp_path), hook_of=lambda u: None)
    c = caps.get("cdi_hook")
    assert c.ok is None and all(g.uuid in c.detail for g in node.gpus) and "no CDI spec" in c.detail
    assert caps.hook == {g.uuid: None for g in node.gpus}


def test_a_fifo_or_a_huge_file_at_dmem_capacity_is_unusable_at_once(tmp_path):
    """Issue 34 input 8: the gate reads regular files only, non-blocking, with a size cap."""
    import os

    from fracplugin.enforce.capability import MAX_KERNEL_FILE

    node = load_node(str(NODE_YAML))
    v2 = tmp_path / "v2"
    v2_tree(v2, "x")
    os.mkfifo(v2 / "dmem.capacity")  # nobody writes: a blocking open or read would wait for ever
    caps = check_capabilities(node.gpus, node.driver_version, cgroup_root=str(v2), mps_protocol=3)
    acc = caps.get("memory_accounting")
    assert acc.ok is False and "dmem.capacity is not a regular file" in acc.detail
    (v2 / "dmem.capacity").unlink()
    (v2 / "dmem.capacity").write_bytes(b"x" * (MAX_KERNEL_FILE + 1))
    acc = check_capabilities(node.gpus, node.driver_version, cgroup_root=str(v2), mps_protocol=3).get("memory_accounting")
    assert acc.ok is False and "is larger than" in acc.detail
