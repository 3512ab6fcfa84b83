"""Issue 10: one allocation shared by the device plugin door and the NRI door.

Every test runs ``fracplugin run`` as a subprocess with both doors on and
drives it through its real sockets, as kubelet and containerd would:
``fake_kubelet.FakeKubelet`` (Registration, Allocate, GetPreferredAllocation
over the plugin's unix socket), ``fake_kubelet.FakePodResources`` (kubelet's
PodResources List), ``nri_runtime.FakeNriRuntime`` (CreateContainer etc. over
the NRI socket) and a pods file standing in for the API server's watch.

The container env at CreateContainer is built as kubelet builds it: the
Allocate answer's envs first, then the pod spec's env (docs/reference/kubelet-device-plugin.md
A.5, "Container start"); a later value of the same key wins.

Node: examples/nodes/gpu-node-1.yaml, four GPUs of 81559 MiB; one device =
1024 MiB (79 devices per GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest
import yaml
from test_daemon import DaemonProc, root, serve_fake_api  # noqa: F401 (root: fixture)
from tests.helpers import wait_until

from fracplugin.allocation import reservation_key

R = "fracplugin.io/gpu-memory"
P = "nvidia.com/container."
UUIDS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def ids(gpu: int, n: int, start: int = 0) -> list[str]:
    return [f"{UUIDS[gpu]}::{i}" for i in range(start, start + n)]


def key_of(dev_ids: list[str]) -> str:
    by: dict[str, list[int]] = {}
    for d in dev_ids:
        u, _, n = d.rpartition("::")
        by.setdefault(u, []).append(int(n))
    return reservation_key(by)


def pod(name: str, units: int | None = None, annotations: Mapping[str, str] | None = None, *,
        containers: list[dict[str, Any]] | None = None, init: list[dict[str, Any]] | None = None,
        phase: str = "Pending") -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": "gpu-node-1",
                            "containers": containers or [{"name": "app", "resources": {"limits": {R: str(units)}}}]}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                         "creationTimestamp": "2026-11-30T00:00:00Z", "annotations": dict(annotations or {})},
            "spec": spec, "status": {"phase": phase}}


def ctr(name: str, units: int | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name}
    if units is not None:
        c["resources"] = {"limits": {R: str(units)}}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return c


class Node:
    """The daemon with both doors, its peers and helpers."""

    def __init__(self, root: Path, *extra: str, ready: tuple[str, ...] = ()) -> None:
        from fake_kubelet import FakeKubelet, FakePodResources
        from nri_runtime import FakeNriRuntime

        (root / "dp").mkdir()
        self.pods_path = root / "pods.yaml"
        self.pods: dict[str, dict[str, Any]] = {}
        self._write()
        # The daemon is forked before this process runs any grpc server (a fork
        # while grpc threads poll can crash the child before its exec).
        self.d = DaemonProc(root, ["--no-mps", "--nri-socket", str(root / "nri.sock"),
                                   "--device-plugin-dir", str(root / "dp"),
                                   "--pod-resources-socket", str(root / "pr.sock"),
                                   "--pod-resources-interval", "0.2", "--node-name", "gpu-node-1",
                                   "--allocate-deadline", "5", *extra]
                           + ([] if "--kubeconfig" in extra else ["--pods-file", str(self.pods_path)])).start()
        self.kubelet = FakeKubelet(str(root / "dp")).start()
        self.pr = FakePodResources(str(root / "pr.sock")).start()
        self.rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
        self.rt.wait_registered(15)
        # ready: every check, or those named (a node that cannot enforce is not ready, its doors serve)
        wait_until(lambda: all(self.d.get("/readyz")[1]["checks"][c]["ready"] for c in ready) if ready
                   else self.d.ready(), 20, what=lambda: f"readiness: {self.d.get('/readyz')}")

    def close(self) -> None:
        self.d.kill()
        self.rt.close()
        self.kubelet.stop()
        self.pr.stop()

    def restart_daemon(self, while_down: Callable[[], None] | None = None) -> None:
        """SIGKILL the daemon, call ``while_down()``, start it again on the
        same state directory (ledger, reservation proofs): waits until it
        registered with the kubelet again, the runtime synchronized it (what
        ``rt.set_sync_state`` says runs) and it is ready."""
        self.d.kill()
        (self.d.state / "endpoints.json").unlink()  # the killed daemon's: wait for the new one's
        if while_down is not None:
            while_down()
        self.d.start()
        self.rt.wait_registered(15)
        wait_until(lambda: self.d.ready() and self.status()["device_plugin"]["registered"]
                   and self.kubelet.stream_open(R), 20, what=lambda: f"readiness: {self.d.get('/readyz')}")

    # ---- the API server (pods file) -------------------------------------------
    def _write(self) -> None:
        tmp = self.pods_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump_all(list(self.pods.values())))
        os.replace(tmp, self.pods_path)

    def put(self, *pods: dict[str, Any]) -> None:
        for p in pods:
            self.pods[p["metadata"]["name"]] = p
        self._write()
        assert wait_until(lambda: (self.status().get("pod_source") or {}).get("pods") == self.live(), 10)

    def delete(self, name: str) -> None:
        del self.pods[name]
        self._write()
        assert wait_until(lambda: (self.status().get("pod_source") or {}).get("pods") == self.live(), 10)

    def live(self) -> int:
        return len(self.pods)

    # ---- kubelet -----------------------------------------------------------------
    def allocate(self, dev_ids: list[str]) -> tuple[dict[str, str], dict[str, str]]:
        """(envs, annotations) of Allocate's answer."""
        resp = self.kubelet.allocate(R, dev_ids)
        c = resp.container_responses[0]
        return dict(c.envs), dict(c.annotations)

    def record(self, pod_name: str, container: str, dev_ids: list[str], resource: str = R) -> None:
        """What kubelet's devicemanager records after Allocate (PodResources)."""
        self.pr.pods.setdefault(("default", pod_name), {}).setdefault(container, {})[resource] = list(dev_ids)

    # ---- containerd ------------------------------------------------------------------
    def create(self, p: dict[str, Any], container: str, alloc_env: Mapping[str, str] | None = None,
               mounts: list[tuple[str, str]] = ()) -> tuple[Any, dict[str, str]]:
        """CreateContainer of ``container`` of pod ``p``: (adjustment or
        RpcError, the env the container ends up with)."""
        from nri_runtime import effective_env, make_container, make_pod

        md = p["metadata"]
        sandbox = make_pod(md["name"], md["namespace"], md["uid"], md.get("annotations") or {})
        spec_c = next(c for c in (p["spec"].get("initContainers") or []) + p["spec"]["containers"]
                      if c["name"] == container)
        env = [PATH_ENV] + [f"{k}={v}" for k, v in (alloc_env or {}).items()]
        env += [f"{e['name']}={e['value']}" for e in spec_c.get("env") or []]
        c = make_container(sandbox, container, env=env)
        for dest, src in mounts:
            c.mounts.add(destination=dest, source=src, type="bind", options=["rbind"])
        out = self.rt.create_container(sandbox, c)
        if getattr(out, "code", None) is not None and not hasattr(out, "env"):
            return out, {}
        return out, effective_env(c, out)

    def stop(self, p: dict[str, Any], container: str) -> None:
        from nri_runtime import make_container, make_pod

        md = p["metadata"]
        sandbox = make_pod(md["name"], md["namespace"], md["uid"], md.get("annotations") or {})
        self.rt.stop_container(sandbox, make_container(sandbox, container))

    # ---- observing -------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.d.get("/status")[1]

    def tenants(self) -> list[dict[str, Any]]:
        return [t for g in self.status()["gpus"] for t in g["tenants"]]

    def held(self, gpu: int) -> int:
        return self.status()["gpus"][gpu]["held_mib"]

    def warnings(self) -> list[dict[str, Any]]:
        return [r for r in self.d.log_records() if r.get("msg") == "nri annotation not applied"]

    def agrees_with_podresources(self) -> bool:
        """Every container kubelet lists with our devices holds exactly that
        reservation, bound to it (pod and container), in /status."""
        by_key = {t["reservation"]: t for t in self.tenants() if t.get("door") == "allocate"}
        for (ns, name), conts in self.pr.pods.items():
            for cname, res in conts.items():
                if R not in res:
                    continue
                t = by_key.get(key_of(res[R]))
                if t is None or (t["namespace"], t["pod_name"]) != (ns, name):
                    return False
        return True


@pytest.fixture
def node(root: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(*extra: str, ready: tuple[str, ...] = ()) -> Node:
        n = Node(root, *extra, ready=ready)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


# ---- 1. kubelet's allocation is authoritative ----------------------------------------------


def test_1_limit_annotation_adds_a_limit_and_keeps_the_request(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("one", 1, {P + "app.gpu-memory.limit": "2Gi"})
    n.put(p)
    env, ann = n.allocate(ids(0, 1))
    assert (env["NVIDIA_GPU_MEMORY_REQUEST"], env["NVIDIA_GPU_MEMORY_LIMIT"]) == ("1024", "2048")
    assert ann["fracplugin.io/allocate"] == "planned" and env["FRACPLUGIN_RESERVATION"] == f"{UUIDS[0]}::0"
    n.record("one", "app", ids(0, 1))
    adj, got = n.create(p, "app", env)
    assert (got["NVIDIA_GPU_MEMORY_REQUEST"], got["NVIDIA_GPU_MEMORY_LIMIT"]) == ("1024", "2048")
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0] and got["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{UUIDS[0]}=2048M"
    (t,) = n.tenants()
    assert (t["pod_uid"], t["container"], t["gpu_uuid"], t["request_mib"], t["limit_mib"], t["door"]) == \
        ("uid-one", "app", UUIDS[0], 1024, 2048, "allocate")
    assert t["container_id"] == "ctr-uid-one-app"
    assert n.agrees_with_podresources()


def test_2_nri_keeps_the_gpu_kubelet_chose(node: Callable[..., Node]) -> None:
    n = node()
    first, second = pod("first", 1), pod("second", 1, {P + "app.gpu-memory.limit": "2Gi"})
    n.put(first)
    env1, _ = n.allocate(ids(0, 1))
    n.create(first, "app", env1)
    n.put(second)
    env2, _ = n.allocate(ids(0, 1, start=1))  # kubelet picks GPU0::1
    _adj, got = n.create(second, "app", env2)
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    assert sorted(t["pod_name"] for t in n.status()["gpus"][0]["tenants"]) == ["first", "second"]
    assert n.held(0) == 2048 and n.held(1) == 0


def test_3_annotations_never_move_or_enlarge_a_device_plugin_container(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("big", 1, {P + "app.gpu-memory.request": "70Gi", P + "app.gpus.devices": UUIDS[3]})
    n.put(p)
    env, _ = n.allocate(ids(0, 1))
    _adj, got = n.create(p, "app", env)
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    assert (got["NVIDIA_GPU_MEMORY_REQUEST"], got["NVIDIA_GPU_MEMORY_LIMIT"]) == ("1024", "1024")
    assert n.held(0) == 1024 and n.held(3) == 0
    keys = {w.get("key") for w in n.warnings()}
    assert {P + "app.gpu-memory.request", P + "app.gpus.devices"} <= keys, n.warnings()
    assert all(w.get("value") and "not applied" in w.get("reason", "") for w in n.warnings())


def test_4_readme_example_gets_the_gpu_kubelet_gave_and_its_units(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("readme", 8, {P + "app.gpu-memory.limit": "12Gi", P + "app.gpu-compute.mode": "time-slicing"})
    n.put(p)
    env, _ = n.allocate(ids(1, 8))
    _adj, got = n.create(p, "app", env)
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]
    assert (got["NVIDIA_GPU_MEMORY_REQUEST"], got["NVIDIA_GPU_MEMORY_LIMIT"]) == ("8192", "12288")
    assert n.held(0) == 0 and n.held(1) == 8192


# ---- 2. Allocate never records a guess ---------------------------------------------------


def test_5_deleted_pods_allocate_is_not_recorded_as_another_pod(node: Callable[..., Node]) -> None:
    n = node()
    a, b = pod("a", 4), pod("b", 4)
    n.put(a, b)
    n.delete("a")
    env_a, ann_a = n.allocate(ids(0, 4))  # kubelet still admits the deleted pod a
    env_b, ann_b = n.allocate(ids(1, 4))  # then b
    assert ann_a["fracplugin.io/allocate"] == "planned" and ann_b["fracplugin.io/allocate"] == "planned"
    assert env_b["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]
    # Nothing names b before evidence arrives.
    assert all(t["pod_name"] == "" for t in n.tenants())
    n.record("b", "app", ids(1, 4))
    _adj, got = n.create(b, "app", env_b)
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]
    mine = [(t["gpu_uuid"], t["request_mib"]) for t in n.tenants() if t["pod_name"] == "b"]
    assert mine == [(UUIDS[1], 4096)]
    assert n.agrees_with_podresources()
    # kubelet never lists a's devices: the reservation goes once the grace is over (not asserted in time).


def test_a_reservation_held_by_a_running_container_cannot_be_claimed_by_another_pod(
        node: Callable[..., Node]) -> None:
    n = node()
    owner = pod("owner", 2)
    n.put(owner)
    env, _ = n.allocate(ids(0, 2))
    n.create(owner, "app", env)
    thief = pod("thief", containers=[ctr("app", env={"FRACPLUGIN_RESERVATION": env["FRACPLUGIN_RESERVATION"]})])
    err, _ = n.create(thief, "app")
    assert getattr(err, "code", None) is not None and "held by running container default/owner/app" in err.message
    assert [(t["pod_name"], t["container"]) for t in n.tenants()] == [("owner", "app")]


# ---- 3. init containers and restarts --------------------------------------------------------


def test_6_init_and_app_on_the_same_ids_are_one_reservation(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("initapp", containers=[ctr("app", 8)], init=[ctr("setup", 8)],
            annotations={P + "app.gpu-compute.mode": "sm-sharing"})
    n.put(p)
    env_init, _ = n.allocate(ids(0, 8))
    env_app, _ = n.allocate(ids(0, 8))  # kubelet reuses the init container's devices
    assert n.held(0) == 8192
    assert env_app["NVIDIA_GPU_MEMORY_REQUEST"] == "8192"
    n.record("initapp", "app", ids(0, 8))
    _adj, got = n.create(p, "setup", env_init)
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0] and n.held(0) == 8192
    n.stop(p, "setup")
    # The init container's time-slicing does not lock the GPU against the app's sm-sharing.
    adj, got = n.create(p, "app", env_app)
    assert getattr(adj, "code", None) is None, adj
    assert n.held(0) == 8192
    (t,) = n.status()["gpus"][0]["tenants"]
    assert (t["container"], t["mode"], t["request_mib"]) == ("app", "sm-sharing", 8192)
    assert n.agrees_with_podresources()


def test_7_init_and_app_of_40_units_each_are_admitted(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("forty", containers=[ctr("app", 40)], init=[ctr("setup", 40)])
    n.put(p)
    n.allocate(ids(0, 40))
    env, ann = n.allocate(ids(0, 40))  # was refused: "40599 MiB free"
    assert ann["fracplugin.io/allocate"] in ("planned", "reserved")
    assert n.held(0) == 40960


def test_8_a_finished_jobs_devices_go_to_the_next_pod(node: Callable[..., Node]) -> None:
    n = node()
    job = pod("job", 60)
    n.put(job)
    env, _ = n.allocate(ids(0, 60))
    n.create(job, "app", env)
    assert n.held(0) == 61440
    done = pod("job", 60, phase="Succeeded")
    n.put(done)
    wait_until(lambda: n.held(0) == 0, 10, lambda: f"GPU 0 released: {n.tenants()}")
    nxt = pod("next", 60)
    n.put(nxt)
    env2, ann2 = n.allocate(ids(0, 60))  # was refused
    assert ann2["fracplugin.io/allocate"] == "planned" and n.held(0) == 61440


def test_8b_devices_allocated_again_free_the_old_reservation(node: Callable[..., Node]) -> None:
    """kubelet frees a pod's devices when it ends; it hands the same IDs on.
    Even when the pod's end was not seen, the old reservation is released,
    once no container of it runs (while one runs, the Allocate is answered
    pending and nothing is released: ADR 0033 decision 2,
    ``test_kubelet_orders.py`` input 2)."""
    n = node()
    job = pod("job2", 60)
    n.put(job)
    env, _ = n.allocate(ids(0, 60))
    n.create(job, "app", env)
    n.stop(job, "app")
    nxt = pod("next2", 60)
    n.put(nxt)
    _env2, ann2 = n.allocate(ids(0, 60, start=10))
    assert ann2["fracplugin.io/allocate"] == "planned"
    assert [t["reservation"] for t in n.tenants()] == [key_of(ids(0, 60, start=10))]


def test_8c_the_same_ids_for_a_new_pod_after_the_holder_is_gone(node: Callable[..., Node]) -> None:
    """The exact device IDs of a deleted pod go to the next pod: it gets its
    own settings, not the recorded ones (while the old container runs the
    answer is pending, and the new container is admitted with those
    settings once it stopped: ADR 0033 decision 2)."""
    n = node()
    old = pod("old", 4, {P + "app.gpu-memory.limit": "16Gi"})
    n.put(old)
    env, _ = n.allocate(ids(0, 4))
    n.create(old, "app", env)
    n.pods["old"]["metadata"]["deletionTimestamp"] = "2026-11-30T00:00:01Z"  # terminating: no deletion seen yet
    n.put(n.pods["old"])
    assert [t["pod_name"] for t in n.tenants()] == ["old"]
    new = pod("new", 4, {P + "app.gpu-memory.limit": "6Gi"})
    n.put(new)
    env2, ann2 = n.allocate(ids(0, 4))
    assert ann2["fracplugin.io/allocate"] == "pending" and env2["NVIDIA_GPU_MEMORY_LIMIT"] == "6144"
    assert [(t["pod_name"], t["limit_mib"]) for t in n.tenants()] == [("old", 16384)]
    err, _ = n.create(new, "app", env2)
    assert getattr(err, "code", None) == 14 and "running container default/old/app" in err.message, err
    n.stop(old, "app")
    adj, got = n.create(new, "app", env2)
    assert not hasattr(adj, "code") and got["NVIDIA_GPU_MEMORY_LIMIT"] == "6144", adj
    assert [(t["pod_name"], t["limit_mib"]) for t in n.tenants()] == [("new", 6144)]


def test_9_re_allocate_after_kubelet_restart_gets_the_same_answer(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("sm", 8, {P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": "0.5"})
    n.put(p)
    env, _ = n.allocate(ids(2, 8))
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    n.create(p, "app", env)
    n.pods["sm"]["status"] = {"phase": "Running", "containerStatuses": [{"name": "app", "containerID": "containerd://x"}]}
    n.put(n.pods["sm"])
    n.kubelet.restart()
    assert wait_until(lambda: n.status()["device_plugin"]["registered"] and n.kubelet.stream_open(R), 15)
    env2, ann2 = n.allocate(ids(2, 8))
    assert ann2["fracplugin.io/allocate"] == "reserved"  # at once, not a fallback after the deadline
    env.pop("FRACPLUGIN_RESERVATION"), env2.pop("FRACPLUGIN_RESERVATION")
    assert env2 == env


# ---- 7. GetPreferredAllocation -----------------------------------------------------------------


def test_10_preferred_never_proposes_an_uneven_split(node: Callable[..., Node]) -> None:
    n = node()
    got = n.kubelet.preferred(R, ids(0, 10) + ids(1, 6), [], 16)
    per: dict[str, int] = {}
    for d in got:
        per[d.rpartition("::")[0]] = per.get(d.rpartition("::")[0], 0) + 1
    assert len(set(per.values())) <= 1, f"uneven split {per}: Allocate would refuse it"
    got = n.kubelet.preferred(R, ids(0, 10) + ids(1, 6) + ids(2, 8), [], 16)
    per = {}
    for d in got:
        per[d.rpartition("::")[0]] = per.get(d.rpartition("::")[0], 0) + 1
    assert sorted(per.values()) == [8, 8]
    env, _ = n.allocate(got)  # Allocate accepts it
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "8192"


def test_11_preferred_avoids_a_gpu_at_its_tenant_limit(node: Callable[..., Node]) -> None:
    n = node("--max-clients-per-gpu", "2")
    for name in ("t1", "t2"):
        p = pod(name, containers=[ctr("app")], annotations={P + "app.gpu-memory.request": "1Gi",
                                                           P + "app.gpus.devices": UUIDS[0]})
        adj, _ = n.create(p, "app")
        assert getattr(adj, "code", None) is None, adj
    all_ids = [d for g in range(4) for d in ids(g, 79)]
    got = n.kubelet.preferred(R, all_ids, [], 1)
    assert got and got[0].rpartition("::")[0] != UUIDS[0]


# ---- 6. both doors give the same answer -----------------------------------------------------------


def test_12_pod_authored_values_of_our_env_are_overridden(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("authored", containers=[ctr("app", 4, env={"NVIDIA_VISIBLE_DEVICES": "all",
                                                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=81559M"})])
    n.put(p)
    env, _ = n.allocate(ids(0, 4))
    _adj, got = n.create(p, "app", env)
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    assert got["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{UUIDS[0]}=4096M"


def test_13_a_gpu_given_whole_by_another_plugin_is_not_shared(node: Callable[..., Node]) -> None:
    n = node()
    n.record("cuda-job", "cuda", [UUIDS[0]], resource="nvidia.com/gpu")
    wait_until(lambda: any(t["door"] == "other-plugin" for t in n.tenants()), 10,
               lambda: f"an other-plugin hold: {n.tenants()}")
    p = pod("frac", containers=[ctr("app")], annotations={P + "app.gpu-memory.request": "40Gi"})
    _adj, got = n.create(p, "app")
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]
    (whole,) = n.status()["gpus"][0]["tenants"]
    assert (whole["pod_name"], whole["container"], whole["request_mib"]) == ("cuda-job", "cuda", 81559)


def test_14_annotation_naming_no_container_is_reported_at_the_nri_door(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("typo", containers=[ctr("app")], annotations={P + "ap.gpu-memory.request": "8Gi"})
    n.put(p)
    adj, _ = n.create(p, "app")
    assert getattr(adj, "code", None) is None and not adj.env  # untouched, but not silent
    (w,) = n.warnings()
    assert w["key"] == P + "ap.gpu-memory.request" and "names no container of this pod" in w["reason"]


def test_15_pod_level_fraction_applies_to_the_first_app_container_only(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("kai", containers=[ctr("app"), ctr("sidecar")], init=[ctr("init")],
            annotations={"gpu-fraction": "0.5"})
    n.put(p)
    got = {}
    for c in ("init", "app", "sidecar"):
        adj, env = n.create(p, c)
        got[c] = env.get("NVIDIA_GPU_MEMORY_REQUEST")
    assert got == {"init": None, "app": "40267", "sidecar": None}  # floor((81559 - 1024 reserve) x 0.5)
    assert [t["container"] for t in n.tenants()] == ["app"]
    # explain says the same
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(n.pods_path),
                          "--node", str(Path(__file__).resolve().parents[2] / "examples/nodes/gpu-node-1.yaml"),
                          "-o", "json"], capture_output=True, text=True, timeout=60)
    rep = json.loads(out.stdout)
    assert [c["name"] for c in rep["containers"] if c["fractional"]] == ["app"]


def test_15b_a_pod_level_fraction_naming_a_native_sidecar_fences_it_and_leaves_the_app(
        node: Callable[..., Node]) -> None:
    """Issue 34, input 5: a native sidecar (an init container with restartPolicy
    Always) named by gpu-fraction-container-name gets the fraction; the app is
    untouched (not refused), at the NRI door and in explain alike."""
    n = node()
    p = pod("kai-sidecar", containers=[ctr("app")], init=[{**ctr("sidecar"), "restartPolicy": "Always"}],
            annotations={"gpu-fraction": "0.25", "gpu-fraction-container-name": "sidecar"})
    n.put(p)
    got = {}
    for c in ("sidecar", "app"):
        adj, env = n.create(p, c)
        assert getattr(adj, "code", None) is None, adj  # neither is refused
        got[c] = env.get("NVIDIA_GPU_MEMORY_REQUEST")
        if c == "app":  # untouched: no env, mount or CDI device at all
            assert (list(adj.env), list(adj.mounts), list(adj.CDI_devices)) == ([], [], []), adj
    assert got == {"sidecar": "20133", "app": None}  # floor((81559 - 1024 reserve) x 0.25)
    assert [(t["container"], t["request_mib"]) for t in n.tenants()] == [("sidecar", 20133)]
    assert n.warnings() == []
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(n.pods_path),
                          "--node", str(Path(__file__).resolve().parents[2] / "examples/nodes/gpu-node-1.yaml"),
                          "-o", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert [(c["name"], c["fractional"], c["request_mib"], c["error"]) for c in rep["containers"]] == [
        ("sidecar", True, 20133, None), ("app", False, None, None)]


def test_15c_the_kubelet_door_lets_a_pod_level_limit_name_a_native_sidecar(node: Callable[..., Node]) -> None:
    """Issue 34 input 5 at Allocate: the native sidecar asks for 8 units of the extended resource and the
    pod-level ``gpu-fraction.limit`` names it through ``gpu-fraction-container-name``: Allocate answers it
    with the limit (the form's target list is the app containers and the native sidecars at every door),
    and nothing is refused for naming no container."""
    n = node()
    p = pod("dp-sidecar", containers=[ctr("app")], init=[{**ctr("sidecar", 8), "restartPolicy": "Always"}],
            annotations={"gpu-fraction": "0.1", "gpu-fraction.limit": "0.5", "gpu-fraction-container-name": "sidecar"})
    n.put(p)
    env, _ = n.allocate(ids(0, 8))
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "8192" and env["NVIDIA_GPU_MEMORY_LIMIT"] == "40267", env
    adj, got = n.create(p, "sidecar", env)
    assert getattr(adj, "code", None) is None and got["NVIDIA_GPU_MEMORY_LIMIT"] == "40267", adj


def test_16_an_existing_mount_at_the_pipe_directory_is_refused_naming_it(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("mnt", containers=[ctr("app")], annotations={P + "app.gpu-memory.request": "1Gi"})
    err, _ = n.create(p, "app", mounts=[("/tmp/nvidia-mps", "/var/lib/kubelet/pods/x/volumes/mine")])
    assert getattr(err, "code", None) is not None
    assert "mounts[/tmp/nvidia-mps]" in err.message and "/var/lib/kubelet/pods/x/volumes/mine" in err.message
    assert n.tenants() == []


def test_16_kubelets_copy_of_the_allocate_pipe_mount_is_ours_not_a_conflict(node: Callable[..., Node]) -> None:
    """A real kubelet passes Allocate's mount (host pipe directory ->
    /tmp/nvidia-mps) in the CRI request (issue 11, seen with kubelet 1.37 and
    1.35): the NRI door must not take fracplugin's own mount for the pod's."""
    n = node()
    p = pod("own", 1)
    n.put(p)
    resp = n.kubelet.allocate(R, ids(0, 1)).container_responses[0]
    # the pipe directory mount as Allocate names it (or, where the answer
    # carries none, as an older fracplugin's answer did): below the MPS root
    m = next(((x.container_path, x.host_path) for x in resp.mounts),
             ("/tmp/nvidia-mps", str(n.d.root / "mps" / "ts")))
    assert m[0] == "/tmp/nvidia-mps" and m[1].startswith(str(n.d.root / "mps"))
    n.record("own", "app", ids(0, 1))
    adj, got = n.create(p, "app", dict(resp.envs), mounts=[m])
    assert getattr(adj, "code", None) is None, getattr(adj, "message", adj)
    assert got["NVIDIA_GPU_MEMORY_REQUEST"] == "1024"
    assert [t["pod_name"] for t in n.tenants()] == ["own"]


# ---- lifetimes, status ------------------------------------------------------------------------------


def metrics(n: Node) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{n.d.endpoints['metrics']}/metrics", timeout=5) as r:
        return r.read().decode()


def test_stopped_nri_container_holds_no_memory_and_its_series_go(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("short", containers=[ctr("app")], annotations={P + "app.gpu-memory.request": "4Gi"})
    n.create(p, "app")
    assert n.held(0) == 4096
    assert 'fracplugin_container_gpu_memory_request_bytes{' in metrics(n) and 'pod="short"' in metrics(n)
    n.stop(p, "app")
    assert n.held(0) == 0
    assert 'pod="short"' not in metrics(n)


def test_unadjusted_running_container_counts_as_holding_its_gpu(node: Callable[..., Node]) -> None:
    """After a (re)synchronization, a running container fracplugin did not
    adjust whose env names GPU0 holds GPU0: a fraction goes elsewhere."""
    from fracplugin._proto import nri_pb2
    from nri_runtime import make_container, make_pod

    n = node()
    sandbox = make_pod("raw", "default", "uid-raw")
    c = make_container(sandbox, "cuda", env={"NVIDIA_VISIBLE_DEVICES": UUIDS[0]}, state=nri_pb2.CONTAINER_RUNNING)
    n.rt.synchronize([sandbox], [c])
    (t,) = n.status()["gpus"][0]["tenants"]
    assert (t["pod_name"], t["door"], t["request_mib"]) == ("raw", "sync", 81559)
    p = pod("frac2", containers=[ctr("app")], annotations={P + "app.gpu-memory.request": "40Gi"})
    _adj, got = n.create(p, "app")
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]


def test_status_cli_shows_reservation_holder_and_door(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("shown", 2)
    n.put(p)
    env, _ = n.allocate(ids(1, 2))
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(n.d.state)],
                         capture_output=True, text=True, timeout=30).stdout
    assert "(holder not known yet)" in out and f"reservation {UUIDS[1]}::0-1" in out, out
    n.create(p, "app", env)
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(n.d.state)],
                         capture_output=True, text=True, timeout=30).stdout
    assert "default/shown/app: request 2048 MiB" in out and "door allocate" in out, out


def test_warning_event_names_the_annotations_not_applied(node: Callable[..., Node], root: Path) -> None:
    """With API access the warning of item 3 is a Kubernetes Warning Event
    (reason AnnotationNotApplied), posted through the API server."""
    from http.server import BaseHTTPRequestHandler

    p = pod("evt", 1, {P + "app.gpu-memory.request": "70Gi", P + "app.gpus.devices": UUIDS[3]})
    posted: list[dict[str, Any]] = []

    class Api(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _json(self, doc: Any, code: int = 200) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if "watch=" in self.path:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                return
            self._json({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": [p]})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posted.append(body)
            self._json(body, 201)

    api, kubeconfig = serve_fake_api(Api, root)
    try:
        n = node("--kubeconfig", str(kubeconfig))
        assert wait_until(lambda: (n.status().get("pod_source") or {}).get("pods") == 1, 15)
        env, _ = n.allocate(ids(0, 1))
        n.create(p, "app", env)
        wait_until(lambda: len(posted) >= 2, 10, lambda: f"two Events posted: {posted}")
        assert {e["reason"] for e in posted} == {"AnnotationNotApplied"}
        text = " ".join(e["message"] for e in posted)
        assert P + "app.gpu-memory.request" in text and P + "app.gpus.devices" in text and "70Gi" in text
    finally:
        api.shutdown()
        api.server_close()
