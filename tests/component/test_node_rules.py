"""Issue 33: one admission for the whole node, every rule at every door.

Each small failing input of the issue through the real daemon (``fracplugin
run`` subprocess on a simulated node) and its real sockets: the NRI runtime
peer (``tests/peers/nri_runtime.py``), the device plugin kubelet
(``fake_kubelet``), the DRA kubelet and API stand-in (``tests/peers``).
The node's health monitor, the MIG rule and the memory-limit gate are the
node's (``noderules.NodeRules``), not a door's: they hold whichever doors run.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml
from test_daemon import NODE, DaemonProc
from test_daemon import daemon, root  # noqa: F401  pytest fixtures
from test_one_allocation import Node, ctr, ids, pod
from test_one_allocation import node as both  # noqa: F401  pytest fixture

from tests.helpers import wait_until

P = "nvidia.com/container.app."
UUIDS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]


def post_xid(d: DaemonProc, uuid: str, xid: int) -> None:
    req = urllib.request.Request(f"http://{d.endpoints['health']}/simulate/xid", method="POST",
                                 data=json.dumps({"gpu_uuid": uuid, "xid": xid}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 202


def gpu_status(d: DaemonProc, index: int) -> dict[str, Any]:
    return d.get("/status")[1]["gpus"][index]


def nri_only(daemon: Callable[..., DaemonProc], root: Path, *extra: str) -> tuple[DaemonProc, Any]:  # noqa: F811
    """KAI's shape: the NRI door only (``--no-device-plugin``), no MPS."""
    from nri_runtime import FakeNriRuntime

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"), *extra)
    rt.wait_registered(15)
    return d, rt


def create(rt: Any, name: str, annotations: dict[str, str]) -> Any:
    from nri_runtime import make_container, make_pod

    sandbox = make_pod(name, "team", f"uid-{name}", annotations)
    return rt.create_container(sandbox, make_container(sandbox, "app"))


def devices_of(adj: Any) -> list[str]:
    env = {e.key: e.value for e in adj.env if not e.key.startswith("-")}
    return env["NVIDIA_VISIBLE_DEVICES"].split(",")


def test_an_xid_on_a_kai_shaped_node_keeps_new_fractions_off_that_gpu(daemon: Callable[..., DaemonProc],  # noqa: F811
                                                                     root: Path) -> None:  # noqa: F811
    """Input 1: NRI only; XID 79 on GPU 0 -> a container naming GPU 0 is refused naming it, a node-placed
    one lands on GPUs 1-3, /status shows GPU 0 Unhealthy."""
    d, rt = nri_only(daemon, root)
    try:
        post_xid(d, UUIDS[0], 79)
        assert wait_until(lambda: gpu_status(d, 0)["healthy"] is False, what=lambda: gpu_status(d, 0))
        assert gpu_status(d, 0)["unhealthy_reasons"] == ["xid 79"]
        err = create(rt, "named", {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"})
        assert getattr(err, "code", None) == 14, err  # UNAVAILABLE: the GPU may recover, the runtime retries
        assert f"GPU 0 ({UUIDS[0]}), which is Unhealthy (xid 79)" in err.message
        adj = create(rt, "placed", {P + "gpu-memory.request": "8Gi"})
        assert devices_of(adj) == [UUIDS[1]], adj
        assert [t["gpu_uuid"] for g in d.get("/status")[1]["gpus"] for t in g["tenants"]] == [UUIDS[1]]
    finally:
        rt.close()


def test_an_xid_on_a_dra_only_node_refuses_the_claim_and_leaves_the_gpu_out_of_the_slice(  # noqa: F811
        daemon: Callable[..., DaemonProc], root: Path) -> None:  # noqa: F811
    """Input 2: DRA only; XID 79 on GPU 0 -> a 10Gi claim allocated on gpu-0 is refused naming it,
    nothing is held, and the next ResourceSlice leaves gpu-0 out."""
    from test_dra_door import SLICE, start

    from tests.peers.dra_kubelet import DraKubelet
    from tests.peers.resource_api import ResourceApi, claim_doc

    api = ResourceApi()
    kubelet = DraKubelet(str(root / "registry"))
    try:
        d = start(daemon, root, api, "--no-device-plugin")
        kubelet.register()
        assert api.wait_for(lambda a: SLICE in a.slices and len(a.slices[SLICE]["spec"]["devices"]) == 4)
        post_xid(d, UUIDS[0], 79)
        assert api.wait_for(lambda a: [x["name"] for x in a.slices[SLICE]["spec"]["devices"]] ==
                            ["gpu-1", "gpu-2", "gpu-3"]), api.slices
        uid = "0b7c1e9a-7979-4a55-9d0e-000000000079"
        api.claims[("team", "sick")] = claim_doc("team", "sick", uid, memory="10Gi")
        err = kubelet.prepare(("team", uid, "sick")).claims[uid].error
        assert f"GPU 0 ({UUIDS[0]}), which is Unhealthy (xid 79)" in err, err
        assert gpu_status(d, 0)["tenants"] == [] and gpu_status(d, 0)["unhealthy_reasons"] == ["xid 79"]
    finally:
        kubelet.close()
        api.close()


def mig_node(root: Path) -> Path:
    doc = yaml.safe_load(NODE.read_text())
    doc["gpus"][0]["mig_enabled"] = True
    path = root / "mig-node.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_mig_gpu_takes_no_fraction_at_the_nri_door_or_in_explain(daemon: Callable[..., DaemonProc],  # noqa: F811
                                                                   root: Path) -> None:  # noqa: F811
    """Input 3: GPU 0 in MIG mode, --memory-limits off: never placed there (request, gpu-fraction),
    naming it refused naming MIG; ``explain`` says the same."""
    from fracplugin.explain import explain

    node_file = mig_node(root)
    d, rt = nri_only(daemon, root, "--simulate-node", str(node_file), "--memory-limits", "off")
    try:
        assert devices_of(create(rt, "req", {P + "gpu-memory.request": "8Gi"})) == [UUIDS[1]]
        assert devices_of(create(rt, "frac", {"gpu-fraction": "0.5"})) != [UUIDS[0]]
        err = create(rt, "named", {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"})
        assert getattr(err, "code", None) == 9, err  # FAILED_PRECONDITION
        assert f"GPU 0 ({UUIDS[0]}), which is in MIG mode" in err.message
        assert all(t["gpu_uuid"] != UUIDS[0] for g in d.get("/status")[1]["gpus"] for t in g["tenants"])
        readyz = d.get("/readyz")[1]["checks"]
        assert readyz["gpus"] == {"ready": True,
                                  "detail": f"GPU 0 ({UUIDS[0]}) in MIG mode: no fraction placed on it"}
    finally:
        rt.close()
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "team", "uid": "u",
                             "annotations": {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"}},
                "spec": {"containers": [{"name": "app"}]}}
    named = explain(manifest, str(node_file))["containers"][0]
    assert named["error"]["key"] == P + "gpus.devices" and "which is in MIG mode" in named["error"]["reason"]
    manifest["metadata"]["annotations"] = {"gpu-fraction": "0.5"}
    assert explain(manifest, str(node_file))["containers"][0]["devices"] == [UUIDS[1]]


def test_allocate_withholds_the_hooks_env_where_the_hook_would_fail(both: Callable[..., Node],  # noqa: F811
                                                                    root: Path) -> None:  # noqa: F811
    """Input 4 (policy warn): a node that cannot enforce (a cgroup v1 tree): Allocate's answer and the
    container's merged env carry neither NVIDIA_GPU_MEMORY_REQUEST nor _LIMIT (containerd cannot take
    Allocate's env back); the hold keeps the limit. (``apply``, not ``auto``: a simulated node has no
    NVML, where ``auto`` means off; the gate is the same.)"""
    (root / "cg" / "memory").mkdir(parents=True)  # v1: a directory per controller, no cgroup.controllers
    n = both("--memory-limits", "apply", "--memory-limits-policy", "warn", "--cgroup-root", str(root / "cg"),
             ready=("nri", "device_plugin"))
    try:
        p = pod("warned", 8, {P + "gpu-memory.limit": "12Gi"})
        n.put(p)
        env, _ = n.allocate(ids(0, 8))
        assert "NVIDIA_GPU_MEMORY_REQUEST" not in env and "NVIDIA_GPU_MEMORY_LIMIT" not in env, env
        adj, merged = n.create(p, "app", env)
        assert "NVIDIA_GPU_MEMORY_REQUEST" not in merged and "NVIDIA_GPU_MEMORY_LIMIT" not in merged, merged
        assert merged["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{merged['NVIDIA_VISIBLE_DEVICES']}=12288M"
        assert [(t["request_mib"], t["limit_mib"]) for t in n.tenants()] == [(8192, 12288)]
    finally:
        n.close()


def test_allocate_refuses_where_the_node_cannot_enforce_under_policy_refuse(both: Callable[..., Node],  # noqa: F811
                                                                            root: Path) -> None:  # noqa: F811
    """Input 4 (policy refuse): the first door that sees the container refuses it, naming the
    capability in the NRI door's words."""
    (root / "cg" / "memory").mkdir(parents=True)
    n = both("--memory-limits", "apply", "--memory-limits-policy", "refuse", "--cgroup-root", str(root / "cg"),
             ready=("nri", "device_plugin"))
    try:
        p = pod("refused", 8)
        n.put(p)
        import grpc

        try:
            n.allocate(ids(0, 8))
            raise AssertionError("Allocate answered")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "memory limits cannot be enforced on this node: cgroup_v2" in err.details(), err.details()
        assert n.tenants() == []
        nri = n.create(pod("other", None, {P + "gpu-memory.request": "8Gi"}), "app")[0]
        assert getattr(nri, "code", None) == 9 and "memory limits cannot be enforced on this node: cgroup_v2" in nri.message
    finally:
        n.close()


def test_two_compute_modes_on_one_gpu_read_the_same_at_the_nri_and_kubelet_doors(  # noqa: F811
        both: Callable[..., Node], root: Path) -> None:  # noqa: F811
    """Input 5: the same refusal through each door: the same words and the same kind of status."""
    import grpc

    n = both()
    try:
        sm = pod("sm", None, {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0",
                              P + "gpu-compute.mode": "sm-sharing"})
        assert n.create(sm, "app")[0].env  # admitted through the NRI door
        nri = n.create(pod("ts-nri", None, {P + "gpu-memory.request": "8Gi", P + "gpus.devices": "0"}), "app")[0]
        n.put(pod("ts-dp", 8))
        try:
            n.allocate(ids(0, 8))
            raise AssertionError("Allocate answered")
        except grpc.RpcError as err:
            dp = err
        assert getattr(nri, "code", None) == 9 and dp.code() == grpc.StatusCode.FAILED_PRECONDITION
        words = f"GPU 0 ({UUIDS[0]}) is in sm-sharing mode for default/sm/app; one compute mode per GPU"
        assert words in nri.message and words in dp.details(), (nri.message, dp.details())
    finally:
        n.close()
