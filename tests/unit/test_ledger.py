"""Ledger: guards, atomic persistence, corrupt files, invariants under any sequence."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import FractionError, PodRef
from fracplugin.planner import plan_container


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
    assert [p.name for p in path.parent.iterdir()] == ["ledger.json"]  # no temp files left behind


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
    assert led.find("two", "app") == [] and led.held_mib(node.gpus[0].uuid) == 0


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
    led.release_pod("a")
    assert seen == [1, 1, 0]


def test_failed_persist_rolls_back(node, tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    led = Ledger(node, path)
    led.admit(mkplan(node, led, "a", devices="0"))
    saved = path.read_text()

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
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]


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
            led.release_pod(uid)
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
