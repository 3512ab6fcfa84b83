"""MPS namespaces the doors forgot (ADR 0030, "Namespaces the doors forgot";
``nri/orphans.py``): after the doors restart, the Synchronize of the same
runtime reconciles what the MPS layer holds with what the runtime still has.
A namespace of a pod deleted while the doors were down is released; one a
running container, a kubelet reservation or a live pod still owns is kept
(a live pod's is released at its RemovePodSandbox).

Through the real NRI socket and the fake runtime; the MPS layer is a
stand-in that keeps its namespaces across the doors' restart as the MPS role
does, and, in the last test, the real MPS role (``MpsSupervisor`` with the
fake ``nvidia-cuda-mps-control``, served by ``MpsApiServer`` and reached
through ``RemoteMps``). Every wait is on a condition."""

from __future__ import annotations

import os
import threading

import psutil
import pytest

from tests.helpers import wait_for
from fracplugin import allocation as al
from fracplugin._proto import nri_pb2
from fracplugin.ledger import Ledger
from fracplugin.model import ComputeMode, PodRef
from fracplugin.mps.layout import namespace_name
from fracplugin.mps.rpc import MpsApiServer, RemoteMps
from fracplugin.nri.orphans import mps_namespaces
from fracplugin.planner import PlannerConfig
from tests.helpers import plan_container

from nri_runtime import RpcError, effective_env, make_container, make_pod
from test_nri_plugin import NODE, FakeMps, make_harness  # noqa: F401 (make_harness: the fixture, shared)

P = "nvidia.com/container."
SM, TS = ComputeMode.SM_SHARING, ComputeMode.TIME_SLICING


class RoleMps(FakeMps):
    """The MPS role as the doors see it: ``FakeMps``'s recorded calls, plus
    the namespaces it holds (made by ``ensure_namespace``, gone with
    ``release_namespace``), reported by ``status()`` as ``MpsSupervisor``
    does (``daemons[].namespaces[]``). It outlives the doors' restart.
    ``reachable = False`` reports an MPS role the doors cannot reach."""

    protocol = 3

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, dict] = {}
        self.reachable = True

    def ensure_namespace(self, pod_uid, container, atp, timeout_s, mode=SM, pinned_limit_mib=None):
        path = super().ensure_namespace(pod_uid, container, atp, timeout_s, mode=mode,
                                        pinned_limit_mib=pinned_limit_mib)
        with self.lock:
            self.held[namespace_name(pod_uid, container)] = {
                "name": namespace_name(pod_uid, container), "pod_uid": pod_uid, "container": container,
                "mode": ComputeMode(mode), "active_thread_percentage": atp, "pinned_limit_mib": pinned_limit_mib}
        return path

    def release_namespace(self, pod_uid, container, timeout_s=None):
        super().release_namespace(pod_uid, container, timeout_s)
        with self.lock:
            self.held.pop(namespace_name(pod_uid, container), None)
        return True

    def status(self):
        if not self.reachable:
            return {"enabled": True, "reachable": False, "ready": False, "error": "connection refused",
                    "daemons": [{"mode": m.value, "healthy": False, "namespaces": self._rows(m)} for m in (TS, SM)]}
        return {"enabled": True, "protocol": 3, "ready": True,
                "daemons": [{"mode": m.value, "healthy": True, "namespaces": self._rows(m)} for m in (TS, SM)]}

    def _rows(self, mode):
        with self.lock:
            return [{k: v for k, v in r.items() if k != "mode"} for r in self.held.values() if r["mode"] is mode]

    def holds(self, uid, container="app"):
        with self.lock:
            return namespace_name(uid, container) in self.held


def _sm_pod(name: str):
    return make_pod(name, uid=f"uid-{name}", annotations={
        P + "app.gpu-memory.request": "1Gi", P + "app.gpu-memory.limit": "2Gi",
        P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": "0.25"})


def _idle(h) -> bool:
    jobs = h.plugin.status()["mps_jobs"]
    return jobs["queued"] == 0 and jobs["running"] == 0


def _released(h, uid):
    return [c for c in h.mps.named("release_namespace") if c[1] == uid]


def _ensured(h, uid):
    return [c for c in h.mps.named("ensure_namespace") if c[1] == uid]


def _run(h, pod):
    """CreateContainer + StartContainer of ``pod``'s "app"; the container as
    Synchronize reports it running afterwards."""
    ctr = make_container(pod, "app", container_id=f"ctr-{pod.name}")
    adj = h.rt.create_container(pod, ctr)
    assert not isinstance(adj, RpcError), adj
    assert h.rt.start_container(pod, ctr) is None
    return ctr, make_container(pod, "app", container_id=ctr.id, env=effective_env(ctr, adj),
                               state=nri_pb2.CONTAINER_RUNNING)


def test_a_doors_restart_releases_the_namespaces_of_pods_deleted_meanwhile(make_harness):
    """Before the restart: an early namespace of a pod whose containers never
    came ("gone"), a container created and removed with its pod while the
    doors were down ("cgone"), a running container ("run") and a pod still
    waiting for its image ("waits"). The restarted doors' Synchronize reports
    "run" and "waits": the first two are released, the others kept."""
    h = make_harness(mps=RoleMps()).start()
    gone, cgone, run, waits = (_sm_pod(n) for n in ("gone", "cgone", "run", "waits"))
    for p in (gone, waits):
        assert h.rt.run_pod_sandbox(p) is None
    _run(h, cgone)
    _, running = _run(h, run)
    wait_for(lambda: all(h.mps.holds(p.uid) for p in (gone, cgone, run, waits)) and _idle(h),
             what="four namespaces made")
    h.rt.set_sync_state([run, waits], [running])  # "gone" and "cgone" were deleted while the doors were down
    h.restart_doors()
    wait_for(lambda: not h.mps.holds(gone.uid) and not h.mps.holds(cgone.uid), what="the two orphans released")
    wait_for(lambda: _idle(h), what="the MPS queue to drain")
    assert h.mps.holds(run.uid) and h.mps.holds(waits.uid)
    assert _released(h, run.uid) == [] and _released(h, waits.uid) == []
    early = h.plugin.status()["early_namespaces"]
    assert (early["orphaned"], early["adopted"], early["pending"]) == (2, 1, 1)  # "waits" adopted
    # the waiting pod is deleted before its containers: its RemovePodSandbox releases the adopted namespace
    assert h.rt.remove_pod_sandbox(waits) is None
    wait_for(lambda: not h.mps.holds(waits.uid), what="the adopted namespace released with its pod")
    assert h.mps.holds(run.uid) and h.plugin.status()["early_namespaces"]["released"] == 1


def test_an_adopted_namespace_is_taken_over_by_its_container(make_harness):
    """A live pod's adopted namespace is its container's once created: an
    ensure of its own (the MPS layer answers it without a control command
    when the caps match), and it goes with RemoveContainer, not the pod."""
    h = make_harness(mps=RoleMps()).start()
    pod = _sm_pod("later")
    assert h.rt.run_pod_sandbox(pod) is None
    wait_for(lambda: h.mps.holds(pod.uid) and _idle(h), what="the early namespace")
    h.rt.set_sync_state([pod], [])
    h.restart_doors()
    assert h.plugin.status()["early_namespaces"]["adopted"] == 1
    _run(h, pod)
    assert len(_ensured(h, pod.uid)) == 2  # the early one before the restart, the container's own after
    assert h.plugin.status()["early_namespaces"]["pending"] == 0
    assert h.rt.remove_pod_sandbox(pod) is None  # kubelet never does this first; nothing of the pod is released
    assert _released(h, pod.uid) == []
    assert h.rt.remove_container(pod, make_container(pod, "app", container_id="ctr-later")) is None
    wait_for(lambda: not h.mps.holds(pod.uid), what="the namespace released at RemoveContainer")


def test_namespaces_a_kubelet_reservation_still_names_are_kept(make_harness):
    """The device plugin door's allocations own namespaces too: Allocate
    records a reservation without a holder (empty pod and container) but with
    the namespace of the container it was planned for, and a reservation
    whose container stopped keeps its owner with no container id. Their pods
    are not in the runtime (not created yet; ending while kubelet still holds
    the devices): neither namespace is released. An orphan in the same
    Synchronize is, so the wait below ends on its release."""
    role = RoleMps()
    h = make_harness(mps=role).start()
    unbound, stopped, orphan = _sm_pod("allocated"), _sm_pod("stopped"), _sm_pod("orphan")
    ledger = Ledger(NODE)
    config = PlannerConfig()
    for i, (p, bound) in enumerate(((unbound, False), (stopped, True))):
        plan = plan_container(dict(p.annotations), "app", PodRef(p.namespace, p.name, p.uid), NODE, ledger, config)
        key = al.reservation_key({plan.device_uuids[0]: [i]})
        ledger.admit(plan, door=al.DOOR_ALLOCATE, reservation=key, bound=bound)
    (t,) = [t for t in ledger.tenancies() if not t.pod_uid]
    assert t.mps_namespace == namespace_name(unbound.uid, "app")  # the namespace the unbound reservation names
    for p in (unbound, stopped, orphan):  # made by the doors before their restart
        role.ensure_namespace(p.uid, "app", 25, 1.0, mode=SM, pinned_limit_mib=2048)
    h.rt.set_sync_state([], [])
    h.restart_doors(ledger=ledger)
    wait_for(lambda: not role.holds(orphan.uid) and _idle(h), what="the orphan released")
    assert role.holds(unbound.uid) and role.holds(stopped.uid)
    assert _released(h, unbound.uid) == [] and _released(h, stopped.uid) == []
    assert h.plugin.status()["early_namespaces"]["orphaned"] == 1


def test_a_namespace_held_again_before_its_release_runs_is_kept(make_harness):
    """The release of an orphan runs in the background and checks again:
    a ledger entry naming the namespace made meanwhile keeps it."""
    role = RoleMps()
    h = make_harness(mps=role).start()
    pod = _sm_pod("late")
    role.ensure_namespace(pod.uid, "app", 25, 1.0, mode=SM, pinned_limit_mib=2048)
    gate = threading.Event()
    role.block = gate
    busy = [_sm_pod(f"busy{i}") for i in range(4)]
    try:
        for b in busy:  # four ensures hold the four MPS workers: the orphan's release stays queued
            assert h.rt.run_pod_sandbox(b) is None
        wait_for(lambda: len(h.mps.named("ensure_namespace")) == 5, what="four ensures running")
        # what the next Synchronize carries and the count before it: both before the disconnect, which
        # waits for the connection to end while the plugin may already register again (seen under load)
        h.rt.set_sync_state(busy, [])
        n = len(h.rt.registrations)
        h.rt.disconnect()  # the runtime reconnects and Synchronizes without the pod
        wait_for(lambda: len(h.rt.registrations) > n and h.plugin.status()["early_namespaces"]["orphaned"] == 1,
                 what="the second Synchronize found the orphan")
        plan = plan_container(dict(pod.annotations), "app", PodRef(pod.namespace, pod.name, pod.uid), NODE,
                              h.ledger, h.config)
        h.ledger.admit(plan, door=al.DOOR_ALLOCATE, reservation=al.reservation_key({plan.device_uuids[0]: [9]}),
                       bound=False)
    finally:
        gate.set()
    wait_for(lambda: _idle(h), what="the MPS queue to drain")
    assert role.holds(pod.uid) and _released(h, pod.uid) == []


def test_an_mps_role_it_cannot_reach_is_not_reconciled_until_it_can(make_harness):
    role = RoleMps()
    h = make_harness(mps=role).start()
    pod = _sm_pod("away")
    role.ensure_namespace(pod.uid, "app", 25, 1.0, mode=SM, pinned_limit_mib=2048)
    role.reachable = False  # its daemons list is the last poll's: not trusted
    h.rt.set_sync_state([], [])
    h.restart_doors()
    assert h.plugin.status()["early_namespaces"]["orphaned"] == 0 and role.holds(pod.uid)
    role.reachable = True
    h.restart_doors()  # the next Synchronize
    wait_for(lambda: not role.holds(pod.uid), what="the orphan released once the MPS role answers")


def test_status_documents_it_cannot_vouch_for_are_not_read():
    assert mps_namespaces({"enabled": False, "daemons": []}) is None  # NullMps
    assert mps_namespaces({"reachable": False, "daemons": [{"mode": "sm-sharing", "namespaces": [
        {"name": "fp_x", "pod_uid": "u", "container": "c"}]}]}) is None
    assert mps_namespaces(None) is None
    rows = [{"name": "fp_a", "pod_uid": "u", "container": "c", "active_thread_percentage": 25,
             "pinned_limit_mib": 2048}, {"name": "fp_b", "pod_uid": "", "container": "c"}, "junk"]
    assert mps_namespaces({"daemons": [{"mode": "sm-sharing", "namespaces": rows}, {"mode": "nope"}, 3]}) == [
        ("fp_a", ("u", "c"), (SM, 25, 2048))]


# ------------------------------------------------------------------ the real MPS role

@pytest.fixture
def mps_role(sockdir):
    """The MPS role in-process: ``MpsSupervisor`` with the compiled fake MPS
    control client (both daemons) behind ``MpsApiServer`` on a real socket.
    Yields (supervisor harness, socket path)."""
    from test_mps_supervisor import Harness as MpsHarness, leftovers
    from tests.helpers import wait_until

    root = os.path.join(sockdir, "role")
    os.makedirs(root)
    os.chmod(sockdir, 0o755)
    os.chmod(root, 0o755)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    mh = MpsHarness(root)
    server = None
    try:
        sup = mh.supervisor(probe_interval_s=0.5)
        wait_until(sup.ready, 30)
        server = MpsApiServer(sup, os.path.join(root, "api", "api.sock"))
        server.start()
        yield mh, server.path
    finally:
        if server is not None:
            server.stop()
        mh.close()
        wait_until(lambda: not leftovers(root, before), 5,
                   lambda: f"no process left behind: {leftovers(root, before)}")


def test_through_the_mps_role_api_the_orphan_leaves_the_daemon(make_harness, mps_role):
    """The split layout end to end: the doors reach the MPS role through
    ``RemoteMps``; after their restart the daemon itself no longer has the
    namespace of the pod deleted meanwhile, and still has the live pod's."""
    mh, api = mps_role
    remotes = []

    def remote():
        r = RemoteMps(api)
        r.start()
        remotes.append(r)
        return r

    try:
        h = make_harness(mps=remote(), planner_config=PlannerConfig(layout=mh.layout)).start()
        gone, waits = _sm_pod("rgone"), _sm_pod("rwaits")
        names = {p.uid: f"shared/{namespace_name(p.uid, 'app')}" for p in (gone, waits)}
        for p in (gone, waits):
            assert h.rt.run_pod_sandbox(p) is None
        wait_for(lambda: set(names.values()) <= set(mh.state(SM)["namespaces"]) and _idle(h), timeout_s=30,
                 what="both early namespaces on the sm-sharing daemon")
        h.rt.set_sync_state([waits], [])
        h.mps.stop()
        h.mps = remote()  # the restarted doors' own client of the MPS role
        h.restart_doors()
        wait_for(lambda: names[gone.uid] not in mh.state(SM)["namespaces"], timeout_s=30,
                 what="the orphan deleted from the daemon")
        assert names[waits.uid] in mh.state(SM)["namespaces"]
        assert h.plugin.status()["early_namespaces"]["adopted"] == 1
        assert h.rt.remove_pod_sandbox(waits) is None
        wait_for(lambda: names[waits.uid] not in mh.state(SM)["namespaces"], timeout_s=30,
                 what="the adopted namespace deleted with its pod")
    finally:
        for r in remotes:
            r.stop()
