"""CUDA memory limits per container through the daemon's real sockets (issue 23,
small failing inputs 2 and 3; ADR 0025).

``fracplugin run`` as a subprocess with the fake ``libnvidia-ml.so.1``
(tests/fakes/nvml, loaded by the real pynvml through LD_LIBRARY_PATH), a
cgroup tree under a temporary ``--cgroup-root`` (these machines run cgroup v1,
so the v2 root is a test tree), and the fake NRI runtime (tests/peers) driving
CreateContainer / StartContainer / RemoveContainer over the NRI socket.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from fracplugin_demo.subproc import die_with_parent
from tests.fakes import nvml as fake
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
INFERENCE = REPO / "examples" / "pods" / "inference-sm-sharing-4gpu.bound.yaml"
MIB = 1 << 20
GPUS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]


class Daemon:
    """``fracplugin run`` with the fake NVML library in its environment."""

    def __init__(self, root: Path, args: list[str], env: dict[str, str], simulate: bool = True) -> None:
        self.root = root
        self.state = root / "state"
        cmd = [sys.executable, "-m", "fracplugin.cli", "run", "--state-dir", str(self.state),
               "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0", "--log-format", "json",
               "--shutdown-timeout", "8", "--mps-root", str(root / "mps"), "--no-device-plugin", "--no-mps",
               "--nri-socket", str(root / "nri.sock"), *(["--simulate-node", str(NODE)] if simulate else []), *args]
        self.log_path = root / "daemon.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(die_with_parent(cmd), stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, cwd=str(root))
        ep = self.state / "endpoints.json"
        wait_until(lambda: ep.exists() or self.proc.poll() is not None, 30, lambda: f"daemon start:\n{self.logs()}")
        assert self.proc.poll() is None, self.logs()
        self.endpoints = json.loads(ep.read_text())

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, key: str = "health") -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://{self.endpoints[key]}{path}", timeout=5) as r:
                code, body = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read().decode()
        try:
            return code, json.loads(body)
        except ValueError:
            return code, body

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fpm", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def started(root: Path) -> Iterator[Any]:
    procs: list[Daemon] = []
    runtimes: list[Any] = []

    def start(args: list[str], *, v2: bool = True, mig: tuple[int, ...] = (), dmem: bool | str = True,
              simulate: bool = True, fail: tuple[tuple[str, str, int], ...] = ()) -> tuple[Daemon, Any, Path]:
        from nri_runtime import FakeNriRuntime

        cg = root / "cgroup"
        cg.mkdir(exist_ok=True)
        node = yaml.safe_load(NODE.read_text())
        if v2:
            (cg / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc dmem\n")
            if dmem == "fifo":
                os.mkfifo(cg / "dmem.capacity")  # nobody writes it: a blocking open would wait for ever
            elif dmem:
                (cg / "dmem.capacity").write_text("".join(
                    f"nvidia/{g['pci_bus_id'][4:].lower()}/vidmem {g['memory_mib'] * MIB}\n" for g in node["gpus"]))
        else:
            (cg / "memory").mkdir(exist_ok=True)  # v1: one directory per controller, no cgroup.controllers
        lib = fake.build_fake_nvml()
        nf = fake.node_file(root / "nvml-node", node, mig=mig, fail=fail)
        rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
        runtimes.append(rt)
        d = Daemon(root, ["--cgroup-root", str(cg), *args], fake.env(lib, nf, root / "limits"), simulate=simulate)
        procs.append(d)
        rt.wait_registered(15)
        return d, rt, cg

    yield start
    for d in procs:
        d.stop()
    for rt in runtimes:
        rt.close()


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of the family ``name`` in exposition ``text``, as
    (labels, value), parsed by prometheus-client's own text parser (so the
    order of labels, e.g. where the daemon's ``node`` label goes, does not matter)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(dict(smp.labels), smp.value) for fam in text_string_to_metric_families(text)
            for smp in fam.samples if smp.name == name]


def _pod_with_cgroup(cg: Path) -> tuple[Any, Any, Path]:
    """The seed inference pod's container with a systemd-driver cgroups path
    (containerd layout) and its leaf directory made under the test root."""
    from nri_runtime import pod_from_manifest

    pod, ctrs = pod_from_manifest(INFERENCE)
    c = ctrs[0]
    uid_ = pod.uid.replace("-", "_")
    c.linux.cgroups_path = f"kubepods-pod{uid_}.slice:cri-containerd:{c.id}"
    leaf = cg / "kubepods.slice" / f"kubepods-pod{uid_}.slice" / f"cri-containerd-{c.id}.scope"
    leaf.mkdir(parents=True)
    return pod, c, leaf


def test_apply_sets_soft_and_hard_on_the_leaf_of_each_gpu_and_reads_back(started: Any, root: Path) -> None:
    """Small failing input 2: no CDI spec on the node, hook unknown; with
    --memory-limits apply the daemon sets soft 40960 MiB / hard 61440 MiB on
    the container's leaf cgroup for each of its four GPUs and reads them back;
    status, /readyz detail and metrics say so; RemoveContainer zeroes the soft limit."""
    d, rt, cg = started(["--memory-limits", "apply"])
    wait_until(lambda: d.get("/readyz")[0] == 200, 15, lambda: f"ready: {d.get('/readyz')}\n{d.logs()}")
    detail = d.get("/readyz")[1]["checks"]["memory_limits"]["detail"]
    assert "cdi_hook" in detail and "memory limits apply" in detail, detail
    pod, c, leaf = _pod_with_cgroup(cg)
    adj = rt.create_container(pod, c)
    assert not hasattr(adj, "code"), adj
    assert rt.start_container(pod, c) is None
    held = fake.read_limits(root / "limits")
    assert {k: v for k, v in held.items() if k[1] == str(leaf)} == {
        (u, str(leaf)): (40960 * MIB, 61440 * MIB) for u in GPUS}, held
    st = d.get("/status")[1]["memory_limits"]
    [cl] = st["containers"]
    assert cl["enforced"] == "yes" and cl["cgroup"] == str(leaf)
    assert [(g["read_soft_bytes"], g["read_hard_bytes"], g["action"]) for g in cl["gpus"]] == \
        [(40960 * MIB, 61440 * MIB, "applied")] * 4
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "status", "--state-dir", str(d.state)],
                         capture_output=True, text=True, timeout=30)
    assert "ENFORCED" in out.stdout and "40960/61440" in out.stdout, out.stdout
    # per GPU tenant; the cgroup limit is what holds its total (issue 35 item 2)
    assert sum("door nri  ENFORCED yes  HOLDS cgroup" in line for line in out.stdout.splitlines()) == 4, out.stdout
    assert [t["holds"] for g in d.get("/status")[1]["gpus"] for t in g["tenants"]] == ["cgroup"] * 4
    code, text = d.get("/metrics", "metrics")
    assert code == 200, text
    node = yaml.safe_load(NODE.read_text())
    gpu0 = node["gpus"][0]
    # every series carries the daemon's node label; the per-GPU one dcgm-exporter's GPU labels
    # (gpu_uuid kept, deprecated) beside them (issue 27 item 3)
    want = {"namespace": pod.namespace, "pod": pod.name, "container": c.name, "gpu_uuid": GPUS[0],
            "UUID": GPUS[0], "gpu": str(gpu0["index"]), "modelName": gpu0["name"], "Hostname": node["node"],
            "kind": "hard", "source": "enforced", "node": node["node"]}
    assert (want, float(61440 * MIB)) in _samples(text, "fracplugin_container_cuda_memory_limit_bytes"), text
    assert ({"capability": "cgroup_v2", "node": node["node"]}, 1.0) in _samples(text, "fracplugin_node_capability")
    assert text.count("# TYPE fracplugin_container_gpu_memory_limit_bytes ") == 1  # the ledger's family, once
    assert ({"namespace": pod.namespace, "pod": pod.name, "container": c.name, "node": node["node"]}, 1.0) in \
        _samples(text, "fracplugin_container_cuda_memory_limit_enforced"), text
    rt.stop_container(pod, c)
    rt.remove_container(pod, c)
    wait_until(lambda: all(fake.read_limits(root / "limits").get((u, str(leaf)), (1, 0))[0] == 0 for u in GPUS), 10,
               lambda: f"soft limits zeroed: {fake.read_limits(root / 'limits')}")
    assert all(fake.read_limits(root / "limits")[(u, str(leaf))] == (0, 61440 * MIB) for u in GPUS)


def test_verify_reports_unenforced_and_sets_nothing(started: Any, root: Path) -> None:
    """--memory-limits verify: nothing is set; the container is ENFORCED no
    with the planned and read values."""
    d, rt, cg = started(["--memory-limits", "verify", "--memory-limits-policy", "warn"])
    pod, c, leaf = _pod_with_cgroup(cg)
    rt.create_container(pod, c)
    assert rt.start_container(pod, c) is None  # policy warn: it starts
    assert fake.read_limits(root / "limits") == {}
    [cl] = d.get("/status")[1]["memory_limits"]["containers"]
    assert cl["enforced"] == "no" and "planned soft 40960 MiB / hard 61440 MiB" in cl["reason"], cl
    # not in force, and no MPS daemon (--no-mps): nothing holds its total (issue 35 item 2)
    assert [t["holds"] for g in d.get("/status")[1]["gpus"] for t in g["tenants"]] == ["none"] * 4


def test_nvml_refusal_with_policy_refuse_fails_the_start(started: Any, root: Path) -> None:
    """NVML says NO_PERMISSION: the reason is in status; --memory-limits-policy
    refuse fails StartContainer with it (never a traceback)."""
    d, rt, cg = started(["--memory-limits", "apply", "--memory-limits-policy", "refuse"],
                        fail=(("SetMemoryLimits", "*", fake.NVML_ERROR_NO_PERMISSION),))
    pod, c, _leaf = _pod_with_cgroup(cg)
    rt.create_container(pod, c)
    err = rt.start_container(pod, c)
    assert err is not None and "not enforced" in err.message and "needs root" in err.message, err
    [cl] = d.get("/status")[1]["memory_limits"]["containers"]
    assert cl["enforced"] == "no" and "Insufficient Permissions" in cl["reason"]


def test_cgroup_v1_node_not_ready_and_refuses_naming_the_capability(started: Any) -> None:
    """Small failing input 3 (cgroup v1): /readyz not ready naming cgroup_v2
    (the KAI node condition follows readiness: MemoryLimitsNotEnforceable);
    with policy refuse the fractional container is refused at CreateContainer
    with a message naming the capability."""
    d, rt, cg = started(["--memory-limits", "auto", "--memory-limits-policy", "refuse"], v2=False)
    code, body = d.get("/readyz")
    assert code == 503 and body["checks"]["memory_limits"]["ready"] is False
    assert "cgroup_v2" in body["checks"]["memory_limits"]["detail"]
    from nri_runtime import pod_from_manifest

    pod, ctrs = pod_from_manifest(INFERENCE)
    err = rt.create_container(pod, ctrs[0])
    assert getattr(err, "code", None) is not None and "cgroup_v2" in err.message, err
    code, text = d.get("/metrics", "metrics")
    assert [v for lbl, v in _samples(text, "fracplugin_node_capability") if lbl["capability"] == "cgroup_v2"] == [0.0]


def test_a_mig_gpu_from_nvml_is_excluded_and_the_other_gpus_enforce(started: Any) -> None:
    """Issue 33 input 3 (refines issue 23's MIG input): the daemon's inventory is the real NvmlInventory
    on the fake library with GPU 0 in MIG mode, ``auto`` + ``refuse``: the node stays ready, ``/readyz``
    names the excluded GPU, a pod naming GPU 0 is refused naming MIG, a node-placed one lands past it."""
    d, rt, _cg = started(["--memory-limits", "auto", "--memory-limits-policy", "refuse"], mig=(0,), simulate=False)
    wait_until(lambda: d.get("/readyz")[0] == 200, 15, lambda: f"ready: {d.get('/readyz')}")
    checks = d.get("/readyz")[1]["checks"]
    assert checks["memory_limits"]["ready"] and GPUS[0] in checks["gpus"]["detail"], checks
    assert "MIG mode" in checks["gpus"]["detail"]
    from nri_runtime import make_container, make_pod, pod_from_manifest

    pod, ctrs = pod_from_manifest(INFERENCE)  # names all four GPUs
    err = rt.create_container(pod, ctrs[0])
    assert getattr(err, "code", None) == 9 and f"GPU 0 ({GPUS[0]}), which is in MIG mode" in err.message, err
    placed = make_pod("placed", "team", "uid-placed", {"nvidia.com/container.app.gpu-memory.request": "8Gi"})
    adj = rt.create_container(placed, make_container(placed, "app"))
    env = {e.key: e.value for e in adj.env if not e.key.startswith("-")}
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPUS[1] and env["NVIDIA_GPU_MEMORY_REQUEST"] == "8192", adj


def test_off_changes_nothing(started: Any, root: Path) -> None:
    """--memory-limits off: no check, no NVML call, no section."""
    d, rt, cg = started(["--memory-limits", "off"], v2=False)
    wait_until(lambda: d.get("/readyz")[0] == 200, 15, lambda: f"ready: {d.get('/readyz')}")
    assert "memory_limits" not in d.get("/readyz")[1]["checks"]
    pod, c, _leaf = _pod_with_cgroup(cg)
    rt.create_container(pod, c)
    assert rt.start_container(pod, c) is None
    assert fake.read_limits(root / "limits") == {}


def test_cgroup_v1_policy_warn_withholds_the_toolkit_hook_env(started: Any) -> None:
    """On a node that cannot enforce, policy warn admits the container but
    does not hand it NVIDIA_GPU_MEMORY_REQUEST/LIMIT (the toolkit hook would
    fail its start on cgroup v1); the rest of the plan's env is there."""
    from nri_runtime import effective_env, pod_from_manifest

    d, rt, _cg = started(["--memory-limits", "auto", "--memory-limits-policy", "warn"], v2=False)
    pod, ctrs = pod_from_manifest(INFERENCE)
    adj = rt.create_container(pod, ctrs[0])
    assert not hasattr(adj, "code"), adj
    env = effective_env(ctrs[0], adj)
    assert "NVIDIA_GPU_MEMORY_REQUEST" not in env and "NVIDIA_GPU_MEMORY_LIMIT" not in env, env
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50" and env["NVIDIA_VISIBLE_DEVICES"] == ",".join(GPUS)


def test_not_enforced_becomes_a_warning_event(started: Any, root: Path) -> None:
    """With API access, a container whose limit is not in force gets a Warning
    Event MemoryLimitNotEnforced on its pod naming the GPU, the planned and
    read values and the reason (here: verify mode, nothing set the limits)."""
    from tests.peers.posts_api import Api

    api = Api(root)
    kubeconfig = api.kubeconfig
    try:
        d, rt, cg = started(["--memory-limits", "verify", "--kubeconfig", str(kubeconfig),
                             "--node-condition-types", "", "--memory-limits-policy", "warn"])
        pod, c, _leaf = _pod_with_cgroup(cg)
        rt.create_container(pod, c)
        assert rt.start_container(pod, c) is None
        wait_until(lambda: api.events("MemoryLimitNotEnforced"), 15,
                   lambda: f"a MemoryLimitNotEnforced Event; posted {api.posted}\n{d.logs()[-3000:]}")
        [ev] = api.events("MemoryLimitNotEnforced")
        assert ev["type"] == "Warning" and ev["action"] == "StartContainer"
        assert ev["involvedObject"]["uid"] == pod.uid and ev["involvedObject"]["fieldPath"] == "spec.containers{app}"
        msg = ev["message"]
        assert all(u in msg for u in GPUS), msg
        assert "planned soft 40960 MiB / hard 61440 MiB, read soft 0 MiB / hard max" in msg, msg
        assert "verify mode" in msg
    finally:
        api.close()


def test_a_fifo_at_dmem_capacity_blocks_nothing(started: Any) -> None:
    """Issue 34 input 8: a FIFO at ``<cgroup-root>/dmem.capacity`` (nobody writes it) blocks neither
    ``/readyz`` nor CreateContainer: the gate skips the file (not a regular file) and asks NVML (the fake
    library answers), so the node is ready and the container admitted. Before, both waited for ever."""
    from nri_runtime import pod_from_manifest

    d, rt, cg = started(["--memory-limits", "apply", "--memory-limits-policy", "refuse"], dmem="fifo")
    wait_until(lambda: d.get("/readyz")[0] == 200, 15, lambda: f"readyz: {d.get('/readyz')}")
    acc = [c for c in d.get("/status")[1]["memory_limits"]["node"]["capabilities"] if c["name"] == "memory_accounting"]
    assert acc and acc[0]["ok"] and "NVML" in acc[0]["detail"], acc
    assert "dmem.capacity is not a regular file" in acc[0]["detail"], acc  # why the dmem file was not used
    pod, ctrs = pod_from_manifest(INFERENCE)
    adj = rt.create_container(pod, ctrs[0])
    assert getattr(adj, "code", None) is None and adj.env, adj


def _drift(d: Daemon) -> dict[str, float]:
    return {lab["UUID"]: v for lab, v in _samples(d.get("/metrics", "metrics")[1],
                                                  "fracplugin_memory_limits_reservation_drift_bytes")}


def _zeroed(d: Daemon) -> dict[str, float]:
    return {lab["outcome"]: v for lab, v in _samples(d.get("/metrics", "metrics")[1],
                                                     "fracplugin_memory_limits_soft_zeroed_total")}


def _delete(leaf: Path) -> None:
    """As runc deletes a leaf: the directory goes at once (renamed away, then removed)."""
    gone = leaf.with_name("deleted-" + leaf.name)
    leaf.rename(gone)
    shutil.rmtree(gone)


def test_soft_limit_zeroed_when_the_leaf_empties_and_leftovers_show_as_drift(started: Any, root: Path) -> None:
    """Issue 35 item 5, containerd's order (the leaf is deleted before NRI StopContainer/RemoveContainer;
    ADR 0036). Container 1's last process exits (the kernel writes ``populated 0`` to its leaf's
    ``cgroup.events``): the daemon zeroes its soft limit on each GPU (hard kept) while the leaf exists,
    then the runtime deletes the leaf and sends Stop/Remove: nothing is left on the parents. Container 2's
    leaf is deleted before the daemon can zero it: the fake driver keeps its 40960 MiB reserved on the
    pod, QoS and kubepods cgroups, and /metrics and /status show it as drift on each GPU."""
    d, rt, cg = started(["--memory-limits", "apply"])
    pod, c, leaf = _pod_with_cgroup(cg)
    (leaf / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert not hasattr(rt.create_container(pod, c), "code") and rt.start_container(pod, c) is None
    assert _drift(d) == {u: 0.0 for u in GPUS} and _zeroed(d) == {"zeroed": 0, "leaf_gone": 0, "failed": 0}
    (leaf / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    wait_until(lambda: all(fake.read_limits(root / "limits")[(u, str(leaf))] == (0, 61440 * MIB) for u in GPUS), 10,
               lambda: f"soft limits zeroed: {fake.read_limits(root / 'limits')}\n{d.logs()[-2000:]}")
    _delete(leaf)
    rt.stop_container(pod, c)
    rt.remove_container(pod, c)
    assert _zeroed(d)["zeroed"] == 4 and _drift(d) == {u: 0.0 for u in GPUS}
    c2 = copy.deepcopy(c)
    c2.id = "e" * 64
    c2.linux.cgroups_path = c.linux.cgroups_path.replace(c.id, c2.id)
    leaf2 = leaf.with_name(f"cri-containerd-{c2.id}.scope")
    leaf2.mkdir()
    (leaf2 / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert not hasattr(rt.create_container(pod, c2), "code") and rt.start_container(pod, c2) is None
    _delete(leaf2)
    rt.stop_container(pod, c2)
    rt.remove_container(pod, c2)
    wait_until(lambda: _zeroed(d)["leaf_gone"] == 4, 10, lambda: f"{_zeroed(d)}\n{d.logs()[-2000:]}")
    assert _drift(d) == {u: float(40960 * MIB) for u in GPUS}
    rows = d.get("/status")[1]["memory_limits"]["soft_reservations"]
    assert sorted((r["gpu"], os.path.relpath(r["cgroup"], cg), r["drift"]) for r in rows) == \
        [(u, str(leaf.parent.relative_to(cg)), 40960 * MIB) for u in GPUS], rows
    leaf.parent.rmdir()  # the pod's cgroup goes: the reservation stays, one level up
    assert _drift(d) == {u: float(40960 * MIB) for u in GPUS}


def test_synchronize_adopts_a_running_container_and_zeroes_it_when_it_ends(started: Any, root: Path) -> None:
    """A container running before this daemon saw its StartContainer (the daemon restarted): Synchronize
    lists it RUNNING with fracplugin's env; the daemon reads and applies its limits (status lists it) and
    watches its leaf, so its soft limit is zeroed when it ends."""
    from fracplugin._proto import nri_pb2
    from nri_runtime import effective_env

    d, rt, cg = started(["--memory-limits", "apply"])
    pod, c, leaf = _pod_with_cgroup(cg)
    (leaf / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    adj = rt.create_container(pod, c)
    running = copy.deepcopy(c)
    running.state = nri_pb2.CONTAINER_RUNNING
    del running.env[:]
    running.env.extend(f"{k}={v}" for k, v in effective_env(c, adj).items())
    rt.synchronize([pod], [running])
    wait_until(lambda: [x["container_id"] for x in d.get("/status")[1]["memory_limits"]["containers"]] == [c.id], 15,
               lambda: f"adopted: {d.get('/status')[1]['memory_limits']}\n{d.logs()[-2000:]}")
    assert all(fake.read_limits(root / "limits")[(u, str(leaf))] == (40960 * MIB, 61440 * MIB) for u in GPUS)
    (leaf / "cgroup.events").write_text("populated 0\n")
    wait_until(lambda: all(fake.read_limits(root / "limits")[(u, str(leaf))][0] == 0 for u in GPUS), 10,
               lambda: f"{fake.read_limits(root / 'limits')}\n{d.logs()[-2000:]}")
