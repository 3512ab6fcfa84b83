"""A one-node Kubernetes on this machine for the kubelet e2e test: etcd,
kube-apiserver, kubelet, containerd + runc, and fracplugin with both doors on.

Every process is started and stopped here; all state lives under one short
temporary base directory (``/tmp/fpk8s-XXXX``, marker file ``.fracplugin-k8s``)
except what kubelet insists on: its device plugin directory is
``/var/lib/kubelet/device-plugins`` whatever ``--root-dir`` says (kubelet's
``v1beta1.DevicePluginPath`` constant; fact D1 of issue 11). ``cleanup_base``
removes our sockets and checkpoint from there (and ``/var/lib/kubelet`` itself
when this harness created it, marker ``.fracplugin-k8s``).

Set-up facts (issue 11, found on this machine: cgroup v1, no systemd, 2 cores):

* kubelet >= 1.35 refuses cgroup v1 unless ``failCgroupV1: false``; cgroup
  driver ``cgroupfs``; ``cgroupsPerQOS: false`` and no node allocatable
  enforcement, so kubelet creates no cgroup hierarchy of its own;
* image GC off (``imageGCHighThresholdPercent: 100``): nothing can be pulled,
  the busybox image is imported once;
* kube-apiserver on loopback needs ``--endpoint-reconciler-type=none``; without
  a controller-manager there is no default ServiceAccount
  (``--disable-admission-plugins=ServiceAccount`` and
  ``automountServiceAccountToken: false``); without a scheduler pods carry
  ``spec.nodeName``; without a CNI pods use ``hostNetwork``;
* authentication by a static token file, authorization ``AlwaysAllow``; the
  apiserver's serving certificate is self-generated (clients skip TLS
  verification: loopback only);
* only 127.0.0.1 addresses and free ports for everything that listens
  (kubelet refuses a loopback ``--node-ip``: "nodeIP can't be loopback
  address", so the node's reported address is kubelet's own choice).

Concurrency model: synchronous; one pytest process drives one cluster. A
``flock`` on ``/run/fracplugin-k8s-e2e.lock`` keeps two harness runs (whose
kubelets would share ``/var/lib/kubelet/device-plugins``) apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import harness as h  # noqa: E402  (tests/e2e/harness.py: containerd, crictl, run, wait_for)

from fracplugin_demo.subproc import die_with_parent  # noqa: E402

MARKER = ".fracplugin-k8s"
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_ROOT = Path("/var/lib/kubelet")
LOCK_PATH = "/run/fracplugin-k8s-e2e.lock"
NODE = "gpu-node-1"  # the simulated node's name (examples/nodes/gpu-node-1.yaml)
TOKEN = "fracplugin-e2e-admin-token"
DEFAULT_KUBE_VERSIONS = "v1.37.2 v1.35.4"
DEFAULT_ETCD_VERSION = "v3.7.3"
DEFAULT_CONTAINERD_VERSION = "v2.3.7"
RESOURCE = "fracplugin.io/gpu-memory"
HarnessError = h.HarnessError
wait_for = h.wait_for


def kube_versions() -> list[str]:
    """kubelet/apiserver versions to test (``$FRACPLUGIN_KUBE_VERSIONS``)."""
    return os.environ.get("FRACPLUGIN_KUBE_VERSIONS", DEFAULT_KUBE_VERSIONS).split()


def version_tuple(v: str) -> tuple[int, ...]:
    """``"v1.37.2"`` -> ``(1, 37, 2)``."""
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in v.lstrip("v").split("."))


@dataclass(frozen=True)
class KubeBinaries:
    """kubelet, kube-apiserver and etcd for one Kubernetes version (plus the
    containerd set of tests/e2e)."""

    version: str
    kubelet: Path
    apiserver: Path
    etcd: Path
    ctrd: h.Binaries

    @classmethod
    def find(cls, version: str) -> "KubeBinaries":
        """Locate the cached builds. Raises HarnessError naming every missing
        file and the command that builds it."""
        c = h.cache_dir()
        kbin = c / f"kubernetes-{version}" / "bin"
        etcd_v = os.environ.get("ETCD_VERSION", DEFAULT_ETCD_VERSION)
        etcd = c / f"etcd-{etcd_v}" / "bin" / "etcd"
        missing = [str(p) for p in (kbin / "kubelet", kbin / "kube-apiserver", etcd)
                   if not (p.exists() and os.access(p, os.X_OK))]
        if missing:
            raise HarnessError("kubelet e2e binaries missing: " + ", ".join(missing)
                               + f"; build them with `KUBE_VERSIONS={version} tests/kubelet_e2e/build.sh`"
                               " (or run `make kubelet-e2e`, which builds then tests)")
        ctrd = h.Binaries.find(os.environ.get("CONTAINERD_VERSION", DEFAULT_CONTAINERD_VERSION))
        return cls(version, kbin / "kubelet", kbin / "kube-apiserver", etcd, ctrd)


class Proc:
    """A background process of ours (own session, dies with the test process),
    stopped by PID: ``signal`` then, after ``timeout``, SIGKILL."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log = log
        with open(log, "ab") as f:
            f.write(f"\n==== start {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n".encode())
            f.flush()
            self.proc = subprocess.Popen(die_with_parent(self.argv), stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        """Raise HarnessError (with the log tail) when the process has exited."""
        if self.proc.poll() is not None:
            raise HarnessError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return f"(no {self.name} log)"

    def log_since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0


def new_base() -> Path:
    """A fresh marked base directory ``/tmp/fpk8s-XXXX`` (short: socket paths)."""
    base = Path(tempfile.mkdtemp(prefix="fpk8s-", dir="/tmp"))
    # 0755: the MPS root lives below it and MPS clients (containers, any UID)
    # must traverse every ancestor of the pipe directory (the supervisor
    # refuses to start its daemons otherwise).
    base.chmod(0o755)
    (base / MARKER).write_text(f"{os.getpid()}\n")
    return base


def acquire_lock() -> Any:
    """Hold the harness lock for the life of the returned file (non-blocking:
    raises HarnessError when another run holds it)."""
    f = open(LOCK_PATH, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise HarnessError(f"another kubelet e2e run holds {LOCK_PATH} (its kubelet would share "
                           f"{DEVICE_PLUGIN_DIR})") from None
    return f


class Cluster:
    """etcd + kube-apiserver + kubelet + containerd under ``base``.

    ``start()`` brings everything up (apiserver ready, the node registered);
    ``kubelet_stop(sig)`` / ``kubelet_start()`` restart kubelet alone;
    ``api()`` is a kubernetes-client ``CoreV1Api`` with admin rights.
    """

    def __init__(self, bins: KubeBinaries, base: Path) -> None:
        self.bins = bins
        self.base = base
        self.ctrd = h.Containerd(bins.ctrd, base)
        self.etcd: Proc | None = None
        self.apiserver: Proc | None = None
        self.kubelet: Proc | None = None
        self.api_port = h.free_port()
        self.kubelet_port = h.free_port()
        self.kubelet_healthz_port = h.free_port()
        self.kubeconfig = base / "kubeconfig"
        self.kubelet_root = base / "kubelet"
        self._api: Any = None
        self.created_kubelet_root = False

    # ---- start ---------------------------------------------------------------
    def start(self) -> None:
        """Start containerd (image imported), etcd, kube-apiserver, kubelet;
        wait until the node is registered. Raises HarnessError."""
        self._prepare_dirs()
        self.ctrd.start()
        self.ctrd.import_image()
        self._start_etcd()
        self._start_apiserver()
        self.kubelet_start()
        # Never Ready: no CNI ("cni plugin not initialized"); hostNetwork pods
        # with spec.nodeName still run (no controller-manager taints the node).
        wait_for(self.node_registered, 120, f"node {NODE} registered")

    def _prepare_dirs(self) -> None:
        if not KUBELET_ROOT.exists():
            KUBELET_ROOT.mkdir(parents=True)
            (KUBELET_ROOT / MARKER).write_text(f"{self.base}\n")
            self.created_kubelet_root = True
        DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)

    def _start_etcd(self) -> None:
        peer, client = h.free_port(), h.free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.etcd = Proc("etcd", [
            self.bins.etcd, "--name", "e2e", "--data-dir", self.base / "etcd",
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{h.free_port()}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ], self.base / "etcd.log")

        def up() -> bool:
            self.etcd.check()
            with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as r:
                return b'"true"' in r.read()
        wait_for(up, 60, "etcd /health")

    def _start_apiserver(self) -> None:
        d = self.base / "apiserver"
        d.mkdir()
        key = d / "sa.key"
        h.run(["openssl", "genrsa", "-out", key, "2048"])
        (d / "tokens.csv").write_text(f'{TOKEN},e2e-admin,e2e-admin,"system:masters"\n')
        self.apiserver = Proc("kube-apiserver", [
            self.bins.apiserver,
            "--etcd-servers", self.etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.api_port), "--cert-dir", d / "certs",
            "--token-auth-file", d / "tokens.csv",
            "--authorization-mode", "AlwaysAllow",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", key, "--service-account-signing-key-file", key,
            "--service-cluster-ip-range", "10.250.0.0/24",
            "--endpoint-reconciler-type", "none",
            "--disable-admission-plugins", "ServiceAccount",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--v", "1",
        ], self.base / "apiserver.log")
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {
                "server": f"https://127.0.0.1:{self.api_port}", "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": TOKEN}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "admin"}}],
            "current-context": "e2e",
        }))

        def ready() -> bool:
            self.apiserver.check()
            try:
                return self.raw_get("/readyz").strip() == "ok"
            except Exception:  # noqa: BLE001 - not up yet
                return False
        wait_for(ready, 180, "kube-apiserver /readyz", interval=0.5)

    def raw_get(self, path: str) -> str:
        """GET ``path`` from the apiserver as admin; returns the body."""
        import ssl

        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        req = urllib.request.Request(f"https://127.0.0.1:{self.api_port}{path}",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.read().decode()

    # ---- kubelet -------------------------------------------------------------
    def kubelet_config(self) -> Path:
        """Write the KubeletConfiguration (see the module docstring); return its path."""
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.kubelet_healthz_port,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.ctrd.sock}",
            "imageServiceEndpoint": f"unix://{self.ctrd.sock}",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi"},
            "podLogsDir": str(self.base / "pod-logs"),
            "volumePluginDir": str(self.base / "volume-plugins"),
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "nodeStatusUpdateFrequency": "2s",
            "serializeImagePulls": False,
            "localStorageCapacityIsolation": False,
            "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False,
            "resolvConf": "",
            "registerNode": True,
            "shutdownGracePeriod": "0s",
        }
        path = self.base / "kubelet-config.json"
        path.write_text(json.dumps(cfg, indent=1))
        return path

    def kubelet_start(self) -> None:
        """Start kubelet (config above) and wait until it serves kubelet.sock
        in the device plugin directory and answers /healthz."""
        cfg = self.kubelet_config()
        self.kubelet = Proc("kubelet", [
            self.bins.kubelet, "--config", cfg, "--kubeconfig", self.kubeconfig,
            "--root-dir", self.kubelet_root, "--hostname-override", NODE,
            "--cert-dir", self.base / "kubelet-pki", "--v", "4",
        ], self.base / "kubelet.log")
        wait_for(lambda: self.kubelet.check() or self.kubelet_healthy(), 120, "kubelet /healthz",
                 interval=0.2)

    def kubelet_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.kubelet_healthz_port}/healthz",
                                        timeout=2) as r:
                return r.read().strip() == b"ok"
        except OSError:
            return False

    def kubelet_stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop kubelet with ``sig`` (SIGTERM: it leaves kubelet.sock behind, D4)."""
        if self.kubelet is not None:
            self.kubelet.stop(sig)

    @property
    def kubelet_sock(self) -> Path:
        return DEVICE_PLUGIN_DIR / "kubelet.sock"

    @property
    def podresources_sock(self) -> Path:
        return self.kubelet_root / "pod-resources" / "kubelet.sock"

    # ---- API -----------------------------------------------------------------
    def api(self) -> Any:
        """A ``kubernetes.client.CoreV1Api`` talking to our apiserver as admin."""
        if self._api is None:
            import urllib3
            from kubernetes import client, config

            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # loopback, self-signed
            c = client.Configuration()
            config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=c)
            c.verify_ssl = False
            self._api = client.CoreV1Api(client.ApiClient(c))
        return self._api

    def node(self) -> Any:
        return self.api().read_node(NODE)

    def node_registered(self) -> bool:
        """The Node object exists and kubelet has posted its conditions."""
        try:
            n = self.node()
        except Exception:  # noqa: BLE001 - not registered yet
            if self.kubelet is not None:
                self.kubelet.check()
            return False
        return any(c.type == "Ready" for c in (n.status.conditions or ()))

    def capacity(self) -> tuple[int, int]:
        """(capacity, allocatable) of our resource on the node (0 when absent)."""
        st = self.node().status
        return (int((st.capacity or {}).get(RESOURCE, "0")), int((st.allocatable or {}).get(RESOURCE, "0")))

    # ---- stop ----------------------------------------------------------------
    def stop(self) -> None:
        """Delete pods (best effort), stop kubelet, apiserver, etcd."""
        for p in (self.kubelet, self.apiserver, self.etcd):
            if p is not None:
                p.stop()


def pod_manifest(name: str, *, gib: int | None = None, annotations: dict[str, str] | None = None,
                 init: bool = False, command: list[str] | None = None,
                 restart: str = "Never", init_gib: int | None = None) -> dict[str, Any]:
    """A bare pod for our node: host network, no service account token,
    ``spec.nodeName`` set (no scheduler), the imported busybox image (never
    pulled), requesting ``gib`` devices of our resource (1 device = 1 GiB).
    ``init``: an init container (``/bin/true``) requesting ``init_gib``
    devices (default ``gib``)."""
    def res_of(n: int | None) -> dict[str, Any]:
        return {"limits": {RESOURCE: str(n)}} if n else {}

    def container(cname: str, cmd: list[str], n: int | None = gib) -> dict[str, Any]:
        return {"name": cname, "image": h.IMAGE, "imagePullPolicy": "Never", "command": cmd,
                "resources": res_of(n)}

    spec: dict[str, Any] = {
        "nodeName": NODE,
        "hostNetwork": True,
        "automountServiceAccountToken": False,
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": 1,
        "containers": [container("app", command or ["/bin/sleep", "3600"])],
    }
    if init:
        spec["initContainers"] = [container("init", ["/bin/true"], gib if init_gib is None else init_gib)]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}},
            "spec": spec}


# ---- cleanup ---------------------------------------------------------------
def cleanup_device_plugin_dir(log=print) -> None:
    """Remove every socket and kubelet's checkpoint from the device plugin
    directory; remove /var/lib/kubelet when this harness created it."""
    if DEVICE_PLUGIN_DIR.exists():
        for p in DEVICE_PLUGIN_DIR.iterdir():
            try:
                if stat.S_ISSOCK(p.lstat().st_mode) or p.name == "kubelet_internal_checkpoint":
                    p.unlink()
            except OSError as e:
                log(f"cleanup: {p}: {e}")
    if (KUBELET_ROOT / MARKER).exists():
        for mp in h._mounts_under(KUBELET_ROOT):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        shutil.rmtree(KUBELET_ROOT, ignore_errors=True)


def cleanup_base(base: Path, cluster: Cluster | None = None, log=print) -> None:
    """Tear down everything under ``base`` (never raises): kubelet first (so it
    does not restart pods), then pods/containerd/shims/processes/mounts through
    tests/e2e's ``harness.cleanup_base`` (which acts on its own marker; ours is
    added for it), then the device plugin directory."""
    base = Path(base)
    if not (base / MARKER).exists():
        log(f"cleanup: {base} has no {MARKER}; not touching it")
        return
    try:
        if cluster is not None and cluster.kubelet is not None:
            cluster.kubelet.stop(signal.SIGKILL)
    except Exception as e:  # noqa: BLE001
        log(f"cleanup: kubelet stop failed: {e}")
    (base / h.MARKER).write_text("kubelet e2e\n")
    h.cleanup_base(base, cluster.ctrd if cluster is not None else None, log=log)
    cleanup_device_plugin_dir(log)


def cleanup_all(log=print) -> None:
    """Clean every marked /tmp/fpk8s-* directory (run.sh's trap)."""
    for base in Path("/tmp").glob("fpk8s-*"):
        if (base / MARKER).exists():
            log(f"cleanup: {base}")
            cleanup_base(base, log=log)
    cleanup_device_plugin_dir(log)


if __name__ == "__main__":
    if sys.argv[1:] == ["cleanup"]:
        cleanup_all()
    else:
        print("usage: cluster.py cleanup", file=sys.stderr)
        sys.exit(2)
