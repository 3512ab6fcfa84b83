"""CdiRegistry: GPU UUID -> CDI device name and memory-limit hook, from fake
spec trees (tests/fixtures/cdi); with_node_cdi_devices: the plan's CDI
devices without duplicates (issue 23 item 1, ADR 0025b)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from fracplugin.cdi import CdiRegistry, container_cdi_devices, with_node_cdi_devices
from fracplugin.gpu.simulated import load_node
from fracplugin.model import PodRef
from fracplugin.planner import EmptyLedger
from tests.helpers import plan_container

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "cdi"
NODE = load_node(REPO / "examples" / "nodes" / "gpu-node-1.yaml")
UUIDS = [g.uuid for g in NODE.gpus]
DP = "k8s.device-plugin.nvidia.com/gpu"


def tree(tmp_path: Path, *names: str) -> Path:
    """A spec directory holding the spec files of the named fixture folders."""
    d = tmp_path / "cdi"
    d.mkdir(exist_ok=True)
    for n in names:
        for f in (FIX / n).iterdir():
            shutil.copy(f, d / f.name)
    return d


def test_device_plugin_kind_by_uuid_with_hook(tmp_path: Path) -> None:
    reg = CdiRegistry([str(tmp_path / "missing"), str(tree(tmp_path, "with-hook"))], NODE.gpus)
    for u in UUIDS:
        d = reg.device_for(u)
        assert d is not None and d.name == f"{DP}={u}" and d.kind == DP and d.has_memory_limit_hook
    assert reg.status()["gpus_without_spec"] == []


def test_without_hook(tmp_path: Path) -> None:
    reg = CdiRegistry([str(tree(tmp_path, "no-hook"))], NODE.gpus)
    d = reg.device_for(UUIDS[2])
    assert d is not None and d.name == f"{DP}={UUIDS[2]}" and not d.has_memory_limit_hook


def test_toolkit_index_names_match_by_minor_and_skip_mig_and_all(tmp_path: Path) -> None:
    reg = CdiRegistry([str(tree(tmp_path, "toolkit"))], NODE.gpus)
    assert [reg.device_for(u).name for u in UUIDS] == [f"nvidia.com/gpu={i}" for i in range(4)]  # type: ignore[union-attr]
    assert all(reg.device_for(u).has_memory_limit_hook for u in UUIDS)  # type: ignore[union-attr]
    assert reg.gpu_of("nvidia.com/gpu=2") == UUIDS[2]
    assert reg.gpu_of("nvidia.com/gpu=0:1") is None and reg.gpu_of("nvidia.com/gpu=all") is None


def test_device_plugin_kind_preferred_over_toolkit_and_operator_kind_over_both(tmp_path: Path) -> None:
    d = tree(tmp_path, "toolkit", "no-hook")
    assert CdiRegistry([str(d)], NODE.gpus).device_for(UUIDS[0]).name == f"{DP}={UUIDS[0]}"  # type: ignore[union-attr]
    op = CdiRegistry([str(d)], NODE.gpus, kind="nvidia.com/gpu").device_for(UUIDS[0])
    assert op is not None and op.name == "nvidia.com/gpu=0" and op.has_memory_limit_hook


def test_spec_level_hook_counts_for_every_device(tmp_path: Path) -> None:
    d = tmp_path / "cdi"
    d.mkdir()
    (d / "x.yaml").write_text(
        f'cdiVersion: "0.6.0"\nkind: {DP}\ndevices:\n  - name: {UUIDS[0]}\n    containerEdits: {{}}\n'
        "containerEdits:\n  hooks:\n    - hookName: createRuntime\n      path: /usr/bin/nvidia-cdi-hook\n"
        "      args: [nvidia-cdi-hook, apply-cuda-memory-limits]\n")
    assert CdiRegistry([str(d)], NODE.gpus).device_for(UUIDS[0]).has_memory_limit_hook  # type: ignore[union-attr]
    # a hook of another lifecycle stage is not the createRuntime hook
    (d / "x.yaml").write_text((d / "x.yaml").read_text().replace("createRuntime", "poststop"))
    assert not CdiRegistry([str(d)], NODE.gpus).device_for(UUIDS[0]).has_memory_limit_hook  # type: ignore[union-attr]


def test_broken_spec_named_in_one_warning_and_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tree(tmp_path, "with-hook", "broken")
    reg = CdiRegistry([str(d)], NODE.gpus)
    reg.file_check_s = 0.0
    with caplog.at_level(logging.WARNING, logger="fracplugin.cdi"):
        assert reg.device_for(UUIDS[0]) is not None  # the good spec still counts
        reg.refresh(force=True)
        reg.device_for(UUIDS[1])
    warnings = [r for r in caplog.records if "vendor.example-gpu.yaml" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "not valid YAML" in warnings[0].getMessage()
    st = reg.status()
    assert [i["path"] for i in st["invalid_specs"]] == [str(d / "vendor.example-gpu.yaml")]


@pytest.mark.parametrize("body, words", [
    ("- just\n- a list\n", "must be a mapping"),
    ('cdiVersion: "0.6.0"\nkind: nogpu\ndevices: []\n', "kind='nogpu'"),
    (f'kind: {DP}\ndevices:\n  - containerEdits: {{}}\n', "devices[0] has no name"),
    (f'kind: {DP}\ndevices: 3\n', "devices must be a list"),
])
def test_bad_spec_shapes_are_named(tmp_path: Path, body: str, words: str) -> None:
    d = tmp_path / "cdi"
    d.mkdir()
    (d / "bad.yaml").write_text(body)
    reg = CdiRegistry([str(d)], NODE.gpus)
    assert reg.device_for(UUIDS[0]) is None
    [inv] = reg.status()["invalid_specs"]
    assert words in inv["reason"], inv


def test_reread_on_new_file_and_on_edit_in_place(tmp_path: Path) -> None:
    d = tmp_path / "cdi"
    d.mkdir()
    reg = CdiRegistry([str(d)], NODE.gpus)
    reg.file_check_s = 0.0
    assert reg.device_for(UUIDS[0]) is None
    assert reg.status()["gpus_without_spec"] == UUIDS
    shutil.copy(FIX / "no-hook" / "k8s.device-plugin.nvidia.com-gpu.yaml", d / "dp.yaml")
    assert reg.device_for(UUIDS[0]) is None  # lookups read the snapshot only (issue 34 item 5)
    assert reg.refresh()  # what the watcher does
    assert not reg.device_for(UUIDS[0]).has_memory_limit_hook  # type: ignore[union-attr]
    # edit in place (same directory mtime possible): the file's own stat changes
    text = (FIX / "with-hook" / "k8s.device-plugin.nvidia.com-gpu.yaml").read_text()
    with open(d / "dp.yaml", "w") as f:
        f.write(text)
    st = os.stat(d / "dp.yaml")
    os.utime(d / "dp.yaml", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert reg.refresh() and reg.device_for(UUIDS[0]).has_memory_limit_hook  # type: ignore[union-attr]
    reads = reg.reads
    assert not reg.refresh() and reg.reads == reads  # unchanged: not read again


def plan_for(devices: str) -> object:
    ann = {
        "nvidia.com/container.app.gpu-memory.request": "40Gi",
        "nvidia.com/container.app.gpu-memory.limit": "60Gi",
        "nvidia.com/container.app.gpus.devices": devices,
    }
    return plan_container(ann, "app", PodRef("default", "inference", "uid-1"), NODE, EmptyLedger())


def test_plan_gets_one_device_per_gpu(tmp_path: Path) -> None:
    reg = CdiRegistry([str(tree(tmp_path, "with-hook"))], NODE.gpus)
    p = with_node_cdi_devices(plan_for(",".join(UUIDS)), reg)  # type: ignore[arg-type]
    assert p.cdi_devices == tuple(f"{DP}={u}" for u in UUIDS)
    assert p.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS)  # env as today


def test_no_duplicate_of_the_containers_own_or_the_schedulers(tmp_path: Path) -> None:
    reg = CdiRegistry([str(tree(tmp_path, "with-hook", "toolkit"))], NODE.gpus)
    # KAI's binder with cdiEnabled wrote CDI names for two GPUs
    written = f"{DP}={UUIDS[0]},{DP}={UUIDS[1]}"
    p = with_node_cdi_devices(plan_for(written), reg)  # type: ignore[arg-type]
    assert p.cdi_devices == (f"{DP}={UUIDS[0]}", f"{DP}={UUIDS[1]}")
    # the container already has GPU 0 (by another kind) and GPU 1 by the same name
    container = SimpleNamespace(CDI_devices=[SimpleNamespace(name="nvidia.com/gpu=0")],
                                annotations={"cdi.k8s.io/fracplugin": f"{DP}={UUIDS[1]}", "other": "x"})
    present = container_cdi_devices(container)
    assert present == ("nvidia.com/gpu=0", f"{DP}={UUIDS[1]}")
    p = with_node_cdi_devices(plan_for(",".join(UUIDS)), reg, present)  # type: ignore[arg-type]
    assert p.cdi_devices == (f"{DP}={UUIDS[2]}", f"{DP}={UUIDS[3]}")


def test_gpu_without_spec_gets_none(tmp_path: Path) -> None:
    d = tmp_path / "cdi"
    d.mkdir()
    text = (FIX / "with-hook" / "k8s.device-plugin.nvidia.com-gpu.yaml").read_text()
    (d / "dp.yaml").write_text(text.replace(UUIDS[3], "GPU-00000000-0000-0000-0000-000000000000"))
    reg = CdiRegistry([str(d)], NODE.gpus)
    p = with_node_cdi_devices(plan_for(",".join(UUIDS)), reg)  # type: ignore[arg-type]
    assert p.cdi_devices == tuple(f"{DP}={u}" for u in UUIDS[:3])
    assert reg.status()["gpus_without_spec"] == [UUIDS[3]]


# ---- issue 34 items 4 and 5 ------------------------------------------------------------------------


def test_a_cdi_name_the_node_does_not_list_becomes_the_nodes_own_device_for_that_gpu(tmp_path: Path) -> None:
    """Input 6: specs of ``k8s.device-plugin.nvidia.com/gpu`` only, ``gpus.devices: nvidia.com/gpu=0``: one CDI
    device for GPU 0, the one the node lists (it gave two, one of which nothing on the node resolves)."""
    reg = CdiRegistry([str(tree(tmp_path, "with-hook"))], NODE.gpus)
    p = with_node_cdi_devices(plan_for("nvidia.com/gpu=0"), reg)  # type: ignore[arg-type]
    assert p.cdi_devices == (f"{DP}={UUIDS[0]}",)
    # a listed name is kept as written, and counts for its GPU
    both = CdiRegistry([str(tree(tmp_path, "toolkit"))], NODE.gpus)
    assert with_node_cdi_devices(plan_for("nvidia.com/gpu=0"), both).cdi_devices == ("nvidia.com/gpu=0",)  # type: ignore[arg-type]


def test_a_device_whose_identities_disagree_matches_no_gpu_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "cdi"
    d.mkdir()
    (d / "dp.yaml").write_text(  # named GPU 0's UUID, its device node GPU 1's
        f'cdiVersion: "0.6.0"\nkind: {DP}\ndevices:\n  - name: {UUIDS[0]}\n    containerEdits:\n'
        f'      deviceNodes:\n        - path: /dev/nvidia{NODE.gpus[1].minor}\n')
    reg = CdiRegistry([str(d)], NODE.gpus)
    reg.file_check_s = 0.0
    with caplog.at_level(logging.WARNING, logger="fracplugin.cdi"):
        assert reg.device_for(UUIDS[0]) is None and reg.device_for(UUIDS[1]) is None
        reg.refresh(force=True)
    warned = [r.getMessage() for r in caplog.records if str(d / "dp.yaml") in r.getMessage()]
    assert len(warned) == 1 and "matches no GPU" in warned[0], warned


def test_specs_of_other_kinds_are_not_parsed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tree(tmp_path, "with-hook")
    (d / "other.yaml").write_text('cdiVersion: "0.6.0"\nkind: vendor.example/fpga\ndevices: [ {name: x\n')
    reg = CdiRegistry([str(d)], NODE.gpus)
    with caplog.at_level(logging.WARNING, logger="fracplugin.cdi"):
        st = reg.status()
    assert str(d / "other.yaml") in st["specs"] and st["invalid_specs"] == [] and not caplog.records
    assert reg.device_for(UUIDS[0]) is not None


class _SlowRegistry(CdiRegistry):
    """A registry whose re-read waits until ``release`` is set (a spec directory of thousands of files)."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.release = __import__("threading").Event()
        self.reading = __import__("threading").Event()

    def _read(self, files):  # type: ignore[no-untyped-def]
        if self.reads:
            self.reading.set()
            assert self.release.wait(60)
        return super()._read(files)


def test_lookups_never_wait_for_a_reread(tmp_path: Path) -> None:
    """Input 7, in process: while the watcher re-reads (held here until released), every lookup and
    ``with_node_cdi_devices`` answers from the last snapshot at once; the new spec counts once the re-read
    ends."""
    from tests.helpers import wait_until

    d = tree(tmp_path, "no-hook")
    reg = _SlowRegistry([str(d)], NODE.gpus)
    reg.file_check_s = 0.05
    reg.start()
    try:
        assert not reg.device_for(UUIDS[0]).has_memory_limit_hook  # type: ignore[union-attr]
        shutil.copy(FIX / "with-hook" / "k8s.device-plugin.nvidia.com-gpu.yaml", d / "zz-hook.yaml")
        assert wait_until(reg.reading.is_set, what="the watcher to start a re-read")
        p = with_node_cdi_devices(plan_for(UUIDS[0]), reg)  # type: ignore[arg-type]
        assert p.cdi_devices == (f"{DP}={UUIDS[0]}",) and not reg.device_for(UUIDS[0]).has_memory_limit_hook  # type: ignore[union-attr]
        reg.release.set()
        assert wait_until(lambda: reg.device_for(UUIDS[0]).has_memory_limit_hook,  # type: ignore[union-attr]
                          what="the re-read to swap the snapshot")
    finally:
        reg.release.set()
        reg.stop()


def test_a_missing_spec_directory_is_one_warning_and_a_status_line(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Issue 36 item 2: a ``--cdi-spec-dirs`` entry that does not exist is said once at start and in status."""
    from fracplugin.status import render_cdi

    gone = tmp_path / "nope"
    reg = CdiRegistry([str(gone), str(tree(tmp_path, "with-hook"))], NODE.gpus)
    reg.file_check_s = 60
    with caplog.at_level(logging.WARNING, logger="fracplugin.cdi"):
        reg.start()
        reg.stop()
    assert [r.getMessage() for r in caplog.records] == [
        f"CDI spec directory {gone}: does not exist; no spec is read from it"]
    st = reg.status()
    assert st["unreadable_dirs"] == {str(gone): "does not exist"}
    assert f"spec directory {gone} does not exist: no spec read from it" in render_cdi(st)
