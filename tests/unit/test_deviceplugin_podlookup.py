"""Which pod an Allocate is for: fracplugin.kubelet.podlookup."""

from __future__ import annotations

import threading

from fracplugin.kubelet.podlookup import (
    InMemoryPodSource,
    KubernetesPodSource,
    PodSource,
    pod_problem,
    resource_count,
    select_candidates,
)
from tests.helpers import scaled, wait_until

R = "fracplugin.io/gpu-memory"


def pod(name, created, containers, init=(), node="n1", phase="Pending", uid=None, **extra):
    def c(spec):
        cname, n = spec
        return {"name": cname, "resources": {"limits": {R: str(n)}} if n else {}}

    p = {
        "metadata": {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}", "creationTimestamp": created},
        "spec": {"nodeName": node, "containers": [c(x) for x in containers], "initContainers": [c(x) for x in init]},
        "status": {"phase": phase},
    }
    p["metadata"].update(extra.get("metadata", {}))
    p["status"].update(extra.get("status", {}))
    return p


def test_resource_count_reads_limits_then_requests():
    assert resource_count({"resources": {"limits": {R: "4"}, "requests": {R: "4"}}}, R) == 4
    assert resource_count({"resources": {"requests": {R: "3"}}}, R) == 3
    assert resource_count({"resources": {"limits": {R: "x"}}}, R) == 0
    assert resource_count({}, R) == 0


def test_oldest_pod_first():
    pods = [
        pod("young", "2026-01-02T00:00:00Z", [("app", 4)]),
        pod("old", "2026-01-01T00:00:00Z", [("app", 4)]),
        pod("other-size", "2025-01-01T00:00:00Z", [("app", 5)]),
    ]
    got = select_candidates(pods, R, 4)
    assert [(c.pod["metadata"]["name"], c.container) for c in got] == [("old", "app"), ("young", "app")]


def test_init_containers_before_app_containers_and_served_skipped():
    p = pod("p", "2026-01-01T00:00:00Z", [("app", 4), ("side", 4)], init=[("setup", 4)])
    got = select_candidates([p], R, 4)
    assert [(c.container, c.init) for c in got] == [("setup", True)]
    served = {("uid-p", "setup")}
    got = select_candidates([p], R, 4, lambda u, c: (u, c) in served)
    assert [c.container for c in got] == ["app"]
    served.add(("uid-p", "app"))
    got = select_candidates([p], R, 4, lambda u, c: (u, c) in served)
    assert [c.container for c in got] == ["side"]


def test_first_unserved_container_must_match_the_count():
    # The pod's next container to admit wants 2, so a 4-device Allocate is not for it.
    p = pod("p", "2026-01-01T00:00:00Z", [("a", 2), ("b", 4)])
    assert select_candidates([p], R, 4) == []
    got = select_candidates([p], R, 4, lambda u, c: c == "a")
    assert [c.container for c in got] == ["b"]


def test_created_containers_are_not_candidates():
    p = pod(
        "p",
        "2026-01-01T00:00:00Z",
        [("app", 4)],
        status={"containerStatuses": [{"name": "app", "containerID": "containerd://abc"}]},
    )
    assert select_candidates([p], R, 4) == []


def test_in_memory_source_filters_node_phase_and_deletion():
    src = InMemoryPodSource("n1")
    assert isinstance(src, PodSource)
    src.add(pod("here", "2026-01-01T00:00:00Z", [("app", 4)]))
    src.add(pod("elsewhere", "2026-01-01T00:00:00Z", [("app", 4)], node="n2"))
    src.add(pod("done", "2026-01-01T00:00:00Z", [("app", 4)], phase="Succeeded"))
    src.add(pod("going", "2026-01-01T00:00:00Z", [("app", 4)], metadata={"deletionTimestamp": "2026-01-01T00:01:00Z"}))
    src.add(pod("nogpu", "2026-01-01T00:00:00Z", [("app", 0)]))
    assert [p["metadata"]["name"] for p in src.candidates(R, 4)] == ["here"]
    assert src.candidates(R, 3) == []
    assert src.get("ns", "here")["metadata"]["uid"] == "uid-here"
    assert src.get("ns", "missing") is None


def test_in_memory_source_wait_wakes_on_change_and_reports_deletes():
    src = InMemoryPodSource("n1")
    deleted = []
    src.subscribe_deleted(lambda p: deleted.append(p["metadata"]["name"]))
    p = pod("p", "2026-01-01T00:00:00Z", [("app", 4)])
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(src.wait(30.0)))
    waiter.start()
    # The change must come while the waiter is blocked (a timer could fire
    # before it waits on a busy machine): the store's condition then holds it.
    wait_until(lambda: len(src._store._cond._waiters) == 1, what="the waiter to block in wait()")  # type: ignore[attr-defined]
    src.add(p)
    waiter.join(10)
    assert not waiter.is_alive() and woke == [True]
    assert len(src) == 1
    # Nothing changes now: wait() must give up after its own timeout. The
    # bounded wait is the thing tested (its timeout path), not a synchronisation.
    assert src.wait(0.01) is False
    src.delete(p)
    assert deleted == ["p"] and len(src) == 0


class _FakeList:
    def __init__(self, items):
        self.items = items
        self.metadata = type("M", (), {"resource_version": "7"})()


def test_kubernetes_source_lists_then_reports_not_ready_on_api_error():
    """KubernetesPodSource with a stub CoreV1Api: the first list fills the cache
    (only pods requesting our resource), a failing API makes it not ready."""
    from kubernetes import client

    api = client.ApiClient()
    calls = {"n": 0}
    gate = threading.Event()

    class StubV1:
        def list_pod_for_all_namespaces(self, **kw):
            calls["n"] += 1
            assert kw["field_selector"] == "spec.nodeName=n1"
            if calls["n"] == 1:
                pods = [
                    client.V1Pod(
                        metadata=client.V1ObjectMeta(name="a", namespace="ns", uid="ua"),
                        spec=client.V1PodSpec(
                            node_name="n1",
                            containers=[
                                client.V1Container(
                                    name="app", resources=client.V1ResourceRequirements(limits={R: "4"})
                                )
                            ],
                        ),
                    ),
                    client.V1Pod(
                        metadata=client.V1ObjectMeta(name="b", namespace="ns", uid="ub"),
                        spec=client.V1PodSpec(node_name="n1", containers=[client.V1Container(name="app")]),
                    ),
                ]
                return _FakeList(pods)
            gate.wait(5)
            raise client.ApiException(status=503, reason="apiserver down")

    src = KubernetesPodSource("n1", R, api_client=api, watch_timeout_s=1)
    src._client = lambda: StubV1()  # the only seam: the API object itself
    src.start()
    try:
        assert src.wait(5.0)
        assert [p["metadata"]["name"] for p in src.candidates(R, 4)] == ["a"]
        assert len(src) == 1
        gate.set()
        # not ready, then the error recorded (two steps of the watch thread: wait for both)
        wait_until(lambda: not src.ready() and "apiserver down" in (src.last_error or ""), 5,
                   lambda: f"the source not ready, naming the API error: ready={src.ready()} error={src.last_error}")
    finally:
        src.stop(0.5)


class _FakeWatchResponse:
    """What the kubernetes client's Watch reads: a streaming HTTP response."""

    status = 200

    def __init__(self, events):
        self._events = events

    def stream(self, amt=None, decode_content=False):
        import json

        for ev in self._events:
            yield (json.dumps(ev) + "\n").encode()

    def close(self):
        pass

    def release_conn(self):
        pass


def test_kubernetes_source_applies_watch_events():
    from kubernetes import client

    def raw(name, uid, count, **md):
        return {
            "metadata": {"name": name, "namespace": "ns", "uid": uid, **md},
            "spec": {"nodeName": "n1", "containers": [{"name": "app", "resources": {"limits": {R: str(count)}}}]},
            "status": {"phase": "Pending"},
        }

    events = [
        {"type": "ADDED", "object": raw("b", "ub", 2)},
        {"type": "MODIFIED", "object": raw("a", "ua", 4, deletionTimestamp="2026-01-01T00:00:00Z")},
        {"type": "ADDED", "object": raw("c", "uc", 2)},
        {"type": "DELETED", "object": raw("c", "uc", 2)},
    ]
    calls = {"list": 0}
    done = threading.Event()
    gate = threading.Event()

    def list_pods(**kw):
        if kw.get("watch"):
            done.set()  # the events below are all this watch has
            return _FakeWatchResponse(events)
        calls["list"] += 1
        if calls["list"] > 1:
            gate.wait(5)
            raise client.ApiException(status=503, reason="stopping")
        return _FakeList(
            [
                client.V1Pod(
                    metadata=client.V1ObjectMeta(name="a", namespace="ns", uid="ua"),
                    spec=client.V1PodSpec(
                        node_name="n1",
                        containers=[
                            client.V1Container(name="app", resources=client.V1ResourceRequirements(limits={R: "4"}))
                        ],
                    ),
                )
            ]
        )

    stub = type("StubV1", (), {"list_pod_for_all_namespaces": staticmethod(list_pods)})()
    src = KubernetesPodSource("n1", R, api_client=client.ApiClient(), watch_timeout_s=1)
    src._client = lambda: stub
    deleted = []
    src.subscribe_deleted(lambda p: deleted.append(p["metadata"]["name"]))
    src.start()
    try:
        assert done.wait(scaled(5))
        wait_until(lambda: calls["list"] > 1, 5, "the watch to end and the source to relist")
        assert src.candidates(R, 4) == []  # a is being deleted
        assert [p["metadata"]["name"] for p in src.candidates(R, 2)] == ["b"]
        assert deleted == ["c"]
    finally:
        gate.set()
        src.stop(0.5)


def test_malformed_pods_are_skipped_not_raised():
    good = pod("g", "2026-01-01T00:00:00Z", [("app", 2)], node="n1")
    bad = [
        "a string",
        {"metadata": "x"},
        {"metadata": {"name": "b1", "uid": "u1"}, "spec": {"nodeName": "n1", "containers": "abc"}},
        {"metadata": {"name": "b2", "uid": "u2"}, "spec": {"nodeName": "n1", "containers": [["x"]]}},
        {"metadata": {"name": "b3", "uid": "u3"},
         "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": [R]}}]}},
        {"metadata": {"name": "b4", "uid": "u4", "annotations": {"k": 5}}, "spec": {"nodeName": "n1"}},
        {"metadata": {"name": "b5", "uid": "u5"}, "spec": {"nodeName": "n1"}, "status": {"containerStatuses": "x"}},
    ]
    for b in bad:
        assert pod_problem(b), b
    assert pod_problem(good) is None
    assert pod_problem({"metadata": {"name": "m"}}) is None  # missing fields read as empty
    src = InMemoryPodSource("n1")
    for b in bad:
        src.add(b)  # used to raise AttributeError out of the source
        src.delete(b)
    src.add(good)
    assert [p["metadata"]["name"] for p in src.candidates(R, 2)] == ["g"]


def test_resource_count_takes_ascii_decimal_counts_only():
    def c(v):
        return {"resources": {"limits": {R: v}}}

    assert resource_count(c("3"), R) == 3 and resource_count(c(3), R) == 3
    for v in ("\u0661", "\u00b2", "9" * 5000, "+1", True, 1.5, {"a": 1}):
        assert resource_count(c(v), R) == 0, v


def test_malformed_watch_object_does_not_end_the_watch():
    """A pod object the lookup cannot read (containers: 'abc') used to raise out
    of the store, ending the watch (relist with backoff) and dropping the
    events after it."""
    from kubernetes import client

    def raw(name, uid, count):
        return {
            "metadata": {"name": name, "namespace": "ns", "uid": uid},
            "spec": {"nodeName": "n1", "containers": [{"name": "app", "resources": {"limits": {R: str(count)}}}]},
            "status": {"phase": "Pending"},
        }

    events = [
        {"type": "ADDED", "object": {"metadata": {"name": "bad", "uid": "ubad"},
                                     "spec": {"nodeName": "n1", "containers": "abc"}}},
        {"type": "MODIFIED", "object": {"metadata": {"name": "bad2", "uid": "ubad2"}, "spec": ["x"]}},
        {"type": "DELETED", "object": {"metadata": "nope"}},
        {"type": "ADDED", "object": raw("after", "uafter", 2)},
    ]
    calls = {"list": 0}
    gate = threading.Event()

    def list_pods(**kw):
        if kw.get("watch"):
            return _FakeWatchResponse(events)
        calls["list"] += 1
        if calls["list"] > 1:
            gate.wait(5)
            raise client.ApiException(status=503, reason="stopping")
        return _FakeList([])

    stub = type("StubV1", (), {"list_pod_for_all_namespaces": staticmethod(list_pods)})()
    src = KubernetesPodSource("n1", R, api_client=client.ApiClient(), watch_timeout_s=1)
    src._client = lambda: stub
    src.start()
    try:
        wait_until(lambda: calls["list"] > 1, 5, "the watch stream to end (the source relists)")
        assert [p["metadata"]["name"] for p in src.candidates(R, 2)] == ["after"]
        assert len(src) == 1
    finally:
        gate.set()
        src.stop(0.5)


def test_cache_keeps_annotated_pods_without_the_resource_for_the_nri_door():
    """The watch cache of a resource keeps pods with fraction annotations too:
    the NRI door reads their spec (first app container, stray keys; ADR 0007)."""
    from fracplugin.kubelet.podlookup import _Store

    store = _Store("n1", "fracplugin.io/gpu-memory")
    kai = {"metadata": {"name": "kai", "namespace": "d", "uid": "u1", "annotations": {"gpu-fraction": "0.5"}},
           "spec": {"nodeName": "n1", "containers": [{"name": "app"}]}}
    plain = {"metadata": {"name": "web", "namespace": "d", "uid": "u2", "annotations": {"team": "a"}},
             "spec": {"nodeName": "n1", "containers": [{"name": "app"}]}}
    store.put(kai)
    store.put(plain)
    assert store.get("d", "kai") is kai and store.get("d", "web") is None
    assert store.candidates("fracplugin.io/gpu-memory", 1) == []  # never an Allocate candidate


def test_candidate_index_holds_pending_containers_only():
    """The (resource, count) index keeps a pod only for its containers the
    runtime has not created (issue 14): running pods are never looked at by
    an Allocate, a pod leaves the bucket once its container is created, and
    a pod whose init container ran is still found by its app container's
    count. select_candidates over the index gives what it gives over every
    cached pod."""
    src = InMemoryPodSource("n1")
    ran = {"containerStatuses": [{"name": "app", "containerID": "containerd://1"}]}
    src.add(pod("running", "2026-01-01T00:00:00Z", [("app", 4)], phase="Running", status=ran))
    src.add(pod("pending", "2026-01-01T00:00:01Z", [("app", 4)]))
    init_done = {"initContainerStatuses": [{"name": "setup", "containerID": "containerd://2"}]}
    src.add(pod("initdone", "2026-01-01T00:00:02Z", [("app", 4)], init=[("setup", 2)], status=init_done))
    assert [p["metadata"]["name"] for p in src.candidates(R, 4)] == ["pending", "initdone"]
    assert src.candidates(R, 2) == []  # the init container was created: no Allocate for it any more
    for count in (2, 4):
        assert select_candidates(src.candidates(R, count), R, count) == select_candidates(src.pods(), R, count)
    src.add(pod("pending", "2026-01-01T00:00:01Z", [("app", 4)], phase="Running", status=ran))
    assert [p["metadata"]["name"] for p in src.candidates(R, 4)] == ["initdone"]
    assert src.get("ns", "running") is not None and len(src) == 3  # still cached for the NRI door
