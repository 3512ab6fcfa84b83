"""A fractional container found running unfenced is restarted (issue 35 item 1,
small failing input 1; ADR 0035), through the daemon's real sockets.

``fracplugin run`` as a subprocess on the fake ``libnvidia-ml.so.1`` (KAI
shape, no simulated node), ``--pods-file`` as its pod watch, a fake API
server recording what it POSTs (Events, pod evictions), and the fake NRI
runtime Synchronizing it with running containers at every connection. The
seed notebook pod (``gpu-fraction: "0.5"``, two GPUs, examples/pods) runs a
container ``app`` that carries no fracplugin env: it started while the
plugin was away.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from fracplugin._proto import nri_pb2
from tests.component.test_memory_limits import NODE, REPO, Daemon, _samples, root  # noqa: F401 (fixture)
from tests.fakes import nvml as fake
from tests.helpers import wait_until
from tests.peers.posts_api import Api

NOTEBOOK = yaml.safe_load((REPO / "examples" / "pods" / "notebook-time-slicing-2gpu.yaml").read_text())
UNFENCED = "ContainerRestartedUnfenced"
RUNNING = nri_pb2.CONTAINER_RUNNING
PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _manifest(name: str, uid: str, annotations: dict[str, str], containers: tuple[str, ...] = ("app",)) -> Any:
    doc = copy.deepcopy(NOTEBOOK)
    doc["metadata"].update(name=name, uid=uid, annotations=annotations)
    doc["spec"]["containers"] = [{"name": c, "image": "busybox"} for c in containers]
    return doc


def _running(doc: Any, name: str = "app", env: dict[str, str] | None = None, cid: str = "") -> tuple[Any, Any]:
    """(sandbox, container ``name`` RUNNING) of manifest ``doc`` as the runtime lists them."""
    from nri_runtime import make_container, pod_from_manifest

    pod, _ = pod_from_manifest(doc)
    env_list = [PATH, *(f"{k}={v}" for k, v in (env or {}).items())]
    return pod, make_container(pod, name, container_id=cid or f"c-{pod.uid}-{name}", env=env_list, state=RUNNING)


class Node:
    """The daemon, its fake API server, pods file and runtime."""

    def __init__(self, root: Path, mode: str, pods: list[Any], sync: tuple[list[Any], list[Any]]) -> None:
        from nri_runtime import FakeNriRuntime

        self.api = Api(root)
        self.pods_file = root / "pods.yaml"
        self.write_pods(pods)
        nf = fake.node_file(root / "nvml-node", yaml.safe_load(NODE.read_text()))
        self.rt = FakeNriRuntime(root / "nri.sock", initial_sync=sync)
        self.d = Daemon(root, ["--memory-limits", "off", "--unfenced-containers", mode, "--kubeconfig",
                               str(self.api.kubeconfig), "--pods-file", str(self.pods_file),
                               "--node-condition-types", ""],
                        fake.env(fake.build_fake_nvml(), nf, root / "limits"), simulate=False)
        self.rt.wait_registered(15)

    def write_pods(self, pods: list[Any]) -> None:
        self.pods_file.write_text(yaml.safe_dump_all(pods))

    def nri(self) -> dict[str, Any]:
        return self.d.get("/status")[1]["nri"]

    def unfenced(self) -> dict[str, Any]:
        return self.nri()["unfenced"]

    def synced(self, n: int = 1) -> dict[str, Any]:
        """``unfenced`` status once the ``n``-th Synchronize was handled."""
        wait_until(lambda: (self.nri().get("synchronize_count") or 0) >= n, 15,
                   lambda: f"Synchronize {n}: {self.nri()}\n{self.d.logs()[-3000:]}")
        return self.unfenced()

    def close(self) -> None:
        self.d.stop()
        self.rt.close()
        self.api.close()


@pytest.fixture
def node(root: Path) -> Iterator[Any]:  # noqa: F811
    made: list[Node] = []

    def start(mode: str, pods: list[Any], sync: tuple[list[Any], list[Any]]) -> Node:
        made.append(Node(root, mode, pods, sync))
        return made[-1]

    yield start
    for n in made:
        n.close()


def _event(api: Api, n: int = 1) -> dict[str, Any]:
    wait_until(lambda: len(api.events(UNFENCED)) >= n, 15, lambda: f"{n} {UNFENCED} Event(s); posted {api.posted}")
    return api.events(UNFENCED)[n - 1]


def test_input1_the_unfenced_notebook_is_restarted_and_comes_back_fenced(node: Any) -> None:
    """Default ``--unfenced-containers restart``: an eviction of exactly the
    notebook pod (its UID as precondition), a Warning Event naming the pod,
    the container and why, the counter; and the container the runtime
    creates again is fenced (env, mount)."""
    pod, app = _running(NOTEBOOK)
    n = node("restart", [NOTEBOOK], ([pod], [app]))
    wait_until(n.api.evictions, 15, lambda: f"a pod eviction; posted {n.api.posted}\n{n.d.logs()[-3000:]}")
    [(path, body)] = n.api.evictions()
    assert path == "/api/v1/namespaces/research/pods/notebook/eviction", path
    assert body["deleteOptions"]["preconditions"] == {"uid": pod.uid}, body
    ev = _event(n.api)
    assert ev["type"] == "Warning" and ev["action"] == "Restart", ev
    assert ev["involvedObject"]["uid"] == pod.uid and ev["involvedObject"]["fieldPath"] == "spec.containers{app}"
    assert "running without fracplugin's adjustment" in ev["message"] and "found at Synchronize" in ev["message"]
    assert "evicting pod research/notebook" in ev["message"], ev["message"]
    wait_until(lambda: n.unfenced()["restarts"]["evicted"] == 1, 15, lambda: f"counted: {n.unfenced()}")
    uf = n.unfenced()
    assert (uf["mode"], uf["restarted"], uf["reported"], uf["waiting"]) == ("restart", 1, 0, []), uf
    assert [u["container_id"] for u in n.nri()["unadjusted"]] == [app.id]
    text = n.d.get("/metrics", "metrics")[1]
    assert {lbl["action"]: v for lbl, v in _samples(text, "fracplugin_unfenced_containers_total")} == {
        "restarted": 1.0, "reported": 0.0, "backed_off": 0.0}, text
    # kubelet (here the runtime peer) creates the container again: fenced at CreateContainer
    from nri_runtime import effective_env, make_container

    again = make_container(pod, "app", container_id="c-nb-again")
    adj = n.rt.create_container(pod, again)
    env = effective_env(again, adj)
    assert len(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == 2, env
    assert (env["NVIDIA_GPU_MEMORY_REQUEST"], env["NVIDIA_GPU_MEMORY_LIMIT"]) == ("40267", "64428"), env
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] and "/tmp/nvidia-mps" in [m.destination for m in adj.mounts]
    assert len(n.api.evictions()) == 1


def test_input1_under_report_the_event_only(node: Any) -> None:
    """``--unfenced-containers report``: no eviction, the Event (action
    Report, saying it is not restarted), counted as reported."""
    pod, app = _running(NOTEBOOK)
    n = node("report", [NOTEBOOK], ([pod], [app]))
    ev = _event(n.api)
    assert ev["action"] == "Report" and "not restarted: --unfenced-containers report" in ev["message"], ev
    uf = n.synced()
    assert (uf["restarted"], uf["reported"]) == (0, 1) and n.api.evictions() == [], uf
    assert [u["container_id"] for u in n.nri()["unadjusted"]] == [app.id]  # today's behaviour, kept


def test_never_restarted_not_fractional_adjusted_or_pod_unreadable(node: Any) -> None:
    """In one Synchronize, with the default ``restart``: a container of a pod
    without fraction annotations, a container carrying fracplugin's memory
    env (an earlier adjustment, other values), a sidecar the pod-level
    ``gpu-fraction`` does not target, and the app container of a pod the pod
    watch does not know yet: none is restarted; the last waits, listed in
    /status. When the pods file (the pod watch) learns that pod, it is."""
    plain = _manifest("plain", "uid-plain", {})
    adjusted = _manifest("older", "uid-older", {"nvidia.com/container.app.gpu-memory.request": "4Gi",
                                                 "nvidia.com/container.app.gpus.devices": "0"})
    two = _manifest("two", "uid-two", {"gpu-fraction": "0.5"}, ("app", "logger"))
    late = _manifest("late", "uid-late", {"gpu-fraction": "0.25"})
    old_env = {"NVIDIA_GPU_MEMORY_REQUEST": "3072", "NVIDIA_GPU_MEMORY_LIMIT": "3072",
               "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M"}
    listed = [_running(plain), _running(adjusted, env=old_env), _running(two, env=old_env),
              _running(two, "logger"), _running(late)]
    pods = list({p.uid: p for p, _ in listed}.values())
    n = node("restart", [plain, adjusted, two], (pods, [c for _, c in listed]))
    wait_until(lambda: n.unfenced()["waiting"], 15, lambda: f"late waits: {n.nri()}\n{n.d.logs()[-3000:]}")
    uf = n.unfenced()
    assert [(w["pod"], w["container"]) for w in uf["waiting"]] == [("research/late", "app")], uf
    assert "does not know the pod's spec yet" in uf["waiting"][0]["why"]
    assert (uf["restarted"], uf["reported"], uf["backed_off"]) == (0, 0, 0) and n.api.evictions() == [], uf
    text = n.d.get("/metrics", "metrics")[1]
    assert [v for _, v in _samples(text, "fracplugin_unfenced_containers_waiting")] == [1.0]
    n.write_pods([plain, adjusted, two, late])  # the pod watch learns it
    wait_until(n.api.evictions, 15, lambda: f"late's eviction; {n.unfenced()}\n{n.d.logs()[-3000:]}")
    assert [p for p, _ in n.api.evictions()] == ["/api/v1/namespaces/research/pods/late/eviction"]
    ev = _event(n.api)
    assert ev["involvedObject"]["name"] == "late" and "when the pod watch learned its pod" in ev["message"], ev
    uf = n.unfenced()
    assert (uf["restarted"], uf["waiting"]) == (1, []), uf


def test_a_pod_that_comes_back_unfenced_is_backed_off(node: Any) -> None:
    """The notebook is evicted at the first Synchronize. The runtime
    reconnects still listing it (the eviction in progress): nothing new. The
    pod comes back (same name, a new UID) unfenced again and the runtime
    reconnects: backed off, no second eviction, an Event saying so, /status
    naming the pod and when the next restart may be."""
    pod, app = _running(NOTEBOOK)
    n = node("restart", [NOTEBOOK], ([pod], [app]))
    wait_until(n.api.evictions, 15, lambda: f"a pod eviction; posted {n.api.posted}")
    _event(n.api)
    n.rt.disconnect()  # the runtime reconnects the plugin: Synchronize 2, the same pod
    uf = n.synced(2)
    assert (uf["restarted"], uf["backed_off"], len(n.api.events(UNFENCED))) == (1, 0, 1), uf
    back = copy.deepcopy(NOTEBOOK)
    back["metadata"]["uid"] = "0b9d7e35-2f1a-4c88-8e0d-5a6b7c8d9e23"
    n.write_pods([back])
    pod2, app2 = _running(back)
    n.rt.set_sync_state([pod2], [app2])
    n.rt.disconnect()  # Synchronize 3: the new pod, unfenced again
    wait_until(lambda: n.unfenced()["backed_off"] == 1, 15, lambda: f"backed off: {n.unfenced()}")
    ev = _event(n.api, 2)
    assert ev["action"] == "Backoff" and ev["involvedObject"]["uid"] == pod2.uid, ev
    assert "came back unfenced after 1 restart(s)" in ev["message"] and "(backoff)" in ev["message"], ev["message"]
    uf = n.unfenced()
    assert [(b["pod"], b["restarts"]) for b in uf["backoff"]] == [("research/notebook", 1)], uf
    assert 0 < uf["backoff"][0]["next_restart_in_s"] <= 300, uf
    assert len(n.api.evictions()) == 1 and uf["restarted"] == 1
