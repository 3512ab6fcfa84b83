"""The DRA door on the real cluster (issue 29 item 5, ADR 0031): the chart
installed with README's install block plus ``dra.enabled=true`` (layout
``split``, scheduler ``default``) on each Kubernetes line of
``$FRACPLUGIN_KUBE_VERSIONS`` (fullcluster.py turns on ``DRAConsumableCapacity``
where the line has it off by default). Everything is asserted through the API
as a user would see it, plus the container as the runtime runs it (``crictl``,
as test_install.py checks env and mounts) and the daemon's ``/metrics`` scraped
at its pod IP.

The steps (class ``TestDra``), each needing the install:

1. install: the DaemonSets roll out; the DeviceClass and the two per-mode
   classes exist; the node's ResourceSlice (driver ``gpu-memory.fracplugin.io``)
   lists the four GPUs of the simulated node with ``allowMultipleAllocations``,
   a ``memory`` capacity and ``computeMode: none``, as the API server stored it
   (the gate kept the fields);
2. README's ResourceClaimTemplate (20Gi, sm-sharing, limit 24Gi, portion 0.5)
   and pod, read from README.md: kube-scheduler allocates 20Gi of one GPU, the
   door prepares it, and the container has README's env, the read-only pipe
   directory mount and both CDI devices applied (the claim's and the GPU's own);
   the daemon's ledger holds 20Gi on that GPU;
3. three claims of 40Gi each (any two exceed one GPU's capacity) are placed on
   three different GPUs (``status.allocation``), each container on its GPU;
   deleting their pods frees their memory;
4. a claim whose parameters say ``gpu-compute.mode: fast`` fails Prepare with
   README's rule in the pod's events;
5. deleting README's pod unprepares its claim: the claim's CDI spec file is
   gone and the GPU's held memory is back to 0;
6. the device plugin door and the DRA door share the ledger: a device plugin
   pod takes most of one GPU, a DRA claim pinned to that GPU (CEL selector on
   its ``uuid``) is allocated by the scheduler (which does not see the device
   plugin's hold) and refused at Prepare by the memory rule, naming the GPU;
6a. the per-mode DeviceClasses (ADR 0031 addendum): an sm-sharing claim through
   ``sm-sharing.gpu-memory.fracplugin.io`` runs and the slice then says
   ``computeMode: sm-sharing`` for its GPU; a time-slicing claim through
   ``time-slicing.gpu-memory.fracplugin.io`` is placed by the scheduler on
   another GPU and runs (no Prepare refusal); freed, both GPUs are ``none``;
7. README's uninstall (split): nothing left, and the ResourceSlice deleted
   (``dra.deleteSlicesOnStop=true``).

Every failure names the pod, container and event that broke (``diagnosed``,
``wait``: pods, container states, logs, events).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

import fullcluster as fc
import readme
from conftest import container_id, crictl_json, diagnosed, pods_of, wait
from test_install import DOORS_SEL, NODE_FILE, Scenarios, container_env, only_pod, running_pod

k = fc.k
pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(900)]

DRIVER = "gpu-memory.fracplugin.io"
GROUP, VERSION = "resource.k8s.io", "v1"
MIB = 1 << 20
MODE_CLASSES = {m: f"{m}.{DRIVER}" for m in ("time-slicing", "sm-sharing")}  # the chart's per-mode classes
GIB_MIB = 1024
BAD_MODE_RULE = 'GpuMemoryParameters.gpu-compute.mode="fast" must be exactly "time-slicing" or "sm-sharing"'


def custom(c: fc.FullCluster) -> Any:
    """A ``CustomObjectsApi`` as the admin (resource.k8s.io objects as dicts)."""
    from kubernetes import client

    return client.CustomObjectsApi(c._client())


def resource_slices(c: fc.FullCluster) -> list[dict[str, Any]]:
    """This node's ResourceSlices of our driver."""
    items = custom(c).list_cluster_custom_object(GROUP, VERSION, "resourceslices")["items"]
    return [s for s in items if s["spec"].get("driver") == DRIVER and s["spec"].get("nodeName") == k.NODE]


def claim(c: fc.FullCluster, name: str, ns: str = "default") -> dict[str, Any]:
    return dict(custom(c).get_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaims", name))


def claim_of(c: fc.FullCluster, pod: Any, request: str = "gpu") -> dict[str, Any]:
    """The ResourceClaim pod ``pod`` uses under ``request`` (a template's
    generated claim: ``status.resourceClaimStatuses``; else the named one)."""
    for r in pod.spec.resource_claims or []:
        if r.name != request:
            continue
        if r.resource_claim_name:
            return claim(c, r.resource_claim_name, pod.metadata.namespace)
        for s in pod.status.resource_claim_statuses or []:
            if s.name == request and s.resource_claim_name:
                return claim(c, s.resource_claim_name, pod.metadata.namespace)
    raise k.HarnessError(f"pod {pod.metadata.name} has no ResourceClaim for {request!r} yet")


def allocated_devices(cl: dict[str, Any]) -> list[dict[str, Any]]:
    """Our driver's results of a claim's ``status.allocation``."""
    alloc = (cl.get("status") or {}).get("allocation") or {}
    return [r for r in (alloc.get("devices") or {}).get("results") or [] if r.get("driver") == DRIVER]


def gpus() -> list[dict[str, Any]]:
    return list(yaml.safe_load(NODE_FILE.read_text())["gpus"])


def gpu_of_device(device: str) -> dict[str, Any]:
    """The simulated GPU behind slice device ``gpu-<index>``."""
    return next(g for g in gpus() if f"gpu-{g['index']}" == device)


def capacity_mib(gpu: dict[str, Any], reserve_mib: int = 1024) -> int:
    """The ``memory`` capacity the door publishes for a GPU: its memory less
    the chart's ``reserveMiB`` (values.yaml default 1024)."""
    return int(gpu["memory_mib"]) - reserve_mib


def quantity_mib(q: str) -> int:
    """``20Gi`` / ``20480Mi`` / bytes -> MiB (the forms the API server writes)."""
    m = re.fullmatch(r"(\d+)(Gi|Mi|Ki)?", str(q))
    assert m, f"unexpected quantity {q!r}"
    n = int(m.group(1))
    return {"Gi": n * 1024, "Mi": n, "Ki": n // 1024}.get(m.group(2) or "", n // MIB)


def held_mib(c: fc.FullCluster) -> dict[str, int]:
    """``fracplugin_gpu_memory_held_bytes`` per GPU UUID in MiB, scraped from
    the daemon pod's IP as Prometheus would."""
    doors = only_pod(c, DOORS_SEL)
    port = next(p.container_port for p in doors.spec.containers[0].ports if p.name == "metrics")
    with urllib.request.urlopen(f"http://{doors.status.pod_ip}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for ln in text.splitlines():
        m = re.match(r'fracplugin_gpu_memory_held_bytes\{.*?UUID="([^"]+)".*\} (\S+)$', ln)
        if m:
            out[m.group(1)] = int(float(m.group(2))) // MIB
    return out


def pod_events(c: fc.FullCluster, name: str, ns: str = "default") -> list[str]:
    return [f"{e.type} {e.reason}: {e.message}" for e in c.api().list_namespaced_event(ns).items
            if e.involved_object.kind == "Pod" and e.involved_object.name == name]


def sleeper(name: str, claims: list[dict[str, str]]) -> dict[str, Any]:
    """A pod whose one container ``app`` (the harness's busybox) uses
    ``claims`` (``[{"name": ..., "resourceClaimName"|"resourceClaimTemplateName": ...}]``)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"automountServiceAccountToken": False, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1, "resourceClaims": claims,
                     "containers": [{"name": "app", "image": k.h.IMAGE, "imagePullPolicy": "Never",
                                     "command": ["/bin/sleep", "3600"],
                                     "resources": {"claims": [{"name": cl["name"]} for cl in claims]}}]}}


def compute_modes(c: fc.FullCluster) -> dict[str, str]:
    """GPU UUID -> the ``computeMode`` attribute the slice publishes for it."""
    return {d["attributes"]["uuid"]["string"]: d["attributes"].get("computeMode", {}).get("string", "")
            for s in resource_slices(c) for d in s["spec"].get("devices") or []}


def claim_doc(name: str, memory: str, params: dict[str, Any] | None = None,
              selector: str = "", device_class: str = DRIVER) -> dict[str, Any]:
    """A ResourceClaim asking ``memory`` of one GPU of ``device_class``, with
    opaque ``params`` (GpuMemoryParameters fields) and a CEL ``selector``."""
    exactly: dict[str, Any] = {"deviceClassName": device_class, "capacity": {"requests": {"memory": memory}}}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if params is not None:
        spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuMemoryParameters", **params}}}]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def create_claim(c: fc.FullCluster, doc: dict[str, Any]) -> None:
    custom(c).create_namespaced_custom_object(GROUP, VERSION, "default", "resourceclaims", doc)


def delete_pods(c: fc.FullCluster, names: list[str]) -> None:
    """Delete pods (grace 0) and wait until they are gone."""
    from kubernetes.client import V1DeleteOptions

    for n in names:
        c.api().delete_namespaced_pod(n, "default", body=V1DeleteOptions(grace_period_seconds=0))
    wait(c, lambda: not [p for p in pods_of(c, "default") if p.metadata.name in names], 120,
         f"pods {names} deleted", ns="default")


def delete_claims(c: fc.FullCluster, names: list[str]) -> None:
    """Delete ResourceClaims and wait until they are gone (the
    ``resource.kubernetes.io/delete-protection`` finalizer holds one while
    a pod may still use it)."""
    api = custom(c)
    for n in names:
        api.delete_namespaced_custom_object(GROUP, VERSION, "default", "resourceclaims", n)

    def gone() -> bool:
        items = api.list_namespaced_custom_object(GROUP, VERSION, "default", "resourceclaims")["items"]
        return not [x for x in items if x["metadata"]["name"] in names]
    wait(c, gone, 120, f"ResourceClaims {names} deleted", ns="default")


def cdi_spec(c: fc.FullCluster, uid: str) -> Path:
    """Where the door writes a claim's CDI spec (``dra.cdiDir``, cdispec.py)."""
    return c.base / "cdi" / f"{DRIVER}-claim_{uid}.json"


def prepare_refused(c: fc.FullCluster, pod: str, text: str) -> list[str]:
    """Pod ``pod``'s Warning events whose message carries ``text``."""
    return [e for e in pod_events(c, pod) if e.startswith("Warning") and text in e]


class TestDra(Scenarios):
    """The chart with ``dra.enabled=true`` (layout split, scheduler default)."""

    LAYOUT, SCHEDULER = "split", "default"

    def key(self, step: str) -> str:
        return f"dra/{self.LAYOUT}/{step}"

    def extra_values(self, helm: Any) -> list[str]:
        # the CDI directory the cluster's containerd reads (cdi_spec_dirs): the runtime must see the claim
        # specs the door writes; on a host whose runtime reads /var/run/cdi the default needs no --set
        return helm.values_args("--set", "dra.enabled=true", "--set", "dra.deleteSlicesOnStop=true",
                                "--set", f"dra.cdiDir={helm.c.base / 'cdi'}")

    # ---- 1 ------------------------------------------------------------------------
    def test_1_install_publishes_the_resource_slice(self, cluster, helm, kubectl, steps):
        c = cluster
        self.install(c, helm, kubectl, steps)
        self.needs(steps, "install")
        for name in (DRIVER, *MODE_CLASSES.values()):
            wait(c, lambda: custom(c).get_cluster_custom_object(GROUP, VERSION, "deviceclasses", name), 30,
                 f"DeviceClass {name}")
        # the first write may list no device: a GPU is Healthy for the door once its MPS daemon answers (the
        # split layout's MPS role starts beside the doors), and the slice is rewritten when that changes
        want = len(gpus())
        sl = wait(c, lambda: [s for s in resource_slices(c) if len(s["spec"].get("devices") or []) == want], 120,
                  f"the ResourceSlice of driver {DRIVER} on node {k.NODE} with {want} devices")
        with diagnosed(c, f"ResourceSlice of {DRIVER} on {k.NODE}"):
            assert len(sl) == 1, [s["metadata"]["name"] for s in sl]
            devs = {d["name"]: d for d in sl[0]["spec"]["devices"]}
            assert sorted(devs) == sorted(f"gpu-{g['index']}" for g in gpus()), sorted(devs)
            for g in gpus():
                d = devs[f"gpu-{g['index']}"]
                assert d["attributes"]["uuid"] == {"string": g["uuid"]}, d
                # dropped by the API server when DRAConsumableCapacity is off: the gate is on
                assert d.get("allowMultipleAllocations") is True, d
                assert quantity_mib(d["capacity"]["memory"]["value"]) == capacity_mib(g), d
                assert d["attributes"].get("computeMode") == {"string": "none"}, d  # nothing held yet
        steps[self.key("slice")] = True

    # ---- 2 ------------------------------------------------------------------------
    def test_2_readme_claim_template_is_allocated_prepared_and_applied(self, cluster, steps):
        c = cluster
        self.needs(steps, "slice")
        docs = readme.yaml_docs(readme.DRA_EXAMPLE)
        tmpl, pod = docs["ResourceClaimTemplate"], docs["Pod"]
        wait(c, lambda: c.api().read_namespaced_service_account("default", "default"), 60,
             "ServiceAccount default/default", ns="default")
        # README's manifests as they stand; only the container is this cluster's (image, a command that runs)
        ctr = pod["spec"]["containers"][0]
        ctr.update({"image": k.h.IMAGE, "imagePullPolicy": "Never", "command": ["/bin/sleep", "3600"]})
        pod["spec"].update({"automountServiceAccountToken": False, "restartPolicy": "Never",
                            "terminationGracePeriodSeconds": 1})
        custom(c).create_namespaced_custom_object(GROUP, VERSION, "default", "resourceclaimtemplates", tmpl)
        c.api().create_namespaced_pod("default", pod)
        name, cname = pod["metadata"]["name"], ctr["name"]
        p = running_pod(c, name)
        with diagnosed(c, f"README's DRA pod {name} container {cname}: events {pod_events(c, name)}"):
            cl = claim_of(c, p)
            res = allocated_devices(cl)
            assert len(res) == 1, cl.get("status")
            r = res[0]
            assert r["pool"] == k.NODE, r
            assert quantity_mib(r["consumedCapacity"]["memory"]) == 20 * GIB_MIB, r
            g = gpu_of_device(r["device"])
            uid = cl["metadata"]["uid"]
            cid = container_id(p, cname)
            env = container_env(c, cid)
            # README's DRA section "What is enforced"
            assert env.get("NVIDIA_VISIBLE_DEVICES") == g["uuid"], env
            assert env.get("NVIDIA_GPU_MEMORY_REQUEST") == "20480", env
            assert env.get("NVIDIA_GPU_MEMORY_LIMIT") == "24576", env
            assert env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == f"{g['uuid']}=24576M", env
            assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "50", env
            assert env.get("CUDA_MPS_PIPE_DIRECTORY") == "/tmp/nvidia-mps", env
            assert env.get("FRACPLUGIN_DRA_CLAIM") == uid, env  # the claim's CDI device, applied
            # the GPU's own CDI device (the node's k8s.device-plugin.nvidia.com/gpu spec, tests/e2e/cdi)
            assert env.get(f"FP_CDI_GPU{g['index']}") == g["uuid"], env
            pipe = self._pipe_mount(c, cid)
            cdi = crictl_json(c, "inspect", cid).get("info", {}).get("config", {}).get("CDI_devices") or []
            print(f"DRA pod {name}: claim {cl['metadata']['name']} on {r['device']} ({g['uuid']}), "
                  f"pipe {pipe}, CRI CDI devices {cdi}")
            assert cdi_spec(c, uid).is_file(), f"no CDI spec {cdi_spec(c, uid)}"
            assert held_mib(c).get(g["uuid"]) == 20 * GIB_MIB, held_mib(c)
        steps[self.key("readme")] = {"pod": name, "uid": uid, "gpu": g["uuid"]}

    # ---- 3 ------------------------------------------------------------------------
    def test_3_claims_exceeding_a_gpu_land_on_different_gpus(self, cluster, steps):
        c = cluster
        self.needs(steps, "slice")
        names = [f"big-{i}" for i in range(3)]
        # 40Gi each: any two exceed one GPU's capacity (80535 MiB). sm-sharing like README's claim, which may
        # still hold 20Gi of a GPU: gpu-memory.fracplugin.io does not select on compute modes, and a time-slicing
        # claim allocated beside it would be refused at Prepare (one compute mode per GPU; what the real cluster
        # showed, ADR 0031; step 6a covers the per-mode classes)
        for n in names:
            create_claim(c, claim_doc(n, "40Gi", {"gpu-compute.mode": "sm-sharing"}))
            c.api().create_namespaced_pod("default", sleeper(n, [{"name": "gpu", "resourceClaimName": n}]))
        placed: dict[str, str] = {}
        for n in names:
            p = running_pod(c, n)
            with diagnosed(c, f"pod {n} container app: events {pod_events(c, n)}"):
                res = allocated_devices(claim(c, n))
                assert len(res) == 1, res
                g = gpu_of_device(res[0]["device"])
                assert container_env(c, container_id(p, "app")).get("NVIDIA_VISIBLE_DEVICES") == g["uuid"]
                placed[n] = g["uuid"]
        with diagnosed(c, f"claims {names} placed {placed}"):
            assert len(set(placed.values())) == 3, placed
            held = held_mib(c)
            for g in gpus():
                assert held.get(g["uuid"], 0) <= capacity_mib(g), held
            for u in placed.values():
                assert held.get(u, 0) >= 40 * GIB_MIB, held
        print(f"three 40Gi claims on {placed}")
        delete_pods(c, names)
        delete_claims(c, names)
        readme_gpu = steps.get(self.key("readme"), {}).get("gpu")
        want = {u: (20 * GIB_MIB if u == readme_gpu else 0) for u in placed.values()}
        wait(c, lambda: all(held_mib(c).get(u, 0) == m for u, m in want.items()), 60,
             f"the 40Gi claims' memory freed: held {want}", ns="default")
        steps[self.key("spread")] = placed

    # ---- 4 ------------------------------------------------------------------------
    def test_4_bad_parameters_fail_prepare_with_the_rule(self, cluster, steps):
        c = cluster
        self.needs(steps, "slice")
        n = "bad-mode"
        create_claim(c, claim_doc(n, "1Gi", {"gpu-compute.mode": "fast"}))
        c.api().create_namespaced_pod("default", sleeper(n, [{"name": "gpu", "resourceClaimName": n}]))
        ev = wait(c, lambda: prepare_refused(c, n, BAD_MODE_RULE), 120,
                  f"a Warning event of pod {n} carrying {BAD_MODE_RULE!r}", ns="default")
        with diagnosed(c, f"pod {n} container app: events {pod_events(c, n)}"):
            p = c.api().read_namespaced_pod(n, "default")
            assert p.status.phase == "Pending" and not any(s.state.running for s in p.status.container_statuses or []), \
                p.status
            assert allocated_devices(claim(c, n)), "the scheduler allocated the claim; Prepare refused it"
        print(f"bad parameters: {ev[0]}")
        delete_pods(c, [n])
        delete_claims(c, [n])
        steps[self.key("bad")] = ev[0]

    # ---- 5 ------------------------------------------------------------------------
    def test_5_deleted_pod_claim_is_unprepared_and_freed(self, cluster, steps):
        c = cluster
        got = self.needs(steps, "readme")
        delete_pods(c, [got["pod"]])
        wait(c, lambda: not cdi_spec(c, got["uid"]).exists(), 60,
             f"the CDI spec of claim {got['uid']} (pod {got['pod']}) removed", ns="default")
        wait(c, lambda: held_mib(c).get(got["gpu"], 0) == 0, 60,
             f"GPU {got['gpu']}'s memory freed after pod {got['pod']} was deleted", ns="default")
        # the claim generated from the template goes with its pod (resourceclaim controller)
        wait(c, lambda: not [x for x in custom(c).list_namespaced_custom_object(
            GROUP, VERSION, "default", "resourceclaims")["items"]
            if x["metadata"]["uid"] == got["uid"]], 60, f"claim {got['uid']} deleted", ns="default")
        steps[self.key("unprepared")] = True

    # ---- 6 ------------------------------------------------------------------------
    def test_6_device_plugin_and_dra_doors_never_overcommit_a_gpu(self, cluster, steps):
        c = cluster
        self.needs(steps, "slice")
        # most of one GPU through the device plugin door (1 GiB devices)
        fill = capacity_mib(gpus()[0]) // GIB_MIB - 10
        c.api().create_namespaced_pod("default", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dp-fill", "namespace": "default"},
            "spec": {"automountServiceAccountToken": False, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "app", "image": k.h.IMAGE, "imagePullPolicy": "Never",
                                     "command": ["/bin/sleep", "3600"],
                                     "resources": {"limits": {k.RESOURCE: str(fill)}}}]}})
        p = running_pod(c, "dp-fill")
        with diagnosed(c, "pod dp-fill container app (device plugin door)"):
            uuid = container_env(c, container_id(p, "app")).get("NVIDIA_VISIBLE_DEVICES", "")
            g = next(x for x in gpus() if x["uuid"] == uuid)
            free = int(g["memory_mib"]) - fill * GIB_MIB  # the ledger counts the GPU's whole memory
        n = "dra-over"
        create_claim(c, claim_doc(n, "20Gi", selector=f'device.attributes["{DRIVER}"].uuid == "{uuid}"'))
        c.api().create_namespaced_pod("default", sleeper(n, [{"name": "gpu", "resourceClaimName": n}]))
        # the memory guard of all three doors (ledger.admission_problem), as README and explain say it
        rule = f"has {free} MiB of {g['memory_mib']} MiB free; this container requests {20 * GIB_MIB} MiB"
        ev = wait(c, lambda: prepare_refused(c, n, rule), 120,
                  f"a Warning event of pod {n} refusing 20Gi on GPU {uuid} ({free} MiB left by pod dp-fill)",
                  ns="default")
        with diagnosed(c, f"pod {n} container app: events {pod_events(c, n)}"):
            assert uuid in ev[0], ev
            res = allocated_devices(claim(c, n))
            assert res and gpu_of_device(res[0]["device"])["uuid"] == uuid, res  # the scheduler said yes
            held = held_mib(c)
            assert held.get(uuid, 0) == fill * GIB_MIB, held  # the claim holds nothing
            assert not cdi_spec(c, claim(c, n)["metadata"]["uid"]).exists()
        print(f"device plugin + DRA on {uuid}: {ev[0]}")
        delete_pods(c, ["dp-fill", n])
        delete_claims(c, [n])
        steps[self.key("doors")] = ev[0]

    # ---- 6a -----------------------------------------------------------------------
    def test_6a_per_mode_classes_place_the_other_mode_on_another_gpu(self, cluster, steps):
        c = cluster
        self.needs(steps, "slice")
        sm, ts = "mode-sm", "mode-ts"
        # no parameters: each class's config sets the mode (the door reads FromClass configs)
        create_claim(c, claim_doc(sm, "10Gi", device_class=MODE_CLASSES["sm-sharing"]))
        c.api().create_namespaced_pod("default", sleeper(sm, [{"name": "gpu", "resourceClaimName": sm}]))
        running_pod(c, sm)
        with diagnosed(c, f"pod {sm} container app: events {pod_events(c, sm)}"):
            (r,) = allocated_devices(claim(c, sm))
            sm_gpu = gpu_of_device(r["device"])["uuid"]
        # the slice tells the scheduler before the second claim exists (the door republishes on the hold)
        wait(c, lambda: compute_modes(c).get(sm_gpu) == "sm-sharing", 60,
             f"computeMode sm-sharing published for GPU {sm_gpu} (claim {sm})", ns="default")
        # the real cluster put a time-slicing claim through gpu-memory.fracplugin.io on this very GPU (the
        # allocator does not see compute modes) and Prepare refused it forever; through its class it goes elsewhere
        create_claim(c, claim_doc(ts, "10Gi", device_class=MODE_CLASSES["time-slicing"]))
        c.api().create_namespaced_pod("default", sleeper(ts, [{"name": "gpu", "resourceClaimName": ts}]))
        p = running_pod(c, ts)
        with diagnosed(c, f"pod {ts} container app: events {pod_events(c, ts)}; modes {compute_modes(c)}"):
            (r,) = allocated_devices(claim(c, ts))
            ts_gpu = gpu_of_device(r["device"])["uuid"]
            assert ts_gpu != sm_gpu, (ts_gpu, sm_gpu)
            assert container_env(c, container_id(p, "app")).get("NVIDIA_VISIBLE_DEVICES") == ts_gpu
            assert not prepare_refused(c, ts, "one compute mode per GPU"), pod_events(c, ts)
        wait(c, lambda: compute_modes(c).get(ts_gpu) == "time-slicing", 60,
             f"computeMode time-slicing published for GPU {ts_gpu} (claim {ts})", ns="default")
        print(f"per-mode classes: sm-sharing on {sm_gpu}, time-slicing on {ts_gpu}")
        delete_pods(c, [sm, ts])
        delete_claims(c, [sm, ts])
        wait(c, lambda: compute_modes(c).get(sm_gpu) == compute_modes(c).get(ts_gpu) == "none", 60,
             f"computeMode none again on GPUs {sm_gpu} and {ts_gpu}", ns="default")
        steps[self.key("modes")] = {"sm-sharing": sm_gpu, "time-slicing": ts_gpu}

    # ---- 7 ------------------------------------------------------------------------
    def test_7_readme_uninstall_deletes_the_resource_slice(self, cluster, helm, kubectl, steps):
        c = cluster
        self.needs(steps, "install")
        api = custom(c)
        left = [x["metadata"]["name"] for x in api.list_namespaced_custom_object(
            GROUP, VERSION, "default", "resourceclaims")["items"]]
        if left:
            delete_pods(c, [p.metadata.name for p in pods_of(c, "default")])
            delete_claims(c, left)
        for t in api.list_namespaced_custom_object(GROUP, VERSION, "default", "resourceclaimtemplates")["items"]:
            api.delete_namespaced_custom_object(GROUP, VERSION, "default", "resourceclaimtemplates",
                                                t["metadata"]["name"])
        with diagnosed(c, "the ResourceSlice before uninstall"):
            # written on change only: the empty first write, the four GPUs, then each GPU's computeMode as
            # holds come and go (steps 2, 3, 6 and 6a take 7 holds; each may change its GPU's mode when taken
            # and when freed, a device plugin reservation once more when bound) - no rewrite loop over what
            # the API server stored, which would add one generation per poll (5 s) over the whole run
            holds = 7
            gen = [s["spec"]["pool"]["generation"] for s in resource_slices(c)]
            print(f"dra: ResourceSlice pool generation {gen} before uninstall")
            assert gen and gen[0] <= 2 + 3 * holds, gen
        self.uninstall(c, helm, kubectl, steps)
        wait(c, lambda: not resource_slices(c), 60, f"the ResourceSlice of {DRIVER} deleted at uninstall")
        with diagnosed(c, "after README's uninstall with dra.enabled"):
            reg = k.KUBELET_ROOT / "plugins_registry"
            ours = [p.name for p in reg.iterdir() if DRIVER in p.name] if reg.exists() else []
            assert not ours, f"left in {reg}: {ours}"
            specs = [p.name for p in (c.base / "cdi").glob(f"{DRIVER}-claim_*")]
            assert not specs, f"claim CDI specs left: {specs}"
        print("dra uninstall: no ResourceSlice, plugin socket or claim CDI spec left")
