"""Issue 36 item 6 and input 7: the per-GPU cordon (node annotation
``fracplugin.io/cordoned-gpus``) through the real daemon (``fracplugin run``
subprocess on the simulated four-GPU node) and its real sockets: the NRI
runtime peer, the device plugin kubelet (``fake_kubelet``), the DRA kubelet,
and the API stand-in (``tests/peers/resource_api.py``) serving the daemon's
own Node, whose annotation the test sets and removes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from test_daemon import root  # noqa: F401  pytest fixture
from test_node_rules import UUIDS, devices_of
from test_one_allocation import R, Node, pod
from test_one_allocation import node as both  # noqa: F401  pytest fixture

from fracplugin.status import render_table
from tests.helpers import wait_until
from tests.peers.dra_kubelet import DraKubelet
from tests.peers.resource_api import ResourceApi, claim_doc

P = "nvidia.com/container.app."
ANN = "fracplugin.io/cordoned-gpus"
SLICE = "gpu-node-1-gpu-memory.fracplugin.io"


def slice_devices(api: ResourceApi) -> list[str]:
    return [x["name"] for x in (api.slices.get(SLICE) or {}).get("spec", {}).get("devices", [])]


def unit_health(n: Node, gpu: int) -> set[str]:
    """The health ListAndWatch gives GPU ``gpu``'s units."""
    return {h for dev, h in n.kubelet.devices(R).items() if dev.startswith(UUIDS[gpu] + "::")}


def test_a_cordoned_gpu_takes_no_new_fraction_at_any_door_and_is_undone_by_removing_it(  # noqa: F811
        both: Callable[..., Node], root: Path) -> None:  # noqa: F811
    """Input 7: GPU 0 holds a running tenant; ``cordoned-gpus: "0"`` -> a container naming GPU 0 is refused
    naming the cordon (FAILED_PRECONDITION), the tenant keeps its hold, node-placed containers go to GPUs
    1-3, the device plugin lists GPU 0's units Unhealthy, the slice leaves gpu-0 out and a claim on it is
    refused; a malformed entry is a warning naming it; removing the annotation undoes all of it."""
    api = ResourceApi()
    api.annotate_node("gpu-node-1", {})
    kubeconfig = api.serve(root)
    dra = DraKubelet(str(root / "registry"))
    try:
        n = both("--kubeconfig", str(kubeconfig), "--node-poll-interval", "0.1", "--node-condition-types", "",
                 "--dra", "--dra-plugins-dir", str(root / "plugins"), "--dra-registry-dir", str(root / "registry"),
                 "--dra-cdi-dir", str(root / "cdi"), ready=("nri", "device_plugin"))
        dra.register()
        assert api.wait_for(lambda a: slice_devices(a) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]), api.slices
        tenant = pod("tenant", None, {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"})
        assert devices_of(n.create(tenant, "app")[0]) == [UUIDS[0]]

        api.annotate_node("gpu-node-1", {ANN: "0"})
        assert wait_until(lambda: n.status()["gpus"][0]["unhealthy_reasons"] == ["cordoned"],
                          what=lambda: n.status()["gpus"][0])
        assert n.status()["cordon"]["gpus"] == [0] and n.status()["cordon"]["value"] == "0"
        table = render_table(n.status())  # fracplugin status
        assert f"cordon {ANN}='0': GPU(s) 0 take no new fraction" in table and " CORDONED" in table, table
        err = n.create(pod("named", None, {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"}), "app")[0]
        assert getattr(err, "code", None) == 9, err  # FAILED_PRECONDITION: an operator's choice, not a fault
        assert f"GPU 0 ({UUIDS[0]}), which is cordoned (node annotation {ANN})" in err.message, err.message
        for name in ("placed-1", "placed-2", "placed-3"):
            adj = n.create(pod(name, None, {P + "gpu-memory.request": "70Gi"}), "app")[0]
            assert devices_of(adj) != [UUIDS[0]], adj
        held = {(t["pod_name"], t["gpu_uuid"]) for t in n.tenants()}
        assert ("tenant", UUIDS[0]) in held, held  # the running tenant keeps its hold
        assert {g for _p, g in held if _p.startswith("placed")} == set(UUIDS[1:]), held
        # the device plugin: GPU 0's units Unhealthy, the others Healthy; the DRA slice leaves gpu-0 out
        assert wait_until(lambda: unit_health(n, 0) == {"Unhealthy"}, what=lambda: n.kubelet.devices(R))
        assert unit_health(n, 1) == {"Healthy"}
        assert api.wait_for(lambda a: slice_devices(a) == ["gpu-1", "gpu-2", "gpu-3"]), api.slices
        uid = "0b7c1e9a-3636-4a55-9d0e-000000000036"
        api.claims[("team", "cordoned")] = claim_doc("team", "cordoned", uid, memory="1Gi")
        claim_err = dra.prepare(("team", uid, "cordoned")).claims[uid].error
        assert f"GPU 0 ({UUIDS[0]}), which is cordoned (node annotation {ANN})" in claim_err, claim_err

        # a malformed entry: a warning naming it, never a crash; GPU 0 stays cordoned
        api.annotate_node("gpu-node-1", {ANN: "0, 7,GPU-nope"})
        assert wait_until(lambda: len(n.status()["cordon"]["warnings"]) == 2, what=lambda: n.status()["cordon"])
        warnings = n.status()["cordon"]["warnings"]
        assert "'7' names no GPU of node gpu-node-1" in warnings[0] and "'GPU-nope'" in warnings[1], warnings
        assert n.status()["cordon"]["gpus"] == [0] and n.d.proc is not None and n.d.proc.poll() is None

        # removing the annotation: GPU 0 takes fractions again at every door
        api.annotate_node("gpu-node-1", {ANN: None})
        assert wait_until(lambda: n.status()["gpus"][0]["healthy"], what=lambda: n.status()["gpus"][0])
        again = n.create(pod("again", None, {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"}), "app")[0]
        assert devices_of(again) == [UUIDS[0]], again
        assert wait_until(lambda: unit_health(n, 0) == {"Healthy"}, what=lambda: n.kubelet.devices(R))
        assert api.wait_for(lambda a: slice_devices(a) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]), api.slices
        assert n.status()["cordon"]["gpus"] == [] and n.status()["cordon"]["value"] is None
    finally:
        dra.close()
        api.close()


def test_explain_refuses_a_gpu_the_node_files_annotation_cordons(root: Path) -> None:  # noqa: F811
    """``explain --node FILE``: the file's ``annotations`` cordon as the Node's do, and an entry that
    names no GPU is one warning naming it."""
    import yaml
    from test_daemon import NODE

    from fracplugin.explain import explain

    doc: dict[str, Any] = yaml.safe_load(NODE.read_text())
    doc["annotations"] = {ANN: f"{UUIDS[0]},9"}
    node_file = root / "cordoned-node.yaml"
    node_file.write_text(yaml.safe_dump(doc))
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "team", "uid": "u",
                             "annotations": {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"}},
                "spec": {"containers": [{"name": "app"}]}}
    report = explain(manifest, str(node_file))
    err = report["containers"][0]["error"]
    assert err["key"] == P + "gpus.devices" and f"which is cordoned (node annotation {ANN})" in err["reason"], err
    assert [w for w in report["warnings"] if ANN in w and "'9'" in w], report["warnings"]
    manifest["metadata"]["annotations"] = {P + "gpu-memory.request": "8Gi"}
    assert explain(manifest, str(node_file))["containers"][0]["devices"] == [UUIDS[1]]
