"""Ledger: guards, atomic persistence, corrupt files, invariants under any sequence."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.ledgerstore import LedgerStore
from fracplugin.model import FractionError, PodRef
from tests.helpers import plan_container


@pytest.fixture
def node(node_file):
    return load_node(node_file)


def mkplan(node, ledger, uid, request="10Gi", mode="time-slicing", devices="0", container="app"):
    ann = {f"nvidia.com/container.{container}.gpu-memory.request": request,
           f"nvidia.com/container.{container}.gpu-compute.mode": mode,
           f"nvidia.com/container.{container}.gpus.devices": devices}
    return plan_container(ann, container, PodRef("ns", uid, uid), node, ledger)


def test_admit_persists_and_reloads(node, tmp_path):
    path = tmp_path / "state" / "ledger.json"
    a = Ledger(node, path)
    a.admit(mkplan(node, a, "u1", devices="0,1"), container_id="c1")
    b = Ledger(node, path)
    assert b.load() == []
    assert b.tenancies() == a.tenancies()
    assert [t.gpu_uuid for t in b.find("u1", "app")] == [node.gpus[0].uuid, node.gpus[1].uuid]
    assert b.release_container_id("c1") and Ledger(node, path).load() == [] and not Ledger(node, path).tenancies()
    # no temp files left behind: the snapshot and its journal only
    assert sorted(p.name for p in path.parent.iterdir()) == ["ledger.json", "ledger.json.journal"]


def test_a_reservation_keeps_its_charge_while_a_smaller_container_of_its_pod_holds_it(node, tmp_path):
    """ADR 0033: a pod's union hold (3 GiB) stays charged while its 2 GiB init container runs under it; the
    container's own request and limit stay its own; the held amount survives the journal and a snapshot."""
    path, gpu = tmp_path / "ledger.json", node.gpus[0]
    led = Ledger(node, path)
    key = f"{gpu.uuid}::0-2"
    led.admit(mkplan(node, led, "u1", request="3Gi"), reservation=key, bound=False)
    (init,) = led.admit(mkplan(node, led, "u1", request="2Gi", container="init"), container_id="c1",
                        reservation=key)
    assert (init.request_mib, init.limit_mib, init.held_mib, init.charged_mib) == (2048, 2048, 3072, 3072)
    free = gpu.memory_mib - 3072
    with pytest.raises(FractionError, match=f"has {free} MiB of {gpu.memory_mib} MiB free"):
        led.admit(mkplan(node, Ledger(node), "u2", request=f"{free + 1}Mi"))

    def reloaded() -> list:
        again = Ledger(node, path, read_only=True)
        assert again.load() == []
        return again.tenancies()

    assert reloaded() == led.tenancies()  # from the journal
    led.close()
    assert '"held_mib":3072' in path.read_text() and reloaded() == led.tenancies()  # from the snapshot
    (app,) = led.admit(mkplan(node, led, "u1", request="3Gi"), container_id="c2", reservation=key)
    assert (app.request_mib, app.held_mib) == (3072, 0)
    (other,) = led.admit(mkplan(node, led, "u3", request="1Gi"), reservation=key)  # another pod keeps nothing
    assert (other.request_mib, other.held_mib) == (1024, 0)


def test_a_ledger_file_without_held_mib_loads_and_a_negative_one_is_corrupt(node, tmp_path):
    """A file written before ``held_mib`` existed loads (0: the request is the charge); ``-1`` is refused."""
    path = tmp_path / "ledger.json"
    led = Ledger(node, path)
    led.admit(mkplan(node, led, "u1"), container_id="c1")
    led.close()
    doc = json.loads(path.read_text())
    assert "held_mib" not in doc["tenancies"][0]
    again = Ledger(node, path)
    assert again.load() == [] and [(t.request_mib, t.held_mib) for t in again.tenancies()] == [(10240, 0)]
    doc["tenancies"][0]["held_mib"] = -1
    path.write_text(json.dumps(doc))
    assert "held -1 MiB" in Ledger(node, path).load()[0]


def test_corrupt_file_is_set_aside_not_trusted(node, tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("{not json")
    led = Ledger(node, path)
    warnings = led.load()
    assert len(warnings) == 1 and "corrupt" in warnings[0]
    assert led.tenancies() == [] and not path.exists()
    assert any(p.name.startswith("ledger.json.corrupt-") for p in tmp_path.iterdir())


def test_records_on_unknown_gpus_are_dropped_with_a_warning(node, tmp_path):
    path = tmp_path / "ledger.json"
    led = Ledger(node, path)
    led.admit(mkplan(node, led, "u1"))
    doc = json.loads(path.read_text())
    doc["tenancies"][0]["gpu_uuid"] = "GPU-gone"
    path.write_text(json.dumps(doc))
    again = Ledger(node, path)
    assert "GPU-gone" in again.load()[0] and again.tenancies() == []


def test_read_only_ledger_never_moves_the_file(node, tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("garbage")
    assert "ignored" in Ledger(node, path, read_only=True).load()[0]
    assert path.read_text() == "garbage"


def test_admit_is_atomic_across_gpus(node):
    led = Ledger(node)
    led.admit(mkplan(node, led, "big", request="70Gi", devices="1"))
    plan = mkplan(node, Ledger(node), "two", request="20Gi", devices="0,1")
    with pytest.raises(FractionError):
        led.admit(plan)
    assert led.find("two", "app") == [] and led.tenants(node.gpus[0].uuid) == []


def test_one_mode_per_gpu_enforced_by_admit(node):
    led = Ledger(node)
    led.admit(mkplan(node, led, "a", mode="sm-sharing"))
    plan = mkplan(node, Ledger(node), "b", mode="time-slicing")
    with pytest.raises(FractionError) as ei:
        led.admit(plan)
    assert ei.value.code == "guard"


def test_client_limit(node):
    led = Ledger(node, max_clients_per_gpu=2)
    led.admit(mkplan(node, led, "a", request="1Gi"))
    led.admit(mkplan(node, led, "b", request="1Gi"))
    with pytest.raises(FractionError) as ei:
        led.admit(mkplan(node, Ledger(node), "c", request="1Gi"))
    assert "MPS client limit is 2 per GPU" in ei.value.reason


def test_readmit_replaces_and_subscribers_hear_changes(node):
    led = Ledger(node)
    seen = []
    led.subscribe(lambda: seen.append(len(led.tenancies())))
    led.admit(mkplan(node, led, "a", devices="0"))
    led.admit(mkplan(node, led, "a", devices="1"))
    assert [t.gpu_uuid for t in led.tenancies()] == [node.gpus[1].uuid]
    led.release("a", "app")
    assert seen == [1, 1, 0]


def test_failed_compaction_rolls_back(node, tmp_path, monkeypatch):
    """The first change after a load writes a snapshot (compaction): a full
    disk there leaves memory and disk on the last good state, no temp file."""
    path = tmp_path / "ledger.json"
    led = Ledger(node, path)
    led.admit(mkplan(node, led, "a", devices="0"))
    led.close()
    saved = path.read_text()
    led = Ledger(node, path)
    assert led.load() == []

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError):
        led.admit(mkplan(node, led, "b", devices="1"))
    with pytest.raises(OSError):
        led.release("a", "app")
    # memory and disk still agree on the last good state, and no temp file is left
    assert [t.pod_uid for t in led.tenancies()] == ["a"]
    assert path.read_text() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.json", "ledger.json.journal"]
    monkeypatch.undo()
    again = Ledger(node, path)
    assert again.load() == [] and [t.pod_uid for t in again.tenancies()] == ["a"]


def test_failed_journal_append_rolls_back(node, tmp_path, monkeypatch):
    """A journal append whose fsync fails (ENOSPC) is cut from the file and
    undone in memory: a reload sees exactly what memory holds."""
    path = tmp_path / "ledger.json"
    led = Ledger(node, path)
    led.admit(mkplan(node, led, "a", devices="0"))  # compaction: the journal is open now
    journal = path.with_name("ledger.json.journal")
    size = journal.stat().st_size

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", disk_full)
    with pytest.raises(OSError):
        led.admit(mkplan(node, led, "b", devices="1"))
    monkeypatch.undo()
    assert [t.pod_uid for t in led.tenancies()] == ["a"]
    assert journal.stat().st_size == size
    again = Ledger(node, path)
    assert again.load() == [] and again.tenancies() == led.tenancies()
    # the ledger keeps working: the next change compacts, and is durable
    led.admit(mkplan(node, led, "c", devices="2"))
    again = Ledger(node, path)
    assert again.load() == [] and [t.pod_uid for t in again.tenancies()] == ["a", "c"]


def _journal_state(node, path, n):
    led = Ledger(node, path)
    for i in range(n):
        led.admit(mkplan(node, led, f"u{i}", request="1Gi", devices=str(i % 4)), container_id=f"c{i}")
    return led


def test_changes_are_appended_not_rewritten(node, tmp_path):
    """After the first change (a snapshot), each change is one journal line
    and the snapshot is not rewritten; a reload replays the journal."""
    path = tmp_path / "ledger.json"
    led = _journal_state(node, path, 1)
    snap = path.read_bytes()
    for i in range(1, 6):
        led.admit(mkplan(node, led, f"u{i}", request="1Gi", devices=str(i % 4)), container_id=f"c{i}")
    led.release_container_id("c2")
    assert path.read_bytes() == snap
    lines = path.with_name("ledger.json.journal").read_bytes().splitlines()
    assert len(lines) == 1 + 5 + 1  # header, five admissions, one release
    again = Ledger(node, path)
    assert again.load() == [] and again.tenancies() == led.tenancies()
    assert [t.pod_uid for t in again.tenancies()] == ["u0", "u1", "u3", "u4", "u5"]
    # a reader (fracplugin explain --ledger) replays the journal and writes nothing
    journal = path.with_name("ledger.json.journal").read_bytes()
    ro = Ledger(node, path, read_only=True)
    assert ro.load() == [] and ro.tenancies() == led.tenancies()
    ro.close()
    assert path.read_bytes() == snap and path.with_name("ledger.json.journal").read_bytes() == journal


@pytest.mark.parametrize("tail", [b'{"del":[],"add":[{"pod_uid":"x"', b'{"del":[],"add":[{"pod_', b"\x00\x00\x00\x00",
                                  b'{"del":[],"add":[{"pod_uid":"x"}]}\n', b"\x00\x00\n", b"not json\n"])
def test_torn_journal_tail_is_dropped_with_a_warning(node, tmp_path, tail):
    """A crash during an append leaves a torn last line (cut, zero-filled, or
    garbage): the unacknowledged change is dropped, every earlier one kept,
    and the next change starts a new generation that reloads cleanly."""
    path = tmp_path / "ledger.json"
    led = _journal_state(node, path, 4)
    with open(path.with_name("ledger.json.journal"), "ab") as f:
        f.write(tail)
    again = Ledger(node, path)
    (warning,) = again.load()
    assert "torn" in warning and "line 5" in warning
    assert again.tenancies() == led.tenancies()
    again.admit(mkplan(node, again, "u9", request="1Gi", devices="0"), container_id="c9")
    third = Ledger(node, path)
    assert third.load() == [] and [t.pod_uid for t in third.tenancies()] == ["u0", "u1", "u2", "u3", "u9"]


def test_bad_journal_line_before_the_end_is_corruption(node, tmp_path):
    """A bad record followed by good ones is not a torn tail: nothing is
    trusted, both files are moved aside and the ledger starts empty."""
    path = tmp_path / "ledger.json"
    _journal_state(node, path, 3)  # header + two appended admissions
    journal = path.with_name("ledger.json.journal")
    lines = journal.read_bytes().splitlines(keepends=True)
    lines.insert(2, b"garbage\n")
    journal.write_bytes(b"".join(lines))
    led = Ledger(node, path)
    (warning,) = led.load()
    assert "corrupt" in warning and "journal line 3" in warning and led.tenancies() == []
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not path.exists() and not journal.exists()
    assert any(n.startswith("ledger.json.corrupt-") for n in names)
    assert any(n.startswith("ledger.json.journal.corrupt-") for n in names)


def test_journal_of_an_older_generation_is_ignored(node, tmp_path):
    """A compaction cut between its snapshot rename and its journal rename
    leaves the previous journal next to the new snapshot: its changes are in
    the snapshot already and replaying them would double them."""
    path = tmp_path / "ledger.json"
    led = _journal_state(node, path, 3)
    journal = path.with_name("ledger.json.journal")
    old = journal.read_bytes()
    led.release_container_id("c0")
    led.close()  # compaction: new generation
    journal.write_bytes(old)  # as if the journal rename never happened
    again = Ledger(node, path)
    assert again.load() == [] and [t.pod_uid for t in again.tenancies()] == ["u1", "u2"]


def test_compaction_bounds_the_journal(node, tmp_path, monkeypatch):
    """Past max(compact_min, 2 x tenancies) changes the journal is
    folded into a new snapshot; the state survives any number of rounds."""
    monkeypatch.setattr(LedgerStore, "compact_min", 4)
    path = tmp_path / "ledger.json"
    led = Ledger(node, path)
    for i in range(40):
        led.admit(mkplan(node, led, f"u{i % 6}", request="1Gi", devices=str(i % 4)), container_id=f"c{i}")
        if i % 3 == 0:
            led.release(f"u{(i + 2) % 6}", "app")
        lines = path.with_name("ledger.json.journal").read_bytes().count(b"\n")
        assert lines <= 1 + max(4, 2 * len(led.tenancies())) + 1
    again = Ledger(node, path)
    assert again.load() == [] and again.tenancies() == led.tenancies()
    led.close()
    assert path.with_name("ledger.json.journal").read_bytes().count(b"\n") == 1  # header only
    assert json.loads(path.read_text())["tenancies"] == [t.to_dict() for t in led.tenancies()]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "release", "release_pod", "reload"]),
        st.sampled_from(["u1", "u2", "u3", "u4", "u5"]),
        st.sampled_from(["app", "side"]),
        st.sampled_from(["1Gi", "20Gi", "40Gi", "79Gi"]),
        st.sampled_from(["time-slicing", "sm-sharing"]),
        st.sampled_from(["0", "1", "0,1", "2,3", "3"]),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_no_sequence_of_operations_breaks_the_invariants(tmp_path_factory, ops):
    node = load_node(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "nodes", "gpu-node-1.yaml"))
    path = tmp_path_factory.mktemp("l") / "ledger.json"
    led = Ledger(node, path, max_clients_per_gpu=3)
    for op, uid, c, req, mode, devices in ops:
        if op == "admit":
            try:
                led.admit(mkplan(node, led, uid, request=req, mode=mode, devices=devices, container=c))
            except FractionError:
                pass
        elif op == "release":
            led.release(uid, c)
        elif op == "release_pod":
            led.release(uid, "app")
            led.release(uid, "side")
        else:
            before = led.tenancies()
            led = Ledger(node, path, max_clients_per_gpu=3)
            assert led.load() == [] and led.tenancies() == before
        assert led.check_invariants() == []


@pytest.mark.parametrize("content", [
    '{"version": 1, "node": "n", "tenancies": [1]}',
    '{"version": 1, "node": "n", "tenancies": ["x"]}',
    "[" * 100000 + "]" * 100000,
    '{"version": 1, "node": "n", "tenancies": [{"pod_uid": "u", "namespace": "n", "pod_name": "p", "container": "c",'
    ' "gpu_uuid": "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01", "request_mib": -80000, "limit_mib": 1, "mode": "time-slicing"}]}',
])
def test_any_unreadable_ledger_is_set_aside(node, tmp_path, content):
    path = tmp_path / "ledger.json"
    path.write_text(content)
    led = Ledger(node, path)
    (warning,) = led.load()
    assert "corrupt" in warning and led.tenancies() == [] and not path.exists()


def test_state_dir_not_on_tmpfs_is_warned(tmp_path):
    """statfs f_type, checked against coreutils' `stat -f -c %t` (an
    independent reader): tmpfs (/dev/shm) gets no warning, any other type one
    naming --state-dir, the path and the f_type."""
    import shutil
    import subprocess

    from fracplugin.ledgerstore import TMPFS_MAGIC, filesystem_type, state_dir_warning

    for path in ("/dev/shm", str(tmp_path)):
        if not os.path.isdir(path):
            continue
        ftype = filesystem_type(path)
        if shutil.which("stat"):
            assert ftype == int(subprocess.run(["stat", "-f", "-c", "%t", path], capture_output=True, text=True,
                                               check=True).stdout, 16)
        warning = state_dir_warning(os.path.join(path, "not", "yet", "made"))  # the nearest existing parent
        if ftype == TMPFS_MAGIC:
            assert warning == ""
        else:
            assert "--state-dir" in warning and path in warning and f"0x{ftype:x}" in warning
    if os.path.isdir("/dev/shm"):
        assert filesystem_type("/dev/shm") == TMPFS_MAGIC


def test_journal_not_started_after_a_written_snapshot_keeps_the_change(node, tmp_path, monkeypatch):
    """Compaction = snapshot, then journal. When the snapshot is in place and
    only the journal cannot be started, the change is durable: it is kept in
    memory (no rollback), a reload sees it, and the next change writes a
    snapshot again."""
    path = tmp_path / "ledger.json"
    led = Ledger(node, path)
    led.admit(mkplan(node, led, "a", devices="0"))
    led.close()
    led = Ledger(node, path)
    led.load()
    real_replace = os.replace

    def journal_full(src, dst):
        if str(dst).endswith(".journal"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", journal_full)
    led.admit(mkplan(node, led, "b", devices="1"))  # compaction: snapshot ok, journal refused
    monkeypatch.undo()
    assert [t.pod_uid for t in led.tenancies()] == ["a", "b"]
    again = Ledger(node, path)
    assert again.load() == [] and [t.pod_uid for t in again.tenancies()] == ["a", "b"]
    led.admit(mkplan(node, led, "c", devices="2"))
    again = Ledger(node, path)
    assert again.load() == [] and [t.pod_uid for t in again.tenancies()] == ["a", "b", "c"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
