"""KAI's NvFractions contract through the daemon's real NRI socket
(tests/fixtures/kai/nvfractions-binder.yaml): ``fracplugin run`` with its
default settings, a runtime speaking NRI creates each seed pod as KAI's
binder leaves it; the ContainerAdjustment must carry the fixture's env and,
for CDI names, the CDI devices. Then both seed pods on one node: the second
is refused naming the GPU and the modes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import yaml

from nri_runtime import FakeNriRuntime, RpcError, effective_env, pod_from_manifest
from test_daemon import DaemonProc
from test_daemon import daemon, root  # noqa: F401  pytest fixtures

from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
FIXTURE = yaml.safe_load((REPO / "tests" / "fixtures" / "kai" / "nvfractions-binder.yaml").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}


def bound(case: dict[str, Any]) -> dict[str, Any]:
    pod = copy.deepcopy(yaml.safe_load((REPO / "examples" / "pods" / case["seed"]).read_text()))
    pod["metadata"]["annotations"].update({**case["admission_adds"], **case["binder_writes"]})
    pod["spec"]["nodeName"] = "gpu-node-1"
    return pod


def test_every_binder_case_through_nri(daemon: Callable[..., DaemonProc], root: Path) -> None:
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"))
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        assert d.get("/status")[1]["config"]["reserve_mib"] == 1024
        for name, case in sorted(CASES.items()):
            pod, (ctr,) = pod_from_manifest(bound(case))
            adj = rt.create_container(pod, ctr)
            assert not isinstance(adj, RpcError), (name, adj)
            env = {k: v for k, v in effective_env(ctr, adj).items() if k in case["env"] or k.startswith(("CUDA_", "NVIDIA_"))}
            assert env == case["env"], name
            assert [c.name for c in adj.CDI_devices] == case["cdi_devices"], name
            assert [m.destination for m in adj.mounts] == ["/tmp/nvidia-mps"], name
            assert rt.remove_container(pod, ctr) is None
        assert d.get("/status")[1]["gpus"][0]["tenants"] == []
        assert d.terminate() == 0
    finally:
        rt.close()


def test_both_seed_pods_second_refused_naming_gpu_and_mode(daemon: Callable[..., DaemonProc], root: Path) -> None:
    both = FIXTURE["both_pods"]
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = daemon("--no-device-plugin", "--no-mps", "--nri-socket", str(root / "nri.sock"))
        rt.wait_registered(15)
        wait_until(d.ready, what=lambda: f"readiness: {d.get('/readyz')}")
        pod1, (c1,) = pod_from_manifest(bound(CASES[both["first"]]))
        assert not isinstance(rt.create_container(pod1, c1), RpcError)
        pod2, (c2,) = pod_from_manifest(bound(CASES[both["second"]]))
        err = rt.create_container(pod2, c2)
        assert isinstance(err, RpcError), err
        assert both["refused_key"] in err.message
        for text in both["reason_contains"]:
            assert text in err.message, err.message
        assert d.terminate() == 0
    finally:
        rt.close()
