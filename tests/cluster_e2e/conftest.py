"""Fixtures of ``make cluster-e2e``: one real cluster per Kubernetes line
(``$FRACPLUGIN_KUBE_VERSIONS``, fullcluster.py; pytest runs every test of one
line before the next line's cluster starts), helm and README's kubectl lines
as README runs them (``Kubectl``: the same operations through the API), and
the diagnostics a failure prints (pod phases, container statuses, events,
container logs).

Under ``make cluster-e2e`` (``FRACPLUGIN_E2E_REQUIRED=1``) a missing binary,
image or root FAILS naming what is missing; run by hand without them the tests
are skipped with the same message (never silently).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

import fullcluster as fc
import readme

k = fc.k
REQUIRED = os.environ.get("FRACPLUGIN_E2E_REQUIRED") == "1"
NAMESPACE = "fracplugin-system"
RELEASE = "fracplugin"
CHART = fc.REPO / "deploy" / "helm" / "fracplugin"
VALUES_SIM = fc.HERE / "values-sim.yaml"
LOGS = fc.REPO / "build" / "cluster-e2e-logs"


def unavailable(msg: str) -> None:
    """Fail under ``make cluster-e2e``, skip when run by hand."""
    if REQUIRED:
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session", params=k.kube_versions())
def cbins(request) -> fc.Binaries:
    """The binaries of one Kubernetes line (each of ``$FRACPLUGIN_KUBE_VERSIONS``)."""
    if os.geteuid() != 0:
        unavailable("the cluster e2e test must run as root (kubelet, containerd, runc, iptables)")
    try:
        return fc.Binaries.find(request.param)
    except fc.HarnessError as e:
        unavailable(str(e))
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def cluster(cbins, request) -> fc.FullCluster:
    """The one-node cluster of one Kubernetes line, node Ready; torn down (and
    its logs copied to build/cluster-e2e-logs/<version>/) after that line's tests."""
    try:
        lock = k.acquire_lock()
    except k.HarnessError as e:
        pytest.fail(str(e), pytrace=False)
    k.cleanup_device_plugin_dir()
    fc.remove_network(Path("/nonexistent"), None)
    base = k.new_base()
    c = fc.FullCluster(cbins, base)

    def fin() -> None:
        keep = LOGS / cbins.kube.version
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True, exist_ok=True)
        for log in base.glob("*.log"):
            shutil.copy(log, keep / log.name)
        if (base / "pod-logs").is_dir():  # every container's log, the daemon pods' among them
            shutil.copytree(base / "pod-logs", keep / "pod-logs", dirs_exist_ok=True)
        fc.cleanup_base(base, c)
        lock.close()
    request.addfinalizer(fin)
    t0 = time.monotonic()
    try:
        c.start()
    except k.HarnessError as e:
        logs = "\n".join(f"--- {p.name}:\n{p.tail(25)}" for p in c.procs())
        pytest.fail(f"cluster {cbins.kube.version} did not come up: {e}\n{logs}\n"
                    f"--- containerd:\n{c.ctrd.log_tail(25)}",
                    pytrace=False)
    print(f"cluster {cbins.kube.version} up in {time.monotonic() - t0:.1f}s under {base}")
    return c


class Helm:
    """The real helm against the cluster, as the admin (KUBECONFIG)."""

    def __init__(self, c: fc.FullCluster) -> None:
        self.c = c
        self.node_values = c.base / "values-node.yaml"
        self.node_values.write_text(yaml.safe_dump(node_values(c)))

    def __call__(self, *args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, KUBECONFIG=str(self.c.kubeconfig), HELM_CACHE_HOME=str(self.c.base / "helm-cache"),
                   HELM_CONFIG_HOME=str(self.c.base / "helm-config"), HELM_DATA_HOME=str(self.c.base / "helm-data"))
        cp = subprocess.run([str(self.c.fb.helm), *args], capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=cwd)
        if cp.returncode != 0:
            raise k.HarnessError(f"helm {' '.join(args)} failed ({cp.returncode}):\n{cp.stdout}\n{cp.stderr}")
        return cp

    def values_args(self, *extra: str) -> list[str]:
        return ["-f", str(VALUES_SIM), "-f", str(self.node_values), *extra]

    def readme(self, argv: list[str], *extra: str) -> subprocess.CompletedProcess:
        """README's ``helm ...`` command ``argv`` as it stands, run from the
        repository root (README's chart path is relative to it), with ``extra``
        (the test-only values files, ``--set layout=single``, ...) appended."""
        assert argv[0] == "helm", argv
        return self(*argv[1:], *extra, cwd=fc.REPO)


def node_values(c: fc.FullCluster) -> dict[str, Any]:
    """The machine-specific values: this repository's test files as hostPath
    volumes, the test containerd's NRI socket, the run directory (MPS root,
    state, the MPS role's API socket) and the CDI spec directory under the
    test's base directory instead of the host's /run/fracplugin and
    /var/run/nri."""
    run = c.run_dir
    return {
        "hostPaths": {"nriSocket": str(c.ctrd.nri_sock), "run": str(run), "stateDir": str(run / "state"),
                      "mpsRoot": str(run / "mps"), "cdiSpecDirs": [str(c.base / "cdi")]},
        "mps": {"apiSocket": str(run / "mps" / "api.sock")},
        "extraVolumes": [
            {"name": "fracplugin-test-nodes",
             "hostPath": {"path": str(fc.REPO / "examples" / "nodes"), "type": "Directory"}},
            {"name": "fracplugin-test-fakes",
             "hostPath": {"path": str(fc.REPO / "tests" / "fakes"), "type": "Directory"}},
        ],
    }


@pytest.fixture(scope="session")
def helm(cluster) -> Helm:
    return Helm(cluster)


@pytest.fixture(scope="session")
def steps(cluster) -> dict[str, Any]:
    """What each scenario of this cluster (Kubernetes line) left for the next
    ones, keyed ``<layout>/<scheduler>/<step>``."""
    return {}


# ---- what the tests read through the API --------------------------------------------
def daemonsets(c: fc.FullCluster) -> list[Any]:
    return c.apps().list_namespaced_daemon_set(NAMESPACE).items


def ds_rolled_out(ds: Any) -> bool:
    """A DaemonSet's pods are all scheduled, current and Ready (what
    `kubectl rollout status` waits for)."""
    st = ds.status
    want = st.desired_number_scheduled or 0
    return (want > 0 and (st.observed_generation or 0) >= ds.metadata.generation
            and (st.number_ready or 0) == want and (st.updated_number_scheduled or 0) == want
            and (st.number_available or 0) == want)


def pods_of(c: fc.FullCluster, ns: str = NAMESPACE, selector: str = "") -> list[Any]:
    return c.api().list_namespaced_pod(ns, label_selector=selector).items


def pod_logs(c: fc.FullCluster, pod: Any, container: str | None = None, previous: bool = False) -> str:
    """A container's log through the API server (kubelet), or kubelet's log
    file on disk when the API call fails."""
    try:
        return c.api().read_namespaced_pod_log(pod.metadata.name, pod.metadata.namespace, container=container,
                                               previous=previous)
    except Exception as e:  # noqa: BLE001 - fall back to the file kubelet writes
        d = c.base / "pod-logs" / f"{pod.metadata.namespace}_{pod.metadata.name}_{pod.metadata.uid}"
        files = sorted(d.glob(f"{container or '*'}/*.log"))
        if not files:
            return f"(no log: {e})"
        return "\n".join(f.read_text(errors="replace") for f in files)


class LogFollower:
    """``kubectl logs -f`` on a thread: one container's log streamed through
    the API server (kubelet) from its first line until the container ends
    (kubelet closes the stream), so that the last words of a container whose
    pod is being deleted (and its log with it) are kept."""

    def __init__(self, c: fc.FullCluster, pod: Any, container: str) -> None:
        self.what = f"pod {pod.metadata.name} container {container}"
        self.chunks: list[bytes] = []
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(c, pod, container), daemon=True,
                                       name=f"follow {self.what}")
        self.thread.start()

    def _run(self, c: fc.FullCluster, pod: Any, container: str) -> None:
        try:
            r = c.api().read_namespaced_pod_log(pod.metadata.name, pod.metadata.namespace, container=container,
                                                follow=True, _preload_content=False)
            for chunk in r.stream(4096):
                self.chunks.append(chunk)
        except Exception as e:  # noqa: BLE001 - reported by text()
            self.error = e

    def text(self, timeout: float) -> str:
        """The log streamed so far, after waiting up to ``timeout`` seconds
        for the stream to end; a note says when it did not, or failed."""
        self.thread.join(timeout)
        out = b"".join(self.chunks).decode(errors="replace")
        if self.thread.is_alive():
            out += f"\n(log of {self.what} still streaming after {timeout:g} s)"
        if self.error is not None:
            out += f"\n(log stream of {self.what} failed: {self.error})"
        return out


def diagnose(c: fc.FullCluster, ns: str = NAMESPACE, log_lines: int = 40) -> str:
    """Pod phases, container statuses (waiting reason, last termination),
    the namespace's events and each container's log tail, for a failure
    message that names the pod, container and event that broke."""
    out: list[str] = []
    try:
        for ds in daemonsets(c) if ns == NAMESPACE else []:
            st = ds.status
            out.append(f"DaemonSet {ds.metadata.name}: desired={st.desired_number_scheduled} "
                       f"current={st.current_number_scheduled} ready={st.number_ready} "
                       f"updated={st.updated_number_scheduled} available={st.number_available}")
        for p in pods_of(c, ns):
            out.append(f"pod {p.metadata.name} (uid {p.metadata.uid}): phase={p.status.phase} "
                       f"node={p.spec.node_name} ip={p.status.pod_ip} reason={p.status.reason} {p.status.message or ''}")
            for s in (p.status.init_container_statuses or []) + (p.status.container_statuses or []):
                state = s.state
                desc = ("running" if state.running else
                        f"waiting {state.waiting.reason}: {state.waiting.message}" if state.waiting else
                        f"terminated {state.terminated.reason} exit {state.terminated.exit_code}: "
                        f"{state.terminated.message}" if state.terminated else "?")
                last = s.last_state.terminated if s.last_state else None
                out.append(f"  container {s.name}: ready={s.ready} restarts={s.restart_count} {desc}"
                           + (f"; last: {last.reason} exit {last.exit_code}" if last else ""))
                log = pod_logs(c, p, s.name)
                out.append("    " + "\n    ".join(log.splitlines()[-log_lines:]))
                if s.restart_count:
                    prev = pod_logs(c, p, s.name, previous=True)
                    out.append("    previous:\n    " + "\n    ".join(prev.splitlines()[-log_lines:]))
        for e in c.api().list_namespaced_event(ns).items:
            obj = e.involved_object
            out.append(f"event {e.type} {obj.kind}/{obj.name} {e.reason}: {e.message}")
    except Exception as e:  # noqa: BLE001 - diagnostics must not hide the failure
        out.append(f"(diagnostics failed: {e})")
    for p in c.procs():
        out.append(f"--- {p.name} (last 8 lines):\n{p.tail(8)}")
    return "\n".join(out)


def wait(c: fc.FullCluster, pred: Callable[[], Any], timeout: float, what: str, ns: str = NAMESPACE) -> Any:
    """``wait_for`` that fails the test with ``diagnose`` on a timeout."""
    try:
        return k.wait_for(lambda: c._check_procs() or pred(), timeout, what, interval=0.5)
    except k.HarnessError as e:
        pytest.fail(f"{e}\n{diagnose(c, ns)}", pytrace=False)


def crictl_json(c: fc.FullCluster, cmd: str, *args: str) -> Any:
    """``crictl <cmd> -o json <args>`` parsed (flags before the arguments)."""
    return json.loads(c.ctrd.crictl(cmd, "-o", "json", *args).stdout)


def container_id(pod: Any, container: str) -> str:
    for s in pod.status.container_statuses or []:
        if s.name == container and s.container_id:
            return str(s.container_id).split("://", 1)[-1]
    raise k.HarnessError(f"pod {pod.metadata.name} has no running container {container}")


def diagnose_all(c: fc.FullCluster) -> str:
    """``diagnose`` of the chart's namespace and of ``default`` (the test's
    fractional pods)."""
    return f"{diagnose(c)}\n--- namespace default:\n{diagnose(c, 'default', log_lines=10)}"


@contextmanager
def diagnosed(c: fc.FullCluster, what: str) -> Iterator[None]:
    """Turn any error inside the block (an assertion, a harness or API
    error) into a failure that names the scenario step and carries
    ``diagnose_all`` (every pod's containers, their states and logs, the
    events): the pod, container and event that broke. pytest's own outcomes
    (``wait``'s failures, which carry their diagnosis) pass through."""
    msg = ""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - pytest.fail/skip are BaseException, not caught
        msg = f"{what}: {type(e).__name__}: {e}\n{diagnose_all(c)}"
    if msg:  # failed outside the except clause: no "during handling of the above exception" chain
        pytest.fail(msg, pytrace=False)


class Kubectl:
    """README's ``kubectl`` lines run through the API (kubectl is not built
    here), each as kubectl does it; any other kubectl line fails naming it
    (docs/e2e.md: what the test runs for each of README's lines):

    - ``create namespace N`` / ``label namespace N k=v``: the same create and
      label patch;
    - ``exec ds/NAME -- CMD`` / ``exec <fracplugin-mps pod> -- CMD``: ``crictl
      exec`` (the CRI call kubelet serves ``kubectl exec`` with) in the first
      container of that DaemonSet's pod on this node; a non-zero exit raises;
    - ``delete daemonset NAMES --cascade=foreground``: foreground deletion of
      each, then waiting until the DaemonSets and their pods are gone (what
      kubectl's default ``--wait`` does with foreground cascading).
    """

    def __init__(self, c: fc.FullCluster) -> None:
        self.c = c

    def __call__(self, argv: list[str]) -> str:
        """Run one README kubectl line; returns an exec's stdout ('' else).
        Raises HarnessError (exec failed) or readme.ReadmeError (a line
        ``readme.kubectl_op`` does not know)."""
        line = " ".join(argv)
        op, ns, names, cmd = readme.kubectl_op(argv)
        if op == "create-namespace":
            from kubernetes import client

            self.c.api().create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=names[0])))
        elif op == "label-namespace":
            labels = dict(x.split("=", 1) for x in names[1:])
            self.c.api().patch_namespace(names[0], {"metadata": {"labels": labels}})
        elif op == "exec":
            pod = self.pod_of(ns, names[0])
            name = pod.spec.containers[0].name
            cp = self.c.ctrd.crictl("exec", container_id(pod, name), *cmd, check=False, timeout=120)
            if cp.returncode != 0:
                raise k.HarnessError(f"`{line}` in pod {pod.metadata.name} container {name} exited "
                                     f"{cp.returncode}:\n{cp.stdout}{cp.stderr}")
            return str(cp.stdout)
        elif op == "delete-daemonsets-foreground":
            for name in names:
                self.c.apps().delete_namespaced_daemon_set(name, ns, propagation_policy="Foreground")
            wait(self.c, lambda: not [d for d in daemonsets(self.c) if d.metadata.name in names]
                 and not pods_of(self.c, ns), 180, f"`{line}`: the DaemonSets and their pods gone", ns=ns)
        return ""

    def pod_of(self, ns: str, ds_name: str) -> Any:
        """The live pod of DaemonSet ``ds_name`` on this node (its selector).
        Raises HarnessError when there is none."""
        ds = self.c.apps().read_namespaced_daemon_set(ds_name, ns)
        sel = ",".join(f"{a}={b}" for a, b in sorted(ds.spec.selector.match_labels.items()))
        ps = [p for p in pods_of(self.c, ns, sel) if p.metadata.deletion_timestamp is None
              and p.spec.node_name == k.NODE]
        if len(ps) != 1:
            raise k.HarnessError(f"DaemonSet {ds_name} has {len(ps)} live pods on {k.NODE}: "
                                 f"{[p.metadata.name for p in ps]}")
        return ps[0]


@pytest.fixture(scope="session")
def kubectl(cluster) -> Kubectl:
    return Kubectl(cluster)
