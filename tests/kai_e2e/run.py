#!/usr/bin/env python3
"""``make kai-e2e``: a real etcd + kube-apiserver on loopback, then
``tests/kai_e2e`` against it (FRACPLUGIN_KAI_E2E_KUBECONFIG), then both stopped
and their directory removed.

Binaries: ``$FRACPLUGIN_E2E_CACHE`` (default ``/var/cache/fracplugin-e2e``)
``/kubernetes-v*/bin/kube-apiserver`` and ``/etcd-v*/bin/etcd``, the ones issue
#11's kubelet-e2e build script puts there (the newest version found is used).
Missing binaries fail with what is missing. Flags as issue #11's harness
(tests/kubelet_e2e/cluster.py): static admin token, AlwaysAllow, self-signed
serving certificate, no ServiceAccount admission, loopback and free ports only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.helpers import free_port  # noqa: E402  (the one port chooser, issue 34 input 10)
CACHE = Path(os.environ.get("FRACPLUGIN_E2E_CACHE", "/var/cache/fracplugin-e2e"))
TOKEN = "kai-e2e-admin"


def newest(pattern: str) -> Path | None:
    found = sorted(CACHE.glob(pattern), key=lambda p: [int(x) if x.isdigit() else x for x in
                                                       p.parts[-3].split("-v")[-1].replace(".", " ").split()])
    return found[-1] if found else None


def wait(pred, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise SystemExit(f"kai-e2e: timed out waiting for {what}")


def main() -> int:
    apiserver, etcd = newest("kubernetes-v*/bin/kube-apiserver"), newest("etcd-v*/bin/etcd")
    if apiserver is None or etcd is None:
        print(f"kai-e2e: kube-apiserver and etcd binaries are needed under {CACHE} "
              "(kubernetes-v*/bin, etcd-v*/bin; built by the kubelet-e2e build script)", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="fpkaiapi", dir="/tmp"))
    procs: list[subprocess.Popen] = []
    try:
        client = f"http://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        procs.append(subprocess.Popen([
            str(etcd), "--name", "e2e", "--data-dir", str(base / "etcd"), "--listen-client-urls", client,
            "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"e2e={peer}", "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
            "--unsafe-no-fsync", "--log-level", "warn"], stdout=open(base / "etcd.log", "w"), stderr=subprocess.STDOUT))
        wait(lambda: b"true" in urllib.request.urlopen(client + "/health", timeout=2).read(), 60, "etcd")
        d = base / "api"
        d.mkdir()
        subprocess.run(["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"], check=True, capture_output=True)
        (d / "tokens.csv").write_text(f'{TOKEN},admin,admin,"system:masters"\n')
        port = free_port()
        procs.append(subprocess.Popen([
            str(apiserver), "--etcd-servers", client, "--bind-address", "127.0.0.1",
            "--advertise-address", "127.0.0.1", "--secure-port", str(port), "--cert-dir", str(d / "certs"),
            "--token-auth-file", str(d / "tokens.csv"), "--authorization-mode", "AlwaysAllow",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(d / "sa.key"), "--service-account-signing-key-file", str(d / "sa.key"),
            "--service-cluster-ip-range", "10.251.0.0/24", "--endpoint-reconciler-type", "none",
            "--disable-admission-plugins", "ServiceAccount", "--enable-priority-and-fairness=false",
            "--profiling=false", "--v", "1"], stdout=open(base / "apiserver.log", "w"), stderr=subprocess.STDOUT))
        kubeconfig = base / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "e",
            "clusters": [{"name": "e", "cluster": {"server": f"https://127.0.0.1:{port}",
                                                   "insecure-skip-tls-verify": True}}],
            "users": [{"name": "a", "user": {"token": TOKEN}}],
            "contexts": [{"name": "e", "context": {"cluster": "e", "user": "a"}}]}))
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        req = urllib.request.Request(f"https://127.0.0.1:{port}/readyz", headers={"Authorization": f"Bearer {TOKEN}"})
        wait(lambda: urllib.request.urlopen(req, timeout=5, context=ctx).read().strip() == b"ok", 240,
             "kube-apiserver /readyz")
        env = {**os.environ, "FRACPLUGIN_KAI_E2E_KUBECONFIG": str(kubeconfig), "FRACPLUGIN_E2E_REQUIRED": "1"}
        return subprocess.run([sys.executable, "-m", "pytest", "tests/kai_e2e", "-q", "-s",
                               "-W", "ignore::urllib3.exceptions.InsecureRequestWarning"], env=env, cwd=REPO).returncode
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
