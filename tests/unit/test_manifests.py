"""Offline checks of the deployment manifests in ``daemonset/`` and the Dockerfile.

What is checked (each check is a function returning a list of problems, so
that the negative tests below can show each one failing on a mutated copy):

- every document of every manifest validates against the Kubernetes JSON
  schemas shipped by ``kubernetes_validate``, strict (unknown fields are
  errors), for each version in ``K8S_VERSIONS``;
- ``kustomization.yaml`` lists exactly the manifest files of the directory;
- every host path the daemon uses by default (``DAEMON_DEFAULT_HOST_PATHS``) is
  under a hostPath volume mounted at the same path inside the container (plans
  hand host paths to the runtime, so the daemon must see host paths as-is),
  and so is every path configured in the ConfigMap;
- the pod: hostPID, system-node-critical, GPU node selector and toleration,
  NODE_NAME / NVIDIA_* env, memory request and limit, startup +
  liveness probes on /healthz and readiness on /readyz at the health port, the
  ports agreeing with the ConfigMap's addresses, the config file mounted where
  ``--config`` points, labels matching the selector;
- least privilege, for every DaemonSet of the directory and every container
  (docs/adr/0008-least-privilege-daemonset.md): not privileged, no privilege
  escalation, read-only root filesystem, RuntimeDefault seccomp, all
  capabilities dropped and exactly ``ALLOWED_CAPABILITIES`` added back, no host
  network or IPC;
- GPU Operator driver upgrades: every DaemonSet leaves a node whose
  ``nvidia.com/gpu.deploy.client`` is paused or whose
  ``nvidia.com/gpu-driver-upgrade-state`` is in progress, and runs where the
  labels are absent (``driver_upgrade_problems``, ADR 0008 decision 13);
- RBAC: exactly the verbs the code calls (``api_verbs_used``, read from the
  source: pods list/watch, events create, nodes get, nodes/status patch), bound to the daemon's
  ServiceAccount; no other role;
- the Dockerfile: ENTRYPOINT ``fracplugin run``, a HEALTHCHECK on the same
  health port and path, a CUDA runtime base for the final stage.

Concurrency: none (pure functions over parsed YAML).
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Callable

import kubernetes_validate

from fracplugin.config import DEFAULTS
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST_DIR = REPO / "daemonset"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
NAMESPACE = "fracplugin-system"

# Kubernetes versions whose schemas the manifests must satisfy: the oldest we
# support and the newest that the pinned kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")

# The host paths `fracplugin run` uses by default (files or directories),
# read from the daemon's own defaults. /proc is reached via hostPID.
DAEMON_DEFAULT_HOST_PATHS: dict[str, str] = {
    name: getattr(DEFAULTS, name)
    for name in ("device_plugin_dir", "pod_resources_socket", "nri_socket", "mps_root", "state_dir", "cgroup_root")
}
HEALTH_PORT = 8080
METRICS_PORT = 2112
CONFIG_MOUNT = "/etc/fracplugin"
CONFIG_FILE = CONFIG_MOUNT + "/config.yaml"

# The API access the daemon needs: (apiGroup, resource) -> verbs. It must be
# what the source calls (test_rbac_needed_is_what_the_code_calls).
RBAC_NEEDED: dict[tuple[str, str], set[str]] = {
    ("", "pods"): {"list", "watch"},
    ("", "events"): {"create"},
    # KAI's readiness gate (ADR 0005): the node condition, and one read of the
    # node to keep its transition time across restarts
    ("", "nodes"): {"get"},
    ("", "nodes/status"): {"patch"},
    # --unfenced-containers restart (the default) and --over-limit restart (ADR 0035): a running
    # container is restarted by evicting its pod
    ("", "pods/eviction"): {"create"},
}
SRC = REPO / "src" / "fracplugin"

# Capabilities a fracplugin container may add back after dropping ALL, and why
# (docs/adr/0008-least-privilege-daemonset.md).
ALLOWED_CAPABILITIES: dict[str, str] = {
    "SYS_PTRACE": "read /proc/<pid>/exe and /environ of other containers' processes (ptrace access mode)",
    "DAC_READ_SEARCH": "read /proc/<pid>/environ (mode 0400) of processes under other UIDs: protocol-2 MPS servers "
                       "run under their client's UID and the cleanup at quit finds them by their environment",
    "KILL": "signal MPS servers and clients that run under other UIDs",
    "SETUID": "the MPS control daemon starts each MPS server under its client's UID",
    "SETGID": "the MPS control daemon starts each MPS server under its client's GID",
}

# Every fracplugin container adds all of these back: without one, a duty of
# ALLOWED_CAPABILITIES silently fails under the DaemonSet (issue 24 found
# DAC_READ_SEARCH missing by running the daemon under exactly this set).
REQUIRED_CAPABILITIES = frozenset(ALLOWED_CAPABILITIES)

# GPU Operator driver-upgrade signals (ADR 0008 decision 13;
# docs/reference/gpu-fractioning-reference.md section 1): node labels -> may the daemon run?
GPU_DEPLOY_CLIENT = "nvidia.com/gpu.deploy.client"
DRIVER_UPGRADE_STATE = "nvidia.com/gpu-driver-upgrade-state"
GPU_NODE = {"nvidia.com/gpu.present": "true"}
DRIVER_UPGRADE_NODES: list[tuple[str, dict[str, str], bool]] = [
    ("no GPU Operator labels", {}, True),
    ("client true, upgrade done", {GPU_DEPLOY_CLIENT: "true", DRIVER_UPGRADE_STATE: "upgrade-done"}, True),
    ("client true, never upgraded", {GPU_DEPLOY_CLIENT: "true"}, True),
    ("older operator: no client label, upgrade done", {DRIVER_UPGRADE_STATE: "upgrade-done"}, True),
    ("driver-manager paused clients", {GPU_DEPLOY_CLIENT: "paused-for-driver-upgrade"}, False),
    ("mig-manager paused clients", {GPU_DEPLOY_CLIENT: "paused-for-mig-change", DRIVER_UPGRADE_STATE: "upgrade-done"}, False),
    ("clients disabled", {GPU_DEPLOY_CLIENT: "false"}, False),
    ("upgrade required", {DRIVER_UPGRADE_STATE: "upgrade-required"}, False),
    ("cordon required", {GPU_DEPLOY_CLIENT: "true", DRIVER_UPGRADE_STATE: "cordon-required"}, False),
    ("pod deletion required", {DRIVER_UPGRADE_STATE: "pod-deletion-required"}, False),
    ("pod restart required", {GPU_DEPLOY_CLIENT: "true", DRIVER_UPGRADE_STATE: "pod-restart-required"}, False),
    ("upgrade failed", {DRIVER_UPGRADE_STATE: "upgrade-failed"}, False),
]

Manifests = dict[str, list[dict[str, Any]]]


# ---------------------------------------------------------------- loading


def load_manifests(directory: Path = MANIFEST_DIR) -> Manifests:
    """Every ``*.yaml`` of ``directory`` -> its non-empty YAML documents."""
    out: Manifests = {}
    for path in sorted(directory.glob("*.yaml")):
        with path.open() as f:
            out[path.name] = [d for d in yaml.safe_load_all(f) if d is not None]
    return out


def objects(m: Manifests) -> list[dict[str, Any]]:
    """All Kubernetes objects (the kustomization excluded)."""
    return [d for name, docs in m.items() if name != "kustomization.yaml" for d in docs]


def one(m: Manifests, kind: str) -> dict[str, Any]:
    found = [d for d in objects(m) if d.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind}, found {len(found)}"
    return found[0]


def daemonsets(m: Manifests) -> list[dict[str, Any]]:
    """Every DaemonSet of the directory (the doors one and, with the two-role
    layout, ``fracplugin-mps``)."""
    return [d for d in objects(m) if d.get("kind") == "DaemonSet"]


MPS_DS = "fracplugin-mps"


def _ds(m: Manifests, role: str = "doors") -> dict[str, Any]:
    """The DaemonSet of ``role``: "doors" = the one named fracplugin (or the only
    one, layout single); "mps" = fracplugin-mps (layout split, ADR 0009)."""
    dss = [d for d in objects(m) if d.get("kind") == "DaemonSet"]
    if len(dss) == 1 and role == "doors":
        return dss[0]  # layout single (role all), or a copy holding one DaemonSet
    if role == "mps":
        found = [d for d in dss if d["metadata"].get("name", "").endswith("-mps")]
    else:
        found = [d for d in dss if not d["metadata"].get("name", "").endswith("-mps")]
    assert len(found) == 1, f"expected exactly one {role} DaemonSet, found {len(found)}"
    return found[0]


def _pod(m: Manifests, role: str = "doors") -> dict[str, Any]:
    return _ds(m, role)["spec"]["template"]["spec"]


def _container(m: Manifests, role: str = "doors") -> dict[str, Any]:
    containers = _pod(m, role)["containers"]
    assert len(containers) == 1, "the daemon pod has one container"
    return containers[0]


def _config(m: Manifests) -> dict[str, Any]:
    return yaml.safe_load(one(m, "ConfigMap")["data"]["config.yaml"])


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _under(path: str, directory: str) -> bool:
    p, d = path.rstrip("/"), directory.rstrip("/")
    return p == d or p.startswith(d + "/")


# ---------------------------------------------------------------- checks


def schema_problems(m: Manifests, version: str) -> list[str]:
    """Strict schema validation of every object; a kind without a schema is a
    problem too (it would be silently unchecked)."""
    problems = []
    for name, docs in m.items():
        if name == "kustomization.yaml":
            continue
        for doc in docs:
            label = f"{name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                problems.append(f"{label} invalid for {version} at {path}: {e.message}")
            except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
                problems.append(f"{label}: no schema for {version}: {e}")
    return problems


def kustomization_problems(m: Manifests) -> list[str]:
    """The kustomization lists exactly the manifest files and sets the namespace."""
    if "kustomization.yaml" not in m:
        return ["daemonset/kustomization.yaml is missing"]
    (k,) = m["kustomization.yaml"]
    problems = []
    if k.get("kind") != "Kustomization" or not str(k.get("apiVersion", "")).startswith("kustomize.config.k8s.io/"):
        problems.append("kustomization.yaml is not a kustomize Kustomization")
    listed = k.get("resources") or []
    files = set(m) - {"kustomization.yaml"}
    if len(listed) != len(set(listed)):
        problems.append(f"kustomization lists a file twice: {listed}")
    for missing in sorted(files - set(listed)):
        problems.append(f"kustomization does not list {missing}")
    for extra in sorted(set(listed) - files):
        problems.append(f"kustomization lists {extra}, which is not in daemonset/")
    if k.get("namespace") != NAMESPACE:
        problems.append(f"kustomization namespace is {k.get('namespace')!r}, want {NAMESPACE!r}")
    return problems


def host_path_problems(m: Manifests, paths: dict[str, str]) -> list[str]:
    """Each of ``paths`` must lie under a hostPath volume that the container
    mounts at the identical path."""
    pod, c = _pod(m), _container(m)
    host_volumes = {v["name"]: v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v}
    identity_mounts = [
        mnt["mountPath"]
        for mnt in c.get("volumeMounts", [])
        if mnt["name"] in host_volumes and host_volumes[mnt["name"]].rstrip("/") == mnt["mountPath"].rstrip("/")
    ]
    problems = []
    for key, path in paths.items():
        if not any(_under(path, d) for d in identity_mounts):
            problems.append(f"{key}={path} is not under any hostPath mounted at the same path ({identity_mounts})")
    for mnt in c.get("volumeMounts", []):
        if mnt["name"] in host_volumes and mnt["mountPath"] not in identity_mounts:
            problems.append(f"hostPath {host_volumes[mnt['name']]} is mounted at a different path {mnt['mountPath']}")
    return problems


def _tolerates(tolerations: list[dict[str, Any]], key: str, effect: str) -> bool:
    """Kubernetes toleration matching (core/v1 Toleration.ToleratesTaint) for a
    taint with ``key`` and any value."""
    for t in tolerations:
        if t.get("effect") not in (None, "", effect):
            continue
        if t.get("operator", "Equal") == "Exists" and t.get("key") in (None, "", key):
            return True
    return False


def _probe_problems(c: dict[str, Any], probe: str, path: str) -> list[str]:
    p = c.get(probe)
    if not p:
        return [f"no {probe}"]
    get = p.get("httpGet") or {}
    port = get.get("port")
    if isinstance(port, str):
        named = {cp.get("name"): cp["containerPort"] for cp in c.get("ports", [])}
        port = named.get(port)
    problems = []
    if get.get("path") != path:
        problems.append(f"{probe} path is {get.get('path')!r}, want {path!r}")
    if port != HEALTH_PORT:
        problems.append(f"{probe} port resolves to {port!r}, want the health port {HEALTH_PORT}")
    return problems


def pod_problems(m: Manifests) -> list[str]:
    """Pod-level requirements of the daemon (see docs/adr/0002-deployment.md)."""
    ds = _ds(m)
    pod, c = _pod(m), _container(m)
    problems = []
    if pod.get("hostPID") is not True:
        problems.append("hostPID must be true (MPS and NVML report host PIDs)")
    if pod.get("priorityClassName") != "system-node-critical":
        problems.append("priorityClassName must be system-node-critical")
    if pod.get("nodeSelector", {}).get("nvidia.com/gpu.present") != "true":
        problems.append('nodeSelector must select nvidia.com/gpu.present: "true"')
    if not _tolerates(pod.get("tolerations", []), "nvidia.com/gpu", "NoSchedule"):
        problems.append("no toleration for the nvidia.com/gpu:NoSchedule taint")
    env = {e["name"]: e for e in c.get("env", [])}
    if env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
        problems.append("NODE_NAME must come from fieldRef spec.nodeName")
    if env.get("NVIDIA_VISIBLE_DEVICES", {}).get("value") != "all":
        problems.append("NVIDIA_VISIBLE_DEVICES must be all")
    caps = set((env.get("NVIDIA_DRIVER_CAPABILITIES", {}).get("value") or "").split(","))
    if not {"compute", "utility"} <= caps:
        problems.append("NVIDIA_DRIVER_CAPABILITIES must include compute (MPS binaries) and utility (NVML)")
    res = c.get("resources") or {}
    for section in ("requests", "limits"):
        if "memory" not in (res.get(section) or {}):
            problems.append(f"resources.{section}.memory must be set")
    problems += _probe_problems(c, "startupProbe", "/healthz")
    problems += _probe_problems(c, "livenessProbe", "/healthz")
    problems += _probe_problems(c, "readinessProbe", "/readyz")
    ports = {cp["containerPort"] for cp in c.get("ports", [])}
    for want in (HEALTH_PORT, METRICS_PORT):
        if want not in ports:
            problems.append(f"container port {want} is not declared")
    cfg = _config(m)
    if _port(str(cfg.get("health_address", ""))) != HEALTH_PORT:
        problems.append(f"ConfigMap health_address {cfg.get('health_address')!r} is not on port {HEALTH_PORT}")
    if _port(str(cfg.get("metrics_address", ""))) != METRICS_PORT:
        problems.append(f"ConfigMap metrics_address {cfg.get('metrics_address')!r} is not on port {METRICS_PORT}")
    args = c.get("args", [])
    if "--config" not in args or args[args.index("--config") + 1 :][:1] != [CONFIG_FILE]:
        problems.append(f"args must pass --config {CONFIG_FILE}")
    cm_name = one(m, "ConfigMap")["metadata"]["name"]
    cm_volumes = {v["name"] for v in pod.get("volumes", []) if v.get("configMap", {}).get("name") == cm_name}
    if not any(mnt["name"] in cm_volumes and mnt["mountPath"] == CONFIG_MOUNT for mnt in c.get("volumeMounts", [])):
        problems.append(f"ConfigMap {cm_name} is not mounted at {CONFIG_MOUNT}")
    selector = ds["spec"]["selector"].get("matchLabels", {})
    labels = ds["spec"]["template"]["metadata"].get("labels", {})
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        problems.append(f"selector {selector} does not match template labels {labels}")
    strategy = ds["spec"].get("updateStrategy", {})
    if strategy.get("type") != "RollingUpdate" or strategy.get("rollingUpdate", {}).get("maxUnavailable") != 1:
        problems.append("updateStrategy must be RollingUpdate with maxUnavailable 1")
    volume_names = [v["name"] for v in pod.get("volumes", [])]
    if len(volume_names) != len(set(volume_names)):
        problems.append(f"duplicate volume names {volume_names}")
    for mnt in c.get("volumeMounts", []):
        if mnt["name"] not in volume_names:
            problems.append(f"volumeMount {mnt['name']} has no volume")
    sa = one(m, "ServiceAccount")["metadata"]["name"]
    if pod.get("serviceAccountName") != sa:
        problems.append(f"serviceAccountName {pod.get('serviceAccountName')!r} is not the ServiceAccount {sa!r}")
    return problems


def security_problems(m: Manifests) -> list[str]:
    """Least privilege for every container of every DaemonSet: not privileged,
    ``allowPrivilegeEscalation: false``, ``readOnlyRootFilesystem: true``,
    seccomp ``RuntimeDefault`` (pod or container level, never Unconfined),
    capabilities ``drop: [ALL]`` and ``add`` within ``ALLOWED_CAPABILITIES``;
    no ``hostNetwork`` / ``hostIPC`` on the pod."""
    problems = []
    sets = daemonsets(m)
    if not sets:
        return ["no DaemonSet"]
    for ds in sets:
        name = ds["metadata"]["name"]
        pod = ds["spec"]["template"]["spec"]
        for host in ("hostNetwork", "hostIPC"):
            if pod.get(host):
                problems.append(f"DaemonSet {name}: {host} must not be set")
        pod_seccomp = ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            where = f"DaemonSet {name} container {c.get('name')}"
            sc = c.get("securityContext") or {}
            if sc.get("privileged"):
                problems.append(f"{where}: privileged must not be set (capabilities do: ADR 0008)")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation must be false")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: readOnlyRootFilesystem must be true")
            seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
            if seccomp != "RuntimeDefault":
                problems.append(f"{where}: seccompProfile must be RuntimeDefault, is {seccomp!r}")
            caps = sc.get("capabilities") or {}
            if [str(x).upper() for x in caps.get("drop") or []] != ["ALL"]:
                problems.append(f"{where}: capabilities.drop must be [ALL], is {caps.get('drop')}")
            added = {str(x).upper().removeprefix("CAP_") for x in caps.get("add") or []}
            extra = sorted(added - set(ALLOWED_CAPABILITIES))
            if extra:
                problems.append(f"{where}: capabilities.add {extra} beyond {sorted(ALLOWED_CAPABILITIES)}")
            missing = sorted(REQUIRED_CAPABILITIES - added)
            if missing:
                problems.append(f"{where}: capabilities.add lacks {missing} "
                                f"({'; '.join(ALLOWED_CAPABILITIES[c] for c in missing)})")
    return problems


def _term_matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    """One nodeSelectorTerm (its matchExpressions ANDed) against node labels,
    with Kubernetes' operator semantics (NotIn and DoesNotExist match a node
    without the label). matchFields are the DaemonSet controller's own (node
    name) and are not part of a template."""
    for e in term.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], [str(v) for v in e.get("values") or []]
        have = key in labels
        if op == "In":
            ok = have and labels[key] in values
        elif op == "NotIn":
            ok = not have or labels[key] not in values
        elif op == "Exists":
            ok = have
        elif op == "DoesNotExist":
            ok = not have
        elif op in ("Gt", "Lt"):
            number = labels.get(key, "").lstrip("-").isdigit()
            ok = have and number and (int(labels[key]) > int(values[0]) if op == "Gt" else int(labels[key]) < int(values[0]))
        else:
            raise ValueError(f"node selector operator {op!r} of key {key!r}: not a Kubernetes operator")
        if not ok:
            return False
    return bool(term.get("matchExpressions")) or not term.get("matchFields")


def node_admits(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a DaemonSet pod template may run on (and so stays on) a node
    with ``labels``: its nodeSelector and its required node affinity (terms
    ORed). A DaemonSet controller deletes running pods from a node that stops
    matching, which is how the GPU Operator's label flips evict the daemon."""
    if any(labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if not required:
        return True
    return any(_term_matches(t, labels) for t in required.get("nodeSelectorTerms") or [])


def driver_upgrade_problems(m: Manifests, node_labels: dict[str, str] | None = None) -> list[str]:
    """Every DaemonSet leaves a node while the GPU Operator upgrades its
    driver or changes its MIG layout, and runs on it otherwise
    (``DRIVER_UPGRADE_NODES`` added to ``node_labels``, default ``GPU_NODE``:
    a node the DaemonSets are meant for)."""
    problems = []
    for ds in daemonsets(m):
        pod = ds["spec"]["template"]["spec"]
        for name, labels, want in DRIVER_UPGRADE_NODES:
            node = {**(GPU_NODE if node_labels is None else node_labels), **labels}
            if node_admits(pod, node) != want:
                problems.append(f"DaemonSet {ds['metadata']['name']} on a node with {labels} ({name}): "
                                f"{'runs' if not want else 'does not run'}, want it to "
                                f"{'run' if want else 'leave (GPU Operator driver upgrade, ADR 0008 decision 13)'}")
    return problems


def api_verbs_used(src: Path = SRC) -> dict[tuple[str, str], set[str]]:
    """The API access the daemon's source calls: every ``CoreV1Api`` method
    named in ``src`` (``v1.list_pod_for_all_namespaces(`` or passed to
    ``watch.Watch().stream``) as (apiGroup, resource) -> RBAC verbs; a list in
    a file that streams a ``watch.Watch`` also needs ``watch``."""
    from kubernetes import client

    verbs_of = {"list": "list", "read": "get", "create": "create", "patch": "patch", "replace": "update",
                "delete": "delete"}
    used: dict[tuple[str, str], set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        text = path.read_text()
        for name in sorted(set(re.findall(r"\b([a-z]+_[a-z_]+)\b", text))):
            if not callable(getattr(client.CoreV1Api, name, None)) or name.endswith("_with_http_info"):
                continue
            verb, _, rest = name.partition("_")
            if verb not in verbs_of:
                continue
            rest = rest.removeprefix("namespaced_").removesuffix("_for_all_namespaces")
            base, _, sub = rest.partition("_")  # a subresource: pod_status, pod_eviction
            rest, sub = (base, "/" + sub) if sub in ("status", "eviction") else (rest, "")
            resource = (rest if rest.endswith("s") else rest + "s") + sub
            found = used.setdefault(("", resource), set())
            found.add(verbs_of[verb])
            if verb == "list" and "watch.Watch(" in text:
                found.add("watch")
    return used


def rbac_problems(m: Manifests) -> list[str]:
    """Exactly ``RBAC_NEEDED``, in one ClusterRole bound to the daemon's
    ServiceAccount; no other Role or ClusterRole."""
    problems = []
    roles = [d for d in objects(m) if d["kind"] in ("Role", "ClusterRole")]
    if [r["kind"] for r in roles] != ["ClusterRole"]:
        return [f"want exactly one ClusterRole and no Role, found {[r['kind'] for r in roles]}"]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in roles[0].get("rules", []):
        if rule.get("nonResourceURLs") or rule.get("resourceNames"):
            problems.append(f"unexpected rule shape {rule}")
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                granted.setdefault((group, resource), set()).update(rule.get("verbs", []))
    if granted != RBAC_NEEDED:
        problems.append(f"ClusterRole grants {granted}, want exactly {RBAC_NEEDED}")
    binding = one(m, "ClusterRoleBinding")
    sa = one(m, "ServiceAccount")["metadata"]
    if binding["roleRef"] != {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": roles[0]["metadata"]["name"]}:
        problems.append(f"ClusterRoleBinding roleRef {binding['roleRef']} is not the ClusterRole")
    want_subject = {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    if binding.get("subjects") != [want_subject]:
        problems.append(f"ClusterRoleBinding subjects {binding.get('subjects')}, want [{want_subject}]")
    return problems


def namespace_problems(m: Manifests) -> list[str]:
    """The Namespace exists; namespaced objects live in it; cluster-scoped
    objects carry no namespace."""
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    problems = []
    if one(m, "Namespace")["metadata"]["name"] != NAMESPACE:
        problems.append(f"Namespace is not {NAMESPACE}")
    for d in objects(m):
        ns = d["metadata"].get("namespace")
        if d["kind"] in cluster_scoped and ns is not None:
            problems.append(f"{d['kind']} is cluster-scoped but has namespace {ns}")
        if d["kind"] not in cluster_scoped and ns != NAMESPACE:
            problems.append(f"{d['kind']}/{d['metadata']['name']} is in namespace {ns!r}, want {NAMESPACE}")
    return problems


def config_problems(m: Manifests) -> list[str]:
    """The ConfigMap's config.yaml documents the main settings at their
    defaults, and every path it configures is mounted from the host."""
    cfg = _config(m)
    want = {
        "resource_name": "fracplugin.io/gpu-memory",
        "device_unit": "GiB",
        "annotation_prefix": "nvidia.com/container.",
        "reserve_mib": 1024,
        "fail_open": False,
        "log_format": "json",
        **DAEMON_DEFAULT_HOST_PATHS,
    }
    problems = [f"config.yaml {k}={cfg.get(k)!r}, want {v!r}" for k, v in want.items() if cfg.get(k) != v]
    paths = {k: v for k, v in cfg.items() if isinstance(v, str) and v.startswith("/")}
    problems += host_path_problems(m, paths)
    return problems


def dockerfile_problems(text: str, dockerignore: str) -> list[str]:
    """Multi-stage build, final stage on an nvidia/cuda base (ARG defaults
    resolved), ENTRYPOINT, HEALTHCHECK on the health port, and every file the
    build COPYs from the context re-included by the allow-list .dockerignore."""
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.strip().startswith("#")]
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)$", "\n".join(lines), re.M))
    problems = []
    froms = [ln for ln in lines if ln.upper().startswith("FROM ")]
    if len(froms) < 2:
        problems.append("the Dockerfile must be multi-stage (a builder and a final stage)")
    final_image = re.sub(r"\$\{(\w+)\}", lambda g: args.get(g.group(1), ""), froms[-1].split()[1]) if froms else ""
    if not final_image.startswith("nvidia/cuda:"):
        problems.append(f"final stage must be an nvidia/cuda base, is {final_image!r}")
    final = lines[lines.index(froms[-1]) :] if froms else []
    entry = [ln for ln in final if ln.upper().startswith("ENTRYPOINT ")]
    if not entry or json.loads(entry[-1].split(None, 1)[1]) != ["fracplugin", "run"]:
        problems.append('ENTRYPOINT must be ["fracplugin", "run"]')
    health = [ln for ln in final if ln.upper().startswith("HEALTHCHECK ")]
    if not health or f":{HEALTH_PORT}/healthz" not in health[-1]:
        problems.append(f"HEALTHCHECK must probe :{HEALTH_PORT}/healthz")
    allowed = {ln.strip()[1:].rstrip("/") for ln in dockerignore.splitlines() if ln.strip().startswith("!")}
    for ln in lines:
        if ln.upper().startswith("COPY ") and "--from=" not in ln:
            for src in ln.split()[1:-1]:
                if src.rstrip("/") not in allowed:
                    problems.append(f"COPY {src}: not re-included by .dockerignore")
    return problems


# ---------------------------------------------------------------- tests on the real files


@pytest.fixture(scope="module")
def manifests() -> Manifests:
    return load_manifests()


def test_manifest_files_present(manifests: Manifests) -> None:
    kinds = sorted(d["kind"] for d in objects(manifests))
    assert kinds == sorted(
        ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "DaemonSet"]
    )
    # both roles (issue 12, ADR 0009): the doors roll, MPS is replaced only on purpose
    assert {d["metadata"]["name"] for d in objects(manifests) if d["kind"] == "DaemonSet"} == {"fracplugin", MPS_DS}


def mps_role_problems(m: Manifests) -> list[str]:
    """The two roles of daemonset/ (ADR 0009): fracplugin-mps runs ``--role mps``
    (OnDelete, no liveness probe: a container restart would end every client's
    MPS server; hostPID; the MPS root at its host path; none of the
    doors' sockets) and fracplugin runs ``--role doors`` (RollingUpdate); both
    name the same ``--mps-api-socket`` under the shared host directory."""
    problems = []
    mps, doors = _ds(m, "mps"), _ds(m)
    pod, c = _pod(m, "mps"), _container(m, "mps")
    args, dargs = c.get("args", []), _container(m).get("args", [])

    def flag(a: list[str], name: str) -> str | None:
        return a[a.index(name) + 1] if name in a[:-1] else None

    if mps["spec"].get("updateStrategy", {}).get("type") != "OnDelete":
        problems.append(f"{MPS_DS} updateStrategy must be OnDelete")
    if doors["spec"].get("updateStrategy", {}).get("type") != "RollingUpdate":
        problems.append("fracplugin (doors) must roll (RollingUpdate)")
    if flag(args, "--role") != "mps" or flag(dargs, "--role") != "doors":
        problems.append(f"roles: {MPS_DS} args {args}, fracplugin args {dargs}: want --role mps / --role doors")
    sock = flag(args, "--mps-api-socket")
    if sock is None or sock != flag(dargs, "--mps-api-socket") or not sock.startswith(DEFAULTS.mps_root + "/"):
        problems.append(f"both roles must name the same --mps-api-socket under {DEFAULTS.mps_root}: {sock}")
    if "livenessProbe" in c:
        problems.append(f"{MPS_DS} must have no livenessProbe (a restart ends every MPS client's server)")
    if pod.get("hostPID") is not True:
        problems.append(f"{MPS_DS} needs hostPID (MPS clients are host PIDs)")
    host = {v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v}
    for doors_only in ("/var/run/nri", "/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"):
        if doors_only in host:
            problems.append(f"{MPS_DS} mounts {doors_only}, which only the doors need")
    mounts = {x["mountPath"] for x in c.get("volumeMounts", [])}
    if not any(DEFAULTS.mps_root == p or DEFAULTS.mps_root.startswith(p.rstrip("/") + "/") for p in mounts & host):
        problems.append(f"{MPS_DS} must mount the MPS root {DEFAULTS.mps_root} at its host path")
    if pod.get("nodeSelector") != _pod(m).get("nodeSelector") or pod.get("tolerations") != _pod(m).get("tolerations"):
        problems.append(f"{MPS_DS} must run on exactly the nodes of fracplugin")
    if mps["spec"]["selector"] == doors["spec"]["selector"]:
        problems.append("the two DaemonSets must not share a selector")
    return problems


def test_both_roles_are_deployed(manifests: Manifests) -> None:
    assert mps_role_problems(manifests) == []


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_schemas_strict(manifests: Manifests, version: str) -> None:
    assert schema_problems(manifests, version) == []


def test_kustomization_lists_every_file(manifests: Manifests) -> None:
    assert kustomization_problems(manifests) == []


def test_every_default_host_path_is_mounted(manifests: Manifests) -> None:
    assert host_path_problems(manifests, DAEMON_DEFAULT_HOST_PATHS) == []


def test_cdi_spec_dirs_are_mounted_read_only(manifests: Manifests) -> None:
    """The daemon reads the node's CDI specs (ADR 0025b): each default and
    configured spec directory is a hostPath mounted at the same path, read-only."""
    cfg = _config(manifests)
    assert cfg["cdi_spec_dirs"] == list(DEFAULTS.cdi_spec_dirs)
    dirs = {f"cdi_spec_dirs[{i}]": d for i, d in enumerate(DEFAULTS.cdi_spec_dirs)}
    assert host_path_problems(manifests, dirs) == []
    c = _container(manifests)
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    assert all(mounts[d].get("readOnly") is True for d in DEFAULTS.cdi_spec_dirs), mounts


def test_pod_spec(manifests: Manifests) -> None:
    assert pod_problems(manifests) == []


def test_least_privilege(manifests: Manifests) -> None:
    assert security_problems(manifests) == []


def test_daemon_leaves_a_node_during_a_gpu_operator_driver_upgrade(manifests: Manifests) -> None:
    assert driver_upgrade_problems(manifests) == []


def test_node_admits_follows_kubernetes_operator_semantics() -> None:
    """The evaluator the driver-upgrade check relies on: terms ORed,
    expressions ANDed, NotIn/DoesNotExist true for an absent label."""
    pod = {"nodeSelector": {"a": "1"}, "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "b", "operator": "NotIn", "values": ["x"]},
                                                    {"key": "c", "operator": "DoesNotExist"}]},
                              {"matchExpressions": [{"key": "c", "operator": "Gt", "values": ["5"]}]}]}}}}
    assert node_admits(pod, {"a": "1"}) is True
    assert node_admits(pod, {"a": "2"}) is False
    assert node_admits(pod, {"a": "1", "b": "x"}) is False
    assert node_admits(pod, {"a": "1", "b": "y"}) is True
    assert node_admits(pod, {"a": "1", "c": "3"}) is False
    assert node_admits(pod, {"a": "1", "b": "x", "c": "6"}) is True


def test_rbac_needed_is_what_the_code_calls() -> None:
    assert api_verbs_used() == RBAC_NEEDED


def test_rbac_exact(manifests: Manifests) -> None:
    assert rbac_problems(manifests) == []


def test_namespaces(manifests: Manifests) -> None:
    assert namespace_problems(manifests) == []


def test_configmap(manifests: Manifests) -> None:
    assert config_problems(manifests) == []


def test_dockerfile() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text(), DOCKERIGNORE.read_text()) == []


def test_image_tag_is_package_version(manifests: Manifests) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    (k,) = manifests["kustomization.yaml"]
    assert _container(manifests)["image"] == f"fracplugin:{version}"
    # `kustomize edit set image` may add a newName (the registry); the tag stays the version.
    assert [i.get("newTag") for i in k.get("images", []) if i.get("name") == "fracplugin"] == [version]


# ---------------------------------------------------------------- negative tests: a broken copy fails


def _mps_args(edit: Callable[[list[str]], list[str]]) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        c = _container(m, "mps")
        c["args"] = edit(list(c["args"]))

    return mutate


def _drop_volume(name: str) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        pod = _pod(m)
        pod["volumes"] = [v for v in pod["volumes"] if v["name"] != name]
        c = _container(m)
        c["volumeMounts"] = [x for x in c["volumeMounts"] if x["name"] != name]

    return mutate


def _set_mount_path(name: str, path: str) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        for x in _container(m)["volumeMounts"]:
            if x["name"] == name:
                x["mountPath"] = path

    return mutate


def _set(getter: Callable[[Manifests], dict[str, Any]], key: str, value: Any) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        getter(m)[key] = value

    return mutate


def _add_rule(rule: dict[str, Any]) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        one(m, "ClusterRole")["rules"].append(rule)

    return mutate


def _set_config(key: str, value: Any) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        cm = one(m, "ConfigMap")
        cfg = yaml.safe_load(cm["data"]["config.yaml"])
        cfg[key] = value
        cm["data"]["config.yaml"] = yaml.safe_dump(cfg)

    return mutate


def _unlist(filename: str) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        m["kustomization.yaml"][0]["resources"].remove(filename)

    return mutate


def _readiness_port(m: Manifests) -> None:
    _container(m)["readinessProbe"]["httpGet"]["port"] = 9090


def _no_gpu_toleration(m: Manifests) -> None:
    _pod(m)["tolerations"] = [t for t in _pod(m)["tolerations"] if t.get("key") != "nvidia.com/gpu"]


def _selector_mismatch(m: Manifests) -> None:
    _ds(m)["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "other"


def _sc(m: Manifests) -> dict[str, Any]:
    return _container(m)["securityContext"]


def _add_cap(cap: str) -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        _sc(m)["capabilities"]["add"].append(cap)

    return mutate


def _drop_cap(cap: str, role: str = "doors") -> Callable[[Manifests], None]:
    def mutate(m: Manifests) -> None:
        add = _container(m, role)["securityContext"]["capabilities"]["add"]
        add.remove(cap)

    return mutate


def _drop_affinity_key(role: str, key: str) -> Callable[[Manifests], None]:
    """Remove every expression on ``key`` from the role's required terms."""

    def mutate(m: Manifests) -> None:
        req = _pod(m, role)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        for t in req["nodeSelectorTerms"]:
            t["matchExpressions"] = [e for e in t["matchExpressions"] if e["key"] != key]

    return mutate


def _require_client_label(m: Manifests) -> None:
    """The reference's own shape: the client label as a plain nodeSelector,
    which keeps the daemon off every node without the GPU Operator."""
    _pod(m)["nodeSelector"][GPU_DEPLOY_CLIENT] = "true"


def _second_daemonset_privileged(m: Manifests) -> None:
    """A second DaemonSet (as the MPS role's fracplugin-mps) that is privileged."""
    mps = copy.deepcopy(_ds(m))
    mps["metadata"]["name"] = "fracplugin-mps"
    mps["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    m["daemonset.yaml"].append(mps)


def _no_seccomp(m: Manifests) -> None:
    _pod(m).pop("securityContext")


MUTATIONS: list[tuple[str, Callable[[Manifests], None], Callable[[Manifests], list[str]], str]] = [
    ("no NRI volume", _drop_volume("nri"), lambda m: host_path_problems(m, DAEMON_DEFAULT_HOST_PATHS), "/var/run/nri/nri.sock"),
    ("no run volume", _drop_volume("run"), lambda m: host_path_problems(m, DAEMON_DEFAULT_HOST_PATHS), "state_dir"),
    ("MPS root mounted elsewhere", _set_mount_path("run", "/mps"), lambda m: host_path_problems(m, DAEMON_DEFAULT_HOST_PATHS), "mps_root"),
    ("hostPID off", _set(_pod, "hostPID", False), pod_problems, "hostPID"),
    ("not node-critical", _set(_pod, "priorityClassName", "default"), pod_problems, "system-node-critical"),
    ("readiness on wrong port", _readiness_port, pod_problems, "readinessProbe port"),
    ("no liveness probe", lambda m: _container(m).pop("livenessProbe"), pod_problems, "no livenessProbe"),
    ("no GPU toleration", _no_gpu_toleration, pod_problems, "nvidia.com/gpu:NoSchedule"),
    ("selector mismatch", _selector_mismatch, pod_problems, "does not match template labels"),
    ("mount without volume", lambda m: _pod(m)["volumes"].pop(), pod_problems, "has no volume"),
    ("config not passed", _set(_container, "args", []), pod_problems, "--config"),
    ("unknown field", _set(_container, "imagePullPolicyy", "Always"), lambda m: schema_problems(m, K8S_VERSIONS[0]), "imagePullPolicyy"),
    ("wrong type", _set(_pod, "hostPID", "yes"), lambda m: schema_problems(m, K8S_VERSIONS[-1]), "hostPID"),
    ("bad probe shape", _set(_container, "startupProbe", {"httpGet": {"path": "/healthz"}}), lambda m: schema_problems(m, K8S_VERSIONS[0]), "startupProbe"),
    ("extra verb", _add_rule({"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]}), rbac_problems, "delete"),
    ("unused pods get", _add_rule({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}), rbac_problems, "get"),
    ("unused events patch", _add_rule({"apiGroups": [""], "resources": ["events"], "verbs": ["patch"]}), rbac_problems, "patch"),
    ("privileged", _set(_sc, "privileged", True), security_problems, "privileged must not be set"),
    ("privilege escalation", _set(_sc, "allowPrivilegeEscalation", True), security_problems, "allowPrivilegeEscalation"),
    ("writable root", _set(_sc, "readOnlyRootFilesystem", False), security_problems, "readOnlyRootFilesystem"),
    ("no seccomp", _no_seccomp, security_problems, "seccompProfile must be RuntimeDefault"),
    ("unconfined seccomp", _set(_sc, "seccompProfile", {"type": "Unconfined"}), security_problems, "'Unconfined'"),
    ("capabilities kept", _set(_sc, "capabilities", {"add": ["KILL"]}), security_problems, "drop must be [ALL]"),
    ("SYS_ADMIN added", _add_cap("SYS_ADMIN"), security_problems, "['SYS_ADMIN']"),
    ("DAC_READ_SEARCH dropped", _drop_cap("DAC_READ_SEARCH"), security_problems, "lacks ['DAC_READ_SEARCH']"),
    ("MPS role without SYS_PTRACE", _drop_cap("SYS_PTRACE", "mps"), security_problems,
     "fracplugin-mps container mps: capabilities.add lacks ['SYS_PTRACE']"),
    ("no driver-upgrade affinity", lambda m: _pod(m).pop("affinity"), driver_upgrade_problems,
     "paused-for-driver-upgrade"),
    ("MPS role ignores the upgrade state", _drop_affinity_key("mps", DRIVER_UPGRADE_STATE), driver_upgrade_problems,
     "DaemonSet fracplugin-mps on a node with {'nvidia.com/gpu-driver-upgrade-state': 'upgrade-required'}"),
    ("client label required, absent blocks", _require_client_label, driver_upgrade_problems,
     "no GPU Operator labels"),
    ("CAP_NET_ADMIN added", _add_cap("CAP_NET_ADMIN"), security_problems, "['NET_ADMIN']"),
    ("host network", _set(_pod, "hostNetwork", True), security_problems, "hostNetwork"),
    ("second DaemonSet privileged", _second_daemonset_privileged, security_problems,
     "DaemonSet fracplugin-mps container fracplugin: privileged"),
    ("extra resource", _add_rule({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}), rbac_problems, "secrets"),
    ("kustomization misses a file", _unlist("daemonset.yaml"), kustomization_problems, "does not list daemonset.yaml"),
    ("configured path not mounted", _set_config("state_dir", "/var/lib/elsewhere"), config_problems, "/var/lib/elsewhere"),
    ("fail-open default flipped", _set_config("fail_open", True), config_problems, "fail_open"),
    ("health port drift", _set_config("health_address", "0.0.0.0:9999"), pod_problems, "health_address"),
    ("MPS role rolls", lambda m: _ds(m, "mps")["spec"].update(updateStrategy={"type": "RollingUpdate"}),
     mps_role_problems, "OnDelete"),
    ("MPS role with a liveness probe",
     lambda m: _container(m, "mps").update(livenessProbe=copy.deepcopy(_container(m)["livenessProbe"])),
     mps_role_problems, "no livenessProbe"),
    ("MPS role runs the doors", _mps_args(lambda a: [x.replace("mps", "doors") if x == "mps" else x for x in a]),
     mps_role_problems, "--role mps"),
    ("roles name different API sockets",
     _mps_args(lambda a: [("/run/fracplugin/mps/other.sock" if x.endswith("api.sock") else x) for x in a]),
     mps_role_problems, "same --mps-api-socket"),
    ("MPS role mounts the NRI socket",
     lambda m: _pod(m, "mps")["volumes"].append({"name": "nri", "hostPath": {"path": "/var/run/nri"}}),
     mps_role_problems, "only the doors need"),
    ("MPS root not at its host path",
     lambda m: [x.update(mountPath="/mps") for x in _container(m, "mps")["volumeMounts"] if x["name"] == "run"],
     mps_role_problems, "MPS root"),
]


@pytest.mark.parametrize(("mutate", "check", "needle"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_broken_copy_is_caught(
    manifests: Manifests, mutate: Callable[[Manifests], None], check: Callable[[Manifests], list[str]], needle: str
) -> None:
    assert check(manifests) == []  # the real files pass this check ...
    broken = copy.deepcopy(manifests)
    mutate(broken)
    problems = check(broken)
    assert any(needle in p for p in problems), problems  # ... the broken copy does not


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda t: t.replace('ENTRYPOINT ["fracplugin", "run"]', 'ENTRYPOINT ["fracplugin"]'), "ENTRYPOINT"),
        (lambda t: t.replace(f":{HEALTH_PORT}/healthz", ":9999/healthz"), "HEALTHCHECK"),
        (lambda t: t.replace("ARG BASE=nvidia/cuda:", "ARG BASE=python:3.11-slim#"), "nvidia/cuda"),
        (lambda t: t.replace("COPY src ./src", "COPY src ./src\nCOPY tests ./tests"), "COPY tests"),
    ],
    ids=["entrypoint", "healthcheck-port", "final-base", "unlisted-copy"],
)
def test_broken_dockerfile_is_caught(edit: Callable[[str], str], needle: str) -> None:
    text, ignore = DOCKERFILE.read_text(), DOCKERIGNORE.read_text()
    broken = edit(text)
    assert broken != text
    assert any(needle in p for p in dockerfile_problems(broken, ignore))


def test_api_verbs_used_sees_a_new_call(tmp_path: Path) -> None:
    """The derivation is not a constant: a call added to the source shows up (and
    the real ClusterRole, which lacks it, would then fail test_rbac_exact)."""
    (tmp_path / "x.py").write_text("v1.read_namespaced_pod(name, ns)\nv1.patch_namespaced_event(n, ns, body)\n"
                                   "create_container(pod)  # not an API call\n")
    assert api_verbs_used(tmp_path) == {("", "pods"): {"get"}, ("", "events"): {"patch"}}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_documented_networkpolicy(manifests: Manifests, version: str) -> None:
    """docs/networkpolicy-metrics.yaml (ADR 0008) validates, selects the daemon's
    pods and opens the metrics port to one namespace only."""
    doc = yaml.safe_load((REPO / "docs" / "networkpolicy-metrics.yaml").read_text())
    assert schema_problems({"networkpolicy.yaml": [doc]}, version) == []
    labels = _ds(manifests)["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in doc["spec"]["podSelector"]["matchLabels"].items())
    metrics_rules = [r for r in doc["spec"]["ingress"] if any(p["port"] == METRICS_PORT for p in r["ports"])]
    assert len(metrics_rules) == 1 and metrics_rules[0]["from"][0]["namespaceSelector"]["matchLabels"]
