"""Early MPS namespaces (ADR 0030, ``nri/early.py``) through the real NRI
socket with the fake runtime: a pod's namespace is queued at RunPodSandbox,
CreateContainer and StartContainer reuse it, and a pod removed before its
containers leaks nothing. Every wait is on a condition."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import wait_for
from fracplugin.model import ComputeMode
from fracplugin.nri.early import EARLY_MAX

from nri_runtime import Code, RpcError, make_container, make_pod
from test_nri_plugin import _refused_pod, make_harness  # noqa: F401 (make_harness: the fixture, shared)

P = "nvidia.com/container."


def _sm_pod(name: str, *, portion: str = "0.25", extra: dict[str, str] | None = None):
    pod = make_pod(name, uid=f"uid-{name}", annotations={
        P + "app.gpu-memory.request": "1Gi", P + "app.gpu-memory.limit": "2Gi",
        P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": portion, **(extra or {})})
    return pod, make_container(pod, "app", container_id=f"ctr-{name}")




def _idle(h) -> bool:
    jobs = h.plugin.status()["mps_jobs"]
    return jobs["queued"] == 0 and jobs["running"] == 0


def _ensures(h, uid):
    return [c for c in h.mps.named("ensure_namespace") if c[1] == uid]


def _releases(h, uid):
    return [c for c in h.mps.named("release_namespace") if c[1] == uid]


@pytest.mark.parametrize("version", ["v0.12.2", "v0.8.0"])
def test_namespace_is_made_at_run_pod_sandbox_and_create_start_issue_no_mps_command(make_harness, version):
    h = make_harness(runtime_kwargs={"nri_version": version}).start()
    assert h.rt.registrations[-1].events == 0x62d  # RunPodSandbox and RemovePodSandbox subscribed
    pod, ctr = _sm_pod("early")
    assert h.rt.run_pod_sandbox(pod) is None
    assert h.rt.calls[-1] == ("RunPodSandbox" if version == "v0.12.2" else "StateChange:RUN_POD_SANDBOX")
    wait_for(lambda: _ensures(h, pod.uid) and _idle(h), what="the early ensure to finish")
    assert "CreateContainer" not in h.rt.calls  # made before any CreateContainer
    ((_, uid, name, atp, _t),) = _ensures(h, pod.uid)
    assert (uid, name, atp) == (pod.uid, "app", 25)
    assert h.mps.kw[-1] == {"mode": ComputeMode.SM_SHARING, "pinned_limit_mib": 2048}  # CreateContainer's settings
    before = list(h.mps.calls)
    adj = h.rt.create_container(pod, ctr)
    assert not isinstance(adj, RpcError), adj
    assert h.rt.start_container(pod, ctr) is None
    assert h.mps.calls == before  # Create + Start: no further MPS command
    early = h.plugin.status()["early_namespaces"]
    assert (early["pending"], early["queued"], early["used"], early["mismatched"]) == (0, 1, 1, 0)
    # once a container holds it, the namespace goes with its RemoveContainer, not with the pod
    assert h.rt.remove_pod_sandbox(pod) is None
    assert h.plugin.status()["early_namespaces"]["released"] == 0
    assert h.rt.remove_container(pod, ctr) is None
    wait_for(lambda: _releases(h, pod.uid), what="the namespace released at RemoveContainer")


def test_create_awaits_an_early_ensure_still_running(make_harness):
    h = make_harness().start()
    gate = threading.Event()
    h.mps.block = gate
    pod, ctr = _sm_pod("slow")
    try:
        assert h.rt.run_pod_sandbox(pod) is None
        wait_for(lambda: _ensures(h, pod.uid), what="the early ensure to reach MPS")
        assert not isinstance(h.rt.create_container(pod, ctr), RpcError)
    finally:
        gate.set()
    assert h.rt.start_container(pod, ctr) is None
    wait_for(lambda: _idle(h), what="the MPS queue to drain")
    assert len(_ensures(h, pod.uid)) == 1  # the early one, awaited; none queued by Create or Start
    assert h.plugin.status()["early_namespaces"]["used"] == 1


def test_an_early_ensure_a_container_awaits_runs_before_early_work_nobody_awaits(make_harness, monkeypatch):
    """A burst: every pod's RunPodSandbox queued its ensure; the one whose
    CreateContainer came (its StartContainer is next) is made first."""
    import fracplugin.nri.namespaces as namespaces

    monkeypatch.setattr(namespaces, "_NS_WORKERS", 1)  # one MPS worker: the order is the queue's
    h = make_harness().start()
    gate = threading.Event()
    h.mps.block = gate
    hold, _ = _sm_pod("hold")
    first, _ = _sm_pod("first")
    second, ctr = _sm_pod("second")
    try:
        assert h.rt.run_pod_sandbox(hold) is None
        wait_for(lambda: _ensures(h, hold.uid), what="the worker held")
        for p in (first, second):
            assert h.rt.run_pod_sandbox(p) is None
        assert not isinstance(h.rt.create_container(second, ctr), RpcError)
    finally:
        gate.set()
    assert h.rt.start_container(second, ctr) is None
    wait_for(lambda: _idle(h), what="the MPS queue to drain")
    assert [c[1] for c in h.mps.named("ensure_namespace")] == [hold.uid, second.uid, first.uid]


def test_settings_mismatch_falls_back_to_its_own_ensure(make_harness):
    """CreateContainer plans other settings than RunPodSandbox did (what a
    container bound to a device-plugin reservation may get; here the pod the
    runtime sends differs): today's path, one more ensure with its settings."""
    h = make_harness().start()
    pod, _ = _sm_pod("mm", portion="0.25")
    wider, ctr = _sm_pod("mm", portion="0.5")
    assert h.rt.run_pod_sandbox(pod) is None
    wait_for(lambda: _ensures(h, pod.uid) and _idle(h), what="the early ensure")
    assert not isinstance(h.rt.create_container(wider, ctr), RpcError)
    assert h.rt.start_container(wider, ctr) is None
    assert [c[3] for c in _ensures(h, pod.uid)] == [25, 50]  # the caps re-set before the container starts
    early = h.plugin.status()["early_namespaces"]
    assert (early["pending"], early["used"], early["mismatched"]) == (0, 0, 1)


def test_a_pod_removed_before_its_containers_were_created_leaks_nothing(make_harness):
    h = make_harness().start()
    # made, then the pod goes: released
    made, _ = _sm_pod("made")
    assert h.rt.run_pod_sandbox(made) is None
    wait_for(lambda: _ensures(h, made.uid) and _idle(h), what="the early ensure")
    assert h.rt.remove_pod_sandbox(made) is None
    wait_for(lambda: _releases(h, made.uid), what="the early namespace released")
    # four ensures hold the four MPS workers; a fifth pod's ensure stays queued and is dropped with its pod
    gate = threading.Event()
    h.mps.block = gate
    busy = [_sm_pod(f"busy{i}")[0] for i in range(4)]
    try:
        for b in busy:
            assert h.rt.run_pod_sandbox(b) is None
        wait_for(lambda: all(_ensures(h, b.uid) for b in busy), what="four ensures running")
        queued, _ = _sm_pod("queued")
        assert h.rt.run_pod_sandbox(queued) is None
        assert h.plugin.status()["mps_jobs"]["queued"] == 1
        assert h.rt.remove_pod_sandbox(queued) is None
        # a pod whose ensure is running when it goes: released after it
        assert h.rt.remove_pod_sandbox(busy[0]) is None
    finally:
        gate.set()
    wait_for(lambda: _idle(h), what="the MPS queue to drain")
    assert _ensures(h, queued.uid) == [] and _releases(h, queued.uid) == []  # never made: nothing to release
    assert len(_releases(h, busy[0].uid)) == 1
    st = h.plugin.status()["early_namespaces"]
    assert (st["pending"], st["released"]) == (3, 3)
    assert set(h.plugin.namespaces._made) == {(b.uid, "app") for b in busy[1:]}


def test_a_recreated_sandbox_keeps_the_early_namespace_when_the_old_one_is_removed(make_harness):
    """kubelet recreates a dead sandbox (same pod UID, new sandbox id), then
    removes the old one: the early namespace is the new sandbox's."""
    h = make_harness().start()
    old, _ = _sm_pod("again")
    new = make_pod("again", uid=old.uid, pod_id="sandbox-again-2", annotations=dict(old.annotations))
    ctr = make_container(new, "app", container_id="ctr-again")
    assert h.rt.run_pod_sandbox(old) is None
    assert h.rt.run_pod_sandbox(new) is None
    assert h.rt.remove_pod_sandbox(old) is None
    wait_for(lambda: _ensures(h, old.uid) and _idle(h), what="the early ensure")
    assert h.plugin.status()["early_namespaces"]["pending"] == 1 and _releases(h, old.uid) == []
    before = list(h.mps.calls)
    assert not isinstance(h.rt.create_container(new, ctr), RpcError)
    assert h.rt.start_container(new, ctr) is None
    assert h.mps.calls == before


def test_synchronize_releases_early_namespaces_of_pods_the_runtime_no_longer_has(make_harness):
    h = make_harness().start()
    gone, _ = _sm_pod("gone")
    kept, _ = _sm_pod("kept")
    for p in (gone, kept):
        assert h.rt.run_pod_sandbox(p) is None
    wait_for(lambda: _ensures(h, gone.uid) and _ensures(h, kept.uid) and _idle(h), what="both early ensures")
    h.rt.disconnect()  # RemovePodSandbox of "gone" happens while the plugin is away
    h.rt.set_sync_state([kept], [])
    wait_for(lambda: h.rt.transport is not None and not h.rt.transport.closed.is_set() and h.rt.registrations
             and len(h.rt.registrations) >= 2, what="reconnection and the second Synchronize")
    wait_for(lambda: _releases(h, gone.uid), what="the gone pod's early namespace released")
    assert _releases(h, kept.uid) == []
    assert h.plugin.status()["early_namespaces"]["pending"] == 1
    # the kept pod's container still reuses its early namespace
    _, ctr = _sm_pod("kept")
    before = list(h.mps.calls)
    assert not isinstance(h.rt.create_container(kept, ctr), RpcError)
    assert h.rt.start_container(kept, ctr) is None
    assert h.mps.calls == before


def test_a_bad_annotation_does_not_fail_the_sandbox_and_create_still_refuses(make_harness):
    h = make_harness().start()
    bad = _refused_pod()
    assert h.rt.run_pod_sandbox(bad) is None
    err = h.rt.create_container(bad, make_container(bad, "app"))
    assert isinstance(err, RpcError) and err.code == Code.INVALID_ARGUMENT
    assert h.metrics.refusals == ["limit_below_request"]  # counted once, by CreateContainer
    assert h.plugin.status()["early_namespaces"]["queued"] == 0 and h.mps.calls == []


@pytest.mark.parametrize("extra", [
    {"gpu-fraction": "0.5"},  # pod-level KAI form: which container it applies to needs the pod's spec
    {"gpu-fraction-container-name": "app"},
    {"gpu-fraction-num-devices": "1"},  # decides how many GPUs a container without devices gets
])
def test_forms_that_need_the_pod_spec_are_left_to_create(make_harness, extra):
    h = make_harness().start()
    pod, ctr = _sm_pod("kai", extra=extra)
    assert h.rt.run_pod_sandbox(pod) is None
    assert h.plugin.status()["early_namespaces"]["queued"] == 0
    assert not isinstance(h.rt.create_container(pod, ctr), RpcError)
    assert h.rt.start_container(pod, ctr) is None
    assert len(_ensures(h, pod.uid)) == 1  # CreateContainer's own


def test_a_mode_whose_daemon_is_down_gets_no_early_namespace(make_harness):
    h = make_harness().start()
    h.mps.healthy = lambda mode: mode is not ComputeMode.SM_SHARING
    pod, _ = _sm_pod("down")
    assert h.rt.run_pod_sandbox(pod) is None  # CreateContainer refuses while the daemon is down
    assert h.plugin.status()["early_namespaces"]["queued"] == 0
    # a time-slicing container has its namespace too (MPS v3), on its own daemon, which is up
    ts = make_pod("ts", uid="uid-ts", annotations={P + "app.gpu-memory.request": "1Gi"})
    assert h.rt.run_pod_sandbox(ts) is None
    wait_for(lambda: _ensures(h, ts.uid) and _idle(h), what="the time-slicing early ensure")
    assert [c[1] for c in h.mps.named("ensure_namespace")] == [ts.uid]
    assert h.mps.kw[-1]["mode"] is ComputeMode.TIME_SLICING


def test_pod_events_are_served_on_the_reader_thread(make_harness):
    h = make_harness().start()
    assert [h.plugin.may_block(m) for m in ("RunPodSandbox", "RemovePodSandbox")] == [False, False]


def test_the_early_table_is_bounded(make_harness, monkeypatch):
    import fracplugin.nri.early as early

    monkeypatch.setattr(early, "EARLY_MAX", 2)
    h = make_harness().start()
    pods = [_sm_pod(f"b{i}")[0] for i in range(3)]
    for p in pods:
        assert h.rt.run_pod_sandbox(p) is None
    assert h.plugin.status()["early_namespaces"]["pending"] == 2
    assert early.EARLY_MAX == 2 and EARLY_MAX == 4096  # the default
    monkeypatch.setattr(early, "EARLY_MAX", 4096)
    many = make_pod("many", uid="uid-many", annotations={
        P + f"c{i:02d}.gpu-memory.request": "1Gi" for i in range(early.EARLY_PER_POD + 4)})
    assert h.rt.run_pod_sandbox(many) is None
    assert h.plugin.status()["early_namespaces"]["pending"] == 2 + early.EARLY_PER_POD
