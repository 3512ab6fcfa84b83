"""The DRA door (issue 29, ADR 0031) of the real daemon (``fracplugin run
--dra`` subprocess on the simulated four-GPU node), driven through its real
sockets by a test kubelet (``tests/peers/dra_kubelet.py``: the registration
handshake, NodePrepareResources / NodeUnprepareResources), with claims and
slices served by an HTTP stand-in for the API server
(``tests/peers/resource_api.py``), the fake MPS control daemon, and the
kubelet device plugin peer for the other door's holds.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from test_daemon import FAKE_MPS, GPU0, NODE, DaemonProc
from test_daemon import daemon, root  # noqa: F401  pytest fixtures

from tests.helpers import wait_until
from tests.peers.dra_kubelet import DraKubelet
from tests.peers.resource_api import ResourceApi, claim_doc

REPO = Path(__file__).resolve().parents[2]
CDI_WITH_HOOK = REPO / "tests" / "fixtures" / "cdi" / "with-hook"
DRIVER = "gpu-memory.fracplugin.io"
SLICE = f"gpu-node-1-{DRIVER}"
PARAMS = "gpu-memory.fracplugin.io/v1alpha1"
RN = "fracplugin.io/gpu-memory"  # the device plugin door's resource


@pytest.fixture
def api(root: Path):  # noqa: F811
    a = ResourceApi()
    yield a
    a.close()


def start(daemon: Callable[..., DaemonProc], root: Path, api: ResourceApi, *extra: str) -> DaemonProc:  # noqa: F811
    kubeconfig = api.serve(root)
    d = daemon("--no-nri", "--mps-control-binary", str(FAKE_MPS), "--dra", "--kubeconfig", str(kubeconfig),
               "--dra-plugins-dir", str(root / "plugins"), "--dra-registry-dir", str(root / "registry"),
               "--dra-cdi-dir", str(root / "cdi"), "--cdi-spec-dirs", str(CDI_WITH_HOOK),
               "--node-condition-types", "", *extra)
    # Prepare makes the claim's MPS namespace: until the (fake) MPS daemons answer it is refused, and the slice
    # lists no GPU (kubelet retries; a test waits instead of racing the daemons' start)
    wait_until(lambda: d.get("/readyz")[1]["checks"].get("mps", {}).get("ready"),
               what=lambda: f"the MPS daemons: {d.get('/readyz')}")
    return d


@contextlib.contextmanager
def both_doors(daemon: Callable[..., DaemonProc], root: Path,  # noqa: F811
               api: ResourceApi) -> Iterator[tuple[DaemonProc, DraKubelet, Any]]:
    """The daemon with the DRA door and the device plugin door, registered with
    a test DRA kubelet and a fake device plugin kubelet (whose devices are
    listed): yields (daemon, DRA kubelet, device plugin kubelet)."""
    from fake_kubelet import FakeKubelet

    (root / "dp").mkdir()
    dp_kubelet = FakeKubelet(str(root / "dp")).start()
    kubelet = DraKubelet(str(root / "registry"))
    try:
        d = start(daemon, root, api, "--no-dra-slices", "--device-plugin-dir", str(root / "dp"),
                  "--pod-resources-socket", str(root / "pr.sock"), "--allocate-deadline", "0.5")
        kubelet.register()
        assert wait_until(lambda: len(dp_kubelet.devices(RN)) > 0)
        yield d, kubelet, dp_kubelet
    finally:
        kubelet.close()
        dp_kubelet.stop()


def tenants(d: DaemonProc, gpu: int = 0) -> list[dict]:
    return d.get("/status")[1]["gpus"][gpu]["tenants"]


def compute_modes(api: ResourceApi) -> list[str]:
    """The published ``computeMode`` of each device of the slice, in device order."""
    return [dev["attributes"]["computeMode"]["string"] for dev in api.slices[SLICE]["spec"]["devices"]]


def test_registration_prepare_unprepare_and_the_slice(daemon: Callable[..., DaemonProc], root: Path,  # noqa: F811
                                                      api: ResourceApi) -> None:
    d = start(daemon, root, api, "--no-device-plugin")
    kubelet = DraKubelet(str(root / "registry"))
    try:
        info = kubelet.register()
        assert (info.type, info.name, info.version) == ("DRAPlugin", DRIVER, "v1.DRAPlugin")
        assert info.endpoint == str(root / "plugins" / DRIVER / "dra.sock")
        assert set(info.versions) == {"v1.DRAPlugin", "v1beta1.DRAPlugin"}
        wait_until(lambda: d.get("/readyz")[1]["checks"].get("dra", {}).get("ready"),
                   what=lambda: f"dra readiness: {d.get('/readyz')}")

        # the slice: one device per GPU, memory = (81559 - 1024) MiB in bytes, 1 MiB step
        # the first slice may list no GPU: until an MPS daemon is up no GPU can take a fraction (the node's health)
        assert api.wait_for(lambda a: SLICE in a.slices and len(a.slices[SLICE]["spec"]["devices"]) == 4), api.requests
        spec = api.slices[SLICE]["spec"]
        assert spec["driver"] == DRIVER and spec["nodeName"] == "gpu-node-1" and spec["pool"]["name"] == "gpu-node-1"
        dev0 = spec["devices"][0]
        assert [x["name"] for x in spec["devices"]] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        assert dev0["allowMultipleAllocations"] is True and dev0["attributes"]["uuid"] == {"string": GPU0}
        assert dev0["capacity"]["memory"]["value"] == str((81559 - 1024) << 20)
        assert dev0["capacity"]["memory"]["requestPolicy"]["validRange"] == {"min": "1048576", "step": "1048576"}
        assert compute_modes(api) == ["none"] * 4  # nothing held yet

        # a 20Gi sm-sharing claim on GPU 0
        uid = "0b7c1e9a-1111-4a55-9d0e-000000000001"
        api.claims[("team-a", "infer-gpu")] = claim_doc(
            "team-a", "infer-gpu", uid, memory="20Gi",
            parameters={"apiVersion": PARAMS, "kind": "GpuMemoryParameters", "gpu-compute.mode": "sm-sharing",
                        "gpu-memory.limit": "24Gi", "gpu-compute.portion": 0.5})
        ref = ("team-a", uid, "infer-gpu")
        r = kubelet.prepare(ref).claims[uid]
        assert r.error == ""
        assert len(r.devices) == 1
        dev = r.devices[0]
        assert (dev.pool_name, dev.device_name, list(dev.request_names)) == ("gpu-node-1", "gpu-0", ["gpu"])
        assert list(dev.cdi_device_ids) == [f"{DRIVER}/claim={uid}", f"k8s.device-plugin.nvidia.com/gpu={GPU0}"]
        assert dev.share_id == f"share-{uid[:8]}"
        spec_file = root / "cdi" / f"{DRIVER}-claim_{uid}.json"
        cdi = json.loads(spec_file.read_text())
        assert cdi["kind"] == f"{DRIVER}/claim" and cdi["devices"][0]["name"] == uid
        edits = cdi["devices"][0]["containerEdits"]
        env = dict(e.split("=", 1) for e in edits["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == GPU0 and env["NVIDIA_GPU_MEMORY_REQUEST"] == "20480"
        assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "24576" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{GPU0}=24576M" and env["FRACPLUGIN_DRA_CLAIM"] == uid
        (mount,) = edits["mounts"]
        assert mount["containerPath"] == "/tmp/nvidia-mps" and "ro" in mount["options"]
        assert mount["hostPath"].startswith(str(root / "mps" / "sm" / "shared"))
        # the ledger holds it, keyed by the claim's UID; the MPS namespace was made before the answer
        (t,) = tenants(d)
        assert (t["door"], t["reservation"], t["request_mib"], t["mode"]) == ("dra", f"dra:{uid}", 20480, "sm-sharing")
        ns = [n for dm in d.get("/status")[1]["mps"]["daemons"] if dm["mode"] == "sm-sharing"
              for n in dm["namespaces"] if n["pod_uid"] == uid]
        assert [(n["container"], n["active_thread_percentage"], n["pinned_limit_mib"]) for n in ns] == [
            ("dra", 50, 24576)], d.get("/status")[1]["mps"]
        assert mount["hostPath"].endswith(ns[0]["name"])

        # the slice tells the scheduler GPU 0 is in sm-sharing now (per-mode DeviceClasses select on it)
        assert api.wait_for(lambda a: compute_modes(a) == ["sm-sharing", "none", "none", "none"]), api.slices

        # kubelet retries: same answer, one hold
        again = kubelet.prepare(ref).claims[uid]
        assert again == r
        assert len(tenants(d)) == 1

        # unprepare frees it (twice: idempotent)
        assert kubelet.unprepare(ref).claims[uid].error == ""
        assert tenants(d) == [] and not spec_file.exists()
        assert api.wait_for(lambda a: compute_modes(a) == ["none"] * 4), api.slices  # GPU 0 takes any mode again
        assert wait_until(lambda: not any(n["pod_uid"] == uid for dm in d.get("/status")[1]["mps"]["daemons"]
                                          for n in dm["namespaces"]))
        assert kubelet.unprepare(ref).claims[uid].error == ""

        # an XID-free stop deletes the slice only when asked (not here)
        assert d.terminate() == 0
        assert SLICE in api.slices
        assert not (root / "registry" / f"{DRIVER}-reg.sock").exists()
    finally:
        kubelet.close()


def test_bad_parameters_are_refused_naming_key_value_and_rule(daemon: Callable[..., DaemonProc],  # noqa: F811
                                                               root: Path, api: ResourceApi) -> None:
    d = start(daemon, root, api, "--no-device-plugin", "--no-dra-slices", "--dra-delete-slices-on-stop")
    kubelet = DraKubelet(str(root / "registry"))
    try:
        kubelet.register()
        cases = {
            "mode": ({"gpu-compute.mode": "fast"},
                     'GpuMemoryParameters.gpu-compute.mode="fast" must be exactly "time-slicing" or "sm-sharing"'),
            "portion": ({"gpu-compute.portion": "1.5"}, 'GpuMemoryParameters.gpu-compute.portion="1.5" is outside (0, 1]'),
            "limit": ({"gpu-memory.limit": "10Gi"},
                      'GpuMemoryParameters.gpu-memory.limit="10Gi" is below the request 20Gi (20480 MiB): '
                      "the limit must be >= the request"),
            "unknown": ({"gpu-memory.request": "1Gi"},
                        'GpuMemoryParameters.gpu-memory.request="1Gi" is not a field of GpuMemoryParameters'),
        }
        for i, (name, (fields, said)) in enumerate(cases.items()):
            uid = f"0b7c1e9a-2222-4a55-9d0e-00000000000{i}"
            api.claims[("team-b", name)] = claim_doc(
                "team-b", name, uid, parameters={"apiVersion": PARAMS, "kind": "GpuMemoryParameters", **fields})
            err = kubelet.prepare(("team-b", uid, name)).claims[uid].error
            assert err.startswith(said), (name, err)
        # no consumed capacity: consumable capacity is off on the cluster
        uid = "0b7c1e9a-3333-4a55-9d0e-000000000009"
        api.claims[("team-b", "nocap")] = claim_doc("team-b", "nocap", uid, memory=None)
        err = kubelet.prepare(("team-b", uid, "nocap")).claims[uid].error
        assert "has no consumedCapacity.memory" in err and "DRAConsumableCapacity" in err
        # a claim the API does not have
        err = kubelet.prepare(("team-b", "0b7c1e9a-4444", "gone")).claims["0b7c1e9a-4444"].error
        assert "resourceclaim team-b/gone" in err and "404" in err
        assert tenants(d) == [] and list((root / "cdi").glob("*.json")) == [] if (root / "cdi").exists() else True
        assert d.get("/status")[1]["dra"]["claims"]["refused"] == 5
    finally:
        kubelet.close()


def test_claim_exceeding_what_the_device_plugin_door_holds_is_refused(daemon: Callable[..., DaemonProc],  # noqa: F811
                                                                       root: Path, api: ResourceApi) -> None:
    with both_doors(daemon, root, api) as (d, kubelet, dp_kubelet):
        rn = RN
        # the device plugin door holds 60 GiB of GPU 0 (time-slicing)
        dp_kubelet.allocate(rn, [f"{GPU0}::{n}" for n in range(60)])
        assert sum(t["request_mib"] for t in tenants(d)) == 61440
        # 20 GiB more does not fit GPU 0's 81559 MiB
        uid = "0b7c1e9a-5555-4a55-9d0e-000000000001"
        api.claims[("team-c", "big")] = claim_doc("team-c", "big", uid, memory="20Gi")
        err = kubelet.prepare(("team-c", uid, "big")).claims[uid].error
        assert err.startswith(f'status.allocation.devices.results="{GPU0}" GPU 0 ({GPU0}) has 20119 MiB of '
                              "81559 MiB free; this container requests 20480 MiB"), err
        # sm-sharing on a GPU the other door uses in time-slicing: one compute mode per GPU
        uid2 = "0b7c1e9a-5555-4a55-9d0e-000000000002"
        api.claims[("team-c", "small")] = claim_doc(
            "team-c", "small", uid2, memory="1Gi",
            parameters={"apiVersion": PARAMS, "kind": "GpuMemoryParameters", "gpu-compute.mode": "sm-sharing"})
        err = kubelet.prepare(("team-c", uid2, "small")).claims[uid2].error
        assert "one compute mode per GPU, this container wants sm-sharing" in err, err
        # what fits is taken, and the device plugin door then sees it
        uid3 = "0b7c1e9a-5555-4a55-9d0e-000000000003"
        api.claims[("team-c", "fits")] = claim_doc("team-c", "fits", uid3, memory="19Gi")
        assert kubelet.prepare(("team-c", uid3, "fits")).claims[uid3].error == ""
        assert sum(t["request_mib"] for t in tenants(d)) == 61440 + 19456


def test_without_api_access_dra_does_not_start(root: Path) -> None:  # noqa: F811
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "run", "--simulate-node", str(NODE), "--no-nri",
                          "--no-mps", "--no-device-plugin", "--dra", "--state-dir", str(root / "s"),
                          "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                           "PYTHONPATH": str(REPO / "src")})
    assert out.returncode != 0 and "--dra" in out.stderr and "--kubeconfig" in out.stderr, out.stderr


def test_pool_and_slice_carry_the_kubernetes_node_name(daemon: Callable[..., DaemonProc], root: Path,  # noqa: F811
                                                       api: ResourceApi) -> None:
    """The node file says gpu-node-1; the node is registered as worker-7 (NODE_NAME): the slice and the pool
    Prepare checks are worker-7's, or the scheduler's allocations would never match this node."""
    d = start(daemon, root, api, "--no-device-plugin", "--node-name", "worker-7")
    kubelet = DraKubelet(str(root / "registry"))
    try:
        kubelet.register()
        name = f"worker-7-{DRIVER}"
        assert api.wait_for(lambda a: name in a.slices), api.requests
        spec = api.slices[name]["spec"]
        assert spec["nodeName"] == spec["pool"]["name"] == "worker-7"
        uid = "0b7c1e9a-6666-4a55-9d0e-000000000001"
        api.claims[("team-d", "w7")] = claim_doc("team-d", "w7", uid, node="worker-7", memory="1Gi")
        assert kubelet.prepare(("team-d", uid, "w7")).claims[uid].error == ""
        assert tenants(d)[0]["reservation"] == f"dra:{uid}"
    finally:
        kubelet.close()


def _namespaces(d: DaemonProc) -> dict[str, dict]:
    """The MPS layer's namespaces the daemon reports, by owner pod UID (a claim's: its claim UID)."""
    return {n["pod_uid"]: n for dm in d.get("/status")[1]["mps"]["daemons"] for n in dm["namespaces"]}


def test_nri_synchronize_keeps_a_prepared_claims_namespace(daemon: Callable[..., DaemonProc],  # noqa: F811
                                                             root: Path, api: ResourceApi) -> None:
    """Both doors in one daemon. The NRI door's Synchronize reconciles the MPS layer's namespaces with the
    runtime's pods (nri/orphans.py): a namespace whose owner's pod UID the runtime no longer has is released.
    A claim's namespace is owned by (claim UID, "dra") and a claim UID is never a pod UID: the claim's is kept
    (the ledger holds its owner), while an NRI pod's namespace whose pod went is released in the same
    Synchronize (so the reconciliation did run)."""
    from nri_runtime import FakeNriRuntime, make_container, make_pod

    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    kubelet = DraKubelet(str(root / "registry"))
    try:
        kubeconfig = api.serve(root)
        d = daemon("--mps-control-binary", str(FAKE_MPS), "--no-device-plugin", "--nri-socket", str(root / "nri.sock"),
                   "--dra", "--kubeconfig", str(kubeconfig), "--no-dra-slices",
                   "--dra-plugins-dir", str(root / "plugins"), "--dra-registry-dir", str(root / "registry"),
                   "--dra-cdi-dir", str(root / "cdi"), "--cdi-spec-dirs", str(CDI_WITH_HOOK),
                   "--node-condition-types", "")
        rt.wait_registered(15)
        kubelet.register()
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")

        # an NRI pod with an sm-sharing container on GPU 1: its namespace is made (in the background)
        p = "nvidia.com/container.app."
        pod = make_pod("nri-app", uid="7a1d0c3e-0000-4c1e-9d7a-00000000aaaa", annotations={
            p + "gpu-memory.request": "1Gi", p + "gpu-memory.limit": "2Gi", p + "gpu-compute.mode": "sm-sharing",
            p + "gpu-compute.portion": "0.25", p + "gpus.devices": GPU0.replace("a01", "a02")})
        ctr = make_container(pod, "app")
        assert not hasattr(rt.create_container(pod, ctr), "code")
        assert rt.start_container(pod, ctr) is None  # StartContainer awaits the namespace
        wait_until(lambda: pod.uid in _namespaces(d), what=lambda: f"the NRI pod's namespace: {_namespaces(d)}")

        # a prepared sm-sharing claim on GPU 0: its namespace (owner (claim uid, "dra")) is made before the answer
        uid = "0b7c1e9a-7777-4a55-9d0e-000000000001"
        api.claims[("team-e", "kept")] = claim_doc(
            "team-e", "kept", uid, memory="4Gi",
            parameters={"apiVersion": PARAMS, "kind": "GpuMemoryParameters", "gpu-compute.mode": "sm-sharing"})
        assert kubelet.prepare(("team-e", uid, "kept")).claims[uid].error == ""
        ns = _namespaces(d)
        assert ns[uid]["container"] == "dra", ns

        # the runtime's Synchronize has neither pod: the NRI pod's namespace is an orphan, the claim's is not
        rt.synchronize([], [])
        nri_status = lambda: d.get("/status")[1]["nri"]  # noqa: E731
        wait_until(lambda: pod.uid not in _namespaces(d), what=lambda: f"the orphan released: {_namespaces(d)}")
        wait_until(lambda: nri_status()["mps_jobs"]["queued"] == 0 and nri_status()["mps_jobs"]["running"] == 0,
                   what=lambda: f"the MPS queue idle: {nri_status()}")
        early = nri_status()["early_namespaces"]
        assert early["orphaned"] == 1, early
        ns = _namespaces(d)
        assert uid in ns and ns[uid]["container"] == "dra", f"the claim's namespace was released: {ns}"
        (t,) = tenants(d)
        assert t["reservation"] == f"dra:{uid}", tenants(d)
        # and the claim's Unprepare still frees it
        assert kubelet.unprepare(("team-e", uid, "kept")).claims[uid].error == ""
        wait_until(lambda: uid not in _namespaces(d), what=lambda: f"the claim's namespace released: {_namespaces(d)}")
    finally:
        kubelet.close()
        rt.close()


def test_gpu_filled_through_dra_refuses_the_device_plugin_door(daemon: Callable[..., DaemonProc],  # noqa: F811
                                                                root: Path, api: ResourceApi) -> None:
    """The other direction of "the two doors never over-commit a GPU" (issue 29
    item 5; the cluster e2e checks device plugin first, DRA second): memory a
    prepared claim holds on GPU 0 is not given out again by Allocate."""
    import grpc

    with both_doors(daemon, root, api) as (d, kubelet, dp_kubelet):
        rn = RN
        uid = "0b7c1e9a-6666-4a66-9d0e-000000000001"
        api.claims[("team-d", "big")] = claim_doc("team-d", "big", uid, memory="70Gi")
        assert kubelet.prepare(("team-d", uid, "big")).claims[uid].error == ""
        assert sum(t["request_mib"] for t in tenants(d)) == 71680
        # 20 GiB of GPU 0 through the device plugin door: 81559 - 71680 = 9879 MiB are free
        with pytest.raises(grpc.RpcError) as refused:
            dp_kubelet.allocate(rn, [f"{GPU0}::{n}" for n in range(20)])
        assert "9879 MiB of 81559 MiB free" in (refused.value.details() or ""), refused.value.details()
        assert sum(t["request_mib"] for t in tenants(d)) == 71680  # nothing more held on GPU 0
        # once the claim is unprepared the same Allocate fits
        assert kubelet.unprepare(("team-d", uid, "big")).claims[uid].error == ""
        dp_kubelet.allocate(rn, [f"{GPU0}::{n}" for n in range(20)])
        assert sum(t["request_mib"] for t in tenants(d)) == 20480


def test_a_claim_with_an_empty_uid_is_refused_up_front(daemon: Callable[..., DaemonProc], root: Path,  # noqa: F811
                                                       api: ResourceApi) -> None:
    """Issue 34 input 9: NodePrepareResources for an existing claim with ``uid: ""`` is refused naming the
    empty UID (not UNKNOWN with a traceback), and nothing is held; the same claim by its UID prepares."""
    d = start(daemon, root, api, "--no-device-plugin", "--no-dra-slices")
    kubelet = DraKubelet(str(root / "registry"))
    try:
        kubelet.register()
        uid = "0b7c1e9a-9999-4a55-9d0e-000000000009"
        api.claims[("team-e", "c")] = claim_doc("team-e", "c", uid)
        err = kubelet.prepare(("team-e", "", "c")).claims[""].error
        assert "claim uid is empty" in err, err
        assert tenants(d) == [] and d.get("/status")[1]["dra"]["claims"]["refused"] == 1
        assert kubelet.prepare(("team-e", uid, "c")).claims[uid].error == ""
        assert [t["request_mib"] for t in tenants(d)] == [20480]
    finally:
        kubelet.close()
