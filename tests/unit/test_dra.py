"""The DRA door's pure parts (issue 29, ADR 0031): the parameters type, a
claim's allocation -> request -> plan, the CDI spec, the ResourceSlice
builder; and the slice publisher against the HTTP stand-in for the API
server (``tests/peers/resource_api.py``) through a kubeconfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fracplugin.dra import cdispec, claims, params
from fracplugin.dra.slices import ATTR_COMPUTE_MODE, MODE_NONE, SlicePublisher, build_slice, mode_text, slice_name
from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import ComputeMode, FractionError
from tests.helpers import wait_until
from tests.peers.resource_api import ResourceApi, claim_doc
from tests.helpers import node_rules

REPO = Path(__file__).resolve().parents[2]
NODE = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
GPU0, GPU1 = NODE.gpus[0].uuid, NODE.gpus[1].uuid
HEAD = {"apiVersion": params.API_VERSION, "kind": params.KIND}


# ---- parameters ---------------------------------------------------------------------
def test_parameters_default_and_merge_class_then_claim() -> None:
    assert params.parse([]) == params.GpuMemoryParameters()
    p = params.parse([{**HEAD, "gpu-compute.mode": "sm-sharing", "gpu-compute.portion": "0.3"},
                      {**HEAD, "gpu-compute.portion": 0.5, "gpu-memory.limit": "24Gi"}])
    assert (p.compute_mode, p.portion, p.limit_mib) == (ComputeMode.SM_SHARING, 0.5, 24576)


@pytest.mark.parametrize("doc,key,value,rule", [
    ({**HEAD, "gpu-compute.mode": "fast"}, "GpuMemoryParameters.gpu-compute.mode", "fast", "must be exactly"),
    ({**HEAD, "gpu-compute.portion": 0}, "GpuMemoryParameters.gpu-compute.portion", "0", "is outside (0, 1]"),
    ({**HEAD, "gpu-compute.portion": True}, "GpuMemoryParameters.gpu-compute.portion", "True", params.NOT_TEXT),
    ({**HEAD, "gpu-memory.limit": "20 Gi"}, "GpuMemoryParameters.gpu-memory.limit", "20 Gi", "is not a Kubernetes quantity"),
    ({**HEAD, "gpu-memory.limit": "512"}, "GpuMemoryParameters.gpu-memory.limit", "512", "did you mean 512Mi?"),
    ({**HEAD, "memory": "1Gi"}, "GpuMemoryParameters.memory", "1Gi", "is not a field of GpuMemoryParameters"),
    ({"apiVersion": "v1", "kind": params.KIND}, "apiVersion", "v1", params.WRONG_API_VERSION),
    ({"apiVersion": params.API_VERSION, "kind": "Other"}, "kind", "Other", params.WRONG_KIND),
    ("sm-sharing", params.KIND, "sm-sharing", params.NOT_AN_OBJECT),
])
def test_bad_parameters_name_key_value_and_rule(doc: object, key: str, value: str, rule: str) -> None:
    with pytest.raises(FractionError) as e:
        params.parse([doc])
    assert (e.value.key, e.value.value) == (key, value) and rule in e.value.reason


# ---- claims -------------------------------------------------------------------------
def test_claim_to_request_and_plan() -> None:
    doc = claim_doc("ns", "c", "uid-1", memory="20Gi",
                    parameters={**HEAD, "gpu-compute.mode": "sm-sharing", "gpu-memory.limit": "22Gi"})
    c = claims.read_claim(doc, NODE, uid="uid-1")
    assert (c.request_mib, [d.gpu.uuid for d in c.devices], c.reservation) == (20480, [GPU0], "dra:uid-1")
    plan = claims.plan_claim(c, node_rules(NODE, Ledger(NODE)))
    assert plan.device_uuids == (GPU0,) and (plan.request_mib, plan.limit_mib) == (20480, 22528)
    assert plan.compute_mode is ComputeMode.SM_SHARING and plan.active_thread_percentage == 26  # KAI's portion 0.26
    assert plan.mps_namespace is not None and plan.pod.uid == "uid-1"


def test_claim_on_two_gpus_and_configs_for_other_requests_or_drivers_ignored() -> None:
    doc = claim_doc("ns", "c", "uid-2", memory="4Gi", parameters={**HEAD, "gpu-compute.mode": "sm-sharing"},
                    extra_results=[{"request": "gpu", "driver": "gpu-memory.fracplugin.io", "pool": "gpu-node-1",
                                    "device": "gpu-1", "consumedCapacity": {"memory": "4Gi"}},
                                   {"request": "nic", "driver": "other.example.com", "pool": "p", "device": "x"}])
    doc["status"]["allocation"]["devices"]["config"] += [
        {"source": "FromClaim", "requests": ["nic"], "opaque": {"driver": "gpu-memory.fracplugin.io",
                                                                "parameters": {"bad": 1}}},
        {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"bad": 1}}}]
    c = claims.read_claim(doc, NODE)
    assert [d.device for d in c.devices] == ["gpu-0", "gpu-1"]
    plan = claims.plan_claim(c, node_rules(NODE, Ledger(NODE)))
    assert plan.device_uuids == (GPU0, GPU1) and plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{GPU0}=4096M,{GPU1}=4096M"


def _class_config(parameters: object, requests: list[str] | None = None) -> dict:
    """A ``status.allocation.devices.config`` entry from a DeviceClass (the
    scheduler copies the class's ``spec.config`` there, ``source: FromClass``)."""
    return {"source": "FromClass", "requests": requests or ["gpu"],
            "opaque": {"driver": "gpu-memory.fracplugin.io", "parameters": parameters}}


def test_class_config_sets_the_mode_and_the_claims_config_overrides_it() -> None:
    # the chart's sm-sharing class alone (no claim config): its mode applies
    doc = claim_doc("ns", "c", "uid-5")
    doc["status"]["allocation"]["devices"]["config"] = [_class_config({**HEAD, "gpu-compute.mode": "sm-sharing"})]
    c = claims.read_claim(doc, NODE)
    assert c.parameters.compute_mode is ComputeMode.SM_SHARING and c.parameters.given == ("gpu-compute.mode",)
    assert claims.plan_claim(c, node_rules(NODE, Ledger(NODE))).compute_mode is ComputeMode.SM_SHARING
    # a claim config for the same request wins over the class's, field by field, whatever the list order
    doc = claim_doc("ns", "c", "uid-5", parameters={**HEAD, "gpu-compute.mode": "time-slicing"})
    doc["status"]["allocation"]["devices"]["config"].append(
        _class_config({**HEAD, "gpu-compute.mode": "sm-sharing", "gpu-memory.limit": "22Gi"}))
    p = claims.read_claim(doc, NODE).parameters
    assert (p.compute_mode, p.limit_mib) == (ComputeMode.TIME_SLICING, 22528)
    # a class config of another request (or of a subrequest's parent) applies only to its own
    doc = claim_doc("ns", "c", "uid-5")
    doc["status"]["allocation"]["devices"]["config"] = [
        _class_config({**HEAD, "gpu-compute.mode": "sm-sharing"}, ["other"])]
    assert claims.read_claim(doc, NODE).parameters.compute_mode is ComputeMode.TIME_SLICING
    doc["status"]["allocation"]["devices"]["results"][0]["request"] = "gpu/big"
    doc["status"]["allocation"]["devices"]["config"] = [_class_config({**HEAD, "gpu-compute.mode": "sm-sharing"})]
    assert claims.read_claim(doc, NODE).parameters.compute_mode is ComputeMode.SM_SHARING


def test_bad_class_config_is_refused_naming_key_value_and_rule() -> None:
    doc = claim_doc("ns", "c", "uid-6")
    doc["status"]["allocation"]["devices"]["config"] = [_class_config({**HEAD, "gpu-compute.mode": "mps"})]
    with pytest.raises(FractionError) as e:
        claims.read_claim(doc, NODE)
    assert (e.value.key, e.value.value) == ("GpuMemoryParameters.gpu-compute.mode", "mps")
    assert 'must be exactly "time-slicing" or "sm-sharing"' in e.value.reason


@pytest.mark.parametrize("change,key,rule", [
    (lambda d: d["metadata"].update(uid="other"), "metadata.uid", "deleted and re-created"),
    (lambda d: d["status"].pop("allocation"), "resourceclaim ns/c", claims.NOT_ALLOCATED),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].update(driver="x.io"), "resourceclaim ns/c",
     "has no device of driver"),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].update(pool="n2"),
     "status.allocation.devices.results[0].pool", "is not this node's pool"),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].update(device="gpu-9"),
     "status.allocation.devices.results[0].device", "is not a GPU device of node gpu-node-1"),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].pop("consumedCapacity"),
     "status.allocation.devices.results[0].consumedCapacity", "DRAConsumableCapacity"),
    (lambda d: d["status"]["allocation"]["devices"]["results"][0].update(adminAccess=True),
     "status.allocation.devices.results[0].adminAccess", "admin access"),
])
def test_claim_refusals(change, key: str, rule: str) -> None:
    doc = claim_doc("ns", "c", "uid-3")
    change(doc)
    with pytest.raises(FractionError) as e:
        claims.read_claim(doc, NODE, uid="uid-3")
    assert e.value.key == key and rule in e.value.reason, e.value.message


def test_claim_guard_counts_the_other_doors_and_not_itself() -> None:
    ledger = Ledger(NODE)
    big = claims.read_claim(claim_doc("ns", "a", "uid-a", memory="70Gi"), NODE)
    ledger.admit(claims.plan_claim(big, node_rules(NODE, ledger)), door="dra", reservation=big.reservation)
    # re-planning the same claim does not count its own hold
    claims.plan_claim(big, node_rules(NODE, ledger))
    more = claims.read_claim(claim_doc("ns", "b", "uid-b", memory="20Gi"), NODE)
    with pytest.raises(FractionError) as e:
        claims.plan_claim(more, node_rules(NODE, ledger))
    assert "has 9879 MiB of 81559 MiB free; this container requests 20480 MiB" in e.value.message


# ---- CDI spec -----------------------------------------------------------------------
def test_cdi_spec_written_and_removed(tmp_path: Path) -> None:
    c = claims.read_claim(claim_doc("ns", "c", "uid-4"), NODE)
    plan = claims.plan_claim(c, node_rules(NODE, Ledger(NODE)))
    path = cdispec.write_spec(str(tmp_path), "uid-4", plan)
    doc = json.loads(path.read_text())
    assert doc["kind"] == "gpu-memory.fracplugin.io/claim" and doc["devices"][0]["name"] == "uid-4"
    assert "FRACPLUGIN_DRA_CLAIM=uid-4" in doc["devices"][0]["containerEdits"]["env"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    assert cdispec.remove_spec(str(tmp_path), "uid-4") and not cdispec.remove_spec(str(tmp_path), "uid-4")
    with pytest.raises(ValueError):
        cdispec.spec_path(str(tmp_path), "../etc")


# ---- slices -------------------------------------------------------------------------
def test_slice_builder_one_device_per_healthy_gpu() -> None:
    s = build_slice(NODE, reserve_mib=1024, healthy={GPU1: False}, generation=3)
    spec = s["spec"]
    assert s["metadata"]["name"] == slice_name("gpu-node-1") == "gpu-node-1-gpu-memory.fracplugin.io"
    assert spec["pool"] == {"name": "gpu-node-1", "generation": 3, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-2", "gpu-3"]  # GPU 1 withdrawn
    d0 = spec["devices"][0]
    assert d0["allowMultipleAllocations"] is True
    assert d0["attributes"] == {"uuid": {"string": GPU0}, "productName": {"string": "NVIDIA H100 80GB HBM3"},
                                "driverVersion": {"string": "615.71.09"}, "computeCapability": {"string": "9.0"},
                                "computeMode": {"string": "none"}, "index": {"int": 0}}
    mem = d0["capacity"]["memory"]
    assert mem["value"] == mem["requestPolicy"]["default"] == str(80535 * 2**20)
    assert mem["requestPolicy"]["validRange"] == {"min": "1048576", "step": "1048576"}


def test_slice_publisher_creates_updates_on_health_change_and_deletes(tmp_path: Path) -> None:
    from kubernetes import config as kconfig

    api = ResourceApi()
    health = {GPU0: True}
    pub = None
    try:
        client = kconfig.new_client_from_config(config_file=str(api.serve(tmp_path)))
        pub = SlicePublisher(client, NODE, reserve_mib=1024, healthy=lambda: dict(health), poll_s=60)
        name = slice_name("gpu-node-1")
        pub.start()
        assert api.wait_for(lambda a: name in a.slices)
        assert wait_until(lambda: pub.status()["writes"] == 1)
        assert api.slices[name]["spec"]["pool"]["generation"] == 1 and len(api.slices[name]["spec"]["devices"]) == 4
        health[GPU0] = False  # an Unhealthy GPU is withdrawn at the next pass
        pub.poke()
        assert api.wait_for(lambda a: len(a.slices[name]["spec"]["devices"]) == 3)
        assert wait_until(lambda: pub.status()["writes"] == 2)
        assert api.slices[name]["spec"]["pool"]["generation"] == 2
        assert ("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{name}") in api.requests
        # no change, no write
        sent = [r for r in api.requests if r[0] in ("PUT", "POST")]
        assert pub.sync() and pub.status()["writes"] == 2
        assert [r for r in api.requests if r[0] in ("PUT", "POST")] == sent
        # deleted by someone: written again at the resync, with a newer generation than it knew
        with api.cond:
            del api.slices[name]
        pub.resync_s = 0.0
        assert pub.sync() and api.slices[name]["spec"]["pool"]["generation"] == 3
        pub.stop(2.0, delete=True)
        assert name not in api.slices
    finally:
        if pub is not None:
            pub.stop(2.0)  # no thread left writing to the closed API into later tests (idempotent)
        api.close()


def _hold(ledger: Ledger, uid: str, device: str, mode: str, door: str = "dra") -> None:
    """A 4Gi claim of ``mode`` on ``device`` held in ``ledger`` (through ``door``)."""
    c = claims.read_claim(claim_doc("ns", uid, uid, device=device, memory="4Gi",
                                    parameters={**HEAD, "gpu-compute.mode": mode}), NODE)
    ledger.admit(claims.plan_claim(c, node_rules(NODE, ledger)), door=door, reservation=c.reservation)


def _modes(doc: dict) -> dict[str, str]:
    return {d["name"]: d["attributes"][ATTR_COMPUTE_MODE]["string"] for d in doc["spec"]["devices"]}


def test_slice_compute_mode_is_the_ledgers_mode_of_each_gpu() -> None:
    ledger = Ledger(NODE)
    modes = lambda: {g.uuid: ledger.mode(g.uuid) for g in NODE.gpus}  # noqa: E731  as the daemon wires it
    assert _modes(build_slice(NODE, reserve_mib=1024, modes=modes())) == {
        "gpu-0": "none", "gpu-1": "none", "gpu-2": "none", "gpu-3": "none"}
    assert _modes(build_slice(NODE, reserve_mib=1024)) == _modes(build_slice(NODE, reserve_mib=1024, modes=modes()))
    _hold(ledger, "a", "gpu-0", "sm-sharing")
    _hold(ledger, "b", "gpu-0", "sm-sharing")
    _hold(ledger, "c", "gpu-1", "time-slicing", door="nri")  # another door's hold: the one ledger
    assert _modes(build_slice(NODE, reserve_mib=1024, modes=modes())) == {
        "gpu-0": "sm-sharing", "gpu-1": "time-slicing", "gpu-2": "none", "gpu-3": "none"}
    # the attribute says what the planner's guard enforces: the other mode is refused there
    with pytest.raises(FractionError) as e:
        _hold(ledger, "d", "gpu-0", "time-slicing")
    assert "one compute mode per GPU" in e.value.message
    ledger.release_reservation("dra:a")
    assert _modes(build_slice(NODE, reserve_mib=1024, modes=modes()))["gpu-0"] == "sm-sharing"  # b still holds
    ledger.release_reservation("dra:b")
    ledger.release_reservation("dra:c")
    assert set(_modes(build_slice(NODE, reserve_mib=1024, modes=modes())).values()) == {MODE_NONE}
    assert [mode_text(m) for m in (None, *ComputeMode)] == ["none", "time-slicing", "sm-sharing"]


def test_slice_publisher_republishes_on_a_ledger_change_without_waiting_for_the_poll(tmp_path: Path) -> None:
    from kubernetes import config as kconfig

    api = ResourceApi()
    ledger = Ledger(NODE)
    pub = None
    try:
        client = kconfig.new_client_from_config(config_file=str(api.serve(tmp_path)))
        pub = SlicePublisher(client, NODE, reserve_mib=1024, poll_s=3600,  # the poll never comes in this test
                             modes=lambda: {g.uuid: ledger.mode(g.uuid) for g in NODE.gpus})
        ledger.subscribe(pub.poke)
        name = slice_name("gpu-node-1")
        pub.start()
        assert api.wait_for(lambda a: name in a.slices and _modes(a.slices[name])["gpu-2"] == "none")
        _hold(ledger, "e", "gpu-2", "sm-sharing")
        assert api.wait_for(lambda a: _modes(a.slices[name])["gpu-2"] == "sm-sharing"), api.slices[name]
        assert api.slices[name]["spec"]["pool"]["generation"] == 2
        ledger.release_reservation("dra:e")
        assert api.wait_for(lambda a: _modes(a.slices[name])["gpu-2"] == "none"), api.slices[name]
        assert api.slices[name]["spec"]["pool"]["generation"] == 3
    finally:
        if pub is not None:
            pub.stop(2.0)
        api.close()


# ---- explain ------------------------------------------------------------------------
def test_explain_shows_what_prepare_would_give_a_claim(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    import yaml

    from fracplugin import explain

    node = str(REPO / "examples" / "nodes" / "gpu-node-1.yaml")
    good = tmp_path / "claim.yaml"
    good.write_text(yaml.safe_dump(claim_doc("team-a", "infer", "uid-7", memory="20Gi",
                                             parameters={**HEAD, "gpu-compute.mode": "sm-sharing"})))
    report = explain.explain(explain.load_pods(str(good))[0], node)
    (entry,) = report["containers"]
    assert report["pod"] == "resourceclaim team-a/infer" and entry["error"] is None
    assert entry["devices"] == [GPU0] and entry["request_mib"] == 20480 and entry["compute_mode"] == "sm-sharing"
    assert entry["env"]["FRACPLUGIN_DRA_CLAIM"] == "uid-7"
    assert entry["cdi_devices"] == ["gpu-memory.fracplugin.io/claim=uid-7"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(claim_doc("team-a", "bad", "uid-8", parameters={**HEAD, "gpu-compute.mode": "x"})))
    p = argparse.ArgumentParser()
    explain.add_arguments(p)
    assert explain.main(p.parse_args([str(bad), "--node", node])) == 1
    out = capsys.readouterr().out
    assert "key:    GpuMemoryParameters.gpu-compute.mode\n  value:  'x'\n" in out, out
    assert 'reason: must be exactly "time-slicing" or "sm-sharing"' in out, out


def test_claim_specs_are_named_so_the_cdi_reader_skips_them(tmp_path) -> None:
    """``cdi.CdiRegistry`` skips files starting ``OWN_CLAIM_SPEC_PREFIX``
    (they name no GPU); every claim spec path must start with it."""
    from fracplugin.cdi import OWN_CLAIM_SPEC_PREFIX
    from fracplugin.dra import cdispec

    assert cdispec.spec_path(str(tmp_path), "abc-1").name.startswith(OWN_CLAIM_SPEC_PREFIX)
    assert OWN_CLAIM_SPEC_PREFIX == f"{cdispec.DRIVER_NAME}-{cdispec.CDI_CLASS}_"
