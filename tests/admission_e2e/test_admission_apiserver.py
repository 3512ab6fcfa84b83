"""The chart's ValidatingAdmissionPolicy on a real kube-apiserver, for each
Kubernetes line of the kubelet-e2e build (``$FRACPLUGIN_KUBE_VERSIONS``,
default v1.37.2 v1.35.4): etcd + kube-apiserver started from the cached
binaries (flags as tests/kubelet_e2e/cluster.py: static admin token,
AlwaysAllow, loopback), the policy created as the chart renders it (``helm
template`` when helm is cached, else ``admission.policy_objects``, which
test_admission_policy.py proves equal), then every pod of the contract's
table created with ``dryRun=All`` (admission runs, nothing is stored): each
bad one refused with ``fracplugin explain``'s message, each good one and each
seed pod admitted; with ``validationActions: [Warn]`` the bad ones are
admitted with that message as a warning."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from fracplugin_demo import admission
from tests.admission_e2e.cases import BAD, GOOD, expected_message, pod, seed_pods

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "kubelet_e2e"))

import cluster as k  # noqa: E402  (tests/kubelet_e2e/cluster.py: Proc, versions, cache, flags)

TOKEN = k.TOKEN


def warning_text(header: str) -> str:
    """The text of an HTTP ``Warning: 299 - "<text>"`` header as the API
    server writes it (RFC 7234 quoted-string: ``\\"`` and ``\\\\`` escaped)."""
    code, _, rest = header.partition(" - ")
    rest = rest.strip()
    if code.strip() != "299" or not (rest.startswith('"') and rest.endswith('"')):
        return header
    out, i, body = [], 0, rest[1:-1]
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            i += 1
        out.append(body[i])
        i += 1
    return "".join(out)


class ApiServer:
    """etcd + kube-apiserver under ``base``; ``request`` speaks HTTPS as admin."""

    def __init__(self, version: str, base: Path) -> None:
        cache = k.h.cache_dir()
        self.apiserver_bin = cache / f"kubernetes-{version}" / "bin" / "kube-apiserver"
        etcd_v = os.environ.get("ETCD_VERSION", k.DEFAULT_ETCD_VERSION)
        self.etcd_bin = cache / f"etcd-{etcd_v}" / "bin" / "etcd"
        missing = [str(p) for p in (self.apiserver_bin, self.etcd_bin) if not os.access(p, os.X_OK)]
        if missing:
            pytest.fail("admission-e2e needs the kubelet-e2e build's binaries: missing " + ", ".join(missing)
                        + f"; build them with `KUBE_VERSIONS={version} tests/kubelet_e2e/build.sh`")
        self.base = base
        self.procs: list[k.Proc] = []
        self.port = k.h.free_port()

    def start(self) -> None:
        peer, client = k.h.free_port(), k.h.free_port()
        etcd_url = f"http://127.0.0.1:{client}"
        etcd = k.Proc("etcd", [
            self.etcd_bin, "--name", "e2e", "--data-dir", self.base / "etcd",
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{k.h.free_port()}", "--unsafe-no-fsync", "--log-level", "warn",
        ], self.base / "etcd.log")
        self.procs.append(etcd)

        def etcd_up() -> bool:
            etcd.check()
            with urllib.request.urlopen(etcd_url + "/health", timeout=2) as r:
                return b'"true"' in r.read()
        k.wait_for(etcd_up, 60, "etcd /health")
        d = self.base / "apiserver"
        d.mkdir()
        key = d / "sa.key"
        k.h.run(["openssl", "genrsa", "-out", key, "2048"])
        (d / "tokens.csv").write_text(f'{TOKEN},e2e-admin,e2e-admin,"system:masters"\n')
        api = k.Proc("kube-apiserver", [
            self.apiserver_bin, "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.port), "--cert-dir", d / "certs", "--token-auth-file", d / "tokens.csv",
            "--authorization-mode", "AlwaysAllow",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", key, "--service-account-signing-key-file", key,
            "--service-cluster-ip-range", "10.250.0.0/24", "--endpoint-reconciler-type", "none",
            "--disable-admission-plugins", "ServiceAccount", "--enable-priority-and-fairness=false",
            "--profiling=false", "--v", "1",
        ], self.base / "apiserver.log")
        self.procs.append(api)

        def ready() -> bool:
            api.check()
            try:
                return self.request("GET", "/readyz")[0] == 200 and \
                    self.request("GET", "/api/v1/namespaces/default")[0] == 200
            except OSError:
                return False
        k.wait_for(ready, 180, "kube-apiserver /readyz and namespace default", interval=0.5)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any, list[str]]:
        """(HTTP status, JSON body, Warning headers)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"https://127.0.0.1:{self.port}{path}", data=data, method=method, headers={
            "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
                code, raw, headers = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            code, raw, headers = e.code, e.read(), e.headers
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = raw.decode(errors="replace")
        return code, doc, [warning_text(w) for w in headers.get_all("Warning") or []]

    def create_pod(self, manifest: dict[str, Any]) -> tuple[int, Any, list[str]]:
        return self.request("POST", "/api/v1/namespaces/default/pods?dryRun=All", manifest)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def _policy_objects(actions: list[str]) -> list[dict[str, Any]]:
    """The policy and binding as the chart renders them: ``helm template``
    with admissionPolicy.enabled=true when helm is cached (HELM or
    scripts/chart-tools.sh's cache), else the generator's objects."""
    helm = os.environ.get("HELM") or next(iter(sorted(Path("/var/cache/fracplugin-e2e/chart-tools").glob(
        "helm-*/bin/helm"))), None)
    if helm:
        r = subprocess.run([str(helm), "template", "fracplugin", str(REPO / "deploy" / "helm" / "fracplugin"),
                            "--show-only", "templates/admissionpolicy.yaml", "--set", "admissionPolicy.enabled=true",
                            "--set-json", f"admissionPolicy.validationActions={json.dumps(actions)}"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [d for d in yaml.safe_load_all(r.stdout) if d]
    return admission.policy_objects(prefix_expression=admission.lit("nvidia.com/container."),
                                    validation_actions=actions)


@pytest.fixture(scope="module", params=k.kube_versions())
def apiserver(request: pytest.FixtureRequest) -> Iterator[ApiServer]:
    base = Path(tempfile.mkdtemp(prefix="fpadm-", dir="/tmp"))
    s = ApiServer(request.param, base)
    try:
        s.start()
        policy, binding = _policy_objects(["Deny"])
        for path, obj in (("validatingadmissionpolicies", policy), ("validatingadmissionpolicybindings", binding)):
            code, doc, _ = s.request("POST", f"/apis/admissionregistration.k8s.io/v1/{path}", obj)
            assert code == 201, doc
        s.policy_name, s.binding = policy["metadata"]["name"], binding
        # the policy is active once a bad pod is refused (its informer and compiler run asynchronously)
        probe = pod("probe", {"nvidia.com/container.app.gpu-compute.mode": "SM-Sharing"}, ["app"])
        k.wait_for(lambda: s.create_pod(probe)[0] == 422, 60, "the admission policy to refuse a bad pod")
        code, doc, _ = s.request("GET", f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{s.policy_name}")
        # a type error in the CEL is reported in the policy's status, not at create
        assert not (doc.get("status", {}).get("typeChecking") or {}).get("expressionWarnings"), doc["status"]
        yield s
    finally:
        s.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("case,annotations,containers", BAD, ids=[b[0] for b in BAD])
def test_bad_annotation_refused_at_create_with_explains_message(apiserver: ApiServer, case: str,
                                                               annotations: dict[str, str], containers: list[str]) -> None:
    manifest = pod(case, annotations, containers)
    want = expected_message(manifest)
    assert want is not None
    code, doc, _ = apiserver.create_pod(manifest)
    assert code == 422, doc
    assert doc["message"].endswith(f"denied request: {want}"), (doc["message"], want)


@pytest.mark.parametrize("case,annotations,containers", GOOD, ids=[g[0] for g in GOOD])
def test_good_pod_admitted(apiserver: ApiServer, case: str, annotations: dict[str, str], containers: list[str]) -> None:
    code, doc, warnings = apiserver.create_pod(pod(case, annotations, containers))
    assert code == 201, doc
    assert warnings == []


def test_a_pod_naming_its_native_sidecar_is_admitted_and_a_plain_init_container_refused(apiserver: ApiServer) -> None:
    """Issue 34 item 3: gpu-fraction-container-name may name a native sidecar
    (an init container with restartPolicy Always), as at the NRI door and in explain."""
    ann = {"gpu-fraction": "0.25", "gpu-fraction-container-name": "side"}
    for name, restart, want in (("sidecar-named", {"restartPolicy": "Always"}, 201), ("init-named", {}, 422)):
        manifest = pod(name, ann, ["app"])
        manifest["spec"]["initContainers"] = [{"name": "side", "image": "busybox:1.37", **restart}]
        code, doc, _ = apiserver.create_pod(manifest)
        assert code == want, (name, doc)
        if want == 422:
            assert 'gpu-fraction-container-name="side" names no container of this pod' in str(doc), doc


def test_seed_pods_admitted(apiserver: ApiServer) -> None:
    for name, manifest in seed_pods().items():
        code, doc, _ = apiserver.create_pod(manifest)
        assert code == 201, (name, doc)


def test_warn_admits_and_warns_with_the_message(apiserver: ApiServer) -> None:
    binding = json.loads(json.dumps(apiserver.binding))
    path = f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{binding['metadata']['name']}"
    code, current, _ = apiserver.request("GET", path)
    assert code == 200
    current["spec"]["validationActions"] = ["Warn"]
    assert apiserver.request("PUT", path, current)[0] == 200
    try:
        case, annotations, containers = BAD[0]
        manifest = pod(case, annotations, containers)
        want = expected_message(manifest)
        k.wait_for(lambda: apiserver.create_pod(manifest)[0] == 201, 60, "the binding to turn to Warn")
        code, _, warnings = apiserver.create_pod(manifest)
        assert code == 201 and any(want in w for w in warnings), warnings
    finally:
        code, current, _ = apiserver.request("GET", path)
        current["spec"]["validationActions"] = ["Deny"]
        apiserver.request("PUT", path, current)
        bad = pod("probe", {"nvidia.com/container.app.gpu-compute.mode": "SM-Sharing"}, ["app"])
        k.wait_for(lambda: apiserver.create_pod(bad)[0] == 422, 60, "the binding to turn back to Deny")


def test_warning_text_unquotes_the_header() -> None:
    assert warning_text('299 - "Validation failed: k=\\"v\\" has \\\\ one"') == 'Validation failed: k="v" has \\ one'
    assert warning_text("199 - other") == "199 - other"
