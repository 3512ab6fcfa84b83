"""Issue 34 items 1-2: holds follow what kubelet really does with device
IDs, and a reservation belongs to one pod (ADR 0033). Small failing inputs
1 and 4 of the issue (input 2 is open: ADR 0033), through the daemon's real sockets
(``test_one_allocation.Node``: the fake kubelet's Allocate, PodResources,
the NRI runtime, a pods file as the API server).

Node: examples/nodes/gpu-node-1.yaml, four GPUs of 81559 MiB; one device =
1024 MiB.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
from test_daemon import root  # noqa: F401 (fixture)
from test_one_allocation import UUIDS, Node, ctr, ids, node, pod  # noqa: F401 (node: fixture)
from tests.helpers import wait_until

INVALID_ARGUMENT = 3
PROOF = "FRACPLUGIN_RESERVATION_PROOF"


def code(out: Any) -> int | None:
    """The error code of a CreateContainer answer (None: an adjustment)."""
    return getattr(out, "code", None) if not hasattr(out, "env") else None


def pod_held(n: Node, gpu: int, uids: set[str]) -> int:
    """MiB held on ``gpu`` by the pods ``uids`` and by reservations no
    container claimed yet (those may be theirs)."""
    return sum(t["request_mib"] for t in n.status()["gpus"][gpu]["tenants"] if t["pod_uid"] in uids | {""})


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
    assert max(seen) <= most and seen[-1] == app_units * 1024, seen
    (t,) = n.status()["gpus"][0]["tenants"]
    assert (t["pod_name"], t["container"], t["container_id"]) == ("sizes", "app", "ctr-uid-sizes-app")
    # kubelet re-Allocates the running app's IDs (a kubelet restart): answered as recorded, nothing released
    env_again, ann = n.allocate(ids(0, app_units))
    assert ann["fracplugin.io/allocate"] == "reserved" and env_again[PROOF] == env_app[PROOF]
    assert n.held(0) == app_units * 1024
    # the app container restarts: still its own
    n.stop(p, "app")
    adj, _ = n.create(p, "app", env_app)
    assert code(adj) is None, adj
    assert n.held(0) <= most


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
