"""fracplugin's NRI plugin (FracNriPlugin + NriStub) against the in-process
fake runtime over a real unix socket: what containers get, refusals, untouched
pods, Synchronize, and recovery from a runtime that misbehaves or goes away
(no ledger entry lost or duplicated)."""

from __future__ import annotations

import os
import shutil
import struct
import threading
from pathlib import Path

import pytest

from tests.helpers import node_rules, scaled, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fracplugin._proto import nri_pb2
from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.mps.api import NullMps
from fracplugin.mps.layout import MpsLayout, namespace_name
from fracplugin.nri.plugin import FracNriPlugin, build_adjustment
from fracplugin.nri.dispatch import PLUGIN_SERVICE
from fracplugin.nri.stub import NriStub
from fracplugin.planner import PlannerConfig
from tests.helpers import plan_container
from fracplugin.model import ComputeMode, PodRef

from nri_runtime import Code, FakeNriRuntime, RpcError, effective_env, make_container, make_pod, pod_from_manifest
from tests.peers import ttrpc_wire as wire

REPO = Path(__file__).resolve().parents[2]
PODS = REPO / "examples" / "pods"
NODE = load_node(REPO / "examples" / "nodes" / "gpu-node-1.yaml")
UUIDS = [g.uuid for g in NODE.gpus]
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class FakeMps(NullMps):
    """Records MPS calls; ``block`` makes ensure_namespace wait for an event."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.kw: list[dict] = []
        self.block: threading.Event | None = None
        self.done = threading.Event()
        self.fail: Exception | None = None
        self.lock = threading.Lock()

    def ensure_namespace(self, pod_uid, container, atp, timeout_s, mode=ComputeMode.SM_SHARING,
                         pinned_limit_mib=None):
        with self.lock:
            self.calls.append(("ensure_namespace", pod_uid, container, atp, timeout_s))
            self.kw.append({"mode": mode, "pinned_limit_mib": pinned_limit_mib})
        gate = self.block
        if gate is not None:
            gate.wait(10)
        self.done.set()
        if self.fail is not None:
            raise self.fail
        return MpsLayout().namespace_pipe_dir(namespace_name(pod_uid, container), mode)

    def release_namespace(self, pod_uid, container, timeout_s=None):
        with self.lock:
            self.calls.append(("release_namespace", pod_uid, container))
        return True

    def drain(self, container_id, timeout_s, modes=None):
        with self.lock:
            self.calls.append(("drain", container_id, timeout_s))
            self.kw.append({"modes": modes})
        return None

    def named(self, name):
        with self.lock:
            return [c for c in self.calls if c[0] == name]


class FakeMetrics:
    def __init__(self) -> None:
        self.hooks: list[tuple[str, float]] = []
        self.threads: list[str] = []  # where each CreateContainer ran
        self.refusals: list[str] = []

    def observe_hook(self, door, seconds):
        self.hooks.append((door, seconds))
        self.threads.append(threading.current_thread().name)

    def refusal(self, reason_code):
        self.refusals.append(reason_code)


class Harness:
    """The NRI door (``FracNriPlugin`` + ``NriStub``) and the fake runtime on
    a real socket under ``tmp``. ``mps``: the MPS layer (default a new
    ``FakeMps``); ``restart_doors`` replaces the door, keeping the runtime
    and the MPS layer."""

    def __init__(self, tmp: str, *, fail_open=False, runtime_kwargs=None, stub_kwargs=None, plugin_kwargs=None,
                 planner_config=None, mps=None, rules_kwargs=None):
        self.path = os.path.join(tmp, "nri.sock")
        self.ledger = Ledger(NODE)
        self.mps = mps if mps is not None else FakeMps()
        self.metrics = FakeMetrics()
        # MPS pipe directories (mount sources the plugin creates) under the test's own directory
        self.layout = MpsLayout(os.path.join(tmp, "mps"))
        self.config = planner_config or PlannerConfig(layout=self.layout)
        self.fail_open = fail_open
        self.plugin_kwargs = plugin_kwargs or {}
        self.rules_kwargs = rules_kwargs or {}
        self.stub_kwargs = stub_kwargs or {}
        self.plugin = self._plugin()
        self.runtime_kwargs = runtime_kwargs or {}
        self.rt = FakeNriRuntime(self.path, **self.runtime_kwargs)
        self.stub = self._stub()

    def _plugin(self):
        return FracNriPlugin(node_rules(NODE, self.ledger, self.config, **self.rules_kwargs), mps=self.mps,
                             metrics=self.metrics,
                             fail_open=self.fail_open, **self.plugin_kwargs)

    def _stub(self):
        return NriStub(self.plugin, socket_path=self.path, env={}, reconnect_initial_s=0.02,
                       reconnect_max_s=0.2, **self.stub_kwargs)

    def restart_doors(self, ledger=None):
        """The doors restart while the runtime and the MPS layer stay: the
        plugin goes (its stub stopped, its MPS queue closed, every table it
        kept in memory lost) and a new one, with ``ledger`` (default: a new,
        empty one) and the same MPS layer, registers with the same runtime,
        which synchronizes it with what ``rt.set_sync_state`` gave. Returns
        self once the new plugin is ready."""
        n = len(self.rt.registrations)
        self.stub.stop(5)
        self.plugin.close()
        self.ledger = ledger if ledger is not None else Ledger(NODE)
        self.plugin = self._plugin()
        self.stub = self._stub()
        self.stub.start()
        wait_for(lambda: len(self.rt.registrations) > n, what="the restarted doors registered")
        wait_for(self.stub.ever_synchronized, 5)
        return self

    def start(self, pods=(), containers=()):
        self.stub.start()
        self.rt.wait_registered()
        self.rt.synchronize(list(pods), list(containers))
        wait_for(self.stub.ever_synchronized, 5)
        return self

    def restart_runtime(self, **kwargs):
        self.rt.close()
        self.rt = FakeNriRuntime(self.path, **{**self.runtime_kwargs, **kwargs})
        return self.rt

    def close(self):
        self.stub.stop(5)
        self.rt.close()


@pytest.fixture
def make_harness(sockdir):
    made = []

    def make(**kwargs):
        h = Harness(sockdir, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def h(make_harness):
    return make_harness().start()


def _manifest(name):
    return pod_from_manifest(PODS / name)


def _ledger_view(ledger):
    return sorted((t.pod_uid, t.container, t.gpu_uuid, t.container_id, t.request_mib, t.limit_mib) for t in ledger.tenancies())


# ------------------------------------------------------------------- contract


def test_bound_inference_pod_gets_the_exact_env_and_mount(h):
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    adj = h.rt.create_container(pod, ctr)
    assert not isinstance(adj, RpcError), adj
    assert effective_env(ctr, adj) == {
        "PATH": PATH_ENV.split("=", 1)[1],
        "NVIDIA_VISIBLE_DEVICES": ",".join(UUIDS[:4]),
        "NVIDIA_GPU_MEMORY_REQUEST": "40960",
        "NVIDIA_GPU_MEMORY_LIMIT": "61440",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{u}=61440M" for u in UUIDS[:4]),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_VISIBLE_DEVICES": ",".join(UUIDS[:4]),
    }
    ns = namespace_name(pod.uid, "app")
    assert [(m.destination, m.type, m.source, list(m.options)) for m in adj.mounts] == [
        ("/tmp/nvidia-mps", "bind", h.layout.namespace_pipe_dir(ns), ["rbind", "ro", "nosuid", "nodev"])
    ]
    # runc bind-mounts at task creation, before StartContainer: the source must exist already
    assert os.path.isdir(h.layout.namespace_pipe_dir(ns))
    # Every set is preceded by its removal marker (clears an earlier plugin's claim).
    keys = [kv.key for kv in adj.env]
    assert keys[0::2] == ["-" + k for k in keys[1::2]]
    tenancies = h.ledger.tenancies()
    assert sorted(t.gpu_uuid for t in tenancies) == sorted(UUIDS[:4])
    assert {(t.container_id, t.mps_namespace, t.active_thread_percentage) for t in tenancies} == {(ctr.id, ns, 50)}
    # The namespace is made in the background and awaited at StartContainer.
    assert h.rt.start_container(pod, ctr) is None
    ((_, uid, name, atp, timeout),) = h.mps.named("ensure_namespace")
    assert (uid, name, atp) == (pod.uid, "app", 50) and 0 < timeout <= 5.0
    # issue 12: the namespace's pinned memory limit is the container's limit per GPU
    assert h.mps.kw[-1] == {"mode": ComputeMode.SM_SHARING, "pinned_limit_mib": 61440}
    assert [d for d, _ in h.metrics.hooks] == ["nri"]
    assert h.rt.registrations[-1].events == 0x62d


def test_classic_mps_sm_sharing_needs_no_namespace(make_harness):
    h = make_harness(planner_config=PlannerConfig(mps_namespaces=False, layout=MpsLayout("/tmp/fp-v2-mps"))).start()
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    adj = h.rt.create_container(pod, ctr)
    assert not isinstance(adj, RpcError), adj
    assert [(m.destination, m.source) for m in adj.mounts] == [
        ("/tmp/nvidia-mps", "/tmp/fp-v2-mps/sm")]
    assert os.path.isdir("/tmp/fp-v2-mps/sm")  # the mount source exists before the runtime mounts it
    shutil.rmtree("/tmp/fp-v2-mps")
    assert effective_env(ctr, adj)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert h.rt.start_container(pod, ctr) is None  # nothing to wait for
    assert h.mps.named("ensure_namespace") == []
    assert {t.mps_namespace for t in h.ledger.tenancies()} == {None}


def test_unmakeable_mount_source_is_unavailable_not_a_broken_container(make_harness, sockdir):
    blocker = os.path.join(sockdir, "file")
    open(blocker, "w").close()  # a file where the MPS root should be
    h = make_harness(planner_config=PlannerConfig(layout=MpsLayout(blocker))).start()
    pod, (ctr,) = _manifest("notebook-time-slicing-2gpu.yaml")
    err = h.rt.create_container(pod, ctr)
    assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE
    assert "cannot create the MPS pipe directory" in err.message
    assert h.ledger.tenancies() == []


def test_pod_authored_values_of_our_keys_are_overridden(h):
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    ctr = make_container(pod, "app", env=[PATH_ENV, "NVIDIA_VISIBLE_DEVICES=all", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100",
                                          "NVIDIA_GPU_MEMORY_LIMIT=999999"])
    env = effective_env(ctr, h.rt.create_container(pod, ctr))
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS[:4])
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "61440"


def test_unbound_pod_is_placed_by_the_node(h):
    pod, (ctr,) = _manifest("notebook-time-slicing-2gpu.yaml")
    env = effective_env(ctr, h.rt.create_container(pod, ctr))
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40267"  # floor((81559 - 1024) * 0.5): KAI's reserve
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "64428"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{UUIDS[0]}=64428M,{UUIDS[1]}=64428M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert len(h.ledger.tenancies()) == 2
    # issue 12: time-slicing gets its own namespace leaf too (never the daemon's control socket)
    assert h.rt.start_container(pod, ctr) is None
    ((_, uid, name, atp, _),) = h.mps.named("ensure_namespace")
    assert (uid, name, atp) == (pod.uid, ctr.name, None)
    assert h.mps.kw[-1] == {"mode": ComputeMode.TIME_SLICING, "pinned_limit_mib": int(env["NVIDIA_GPU_MEMORY_LIMIT"])}


def test_pod_without_fraction_annotations_is_untouched(h):
    pod = make_pod("plain", annotations={"example.com/whatever": "1"})
    ctr = make_container(pod, "main")
    adj = h.rt.create_container(pod, ctr)
    assert adj == nri_pb2.ContainerAdjustment()
    assert h.ledger.tenancies() == []


def _refused_pod():
    return make_pod("bad", uid="uid-bad", annotations={
        "nvidia.com/container.app.gpu-memory.request": "40Gi",
        "nvidia.com/container.app.gpu-memory.limit": "20Gi",
    })


def test_refusal_is_invalid_argument_naming_key_value_and_rule(h):
    pod = _refused_pod()
    err = h.rt.create_container(pod, make_container(pod, "app"))
    assert isinstance(err, RpcError) and err.code == Code.INVALID_ARGUMENT
    assert err.message.startswith('nvidia.com/container.app.gpu-memory.limit="20Gi" ')
    assert "40Gi" in err.message and "the limit must be >= the request" in err.message
    assert h.ledger.tenancies() == []
    assert h.metrics.refusals == ["limit_below_request"]
    # The plugin stays connected and serves the next container.
    pod2, (ctr2,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod2, ctr2), RpcError)


def test_fail_open_leaves_a_refused_container_unadjusted(make_harness):
    h = make_harness(fail_open=True).start()
    pod = _refused_pod()
    assert h.rt.create_container(pod, make_container(pod, "app")) == nri_pb2.ContainerAdjustment()
    assert h.metrics.refusals == ["limit_below_request"]
    assert h.ledger.tenancies() == []


def test_mps_failure_fails_the_start_with_unavailable(h):
    h.mps.fail = RuntimeError("control daemon down")
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod, ctr), RpcError)
    err = h.rt.start_container(pod, ctr)
    assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE and "control daemon down" in err.message
    assert h.metrics.refusals == ["mps_unavailable"]
    h.rt.remove_container(pod, ctr)  # kubelet removes the failed container
    assert h.ledger.tenancies() == []


def _records(caplog, text):
    return [r for r in list(caplog.records) if text in r.getMessage()]


@pytest.mark.parametrize("start_wait_s", [0.05, 30.0])
def test_start_never_refuses_a_slow_namespace_and_keeps_the_runtime_timeout(make_harness, caplog, start_wait_s):
    """ADR 0028: the namespace job is still running (the MPS gate stays shut
    until StartContainer has answered): the container starts, the log says the
    wait was spent, and a later line says when the namespace got made. A
    configured wait far past the runtime's 1 s request timeout is cut to the
    handler's budget: the answer comes before the runtime gives up."""
    caplog.set_level("INFO", logger="fracplugin.nri.plugin")
    h = make_harness(runtime_kwargs={"request_timeout_ms": 1000}, plugin_kwargs={"start_wait_s": start_wait_s}).start()
    gate = threading.Event()
    h.mps.block = gate
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod, ctr), RpcError)  # not held up by MPS
    try:
        assert h.rt.start_container(pod, ctr) is None  # started, not refused; answered within the runtime timeout
        assert not h.mps.done.is_set()  # the namespace really was not there yet
    finally:
        gate.set()
    (spent,) = _records(caplog, "StartContainer wait spent")
    assert spent.levelname == "WARNING" and spent.container_id == ctr.id
    # The cut to the handler's budget is proven by the answer above arriving within the runtime's
    # 1 s timeout (the peer fails the call otherwise); waited_s is wall time, not asserted (busy machine).
    assert spent.namespace_job in ("queued", "running") and spent.start_wait_s == start_wait_s
    assert h.metrics.refusals == []
    wait_for(lambda: _records(caplog, "namespace ready after its container started"), what="the late namespace line")
    assert len(h.mps.named("ensure_namespace")) == 1
    assert h.plugin.status()["pending_namespaces"] == 0
    assert len(h.ledger.tenancies()) == 4


def test_start_refuses_when_the_daemon_of_the_mode_is_down_not_slow(make_harness, caplog):
    """A namespace job waiting for a daemon that is down is not slow: the
    start is refused (UNAVAILABLE, kubelet retries), as CreateContainer
    refuses while that daemon is down (issue 12)."""
    h = make_harness(plugin_kwargs={"start_wait_s": 0.05}).start()
    up = {"sm": True}
    h.mps.healthy = lambda mode: up["sm"]
    gate = threading.Event()
    h.mps.block = gate
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod, ctr), RpcError)
    up["sm"] = False
    try:
        err = h.rt.start_container(pod, ctr)
        assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE and "daemon is down" in err.message
        assert h.metrics.refusals == ["mps_unavailable"]
    finally:
        up["sm"] = True
        gate.set()
    assert not _records(caplog, "StartContainer wait spent")


def test_start_after_a_failed_namespace_is_refused_even_when_slow_ones_start(h):
    """Failed is not slow: an ensure that raised fails the start (UNAVAILABLE)."""
    h.mps.fail = RuntimeError("namespace create refused")
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod, ctr), RpcError)
    wait_for(h.mps.done.is_set, what="the failed ensure")
    err = h.rt.start_container(pod, ctr)
    assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE and "namespace create refused" in err.message


def test_stop_drains_within_half_the_request_timeout_and_remove_releases(h):
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    h.rt.create_container(pod, ctr)
    assert h.rt.stop_container(pod, ctr) == []
    ((_, cid, timeout),) = h.mps.named("drain")
    # issue 12: only the daemon of the container's mode, with the drain's own budget (in the background)
    assert cid == ctr.id and timeout == h.plugin.settings.drain_timeout_s
    assert {"modes": [ComputeMode.SM_SHARING]} in h.mps.kw
    assert h.ledger.tenancies() == []  # a stopped container holds no memory (issue 10 item 4)
    assert h.mps.named("release_namespace") == []  # its namespace goes at removal (StopContainer's budget)
    assert h.rt.remove_container(pod, ctr) is None
    assert h.ledger.tenancies() == []
    wait_for(lambda: h.mps.named("release_namespace"), what="background namespace release")
    assert h.mps.named("release_namespace") == [("release_namespace", pod.uid, "app")]


def test_v08_runtime_removes_through_state_change(make_harness):
    h = make_harness(runtime_kwargs={"nri_version": "v0.8.0"}).start()
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    h.rt.create_container(pod, ctr)
    assert h.rt.remove_container(pod, ctr) is None
    assert h.rt.calls[-1] == "StateChange:REMOVE_CONTAINER"
    assert h.ledger.tenancies() == []
    assert h.rt.registrations[-1].events == 0x62d


def test_container_restart_replaces_its_hold(h):
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    h.rt.create_container(pod, ctr)
    again = make_container(pod, "app", container_id="ctr-restarted")
    h.rt.create_container(pod, again)
    assert {t.container_id for t in h.ledger.tenancies()} == {"ctr-restarted"}
    h.rt.remove_container(pod, ctr)  # the old container's removal frees nothing
    assert len(h.ledger.tenancies()) == 4
    assert h.mps.named("release_namespace") == []


# ---------------------------------------------------------------- synchronize


def _running(pod, name, *, adjusted, container_id):
    """A running container as the runtime reports it: with our env when it
    was adjusted at creation, with the spec env only when it was not."""
    env = [PATH_ENV]
    if adjusted:
        p = plan_container(dict(pod.annotations), name, PodRef(pod.namespace, pod.name, pod.uid), NODE, Ledger(NODE),
                           PlannerConfig())
        env += [f"{kv.key}={kv.value}" for kv in build_adjustment(p).env if not kv.key.startswith("-")]
    return make_container(pod, name, container_id=container_id, env=env, state=nri_pb2.CONTAINER_RUNNING)


def test_synchronize_rebuilds_the_ledger_and_reports_unadjusted_containers(make_harness):
    h = make_harness()
    bound, _ = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    notebook, _ = _manifest("notebook-time-slicing-2gpu.yaml")
    plain = make_pod("plain")
    bound_ctr = _running(bound, "app", adjusted=True, container_id="c-bound")
    nb_ctr = _running(notebook, "notebook", adjusted=True, container_id="c-nb")
    plain_ctr = make_container(plain, "main", container_id="c-plain", state=nri_pb2.CONTAINER_RUNNING)
    # A stale entry from before the restart, for a container that is gone.
    stale = make_pod("gone", uid="uid-gone", annotations={"nvidia.com/container.x.gpu-memory.request": "1Gi",
                                                          "nvidia.com/container.x.gpus.devices": "0"})
    stale_plan = plan_container(dict(stale.annotations), "x", PodRef("default", "gone", "uid-gone"), NODE, h.ledger,
                                PlannerConfig())
    h.ledger.admit(stale_plan, "c-gone")
    assert not h.stub.ready()
    h.start([bound, notebook, plain], [bound_ctr, nb_ctr, plain_ctr])
    assert h.stub.ready() and h.plugin.ready()
    view = _ledger_view(h.ledger)
    assert {(uid, cid) for uid, _, _, cid, _, _ in view} == {(bound.uid, "c-bound"), (notebook.uid, "c-nb")}
    assert len(view) == 6 and len(set(view)) == 6
    nb_gpus = {gpu for uid, _, gpu, _, _, _ in view if uid == notebook.uid}
    assert nb_gpus == set(dict(kv.split("=", 1) for kv in nb_ctr.env)["NVIDIA_VISIBLE_DEVICES"].split(","))
    assert h.plugin.reconciler.unadjusted == []
    # A restarted daemon's MPS layer is told again about the running sm-sharing namespace.
    wait_for(lambda: len(h.mps.named("ensure_namespace")) == 2, what="namespace renewal")
    # both modes have namespaces under MPS v3 (issue 12)
    assert sorted(c[1:4] for c in h.mps.named("ensure_namespace")) == sorted(
        [(bound.uid, "app", 50), (notebook.uid, "notebook", None)])


def test_synchronize_records_unadjusted_bound_container_and_reports_it(make_harness):
    h = make_harness()
    bound, _ = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    notebook, _ = _manifest("notebook-time-slicing-2gpu.yaml")
    h.start([bound, notebook], [_running(bound, "app", adjusted=False, container_id="c-bound"),
                                _running(notebook, "notebook", adjusted=False, container_id="c-nb")])
    # The bound container's devices are known from its annotations: recorded.
    # The node-placed one never got devices from us: reported, not invented.
    assert {t.container_id for t in h.ledger.tenancies()} == {"c-bound"}
    assert len(h.ledger.tenancies()) == 4
    report = {u["container_id"]: u for u in h.plugin.reconciler.unadjusted}
    assert set(report) == {"c-bound", "c-nb"}
    assert "NVIDIA_GPU_MEMORY_LIMIT" in report["c-bound"]["missing"]


def test_split_synchronize_is_honoured(make_harness):
    h = make_harness()
    h.stub.start()
    h.rt.wait_registered()
    pods, ctrs = [], []
    for i in range(6):
        pod = make_pod(f"p{i}", uid=f"uid-{i}", annotations={
            "nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": str(i % 4)})
        pods.append(pod)
        ctrs.append(_running(pod, "c", adjusted=True, container_id=f"c{i}"))
    assert h.rt.synchronize(pods, ctrs, parts=3) == []
    wait_for(h.stub.ever_synchronized, 5)
    assert sorted(t.container_id for t in h.ledger.tenancies()) == [f"c{i}" for i in range(6)]


# ----------------------------------------------------------------- robustness


def _pods_running(n=3):
    pods, ctrs = [], []
    for i in range(n):
        pod = make_pod(f"r{i}", uid=f"uid-r{i}", annotations={
            "nvidia.com/container.c.gpu-memory.request": "2Gi", "nvidia.com/container.c.gpus.devices": str(i % 4)})
        pods.append(pod)
        ctrs.append(_running(pod, "c", adjusted=True, container_id=f"cr{i}"))
    return pods, ctrs


def _assert_recovers(h, old, before, pods, ctrs):
    """The plugin dropped connection ``old``, reconnected and was synchronized
    again; the ledger holds exactly what it held."""
    assert old.closed.wait(scaled(10)), "the bad connection was not dropped"
    wait_for(lambda: h.rt.connections >= 2 and h.rt.transport is not None and not h.rt.transport.closed.is_set(),
             what="reconnection")
    h.rt.wait_registered()
    h.rt.synchronize(pods, ctrs)
    assert _ledger_view(h.ledger) == before
    assert h.stub.synchronize_count >= 2
    pod = make_pod("after", uid="uid-after", annotations={"nvidia.com/container.c.gpu-memory.request": "1Gi",
                                                          "nvidia.com/container.c.gpus.devices": "1"})
    assert not isinstance(h.rt.create_container(pod, make_container(pod, "c")), RpcError)


@pytest.fixture
def running(make_harness):
    h = make_harness()
    pods, ctrs = _pods_running()
    h.start(pods, ctrs)
    before = _ledger_view(h.ledger)
    assert len(before) == 3
    return h, before, pods, ctrs


def test_runtime_going_away_and_coming_back(running):
    h, before, pods, ctrs = running
    h.rt.close()
    wait_for(lambda: not h.stub.connected(), what="disconnect")
    assert _ledger_view(h.ledger) == before  # nothing lost while the runtime is away
    rt = h.restart_runtime(initial_sync=(pods, ctrs))
    rt.wait_registered()
    assert _ledger_view(h.ledger) == before
    assert h.stub.sessions_started == 2 and h.stub.connected()


def test_garbage_drops_the_connection_and_the_plugin_reconnects(running):
    h, before, pods, ctrs = running
    old = h.rt.transport
    h.rt.transport.send_raw(b"\xde\xad\xbe\xef" * 64)
    _assert_recovers(h, old, before, pods, ctrs)


def test_truncated_frame_then_close(running):
    h, before, pods, ctrs = running
    old = h.rt.transport
    body = wire.encode_request(wire.Request(PLUGIN_SERVICE, "CreateContainer", b"\x0a\x00"))
    msg = wire.ttrpc_frame(99, wire.REQUEST, body)
    h.rt.transport.send_raw(struct.pack(">II", 1, len(msg)) + msg[:7])  # mux frame cut short
    h.rt.disconnect()
    _assert_recovers(h, old, before, pods, ctrs)


def test_oversized_mux_frame_drops_the_connection(running):
    h, before, pods, ctrs = running
    old = h.rt.transport
    h.rt.transport.send_raw(struct.pack(">II", 1, wire.MUX_MAX_PAYLOAD + 1))
    _assert_recovers(h, old, before, pods, ctrs)


def test_oversized_ttrpc_message_is_answered_resource_exhausted(running):
    h, before, pods, ctrs = running
    # A ttrpc request above 4 MiB, spread over legal mux frames: discarded and
    # answered RESOURCE_EXHAUSTED; the connection stays up.
    body = wire.encode_request(wire.Request(PLUGIN_SERVICE, "CreateContainer", b"\0" * (wire.TTRPC_MAX_DATA + 1)))
    resp = h.rt.transport.call_async_body(body, check_size=False).result(10)
    assert resp.code == Code.RESOURCE_EXHAUSTED
    resp = h.rt.call_raw(PLUGIN_SERVICE, "Frobnicate", b"")
    assert resp.code == Code.UNIMPLEMENTED
    assert h.rt.transport is not None and not h.rt.transport.closed.is_set()
    assert _ledger_view(h.ledger) == before


def test_unknown_methods_and_services_are_unimplemented(running):
    h, before, _, _ = running
    resp = h.rt.call_raw(PLUGIN_SERVICE, "Frobnicate", b"")
    assert (resp.code, resp.message) == (Code.UNIMPLEMENTED, "method Frobnicate")
    resp = h.rt.call_raw("example.Other", "CreateContainer", b"")
    assert (resp.code, resp.message) == (Code.UNIMPLEMENTED, "service example.Other")
    resp = h.rt.call_raw(PLUGIN_SERVICE, "CreateContainer", b"\xff\xff\xff")
    assert resp.code == Code.INVALID_ARGUMENT
    resp = h.rt.call_raw(PLUGIN_SERVICE, "Shutdown", b"")
    assert resp.ok
    assert h.stub.connected() and _ledger_view(h.ledger) == before


def test_a_slow_creation_is_cut_at_the_budget_and_its_admission_undone(make_harness, caplog):
    """A CreateContainer that overruns its budget (here its pod lookup hangs)
    is answered UNAVAILABLE by the stub; its late admission is undone."""
    gate, asked = threading.Event(), threading.Event()
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")

    def slow_lookup(namespace, name):
        asked.set()
        gate.wait(10)
        return {"metadata": {"uid": pod.uid}, "spec": {"containers": [{"name": "app"}]}}

    h = make_harness(runtime_kwargs={"request_timeout_ms": 1000}, plugin_kwargs={"pod_lookup": slow_lookup}).start()
    try:
        err = h.rt.create_container(pod, ctr)  # answered by the stub (0.75 s budget) before the runtime gives up (1 s)
        assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE and "budget" in err.message
        assert asked.is_set() and h.rt.transport is not None and not h.rt.transport.closed.is_set()
    finally:
        gate.set()
    wait_for(lambda: _records(caplog, "admission undone"), what="the late result dropped")
    (undone,) = _records(caplog, "admission undone")
    assert undone.gpus == 4 and h.ledger.tenancies() == []  # admitted late, then undone


def test_requests_are_served_concurrently(make_harness):
    """A StartContainer awaiting its MPS namespace (on a handler thread) holds
    up no other call: another pod's CreateContainer and StartContainer are
    served meanwhile."""
    h = make_harness(runtime_kwargs={"request_timeout_ms": 10000}, plugin_kwargs={"start_wait_s": 8.0}).start()
    gate = threading.Event()
    h.mps.block = gate
    slow_pod, (slow_ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(slow_pod, slow_ctr), RpcError)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("slow", h.rt.start_container(slow_pod, slow_ctr)))
    try:
        wait_for(lambda: h.mps.named("ensure_namespace"), what="the slow namespace to reach MPS")
        h.mps.block = None
        t.start()
        fast = make_pod("fast", uid="uid-fast", annotations={"nvidia.com/container.c.gpu-memory.request": "1Gi",
                                                             "nvidia.com/container.c.gpu-compute.mode": "sm-sharing",
                                                             "nvidia.com/container.c.gpus.devices": "0"})
        fast_ctr = make_container(fast, "c")
        assert not isinstance(h.rt.create_container(fast, fast_ctr), RpcError)
        assert h.rt.start_container(fast, fast_ctr) is None
        assert "slow" not in result  # served while the first one still waits
    finally:
        gate.set()
        t.join(10)
    assert result["slow"] is None
    assert len(h.ledger.tenancies()) == 5


_garbage = st.one_of(
    st.binary(min_size=1, max_size=400),
    # well-formed mux frames on the Plugin conn carrying junk ttrpc
    st.binary(min_size=1, max_size=300).map(lambda b: struct.pack(">II", 1, len(b)) + b),
    # well-formed mux + ttrpc framing around a junk or truncated request body
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 255), st.binary(max_size=200)).map(
        lambda t: (lambda m: struct.pack(">II", 1, len(m)) + m)(wire.ttrpc_frame(t[0], t[1], t[2]))
    ),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_garbage)
def test_any_garbage_then_a_runtime_restart_loses_and_duplicates_nothing(running, data):
    h, before, pods, ctrs = running
    old = h.rt.transport
    try:
        old.send_raw(data)
    except ConnectionError:
        pass  # the plugin already dropped the connection
    h.rt.disconnect()  # the runtime side dies mid-stream
    assert old.closed.wait(scaled(10))
    wait_for(lambda: h.rt.transport is not old and h.rt.transport is not None, what="reconnection")
    h.rt.wait_registered()
    h.rt.synchronize(pods, ctrs)
    assert _ledger_view(h.ledger) == before
    assert not h.stub.exited


def _recording_refusals():
    seen = []
    return seen, lambda pod, container, err: seen.append((pod, container, err.key, err.code))


@pytest.mark.parametrize("fail_open", [False, True])
def test_every_refusal_reaches_on_refusal(make_harness, fail_open):
    seen, hook = _recording_refusals()
    h = make_harness(fail_open=fail_open, plugin_kwargs={"on_refusal": hook}).start()
    pod = _refused_pod()
    res = h.rt.create_container(pod, make_container(pod, "app"))
    assert isinstance(res, RpcError) != fail_open
    assert seen == [(PodRef("default", "bad", "uid-bad"), "app", "nvidia.com/container.app.gpu-memory.limit",
                     "limit_below_request")]
    # Admissions and untouched containers do not call it.
    pod2, (ctr2,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod2, ctr2), RpcError)
    plain = make_pod("plain", uid="uid-plain")
    assert h.rt.create_container(plain, make_container(plain, "app")) == nri_pb2.ContainerAdjustment()
    assert len(seen) == 1


def test_a_failing_on_refusal_does_not_change_the_answer(make_harness):
    def hook(pod, container, err):
        raise RuntimeError("event queue broken")

    h = make_harness(plugin_kwargs={"on_refusal": hook}).start()
    pod = _refused_pod()
    err = h.rt.create_container(pod, make_container(pod, "app"))
    assert isinstance(err, RpcError) and err.code == Code.INVALID_ARGUMENT
    assert err.message.startswith('nvidia.com/container.app.gpu-memory.limit="20Gi" ')
    assert h.metrics.refusals == ["limit_below_request"]


def test_container_of_a_mode_whose_daemon_is_down_gets_unavailable(h):
    # issue 12: no admission pointing at a pipe directory with no daemon
    down = {ComputeMode.TIME_SLICING: "failed after 5 restarts, retrying every 30s: start failed"}
    h.mps.healthy = lambda mode: mode not in down
    h.mps.unhealthy_reason = lambda mode: down.get(mode, "")
    pod, (ctr,) = _manifest("notebook-time-slicing-2gpu.yaml")
    err = h.rt.create_container(pod, ctr)
    assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE
    assert "the time-slicing MPS daemon is down (failed after 5 restarts" in err.message
    assert h.ledger.tenancies() == [] and h.metrics.refusals == ["mps_unavailable"]
    # the other mode is admitted
    pod2, (ctr2,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod2, ctr2), RpcError)
    del down[ComputeMode.TIME_SLICING]
    # back: admitted (the runtime retries); one mode per GPU puts it on no GPU here, so check the refusal kind
    err = h.rt.create_container(pod, ctr)
    assert not (isinstance(err, RpcError) and err.code == Code.UNAVAILABLE)


def test_no_fraction_is_placed_on_an_unhealthy_gpu(make_harness):
    from fracplugin.gpu.inventory import XidEvent

    h = make_harness().start()
    h.plugin.rules.health.record_xid(XidEvent(UUIDS[0], 79))  # the node's health monitor (issue 33)
    # bound to the unhealthy GPU: UNAVAILABLE (it may recover: noderules.status_of) naming it and why
    bound, (bctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    err = h.rt.create_container(bound, bctr)
    assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE
    assert f"GPU 0 ({UUIDS[0]}), which is Unhealthy (xid 79)" in err.message
    assert h.metrics.refusals == ["unhealthy"] and h.ledger.tenancies() == []
    # node-placed: planned on healthy GPUs only
    pod, (ctr,) = _manifest("notebook-time-slicing-2gpu.yaml")
    adj = h.rt.create_container(pod, ctr)
    assert not isinstance(adj, RpcError), adj
    assert UUIDS[0] not in effective_env(ctr, adj)["NVIDIA_VISIBLE_DEVICES"]
    assert len(h.ledger.tenancies()) == 2 and all(t.gpu_uuid != UUIDS[0] for t in h.ledger.tenancies())


def test_create_is_served_on_the_reader_thread_unless_it_may_wait_on_mps(make_harness):
    """issue 14: CreateContainer that only plans, admits and answers runs on
    the stub's reader thread; while a daemon is down (it waits for it) or
    when it creates the namespace itself, on a handler thread. Same answers."""
    h = make_harness().start()
    assert [h.plugin.may_block(m) for m in ("CreateContainer", "RemoveContainer", "StartContainer",
                                            "StopContainer", "Synchronize", "StateChange")] == [
        False, False, True, True, True, True]
    down = {ComputeMode.TIME_SLICING}
    h.mps.healthy = lambda mode: mode not in down
    h.mps.unhealthy_reason = lambda mode: "probe failed"
    assert h.plugin.may_block("CreateContainer")
    nb, (nctr,) = _manifest("notebook-time-slicing-2gpu.yaml")
    err = h.rt.create_container(nb, nctr)
    assert isinstance(err, RpcError) and err.code == Code.UNAVAILABLE  # waited for the daemon, on a handler thread
    assert h.metrics.threads[-1].startswith("nri-handler")
    down.clear()
    assert not h.plugin.may_block("CreateContainer")
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    assert not isinstance(h.rt.create_container(pod, ctr), RpcError)
    assert h.metrics.threads[-1].endswith("-reader")


def test_a_mount_source_removed_since_the_last_creation_is_made_again(h):
    """The mount source is checked on every creation (one stat when it was
    made before): the MPS layer removes a released namespace's directory."""
    pod, (ctr,) = _manifest("inference-sm-sharing-4gpu.bound.yaml")
    adj = h.rt.create_container(pod, ctr)
    assert not isinstance(adj, RpcError)
    (src,) = [m.source for m in adj.mounts]
    assert os.path.isdir(src)
    assert h.rt.remove_container(pod, ctr) is None
    os.rmdir(src)
    again = make_container(pod, "app", container_id="again")
    again.env.extend(ctr.env)
    adj = h.rt.create_container(pod, again)
    assert not isinstance(adj, RpcError) and [m.source for m in adj.mounts] == [src]
    assert os.path.isdir(src) and (os.stat(src).st_mode & 0o777) == 0o755


def test_synchronize_keeps_dra_claims_and_does_not_count_their_containers_whole(make_harness):
    """A DRA claim's hold (ADR 0031) is kubelet's to free (NodeUnprepareResources),
    not the runtime's: Synchronize keeps it; the claim's container, whose env
    the claim's CDI spec set (NVIDIA_VISIBLE_DEVICES, FRACPLUGIN_DRA_CLAIM),
    is not counted as an unfenced user of its GPU."""
    from fracplugin.dra import claims as dra_claims
    from tests.peers.resource_api import claim_doc

    h = make_harness()
    claim = dra_claims.read_claim(claim_doc("team-a", "infer", "claim-uid-1", node=NODE.name, memory="20Gi"), NODE)
    plan = dra_claims.plan_claim(claim, node_rules(NODE, h.ledger))
    h.ledger.admit(plan, door="dra", reservation=claim.reservation)
    pod = make_pod("dra-pod")
    env = [PATH_ENV, f"NVIDIA_VISIBLE_DEVICES={NODE.gpus[0].uuid}", "FRACPLUGIN_DRA_CLAIM=claim-uid-1"]
    ctr = make_container(pod, "app", container_id="c-dra", env=env, state=nri_pb2.CONTAINER_RUNNING)
    h.start([pod], [ctr])
    assert h.stub.ready()
    assert [(t.door, t.reservation, t.request_mib) for t in h.ledger.tenancies()] == [("dra", "dra:claim-uid-1", 20480)]
    # without the claim's hold the same container is a GPU user fracplugin did not fence: counted whole
    h.ledger.release_reservation(claim.reservation)
    rt = h.restart_runtime()
    rt.wait_registered()
    rt.synchronize([pod], [ctr])
    wait_for(lambda: [t.door for t in h.ledger.tenancies()] == ["sync"], what="the container counted whole")
