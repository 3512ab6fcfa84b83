"""A real one-node Kubernetes cluster on this machine for ``make cluster-e2e``
(issue 24): etcd, kube-apiserver (RBAC, ServiceAccount tokens),
kube-controller-manager (the DaemonSet, garbage collector, ServiceAccount and
root-CA publisher controllers), kube-scheduler, kubelet and containerd with a
CNI bridge network, so that the shipped install (image + Helm chart) runs as a
platform team runs it.

It extends tests/kubelet_e2e/cluster.py (same binaries cache, ``Proc``, lock
and cleanup) with what a DaemonSet pod needs and that harness leaves out:

* **Pod network.** The reference CNI plugins ``bridge``, ``host-local`` and
  ``loopback`` (github.com/containernetworking/plugins, built by run.sh into
  the cache) on a bridge ``fpk8s0`` that the harness creates with the node's
  address ``10.244.77.1/24``; pods get ``10.244.77.0/24`` addresses and their
  default route through the bridge. The chart's DaemonSets run without
  ``hostNetwork`` exactly as rendered.
* **The ``kubernetes`` Service.** There is no kube-proxy: in-cluster clients
  (the daemon's) dial the Service's ClusterIP ``10.96.0.1:443``
  (``KUBERNETES_SERVICE_HOST``/``_PORT`` that kubelet injects), so the harness
  adds the one rule kube-proxy would add for it, a ``nat PREROUTING`` DNAT to
  the API server's address (``iptables``), and removes it at cleanup.
* **TLS and identities.** A throw-away CA signs the API server's serving
  certificate for the ClusterIP, the bridge address and the Service's DNS
  names; the controller-manager publishes it as ``kube-root-ca.crt``, which
  projected ServiceAccount volumes carry (``ca.crt``). Every component has its
  own static token and its real RBAC identity: ``system:node:gpu-node-1``
  (group ``system:nodes``; authorizer ``Node,RBAC``, admission
  ``NodeRestriction``), ``system:kube-controller-manager`` (with
  ``--use-service-account-credentials``), ``system:kube-scheduler``; the test
  is ``system:masters``; the daemon runs under only the chart's ClusterRole.
* **Audit log.** The API server writes an audit log (``<base>/audit.log``,
  JSON lines, copied with the other logs) of one kind of request only: a
  ``patch``/``update`` of ``nodes/status`` at level ``Metadata`` (who, which
  node, the answer; ``AUDIT_POLICY``). It shows who writes the node
  conditions: the daemon's ServiceAccount (``system:serviceaccount:...``, with
  the pod's name in the token's ``authentication.kubernetes.io/pod-name``
  extra) beside kubelet.
* **kubelet root.** ``--root-dir /var/lib/kubelet`` (the chart's
  ``hostPaths.kubeletRoot`` default: its device plugin directory is that
  path whatever the root, and the chart derives ``pod-resources`` from the
  same root); kubelet serves on the bridge address so the API server reaches
  it (logs).

Everything else lives under one temporary base directory
(``/tmp/fpk8s-XXXX``, marker ``.fracplugin-k8s``) as in kubelet_e2e; the
same lock (``/run/fracplugin-k8s-e2e.lock``) keeps this and kubelet-e2e apart.

Concurrency model: synchronous; one pytest process drives one cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.append(str(REPO / "tests" / "kubelet_e2e"))  # after our own dir: its conftest is not ours

import cluster as k  # noqa: E402  (tests/kubelet_e2e/cluster.py)
import readme  # noqa: E402  (tests/cluster_e2e/readme.py)

h = k.h
HarnessError = k.HarnessError
wait_for = k.wait_for

BRIDGE = "fpk8s0"
NODE_IP = "10.244.77.1"
POD_SUBNET = "10.244.77.0/24"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service: first address of the range
CNI_PLUGINS_VERSION = "v1.10.0"  # run.sh builds them into <cache>/cni-plugins-<version>/bin
CNI_PLUGINS = ("bridge", "host-local", "loopback")
DNAT_COMMENT = "fracplugin-cluster-e2e"
TOKENS = {  # name -> (token, user, groups)
    "admin": ("fp-e2e-admin", "e2e-admin", "system:masters"),
    "kubelet": ("fp-e2e-kubelet", f"system:node:{k.NODE}", "system:nodes"),
    "controller-manager": ("fp-e2e-kcm", "system:kube-controller-manager", ""),
    "scheduler": ("fp-e2e-sched", "system:kube-scheduler", ""),
}
# The API server's audit policy: nodes/status writes at Metadata, nothing else (first match wins;
# https://kubernetes.io/docs/tasks/debug/debug-cluster/audit/#audit-policy).
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "verbs": ["patch", "update"], "resources": [{"group": "", "resources": ["nodes/status"]}]},
        {"level": "None"},
    ],
}


# Feature gates per Kubernetes line, the same on kube-apiserver, kube-controller-manager, kube-scheduler and
# kubelet (each component checks its own copy): DRA consumable capacity (KEP-5075, the DRA door's
# allowMultipleAllocations and capacity requests, ADR 0031) is alpha, off by default, in 1.34/1.35 and beta, on
# by default, from 1.36 (pkg/features/kube_features.go of each line). Without it the API server drops
# allowMultipleAllocations from our ResourceSlice and capacity.requests from a claim.
DRA_CONSUMABLE_CAPACITY_ON_BY_DEFAULT = (1, 36)


def feature_gates(version: str) -> dict[str, bool]:
    """The feature gates the cluster of Kubernetes line ``version`` (``v1.35.4``) turns on: what the DRA door
    needs where it is not on by default (``DRAConsumableCapacity`` below 1.36); {} from 1.36."""
    if k.version_tuple(version)[:2] < DRA_CONSUMABLE_CAPACITY_ON_BY_DEFAULT:
        return {"DRAConsumableCapacity": True}
    return {}


def gates_flag(gates: dict[str, bool]) -> list[str]:
    """``--feature-gates=A=true,B=false`` (none when ``gates`` is empty)."""
    if not gates:
        return []
    return ["--feature-gates=" + ",".join(f"{g}={str(v).lower()}" for g, v in sorted(gates.items()))]


IMAGE_ARCHIVE = REPO / "build" / "image" / "fracplugin-0.1.0.oci.tar"
# The chart's default image reference fracplugin:<appVersion>, as the CRI names it.
DAEMON_IMAGE = "docker.io/library/fracplugin:0.1.0"
# The same archive under a second tag: the new image of the `helm upgrade` scenario.
UPGRADE_TAG = readme.UPGRADE_TAG
DAEMON_IMAGE_UPGRADE = f"docker.io/library/fracplugin:{UPGRADE_TAG}"


@dataclass(frozen=True)
class Binaries:
    """The four Kubernetes binaries of one line, etcd, containerd + crictl,
    the CNI plugins, helm and the image archive. ``find`` raises HarnessError
    naming every missing file and the command that makes it."""

    kube: k.KubeBinaries
    controller_manager: Path
    scheduler: Path
    cni_dir: Path
    helm: Path
    image: Path

    @classmethod
    def find(cls, version: str) -> "Binaries":
        missing: list[str] = []
        try:
            kube = k.KubeBinaries.find(version)
        except HarnessError as e:
            raise HarnessError(f"{e}; `make cluster-e2e` builds them") from None
        kbin = kube.kubelet.parent
        cm, sched = kbin / "kube-controller-manager", kbin / "kube-scheduler"
        for p in (cm, sched):
            if not os.access(p, os.X_OK):
                missing.append(f"{p} (KUBE_VERSIONS={version} tests/kubelet_e2e/build.sh)")
        cni = Path(os.environ.get("FRACPLUGIN_CNI_BIN",
                                  h.cache_dir() / f"cni-plugins-{CNI_PLUGINS_VERSION}" / "bin"))
        if not all(os.access(cni / p, os.X_OK) for p in CNI_PLUGINS):
            missing.append(f"CNI plugins {', '.join(CNI_PLUGINS)} in {cni} (tests/cluster_e2e/build-cni.sh)")
        helm = Path(os.environ.get("HELM", "/var/cache/fracplugin-e2e/chart-tools/helm-v3.22.0/bin/helm"))
        if not os.access(helm, os.X_OK):
            missing.append(f"{helm} (bash scripts/chart-tools.sh helm)")
        image = Path(os.environ.get("FRACPLUGIN_IMAGE_ARCHIVE", IMAGE_ARCHIVE))
        if not image.is_file():
            missing.append(f"{image} (make image)")
        if shutil.which("iptables") is None:
            missing.append("iptables (apt-get install iptables)")
        if missing:
            raise HarnessError("cluster e2e prerequisites missing: " + "; ".join(missing))
        return cls(kube, cm, sched, cni, helm, image)


def _openssl(*args: Any) -> None:
    h.run(["openssl", *args], timeout=60)


def make_pki(d: Path) -> None:
    """A CA (``ca.crt``/``ca.key``), the API server's serving pair signed by it
    (SANs: the ClusterIP, the node address, 127.0.0.1 and the Service's DNS
    names) and the ServiceAccount signing key ``sa.key``, all in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fracplugin-e2e-ca",
             "-keyout", d / "ca.key", "-out", d / "ca.crt",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
             "-keyout", d / "apiserver.key", "-out", d / "apiserver.csr")
    sans = ",".join([f"IP:{SERVICE_IP}", f"IP:{NODE_IP}", "IP:127.0.0.1", "DNS:kubernetes",
                     "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                     "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost"])
    (d / "apiserver.ext").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n"
                                     "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n")
    _openssl("x509", "-req", "-in", d / "apiserver.csr", "-CA", d / "ca.crt", "-CAkey", d / "ca.key",
             "-CAcreateserial", "-days", "2", "-out", d / "apiserver.crt", "-extfile", d / "apiserver.ext")
    _openssl("genrsa", "-out", d / "sa.key", "2048")


class FullCluster(k.Cluster):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler +
    kubelet + containerd (CNI bridge) under ``base``; ``start()`` returns when
    the node is Ready. ``api()`` (CoreV1Api) and ``apps()`` (AppsV1Api) act
    as the admin."""

    def __init__(self, bins: Binaries, base: Path) -> None:
        super().__init__(bins.kube, base)
        self.fb = bins
        self.kubelet_root = k.KUBELET_ROOT
        self.pki = base / "pki"
        self.controller_manager: k.Proc | None = None
        self.scheduler: k.Proc | None = None
        self._apps: Any = None
        self.dnat_rule: list[str] | None = None
        self.created_bridge = False
        self.run_dir = base / "run"
        self.audit_log = base / "audit.log"
        self.gates = feature_gates(bins.kube.version)

    # ---- start ---------------------------------------------------------------
    def start(self) -> None:
        """Bridge, PKI, containerd (CNI, images imported), etcd, apiserver,
        DNAT rule, controller-manager, scheduler, kubelet; waits until the
        node is Ready. Raises HarnessError."""
        self._prepare_dirs()
        # the chart's hostPaths.run lives here: a nosuid,nodev tmpfs like a systemd host's /run
        # (the ledger's and the MPS pipe directories' filesystem, ADR 0003)
        self.run_dir.mkdir()
        h.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,mode=0755,size=64m", "fpk8s-run", self.run_dir])
        self._network()
        make_pki(self.pki)
        self._cni_config()
        self.ctrd.start()
        self.ctrd.import_image()
        self._import_daemon_image()
        self._start_etcd()
        self._start_apiserver()
        self._service_dnat()
        self._start_controller_manager()
        self._start_scheduler()
        self.kubelet_start()
        wait_for(self.node_ready, 180, f"node {k.NODE} Ready", interval=0.5)

    def _network(self) -> None:
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
            h.run(["ip", "link", "add", BRIDGE, "type", "bridge"])
            self.created_bridge = True
        (self.base / ".bridge").write_text(BRIDGE + "\n")
        h.run(["ip", "addr", "replace", f"{NODE_IP}/24", "dev", BRIDGE])
        h.run(["ip", "link", "set", BRIDGE, "up"])

    def _cni_config(self) -> None:
        bindir, confdir = self.base / "cni" / "bin", self.base / "cni" / "net.d"
        bindir.mkdir(parents=True, exist_ok=True)
        confdir.mkdir(parents=True, exist_ok=True)
        for p in CNI_PLUGINS:
            shutil.copy2(self.fb.cni_dir / p, bindir / p)
        conf = {"cniVersion": "1.0.0", "name": "fpk8s", "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": False,
            "ipam": {"type": "host-local", "dataDir": str(self.base / "cni" / "ipam"),
                     "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                     "routes": [{"dst": "0.0.0.0/0"}]},
        }]}
        (confdir / "10-fpk8s.conflist").write_text(json.dumps(conf, indent=1))

    def _import_daemon_image(self) -> None:
        """``make image``'s OCI archive (reference ``fracplugin:0.1.0``) into
        containerd's k8s.io namespace under the name kubelet asks the CRI for,
        and the same image under a second tag (``DAEMON_IMAGE_UPGRADE``, the
        upgrade scenario's "new" image)."""
        self.ctrd.ctr("images", "import", str(self.fb.image), timeout=300)
        names = self.ctrd.ctr("images", "ls", "-q").stdout.split()
        if DAEMON_IMAGE not in names:
            src = next((n for n in names if "fracplugin:" in n and "busybox" not in n), None)
            if src is None:
                raise HarnessError(f"import of {self.fb.image} gave no fracplugin image; have {names}")
            self.ctrd.ctr("images", "tag", "--force", src, DAEMON_IMAGE)
        self.ctrd.ctr("images", "tag", "--force", DAEMON_IMAGE, DAEMON_IMAGE_UPGRADE)
        wait_for(lambda: all(i in self.ctrd.crictl("images", "-o", "json").stdout
                             for i in (DAEMON_IMAGE, DAEMON_IMAGE_UPGRADE)), 60,
                 "CRI to list the daemon image under both tags")

    def _kubeconfig(self, name: str) -> Path:
        token = TOKENS[name][0]
        path = self.base / f"{name}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {
                "server": f"https://{NODE_IP}:{self.api_port}", "certificate-authority": str(self.pki / "ca.crt")}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": name}}],
            "current-context": "e2e",
        }))
        return path

    def _start_apiserver(self) -> None:
        d = self.base / "apiserver"
        d.mkdir()
        (d / "tokens.csv").write_text("".join(f'{t},{u},{u},"{g}"\n' for t, u, g in TOKENS.values()))
        (d / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY, indent=1))
        self.apiserver = k.Proc("kube-apiserver", [
            self.bins.apiserver,
            "--etcd-servers", self.etcd_url,
            "--bind-address", NODE_IP, "--advertise-address", NODE_IP,
            "--secure-port", str(self.api_port),
            "--tls-cert-file", self.pki / "apiserver.crt", "--tls-private-key-file", self.pki / "apiserver.key",
            "--client-ca-file", self.pki / "ca.crt",
            "--token-auth-file", d / "tokens.csv",
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", self.pki / "sa.key",
            "--service-account-signing-key-file", self.pki / "sa.key",
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--kubelet-preferred-address-types", "InternalIP",
            "--audit-policy-file", d / "audit-policy.json",
            "--audit-log-path", self.audit_log,
            "--audit-log-mode", "blocking",  # the event is on disk before the request is answered
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            *gates_flag(self.gates),
            "--v", "1",
        ], self.base / "apiserver.log")
        self.kubeconfig = self._kubeconfig("admin")

        def ready() -> bool:
            self.apiserver.check()
            try:
                return self.raw_get("/readyz").strip() == "ok"
            except Exception:  # noqa: BLE001 - not up yet
                return False
        wait_for(ready, 180, "kube-apiserver /readyz", interval=0.5)

    def raw_get(self, path: str) -> str:
        """GET ``path`` from the apiserver as admin (TLS verified with our CA)."""
        import ssl
        import urllib.request

        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        req = urllib.request.Request(f"https://{NODE_IP}:{self.api_port}{path}",
                                     headers={"Authorization": f"Bearer {TOKENS['admin'][0]}"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.read().decode()

    def audit_events(self) -> list[dict[str, Any]]:
        """The API server's audit events so far (``AUDIT_POLICY``: writes of
        ``nodes/status``), oldest first, each an ``audit.k8s.io/v1`` Event
        (``user.username``, ``user.extra``, ``verb``, ``objectRef``,
        ``responseStatus.code``, ``stage``). A line being written (no newline
        yet) is left for the next call."""
        if not self.audit_log.exists():
            return []
        text = self.audit_log.read_text(errors="replace")
        return [json.loads(ln) for ln in text[:text.rfind("\n") + 1].splitlines() if ln.strip()]

    def _service_dnat(self) -> None:
        """The one rule kube-proxy would write for the `kubernetes` Service."""
        rule = ["PREROUTING", "-d", f"{SERVICE_IP}/32", "-p", "tcp", "--dport", "443",
                "-m", "comment", "--comment", f"{DNAT_COMMENT} {self.base}",
                "-j", "DNAT", "--to-destination", f"{NODE_IP}:{self.api_port}"]
        h.run(["iptables", "-w", "-t", "nat", "-A", *rule])
        self.dnat_rule = rule

    def _start_controller_manager(self) -> None:
        self.controller_manager = k.Proc("kube-controller-manager", [
            self.fb.controller_manager,
            "--kubeconfig", self._kubeconfig("controller-manager"),
            "--bind-address", "127.0.0.1", "--secure-port", str(h.free_port()),
            "--cert-dir", self.base / "kcm-certs",
            "--leader-elect=false",
            "--use-service-account-credentials",
            "--service-account-private-key-file", self.pki / "sa.key",
            "--root-ca-file", self.pki / "ca.crt",
            "--controllers", "*",
            "--profiling=false",
            *gates_flag(self.gates),
            "--v", "1",
        ], self.base / "controller-manager.log")

    def _start_scheduler(self) -> None:
        cfg = self.base / "scheduler-config.json"
        cfg.write_text(json.dumps({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self._kubeconfig("scheduler"))},
            "leaderElection": {"leaderElect": False},
        }))
        self.scheduler = k.Proc("kube-scheduler", [
            self.fb.scheduler, "--config", cfg,
            "--bind-address", "127.0.0.1", "--secure-port", str(h.free_port()),
            "--cert-dir", self.base / "sched-certs", "--profiling=false", *gates_flag(self.gates), "--v", "1",
        ], self.base / "scheduler.log")

    def kubelet_config(self) -> Path:
        path = super().kubelet_config()
        cfg = json.loads(path.read_text())
        cfg.update({"address": NODE_IP, "healthzBindAddress": "127.0.0.1",
                    "rotateCertificates": False, "serverTLSBootstrap": False})
        if self.gates:
            cfg["featureGates"] = {**cfg.get("featureGates", {}), **self.gates}
        path.write_text(json.dumps(cfg, indent=1))
        return path

    def kubelet_start(self) -> None:
        """kubelet as ``system:node:gpu-node-1`` on the bridge address; waits
        for its /healthz."""
        cfg = self.kubelet_config()
        self.kubelet = k.Proc("kubelet", [
            self.bins.kubelet, "--config", cfg, "--kubeconfig", self._kubeconfig("kubelet"),
            "--root-dir", self.kubelet_root, "--hostname-override", k.NODE, "--node-ip", NODE_IP,
            "--cert-dir", self.base / "kubelet-pki", "--v", "2",
        ], self.base / "kubelet.log")
        wait_for(lambda: self.kubelet.check() or self.kubelet_healthy(), 120, "kubelet /healthz", interval=0.2)

    def _check_procs(self) -> None:
        for p in (self.etcd, self.apiserver, self.controller_manager, self.scheduler, self.kubelet):
            if p is not None:
                p.check()

    def node_ready(self) -> bool:
        """The node reports Ready=True (CNI initialised). Raises HarnessError
        when a component exited."""
        self._check_procs()
        try:
            n = self.node()
        except Exception:  # noqa: BLE001 - not registered yet
            return False
        return any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or ()))

    # ---- API -----------------------------------------------------------------
    def _client(self) -> Any:
        from kubernetes import client, config

        c = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=c)
        return client.ApiClient(c)

    def api(self) -> Any:
        if self._api is None:
            from kubernetes import client

            self._api = client.CoreV1Api(self._client())
        return self._api

    def apps(self) -> Any:
        """An ``AppsV1Api`` as the admin."""
        if self._apps is None:
            from kubernetes import client

            self._apps = client.AppsV1Api(self._client())
        return self._apps

    def procs(self) -> list[k.Proc]:
        return [p for p in (self.etcd, self.apiserver, self.controller_manager, self.scheduler, self.kubelet) if p]

    # ---- stop ----------------------------------------------------------------
    def stop(self) -> None:
        for p in (self.kubelet, self.scheduler, self.controller_manager, self.apiserver, self.etcd):
            if p is not None:
                p.stop()


def remove_network(base: Path, rule: list[str] | None, log=print) -> None:
    """Delete our DNAT rule(s) (any rule carrying our comment) and the bridge;
    never raises."""
    for _ in range(10):
        out = subprocess.run(["iptables", "-w", "-t", "nat", "-S", "PREROUTING"], capture_output=True, text=True)
        ours = [ln for ln in out.stdout.splitlines() if DNAT_COMMENT in ln and ln.startswith("-A ")]
        if not ours:
            break
        import shlex

        args = shlex.split(ours[0])
        subprocess.run(["iptables", "-w", "-t", "nat", "-D", *args[1:]], capture_output=True)
    if (base / ".bridge").exists() or subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def cleanup_base(base: Path, c: FullCluster | None = None, log=print) -> None:
    """Tear down everything of ``base`` (never raises): kubelet first, the
    control plane, then kubelet_e2e's cleanup (pods, containerd, shims,
    mounts, the device plugin directory and /var/lib/kubelet when the harness
    created it), then the DNAT rule and the bridge."""
    base = Path(base)
    if not (base / k.MARKER).exists():
        log(f"cleanup: {base} has no {k.MARKER}; not touching it")
        return
    if c is not None:
        for p in (c.kubelet, c.scheduler, c.controller_manager):
            try:
                if p is not None:
                    p.stop(sig=9)
            except Exception as e:  # noqa: BLE001
                log(f"cleanup: {p.name}: {e}")
    k.cleanup_base(base, c, log=log)
    for mp in h._mounts_under(k.KUBELET_ROOT):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    if c is not None:
        for p in (c.apiserver, c.etcd):
            if p is not None:
                p.stop()
    remove_network(base, c.dnat_rule if c else None, log)


def cleanup_all(log=print) -> None:
    """Clean every marked /tmp/fpk8s-* directory and our network (run.sh's trap)."""
    for base in Path("/tmp").glob("fpk8s-*"):
        if (base / k.MARKER).exists():
            log(f"cleanup: {base}")
            cleanup_base(base, log=log)
    k.cleanup_device_plugin_dir(log)
    remove_network(Path("/nonexistent"), None, log)


if __name__ == "__main__":
    if sys.argv[1:] == ["cleanup"]:
        cleanup_all()
    else:
        print("usage: fullcluster.py cleanup", file=sys.stderr)
        sys.exit(2)
