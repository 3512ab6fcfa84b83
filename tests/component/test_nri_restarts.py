"""A container's hold ends with that container (issue 34, small failing
input 3), through the real NRI socket with the fake runtime: when a
Synchronize lists an old container of a (pod, container name) beside its
running restart, the running one keeps the hold whatever the list's order,
and the old one's RemoveContainer releases nothing of it. And a running
container whose key is an alias of a shared hold (an init container's
devices reused) is recorded under that hold at Synchronize (ADR 0033, "At
Synchronize"), through the daemon with both doors. Every wait is on a
condition."""

from __future__ import annotations

import pytest

from fracplugin._proto import nri_pb2

from nri_runtime import Code, RpcError, effective_env, make_container, make_pod
from test_daemon import root  # noqa: F401 (fixture)
from test_nri_plugin import NODE, make_harness  # noqa: F401 (make_harness: the fixture, shared)
from test_one_allocation import ctr, ids, key_of, node, pod  # noqa: F401 (node: fixture)
from tests.helpers import wait_until

P = "nvidia.com/container."
GPU0 = NODE.gpus[0].uuid


def _kai_pod(name: str, memory: str):
    return make_pod(name, uid=f"uid-{name}", annotations={P + "app.gpu-memory.request": memory,
                                                          P + "app.gpus.devices": "0"})


def _listed(pod, created, adj, state):
    """``created`` as the runtime lists it at Synchronize: its env with our
    adjustment, in ``state``."""
    env = [f"{k}={v}" for k, v in effective_env(created, adj).items()]
    return make_container(pod, created.name, container_id=created.id, env=env, state=state)


def _holds(h):
    return sorted((t.container_id, t.gpu_uuid, t.request_mib) for t in h.ledger.tenancies())


@pytest.mark.parametrize("order", ["old first", "new first"])
@pytest.mark.parametrize("who_restarts", ["runtime", "doors"])
def test_a_running_restart_keeps_its_hold_through_synchronize_and_the_old_ones_remove(
        make_harness, order, who_restarts):  # noqa: F811
    h = make_harness().start()
    pod = _kai_pod("web", "50Gi")
    old = make_container(pod, "app", container_id="ctr-old")
    new = make_container(pod, "app", container_id="ctr-new")
    adj_old = h.rt.create_container(pod, old)  # created, never started (kubelet restarts it)
    assert not isinstance(adj_old, RpcError), adj_old
    adj_new = h.rt.create_container(pod, new)
    assert not isinstance(adj_new, RpcError), adj_new
    assert h.rt.start_container(pod, new) is None
    assert _holds(h) == [("ctr-new", GPU0, 51200)]

    listed = [_listed(pod, old, adj_old, nri_pb2.CONTAINER_CREATED),
              _listed(pod, new, adj_new, nri_pb2.CONTAINER_RUNNING)]
    if order == "new first":
        listed.reverse()
    if who_restarts == "runtime":  # containerd restarts: the plugin reconnects and is synchronized again
        rt = h.restart_runtime(initial_sync=([pod], listed))
        rt.wait_registered()
    else:  # the daemon restarts with an empty ledger: Synchronize alone rebuilds it
        h.rt.set_sync_state([pod], listed)
        h.restart_doors()
    assert _holds(h) == [("ctr-new", GPU0, 51200)]

    assert h.rt.remove_container(pod, old) is None
    assert _holds(h) == [("ctr-new", GPU0, 51200)]  # the old container's Remove releases nothing of the new one

    other = _kai_pod("other", "40Gi")
    got = h.rt.create_container(other, make_container(other, "app", container_id="ctr-other"))
    assert isinstance(got, RpcError) and got.code == Code.FAILED_PRECONDITION, got
    assert "GPU 0" in got.message and "40960 MiB" in got.message, got.message
    assert _holds(h) == [("ctr-new", GPU0, 51200)]

    # the running container's own Remove ends its hold
    assert h.rt.remove_container(pod, new) is None
    assert _holds(h) == []


# ---- a running container under an alias of a shared hold (ADR 0033, "At Synchronize") ----------


@pytest.mark.parametrize("who_restarts", ["runtime", "doors"])
def test_a_running_container_whose_key_is_an_alias_is_recorded_under_the_shared_hold(node, who_restarts):  # noqa: F811
    """Device plugin shape, init 3 units / app 2 units: kubelet gives the app
    the init's devices (``::0-1`` of ``::0-2``), so the app's key is an alias
    of the pod's one hold (the union, ``::0-2``). The runtime (or the whole
    daemon) restarts while the app runs and the init has exited: the
    Synchronize records the app under that hold, once (2048 MiB, its own
    size; the hold stays charged the union's 3072 MiB, as kubelet counts the
    pod's devices), not under its key beside the hold (4096 MiB, or the
    exited init's 3072 as its request), both through the real sockets (fake kubelet, NRI runtime, the
    daemon's ledger and proofs files)."""
    n = node()
    p = pod("reuse", containers=[ctr("app", 2)], init=[ctr("init", 3)])
    n.put(p)
    env_init, _ = n.allocate(ids(0, 3))
    env_app, _ = n.allocate(ids(0, 2))  # kubelet's device manager reuses the init's devices
    union = key_of(ids(0, 3))
    assert env_app["FRACPLUGIN_RESERVATION"] == key_of(ids(0, 2)) != union
    n.record("reuse", "init", ids(0, 3))  # what kubelet's PodResources lists for the pod
    n.record("reuse", "app", ids(0, 2))
    adj, got_init = n.create(p, "init", env_init)
    assert not isinstance(adj, RpcError), adj
    n.stop(p, "init")
    adj, got_app = n.create(p, "app", env_app)
    assert not isinstance(adj, RpcError), adj
    sandbox = make_pod("reuse", "default", "uid-reuse")
    assert n.rt.start_container(sandbox, make_container(sandbox, "app")) is None

    def holds():
        return sorted((t["reservation"], t["container_id"], t["request_mib"]) for t in n.tenants())
    assert holds() == [(union, "ctr-uid-reuse-app", 2048)]

    listed = [make_container(sandbox, "init", env=got_init, state=nri_pb2.CONTAINER_STOPPED),
              make_container(sandbox, "app", env=got_app, state=nri_pb2.CONTAINER_RUNNING)]
    n.rt.set_sync_state([sandbox], listed)
    if who_restarts == "runtime":  # containerd restarts: the plugin reconnects and is synchronized again
        n.rt.disconnect()
        n.rt.wait_registered(15)
    else:  # the daemon restarts: its ledger and proofs (aliases) files, then Synchronize
        n.restart_daemon()
    assert wait_until(lambda: holds() == [(union, "ctr-uid-reuse-app", 2048)], 10, holds)
    assert n.held(0) == 3072  # counted once: the pod's devices, the union, as before the restart

    # the app's own Stop ends its container's hold; the reservation stays with its pod
    n.stop(p, "app")
    assert holds() == [(union, "", 2048)]
