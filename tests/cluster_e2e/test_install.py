"""The shipped install run for real (issue 24): the image from ``make image``
and the Helm chart, installed with README's own commands (read from README.md:
readme.py) on a one-node cluster with kube-controller-manager, kube-scheduler,
kubelet and containerd (CNI), on each Kubernetes line of
``$FRACPLUGIN_KUBE_VERSIONS``. Three installs per line, one after the other,
each a class of the same scenario steps (``Scenarios``) with its layout and
scheduler:

- ``TestSplit`` (layout ``split``, scheduler ``default``: the chart's defaults);
- ``TestSingle`` (``--set layout=single``);
- ``TestSplitKai`` (``--set scheduler=kai``).

The steps:

1. install: README's install block (namespace created and labelled, ``helm
   install`` with the test-only values files added, ``fracplugin status`` in
   the daemon pod); every DaemonSet rolls out (numberReady ==
   desiredNumberScheduled, polled through the API) under the chart's exact
   securityContext, hostPaths, probes, ServiceAccount and RBAC; no
   ``Forbidden`` in the daemon logs; the node conditions are True, and the
   API server's audit log shows a successful ``nodes/status`` patch of the
   node by the chart's ServiceAccount (``system:serviceaccount:<namespace>:<the
   rendered ServiceAccount's name>``) from the doors pod (the token's
   ``authentication.kubernetes.io/pod-name``), and no writer of the node's
   status but it, kubelet and kube-controller-manager's controllers (the
   test's admin never);
2. a pod requesting ``fracplugin.io/gpu-memory`` without ``nodeName``:
   placed by kube-scheduler, admitted by kubelet through the device plugin
   door, adjusted through the NRI door; its env and the pipe-directory mount
   are what README says (scheduler ``kai``: a pod bound as KAI's binder binds
   it, through the NRI door only);
3. ``/metrics`` scraped from the host at the daemon pod's IP (outside the
   pod's network namespace, as Prometheus would) carries that pod;
4. (split) README's ``helm upgrade`` to a new image tag (the same archive
   under a second tag) while a long-running MPS client started before it (the
   fractional container's process, registered with the fake MPS daemon in
   that container's MPS namespace) keeps its MPS server PID and namespace;
   the doors roll to the new image; the ``fracplugin-mps`` pod keeps its UID
   and restart count;
4b, 4c. (split, default) a GPU Operator driver upgrade as it reaches our pods:
   the node label ``nvidia.com/gpu-driver-upgrade-state=pod-deletion-required``
   (4b; then ``upgrade-done``) or ``nvidia.com/gpu.deploy.client=paused-for-driver-upgrade``
   (4c; then ``true``) set through the API: the DaemonSet controller deletes
   both pods (chart affinity ``gpuOperator.driverUpgrade``), the MPS role quits
   its MPS daemons on purpose before its container ends (its log; each fake
   control daemon's own ``quit``), no fracplugin or MPS process is left, the
   node conditions are not True; with the label back both pods are Ready with
   new MPS daemons and the conditions True again. The labels stay in their
   "done" values, as on a GPU Operator node;
5. README's uninstall block for the layout: no pod, no fracplugin or MPS
   process, no socket of ours in the device plugin directory, the NRI socket
   directory or the MPS root, no node condition left True (they are
   ``Unknown``/``ShuttingDown``, the daemon's last word); then the namespace
   is deleted so the next install starts from README's first line.

Each step needs the previous one of its install; a failed step fails the
later ones with its name rather than with a confusing second failure, and the
next install first removes whatever a failed one left. Every failure carries
``diagnose_all``: each pod's containers, their states and logs, the events.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

import fullcluster as fc
import readme
from conftest import (NAMESPACE, LogFollower, container_id, crictl_json, daemonsets, diagnose_all, diagnosed,
                      ds_rolled_out, pod_logs, pods_of, wait)

k = fc.k
pytestmark = [pytest.mark.cluster_e2e, pytest.mark.timeout(900)]

CONDITIONS = ("gpu-fractioning.nvidia.com/Ready", "gpu-sharing.nvidia.com/Ready")  # values nodeConditionTypes
DOORS_SEL = "app.kubernetes.io/component=node-daemon"
MPS_SEL = "app.kubernetes.io/component=mps"
ANN = "nvidia.com/container.app."
ROLLOUT_S = 300
RELEASE_NAME = "fracplugin"  # README's release name
FAKE_MPS = fc.REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
NODE_FILE = fc.REPO / "examples" / "nodes" / "gpu-node-1.yaml"


def only_pod(c: fc.FullCluster, selector: str) -> Any:
    ps = [p for p in pods_of(c, selector=selector) if p.metadata.deletion_timestamp is None]
    assert len(ps) == 1, f"pods {selector}: {[p.metadata.name for p in ps]}"
    return ps[0]


def forbidden_lines(c: fc.FullCluster) -> list[str]:
    out = []
    for p in pods_of(c):
        for s in p.status.container_statuses or []:
            out += [f"pod {p.metadata.name} container {s.name}: {ln}" for ln in pod_logs(c, p, s.name).splitlines()
                    if re.search("forbidden", ln, re.I)]
    return out


def node_conditions(c: fc.FullCluster) -> dict[str, Any]:
    return {x.type: x for x in c.node().status.conditions or ()}


def running_pod(c: fc.FullCluster, name: str) -> Any:
    """Wait until pod ``name`` (namespace default) runs its container."""
    def running() -> Any:
        p = c.api().read_namespaced_pod(name, "default")
        if p.status.phase == "Failed":
            raise k.HarnessError(f"pod {name} failed: {p.status.reason}: {p.status.message}")
        cs = p.status.container_statuses or []
        return p if cs and cs[0].state.running else None
    return wait(c, running, 120, f"pod {name} running", ns="default")


def container_env(c: fc.FullCluster, cid: str) -> dict[str, str]:
    out = c.ctrd.crictl("exec", cid, "env").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


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


# ---- the fake MPS daemon, asked from the host (its pipe directories are host paths) ----
def mps_ctl(mode_dir: Path, *args: str) -> list[list[str]]:
    """Run the fake ``nvidia-cuda-mps-control`` client against the control
    daemon of ``mode_dir`` (as root, like the daemon); CSV rows of its answer.
    Raises HarnessError on a non-zero exit."""
    cp = subprocess.run([sys.executable, str(FAKE_MPS), *args], capture_output=True, text=True, timeout=30,
                        env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(mode_dir)))
    if cp.returncode != 0:
        raise k.HarnessError(f"fake MPS control {' '.join(args)} in {mode_dir}: exit {cp.returncode}: "
                             f"{cp.stdout}{cp.stderr}")
    return [r for r in csv.reader(cp.stdout.splitlines()) if r]


def mps_daemon_dir(pipe: Path) -> Path:
    """The MPS control daemon directory above a pipe directory: the first
    parent holding ``control`` and the daemon's pid file."""
    for d in pipe.parents:
        if (d / "control").exists() and (d / "nvidia-cuda-mps-control.pid").exists():
            return d
    raise k.HarnessError(f"no MPS control daemon directory above {pipe}")


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- who writes the node conditions: the API server's audit log (fullcluster.AUDIT_POLICY) ----
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"  # a bound ServiceAccount token's pod, in user.extra
# kube-controller-manager's controllers (--use-service-account-credentials): the node lifecycle controller
# marks a silent kubelet's node Unknown, the attach/detach controller writes volumesAttached
CONTROLLERS = "system:serviceaccount:kube-system:"


def status_writes(c: fc.FullCluster) -> list[dict[str, Any]]:
    """The audit log's completed writes (patch/update) of our node's
    ``nodes/status``, oldest first."""
    return [e for e in c.audit_events() if e.get("stage") == "ResponseComplete"
            and e.get("verb") in ("patch", "update")
            and (e.get("objectRef") or {}).get("resource") == "nodes"
            and (e.get("objectRef") or {}).get("subresource") == "status"
            and (e.get("objectRef") or {}).get("name") == k.NODE]


def writers(events: list[dict[str, Any]]) -> dict[str, str]:
    """user -> a summary of its writes (count, verbs, pods of its token,
    response codes), for failure messages that show what was seen."""
    by: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by.setdefault(str((e.get("user") or {}).get("username")), []).append(e)

    def pods(e: dict[str, Any]) -> list[str]:
        return list(((e.get("user") or {}).get("extra") or {}).get(POD_NAME_EXTRA) or [])
    return {u: (f"{len(es)} writes, verbs {sorted({str(e.get('verb')) for e in es})}, "
                f"pods {sorted({p for e in es for p in pods(e)})}, "
                f"codes {sorted({str((e.get('responseStatus') or {}).get('code')) for e in es})}")
            for u, es in by.items()}


def chart_service_account(helm: Any) -> str:
    """The ServiceAccount name of the release as rendered (``helm get
    manifest``: the chart's ``fracplugin.serviceAccountName`` helper)."""
    docs = [d for d in yaml.safe_load_all(helm("get", "manifest", RELEASE_NAME, "-n", NAMESPACE).stdout) if d]
    names = [d["metadata"]["name"] for d in docs if d.get("kind") == "ServiceAccount"]
    assert len(names) == 1, f"the release renders {len(names)} ServiceAccounts: {names}"
    return str(names[0])


def assert_conditions_written_by(c: fc.FullCluster, user: str, pod: str) -> None:
    """The audit log has a successful nodes/status write of our node by
    ``user`` (the daemon's ServiceAccount) from pod ``pod`` (when the event
    records the token's pod), and nobody but that ServiceAccount, kubelet and
    kube-controller-manager's controllers writes our node's status (the
    admin, the test's identity, never does). At level Metadata the log names
    the writer, not the patched condition types."""
    kubelet = fc.TOKENS["kubelet"][1]

    def by_daemon() -> list[dict[str, Any]]:
        return [e for e in status_writes(c) if (e.get("user") or {}).get("username") == user
                and pod in ((e["user"].get("extra") or {}).get(POD_NAME_EXTRA) or [pod])
                and 200 <= int((e.get("responseStatus") or {}).get("code") or 0) < 300]
    try:
        k.wait_for(by_daemon, 30, f"an audited nodes/status write by {user}", interval=0.5)
    except k.HarnessError:
        pytest.fail(f"expected a successful patch of nodes/status {k.NODE} by {user} from pod {pod} in the "
                    f"audit log {c.audit_log}; writers seen: {writers(status_writes(c)) or 'none'}\n"
                    f"{diagnose_all(c)}", pytrace=False)
    others = {u: w for u, w in writers(status_writes(c)).items()
              if u not in (user, kubelet) and not u.startswith(CONTROLLERS)}
    assert not others, (f"expected nodes/status of {k.NODE} written only by the daemon's ServiceAccount {user}, "
                        f"kubelet {kubelet} and controllers {CONTROLLERS}*; also seen: {others}")
    seen = writers(by_daemon())[user]
    print(f"node conditions written by {user}: {seen}")


class Scenarios:
    """The steps of one install (layout ``LAYOUT``, scheduler ``SCHEDULER``);
    each concrete class lists the steps it runs, in order, as its tests."""

    LAYOUT = "split"
    SCHEDULER = "default"

    @property
    def daemonsets(self) -> list[str]:
        return ["fracplugin", "fracplugin-mps"] if self.LAYOUT == "split" else ["fracplugin"]

    def key(self, step: str) -> str:
        return f"{self.LAYOUT}/{self.SCHEDULER}/{step}"

    def needs(self, steps: dict[str, Any], step: str) -> Any:
        if self.key(step) not in steps:
            pytest.fail(f"step '{self.key(step)}' did not pass; this one depends on it", pytrace=False)
        return steps[self.key(step)]

    def extra_values(self, helm: Any) -> list[str]:
        """What the test adds to README's ``helm install``: the test-only
        values files and this install's layout/scheduler (chart values README
        documents)."""
        extra = []
        if self.LAYOUT != "split":
            extra += ["--set", f"layout={self.LAYOUT}"]
        if self.SCHEDULER != "default":
            extra += ["--set", f"scheduler={self.SCHEDULER}"]
        return helm.values_args(*extra)

    # ---- 1 ------------------------------------------------------------------------
    def install(self, c: fc.FullCluster, helm: Any, kubectl: Any, steps: dict[str, Any]) -> None:
        self._leftovers(c, helm)
        # what GPU feature discovery / the GPU Operator labels a GPU node with (the chart's nodeSelector)
        c.api().patch_node(k.NODE, {"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}})
        status = ""
        with diagnosed(c, f"README's install ({self.LAYOUT}, {self.SCHEDULER})"):
            for argv in readme.commands(readme.INSTALL):
                if argv[:2] == ["helm", "install"]:
                    t0 = time.monotonic()
                    helm.readme(argv, *self.extra_values(helm))
                    wait(c, lambda: sorted(d.metadata.name for d in daemonsets(c)) == sorted(self.daemonsets)
                         and all(ds_rolled_out(d) for d in daemonsets(c)), ROLLOUT_S,
                         f"DaemonSets {self.daemonsets} rolled out (numberReady == desiredNumberScheduled)")
                    rollout_s = round(time.monotonic() - t0, 1)
                    print(f"install {self.key('')}: DaemonSets ready {rollout_s} s after helm install")
                elif argv[0] == "kubectl":
                    out = kubectl(argv)
                    if "status" in argv:
                        status = out  # README / NOTES.txt: kubectl exec ds/fracplugin -- fracplugin status
                else:
                    raise readme.ReadmeError(f"README's install runs {argv}: not a helm or kubectl command")
            assert "ready" in status.lower(), f"`fracplugin status` in ds/fracplugin: {status}"
            doors = only_pod(c, DOORS_SEL)
            pods = [doors] + ([only_pod(c, MPS_SEL)] if self.LAYOUT == "split" else [])
            for p in pods:
                assert p.spec.node_name == k.NODE, (p.metadata.name, p.spec.node_name)
                assert p.spec.containers[0].image == fc.DAEMON_IMAGE, (p.metadata.name, p.spec.containers[0].image)
            assert not doors.spec.host_network and doors.status.pod_ip.startswith("10.244.77."), doors.status.pod_ip
        # the node conditions the daemon publishes with its own ServiceAccount token
        wait(c, lambda: all(t in node_conditions(c) and node_conditions(c)[t].status == "True" for t in CONDITIONS),
             60, f"node conditions {CONDITIONS} True")
        with diagnosed(c, f"install ({self.LAYOUT}, {self.SCHEDULER}): the ServiceAccount of pod "
                          f"{doors.metadata.name}"):
            sa = chart_service_account(helm)
            assert doors.spec.service_account_name == sa, \
                f"pod {doors.metadata.name} runs as ServiceAccount {doors.spec.service_account_name}, the chart's is {sa}"
        assert_conditions_written_by(c, f"system:serviceaccount:{NAMESPACE}:{sa}", doors.metadata.name)
        with diagnosed(c, f"install ({self.LAYOUT}, {self.SCHEDULER})"):
            bad = forbidden_lines(c)
            assert not bad, "the API server refused the daemon (RBAC too narrow?):\n" + "\n".join(bad)
            ours = [p.name for p in k.DEVICE_PLUGIN_DIR.iterdir() if p.name.startswith("fracplugin")]
            if self.SCHEDULER == "kai":  # the NRI door only
                assert not ours, f"scheduler=kai, yet device plugin sockets in {k.DEVICE_PLUGIN_DIR}: {ours}"
        steps[self.key("install")] = {p.metadata.name: p.metadata.uid for p in pods}

    def _leftovers(self, c: fc.FullCluster, helm: Any) -> None:
        """Before an install: remove what a failed earlier install left (its
        own steps failed already; this one should not fail for them)."""
        if not helm("list", "-n", NAMESPACE, "-q", "-a").stdout.strip() and not daemonsets(c):
            try:
                c.api().read_namespace(NAMESPACE)
            except Exception:  # noqa: BLE001 - absent: a clean slate
                return
        print("install: removing what an earlier failed install left")
        for p in pods_of(c, selector=MPS_SEL):
            c.ctrd.crictl("exec", container_id(p, "mps"), "fracplugin", "mps-quit", check=False)
        for d in daemonsets(c):
            c.apps().delete_namespaced_daemon_set(d.metadata.name, NAMESPACE, propagation_policy="Foreground")
        wait(c, lambda: not daemonsets(c) and not pods_of(c), 180, "an earlier install's DaemonSets gone")
        helm("uninstall", RELEASE_NAME, "-n", NAMESPACE, "--ignore-not-found", "--wait")
        self._delete_namespace(c)

    @staticmethod
    def _delete_namespace(c: fc.FullCluster) -> None:
        from kubernetes.client.rest import ApiException

        try:
            c.api().delete_namespace(NAMESPACE)
        except ApiException as e:
            if e.status != 404:
                raise

        def gone() -> bool:
            try:
                c.api().read_namespace(NAMESPACE)
                return False
            except ApiException as e:
                return e.status == 404
        wait(c, gone, 120, f"namespace {NAMESPACE} deleted")

    # ---- 2 ------------------------------------------------------------------------
    def scheduled_pod(self, c: fc.FullCluster, steps: dict[str, Any]) -> None:
        self.needs(steps, "install")
        node = yaml.safe_load(NODE_FILE.read_text())
        n = sum(int(g["memory_mib"]) // 1024 for g in node["gpus"])
        wait(c, lambda: c.capacity() == (n, n), 90, f"{k.RESOURCE} capacity = allocatable = {n}")
        # the ServiceAccount admission plugin needs the namespace's default ServiceAccount (controller-manager)
        wait(c, lambda: c.api().read_namespaced_service_account("default", "default"), 60,
             "ServiceAccount default/default", ns="default")
        name = f"frac-{self.LAYOUT}"
        c.api().create_namespaced_pod("default", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": {ANN + "gpu-memory.limit": "6Gi"}},
            "spec": {"automountServiceAccountToken": False, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "app", "image": k.h.IMAGE, "imagePullPolicy": "Never",
                                     "command": ["/bin/sleep", "3600"],
                                     "resources": {"limits": {k.RESOURCE: "4"}}}]}})
        p = running_pod(c, name)

        def scheduled() -> list[str]:
            return [f"{e.source.component if e.source else ''} {e.reporting_component or ''}"
                    for e in c.api().list_namespaced_event("default").items
                    if e.involved_object.name == name and e.reason == "Scheduled"]
        by = wait(c, scheduled, 30, f"the Scheduled event of pod {name}", ns="default")
        with diagnosed(c, f"pod {name} container app ({self.LAYOUT})"):
            assert p.spec.node_name == k.NODE  # bound by kube-scheduler: the manifest names no node
            assert "default-scheduler" in by[0], by
            cid = container_id(p, "app")
            env = container_env(c, cid)
            gpus = [g["uuid"] for g in node["gpus"]]
            # README "What a fractional container gets": one GPU, request = 4 devices x 1 GiB, the annotated limit
            assert env.get("NVIDIA_VISIBLE_DEVICES") in gpus, env
            assert env.get("CUDA_VISIBLE_DEVICES") == env["NVIDIA_VISIBLE_DEVICES"], env
            assert env.get("NVIDIA_GPU_MEMORY_REQUEST") == "4096", env
            assert env.get("NVIDIA_GPU_MEMORY_LIMIT") == "6144", env
            assert env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == f"{env['NVIDIA_VISIBLE_DEVICES']}=6144M", env
            assert env.get("CUDA_MPS_PIPE_DIRECTORY") == "/tmp/nvidia-mps", env
            pipe = self._pipe_mount(c, cid)
        steps[self.key("pod")] = {"name": name, "cid": cid, "pipe": pipe, "uid": p.metadata.uid}

    def _pipe_mount(self, c: fc.FullCluster, cid: str) -> str:
        """The pipe directory: a read-only bind of the host's
        <mpsRoot>/<mode>/... directory at /tmp/nvidia-mps holding the MPS
        ``control`` socket; returns its host path."""
        info = crictl_json(c, "inspect", cid)
        mounts = info.get("info", {}).get("runtimeSpec", {}).get("mounts", [])  # the OCI spec runc got
        pipe = [m for m in mounts if m.get("destination") == "/tmp/nvidia-mps"]
        mps_root = str(c.run_dir / "mps") + "/"
        assert len(pipe) == 1 and pipe[0]["source"].startswith(mps_root) and "ro" in pipe[0].get("options", []), \
            mounts
        mountinfo = c.ctrd.crictl("exec", cid, "cat", "/proc/self/mountinfo").stdout
        fields = [ln.split() for ln in mountinfo.splitlines()
                  if len(ln.split()) > 5 and ln.split()[4] == "/tmp/nvidia-mps"]
        assert fields and "ro" in fields[0][5].split(","), mountinfo
        assert "control" in c.ctrd.crictl("exec", cid, "ls", "/tmp/nvidia-mps").stdout
        return str(pipe[0]["source"])

    def kai_pod(self, c: fc.FullCluster, steps: dict[str, Any]) -> None:
        """A pod bound the way KAI's binder binds it (``nodeName`` and the
        ``nvidia.com/container.*`` annotations, no extended resource) gets
        README's env and pipe mount through the NRI door."""
        self.needs(steps, "install")
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
        p = running_pod(c, "kai")
        with diagnosed(c, "pod kai container app (scheduler kai)"):
            cid = container_id(p, "app")
            env = container_env(c, cid)
            assert env.get("NVIDIA_VISIBLE_DEVICES") == gpu, env
            assert (env.get("NVIDIA_GPU_MEMORY_REQUEST"), env.get("NVIDIA_GPU_MEMORY_LIMIT")) == ("4096", "6144"), env
            assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "50", env
            assert env.get("CUDA_MPS_PIPE_DIRECTORY") == "/tmp/nvidia-mps", env
            self._pipe_mount(c, cid)
        steps[self.key("pod")] = {"name": "kai", "cid": cid}

    # ---- 3 ------------------------------------------------------------------------
    def metrics(self, c: fc.FullCluster, steps: dict[str, Any]) -> None:
        pod = self.needs(steps, "pod")
        doors = only_pod(c, DOORS_SEL)
        with diagnosed(c, f"/metrics of pod {doors.metadata.name} container {doors.spec.containers[0].name}"):
            port = next(p.container_port for p in doors.spec.containers[0].ports if p.name == "metrics")
            assert doors.metadata.annotations.get("prometheus.io/port") == str(port)
            url = f"http://{doors.status.pod_ip}:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.status == 200
                text = r.read().decode()
            series = [ln for ln in text.splitlines() if ln.startswith("fracplugin_container_gpu_memory_request_bytes{")]
            frac = [ln for ln in series if f'pod="{pod["name"]}"' in ln]
            assert frac and frac[0].endswith(f" {4096 * 1024 * 1024}.0"), series
        steps[self.key("metrics")] = True

    # ---- 4 ------------------------------------------------------------------------
    def upgrade_keeps_mps_client(self, c: fc.FullCluster, helm: Any, steps: dict[str, Any]) -> None:
        """README's ``helm upgrade --reuse-values --set image.tag=<new tag>``
        while the fractional container's process is an MPS client of its
        namespace: the doors roll to the new image, the fracplugin-mps pod
        (UID, restart count, image) stays, and so do the client's MPS server
        PID, its control daemon, its namespace and the client itself."""
        pod = self.needs(steps, "pod")
        with diagnosed(c, f"before helm upgrade: pod {pod['name']} container app as an MPS client"):
            doors0, mps0 = only_pod(c, DOORS_SEL), only_pod(c, MPS_SEL)
            restarts0 = mps0.status.container_statuses[0].restart_count
            pipe = Path(pod["pipe"])
            daemon_dir = mps_daemon_dir(pipe)
            parts = pipe.relative_to(daemon_dir).parts
            assert len(parts) == 2, f"pipe directory {pipe} is not <MPS daemon dir>/<server>/<namespace>"
            server, ns = parts
            daemon_pid = int((daemon_dir / "nvidia-cuda-mps-control.pid").read_text())
            # the long-running client: the fractional container's process, started before the upgrade
            client_pid = int(crictl_json(c, "inspect", pod["cid"])["info"]["pid"])
            mps_ctl(daemon_dir, "fake-client", "add", str(client_pid), f"--server={server}", f"--namespace={ns}",
                    "--cmd=/bin/sleep")
            before = self._mps_view(daemon_dir, server, ns, client_pid)
            assert before["server_pid"].isdigit() and pid_alive(int(before["server_pid"])), before
            assert before["client"][:2] == [str(client_pid), server] and before["client"][3] == ns, before
        helm.readme(readme.one(readme.UPGRADE, "helm", "upgrade"))

        def rolled() -> bool:
            ds = c.apps().read_namespaced_daemon_set("fracplugin", NAMESPACE)
            ps = pods_of(c, selector=DOORS_SEL)
            return (ds_rolled_out(ds) and len(ps) == 1 and ps[0].metadata.uid != doors0.metadata.uid
                    and ps[0].spec.containers[0].image == fc.DAEMON_IMAGE_UPGRADE)
        wait(c, rolled, ROLLOUT_S, f"the doors DaemonSet rolled to a new pod of {fc.DAEMON_IMAGE_UPGRADE}")

        def mps_observed() -> Any:
            d = c.apps().read_namespaced_daemon_set("fracplugin-mps", NAMESPACE)
            return d if (d.status.observed_generation or 0) >= d.metadata.generation else None
        mds = wait(c, mps_observed, 60, "fracplugin-mps DaemonSet observed the upgrade")
        with diagnosed(c, f"after helm upgrade: pod {mps0.metadata.name} container mps, pod {pod['name']}"):
            mps = only_pod(c, MPS_SEL)
            assert mps.metadata.uid == mps0.metadata.uid, f"helm upgrade replaced pod {mps0.metadata.name}"
            assert mps.status.container_statuses[0].restart_count == restarts0, "container mps restarted"
            assert mps.spec.containers[0].image == fc.DAEMON_IMAGE, mps.spec.containers[0].image  # OnDelete
            assert (mds.status.updated_number_scheduled or 0) == 0 and mds.status.number_ready == 1
            p = c.api().read_namespaced_pod(pod["name"], "default")
            assert p.status.phase == "Running" and container_id(p, "app") == pod["cid"]
            assert pid_alive(client_pid), f"the MPS client {client_pid} died"
            after = self._mps_view(daemon_dir, server, ns, client_pid)
            assert after == before, f"MPS changed under its client: before {before}, after {after}"
            assert int((daemon_dir / "nvidia-cuda-mps-control.pid").read_text()) == daemon_pid
            assert pid_alive(int(after["server_pid"])) and pid_alive(daemon_pid)
            bad = forbidden_lines(c)
            assert not bad, "\n".join(bad)
            mps_ctl(daemon_dir, "fake-client", "remove", str(client_pid))
        print(f"upgrade: client {client_pid} kept server {before['server_pid']} and namespace {server}/{ns}")
        steps[self.key("upgrade")] = True

    @staticmethod
    def _mps_view(daemon_dir: Path, server: str, ns: str, client_pid: int) -> dict[str, Any]:
        """What MPS says of the client: its server's PID (``server list``),
        its namespace's row (``namespace list``) and its own row (``client list``)."""
        fmt = "--format=csv,noheader"
        servers = {r[0]: r for r in mps_ctl(daemon_dir, "server", "list", fmt)}
        nss = [r for r in mps_ctl(daemon_dir, "namespace", "list", f"--server={server}", fmt) if r[0] == ns]
        clients = [r for r in mps_ctl(daemon_dir, "client", "list", fmt) if r[0] == str(client_pid)]
        return {"server_pid": servers.get(server, ["", "", ""])[2], "namespace": nss[0] if nss else None,
                "client": clients[0] if clients else None}

    # ---- 4b, 4c -------------------------------------------------------------------
    def gpu_operator_pause(self, c: fc.FullCluster, steps: dict[str, Any], label: str, pause: str,
                           done: str) -> None:
        """A GPU Operator driver upgrade as it reaches our pods (the chart's
        ``gpuOperator.driverUpgrade`` affinity): node label ``label`` set to
        ``pause`` through the API. The DaemonSet controller deletes both pods
        (its ``SuccessfulDelete`` events name them; desiredNumberScheduled 0);
        the MPS role's keeper quits every MPS control daemon on purpose before
        its container ends (its streamed log says so, each fake control daemon
        logged its own ``quit`` and removed its socket and pid file; no
        fracplugin or fake MPS process is left); the node conditions are not
        left True. Then ``label`` = ``done``: both pods return Ready, new MPS
        daemons run and the conditions are True again."""
        self.needs(steps, "install")
        what = f"{label}={pause}"
        mps_root = c.run_dir / "mps"
        with diagnosed(c, f"before {what}: pods of {self.daemonsets}"):
            doors0, mps0 = only_pod(c, DOORS_SEL), only_pod(c, MPS_SEL)
            daemons = {p.parent.name: int(p.read_text().split()[0])
                       for p in mps_root.glob("*/nvidia-cuda-mps-control.pid")}
            assert sorted(daemons) == ["sm", "ts"] and all(pid_alive(p) for p in daemons.values()), daemons
            logs0 = {m: (mps_root / "log" / m / "control.log").stat().st_size for m in daemons}
            follow = LogFollower(c, mps0, mps0.spec.containers[0].name)
        t0 = time.monotonic()
        c.api().patch_node(k.NODE, {"metadata": {"labels": {label: pause}}})
        wait(c, lambda: not pods_of(c), 120, f"{what}: pods {doors0.metadata.name} and {mps0.metadata.name} "
                                             "deleted by the DaemonSet controller")
        gone_s = round(time.monotonic() - t0, 1)
        with diagnosed(c, f"after {what}: pods {doors0.metadata.name}, {mps0.metadata.name} container mps"):
            counts = {d.metadata.name: d.status.desired_number_scheduled for d in daemonsets(c)}
            assert counts == {n: 0 for n in self.daemonsets}, f"desiredNumberScheduled under {what}: {counts}"
            deleted = {e.message for e in c.api().list_namespaced_event(NAMESPACE).items
                       if e.reason == "SuccessfulDelete" and e.involved_object.kind == "DaemonSet"}
            for p in (doors0, mps0):
                assert f"Deleted pod: {p.metadata.name}" in deleted, \
                    f"expected the DaemonSet controller's event 'Deleted pod: {p.metadata.name}'; seen: {deleted}"
            log = follow.text(30)
            assert "MPS stopped on purpose: every MPS control daemon quit" in log, \
                ("expected the MPS role's log to say 'MPS stopped on purpose: every MPS control daemon quit'; "
                 "its last lines:\n" + "\n".join(log.splitlines()[-15:]))
            for m, size in logs0.items():
                with open(mps_root / "log" / m / "control.log", "rb") as f:
                    f.seek(size)
                    new = f.read().decode(errors="replace")
                assert "Exiting control daemon (fake)" in new, \
                    f"expected MPS {m} control daemon pid {daemons[m]} to quit (its control.log); it logged: {new!r}"
                left = [x.name for x in (mps_root / m / "control", mps_root / m / "nvidia-cuda-mps-control.pid")
                        if x.exists()]
                assert not left, f"MPS {m} daemon quit but left {left} in {mps_root / m}"
        wait(c, lambda: not _our_processes(), 60, f"{what}: no fracplugin or MPS process on the host")
        with diagnosed(c, f"after {what}: node {k.NODE} conditions"):
            conds = node_conditions(c)
            last = {t: (conds[t].status, conds[t].reason) for t in CONDITIONS if t in conds}
            still = {t: v for t, v in last.items() if v[0] == "True"}
            assert not still, f"expected node conditions {CONDITIONS} not True under {what}; seen {last}"
        t1 = time.monotonic()
        c.api().patch_node(k.NODE, {"metadata": {"labels": {label: done}}})
        wait(c, lambda: sorted(d.metadata.name for d in daemonsets(c)) == sorted(self.daemonsets)
             and all(ds_rolled_out(d) for d in daemonsets(c)), ROLLOUT_S,
             f"{label}={done}: DaemonSets {self.daemonsets} back and rolled out")
        wait(c, lambda: all(t in node_conditions(c) and node_conditions(c)[t].status == "True" for t in CONDITIONS),
             60, f"{label}={done}: node conditions {CONDITIONS} True again")
        back_s = round(time.monotonic() - t1, 1)
        with diagnosed(c, f"after {label}={done}: the new pods of {self.daemonsets}"):
            doors, mps = only_pod(c, DOORS_SEL), only_pod(c, MPS_SEL)
            assert doors.metadata.uid != doors0.metadata.uid and mps.metadata.uid != mps0.metadata.uid
            now = {p.parent.name: int(p.read_text().split()[0]) for p in mps_root.glob("*/nvidia-cuda-mps-control.pid")}
            assert sorted(now) == ["sm", "ts"] and all(pid_alive(p) for p in now.values()), now
            assert not set(now.values()) & set(daemons.values()), (daemons, now)
        print(f"{what}: pods gone in {gone_s} s, MPS quit on purpose, conditions {last}; "
              f"{label}={done}: back Ready in {back_s} s")
        steps[self.key(f"gpu-operator {label}")] = last

    # ---- 5 ------------------------------------------------------------------------
    def uninstall(self, c: fc.FullCluster, helm: Any, kubectl: Any, steps: dict[str, Any]) -> None:
        self.needs(steps, "install")
        from kubernetes.client import V1DeleteOptions

        for p in pods_of(c, "default"):
            c.api().delete_namespaced_pod(p.metadata.name, "default", body=V1DeleteOptions(grace_period_seconds=0))
        wait(c, lambda: not pods_of(c, "default"), 60, "the fractional pods deleted", ns="default")
        block = readme.UNINSTALL if self.LAYOUT == "split" else readme.UNINSTALL_SINGLE
        with diagnosed(c, f"README's uninstall ({self.LAYOUT}, {self.SCHEDULER})"):
            for argv in readme.commands(block):
                if argv[0] == "helm":
                    helm.readme(argv)
                else:
                    kubectl(argv)
        wait(c, lambda: not pods_of(c) and not daemonsets(c), 120, "every fracplugin pod gone")
        wait(c, lambda: not _our_processes(), 60, "no fracplugin or MPS process on the host")
        with diagnosed(c, f"after README's uninstall ({self.LAYOUT}, {self.SCHEDULER})"):
            ours = [p.name for p in k.DEVICE_PLUGIN_DIR.iterdir() if p.name.startswith("fracplugin")]
            assert not ours, f"left in {k.DEVICE_PLUGIN_DIR}: {ours}"
            nri_dir = c.ctrd.nri_sock.parent
            left = [p.name for p in nri_dir.iterdir() if p.name != "nri.sock" and p.is_socket()]
            assert not left, f"left in {nri_dir}: {left}"
            conds = node_conditions(c)
            still = {t: conds[t].status for t in CONDITIONS if t in conds and conds[t].status == "True"}
            assert not still, f"node conditions left True after uninstall: {still}"
            # the daemon's last word (ADR 0005), written while its RBAC still existed
            last = {t: (conds[t].status, conds[t].reason) for t in CONDITIONS if t in conds}
            assert all(v == ("Unknown", "ShuttingDown") for v in last.values()) and len(last) == 2, last
            mps_root = c.run_dir / "mps"
            socks = [str(p) for p in mps_root.rglob("*") if p.is_socket()] if mps_root.exists() else []
            assert not socks, f"MPS sockets left: {socks}"
        print(f"after uninstall ({self.LAYOUT}, {self.SCHEDULER}): node conditions {last}")
        # not in README (the namespace is the user's): so that the next install starts from README's first line
        self._delete_namespace(c)
        steps[self.key("uninstall")] = last



class TestSplit(Scenarios):
    """Layout split, scheduler default: the chart's defaults."""

    LAYOUT, SCHEDULER = "split", "default"

    def test_1_readme_install_rolls_out(self, cluster, helm, kubectl, steps):
        self.install(cluster, helm, kubectl, steps)

    def test_2_scheduled_pod_goes_through_both_doors(self, cluster, steps):
        self.scheduled_pod(cluster, steps)

    def test_3_metrics_scraped_from_the_host_at_the_pod_ip(self, cluster, steps):
        self.metrics(cluster, steps)

    def test_4_helm_upgrade_new_image_keeps_the_mps_client(self, cluster, helm, steps):
        self.upgrade_keeps_mps_client(cluster, helm, steps)

    def test_4b_gpu_operator_driver_upgrade_state_evicts_then_returns(self, cluster, steps):
        # the upgrade controller's state while it deletes GPU pods; any state but upgrade-done evicts us
        self.gpu_operator_pause(cluster, steps, "nvidia.com/gpu-driver-upgrade-state", "pod-deletion-required",
                                "upgrade-done")

    def test_4c_gpu_operator_driver_manager_pause_evicts_then_returns(self, cluster, steps):
        # k8s-driver-manager's pause of the GPU clients before it unloads the driver, and their return
        self.gpu_operator_pause(cluster, steps, "nvidia.com/gpu.deploy.client", "paused-for-driver-upgrade", "true")

    def test_5_readme_uninstall_leaves_nothing(self, cluster, helm, kubectl, steps):
        self.uninstall(cluster, helm, kubectl, steps)


class TestSingle(Scenarios):
    """Layout single (one DaemonSet, role all), scheduler default."""

    LAYOUT, SCHEDULER = "single", "default"

    def test_1_readme_install_rolls_out(self, cluster, helm, kubectl, steps):
        self.install(cluster, helm, kubectl, steps)

    def test_2_scheduled_pod_goes_through_both_doors(self, cluster, steps):
        self.scheduled_pod(cluster, steps)

    def test_3_metrics_scraped_from_the_host_at_the_pod_ip(self, cluster, steps):
        self.metrics(cluster, steps)

    def test_5_readme_uninstall_leaves_nothing(self, cluster, helm, kubectl, steps):
        self.uninstall(cluster, helm, kubectl, steps)


class TestSplitKai(Scenarios):
    """Layout split, scheduler kai: the NRI door only."""

    LAYOUT, SCHEDULER = "split", "kai"

    def test_1_readme_install_rolls_out(self, cluster, helm, kubectl, steps):
        self.install(cluster, helm, kubectl, steps)

    def test_2_kai_bound_pod_goes_through_the_nri_door(self, cluster, steps):
        self.kai_pod(cluster, steps)

    def test_5_readme_uninstall_leaves_nothing(self, cluster, helm, kubectl, steps):
        self.uninstall(cluster, helm, kubectl, steps)
