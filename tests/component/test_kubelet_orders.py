"""Issue 34 items 1-2: holds follow what kubelet really does with device
IDs, and a reservation belongs to one pod (ADR 0033). Small failing inputs
1, 2 and 4 of the issue, through the daemon's real sockets
(``test_one_allocation.Node``: the fake kubelet's Allocate, PodResources,
the NRI runtime, a pods file as the API server).

Node: examples/nodes/gpu-node-1.yaml, four GPUs of 81559 MiB; one device =
1024 MiB.
"""

from __future__ import annotations

from typing import Any, Callable

import json

import pytest
from test_daemon import root  # noqa: F401 (fixture)
from test_one_allocation import UUIDS, Node, ctr, ids, key_of, node, pod  # noqa: F401 (node: fixture)
from fracplugin.status import render_gpus
from tests.helpers import wait_until

INVALID_ARGUMENT = 3
UNAVAILABLE = 14
PROOF = "FRACPLUGIN_RESERVATION_PROOF"


def code(out: Any) -> int | None:
    """The error code of a CreateContainer answer (None: an adjustment)."""
    return getattr(out, "code", None) if not hasattr(out, "env") else None


def pod_held(n: Node, gpu: int, uids: set[str]) -> int:
    """MiB held on ``gpu`` by the pods ``uids`` and by reservations no
    container claimed yet (those may be theirs): each entry's charge, its
    ``held_mib`` where the hold keeps more than the container's request."""
    return sum(max(t["request_mib"], t.get("held_mib", 0)) for t in n.status()["gpus"][gpu]["tenants"] if t["pod_uid"] in uids | {""})


# ---- input 1: an init container's devices given again to the app container ---------------------


@pytest.mark.parametrize(("init_units", "app_units"), [(2, 3), (3, 2)], ids=["init2-app3", "init3-app2"])
def test_1_init_and_app_of_different_sizes_share_their_devices(node: Callable[..., Node], init_units: int,
                                                                app_units: int) -> None:
    n = node()
    p = pod("sizes", containers=[ctr("app", app_units)], init=[ctr("init", init_units)])
    n.put(p)
    most = max(init_units, app_units) * 1024
    seen: list[int] = []
    env_init, _ = n.allocate(ids(0, init_units))
    seen.append(pod_held(n, 0, {"uid-sizes"}))
    env_app, _ = n.allocate(ids(0, app_units))  # kubelet's device manager reuses the init's devices
    seen.append(pod_held(n, 0, {"uid-sizes"}))
    assert env_init["FRACPLUGIN_RESERVATION"] == f"{UUIDS[0]}::0-{init_units - 1}"
    assert env_app["FRACPLUGIN_RESERVATION"] == f"{UUIDS[0]}::0-{app_units - 1}"
    assert n.held(0) == most  # memory counted once, the union of the pod's devices
    adj, got = n.create(p, "init", env_init)
    assert code(adj) is None, adj  # was: "names no reservation ... (or one already released)"
    assert got["NVIDIA_GPU_MEMORY_REQUEST"] == str(init_units * 1024)
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    seen.append(pod_held(n, 0, {"uid-sizes"}))
    n.stop(p, "init")
    seen.append(pod_held(n, 0, {"uid-sizes"}))
    adj, got = n.create(p, "app", env_app)
    assert code(adj) is None, adj
    assert got["NVIDIA_GPU_MEMORY_REQUEST"] == str(app_units * 1024)
    seen.append(pod_held(n, 0, {"uid-sizes"}))
    # kubelet counts the pod's devices (the union) as its own until the pod ends: so does the hold
    assert max(seen) <= most and seen[-1] == most, seen
    (t,) = n.status()["gpus"][0]["tenants"]
    assert (t["pod_name"], t["container"], t["container_id"]) == ("sizes", "app", "ctr-uid-sizes-app")
    # kubelet re-Allocates the running app's IDs (a kubelet restart): answered as recorded, nothing released
    env_again, ann = n.allocate(ids(0, app_units))
    assert ann["fracplugin.io/allocate"] == "reserved" and env_again[PROOF] == env_app[PROOF]
    assert n.held(0) == most
    # the app container restarts: still its own
    n.stop(p, "app")
    adj, _ = n.create(p, "app", env_app)
    assert code(adj) is None, adj
    assert n.held(0) <= most


# ---- input 2: a recreated pod's Allocate of devices a running container holds --------------------


def pending(n: Node) -> list[str]:
    """The pending reservation keys, as the proofs file beside the ledger keeps them."""
    return list(json.loads((n.d.state / "reservation-proofs.json").read_text()).get("pending") or {})


def _web_running_then_recreated(n: Node) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, str]]:
    """Pod ``web`` (uid-old, 60 units) Allocated ``GPU0::0-59``, created and
    started; force-deleted (the runtime still runs its container) and
    recreated with the same name (uid-new, Pending). Returns (old pod, new
    pod, the old container's env, its Allocate env)."""
    from nri_runtime import make_container, make_pod

    old = pod("web", 60)
    old["metadata"]["uid"] = "uid-old"
    n.put(old)
    env_old, _ = n.allocate(ids(0, 60))
    adj, got = n.create(old, "app", env_old)
    assert code(adj) is None, adj
    sandbox = make_pod("web", "default", "uid-old")
    assert n.rt.start_container(sandbox, make_container(sandbox, "app")) is None
    assert n.held(0) == 61440
    n.delete("web")  # force delete: the API object goes, the runtime still runs ctr-uid-old-app
    new = pod("web", 60)  # recreated with the same name and a new UID
    new["metadata"]["uid"] = "uid-new"
    n.put(new)
    return old, new, got, env_old


def _held_by(n: Node) -> list[tuple[str, str, int]]:
    return [(t["pod_uid"], t["container_id"], t["request_mib"]) for t in n.tenants()]


def test_2_an_allocate_of_a_running_containers_devices_waits_for_it(node: Callable[..., Node]) -> None:
    n = node()
    old, new, _got, env_old = _web_running_then_recreated(n)
    seen = [n.held(0)]
    env_new, ann = n.allocate(ids(0, 60))  # answered: a refused Allocate is terminal for the pod
    n.record("web", "app", ids(0, 60))  # kubelet records the new pod's allocation (PodResources)
    assert ann["fracplugin.io/allocate"] == "pending"
    assert env_new["FRACPLUGIN_RESERVATION"] == env_old["FRACPLUGIN_RESERVATION"]
    assert env_new[PROOF] != env_old[PROOF]  # a new proof: the devices go to another holder
    assert env_new["NVIDIA_GPU_MEMORY_REQUEST"] == "61440"
    assert pending(n) == [key_of(ids(0, 60))]  # kept beside the ledger
    # was: ledger ('', '', '01', 61440, ..., 'allocate', '..::0-59'), ctr-old no longer held
    assert _held_by(n) == [("uid-old", "ctr-uid-old-app", 61440)]
    seen.append(n.held(0))
    err, _ = n.create(new, "app", env_new)
    assert code(err) == UNAVAILABLE, err  # transient: kubelet retries CreateContainer
    assert "running container default/web/app" in err.message and "uid-old" in err.message, err.message
    assert "ctr-uid-old-app" in err.message, err.message
    err, _ = n.create(new, "app", env_new)  # kubelet's retry, the old container still runs
    assert code(err) == UNAVAILABLE, err
    seen.append(n.held(0))
    # a copy of the old answer's key and proof does not get in either
    thief = dict(new, spec={**new["spec"], "containers": [ctr("app", 60, env={
        "FRACPLUGIN_RESERVATION": env_old["FRACPLUGIN_RESERVATION"], PROOF: env_old[PROOF]})]})
    err, _ = n.create(thief, "app")
    assert code(err) == INVALID_ARGUMENT and "running container default/web/app" in err.message, err
    assert _held_by(n) == [("uid-old", "ctr-uid-old-app", 61440)]
    n.stop(old, "app")  # the runtime stops ctr-old: its own StopContainer ends its hold
    seen.append(n.held(0))
    adj, got = n.create(new, "app", env_new)
    assert code(adj) is None, adj
    assert got["NVIDIA_GPU_MEMORY_REQUEST"] == "61440" and got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    assert got[PROOF] == ""  # checked, then out of the env
    assert _held_by(n) == [("uid-new", "ctr-uid-new-app", 61440)]
    seen.append(n.held(0))
    assert max(seen) == 61440, seen  # never 2 x 60 GiB on GPU 0
    assert pending(n) == []
    assert n.status()["device_plugin"]["pending"] == 1


def test_2_an_allocate_overlapping_a_running_hold_waits_and_podresources_records_nothing_before(
        node: Callable[..., Node]) -> None:
    """Other IDs sharing devices with the running hold (``::10-69`` against
    ``::0-59``): the same wait; PodResources listing the new pod meanwhile
    records nothing over the running container; once it stopped, the new
    container takes the devices over (the stopped pod's reservation goes)."""
    n = node()
    job = pod("job3", 60)
    n.put(job)
    env, _ = n.allocate(ids(0, 60))
    assert code(n.create(job, "app", env)[0]) is None
    nxt = pod("next3", 60)
    n.put(nxt)
    env2, ann = n.allocate(ids(0, 60, start=10))
    assert ann["fracplugin.io/allocate"] == "pending"
    n.record("next3", "app", ids(0, 60, start=10))  # kubelet records the allocation (PodResources)
    err, _ = n.create(nxt, "app", env2)
    assert code(err) == UNAVAILABLE and "running container default/job3/app" in err.message, err
    seen = n.pr.lists
    assert wait_until(lambda: n.pr.lists >= seen + 2, 10)  # a whole PodResources pass after the record
    assert [t["pod_name"] for t in n.tenants()] == ["job3"] and n.held(0) == 61440
    n.stop(job, "app")
    assert n.held(0) <= 61440
    adj, got = n.create(nxt, "app", env2)
    assert code(adj) is None, adj
    assert [(t["pod_name"], t["reservation"]) for t in n.tenants()] == [("next3", key_of(ids(0, 60, start=10)))]
    assert n.held(0) == 61440


def test_2_a_pending_reservation_survives_a_daemon_restart(node: Callable[..., Node]) -> None:
    """The daemon restarts while the reservation is pending: the proofs file
    keeps it (and its proof); the new container still waits while the
    runtime reports the old one running, and is admitted once a Synchronize
    no longer lists it."""
    from fracplugin._proto import nri_pb2
    from nri_runtime import make_container, make_pod

    n = node()
    _old, new, got_old, _env_old = _web_running_then_recreated(n)
    env_new, ann = n.allocate(ids(0, 60))
    assert ann["fracplugin.io/allocate"] == "pending"
    n.record("web", "app", ids(0, 60))  # kubelet lists the new pod: the restarted daemon keeps the pending key
    sandbox_old = make_pod("web", "default", "uid-old")
    running = make_container(sandbox_old, "app", env=got_old, state=nri_pb2.CONTAINER_RUNNING)
    n.rt.set_sync_state([sandbox_old], [running])  # what the runtime reports to the restarted daemon
    n.restart_daemon()
    assert pending(n) == [key_of(ids(0, 60))]
    assert _held_by(n) == [("uid-old", "ctr-uid-old-app", 61440)]
    err, _ = n.create(new, "app", env_new)
    assert code(err) == UNAVAILABLE and "running container default/web/app" in err.message, err
    assert n.held(0) == 61440
    # the runtime reconnects and its Synchronize no longer lists ctr-old (it stopped while nobody listened)
    sandbox_new = make_pod("web", "default", "uid-new")
    n.rt.set_sync_state([sandbox_new], [])
    n.rt.disconnect()
    n.rt.wait_registered(15)
    assert wait_until(lambda: not any(t["container_id"] for t in n.tenants()), 10, lambda: n.tenants())
    adj, got = n.create(new, "app", env_new)
    assert code(adj) is None, adj
    assert got["NVIDIA_GPU_MEMORY_REQUEST"] == "61440"
    assert _held_by(n) == [("uid-new", "ctr-uid-new-app", 61440)]
    assert n.held(0) == 61440 and pending(n) == []


def test_2_a_pending_key_whose_pod_is_gone_is_dropped(node: Callable[..., Node]) -> None:
    """The recreated pod is deleted before its container was ever created:
    its pending key goes (its pod is gone from the API, and PodResources
    does not list it at the restarted daemon's first pass), and the old
    container keeps its hold throughout."""
    from fracplugin._proto import nri_pb2
    from nri_runtime import make_container, make_pod

    n = node()
    _old, _new, got_old, _env_old = _web_running_then_recreated(n)
    _env_new, ann = n.allocate(ids(0, 60))
    assert ann["fracplugin.io/allocate"] == "pending" and pending(n) == [key_of(ids(0, 60))]
    n.delete("web")
    assert wait_until(lambda: pending(n) == [], 10, lambda: pending(n))  # every pod it may be for is gone
    n.put(pod("other", 60))
    _env_new, ann = n.allocate(ids(0, 60))  # another pod: pending again
    assert ann["fracplugin.io/allocate"] == "pending" and pending(n) == [key_of(ids(0, 60))]
    sandbox_old = make_pod("web", "default", "uid-old")
    n.rt.set_sync_state([sandbox_old], [make_container(sandbox_old, "app", env=got_old,
                                                       state=nri_pb2.CONTAINER_RUNNING)])

    def delete_other() -> None:  # while the daemon is down: no deletion seen
        del n.pods["other"]
        n._write()
    n.restart_daemon(delete_other)  # nothing lists the key at the first PodResources pass: dropped
    assert wait_until(lambda: pending(n) == [], 10, lambda: pending(n))
    assert _held_by(n) == [("uid-old", "ctr-uid-old-app", 61440)]


# ---- input 4: a reservation belongs to one pod --------------------------------------------------


def test_4_a_stolen_key_and_proof_are_refused_once_a_pod_owns_the_reservation(node: Callable[..., Node]) -> None:
    n = node()
    owner = pod("owner3", 4)
    n.put(owner)
    env, _ = n.allocate(ids(3, 4))
    key, proof = env["FRACPLUGIN_RESERVATION"], env[PROOF]
    n.record("owner3", "app", ids(3, 4))
    assert wait_until(lambda: [t["pod_name"] for t in n.tenants()] == ["owner3"], 10,
                      lambda: f"PodResources binds owner3: {n.tenants()}")
    adj, got = n.create(owner, "app", env)
    assert code(adj) is None, adj
    assert got[PROOF] == "", "the proof is out of the running container's env once checked"
    assert any(kv.key == "-" + PROOF for kv in adj.env), "the removal marker comes first"
    n.stop(owner, "app")
    thief = pod("thief", containers=[ctr("app", env={"FRACPLUGIN_RESERVATION": key, PROOF: proof})])
    n.put(thief)
    err, _ = n.create(thief, "app")
    assert code(err) == INVALID_ARGUMENT, err  # was: admitted with GPU 3
    assert "belongs to pod default/owner3" in err.message and key in err.message, err.message
    assert [(t["pod_name"], t["request_mib"]) for t in n.tenants()] == [("owner3", 4096)]
    adj, got = n.create(owner, "app", env)  # owner3's restart
    assert code(adj) is None, adj
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[3] and got[PROOF] == ""
    assert [(t["pod_name"], t["container_id"]) for t in n.tenants()] == [("owner3", "ctr-uid-owner3-app")]


@pytest.mark.parametrize(("init_units", "app_units"), [(2, 3), (3, 2)], ids=["init2-app3", "init3-app2"])
def test_1_2_a_pending_init_and_app_stay_one_hold_when_podresources_lists_both(
        node: Callable[..., Node], init_units: int, app_units: int) -> None:
    """Inputs 1 and 2 together, as the real kubelet v1.35 ran them in CI: the
    previous pod's container still runs on the devices, so both of the new
    pod's Allocates (init, then app on the init's devices plus or minus one)
    are pending; kubelet lists both in PodResources. While the init container
    runs, a PodResources pass must not record the app's key beside the
    init's hold (it did: 3072 + 2048 on GPU 0); the pod's keys are one hold,
    never more than the larger."""
    n = node()
    job = pod("job4", 3)
    n.put(job)
    env_job, _ = n.allocate(ids(0, 3))
    assert code(n.create(job, "app", env_job)[0]) is None
    n.delete("job4")  # deleted from the API; the runtime still runs its container
    p = pod("sizes", containers=[ctr("app", app_units)], init=[ctr("init", init_units)])
    n.put(p)
    most = max(init_units, app_units) * 1024
    env_init, ann_init = n.allocate(ids(0, init_units))
    env_app, ann_app = n.allocate(ids(0, app_units))
    assert (ann_init["fracplugin.io/allocate"], ann_app["fracplugin.io/allocate"]) == ("pending", "pending")
    n.record("sizes", "init", ids(0, init_units))
    n.record("sizes", "app", ids(0, app_units))
    n.stop(job, "app")
    seen: list[int] = []

    def passes(k: int) -> None:  # k whole PodResources passes, sampling what the pod holds
        start = n.pr.lists
        assert wait_until(lambda: n.pr.lists >= start + k, 10)
        seen.append(pod_held(n, 0, {"uid-sizes"}))

    passes(2)
    for name, env, units in (("init", env_init, init_units), ("app", env_app, app_units)):
        adj, got = n.create(p, name, env)
        assert code(adj) is None, adj
        assert got["NVIDIA_GPU_MEMORY_REQUEST"] == str(units * 1024)
        passes(2)
        assert max(seen) <= most, (name, seen)
        if name == "init":
            n.stop(p, "init")
            passes(2)
    assert [(t["pod_name"], t["container"], t["request_mib"]) for t in n.tenants()] == [
        ("sizes", "app", app_units * 1024)]
    assert n.held(0) == most  # the pod's devices, the union, until the pod ends (as kubelet counts them)


def test_1_the_pods_union_hold_stays_charged_while_its_init_container_runs(node: Callable[..., Node]) -> None:
    """Input 1 with another door on the GPU (review of issue 34): kubelet gave the pod ``GPU0::0-2`` (init 2
    units, app 3) and counts those 3 devices as the pod's until it ends, so the pod's one hold must stay
    charged 3072 MiB (``allocation.charge_mib`` of the union) while the init container runs. If the init's
    CreateContainer re-records the hold at its own 2048 MiB, the 1024 MiB kubelet still counts as the pod's
    look free; a KAI-shape pod (NRI door) takes them, and the app container kubelet already admitted is then
    refused at CreateContainer for want of memory (the pod does not start while the other runs).

    GPU 0: 81559 MiB. Pod ``fill`` holds 75 devices (76800 MiB): with the pod's 3072 MiB, 1687 MiB are free,
    so the 2 GiB KAI pod must be refused (with the hold re-recorded at 2048 MiB, 2711 MiB look free: it is
    admitted, and the app's 3072 MiB then find 663 MiB free)."""
    n = node()
    p = pod("sizes", containers=[ctr("app", 3)], init=[ctr("init", 2)])
    fill = pod("fill", 75)
    n.put(p, fill)
    env_init, _ = n.allocate(ids(0, 2))
    env_app, _ = n.allocate(ids(0, 3))
    env_fill, _ = n.allocate(ids(0, 75, start=3))
    assert code(n.create(fill, "app", env_fill)[0]) is None
    assert n.held(0) == 3072 + 76800
    adj, got = n.create(p, "init", env_init)
    assert code(adj) is None, adj
    assert got["NVIDIA_GPU_MEMORY_REQUEST"] == "2048"  # the init container's own size...
    assert pod_held(n, 0, {"uid-sizes"}) == 3072, n.tenants()  # ...but the pod's hold is still its 3 devices
    assert "/sizes/init: request 2048 MiB, limit 2048 MiB, held 3072 MiB," in render_gpus(n.status())
    kai = pod("kai", containers=[ctr("app")], annotations={
        "nvidia.com/container.app.gpu-memory.request": "2Gi", "nvidia.com/container.app.gpus.devices": "0"})
    n.put(kai)
    err, _ = n.create(kai, "app")
    assert code(err) is not None, "the 2 GiB KAI pod took memory kubelet counts as pod sizes'"
    n.stop(p, "init")
    adj, got = n.create(p, "app", env_app)
    assert code(adj) is None, adj  # the app container kubelet admitted is admitted
    assert got["NVIDIA_GPU_MEMORY_REQUEST"] == "3072"
    assert n.held(0) == 3072 + 76800
