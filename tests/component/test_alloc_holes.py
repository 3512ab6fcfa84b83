"""Issue 25 items 1-7: every admitted container gets exactly its own
allocation, through the daemon's real sockets (``test_one_allocation.Node``:
the device plugin door as kubelet sees it, the NRI door as containerd sees
it, a pods file as the API server).

Node: examples/nodes/gpu-node-1.yaml, four GPUs of 81559 MiB; one device =
1024 MiB (79 devices per GPU); KAI's reserve 1024 MiB, so gpu-fraction 0.5 =
floor((81559 - 1024) x 0.5) = 40267 MiB.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from test_daemon import FAKE_MPS, DaemonProc, root  # noqa: F401 (root: fixture)
from test_one_allocation import P, UUIDS, Node, ctr, ids, node, pod  # noqa: F401 (node: fixture)
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
NODE_FILE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
KAI = "--no-device-plugin"
UNAVAILABLE, INVALID_ARGUMENT, FAILED_PRECONDITION = 14, 3, 9


def code(out: Any) -> int | None:
    """The error code of a CreateContainer answer (None: an adjustment)."""
    return getattr(out, "code", None) if not hasattr(out, "env") else None


def explain(n: Node, name: str) -> dict[str, Any]:
    """``fracplugin explain`` of pod ``name`` as the pods file holds it (JSON report)."""
    path = n.pods_path.with_name(f"explain-{name}.json")
    path.write_text(json.dumps(n.pods[name]))
    out = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(path), "--node", str(NODE_FILE),
                          "-o", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 1), out.stderr
    rep: dict[str, Any] = json.loads(out.stdout)
    rep["exit"] = out.returncode
    return rep


def warned(n: Node) -> list[str]:
    return [str(w.get("reason")) for w in n.warnings()]


# ---- 1. the KAI path: pod-level forms fence only their container ----------------------------


@pytest.mark.parametrize("extra", [(), (KAI,)], ids=["both-doors", "kai"])
def test_1_pod_level_forms_fence_the_first_container_only(node: Callable[..., Node], extra: tuple[str, ...]) -> None:
    n = node(*extra)
    assert n.status().get("pod_source"), "the pod watch runs in every configuration that reads pod-level forms"
    p = pod("kai2", containers=[ctr("app"), ctr("istio-proxy")],
            annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    n.put(p)
    adj, env = n.create(p, "app")
    assert code(adj) is None, adj
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40267" and len(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == 2
    adj, env = n.create(p, "istio-proxy")
    assert code(adj) is None and not adj.env, "the sidecar is untouched"
    assert [t["container"] for t in n.tenants()] == ["app", "app"]
    assert sorted(n.held(g) for g in range(4)) == [0, 0, 40267, 40267]
    rep = explain(n, "kai2")
    assert [(c["name"], len(c["devices"]), c["request_mib"]) for c in rep["containers"] if c["fractional"]] == \
        [("app", 2, 40267)]


def test_1_named_container_gets_the_pod_level_forms_in_the_kai_path(node: Callable[..., Node]) -> None:
    n = node(KAI)
    p = pod("named", containers=[ctr("istio-proxy"), ctr("app")],
            annotations={"gpu-fraction": "0.5", "gpu-fraction-container-name": "app"})
    n.put(p)
    adj, _ = n.create(p, "istio-proxy")
    assert code(adj) is None and not adj.env
    _adj, env = n.create(p, "app")
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "40267"


def test_1_pod_not_yet_in_the_watch_is_retried_not_fenced_whole(node: Callable[..., Node]) -> None:
    """The watch does not know the pod yet: which container is first is not
    known, so the creation fails UNAVAILABLE (kubelet retries) rather than
    fence a sidecar."""
    n = node(KAI)
    p = pod("unseen", containers=[ctr("app"), ctr("istio-proxy")], annotations={"gpu-fraction": "0.5"})
    err, _ = n.create(p, "istio-proxy")
    assert code(err) == UNAVAILABLE and "does not know its spec yet" in err.message
    assert n.tenants() == []
    n.put(p)
    adj, _ = n.create(p, "istio-proxy")
    assert code(adj) is None and not adj.env


def test_1_readyz_says_when_the_pod_watch_cannot_run(root: Path) -> None:  # noqa: F811
    from nri_runtime import FakeNriRuntime

    d = DaemonProc(root, ["--no-mps", "--no-device-plugin", "--nri-socket", str(root / "nri.sock")]).start()
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        rt.wait_registered(15)
        wait_until(d.ready, 20, what=lambda: f"readiness: {d.get('/readyz')}")
        detail = d.get("/readyz")[1]["checks"]["nri"]["detail"]
        assert "no API access" in detail and "pod-level KAI forms" in detail and "sidecars" in detail, detail
    finally:
        d.kill()
        rt.close()


# ---- 2. gpu-fraction-container-name naming no container: one outcome ------------------------


@pytest.mark.parametrize("extra", [(), (KAI,)], ids=["both-doors", "kai"])
def test_2_container_name_naming_no_container_is_refused_at_every_door(node: Callable[..., Node],
                                                                        extra: tuple[str, ...]) -> None:
    n = node(*extra)
    p = pod("noworker", containers=[ctr("app")],
            annotations={"gpu-fraction": "0.5", "gpu-fraction-container-name": "worker"})
    n.put(p)
    err, _ = n.create(p, "app")
    assert code(err) == INVALID_ARGUMENT, err
    assert "gpu-fraction-container-name" in err.message and "names no container of this pod" in err.message
    rep = explain(n, "noworker")
    assert rep["exit"] == 1
    assert [(c["name"], c["error"]["key"]) for c in rep["containers"]] == [("app", "gpu-fraction-container-name")]
    assert n.tenants() == []


# ---- 3. typos and ignored forms are said at every door ------------------------------------------


def test_3_a_typo_key_is_a_warning_naming_the_closest_key(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("typo2", containers=[ctr("app")], annotations={P + "app.gpu-memory.requests": "20Gi",
                                                           "gpu-fractoin": "0.5",
                                                           "nvidia.com/containers.app.gpu-memory.limit": "30Gi"})
    n.put(p)
    adj, _ = n.create(p, "app")
    assert code(adj) is None and not adj.env
    got = {w["key"]: w["reason"] for w in n.warnings()}
    assert f"did you mean {P}app.gpu-memory.request?" in got[P + "app.gpu-memory.requests"], got
    assert "did you mean gpu-fraction?" in got["gpu-fractoin"], got
    assert f"did you mean {P}app.gpu-memory.limit?" in got["nvidia.com/containers.app.gpu-memory.limit"], got
    rep = explain(n, "typo2")
    assert sorted(w for w in rep["warnings"] if "did you mean" in w) == sorted(
        got[k] for k in (P + "app.gpu-memory.requests", "gpu-fractoin", "nvidia.com/containers.app.gpu-memory.limit"))


def test_3_an_ignored_pod_level_form_says_which_and_why(node: Callable[..., Node]) -> None:
    n = node(KAI)
    p = pod("both", containers=[ctr("app")], annotations={"gpu-fraction": "0.5", P + "app.gpu-memory.request": "8Gi"})
    n.put(p)
    _adj, env = n.create(p, "app")
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "8192"
    (w,) = [w for w in n.warnings() if w["key"] == "gpu-fraction"]
    assert "is ignored for container app" in w["reason"] and P + "app.gpu-memory.request" in w["reason"]
    assert w["reason"] in explain(n, "both")["warnings"]


def test_3_allocate_logs_the_typo(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("dptypo", 2, {P + "app.gpu-memory.limt": "4Gi"})
    n.put(p)
    n.allocate(ids(0, 2))
    assert wait_until(lambda: any(f"did you mean {P}app.gpu-memory.limit?" in str(r.get("msg"))
                                  for r in n.d.log_records()), 10)


# ---- 4. a reservation binds only to the container kubelet allocated it to ------------------------


def test_4_a_copied_key_is_refused_and_the_owner_is_admitted(node: Callable[..., Node]) -> None:
    n = node()
    owner = pod("owner4", 8)
    n.put(owner)
    env, _ = n.allocate(ids(1, 8))
    key = env["FRACPLUGIN_RESERVATION"]
    assert key == f"{UUIDS[1]}::0-7"
    thief = pod("thief", containers=[ctr("app", env={"FRACPLUGIN_RESERVATION": key})])
    n.put(thief)
    err, _ = n.create(thief, "app")  # created first
    assert code(err) == INVALID_ARGUMENT and key in err.message and "FRACPLUGIN_RESERVATION_PROOF" in err.message
    # a made-up proof too
    liar = pod("liar", containers=[ctr("app", env={"FRACPLUGIN_RESERVATION": key,
                                                    "FRACPLUGIN_RESERVATION_PROOF": "0" * 32})])
    err, _ = n.create(liar, "app")
    assert code(err) == INVALID_ARGUMENT and "wrong FRACPLUGIN_RESERVATION_PROOF" in err.message
    assert n.held(1) == 8192 and all(t["pod_name"] == "" for t in n.tenants())
    adj, got = n.create(owner, "app", env)
    assert code(adj) is None, adj
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1] and got["NVIDIA_GPU_MEMORY_REQUEST"] == "8192"
    assert [(t["pod_name"], t["reservation"]) for t in n.tenants()] == [("owner4", key)]
    # the owner's container restarts: still its own
    n.stop(owner, "app")
    adj, _ = n.create(owner, "app", env)
    assert code(adj) is None, adj


def test_4_a_key_no_allocate_made_is_refused_naming_it(node: Callable[..., Node]) -> None:
    n = node()
    for key in (f"{UUIDS[0]}::0-78", f"{UUIDS[0]}::0-79", "GPU-nope::0"):
        p = pod("forger", containers=[ctr("app", env={"FRACPLUGIN_RESERVATION": key})])
        err, _ = n.create(p, "app")
        assert code(err) == INVALID_ARGUMENT and key in err.message, (key, err)
    assert n.tenants() == []


def test_4_the_owner_known_to_podresources_is_admitted_without_a_proof(node: Callable[..., Node]) -> None:
    """A container whose Allocate answer carried no proof (an older
    fracplugin) is its reservation's owner once PodResources says so."""
    n = node()
    p = pod("older", 2)
    n.put(p)
    env, _ = n.allocate(ids(2, 2))
    env.pop("FRACPLUGIN_RESERVATION_PROOF")
    n.record("older", "app", ids(2, 2))
    assert wait_until(lambda: [t["pod_name"] for t in n.tenants()] == ["older"], 10)
    adj, got = n.create(p, "app", env)
    assert code(adj) is None, adj
    assert got["NVIDIA_VISIBLE_DEVICES"] == UUIDS[2]


def test_4_init_and_app_share_the_proof(node: Callable[..., Node]) -> None:
    n = node()
    p = pod("initproof", containers=[ctr("app", 4)], init=[ctr("setup", 4)])
    n.put(p)
    env_init, _ = n.allocate(ids(0, 4))
    env_app, _ = n.allocate(ids(0, 4))
    assert env_init["FRACPLUGIN_RESERVATION_PROOF"] == env_app["FRACPLUGIN_RESERVATION_PROOF"]
    assert code(n.create(p, "setup", env_init)[0]) is None
    n.stop(p, "setup")
    assert code(n.create(p, "app", env_app)[0]) is None


# ---- 5. a force-deleted pod holds its GPU while its container runs ----------------------------------


def test_5_a_force_deleted_pods_hold_lasts_until_the_runtime_stops_it(node: Callable[..., Node]) -> None:
    n = node()
    big = pod("big", 60)
    n.put(big)
    env, _ = n.allocate(ids(0, 60))
    assert code(n.create(big, "app", env)[0]) is None
    assert n.held(0) == 61440
    n.delete("big")  # force delete: the API object is gone, the runtime still runs the container
    kai = pod("kai5", containers=[ctr("app")], annotations={P + "app.gpus.devices": UUIDS[0],
                                                           P + "app.gpu-memory.request": "40Gi"})
    n.put(kai)
    err, _ = n.create(kai, "app")
    assert code(err) == FAILED_PRECONDITION and "MiB free" in err.message, err  # a node guard (noderules.status_of)
    assert n.held(0) == 61440
    n.stop(big, "app")  # the runtime says it stopped
    assert wait_until(lambda: n.held(0) == 0, 10, lambda: f"released: {n.tenants()}")
    adj, env = n.create(kai, "app")
    assert code(adj) is None and env["NVIDIA_GPU_MEMORY_REQUEST"] == "40960"


def test_5_a_synchronize_without_the_container_ends_the_hold(node: Callable[..., Node]) -> None:
    from fracplugin._proto import nri_pb2
    from nri_runtime import make_container, make_pod

    n = node()
    big = pod("big5", 60)
    n.put(big)
    env, _ = n.allocate(ids(0, 60))
    assert code(n.create(big, "app", env)[0]) is None
    n.delete("big5")
    sandbox = make_pod("big5", "default", "uid-big5")
    running = make_container(sandbox, "app", env=env, state=nri_pb2.CONTAINER_RUNNING)
    n.rt.synchronize([sandbox], [running])  # still runs: still held
    assert n.held(0) == 61440
    n.rt.synchronize([], [])  # the runtime no longer runs it
    assert wait_until(lambda: n.held(0) == 0, 10, lambda: f"released: {n.tenants()}")


# ---- 6. no admitted pod stuck on a mode the node chose -------------------------------------------------


def test_6_ambiguous_allocations_of_different_modes_never_share_a_gpu(node: Callable[..., Node]) -> None:
    n = node()
    a = pod("a6", 4, {P + "app.gpu-compute.mode": "sm-sharing"})
    b = pod("b6", 4)
    n.put(a, b)
    env1, ann1 = n.allocate(ids(0, 4))
    assert ann1["fracplugin.io/allocate"] == "fallback"
    # GetPreferredAllocation keeps GPU 0 out: one of the candidates would be refused there
    got = n.kubelet.preferred(R := "fracplugin.io/gpu-memory", [d for g in range(4) for d in ids(g, 79, 0)
                                                                if d not in ids(0, 4)], [], 4)
    assert got and all(not d.startswith(UUIDS[0]) for d in got), got
    # kubelet takes devices of the same GPU anyway: refused at admission, naming why
    with pytest.raises(grpc.RpcError) as exc:
        n.kubelet.allocate(R, ids(0, 4, start=4))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msg = exc.value.details()
    assert "holder not known yet" in msg and "sm-sharing" in msg and "//" not in msg, msg
    # whichever pod holds 0-3, it is admitted
    adj, got_env = n.create(a, "app", env1)
    assert code(adj) is None, adj
    assert got_env["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]


def test_6_a_refusal_names_an_unclaimed_reservation_as_holder_not_known_yet(node: Callable[..., Node]) -> None:
    n = node()
    n.put(pod("ts6", 4))
    n.allocate(ids(0, 4))  # time-slicing, holder not known yet
    sm = pod("sm6", containers=[ctr("app")], annotations={P + "app.gpus.devices": UUIDS[0],
                                                         P + "app.gpu-memory.request": "1Gi",
                                                         P + "app.gpu-compute.mode": "sm-sharing"})
    err, _ = n.create(sm, "app")
    assert code(err) == FAILED_PRECONDITION  # one compute mode per GPU: a node guard
    assert f"reservation {UUIDS[0]}::0-3 (holder not known yet)" in err.message and "//" not in err.message


# ---- 7. a brief MPS outage is transient, naming the mode ----------------------------------------------


@pytest.fixture
def mps_node(root: Path) -> Iterator[tuple[DaemonProc, Any, list[int]]]:  # noqa: F811
    from nri_runtime import FakeNriRuntime

    (root / "dp").mkdir()
    from fake_kubelet import FakeKubelet

    # The MPS control binary, as a wrapper: while ``mps-down`` exists every new
    # start of it waits (the supervisor's restart of a hung daemon does not come
    # back either), so the outage lasts until the test ends it.
    flag = root / "mps-down"
    wrapper = root / "mps-control"
    wrapper.write_text(f"#!/bin/sh\nwhile [ -e {flag} ]; do sleep 0.05; done\nexec {FAKE_MPS} \"$@\"\n")
    wrapper.chmod(0o755)
    d = DaemonProc(root, ["--mps-control-binary", str(wrapper), "--nri-socket", str(root / "nri.sock"),
                          "--device-plugin-dir", str(root / "dp"), "--pod-resources-socket", str(root / "pr.sock"),
                          "--node-name", "gpu-node-1"]).start()
    kubelet = FakeKubelet(str(root / "dp")).start()
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    stopped: list[int] = []
    try:
        rt.wait_registered(15)
        wait_until(d.ready, 30, what=lambda: f"readiness: {d.get('/readyz')}")
        yield d, rt, stopped
    finally:
        flag.unlink(missing_ok=True)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        d.kill()
        rt.close()
        kubelet.stop()


def test_7_mps_daemons_not_answering_is_unavailable_naming_the_mode(mps_node: tuple[DaemonProc, Any, list[int]]) -> None:
    from nri_runtime import make_container, make_pod

    d, rt, stopped = mps_node
    (d.root / "mps-down").touch()
    for x in d.get("/status")[1]["mps"]["daemons"]:
        os.kill(x["pid"], signal.SIGSTOP)
        stopped.append(x["pid"])
    # /readyz turns when the first daemon misses its probe; the refusal reads
    # the time-slicing daemon's own health, so wait for that one.
    def ts_down() -> bool:
        return not any(x["healthy"] for x in d.get("/status")[1]["mps"]["daemons"] if x["mode"] == "time-slicing")

    assert wait_until(ts_down, 30, lambda: f"time-slicing MPS daemon seen down: {d.get('/status')[1]['mps']}")
    assert not d.get("/readyz")[1]["checks"]["mps"]["ready"]
    sandbox = make_pod("np7", "default", "uid-np7", {P + "app.gpu-memory.request": "4Gi"})
    err = rt.create_container(sandbox, make_container(sandbox, "app"))
    assert code(err) == UNAVAILABLE, err
    assert "time-slicing MPS daemon is down" in err.message and "more GPUs" not in err.message, err.message
