"""Both doors on one allocation, against a real kubelet (issue 11 scenarios
2, 6 and 7). They depend on issue 10 (one allocation for both doors, branch
i10): written to assert the RIGHT behaviour, kept apart from
``test_kubelet.py`` so they can be merged after i10.

* 2: a pod with devices (units) and ``gpu-memory.limit`` runs on the GPU
  kubelet chose, with request = units x unit and the annotated limit, and the
  ledger holds one reservation for it;
* 6: kubelet's checkpoint removed and kubelet restarted: when the container
  starts again kubelet Allocates again (D8); the answer is the original
  plan, given at once (a planned answer, not the fallback after the deadline);
* 7: an init container and an app container requesting the resource: kubelet
  hands the app the init container's devices (D6); one reservation, and
  kubelet's PodResources List agrees with fracplugin's /status after each step;
* issue 34 input 1: an init container and an app container of different
  sizes (device plugin shape, no annotations; init 2 / app 3 and init 3 /
  app 2): kubelet gives the app the init's devices plus or minus some; the
  pod reaches Running (init completed) and the ledger never holds more than
  the larger for it (ADR 0033 decision 3).
"""

from __future__ import annotations

import signal

import pytest

import cluster as k
from conftest import container_env, expected_devices, kubelet_lines, ledger, podresources

pytestmark = [pytest.mark.kubelet_e2e, pytest.mark.timeout(900)]

ANN = "nvidia.com/container.app."
CHECKPOINT = k.DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint"


def _advertised(c: k.Cluster) -> None:
    n = expected_devices()
    k.wait_for(lambda: c.capacity() == (n, n), 60, "every device advertised", interval=0.3)


def _gpu_of(ids: list[str]) -> str:
    gpus = {i.split("::")[0] for i in ids}
    assert len(gpus) == 1, ids
    return gpus.pop()


def test_units_and_limit_run_on_kubelets_gpu(cluster, daemon, pods):
    """Scenario 2: 4 devices (4 GiB) + limit 6Gi -> request 4096, limit 6144
    on the GPU kubelet chose; one ledger reservation with those figures."""
    c = cluster
    _advertised(c)
    pods.create(k.pod_manifest("b2", gib=4, annotations={ANN + "gpu-memory.limit": "6Gi"}))
    pods.wait_running("b2")
    gpu = _gpu_of(podresources(c)[("b2", "app")])
    env = container_env(c, pods.container_id("b2"))
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "4096"
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "6144"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu}=6144M"
    held = [t for t in ledger(daemon) if t["pod_name"] == "b2"]
    assert len(held) == 1, held
    assert (held[0]["gpu_uuid"], held[0]["request_mib"], held[0]["limit_mib"]) == (gpu, 4096, 6144)


def test_checkpoint_lost_reallocate_gets_the_original_plan_at_once(cluster, daemon, pods):
    """Scenario 6 (D8): kubelet restarted without its checkpoint. Running
    containers are left alone; when one starts again (here: stopped, and
    restarted by kubelet, restartPolicy Always) kubelet finds no cached
    devices for it and calls Allocate again ("Needs to re-allocate device
    plugin resources", GetDeviceRunContainerOptions). fracplugin answers with
    the reservation it already holds ("reserved", no fallback after the
    deadline), the ledger keeps the same figures and the new container has
    the original env."""
    c = cluster
    _advertised(c)
    pods.create(k.pod_manifest("b6", gib=2, annotations={ANN + "gpu-memory.limit": "3Gi"}, restart="Always"))
    pods.wait_running("b6")
    cid = pods.container_id("b6")
    env0 = container_env(c, cid)
    held0 = [t for t in ledger(daemon) if t["pod_name"] == "b6"]
    dp0 = daemon.dp()
    off = c.kubelet.log_size()
    c.kubelet_stop(signal.SIGTERM)
    CHECKPOINT.unlink(missing_ok=True)
    c.kubelet_start()
    _advertised(c)
    assert pods.container_id("b6") == cid  # running containers: nothing to do
    c.ctrd.crictl("stop", "--timeout", "1", cid)
    k.wait_for(lambda: pods.get("b6").status.container_statuses[0].restart_count >= 1
               and pods.container_id("b6") != cid and pods.wait_running("b6"), 120, "b6 restarted by kubelet")
    assert kubelet_lines(c, off, "Needs to re-allocate"), c.kubelet.tail(40)
    dp = daemon.dp()
    # answered from the recorded reservation (ADR 0007: "reserved"), not
    # planned anew and not the fallback after the deadline
    assert dp["reserved"] > dp0["reserved"]
    assert dp["fallbacks"] == dp0["fallbacks"], dp["last_fallback"]
    held = [t for t in ledger(daemon) if t["pod_name"] == "b6"]
    assert [(t["gpu_uuid"], t["request_mib"], t["limit_mib"]) for t in held] == \
        [(t["gpu_uuid"], t["request_mib"], t["limit_mib"]) for t in held0]
    assert container_env(c, pods.container_id("b6")) == env0


def test_init_and_app_container_one_reservation_podresources_agrees(cluster, daemon, pods):
    """Scenario 7 (D6): the app container gets the init container's devices;
    one reservation for the pod; PodResources and /status agree while it runs
    and after it is gone."""
    c = cluster
    _advertised(c)
    pods.create(k.pod_manifest("b7", gib=2, init=True))
    pods.wait_running("b7")
    pr = podresources(c)
    app_ids = pr[("b7", "app")]
    assert sorted(pr.get(("b7", "init"), app_ids)) == sorted(app_ids)
    gpu = _gpu_of(app_ids)
    held = [t for t in ledger(daemon) if t["pod_name"] == "b7"]
    assert len(held) == 1, held
    assert (held[0]["gpu_uuid"], held[0]["request_mib"]) == (gpu, 2048)
    # /status agrees with PodResources for every pod kubelet lists with our devices
    on_status = {(t["pod_name"], t["gpu_uuid"]) for t in ledger(daemon)}
    on_kubelet = {(pod, _gpu_of(ids)) for (pod, _ct), ids in podresources(c).items()}
    assert on_kubelet <= on_status, (on_kubelet, on_status)
    pods.delete_all()
    k.wait_for(lambda: not [t for t in ledger(daemon) if t["pod_name"] == "b7"], 60, "b7's reservation released")
    assert ("b7", "app") not in podresources(c)


@pytest.mark.parametrize(("init_gib", "app_gib"), [(2, 3), (3, 2)], ids=["init2-app3", "init3-app2"])
def test_init_and_app_of_different_sizes_run(cluster, daemon, pods, init_gib, app_gib):
    """Issue 34 input 1 on the real kubelet: the init container's devices
    go again to the app container, plus or minus some (``devicesToReuse``);
    both keys are one hold on the union of their devices. The pod reaches
    Running with its init completed, each container got its own size, and
    the ledger never held more than the larger for this pod (sampled while
    it started: its own entries and those no container claimed yet)."""
    c = cluster
    _advertised(c)
    name = f"i34-init{init_gib}-app{app_gib}"
    most = max(init_gib, app_gib) * 1024
    seen: list[int] = []

    def held() -> int:  # this pod's, and reservations whose holder is not known yet (they may be its): charged
        mib = sum(max(t["request_mib"], t.get("held_mib", 0)) for t in ledger(daemon) if t["pod_name"] in (name, ""))
        seen.append(mib)
        return mib

    pods.create(k.pod_manifest(name, gib=app_gib, init=True, init_gib=init_gib))

    def running():
        held()
        p = pods.get(name)
        if p.status.phase == "Failed":
            raise k.HarnessError(f"pod {name} failed: {p.status.reason}: {p.status.message}")
        cs = p.status.container_statuses or []
        return p if cs and all(s.state.running for s in cs) else None
    k.wait_for(running, 120, f"pod {name} running", interval=0.2)
    p = pods.get(name)
    (init,) = p.status.init_container_statuses
    assert init.state.terminated is not None and init.state.terminated.exit_code == 0, init.state
    pr = podresources(c)
    app_ids = pr[(name, "app")]
    assert len(app_ids) == app_gib
    init_ids = pr.get((name, "init"))
    if init_ids is not None:  # kubelet reuses the init's devices: the app's share a GPU with them
        assert len(init_ids) == init_gib and _gpu_of(init_ids) == _gpu_of(app_ids)
    env = container_env(c, pods.container_id(name))
    assert env["NVIDIA_VISIBLE_DEVICES"] == _gpu_of(app_ids)
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == str(app_gib * 1024)
    assert env.get("FRACPLUGIN_RESERVATION_PROOF", "") == ""  # checked once, then out of the env
    mine = [t for t in ledger(daemon) if t["pod_name"] == name]
    assert [(t["container"], t["request_mib"]) for t in mine] == [("app", app_gib * 1024)], mine
    held()
    assert max(seen) <= most, seen


def test_dcgm_exporter_rule_on_the_real_podresources_list(cluster, daemon, pods):
    """Issue 36 item 8 on a recorded List: two device-plugin-door pods (8
    and 4 units) as this kubelet lists them in PodResources, read through
    dcgm-exporter's attribution rule as docs/operator-guide.md states it
    (``tests/unit/test_dcgm_exporter_join.dcgm_attribution``). With
    ``--nvidia-resource-names fracplugin.io/gpu-memory`` every GPU they use
    is attributed (one container per GPU, or one copy per container and
    unit with ``--kubernetes-virtual-gpus``); without it, nothing. The List
    is kept beside the logs (``podresources-list.json``)."""
    import grpc
    from google.protobuf import json_format

    from fracplugin._proto import podresources_pb2 as pb
    from fracplugin._proto import podresources_pb2_grpc as pbg
    from tests.unit.test_dcgm_exporter_join import UUID, dcgm_attribution

    c = cluster
    _advertised(c)
    for name, gib in (("dcgm-a", 8), ("dcgm-b", 4)):
        pods.create(k.pod_manifest(name, gib=gib))
    for name in ("dcgm-a", "dcgm-b"):
        pods.wait_running(name)
    with grpc.insecure_channel(f"unix://{c.podresources_sock}") as ch:
        listed = pbg.PodResourcesListerStub(ch).List(pb.ListPodResourcesRequest(), timeout=10)
    # this test's pods (an earlier test's may still be listed while they end)
    resp = pb.ListPodResourcesResponse(pod_resources=[p for p in listed.pod_resources if p.name.startswith("dcgm-")])
    keep = k.REPO / "build" / "kubelet-e2e-logs"
    keep.mkdir(parents=True, exist_ok=True)
    (keep / f"podresources-list-{c.bins.version}.json").write_text(json_format.MessageToJson(listed))
    units: dict[int, list[tuple[str, str, str, str]]] = {}
    index = {u: i for i, u in UUID.items()}
    for p in resp.pod_resources:
        for ct in p.containers:
            for dev in ct.devices:
                if dev.resource_name == k.RESOURCE:
                    for d in dev.device_ids:
                        uuid, n = d.split("::")
                        units.setdefault(index[uuid], []).append((p.namespace, p.name, ct.name, n))
    assert sorted(len(v) for v in units.values()) in ([12], [4, 8]), units
    copies = dcgm_attribution(resp, [k.RESOURCE], virtual_gpus=True)
    assert {i: sorted(v) for i, v in copies.items()} == {i: sorted(v) for i, v in units.items()}
    one = dcgm_attribution(resp, [k.RESOURCE], virtual_gpus=False)
    assert set(one) == set(units) and all(len(v) == 1 and v[0][:3] in {w[:3] for w in units[i]}
                                          for i, v in one.items())
    assert dcgm_attribution(resp, [], virtual_gpus=True) == {}
