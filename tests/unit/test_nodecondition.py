"""nodecondition: readiness -> the KAI node condition; publisher debounce,
retries and shutdown, against an in-memory stand-in for CoreV1Api (the
publisher's peer; the subject itself is real)."""

from __future__ import annotations

import argparse
import threading

import pytest

from fracplugin import config as c
from fracplugin.config import ConfigError
from fracplugin.nodecondition import (
    DEFAULT_CONDITION_TYPE,
    DEFAULT_CONDITION_TYPES,
    ConditionState,
    NodeConditionPublisher,
    condition_from_checks,
)
from tests.helpers import wait_until


def test_all_ready_is_true() -> None:
    s = condition_from_checks({"nri": {"ready": True, "detail": "synchronized with the runtime"},
                               "mps": {"ready": True, "detail": "every daemon healthy"}})
    assert (s.ready, s.status, s.reason) == (True, "True", "FracpluginReady")
    assert "nri: synchronized with the runtime" in s.message


@pytest.mark.parametrize("checks,reason", [
    ({"nri": {"ready": False, "detail": "not connected to /x"}, "mps": {"ready": True}}, "NRINotReady"),
    ({"device_plugin": {"ready": False, "detail": "not registered"}}, "DevicePluginNotReady"),
    ({"nri": {"ready": True}, "mps": {"ready": False, "detail": "unhealthy: sm-sharing"}}, "MPSNotHealthy"),
    ({"mps": {"ready": False}, "nri": {"ready": False}, "daemon": {"ready": False, "detail": "shutting down"}},
     "ShuttingDown"),
    ({"mps": {"ready": False}, "nri": {"ready": False}}, "NRINotReady"),  # fixed order, not dict order
    ({"pod_watch": {"ready": False, "detail": "x"}}, "PodWatchNotReady"),
    ({}, "NoDoorsEnabled"),
])
def test_not_ready_reason_and_message(checks, reason) -> None:
    s = condition_from_checks(checks)
    assert s.status == "False" and s.reason == reason
    for part, c in checks.items():
        if not c.get("ready") and c.get("detail"):
            assert f"{part}: {c['detail']}" in s.message


class Core:
    """In-memory node status: records patches, fails on demand."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.fail: list[Exception] = []
        self.lock = threading.Lock()

    def read_node(self, name: str, **kw):  # no prior condition
        raise ApiError(404)

    def patch_node_status(self, name: str, body: dict, **kw) -> None:
        assert kw.get("_content_type") == "application/strategic-merge-patch+json"
        with self.lock:
            if self.fail:
                raise self.fail.pop(0)
            self.bodies.append(body)

    def statuses(self) -> list[str]:
        with self.lock:
            return [b["status"]["conditions"][0]["status"] for b in self.bodies]


class ApiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.reason = "Injected"


class Readiness:
    """The readiness function a publisher polls: returns ``state`` and counts
    the polls, so a test can wait for the publisher to have seen a state
    (instead of sleeping and hoping it has)."""

    def __init__(self, state: ConditionState) -> None:
        self.state = state
        self.polls = 0
        self.seen: list[ConditionState] = []

    def __call__(self) -> ConditionState:
        state = self.state
        self.polls += 1
        self.seen.append(state)
        return state

    def polls_after(self, n: int) -> None:
        """Wait until the publisher has polled ``n`` more times: its loop went
        round, every decision on the earlier polls is made."""
        target = self.polls + n
        wait_until(lambda: self.polls >= target, what=f"{n} more readiness polls")


def _publisher(core, readiness, **timings: float) -> NodeConditionPublisher:
    """A publisher on node ``n`` with its timings (class attributes, seconds) shortened for the test."""
    p = NodeConditionPublisher(core, "n", readiness)
    for name, value in timings.items():
        setattr(p, name, value)
    return p


def test_a_flap_shorter_than_the_debounce_is_not_published() -> None:
    core = Core()
    ready, down = ConditionState(True, "FracpluginReady", "ok"), ConditionState(False, "MPSNotHealthy", "mps: down")
    readiness = Readiness(ready)
    p = _publisher(core, readiness, poll_s=0.01, debounce_s=2.0).start()
    try:
        wait_until(lambda: core.statuses() == ["True"])
        readiness.state = down
        wait_until(lambda: down in readiness.seen, what="the publisher to see the dip")
        readiness.state = ready
        n = len(readiness.seen)
        wait_until(lambda: ready in readiness.seen[n:], what="the publisher to see the recovery")
        readiness.polls_after(2)
        assert core.statuses() == ["True"]  # the dip, shorter than the debounce, never reached the API
        readiness.state = down
        wait_until(lambda: core.statuses() == ["True", "False"], 15)
    finally:
        p.stop(1.0)
    last = core.bodies[-1]["status"]["conditions"][0]
    assert last["reason"] == "ShuttingDown" and last["status"] == "Unknown"  # a stop on purpose: Unknown


def test_transition_time_moves_only_with_the_status() -> None:
    core, cur = Core(), {"s": ConditionState(False, "NRINotReady", "a")}
    p = _publisher(core, lambda: cur["s"], poll_s=0.01, debounce_s=0).start()
    try:
        wait_until(lambda: len(core.bodies) == 1)
        cur["s"] = ConditionState(False, "MPSNotHealthy", "b")  # same status, new reason
        wait_until(lambda: len(core.bodies) == 2)
    finally:
        p.stop(1.0)
    c0, c1 = (b["status"]["conditions"][0] for b in core.bodies[:2])
    assert c1["reason"] == "MPSNotHealthy" and c1["lastTransitionTime"] == c0["lastTransitionTime"]


def test_server_errors_are_retried_forbidden_is_not() -> None:
    core = Core()
    core.fail = [ApiError(500), ConnectionError("refused")]
    p = _publisher(core, lambda: ConditionState(True, "R", "m"), poll_s=0.01, retry_base_s=0.01).start()
    try:
        wait_until(lambda: core.statuses() == ["True"])
        assert p.status()["failures"] == 0 and p.status()["patches"] == 1
    finally:
        p.stop(0.5)
    core2 = Core()
    core2.fail = [ApiError(403)] * 50
    readiness = Readiness(ConditionState(True, "R", "m"))
    p2 = _publisher(core2, readiness, poll_s=0.01, retry_base_s=0.01).start()
    try:
        wait_until(lambda: p2.status()["failures"] == 1)
        readiness.polls_after(3)  # the loop went round after the failure and did not patch again
        assert len(core2.fail) == 49  # one request, no tenacity retry on 403
        assert "403" in p2.status()["last_error"]
    finally:
        p2.stop(0.3)


def test_every_type_gets_the_same_condition() -> None:
    core = Core()
    p = _publisher(core, lambda: ConditionState(True, "R", "m"), poll_s=0.01).start()
    try:
        wait_until(lambda: core.bodies)
    finally:
        p.stop(0.5)
    # by default both names (issue 23 item 5): the renamed stack's / KAI api's, then the older one
    types = [c["type"] for c in core.bodies[0]["status"]["conditions"]]
    assert types == [DEFAULT_CONDITION_TYPE, "gpu-sharing.nvidia.com/Ready"] == list(DEFAULT_CONDITION_TYPES)
    assert DEFAULT_CONDITION_TYPE == "gpu-fractioning.nvidia.com/Ready"
    # the last word of a stop on purpose: Unknown under both names
    assert [(c["type"], c["status"], c["reason"]) for c in core.bodies[-1]["status"]["conditions"]] == [
        ("gpu-fractioning.nvidia.com/Ready", "Unknown", "ShuttingDown"),
        ("gpu-sharing.nvidia.com/Ready", "Unknown", "ShuttingDown")]


@pytest.mark.parametrize("kwargs", [{"types": ()}, {"node_name": ""}])
def test_bad_arguments(kwargs) -> None:
    args = {"api": Core(), "node_name": "n", "readiness": lambda: ConditionState(True, "R", "m"), **kwargs}
    with pytest.raises(ValueError):
        NodeConditionPublisher(**args)


def load(argv: list[str], env: dict[str, str]):
    p = argparse.ArgumentParser()
    c.add_arguments(p)
    return c.load(p.parse_args(argv), env)


def test_condition_types_setting() -> None:
    cfg, _ = load(["--node-condition-types", "gpu-sharing.nvidia.com/Ready,gpu-fractioning.nvidia.com/Ready"], {})
    assert cfg.node_condition_types == ("gpu-sharing.nvidia.com/Ready", "gpu-fractioning.nvidia.com/Ready")
    assert load([], {})[0].node_condition_types == ("gpu-fractioning.nvidia.com/Ready", "gpu-sharing.nvidia.com/Ready")
    assert load(["--node-condition-types", ""], {})[0].node_condition_types == ()
    with pytest.raises(ConfigError, match=r"--node-condition-types .*'bad type!'.*not a condition type"):
        load(["--node-condition-types", "bad type!"], {})


def test_status_table_shows_the_node_condition() -> None:
    from fracplugin.status import render_table

    doc = {"node": "n1", "version": "0", "pid": 1, "ready": False, "checks": {}, "doors": {}, "gpus": [],
           "mps": {"enabled": False, "daemons": []},
           "node_condition": {"types": ["gpu-sharing.nvidia.com/Ready"], "patches": 3, "failures": 1,
                              "published": {"status": "False", "reason": "MPSNotHealthy", "message": "mps: x"},
                              "last_error": None}}
    out = render_table(doc)
    assert "node condition gpu-sharing.nvidia.com/Ready: False (MPSNotHealthy)  patches 3  failures 1" in out
    doc["node_condition"].update(published=None, last_error="ApiException: 403 Forbidden")
    out = render_table(doc)
    assert "not published" in out and "last error: ApiException: 403 Forbidden" in out
