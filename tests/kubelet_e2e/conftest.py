"""Fixtures of the kubelet e2e test: one cluster per kubelet version (module
scope), fracplugin with both doors, pods created through the API server.

Under ``make kubelet-e2e`` (``FRACPLUGIN_E2E_REQUIRED=1``) a missing binary or
missing root FAILS with what is missing; run by hand without them the tests
are skipped with the same message (never silently).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import cluster as k

REQUIRED = os.environ.get("FRACPLUGIN_E2E_REQUIRED") == "1"
BENCH = k.REPO / "build" / "bench.json"
KLOG_TS = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d{6})")


def unavailable(msg: str) -> None:
    """Fail under ``make kubelet-e2e``, skip when run by hand."""
    if REQUIRED:
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def record(key: str, value: Any) -> None:
    """Merge a measurement (a number) into build/bench.json, the flat file
    ``make bench`` writes (docs/benchmarks.md); keys name the kubelet version."""
    BENCH.parent.mkdir(exist_ok=True)
    doc = json.loads(BENCH.read_text()) if BENCH.exists() else {}
    doc[key] = value
    tmp = BENCH.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, BENCH)


def klog_time(line: str) -> float | None:
    """Wall-clock seconds (epoch) of a klog line ``I1130 19:50:01.123456 ...``."""
    m = KLOG_TS.match(line)
    if not m:
        return None
    year = time.gmtime().tm_year
    dt = datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
    return (dt - datetime(1970, 1, 1)).total_seconds()


class Daemon(k.Proc):
    """``fracplugin run`` with both doors on the simulated node, attached to
    the cluster's containerd (NRI) and kubelet (device plugin), reading pods
    from the API server."""

    def __init__(self, c: k.Cluster) -> None:
        base = c.base
        self.health = f"127.0.0.1:{k.h.free_port()}"
        argv = [k.REPO / ".venv" / "bin" / "fracplugin", "run",
                "--simulate-node", k.REPO / "examples" / "nodes" / "gpu-node-1.yaml",
                "--nri-socket", c.ctrd.nri_sock,
                "--device-plugin-dir", k.DEVICE_PLUGIN_DIR,
                "--pod-resources-socket", c.podresources_sock,
                "--kubeconfig", c.kubeconfig, "--node-name", k.NODE,
                "--state-dir", base / "fp-state",
                "--mps-control-binary", k.REPO / "tests" / "fakes" / "nvidia-cuda-mps-control",
                "--mps-root", base / "mps",
                "--health-address", self.health, "--metrics-address", "127.0.0.1:0",
                "--log-format", "text"]
        super().__init__("fracplugin", argv, base / "fracplugin.log")

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://{self.health}/status", timeout=5) as r:
            return json.loads(r.read())

    def dp(self) -> dict:
        """The device plugin part of /status."""
        return self.status()["device_plugin"] or {}


@pytest.fixture(scope="session", params=k.kube_versions())
def kbins(request) -> k.KubeBinaries:
    if os.geteuid() != 0:
        unavailable("the kubelet e2e test must run as root (kubelet, containerd, runc)")
    try:
        return k.KubeBinaries.find(request.param)
    except k.HarnessError as e:
        unavailable(str(e))
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def cluster(kbins, request) -> k.Cluster:
    """etcd + apiserver + kubelet + containerd, node Ready; one per kubelet
    version (pytest groups the tests by version), torn down after its tests."""
    try:
        lock = k.acquire_lock()
    except k.HarnessError as e:
        pytest.fail(str(e), pytrace=False)
    k.cleanup_device_plugin_dir()
    base = k.new_base()
    c = k.Cluster(kbins, base)

    def fin() -> None:
        keep = k.REPO / "build" / "kubelet-e2e-logs" / kbins.version
        keep.mkdir(parents=True, exist_ok=True)
        for log in base.glob("*.log"):  # for the CI artefacts / a failure's post-mortem
            shutil.copy(log, keep / log.name)
        k.cleanup_base(base, c)
        lock.close()
    request.addfinalizer(fin)
    t0 = time.monotonic()
    try:
        c.start()
    except k.HarnessError as e:
        logs = "\n".join(f"--- {p.name}:\n{p.tail(25)}" for p in (c.etcd, c.apiserver, c.kubelet) if p)
        pytest.fail(f"cluster {kbins.version} did not come up: {e}\n{logs}", pytrace=False)
    record(f"kubelet_e2e.{kbins.version}.cluster_start_s", round(time.monotonic() - t0, 1))
    print(f"cluster {kbins.version} up in {time.monotonic() - t0:.1f}s under {base}")
    return c


def start_daemon(c: k.Cluster) -> Daemon:
    """Start fracplugin and wait until kubelet advertises every device Healthy
    (node allocatable = capacity = the device count) and /status is ready."""
    d = Daemon(c)
    try:
        k.wait_for(lambda: d.check() or d.status()["ready"], 60, "fracplugin /status ready")
        k.wait_for(lambda: d.check() or d.dp().get("registered"), 30, "fracplugin registered")
        k.wait_for(lambda: (d.status().get("pod_source") or {}).get("ready"), 30, "fracplugin's pod source synced")
    except k.HarnessError as e:
        pytest.fail(f"{e}\n--- fracplugin:\n{d.tail()}\n--- kubelet:\n{c.kubelet.tail(15)}", pytrace=False)
    return d


@pytest.fixture(scope="session")
def daemon_box(cluster, request) -> dict:
    """A mutable holder of the current daemon (tests restart it)."""
    box = {"d": start_daemon(cluster)}
    request.addfinalizer(lambda: box["d"].stop())
    return box


@pytest.fixture
def daemon(daemon_box, cluster) -> Daemon:
    """The running daemon (restarted when an earlier test left it stopped)."""
    if not daemon_box["d"].alive():
        daemon_box["d"] = start_daemon(cluster)
    return daemon_box["d"]


class Pods:
    """Pods a test created through the API server; deleted at teardown."""

    def __init__(self, c: k.Cluster) -> None:
        self.c = c
        self.names: list[str] = []

    def create(self, manifest: dict) -> str:
        self.c.api().create_namespaced_pod("default", manifest)
        self.names.append(manifest["metadata"]["name"])
        return manifest["metadata"]["name"]

    def get(self, name: str) -> Any:
        return self.c.api().read_namespaced_pod(name, "default")

    def wait_running(self, name: str, timeout: float = 90) -> Any:
        def running():
            p = self.get(name)
            if p.status.phase == "Failed":
                raise k.HarnessError(f"pod {name} failed: {p.status.reason}: {p.status.message}")
            cs = p.status.container_statuses or []
            return p if cs and all(s.state.running for s in cs) else None
        return k.wait_for(running, timeout, f"pod {name} running", interval=0.3)

    def container_id(self, name: str, container: str = "app") -> str:
        p = self.get(name)
        for s in p.status.container_statuses or []:
            if s.name == container:
                return s.container_id.split("://", 1)[-1]
        raise k.HarnessError(f"pod {name} has no container {container}")

    def delete_all(self) -> None:
        from kubernetes.client import V1DeleteOptions

        for n in self.names:
            try:
                self.c.api().delete_namespaced_pod(n, "default", body=V1DeleteOptions(grace_period_seconds=0))
            except Exception:  # noqa: BLE001 - already gone
                pass
        for n in self.names:
            try:
                k.wait_for(lambda: _gone(self.c, n), 60, f"pod {n} deleted")
            except k.HarnessError:
                pass
        self.names.clear()


def _gone(c: k.Cluster, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        c.api().read_namespaced_pod(name, "default")
    except ApiException as e:
        return e.status == 404
    return False


@pytest.fixture
def pods(cluster, request) -> Pods:
    p = Pods(cluster)
    request.addfinalizer(p.delete_all)
    return p


def container_env(c: k.Cluster, cid: str) -> dict[str, str]:
    out = c.ctrd.crictl("exec", cid, "env").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def container_mounts(c: k.Cluster, cid: str) -> dict[str, str]:
    """mount point -> per-mount options (mountinfo field 6) inside the container."""
    out = c.ctrd.crictl("exec", cid, "cat", "/proc/self/mountinfo").stdout
    return {f[4]: f[5] for f in (line.split() for line in out.splitlines()) if len(f) > 5}


def kubelet_lines(c: k.Cluster, offset: int, needle: str) -> list[str]:
    return [ln for ln in c.kubelet.log_since(offset).splitlines() if needle in ln]


def restart_kubelet(c: k.Cluster, sig: int = signal.SIGTERM) -> float:
    """Stop kubelet with ``sig``, start it again; returns the new
    kubelet.sock's ctime (epoch seconds). Both signals leave the old
    kubelet.sock behind (D4) until the new kubelet's device manager removes
    it and creates its own: wait for a new (inode, ctime), not for the file
    (the inode number is often reused)."""
    st0 = c.kubelet_sock.stat()
    old = (st0.st_ino, st0.st_ctime_ns)

    def new_sock():
        try:
            st = c.kubelet_sock.stat()
        except FileNotFoundError:
            return None
        return st if (st.st_ino, st.st_ctime_ns) != old else None
    c.kubelet_stop(sig)
    assert c.kubelet_sock.exists(), "kubelet removed kubelet.sock when stopped (D4 says it stays)"
    c.kubelet_start()
    return k.wait_for(new_sock, 30, "the new kubelet.sock", interval=0.01).st_ctime


def expected_devices() -> int:
    """Devices the simulated node advertises: sum of memory_mib // 1024 per GPU."""
    import yaml

    node = yaml.safe_load((k.REPO / "examples" / "nodes" / "gpu-node-1.yaml").read_text())
    return sum(int(g["memory_mib"]) // 1024 for g in node["gpus"])


def podresources(c: k.Cluster) -> dict[tuple[str, str], list[str]]:
    """(pod name, container) -> our device IDs, from kubelet's PodResources List."""
    from fracplugin.kubelet.podresources import PodResourcesClient

    out = {}
    for p in PodResourcesClient(str(c.podresources_sock)).list():
        for ct in p.containers:
            ids = list(ct.devices.get(k.RESOURCE, ()))
            if ids:
                out[(p.name, ct.name)] = ids
    return out


def ledger(d: Daemon) -> list[dict]:
    return [t for g in d.status()["gpus"] for t in g.get("tenants", [])]


def wait_path(p: Path, timeout: float = 30) -> None:
    k.wait_for(lambda: p.exists(), timeout, str(p))
