"""CUDA memory limits for DRA containers (issue 29 item 3; ADR 0025, 0031)
through the daemon's real sockets.

``fracplugin run --dra --memory-limits ...`` with the fake NVML library and a
test cgroup tree (the harness of test_memory_limits.py), claims served by the
resource API stand-in (tests/peers/resource_api.py), Prepare driven by the
test kubelet DRA peer (tests/peers/dra_kubelet.py), and the container
created/started by the fake NRI runtime with the env the claim's CDI spec
gives it (``FRACPLUGIN_DRA_CLAIM=<uid>``: the runtime applies CDI edits
before NRI sees the container).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_memory_limits import MIB
from test_memory_limits import root, started  # noqa: F401  pytest fixtures

from tests.fakes import nvml as fake
from tests.helpers import wait_until
from tests.peers.dra_kubelet import DraKubelet
from tests.peers.resource_api import ResourceApi, claim_doc

DRIVER = "gpu-memory.fracplugin.io"
PARAMS = "gpu-memory.fracplugin.io/v1alpha1"
GPU0 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01"
UID = "0b7c1e9a-2222-4a55-9d0e-000000000001"


def _dra_args(api: ResourceApi, root: Path, *extra: str) -> list[str]:
    kubeconfig = api.serve(root)
    return ["--dra", "--kubeconfig", str(kubeconfig), "--no-dra-slices", "--node-condition-types", "",
            "--dra-plugins-dir", str(root / "plugins"), "--dra-registry-dir", str(root / "registry"),
            "--dra-cdi-dir", str(root / "cdi"), *extra]


def _claim(api: ResourceApi, name: str, uid: str) -> tuple[str, str, str]:
    api.claims[("team-a", name)] = claim_doc(
        "team-a", name, uid, memory="20Gi",
        parameters={"apiVersion": PARAMS, "kind": "GpuMemoryParameters", "gpu-memory.limit": "24Gi"})
    return ("team-a", uid, name)


def _dra_container(cg: Path, name: str, uid: str, pod_uid: str) -> tuple[Any, Any, Path]:
    """A pod without fracplugin annotations whose container carries the
    claim's CDI env, with a systemd-driver cgroups path and its leaf made."""
    from nri_runtime import pod_from_manifest

    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": GPU0}, {"name": "FRACPLUGIN_DRA_CLAIM", "value": uid}]
    pod, [c] = pod_from_manifest({"metadata": {"name": f"infer-{name}", "namespace": "team-a", "uid": pod_uid},
                                  "spec": {"containers": [{"name": name, "env": env}]}})
    uid_ = pod.uid.replace("-", "_")
    c.linux.cgroups_path = f"kubepods-pod{uid_}.slice:cri-containerd:{c.id}"
    leaf = cg / "kubepods.slice" / f"kubepods-pod{uid_}.slice" / f"cri-containerd-{c.id}.scope"
    leaf.mkdir(parents=True)
    return pod, c, leaf


def test_dra_containers_get_the_claims_limits_on_their_leaves(started: Any, root: Path) -> None:  # noqa: F811
    """A prepared 20Gi/24Gi claim on GPU 0: each container using it (a shared
    claim: two) gets soft 20480 MiB / hard 24576 MiB on its own leaf for GPU 0
    only, read back; the ledger still holds the claim once; RemoveContainer
    zeroes the soft limit."""
    api = ResourceApi()
    try:
        d, rt, cg = started(["--memory-limits", "apply", *_dra_args(api, root)])
        kubelet = DraKubelet(str(root / "registry"))
        kubelet.register()
        ref = _claim(api, "infer-gpu", UID)
        r = kubelet.prepare(ref).claims[UID]
        assert r.error == "", (r.error, d.logs()[-3000:])
        cdi = json.loads((root / "cdi" / f"{DRIVER}-claim_{UID}.json").read_text())
        env = dict(e.split("=", 1) for e in cdi["devices"][0]["containerEdits"]["env"])
        assert (env["NVIDIA_GPU_MEMORY_REQUEST"], env["NVIDIA_GPU_MEMORY_LIMIT"]) == ("20480", "24576")

        p1, c1, leaf1 = _dra_container(cg, "app", UID, "5a5a5a5a-0000-4000-8000-000000000001")
        p2, c2, leaf2 = _dra_container(cg, "sidecar", UID, "5a5a5a5a-0000-4000-8000-000000000002")
        for p, c in ((p1, c1), (p2, c2)):
            adj = rt.create_container(p, c)
            assert not hasattr(adj, "code"), adj
            assert rt.start_container(p, c) is None
        held = fake.read_limits(root / "limits")
        assert held == {(GPU0, str(leaf1)): (20480 * MIB, 24576 * MIB),
                        (GPU0, str(leaf2)): (20480 * MIB, 24576 * MIB)}, held
        st = d.get("/status")[1]
        cls = sorted(st["memory_limits"]["containers"], key=lambda x: x["container"])
        assert [(x["container"], x["enforced"], x["cgroup"]) for x in cls] == [
            ("app", "yes", str(leaf1)), ("sidecar", "yes", str(leaf2))], cls
        assert [[(g["gpu"], g["read_soft_bytes"], g["read_hard_bytes"]) for g in x["gpus"]] for x in cls] == \
            [[(GPU0, 20480 * MIB, 24576 * MIB)]] * 2
        # not double-counted: the claim's one hold, nothing by container id
        (t,) = st["gpus"][0]["tenants"]
        assert (t["door"], t["reservation"], t["request_mib"]) == ("dra", f"dra:{UID}", 20480)

        rt.stop_container(p1, c1)
        rt.remove_container(p1, c1)
        wait_until(lambda: fake.read_limits(root / "limits")[(GPU0, str(leaf1))][0] == 0, 10,
                   lambda: f"soft limit zeroed: {fake.read_limits(root / 'limits')}")
        assert fake.read_limits(root / "limits")[(GPU0, str(leaf2))] == (20480 * MIB, 24576 * MIB)
    finally:
        api.close()


def test_dra_container_of_an_unknown_claim_gets_nothing(started: Any, root: Path) -> None:  # noqa: F811
    """A container naming a claim the ledger does not hold: no limit is set
    (the NRI path has nothing for it either) and it starts."""
    api = ResourceApi()
    try:
        _d, rt, cg = started(["--memory-limits", "apply", "--memory-limits-policy", "refuse", *_dra_args(api, root)])
        p, c, _leaf = _dra_container(cg, "app", "no-such-claim", "5a5a5a5a-0000-4000-8000-000000000003")
        rt.create_container(p, c)
        assert rt.start_container(p, c) is None
        assert fake.read_limits(root / "limits") == {}
    finally:
        api.close()


def _prepare_on_cgroup_v1(started: Any, root: Path, api: ResourceApi, policy: str) -> tuple[Any, Any]:
    """A daemon on a cgroup v1 node (``--memory-limits auto``, ``policy``)
    and a test kubelet's Prepare of the claim ``UID``: (daemon, the claim's
    NodePrepareResources result)."""
    d, _rt, _cg = started(["--memory-limits", "auto", "--memory-limits-policy", policy, *_dra_args(api, root)],
                          v2=False)
    kubelet = DraKubelet(str(root / "registry"))
    kubelet.register()
    return d, kubelet.prepare(_claim(api, "infer-gpu", UID)).claims[UID]


def test_dra_prepare_refused_under_policy_refuse_on_a_node_that_cannot_enforce(started: Any,  # noqa: F811
                                                                               root: Path) -> None:
    """cgroup v1 node, --memory-limits-policy refuse: Prepare answers the
    claim's error naming the capability (the NRI door's refusal text); the
    ledger holds nothing and no CDI spec is written."""
    api = ResourceApi()
    try:
        d, r = _prepare_on_cgroup_v1(started, root, api, "refuse")
        assert "cgroup_v2" in r.error and "--memory-limits-policy refuse" in r.error, r.error
        assert r.error.startswith("node: "), r.error
        assert d.get("/status")[1]["gpus"][0]["tenants"] == []
        assert not (root / "cdi" / f"{DRIVER}-claim_{UID}.json").exists()
    finally:
        api.close()


def test_dra_prepare_under_policy_warn_withholds_the_toolkit_hook_env(started: Any, root: Path) -> None:  # noqa: F811
    """cgroup v1 node, policy warn: the claim is prepared but its CDI env
    lacks NVIDIA_GPU_MEMORY_REQUEST/LIMIT (the toolkit hook would fail the
    container's start); the rest of the env is there."""
    api = ResourceApi()
    try:
        _d, r = _prepare_on_cgroup_v1(started, root, api, "warn")
        assert r.error == "", r.error
        cdi = json.loads((root / "cdi" / f"{DRIVER}-claim_{UID}.json").read_text())
        env = dict(e.split("=", 1) for e in cdi["devices"][0]["containerEdits"]["env"])
        assert "NVIDIA_GPU_MEMORY_REQUEST" not in env and "NVIDIA_GPU_MEMORY_LIMIT" not in env, env
        assert env["NVIDIA_VISIBLE_DEVICES"] == GPU0 and env["FRACPLUGIN_DRA_CLAIM"] == UID
    finally:
        api.close()


def test_dra_container_start_refused_when_nvml_refuses_under_policy_refuse(started: Any,  # noqa: F811
                                                                          root: Path) -> None:
    """NVML says NO_PERMISSION and the policy is refuse: the DRA container's
    StartContainer fails (FAILED_PRECONDITION) with the reason, as an NRI
    door container's would; status says ENFORCED no."""
    api = ResourceApi()
    try:
        d, rt, cg = started(["--memory-limits", "apply", "--memory-limits-policy", "refuse", *_dra_args(api, root)],
                            fail=(("SetMemoryLimits", "*", fake.NVML_ERROR_NO_PERMISSION),))
        kubelet = DraKubelet(str(root / "registry"))
        kubelet.register()
        assert kubelet.prepare(_claim(api, "infer-gpu", UID)).claims[UID].error == ""
        p, c, _leaf = _dra_container(cg, "app", UID, "5a5a5a5a-0000-4000-8000-000000000004")
        rt.create_container(p, c)
        err = rt.start_container(p, c)
        assert err is not None and "not enforced" in err.message and "needs root" in err.message, err
        [cl] = d.get("/status")[1]["memory_limits"]["containers"]
        assert cl["enforced"] == "no" and cl["container"] == "app" and "Insufficient Permissions" in cl["reason"]
    finally:
        api.close()
