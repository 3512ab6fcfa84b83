"""The Helm chart deploy/helm/fracplugin, checked with the real helm.

- ``helm lint --strict`` and ``helm template`` for each documented values set
  (default and ci/*-values.yaml);
- every rendered object validates strictly against the Kubernetes schemas
  (oldest and newest supported versions, as tests/unit/test_manifests.py) and
  the ServiceMonitor / PrometheusRule against the Prometheus operator's CRDs;
- the manifest checks of test_manifests.py (host paths, pod, RBAC, ConfigMap)
  hold for every rendering, and the split layout has its two roles as agreed;
- the rendered args and config.yaml are accepted by the daemon's own parser
  and config loader; the chart's defaults are the daemon's defaults;
- values.schema.json and the template rules reject bad values naming the key;
- daemonset/ is the current rendering (scripts/render_manifests.py);
- each check fails on a mutated copy.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from chartutil import (CHART, REPO, crd_schemas, manifest_checks, objects, render_manifests, rendered,
                       schema_problems, template, value_sets)
from fracplugin import cli
from fracplugin import config as fpconfig
from fracplugin.config import DEFAULTS

SETS = value_sets()
K8S_VERSIONS = manifest_checks.K8S_VERSIONS
AGREED_ROLES = ("all", "doors", "mps")  # `fracplugin run --role`, the two-role interface (issue 12)


@pytest.fixture(scope="module")
def renders(helm: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    return {name: rendered(helm, values) for name, values in SETS.items()}


def _daemonsets(m: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for d in objects(m) if d["kind"] == "DaemonSet"]


def _only(m: dict[str, list[dict[str, Any]]], ds: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A copy of ``m`` with ``ds`` the only DaemonSet (test_manifests' checks expect one)."""
    out = copy.deepcopy(m)
    out["daemonset.yaml"] = [copy.deepcopy(ds)]
    out.pop("dashboard.yaml", None)  # the dashboard's ConfigMap: the checks expect the daemon's only
    return out


def _config(m: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (cm,) = [d for d in objects(m) if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})]
    return yaml.safe_load(cm["data"]["config.yaml"])


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


# ---------------------------------------------------------------- lint, template, schemas


@pytest.mark.parametrize("name", SETS)
def test_lint_strict(helm: str, name: str) -> None:
    cmd = [helm, "lint", "--strict", str(CHART), "--namespace", "fracplugin-system"]
    for v in SETS[name]:
        cmd += ["--values", str(v)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", SETS)
def test_rendering_is_schema_valid(renders, name: str, version: str) -> None:
    assert objects(renders[name]), "the rendering is empty"
    assert schema_problems(renders[name], version) == []


def test_monitoring_set_renders_every_optional_object(renders) -> None:
    kinds = sorted(d["kind"] for d in objects(renders["monitoring"]))
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap",
                            "DaemonSet", "DaemonSet", "Service", "ServiceMonitor", "PrometheusRule"])
    assert {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")} <= set(crd_schemas())


def test_service_monitor_brings_its_service_and_needs_no_relabelling(helm: str) -> None:
    m = rendered(helm, [], ("serviceMonitor.enabled=true",))
    kinds = [d["kind"] for d in objects(m)]
    assert kinds.count("Service") == 1 and kinds.count("ServiceMonitor") == 1
    (mon,) = [d for d in objects(m) if d["kind"] == "ServiceMonitor"]
    (ep,) = mon["spec"]["endpoints"]
    assert ep["honorLabels"] is True and "relabelings" not in ep  # node is the daemon's own label
    alone = rendered(helm, [], ("metrics.service.enabled=true",))
    assert [d["kind"] for d in objects(alone)].count("Service") == 1
    assert "ServiceMonitor" not in [d["kind"] for d in objects(alone)]


def test_admission_set_renders_the_generated_policy(renders) -> None:
    """ci/admission-values.yaml: the ValidatingAdmissionPolicy and its binding,
    whose CEL is the generator's (fracplugin_demo.admission, ADR 0026) with the
    set's annotation prefix, and whose actions and failure policy are the set's."""
    from fracplugin_demo import admission

    m = renders["admission"]
    (policy,) = [d for d in objects(m) if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in objects(m) if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    want, want_binding = admission.policy_objects(prefix_expression='"gpu.example.com/container."',
                                                  validation_actions=["Warn"], failure_policy="Fail",
                                                  name=policy["metadata"]["name"])
    assert policy["spec"] == want["spec"]
    assert binding["spec"] == {**want_binding["spec"], "policyName": policy["metadata"]["name"]}
    assert policy["metadata"]["labels"] == binding["metadata"]["labels"] != {}
    assert not any(d["kind"].startswith("ValidatingAdmissionPolicy") for d in objects(renders["default"]))


def test_default_has_no_optional_object(renders) -> None:
    kinds = sorted(d["kind"] for d in objects(renders["default"]))
    # layout split by default (issue 12, ADR 0009): fracplugin-mps and fracplugin
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet",
                            "DaemonSet"])


# ---------------------------------------------------------------- what test_manifests.py checks, on every rendering


def _config_paths(m: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    cfg = _config(m)
    paths = {k: cfg[k] for k in ("mps_root", "state_dir")}
    if not cfg.get("no_nri"):
        paths["nri_socket"] = cfg["nri_socket"]
    if not cfg.get("no_device_plugin"):
        paths.update(device_plugin_dir=cfg["device_plugin_dir"], pod_resources_socket=cfg["pod_resources_socket"])
    return paths


def deployment_problems(m: dict[str, list[dict[str, Any]]], priority_class: str = "system-node-critical") -> list[str]:
    """test_manifests.py's least-privilege checks on every DaemonSet, and its
    pod, RBAC and host path checks on the DaemonSet that serves the doors, with the paths and ports its config.yaml names
    (a values set may move them) and ``priority_class`` (the set's value)."""
    problems = manifest_checks.rbac_problems(m)
    problems += manifest_checks.security_problems(m)  # every DaemonSet of the set (ADR 0008)
    doors = [ds for ds in _daemonsets(m) if "mps" not in ds["spec"]["selector"]["matchLabels"].values()]
    if len(doors) != 1:
        return problems + [f"want one DaemonSet serving the doors, found {len(doors)}"]
    one = _only(m, doors[0])
    cfg = _config(m)
    ports = {"HEALTH_PORT": fpconfig.parse_address(cfg["health_address"])[1],
             "METRICS_PORT": fpconfig.parse_address(cfg["metrics_address"])[1]}
    saved = {k: getattr(manifest_checks, k) for k in ports}
    try:
        for k, v in ports.items():
            setattr(manifest_checks, k, v)
        pod = manifest_checks.pod_problems(one)
    finally:
        for k, v in saved.items():
            setattr(manifest_checks, k, v)
    got_pc = doors[0]["spec"]["template"]["spec"].get("priorityClassName")
    if priority_class != "system-node-critical":  # test_manifests insists on the default; the set chose another
        pod = [p for p in pod if not p.startswith("priorityClassName must be")]
        if got_pc != priority_class:
            pod.append(f"priorityClassName is {got_pc!r}, the values set {priority_class!r}")
    problems += pod
    problems += manifest_checks.host_path_problems(one, _config_paths(m))
    return problems


def _set_value(name: str, key: str, default: Any) -> Any:
    for path in SETS[name]:
        doc = yaml.safe_load(path.read_text()) or {}
        if key in doc:
            return doc[key]
    return default


@pytest.mark.parametrize("name", SETS)
def test_rendering_passes_the_manifest_checks(renders, name: str) -> None:
    assert deployment_problems(renders[name], _set_value(name, "priorityClassName", "system-node-critical")) == []


def _node_for(name: str) -> dict[str, str]:
    """Labels of a node the set's DaemonSets are meant for: the chart's
    nodeSelector with the set's merged in (Helm merges maps)."""
    return {**manifest_checks.GPU_NODE, **_set_value(name, "nodeSelector", {}), "kubernetes.io/arch": "amd64"}


@pytest.mark.parametrize("name", SETS)
def test_every_set_leaves_a_node_during_a_gpu_operator_driver_upgrade(renders, name: str) -> None:
    """ADR 0008 decision 13, on each rendering: every DaemonSet runs on the
    set's nodes without GPU Operator labels or with them idle, and leaves while
    the client label is paused or a driver upgrade is in progress."""
    assert manifest_checks.driver_upgrade_problems(renders[name], _node_for(name)) == []


def test_user_affinity_is_kept_and_anded_with_the_gpu_operator_rules(renders) -> None:
    """custom-values.yaml has two required terms (ORed) and a preference: each
    term still decides, the GPU Operator rules apply under both, and the
    preference is kept."""
    node = _node_for("custom")
    for ds in _daemonsets(renders["custom"]):
        pod = ds["spec"]["template"]["spec"]
        admits = lambda labels: manifest_checks.node_admits(pod, labels)  # noqa: E731
        assert admits(node)
        assert not admits({**node, "kubernetes.io/arch": "arm64"})  # the user's first term
        assert admits({**node, "kubernetes.io/arch": "arm64", "example.com/gpu-pool": "a"})  # ... or the second
        assert not admits({**node, "kubernetes.io/arch": "arm64", "example.com/gpu-pool": "a",
                           manifest_checks.GPU_DEPLOY_CLIENT: "paused-for-driver-upgrade"})
        assert not admits({**node, manifest_checks.DRIVER_UPGRADE_STATE: "drain-required"})
        pref = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert pref[0]["preference"]["matchExpressions"][0]["key"] == "example.com/fast"


def test_driver_upgrade_rules_can_be_turned_off(helm: str) -> None:
    """gpuOperator.driverUpgrade=false: no chart affinity at all (the user's,
    none by default), so the DaemonSets stay on a node mid-upgrade."""
    m = rendered(helm, [], ("gpuOperator.driverUpgrade=false",))
    for ds in _daemonsets(m):
        pod = ds["spec"]["template"]["spec"]
        assert "affinity" not in pod
        assert manifest_checks.node_admits(pod, {**manifest_checks.GPU_NODE,
                                                 manifest_checks.DRIVER_UPGRADE_STATE: "pod-restart-required"})


def test_values_set_ports_reach_probes_and_config(renders) -> None:
    (ds,) = [d for d in _daemonsets(renders["custom"]) if d["metadata"]["name"] == "fracplugin"]  # the doors
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9102, "health": 9103}
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9102"
    cfg = _config(renders["custom"])
    assert (cfg["metrics_address"], cfg["health_address"]) == ("0.0.0.0:9102", "0.0.0.0:9103")
    assert c["args"][-1] == "--allocation-policy=spread" and cfg["allocate_deadline_s"] == 3
    assert c["image"] == "registry.example.com/gpu/fracplugin:0.1.0"
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


def test_default_rendering_is_the_daemon_defaults(renders) -> None:
    m = renders["default"]
    assert manifest_checks.config_problems(m) == []
    assert manifest_checks.host_path_problems(m, manifest_checks.DAEMON_DEFAULT_HOST_PATHS) == []


def split_problems(m: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The agreed two-role layout: fracplugin-mps runs --role mps with OnDelete,
    fracplugin runs --role doors with RollingUpdate, both with the same
    --mps-api-socket under the hostPath they both mount."""
    by_name = {d["metadata"]["name"]: d for d in _daemonsets(m)}
    if sorted(by_name) != ["fracplugin", "fracplugin-mps"]:
        return [f"want DaemonSets fracplugin and fracplugin-mps, found {sorted(by_name)}"]
    problems = []
    sockets = set()
    for name, role, strategy in (("fracplugin-mps", "mps", "OnDelete"), ("fracplugin", "doors", "RollingUpdate")):
        ds = by_name[name]
        pod = ds["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        args = c.get("args", [])
        got_role = args[args.index("--role") + 1] if "--role" in args[:-1] else None
        if got_role != role:
            problems.append(f"{name}: args {args} do not run --role {role}")
        if "--mps-api-socket" in args:
            sockets.add(args[args.index("--mps-api-socket") + 1])
        else:
            problems.append(f"{name}: no --mps-api-socket")
        if ds["spec"].get("updateStrategy", {}).get("type") != strategy:
            problems.append(f"{name}: updateStrategy {ds['spec'].get('updateStrategy')}, want {strategy}")
        if pod.get("hostPID") is not True:
            problems.append(f"{name}: hostPID must be true")
        mounts = {x["mountPath"] for x in c.get("volumeMounts", [])}
        if role == "mps" and {"/var/run/nri", "/var/lib/kubelet/device-plugins"} & mounts:
            problems.append(f"{name}: the MPS role mounts a door's socket directory: {sorted(mounts)}")
    if len(sockets) != 1:
        problems.append(f"the roles name different API sockets: {sorted(sockets)}")
    else:
        one = _only(m, by_name["fracplugin-mps"])
        problems += manifest_checks.host_path_problems(one, {"mps_api_socket": sockets.pop(), **{
            k: v for k, v in _config_paths(m).items() if k in ("mps_root", "state_dir")}})
    sel = [tuple(sorted(by_name[n]["spec"]["selector"]["matchLabels"].items())) for n in by_name]
    if len(set(sel)) != 2:
        problems.append("the two DaemonSets have the same selector")
    return problems


def test_split_layout_has_the_two_agreed_roles(renders) -> None:
    assert split_problems(renders["split"]) == []


@pytest.mark.parametrize("name", ["split", "custom"])
def test_mps_quit_in_either_pod_finds_the_mps_roles_socket(renders, name: str) -> None:
    """README's uninstall step runs `fracplugin mps-quit` in the fracplugin-mps
    pod with no flag; it reads FRACPLUGIN_MPS_API_SOCKET. Found by the cluster
    e2e (issue 24): with mps.apiSocket not the default (custom-values.yaml:
    /run/fp/mps/api.sock) the command looked at /run/fracplugin/mps/api.sock and
    failed "not reachable". Each container's env names its --mps-api-socket."""
    for ds in _daemonsets(renders[name]):
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        args = c["args"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env.get("FRACPLUGIN_MPS_API_SOCKET") == args[args.index("--mps-api-socket") + 1], ds["metadata"]["name"]
    if name == "custom":
        assert env["FRACPLUGIN_MPS_API_SOCKET"] == "/run/fp/mps/api.sock"


def test_readme_uninstall_ends_the_daemonsets_before_their_rbac(renders) -> None:
    """The operator guide's uninstall deletes every DaemonSet of the default rendering with
    foreground cascading (kubectl waits for the pods) before `helm uninstall`.
    Found by the cluster e2e (issue 24): `helm uninstall` alone deletes the
    ServiceAccount, ClusterRole and binding together with the DaemonSets, so
    the stopping doors' last node-condition patch (Unknown) was refused and the
    KAI conditions stayed True on a node without fracplugin."""
    text = (REPO / "docs" / "operator-guide.md").read_text()
    start = text.index("Uninstall (stopping MPS on purpose)")
    block = text[text.index("```sh", start) + 5 : text.index("```", text.index("```sh", start) + 5)]
    lines = [ln.split("#")[0].strip() for ln in block.strip().splitlines()]
    assert "fracplugin mps-quit" in lines[0], lines
    delete = lines[1].split()
    assert delete[:5] == ["kubectl", "-n", "fracplugin-system", "delete", "daemonset"], lines[1]
    assert "--cascade=foreground" in delete, lines[1]
    names = {d["metadata"]["name"] for d in _daemonsets(renders["default"])}
    assert names <= set(delete), (names, lines[1])
    assert lines[2].startswith("helm uninstall fracplugin"), lines


def test_readme_install_blocks_are_what_the_cluster_e2e_runs() -> None:
    """The operator guide's install, upgrade and uninstall blocks (both layouts) are read
    and run by make cluster-e2e (tests/cluster_e2e/readme.py, issue 24): each
    exists, each line is a helm command (run as it stands, test-only values
    files appended) or a kubectl line the test knows how to run through the
    API. A guide edit the cluster e2e could not follow fails here, in the
    fast suite, naming the line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cluster_e2e_readme", REPO / "tests" / "cluster_e2e" / "readme.py")
    assert spec is not None and spec.loader is not None
    readme = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme)
    blocks = readme.blocks_the_test_runs()
    install = readme.one(readme.INSTALL, "helm", "install")
    assert install[2:6] == ["fracplugin", "deploy/helm/fracplugin", "-n", "fracplugin-system"], install
    upgrade = readme.one(readme.UPGRADE, "helm", "upgrade")
    assert "--reuse-values" in upgrade and f"image.tag={readme.UPGRADE_TAG}" in upgrade, upgrade
    single = [a for a in blocks[readme.UNINSTALL_SINGLE] if a[0] == "kubectl"]
    assert [readme.kubectl_op(a)[0] for a in single] == ["delete-daemonsets-foreground"], single


def test_extra_volumes_reach_every_daemon_pod(helm: str) -> None:
    """extraVolumes / extraVolumeMounts (tests and advanced set-ups, e.g.
    tests/cluster_e2e/values-sim.yaml) land in each DaemonSet of both layouts,
    after the chart's own volumes and mounts, which stay unchanged."""
    sets = ("extraVolumes[0].name=sim", "extraVolumes[0].hostPath.path=/srv/sim",
            "extraVolumeMounts[0].name=sim", "extraVolumeMounts[0].mountPath=/opt/sim",
            "extraVolumeMounts[0].readOnly=true")
    for layout in ("split", "single"):
        base = {d["metadata"]["name"]: d for d in _daemonsets(rendered(helm, [], (f"layout={layout}",)))}
        m = rendered(helm, [], (f"layout={layout}", *sets))
        dss = _daemonsets(m)
        assert len(dss) == (2 if layout == "split" else 1)
        for ds in dss:
            pod = ds["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            pod0 = base[ds["metadata"]["name"]]["spec"]["template"]["spec"]
            assert pod["volumes"] == pod0["volumes"] + [{"name": "sim", "hostPath": {"path": "/srv/sim"}}]
            assert c["volumeMounts"] == pod0["containers"][0]["volumeMounts"] + [
                {"name": "sim", "mountPath": "/opt/sim", "readOnly": True}]
        for version in K8S_VERSIONS:
            assert schema_problems(m, version) == [], version


def test_cluster_e2e_values_file_renders(helm: str) -> None:
    """tests/cluster_e2e/values-sim.yaml (with the harness's machine-specific
    file's shape) renders and the daemon accepts its args: --simulate-node and
    --mps-control-binary point into the extra mounts."""
    sim = REPO / "tests" / "cluster_e2e" / "values-sim.yaml"
    m = rendered(helm, [sim], ("extraVolumes[0].name=fracplugin-test-nodes",
                               "extraVolumes[0].hostPath.path=/srv/nodes",
                               "extraVolumes[1].name=fracplugin-test-fakes",
                               "extraVolumes[1].hostPath.path=/srv/fakes"))
    for ds in _daemonsets(m):
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        assert c["imagePullPolicy"] == "Never"
        mounts = {x["mountPath"] for x in c["volumeMounts"]}
        for a in c["args"]:
            if a.startswith(("--simulate-node=", "--mps-control-binary=")):
                assert str(Path(a.split("=", 1)[1]).parent) in mounts, (a, mounts)
        _parse_run_args(c["args"])


# ---------------------------------------------------------------- what the daemon accepts


def _parse_run_args(args: list[str]) -> Any:
    """Parse the container's args with the daemon's own parser. The agreed
    two-role flags (--role, --mps-api-socket; issue 12) are checked here and
    removed while this daemon does not know them yet."""
    parser = cli.build_parser()
    known = {a for action in parser._subparsers._group_actions[0].choices["run"]._actions for a in action.option_strings}  # type: ignore[union-attr]
    rest = list(args)
    for flag in ("--role", "--mps-api-socket"):
        if flag in rest and flag not in known:
            i = rest.index(flag)
            value = rest[i + 1]
            if flag == "--role":
                assert value in AGREED_ROLES, f"--role {value} is not one of {AGREED_ROLES}"
            else:
                assert value.startswith("/"), f"--mps-api-socket {value} is not an absolute path"
            del rest[i : i + 2]
    return parser.parse_args(["run", *rest])


def daemon_config_problems(m: dict[str, list[dict[str, Any]]], tmp: Path) -> list[str]:
    """Every DaemonSet's args and the rendered config.yaml, through the
    daemon's own argument parser and config loader (``config.load``: the
    file's keys, types and every rule of ``config.validate``)."""
    problems = []
    cfg_file = tmp / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(_config(m)))
    for ds in _daemonsets(m):
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        try:
            ns = _parse_run_args(c.get("args", []))
        except AssertionError as exc:
            problems.append(f"{ds['metadata']['name']}: {exc}")
            continue
        except SystemExit:
            problems.append(f"{ds['metadata']['name']}: `fracplugin run` rejects args {c.get('args')}")
            continue
        if ns.config != "/etc/fracplugin/config.yaml":
            problems.append(f"{ds['metadata']['name']}: --config is {ns.config!r}")
        ns.config = str(cfg_file)
        try:
            fpconfig.load(ns, env={})
        except fpconfig.ConfigError as exc:
            problems.append(f"{ds['metadata']['name']}: the daemon rejects the rendered configuration: {exc}")
    return problems


@pytest.mark.parametrize("name", SETS)
def test_daemon_accepts_rendered_args_and_config(renders, name: str, tmp_path: Path) -> None:
    assert daemon_config_problems(renders[name], tmp_path) == []


def defaults_problems(values: dict[str, Any]) -> list[str]:
    """The chart's defaults (values.yaml) against the daemon's (config.DEFAULTS)."""
    d = DEFAULTS
    want = {
        ("metrics", "port"): fpconfig.parse_address(d.metrics_address)[1],
        ("health", "port"): fpconfig.parse_address(d.health_address)[1],
        ("hostPaths", "nriSocket"): d.nri_socket,
        ("hostPaths", "stateDir"): d.state_dir,
        ("hostPaths", "mpsRoot"): d.mps_root,
        ("hostPaths", "cdiSpecDirs"): list(d.cdi_spec_dirs),
        ("hostPaths", "kubeletRoot"): str(Path(d.device_plugin_dir).parent),
        ("devicePlugin", "resourceName"): d.resource_name,
        ("devicePlugin", "unit"): {1024: "GiB"}.get(d.device_unit_mib, f"{d.device_unit_mib}Mi"),
        ("nri", "pluginName"): d.nri_plugin_name,
        ("nri", "pluginIndex"): d.nri_plugin_idx,
        ("nri", "enabled"): not d.no_nri,
        ("devicePlugin", "enabled"): not d.no_device_plugin,
        ("mps", "enabled"): not d.no_mps,
        ("mps", "modes"): list(d.mps_modes),
        ("mps", "protocol"): d.mps_protocol,
        ("mps", "exclusiveProcess"): d.exclusive_process,
        ("annotationPrefix",): d.annotation_prefix,
        ("reserveMiB",): d.reserve_mib,
        ("nodeConditionTypes",): list(d.node_condition_types),
        ("maxClientsPerGpu",): d.max_clients_per_gpu,
        ("failOpen",): d.fail_open,
        ("overLimit",): d.over_limit,
        ("unfencedContainers",): d.unfenced_containers,
        ("log", "format"): d.log_format,
        ("log", "level"): d.log_level,
    }
    problems = []
    for path, expected in want.items():
        got: Any = values
        for k in path:
            got = got.get(k) if isinstance(got, dict) else None
        if got != expected:
            problems.append(f"values.yaml {'.'.join(path)}={got!r}, the daemon's default is {expected!r}")
    pod_resources = str(Path(d.pod_resources_socket).parent.parent)
    if pod_resources != values.get("hostPaths", {}).get("kubeletRoot"):
        problems.append(f"the daemon's PodResources socket {d.pod_resources_socket} is not under hostPaths.kubeletRoot")
    if not d.mps_root.startswith(values["hostPaths"]["run"] + "/") or not d.state_dir.startswith(values["hostPaths"]["run"] + "/"):
        problems.append(f"hostPaths.run={values['hostPaths']['run']!r} does not hold the daemon's default state and MPS roots")
    return problems


def test_chart_defaults_are_the_daemon_defaults() -> None:
    assert defaults_problems(_values()) == []


def test_chart_version_is_the_package_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version


# ---------------------------------------------------------------- bad values


BAD_VALUES = [
    ("log.format=xml", ["/log/format", "json", "text"]),
    ("layout=both", ["/layout", "single", "split"]),
    ("scheduler=volcano", ["/scheduler"]),
    ("nri.pluginIndex=100", ["/nri/pluginIndex", "99"]),
    ("maxClientsPerGpu=49", ["/maxClientsPerGpu", "48"]),
    ("metrics.port=70000", ["/metrics/port", "maximum"]),
    ("mps.modes={exclusive}", ["/mps/modes/0"]),
    ("mps.protocol=4", ["/mps/protocol"]),
    ("devicePlugin.unit=1TB", ["/devicePlugin/unit"]),
    ("hostPaths.nriSocket=nri.sock", ["/hostPaths/nriSocket"]),
    ("replicas=3", ["additional properties", "replicas"]),
    ("hostPaths.stateDir=/var/lib/fracplugin", ["hostPaths.stateDir", "/var/lib/fracplugin", "must lie under hostPaths.run"]),
    ("nri.enabled=false,scheduler=kai", ["nri.enabled=false", "kai", "leaves no door"]),
    ("extraConfig.mps_root=/x", ["extraConfig.mps_root", "set it there"]),
    ("layout=split,mps.apiSocket=/tmp/api.sock", ["mps.apiSocket", "/tmp/api.sock", "hostPaths.run"]),
    ("gpuOperator.driverUpgrade=sometimes", ["/gpuOperator/driverUpgrade"]),
    ("admissionPolicy.validationActions={Audit}", ["/admissionPolicy/validationActions/0", "Deny", "Warn"]),
    ("admissionPolicy.failurePolicy=Never", ["/admissionPolicy/failurePolicy", "Ignore", "Fail"]),
    ("admissionPolicy.enable=true", ["additional properties", "enable"]),
    ("extraVolumeMounts[0].name=x", ["/extraVolumeMounts/0", "mountPath"]),
    ("extraVolumes[0].hostPath.path=/x", ["/extraVolumes/0", "name"]),
]


@pytest.mark.parametrize(("setting", "needles"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_are_rejected_naming_the_key(helm: str, setting: str, needles: list[str]) -> None:
    out = template(helm, [], (setting,))
    assert out.returncode != 0, f"helm template accepted {setting}"
    for needle in needles:
        assert needle in out.stderr, out.stderr


def test_numbers_given_with_set_become_the_daemons_strings(helm: str, tmp_path: Path) -> None:
    # `--set nri.pluginIndex=5 --set mps.protocol=3` arrive as numbers; the daemon wants "05" and "3".
    m = rendered(helm, [], ("nri.pluginIndex=5", "mps.protocol=3"))
    cfg = _config(m)
    assert (cfg["nri_plugin_idx"], cfg["mps_protocol"]) == ("05", "3")
    assert daemon_config_problems(m, tmp_path) == []


# ---------------------------------------------------------------- daemonset/ is generated from the chart


def test_checked_in_manifests_are_current(helm: str, tmp_path: Path) -> None:
    render_manifests.render(helm, tmp_path)
    problems = render_manifests.compare(tmp_path, render_manifests.MANIFESTS)
    assert not problems, "daemonset/ is stale; run `make manifests`:\n" + "\n".join(problems)


def test_stale_manifests_are_detected(helm: str, tmp_path: Path) -> None:
    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    render_manifests.render(helm, fresh)
    shutil.copytree(fresh, stale)
    assert render_manifests.compare(fresh, stale) == []
    ds = stale / "daemonset.yaml"
    ds.write_text(ds.read_text().replace("memory: 1Gi", "memory: 2Gi"))
    (stale / "extra.yaml").write_text("{}\n")
    (stale / "rbac.yaml").unlink()
    assert render_manifests.compare(fresh, stale) == [
        "missing: rbac.yaml", "unexpected (stale): extra.yaml", "differs: daemonset.yaml"]


# ---------------------------------------------------------------- each check fails on a mutated copy


def test_lint_fails_on_a_broken_chart(helm: str, tmp_path: Path) -> None:
    broken = tmp_path / "fracplugin"
    shutil.copytree(CHART, broken)
    t = broken / "templates" / "service.yaml"
    t.write_text(t.read_text().replace("{{- end }}", "", 1))  # an unclosed {{ if }}
    out = subprocess.run([helm, "lint", "--strict", str(broken)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "service.yaml" in out.stdout + out.stderr


def test_lint_strict_fails_on_a_warning(helm: str, tmp_path: Path) -> None:
    broken = tmp_path / "fracplugin"
    shutil.copytree(CHART, broken)
    chart = yaml.safe_load((broken / "Chart.yaml").read_text())
    chart["version"] = "not-semver"
    (broken / "Chart.yaml").write_text(yaml.safe_dump(chart))
    out = subprocess.run([helm, "lint", "--strict", str(broken)], capture_output=True, text=True)
    assert out.returncode != 0 and "version" in out.stdout + out.stderr


def _set(kind: str, path: tuple[str, ...], value: Any) -> Callable[[dict[str, list[dict[str, Any]]]], None]:
    def mutate(m: dict[str, list[dict[str, Any]]]) -> None:
        (d,) = [o for o in objects(m) if o["kind"] == kind][:1]
        for k in path[:-1]:
            d = d[k][0] if isinstance(d[k], list) else d[k]
        d[path[-1]] = value

    return mutate


SCHEMA_MUTATIONS = [
    ("daemonset unknown field", _set("DaemonSet", ("spec", "template", "spec", "hostPIDD"), True), "hostPIDD"),
    ("daemonset wrong type", _set("DaemonSet", ("spec", "template", "spec", "hostPID"), "yes"), "hostPID"),
    ("servicemonitor unknown field", _set("ServiceMonitor", ("spec", "endpoints", "honourLabels"), True), "honourLabels"),
    ("prometheusrule wrong type", _set("PrometheusRule", ("spec", "groups", "rules"), "none"), "rules"),
    ("service bad port", _set("Service", ("spec", "ports", "port"), "metrics"), "port"),
]


@pytest.mark.parametrize(("mutate", "needle"), [m[1:] for m in SCHEMA_MUTATIONS], ids=[m[0] for m in SCHEMA_MUTATIONS])
def test_schema_check_fails_on_a_mutated_rendering(renders, mutate, needle: str) -> None:
    m = copy.deepcopy(renders["monitoring"])
    assert schema_problems(m, K8S_VERSIONS[-1]) == []
    mutate(m)
    problems = schema_problems(m, K8S_VERSIONS[0]) + schema_problems(m, K8S_VERSIONS[-1])
    assert any(needle in p for p in problems), problems


def _ds_args(name: str, args: list[str]) -> Callable[[dict[str, list[dict[str, Any]]]], None]:
    def mutate(m: dict[str, list[dict[str, Any]]]) -> None:
        (ds,) = [d for d in _daemonsets(m) if d["metadata"]["name"] == name]
        ds["spec"]["template"]["spec"]["containers"][0]["args"] = args

    return mutate


def _cfg(key: str, value: Any) -> Callable[[dict[str, list[dict[str, Any]]]], None]:
    def mutate(m: dict[str, list[dict[str, Any]]]) -> None:
        (cm,) = [d for d in objects(m) if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})]
        cfg = yaml.safe_load(cm["data"]["config.yaml"])
        cfg[key] = value
        cm["data"]["config.yaml"] = yaml.safe_dump(cfg)

    return mutate


def _ds_field(name: str, path: tuple[str, ...], value: Any) -> Callable[[dict[str, list[dict[str, Any]]]], None]:
    def mutate(m: dict[str, list[dict[str, Any]]]) -> None:
        (d,) = [x for x in _daemonsets(m) if x["metadata"]["name"] == name]
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return mutate


RENDER_MUTATIONS = [
    ("daemon rejects a config key", "default", _cfg("log_colour", "red"), daemon_config_problems, "log_colour"),
    ("daemon rejects a config value", "default", _cfg("mps_protocol", "4"), daemon_config_problems, "--mps-protocol"),
    ("daemon rejects a flag", "default", _ds_args("fracplugin", ["--config", "/etc/fracplugin/config.yaml", "--colour"]),
     daemon_config_problems, "rejects args"),
    ("unknown role", "split", _ds_args("fracplugin-mps", ["--config", "/etc/fracplugin/config.yaml", "--role", "gpu",
                                                          "--mps-api-socket", "/run/fracplugin/mps/api.sock"]),
     daemon_config_problems, "gpu"),
    ("mps role rolls", "split", _ds_field("fracplugin-mps", ("spec", "updateStrategy"), {"type": "RollingUpdate"}),
     split_problems, "want OnDelete"),
    ("roles disagree on the socket", "split",
     _ds_args("fracplugin", ["--config", "/etc/fracplugin/config.yaml", "--role", "doors", "--mps-api-socket", "/run/fracplugin/other.sock"]),
     split_problems, "different API sockets"),
    ("doors without least privilege", "kai", lambda m: [d for d in _daemonsets(m) if d["metadata"]["name"] == "fracplugin"][0]["spec"]["template"]["spec"]["containers"][0].update(securityContext={}),
     deployment_problems, "capabilities.drop must be [ALL]"),
    ("mps role privileged", "split", lambda m: next(d for d in _daemonsets(m) if d["metadata"]["name"] == "fracplugin-mps")[
        "spec"]["template"]["spec"]["containers"][0]["securityContext"].update(privileged=True),
     deployment_problems, "DaemonSet fracplugin-mps container"),
    ("configured NRI socket not mounted", "default", _cfg("nri_socket", "/run/containerd/nri.sock"), deployment_problems,
     "/run/containerd/nri.sock"),
]


@pytest.mark.parametrize(("values", "mutate", "check", "needle"), [m[1:] for m in RENDER_MUTATIONS],
                         ids=[m[0] for m in RENDER_MUTATIONS])
def test_render_checks_fail_on_a_mutated_copy(renders, tmp_path: Path, values: str, mutate, check, needle: str) -> None:
    def run(m: Any) -> list[str]:
        return check(m, tmp_path) if check is daemon_config_problems else check(m)

    assert run(renders[values]) == []
    broken = copy.deepcopy(renders[values])
    mutate(broken)
    problems = run(broken)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(("path", "value", "needle"), [
    (("metrics", "port"), 9999, "metrics.port"),
    (("hostPaths", "mpsRoot"), "/run/fracplugin/mps2", "hostPaths.mpsRoot"),
    (("mps", "modes"), ["sm-sharing"], "mps.modes"),
    (("failOpen",), True, "failOpen"),
])
def test_defaults_check_fails_on_a_mutated_values_copy(path: tuple[str, ...], value: Any, needle: str) -> None:
    values = copy.deepcopy(_values())
    d = values
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    assert any(needle in p for p in defaults_problems(values))


# ---------------------------------------------------------------- monitoring objects are the checked files


def test_monitoring_objects_carry_the_checked_files(renders) -> None:
    m = renders["monitoring"]
    (rule,) = [d for d in objects(m) if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (dash,) = [d for d in objects(m) if d["kind"] == "ConfigMap" and "fracplugin.json" in d.get("data", {})]
    assert json.loads(dash["data"]["fracplugin.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    (svc,) = [d for d in objects(m) if d["kind"] == "Service"]
    (mon,) = [d for d in objects(m) if d["kind"] == "ServiceMonitor"]
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in mon["spec"]["selector"]["matchLabels"].items())
    assert [e["port"] for e in mon["spec"]["endpoints"]] == [p["name"] for p in svc["spec"]["ports"]]
    (ds,) = [d for d in _daemonsets(m) if d["metadata"]["name"] == "fracplugin"]  # the doors serve /metrics
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert svc["spec"]["ports"][0]["port"] == fpconfig.parse_address(DEFAULTS.metrics_address)[1]


def _notes(helm: str, tmp_path: Path, *sets: str) -> str:
    """NOTES.txt as `helm install` prints it (rendered by helm itself: a copy
    of the chart gets one template that includes NOTES.txt; `helm install
    --dry-run` would need a cluster)."""
    chart = tmp_path / "fracplugin"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "notes-render.yaml").write_text(
        'notes: |\n{{ include (print $.Template.BasePath "/NOTES.txt") . | indent 2 }}\n')
    out = template(helm, [], sets, chart=chart)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d and "notes" in d]
    assert len(docs) == 1
    return docs[0]["notes"]


def test_notes_tell_how_to_check_the_install(helm: str, tmp_path: Path) -> None:
    notes = _notes(helm, tmp_path)
    assert "kubectl -n fracplugin-system exec ds/fracplugin -- fracplugin status" in notes
    assert "port-forward ds/fracplugin 2112:2112" in notes and "/metrics" in notes
    assert "pod-security.kubernetes.io/enforce=privileged" in notes
    assert "fracplugin.io/gpu-memory".replace(".", "\\.") in notes


def test_notes_follow_the_values(helm: str, tmp_path: Path) -> None:
    notes = _notes(helm, tmp_path, "layout=split", "scheduler=kai", "metrics.port=9102", "namespace.create=true")
    assert "ds/fracplugin-mps" in notes and "OnDelete" in notes
    assert "port-forward ds/fracplugin 9102:9102" in notes
    assert "gpu-memory" not in notes  # no device plugin door with KAI
    assert "pod-security" not in notes  # the chart created the labelled namespace
    assert '@.type=="gpu-fractioning.nvidia.com/Ready"' in notes  # KAI's readiness gate (first of both names)
