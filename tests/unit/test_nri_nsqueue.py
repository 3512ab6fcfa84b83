"""The NRI door's keyed work queue (``fracplugin.nri.nsqueue``, issue 14):
one pending job per key, a newer job replaces a queued one, a key is never
processed by two workers at once, FIFO over keys, shutdown. Workers are held
with events, never timed: every wait below is for a condition."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from fracplugin.nri.nsqueue import KeyedWorkQueue
from tests.helpers import scaled, wait_for


class Gate:
    """A job that records that it started, then waits for ``open``."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.release.wait(scaled(30)), "gate never opened"
        return "gate"


@pytest.fixture
def queue():
    q = KeyedWorkQueue(workers=1, name="t-queue")
    yield q
    q.close()
    assert q.join(30)


def _busy(q: KeyedWorkQueue, key: str = "busy") -> Gate:
    """Hold one worker on ``key`` until the returned gate opens."""
    g = Gate()
    q.put(key, g)
    assert g.started.wait(scaled(30))
    return g


def test_one_pending_entry_per_key_whatever_the_rate(queue):
    gate = _busy(queue)
    runs: list[int] = []
    futures = [queue.put(("ns", f"pod-{i % 8}", "app"), lambda i=i: runs.append(i) or i, join=True)
               for i in range(10_000)]
    # 10,000 puts over 8 keys: 8 entries queued, not 10,000
    assert queue.stats()["queued"] == 8 and queue.stats()["running"] == 1
    # joined puts share the first future of their key; each key runs once, with its newest job
    assert len({id(f) for f in futures}) == 8
    gate.release.set()
    assert [f.result(30) for f in futures[-8:]] == list(range(9992, 10_000))
    assert runs == list(range(9992, 10_000))
    assert futures[0].result(0) == 9992  # a waiter of the first put gets the newest job's outcome


def test_a_replaced_job_is_cancelled_and_never_runs(queue):
    gate = _busy(queue)
    ran: list[str] = []
    first = queue.put("k", lambda: ran.append("first"), tag="ensure")
    second = queue.put("k", lambda: ran.append("second") or "second", tag="release")
    assert first.cancelled() and queue.pending_tag("k") == "release"
    with pytest.raises(CancelledError):
        first.result(0)
    gate.release.set()
    assert second.result(30) == "second"
    assert ran == ["second"]


def test_a_key_is_never_processed_by_two_workers_at_once():
    q = KeyedWorkQueue(workers=4, name="t-queue")
    try:
        active: dict[str, int] = {}
        most: dict[str, int] = {}
        lock = threading.Lock()
        order: list[str] = []
        gates = {n: threading.Event() for n in ("k1", "k2")}

        def job(name: str, key: str = "k") -> str:
            with lock:
                active[key] = active.get(key, 0) + 1
                most[key] = max(most.get(key, 0), active[key])
                order.append(name)
            try:
                if name in gates:
                    assert gates[name].wait(scaled(30))
                return name
            finally:
                with lock:
                    active[key] -= 1

        f1 = q.put("k", lambda: job("k1"))
        wait_for(lambda: order == ["k1"], what="k1 running")
        f2 = q.put("k", lambda: job("k2"))  # the key runs: k2 waits although 3 workers are idle
        assert q.running("k") and q.pending_tag("k") == "" and q.stats()["queued"] == 1
        # Later keys flow past it: with k2 handed to an idle worker it would have run before them (FIFO).
        assert [q.put(f"x{i}", lambda i=i: job(f"x{i}", f"x{i}")).result(30) for i in range(3)] == ["x0", "x1", "x2"]
        assert order == ["k1", "x0", "x1", "x2"]
        gates["k1"].set()
        assert f1.result(30) == "k1"
        wait_for(lambda: "k2" in order, what="k2 after k1")
        gates["k2"].set()
        assert f2.result(30) == "k2"
        assert most["k"] == 1
    finally:
        q.close()
        assert q.join(30)


def test_ensure_then_release_of_one_owner_run_in_that_order(queue):
    """A release put while the owner's ensure runs comes after it; an ensure
    put while a release is still queued replaces it (desired state)."""
    key = ("ns", "pod-uid", "app")
    calls: list[str] = []
    ensure_gate = threading.Event()

    def ensure(n: int) -> str:
        calls.append(f"ensure{n}")
        if n == 1:
            assert ensure_gate.wait(scaled(30))
        return f"ensure{n}"

    e1 = queue.put(key, lambda: ensure(1), tag="ensure")
    wait_for(lambda: calls == ["ensure1"], what="ensure1 running")
    r1 = queue.put(key, lambda: calls.append("release1"), tag="release")
    assert queue.pending_tag(key) == "release"
    ensure_gate.set()
    e1.result(30)
    r1.result(30)
    assert calls == ["ensure1", "release1"]

    gate = _busy(queue)  # hold the only worker: what follows stays queued
    r2 = queue.put(key, lambda: calls.append("release2"), tag="release")
    e2 = queue.put(key, lambda: ensure(2), join=queue.pending_tag(key) == "ensure", tag="ensure")
    assert r2.cancelled() and queue.stats()["queued"] == 1
    gate.release.set()
    assert e2.result(30) == "ensure2"
    assert calls == ["ensure1", "release1", "ensure2"]


def test_keys_run_in_the_order_first_queued_and_a_replaced_entry_keeps_its_place(queue):
    gate = _busy(queue)
    ran: list[str] = []
    queue.put("a", lambda: ran.append("a1"))
    queue.put("b", lambda: ran.append("b"))
    last = queue.put("a", lambda: ran.append("a2"))  # replaces a1, keeps a's place before b
    gate.release.set()
    last.result(30)
    wait_for(lambda: queue.stats()["queued"] + queue.stats()["running"] == 0, what="the queue idle")
    assert ran == ["a2", "b"]


def test_cancel_drops_only_what_it_is_asked_to(queue):
    gate = _busy(queue, key="k")
    pending = queue.put("k", lambda: "next", tag="ensure")
    assert not queue.cancel("k", tag="release")  # another tag
    assert not queue.cancel("k", only_idle=True)  # the key runs now
    assert not queue.cancel("nothing")
    assert queue.cancel("k", tag="ensure")
    assert pending.cancelled() and queue.stats()["queued"] == 0 and queue.pending_tag("k") is None
    gate.release.set()
    wait_for(lambda: queue.stats()["queued"] + queue.stats()["running"] == 0, what="the queue idle")
    idle = _busy(queue, key="other")
    queued = queue.put("k", lambda: "x", tag="ensure")
    assert queue.cancel("k", tag="ensure", only_idle=True)  # queued behind another key, never started
    assert queued.cancelled()
    idle.release.set()


def test_share_returns_the_job_queued_or_running(queue):
    gate = Gate()
    running = queue.put(("drain", "c1"), gate)
    assert gate.started.wait(scaled(30))
    assert queue.share(("drain", "c1"), lambda: "second") is running  # a drain of c1 runs: the same one
    other = queue.share(("drain", "c2"), lambda: "c2")
    assert queue.share(("drain", "c2"), lambda: "again") is other
    gate.release.set()
    assert running.result(30) == "gate" and other.result(30) == "c2"


def test_a_failing_job_fails_its_future_and_the_worker_goes_on(queue):
    def boom() -> None:
        raise RuntimeError("control daemon down")

    failed = queue.put("k", boom)
    with pytest.raises(RuntimeError, match="control daemon down"):
        failed.result(30)
    assert queue.put("k", lambda: "ok").result(30) == "ok"
    assert queue.stats()["threads"] == 1


def test_close_cancels_what_is_queued_and_lets_the_running_job_finish():
    q = KeyedWorkQueue(workers=2, name="t-queue")
    gate = Gate()
    running = q.put("k", gate)
    assert gate.started.wait(scaled(30))
    queued = [q.put(f"q{i}", lambda: None) for i in range(3)]
    after = q.put("k", lambda: None)
    wait_for(lambda: all(f.done() for f in queued), what="the other keys")  # the second worker took them
    q.close()
    assert after.cancelled() and q.stats()["queued"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        q.put("k", lambda: None)
    with pytest.raises(RuntimeError, match="closed"):
        q.share("new", lambda: None)
    assert not running.done()
    gate.release.set()
    assert q.join(30)
    assert running.result(0) == "gate"
    assert q.stats() == {"queued": 0, "running": 0, "threads": 0}


def test_workers_start_on_demand_up_to_the_limit():
    q = KeyedWorkQueue(workers=3, name="t-queue")
    try:
        assert q.stats()["threads"] == 0
        gates = [Gate() for _ in range(5)]
        for i, g in enumerate(gates):
            q.put(i, g)
        wait_for(lambda: sum(g.started.is_set() for g in gates) == 3, what="three jobs running")
        assert q.stats() == {"queued": 2, "running": 3, "threads": 3}
        for g in gates:
            g.release.set()
        wait_for(lambda: q.stats()["queued"] + q.stats()["running"] == 0, what="the queue idle")
    finally:
        q.close()
        assert q.join(30)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        KeyedWorkQueue(workers=0)


def test_a_burst_put_while_one_worker_idles_runs_on_as_many_workers_as_allowed():
    """A worker that was notified but has not woken yet counts as idle: a burst
    of puts in that moment used to queue behind it (one job at a time with
    ``workers=4``). Each job below waits at a barrier of four: they can only
    all finish when four run at once."""
    q = KeyedWorkQueue(workers=4, name="t-queue")
    try:
        q.put("warm", lambda: None).result(30)
        wait_for(lambda: q.stats() == {"queued": 0, "running": 0, "threads": 1}, what="one idle worker")
        barrier = threading.Barrier(4, timeout=30)
        futures = [q.put(k, barrier.wait) for k in "abcd"]  # back to back, before the idle worker wakes
        assert sorted(f.result(60) for f in futures) == [0, 1, 2, 3]  # BrokenBarrierError when serialised
        assert q.stats()["threads"] == 4
    finally:
        q.close()
        assert q.join(30)


def test_busy_while_a_job_of_the_key_is_pending_or_running(queue):
    assert not queue.busy("k")
    gate = _busy(queue, "k")  # running (the only worker)
    assert queue.busy("k") and not queue.busy("other")
    queued = queue.put("other", lambda: "other")  # pending behind the busy worker
    assert queue.busy("other")
    gate.release.set()
    assert queued.result(30) == "other"
    wait_for(lambda: not queue.busy("k") and not queue.busy("other"), what="both done")


def test_urgent_work_runs_before_early_work_fifo_among_itself(queue):
    """ADR 0030: ensures queued early (RunPodSandbox) yield to the ones a
    StartContainer awaits: ``put(urgent=True)`` and ``promote`` move a key
    ahead of the non-urgent ones, behind the urgent ones already waiting."""
    gate = _busy(queue)
    order: list[str] = []
    futures = {k: queue.put(k, lambda k=k: order.append(k)) for k in ("e1", "e2", "e3", "e4")}
    futures["u1"] = queue.put("u1", lambda: order.append("u1"), urgent=True)
    assert queue.promote("e3") and not queue.promote("nothing")
    futures["u2"] = queue.put("u2", lambda: order.append("u2"), urgent=True)
    queue.put("e4", lambda: order.append("e4"), join=True, urgent=True)  # a joined put makes it urgent
    queue.put("e2", lambda: order.append("e2"))  # a replaced job keeps its place (not urgent)
    gate.release.set()
    for f in futures.values():
        if not f.cancelled():
            f.result(30)
    wait_for(lambda: len(order) == 6, what="every job")
    assert order == ["u1", "e3", "u2", "e4", "e1", "e2"]


def test_a_promoted_key_that_runs_stays_urgent_for_its_next_job():
    q = KeyedWorkQueue(workers=1, name="t-queue")
    try:
        gate = _busy(q, "k")
        order: list[str] = []
        q.put("k", lambda: order.append("k2"))  # waits for k's running job
        q.put("e", lambda: order.append("e"))
        assert q.promote("k")
        gate.release.set()
        wait_for(lambda: len(order) == 2, what="both jobs")
        assert order == ["k2", "e"]
    finally:
        q.close()
        assert q.join(30)
