"""End to end: a fractional container that started while fracplugin was away is found at Synchronize
and restarted, and comes back fenced (issue 35 item 1 "Done when": the real-containerd e2e shows it on both
containerd lines; ADR 0035 decisions 5-9).

What is real: containerd (each line of ``make e2e``: 2.3.7 and 2.1.9), runc and crictl; the container
created and started by containerd while no NRI plugin is attached (it runs with no fracplugin env, no
mount, no limit); containerd's Synchronize of the plugin when it connects, listing that container; the
daemon's decision and its POSTs (a pod eviction, a Warning Event) over HTTP through the kubernetes client;
the CreateContainer adjustment of the container created again, and its CUDA memory limits set on its own
leaf cgroup at StartContainer (through the fake NVML library, as test_containerd_memory_limits.py does).

What stands in: the API server (``tests/peers/posts_api.py`` records what is POSTed and answers 201; no
pod is deleted by it), and kubelet with the pod's controller, which ``make e2e`` does not run: once the
eviction request has reached the API, the test does what they would do, stopping and removing the evicted
pod's sandbox and running the pod again (same name, a new UID) with its container. A real kubelet's part
(deleting the pod, the controller creating the next) is covered by nothing here; the fence of the new
container is containerd's real CreateContainer and StartContainer.

Requirements and fixtures as test_containerd_memory_limits.py (root, cgroup v1 host, gcc for the fake NVML).
"""

from __future__ import annotations

import json

import pytest

import harness as h
from test_containerd import (  # noqa: F401 - fixtures are used by name
    EXPECTED_UUIDS, PIPE_DIR, Pods, _wait_ledger_empty, bins, ctrd, pods, start_daemon)
from test_containerd_memory_limits import MIB, _assert_own_leaf, _limits_daemon, _limits_row
from tests.peers.posts_api import Api

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ANN = "nvidia.com/container.app."
KAI = {ANN + "gpu-memory.request": "40Gi", ANN + "gpu-memory.limit": "60Gi", ANN + "gpus.devices": "0"}
GPU0 = EXPECTED_UUIDS[0]


def _state(ctrd: h.Containerd, cid: str) -> str:
    return json.loads(ctrd.crictl("inspect", cid).stdout)["status"]["state"]


def test_a_container_started_while_the_plugin_was_away_is_evicted_and_comes_back_fenced(ctrd, pods, request):
    """The KAI shape (40Gi request, 60Gi limit, GPU 0) created and started with no plugin attached; the
    daemon starts (``--unfenced-containers`` default ``restart``, ``--memory-limits apply``) and
    containerd's Synchronize lists the container: an eviction of exactly that pod reaches the API with
    its UID as precondition, and a Warning Event ``ContainerRestartedUnfenced`` naming the container.
    Standing in for kubelet, the test removes the pod and runs it again: the new container carries the
    env, the MPS pipe-directory mount and its limits on its own leaf cgroup."""
    parent = h.cgroup_parent_of(ctrd.base)
    pid, cfg = pods.run("unfenced", KAI, cgroup_parent=parent)
    old = pods.create_and_start(pid, cfg)
    env = h.container_env(ctrd, old)
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in env and PIPE_DIR not in h.container_mountpoints(ctrd, old), env
    uid = json.loads(cfg.read_text())["metadata"]["uid"]

    root = ctrd.base / f"api-{ctrd.version}"
    root.mkdir(exist_ok=True)
    api = Api(root)
    request.addfinalizer(api.close)
    (root / "pods.yaml").write_text("")  # the pod source: a pods file, so the daemon needs no watch from the API
    d, fake, limits = _limits_daemon(
        ctrd, request, ["--memory-limits", "apply", "--kubeconfig", str(api.kubeconfig), "--pods-file",
                        str(root / "pods.yaml"), "--node-condition-types", ""], ctrd.base / "cdi")
    try:
        h.wait_for(api.evictions, 30, "the pod's eviction to reach the API server")
        h.wait_for(lambda: api.events("ContainerRestartedUnfenced"), 30, "the Event")
    except h.HarnessError as e:
        pytest.fail(f"{e}\nposted: {api.posted}\n--- fracplugin log:\n{d.tail(80)}", pytrace=False)
    [(path, body)] = api.evictions()
    assert path == "/api/v1/namespaces/default/pods/unfenced/eviction", path
    assert body["deleteOptions"]["preconditions"] == {"uid": uid}, body
    [ev] = api.events("ContainerRestartedUnfenced")
    assert ev["type"] == "Warning" and ev["action"] == "Restart", ev
    assert ev["involvedObject"]["uid"] == uid and ev["involvedObject"]["fieldPath"] == "spec.containers{app}", ev
    assert "found at Synchronize running without fracplugin's adjustment" in ev["message"], ev["message"]
    nri = d.status()["nri"]
    assert nri["unfenced"]["restarted"] == 1 and [u["container_id"] for u in nri["unadjusted"]] == [old], nri
    print(f"containerd {ctrd.version}: eviction {path}; Event: {ev['message']}")
    assert _state(ctrd, old) == "CONTAINER_RUNNING"  # an API eviction: containerd is not asked to stop anything

    # kubelet and the pod's controller, stood in for: the evicted pod goes, the pod is created again
    pods.remove_all()
    _wait_ledger_empty(d)
    pid2, cfg2 = pods.run("unfenced", KAI, cgroup_parent=parent)
    new = pods.create_and_start(pid2, cfg2)
    env = h.container_env(ctrd, new)
    assert (env.get("NVIDIA_VISIBLE_DEVICES"), env.get("NVIDIA_GPU_MEMORY_REQUEST"),
            env.get("NVIDIA_GPU_MEMORY_LIMIT"), env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")) == (
        GPU0, "40960", "61440", f"{GPU0}=61440M"), env
    assert PIPE_DIR in h.container_mountpoints(ctrd, new)
    cl = _limits_row(d)
    assert cl["container_id"] == new and cl["enforced"] == "yes", cl
    _assert_own_leaf(ctrd, new, cl["cgroup"])
    # the new container's own leaf carries its limits; the old one's (set when Synchronize adopted it
    # under apply, ADR 0036) is what the soft-limit bookkeeping watches: test_containerd_memory_limits
    got = fake.read_limits(limits)
    assert got[(GPU0, cl["cgroup"])] == (40960 * MIB, 61440 * MIB), got
    assert len(api.evictions()) == 1 and d.alive(), d.tail()
    pods.remove_all()
    _wait_ledger_empty(d)
