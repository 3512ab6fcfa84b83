"""The shipped install run for real (issue 24): the image from ``make image``
and the Helm chart, installed as README says on a one-node cluster with
kube-controller-manager, kube-scheduler, kubelet and containerd (CNI), layout
``split`` with scheduler ``default`` (the chart's defaults), then ``kai``. In order:

1. ``helm install`` (namespace created and labelled as README says); every
   DaemonSet rolls out (numberReady == desiredNumberScheduled, polled through
   the API) under the chart's exact securityContext, hostPaths, probes,
   ServiceAccount and RBAC; no ``Forbidden`` in the daemon logs; the node
   conditions are written (by the doors' ServiceAccount: the test never
   writes them); README's ``fracplugin status`` answers in the doors pod;
2. a pod requesting ``fracplugin.io/gpu-memory`` without ``nodeName``:
   placed by kube-scheduler, admitted by kubelet through the device plugin
   door, adjusted through the NRI door; its env and the pipe-directory mount
   are what README says;
3. ``/metrics`` scraped from the host at the doors pod's IP (outside the
   pod's network namespace, as Prometheus would) carries that pod;
4. ``helm upgrade`` with a changed value rolls the doors; the
   ``fracplugin-mps`` pod keeps its UID and restart count, the fractional
   pod keeps running;
5. README's uninstall (``fracplugin mps-quit`` in the MPS pod, the
   DaemonSets deleted with foreground cascading, then ``helm uninstall``):
   no fracplugin or MPS process, no socket of ours in the device
   plugin directory, none in the NRI socket directory, no node condition left
   True (they are ``Unknown``/``ShuttingDown``, the daemon's last word);
6. ``helm install --set scheduler=kai``: only the NRI door (no device plugin
   socket); a pod bound as KAI's binder binds it (``nodeName`` and the
   ``nvidia.com/container.*`` annotations) gets the env and pipe mount through
   NRI; README's uninstall again.

Each step needs the previous one; a failed step fails the later ones with
its name rather than with a confusing second failure.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import fullcluster as fc
from conftest import (NAMESPACE, RELEASE, CHART, container_id, crictl_json, daemonsets, diagnose,
                      ds_rolled_out, pod_logs, pods_of, wait)

k = fc.k
pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(900)]

CONDITIONS = ("gpu-fractioning.nvidia.com/Ready", "gpu-sharing.nvidia.com/Ready")  # values nodeConditionTypes
DOORS_SEL = "app.kubernetes.io/component=node-daemon"
MPS_SEL = "app.kubernetes.io/component=mps"
ANN = "nvidia.com/container.app."
STATE: dict[str, Any] = {}
ROLLOUT_S = 300


def needs(step: str) -> None:
    if step not in STATE:
        pytest.fail(f"step '{step}' did not pass; this one depends on it", pytrace=False)


def only_pod(c: fc.FullCluster, selector: str) -> Any:
    ps = [p for p in pods_of(c, selector=selector) if p.metadata.deletion_timestamp is None]
    assert len(ps) == 1, [p.metadata.name for p in ps]
    return ps[0]


def forbidden_lines(c: fc.FullCluster) -> list[str]:
    out = []
    for p in pods_of(c):
        for s in p.status.container_statuses or []:
            out += [f"{p.metadata.name}/{s.name}: {ln}" for ln in pod_logs(c, p, s.name).splitlines()
                    if re.search("forbidden", ln, re.I)]
    return out


def node_conditions(c: fc.FullCluster) -> dict[str, Any]:
    return {x.type: x for x in c.node().status.conditions or ()}


def test_1_helm_install_rolls_out(cluster, helm):
    c = cluster
    from kubernetes import client

    # what GPU feature discovery / the GPU Operator labels a GPU node with (the chart's nodeSelector)
    c.api().patch_node(k.NODE, {"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}})
    # README: kubectl create namespace + kubectl label namespace ... enforce=privileged
    c.api().create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=NAMESPACE, labels={"pod-security.kubernetes.io/enforce": "privileged"})))
    t0 = time.monotonic()
    helm("install", RELEASE, str(CHART), "-n", NAMESPACE, *helm.values_args())
    wait(c, lambda: len(daemonsets(c)) == 2 and all(ds_rolled_out(d) for d in daemonsets(c)), ROLLOUT_S,
         "both DaemonSets rolled out (numberReady == desiredNumberScheduled)")
    STATE["rollout_s"] = round(time.monotonic() - t0, 1)
    print(f"install: both DaemonSets ready {STATE['rollout_s']} s after helm install")
    assert sorted(d.metadata.name for d in daemonsets(c)) == ["fracplugin", "fracplugin-mps"]
    doors, mps = only_pod(c, DOORS_SEL), only_pod(c, MPS_SEL)
    assert doors.spec.node_name == mps.spec.node_name == k.NODE
    assert not doors.spec.host_network and doors.status.pod_ip.startswith("10.244.77."), doors.status.pod_ip
    # the node conditions the doors publish with their own ServiceAccount token
    wait(c, lambda: all(t in node_conditions(c) and node_conditions(c)[t].status == "True" for t in CONDITIONS),
         60, f"node conditions {CONDITIONS} True")
    bad = forbidden_lines(c)
    assert not bad, "the API server refused the daemon (RBAC too narrow?):\n" + "\n".join(bad) + "\n" + diagnose(c)
    # README / NOTES.txt: kubectl exec ds/fracplugin -- fracplugin status
    st = c.ctrd.crictl("exec", container_id(doors, "fracplugin"), "fracplugin", "status", check=False)
    assert st.returncode == 0 and "ready" in st.stdout.lower(), st.stdout + st.stderr
    STATE["install"] = {"doors": doors.metadata.uid, "mps": mps.metadata.uid}


def _advertised(c: fc.FullCluster) -> int:
    import yaml

    node = yaml.safe_load((fc.REPO / "examples" / "nodes" / "gpu-node-1.yaml").read_text())
    n = sum(int(g["memory_mib"]) // 1024 for g in node["gpus"])
    wait(c, lambda: c.capacity() == (n, n), 90, f"{k.RESOURCE} capacity = allocatable = {n}")
    return n


def test_2_scheduled_pod_goes_through_both_doors(cluster):
    needs("install")
    c = cluster
    _advertised(c)
    # the ServiceAccount admission plugin needs the namespace's default ServiceAccount (controller-manager)
    wait(c, lambda: c.api().read_namespaced_service_account("default", "default"), 60,
         "ServiceAccount default/default", ns="default")
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "frac", "namespace": "default",
                             "annotations": {ANN + "gpu-memory.limit": "6Gi"}},
                "spec": {"automountServiceAccountToken": False, "restartPolicy": "Never",
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "app", "image": k.h.IMAGE, "imagePullPolicy": "Never",
                                         "command": ["/bin/sleep", "3600"],
                                         "resources": {"limits": {k.RESOURCE: "4"}}}]}}
    c.api().create_namespaced_pod("default", manifest)

    def running() -> Any:
        p = c.api().read_namespaced_pod("frac", "default")
        if p.status.phase == "Failed":
            raise k.HarnessError(f"pod frac failed: {p.status.reason}: {p.status.message}")
        cs = p.status.container_statuses or []
        return p if cs and cs[0].state.running else None
    p = wait(c, running, 120, "pod frac running", ns="default")
    assert p.spec.node_name == k.NODE  # bound by kube-scheduler: the manifest names no node

    def scheduled() -> list[str]:
        return [f"{e.source.component if e.source else ''} {e.reporting_component or ''}"
                for e in c.api().list_namespaced_event("default").items
                if e.involved_object.name == "frac" and e.reason == "Scheduled"]
    by = wait(c, scheduled, 30, "the Scheduled event of pod frac", ns="default")
    assert "default-scheduler" in by[0], by
    cid = container_id(p, "app")
    out = c.ctrd.crictl("exec", cid, "env").stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    gpus = [line.split(":", 1)[1].strip() for line in
            (fc.REPO / "examples" / "nodes" / "gpu-node-1.yaml").read_text().splitlines() if "uuid:" in line]
    # README "What a fractional container gets": one GPU, request = 4 devices x 1 GiB, the annotated limit
    assert env.get("NVIDIA_VISIBLE_DEVICES") in gpus, env
    assert env.get("CUDA_VISIBLE_DEVICES") == env["NVIDIA_VISIBLE_DEVICES"], env
    assert env.get("NVIDIA_GPU_MEMORY_REQUEST") == "4096", env
    assert env.get("NVIDIA_GPU_MEMORY_LIMIT") == "6144", env
    assert env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == "0=6144M", env
    assert env.get("CUDA_MPS_PIPE_DIRECTORY") == "/tmp/nvidia-mps", env
    # the pipe directory: a read-only bind of the host's <mpsRoot>/<mode>/... directory at /tmp/nvidia-mps
    info = crictl_json(c, "inspect", cid)
    mounts = info.get("info", {}).get("runtimeSpec", {}).get("mounts", [])  # the OCI spec runc got
    pipe = [m for m in mounts if m.get("destination") == "/tmp/nvidia-mps"]
    mps_root = str(c.base / "run" / "mps") + "/"
    assert len(pipe) == 1 and pipe[0]["source"].startswith(mps_root) and "ro" in pipe[0].get("options", []), mounts
    mountinfo = c.ctrd.crictl("exec", cid, "cat", "/proc/self/mountinfo").stdout
    fields = [ln.split() for ln in mountinfo.splitlines() if len(ln.split()) > 5 and ln.split()[4] == "/tmp/nvidia-mps"]
    assert fields and "ro" in fields[0][5].split(","), mountinfo
    assert "control" in c.ctrd.crictl("exec", cid, "ls", "/tmp/nvidia-mps").stdout
    STATE["pod"] = {"cid": cid, "gpu": env["NVIDIA_VISIBLE_DEVICES"], "uid": p.metadata.uid}


def test_3_metrics_scraped_from_the_host_at_the_pod_ip(cluster):
    needs("pod")
    c = cluster
    doors = only_pod(c, DOORS_SEL)
    port = next(p.container_port for p in doors.spec.containers[0].ports if p.name == "metrics")
    assert doors.metadata.annotations.get("prometheus.io/port") == str(port)
    url = f"http://{doors.status.pod_ip}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    series = [ln for ln in text.splitlines() if ln.startswith("fracplugin_container_gpu_memory_request_bytes{")]
    frac = [ln for ln in series if 'pod="frac"' in ln]
    assert frac and frac[0].endswith(f" {4096 * 1024 * 1024}.0"), series
    STATE["metrics"] = True


def test_4_helm_upgrade_rolls_the_doors_not_mps(cluster, helm):
    needs("pod")
    c = cluster
    doors0, mps0 = only_pod(c, DOORS_SEL), only_pod(c, MPS_SEL)
    restarts0 = mps0.status.container_statuses[0].restart_count
    helm("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *helm.values_args("--set", "log.level=debug"))

    def rolled() -> bool:
        ds = c.apps().read_namespaced_daemon_set("fracplugin", NAMESPACE)
        ps = [p for p in pods_of(c, selector=DOORS_SEL)]
        return ds_rolled_out(ds) and len(ps) == 1 and ps[0].metadata.uid != doors0.metadata.uid
    wait(c, rolled, ROLLOUT_S, "the doors DaemonSet rolled to a new pod")
    mps = only_pod(c, MPS_SEL)
    assert mps.metadata.uid == mps0.metadata.uid, "helm upgrade replaced the fracplugin-mps pod"
    assert mps.status.container_statuses[0].restart_count == restarts0, "the MPS container restarted"
    p = c.api().read_namespaced_pod("frac", "default")
    assert p.status.phase == "Running" and container_id(p, "app") == STATE["pod"]["cid"]
    # the OnDelete DaemonSet saw the new template but kept its pod
    def mps_observed() -> Any:
        d = c.apps().read_namespaced_daemon_set("fracplugin-mps", NAMESPACE)
        return d if (d.status.observed_generation or 0) >= d.metadata.generation else None
    mds = wait(c, mps_observed, 60, "fracplugin-mps DaemonSet observed the upgrade")
    assert (mds.status.updated_number_scheduled or 0) == 0 and mds.status.number_ready == 1
    bad = forbidden_lines(c)
    assert not bad, "\n".join(bad)
    STATE["upgrade"] = True


def _our_processes() -> list[str]:
    """Processes of the install in the host PID namespace: the fake MPS
    binaries mounted at /opt/fracplugin-test (values-sim.yaml), or the
    image's fracplugin in a pod of this cluster (kubelet's
    KUBERNETES_SERVICE_HOST in its environment: other sessions' daemons on
    this machine do not count)."""
    out = []
    for ent in os.listdir("/proc"):
        if not ent.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{ent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not re.search(r"/opt/venv/bin/fracplugin|/opt/fracplugin-test/", cmd):
                continue
            env = Path(f"/proc/{ent}/environ").read_bytes()
        except OSError:
            continue
        if "/opt/fracplugin-test/" in cmd or f"KUBERNETES_SERVICE_HOST={fc.SERVICE_IP}".encode() in env:
            out.append(f"{ent}: {cmd}")
    return out


def test_5_uninstall_leaves_nothing(cluster, helm):
    needs("install")
    c = cluster
    from kubernetes.client import V1DeleteOptions

    try:
        c.api().delete_namespaced_pod("frac", "default", body=V1DeleteOptions(grace_period_seconds=0))
    except Exception:  # noqa: BLE001 - step 2 may not have created it
        pass
    wait(c, lambda: not [p for p in pods_of(c, "default")], 60, "pod frac deleted", ns="default")
    # README: kubectl -n fracplugin-system exec <fracplugin-mps pod> -- fracplugin mps-quit, then helm uninstall
    mps = only_pod(c, MPS_SEL)
    q = c.ctrd.crictl("exec", container_id(mps, "mps"), "fracplugin", "mps-quit", check=False)
    assert q.returncode == 0, f"fracplugin mps-quit: {q.stdout}{q.stderr}\n{diagnose(c)}"
    # README: kubectl -n fracplugin-system delete daemonset fracplugin fracplugin-mps --cascade=foreground
    # (the pods end while their RBAC exists, so their last node-condition patch is allowed)
    for name in ("fracplugin", "fracplugin-mps"):
        c.apps().delete_namespaced_daemon_set(name, NAMESPACE, propagation_policy="Foreground")
    wait(c, lambda: not daemonsets(c) and not pods_of(c), 120, "both DaemonSets and their pods deleted (foreground)")
    helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
    wait(c, lambda: not pods_of(c), 120, "every fracplugin pod gone")
    wait(c, lambda: not _our_processes(), 60, "no fracplugin or MPS process on the host")
    ours = [p.name for p in k.DEVICE_PLUGIN_DIR.iterdir() if p.name.startswith("fracplugin")]
    assert not ours, f"left in {k.DEVICE_PLUGIN_DIR}: {ours}"
    nri_dir = c.ctrd.nri_sock.parent
    left = [p.name for p in nri_dir.iterdir() if p.name != "nri.sock" and p.is_socket()]
    assert not left, f"left in {nri_dir}: {left}"
    conds = node_conditions(c)
    still = {t: conds[t].status for t in CONDITIONS if t in conds and conds[t].status == "True"}
    assert not still, f"node conditions left True after uninstall: {still}"
    # the doors' last word (ADR 0005), written while their RBAC still existed
    assert all(conds[t].status == "Unknown" and conds[t].reason == "ShuttingDown" for t in CONDITIONS), \
        {t: (conds[t].status, conds[t].reason) for t in CONDITIONS if t in conds}
    mps_root = c.base / "run" / "mps"
    socks = [str(p) for p in mps_root.rglob("*") if p.is_socket()] if mps_root.exists() else []
    assert not socks, f"MPS sockets left: {socks}"
    STATE["uninstall"] = {t: (conds[t].status, conds[t].reason) for t in CONDITIONS if t in conds}
    print(f"after uninstall: node conditions {STATE['uninstall']}")


def test_6_kai_scheduler_install_goes_through_the_nri_door(cluster, helm):
    """``scheduler: kai`` (split layout): only the NRI door runs (no device
    plugin socket). A pod bound the way KAI's binder binds it (``nodeName``
    and the ``nvidia.com/container.*`` annotations, no extended resource) gets
    README's env and pipe mount through NRI; then README's uninstall again."""
    needs("uninstall")
    c = cluster
    helm("install", RELEASE, str(CHART), "-n", NAMESPACE, *helm.values_args("--set", "scheduler=kai"))
    wait(c, lambda: len(daemonsets(c)) == 2 and all(ds_rolled_out(d) for d in daemonsets(c)), ROLLOUT_S,
         "both DaemonSets rolled out (scheduler=kai)")
    wait(c, lambda: all(node_conditions(c)[t].status == "True" for t in CONDITIONS), 60,
         f"node conditions {CONDITIONS} True again")
    assert not [p.name for p in k.DEVICE_PLUGIN_DIR.iterdir() if p.name.startswith("fracplugin")]
    gpu = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a02"
    ann = {ANN + "gpu-memory.request": "4Gi", ANN + "gpu-memory.limit": "6Gi",
           ANN + "gpu-compute.mode": "sm-sharing", ANN + "gpu-compute.portion": "0.5",
           ANN + "gpus.devices": gpu, "gpu-fraction-num-devices": "1"}
    c.api().create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kai", "namespace": "default", "annotations": ann},
        "spec": {"nodeName": k.NODE, "automountServiceAccountToken": False, "restartPolicy": "Never",
                 "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "app", "image": k.h.IMAGE, "imagePullPolicy": "Never",
                                 "command": ["/bin/sleep", "3600"]}]}})

    def running() -> Any:
        p = c.api().read_namespaced_pod("kai", "default")
        if p.status.phase == "Failed":
            raise k.HarnessError(f"pod kai failed: {p.status.reason}: {p.status.message}")
        cs = p.status.container_statuses or []
        return p if cs and cs[0].state.running else None
    p = wait(c, running, 120, "pod kai running", ns="default")
    cid = container_id(p, "app")
    out = c.ctrd.crictl("exec", cid, "env").stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env.get("NVIDIA_VISIBLE_DEVICES") == gpu, env
    assert (env.get("NVIDIA_GPU_MEMORY_REQUEST"), env.get("NVIDIA_GPU_MEMORY_LIMIT")) == ("4096", "6144"), env
    assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "50", env
    assert env.get("CUDA_MPS_PIPE_DIRECTORY") == "/tmp/nvidia-mps", env
    assert "control" in c.ctrd.crictl("exec", cid, "ls", "/tmp/nvidia-mps").stdout
    from kubernetes.client import V1DeleteOptions

    c.api().delete_namespaced_pod("kai", "default", body=V1DeleteOptions(grace_period_seconds=0))
    wait(c, lambda: not pods_of(c, "default"), 60, "pod kai deleted", ns="default")
    mps = only_pod(c, MPS_SEL)
    assert c.ctrd.crictl("exec", container_id(mps, "mps"), "fracplugin", "mps-quit", check=False).returncode == 0
    for name in ("fracplugin", "fracplugin-mps"):
        c.apps().delete_namespaced_daemon_set(name, NAMESPACE, propagation_policy="Foreground")
    wait(c, lambda: not daemonsets(c) and not pods_of(c), 120, "both DaemonSets and their pods deleted (foreground)")
    helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
    wait(c, lambda: not _our_processes(), 60, "no fracplugin or MPS process on the host")
    assert all(node_conditions(c)[t].status == "Unknown" for t in CONDITIONS)
