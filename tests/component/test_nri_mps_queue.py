"""The NRI door's background MPS work against a slow MPS (issue 14): a burst of
create+remove pairs leaves at most one queued job per namespace owner, every
owner whose namespace was made is released in the end, one owner's MPS calls
never overlap, and a container restarted while its namespace is still queued
gets it. Over a real unix socket with the in-process fake runtime; the slow
MPS is a gate the test opens (entries are counted, never timed)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.mps.api import NullMps
from fracplugin.mps.layout import MpsLayout, namespace_name
from fracplugin.model import ComputeMode
from fracplugin.nri.plugin import FracNriPlugin
from fracplugin.nri.stub import NriStub
from fracplugin.planner import PlannerConfig
from nri_runtime import FakeNriRuntime, RpcError, make_container, make_pod
from tests.helpers import node_rules, scaled, wait_for

REPO = Path(__file__).resolve().parents[2]
NODE = load_node(REPO / "examples" / "nodes" / "gpu-node-1.yaml")
P = "nvidia.com/container."


class SlowMps(NullMps):
    """An MPS layer whose namespace calls wait for ``gate``; records every
    call in order and the most calls of one owner in flight at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, str]] = []
        self.active: dict[tuple[str, str], int] = defaultdict(int)
        self.most_at_once = 0

    def _call(self, what: str, pod_uid: str, container: str) -> None:
        owner = (pod_uid, container)
        with self.lock:
            self.calls.append((what, pod_uid, container))
            self.active[owner] += 1
            self.most_at_once = max(self.most_at_once, self.active[owner])
        try:
            assert self.gate.wait(scaled(30)), "the test never opened the MPS gate"
        finally:
            with self.lock:
                self.active[owner] -= 1

    def ensure_namespace(self, pod_uid, container, atp, timeout_s, mode=ComputeMode.SM_SHARING,
                         pinned_limit_mib=None):
        self._call("ensure", pod_uid, container)
        return MpsLayout().namespace_pipe_dir(namespace_name(pod_uid, container), mode)

    def release_namespace(self, pod_uid, container, timeout_s=None):
        self._call("release", pod_uid, container)
        return True

    def drain(self, container_id, timeout_s, modes=None):
        return None

    def by_owner(self) -> dict[tuple[str, str], list[str]]:
        out: dict[tuple[str, str], list[str]] = defaultdict(list)
        with self.lock:
            for what, uid, name in self.calls:
                out[(uid, name)].append(what)
        return dict(out)


@pytest.fixture
def node():
    tmp = tempfile.mkdtemp(prefix="fpq", dir="/tmp")
    ledger = Ledger(NODE)
    mps = SlowMps()
    plugin = FracNriPlugin(node_rules(NODE, ledger, PlannerConfig(layout=MpsLayout(os.path.join(tmp, "mps")))),
                           mps=mps)
    rt = FakeNriRuntime(os.path.join(tmp, "nri.sock"))
    stub = NriStub(plugin, socket_path=os.path.join(tmp, "nri.sock"), env={}, reconnect_initial_s=0.02,
                   reconnect_max_s=0.2)
    stub.start()
    rt.wait_registered()
    rt.synchronize([], [])
    wait_for(stub.ever_synchronized, 5)
    yield plugin, ledger, mps, rt
    mps.gate.set()
    stub.stop(5)
    rt.close()
    shutil.rmtree(tmp, ignore_errors=True)


def _pod(i: int):
    """A small sm-sharing pod (1 GiB on one GPU the node picks): many fit at once."""
    return make_pod(f"inference-{i}", uid=f"uid-{i:02d}", pod_id=f"sandbox-{i}", annotations={
        P + "app.gpu-memory.request": "1Gi", P + "app.gpu-memory.limit": "2Gi",
        P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": "0.25"})


def _jobs(plugin: FracNriPlugin) -> dict[str, int]:
    return plugin.status()["mps_jobs"]


def test_a_burst_of_creations_and_removals_queues_one_job_per_owner(node):
    plugin, ledger, mps, rt = node
    owners, pairs = 8, 400
    pods = [_pod(i) for i in range(owners)]
    for n in range(pairs):
        pod = pods[n % owners]
        ctr = make_container(pod, "app", container_id=f"ctr-{n:04d}")
        assert not isinstance(rt.create_container(pod, ctr), RpcError)
        assert rt.remove_container(pod, ctr) is None
    # MPS has not answered once: at most one queued job per owner (the old
    # pool queued one per creation and one per removal: 800 here), plus the
    # jobs the 4 workers hold.
    jobs = _jobs(plugin)
    assert jobs["running"] <= 4 and jobs["queued"] <= owners, jobs
    assert plugin.status()["pending_namespaces"] == 0  # no container left to await a namespace
    assert ledger.tenancies() == []
    mps.gate.set()
    wait_for(lambda: _jobs(plugin)["queued"] == 0 and _jobs(plugin)["running"] == 0, what="the queue drained")
    calls = mps.by_owner()
    # Each owner whose namespace was (being) made is released last; an owner's
    # calls alternate (no duplicate work), never overlap, and are few.
    for owner, seq in calls.items():
        assert seq[-1] == "release", (owner, seq)
        assert all(a != b for a, b in zip(seq, seq[1:])), (owner, seq)
        assert len(seq) <= 4, (owner, seq)
    assert mps.most_at_once == 1
    assert sum(len(s) for s in calls.values()) <= 4 * owners


def test_a_container_restarted_before_its_namespace_was_made_gets_it(node):
    plugin, ledger, mps, rt = node
    pod = _pod(0)
    busy = [_pod(i) for i in range(1, 5)]
    for p in busy:  # four other owners hold the four workers in MPS
        assert not isinstance(rt.create_container(p, make_container(p, "app", container_id=f"busy-{p.uid}")), RpcError)
    wait_for(lambda: _jobs(plugin)["running"] == 4, what="the workers busy")
    old = make_container(pod, "app", container_id="ctr-old")
    new = make_container(pod, "app", container_id="ctr-new")
    assert not isinstance(rt.create_container(pod, old), RpcError)
    assert not isinstance(rt.create_container(pod, new), RpcError)  # kubelet restarted the container
    assert rt.remove_container(pod, old) is None  # the old one's removal: the new one holds the owner
    assert _jobs(plugin)["queued"] == 1  # one ensure for the owner, awaited by the new container
    mps.gate.set()
    assert rt.start_container(pod, new) is None
    seq = mps.by_owner()[(pod.uid, "app")]
    assert seq == ["ensure"]  # made once, never released
    assert {t.container_id for t in ledger.tenancies() if t.pod_uid == pod.uid} == {"ctr-new"}


def test_removal_after_the_namespace_was_made_releases_it_after_the_creation(node):
    plugin, ledger, mps, rt = node
    pod = _pod(0)
    ctr = make_container(pod, "app", container_id="ctr-0")
    assert not isinstance(rt.create_container(pod, ctr), RpcError)
    wait_for(lambda: mps.by_owner().get((pod.uid, "app")) == ["ensure"], what="the ensure running")
    assert rt.remove_container(pod, ctr) is None  # while MPS still creates it
    assert _jobs(plugin) == {"queued": 1, "running": 1, "threads": 1}  # the release waits for the ensure
    mps.gate.set()
    wait_for(lambda: _jobs(plugin)["queued"] == 0 and _jobs(plugin)["running"] == 0, what="the queue drained")
    assert mps.by_owner()[(pod.uid, "app")] == ["ensure", "release"]
    assert mps.most_at_once == 1


def _settled(plugin: FracNriPlugin) -> bool:
    return _jobs(plugin)["queued"] == 0 and _jobs(plugin)["running"] == 0


def test_a_new_container_of_an_owner_whose_namespace_is_made_queues_nothing(node):
    # issue 14: each container restart (or the runtime's retry) of a pod's
    # container queued one more ensure of the same namespace.
    plugin, ledger, mps, rt = node
    mps.gate.set()
    pod = _pod(0)
    first = make_container(pod, "app", container_id="ctr-0")
    assert not isinstance(rt.create_container(pod, first), RpcError)
    assert rt.start_container(pod, first) is None
    wait_for(lambda: _settled(plugin), what="the ensure done")
    for n in range(1, 4):  # restarts: the old container goes, a new one comes
        ctr = make_container(pod, "app", container_id=f"ctr-{n}")
        assert not isinstance(rt.create_container(pod, ctr), RpcError)
        assert _jobs(plugin)["queued"] == 0 and _jobs(plugin)["running"] == 0
        assert rt.start_container(pod, ctr) is None  # awaits the ensure that made it
        assert rt.remove_container(pod, make_container(pod, "app", container_id=f"ctr-{n - 1}")) is None
    assert mps.by_owner()[(pod.uid, "app")] == ["ensure"]
    # Other settings for the same owner (a new portion): ensured again.
    other = make_pod("inference-0", uid=pod.uid, pod_id=pod.id, annotations={
        **dict(pod.annotations), P + "app.gpu-compute.portion": "0.5"})
    ctr = make_container(other, "app", container_id="ctr-9")
    assert not isinstance(rt.create_container(other, ctr), RpcError)
    assert rt.start_container(other, ctr) is None
    wait_for(lambda: _settled(plugin), what="the second ensure done")
    assert mps.by_owner()[(pod.uid, "app")] == ["ensure", "ensure"]
    # Released: the next container of the owner makes it again.
    assert rt.remove_container(pod, make_container(pod, "app", container_id="ctr-3")) is None
    assert rt.remove_container(other, ctr) is None
    wait_for(lambda: _settled(plugin) and mps.by_owner()[(pod.uid, "app")][-1] == "release", what="the release")
    again = make_container(pod, "app", container_id="ctr-10")
    assert not isinstance(rt.create_container(pod, again), RpcError)
    assert rt.start_container(pod, again) is None
    assert mps.by_owner()[(pod.uid, "app")] == ["ensure", "ensure", "release", "ensure"]


def test_a_failed_ensure_is_not_reused(node):
    plugin, ledger, mps, rt = node
    mps.gate.set()
    pod = _pod(0)
    calls = {"n": 0}
    ensure = mps.ensure_namespace

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("MPS said no")
        return ensure(*a, **kw)

    mps.ensure_namespace = flaky
    first = make_container(pod, "app", container_id="ctr-0")
    assert not isinstance(rt.create_container(pod, first), RpcError)
    assert isinstance(rt.start_container(pod, first), RpcError)  # UNAVAILABLE: the ensure failed
    second = make_container(pod, "app", container_id="ctr-1")
    assert not isinstance(rt.create_container(pod, second), RpcError)
    assert rt.start_container(pod, second) is None  # a new ensure ran (and succeeded)
    assert calls["n"] == 2
