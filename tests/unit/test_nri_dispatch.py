"""The stub's dispatch machinery without sockets: the watchdog
(``nri.serving._Watchdog``: expired calls are reported, finished ones are not,
and a call whose deadline is earlier than the ones already waited for is not
held back behind them) and the handler threads (``nri.serving._Workers``)."""

from __future__ import annotations

import threading
import time

import pytest

from fracplugin.nri.interfaces import CallContext
from fracplugin.nri.serving import _DONE, _Call, _Watchdog, _Workers
from fracplugin.nri.ttrpc import RequestReceived
from tests.helpers import scaled, wait_until


def _call(stream_id: int, in_s: float) -> _Call:
    ev = RequestReceived(stream_id, "svc", "CreateContainer", b"")
    ctx = CallContext("CreateContainer", stream_id, 2.0, in_s, time.monotonic() + in_s)
    return _Call(None, ev, ctx)  # type: ignore[arg-type]


@pytest.fixture
def watchdog():
    seen: list[int] = []
    done = threading.Condition()

    def on_expired(call: _Call) -> None:
        with done:
            seen.append(call.stream_id)
            done.notify_all()

    wd = _Watchdog(on_expired)
    yield wd, seen, done
    wd.stop()


def _wait_for(done: threading.Condition, seen: list[int], n: int) -> None:
    with done:
        assert done.wait_for(lambda: len(seen) >= n, timeout=10), seen


def test_an_earlier_deadline_is_not_held_behind_a_later_one(watchdog) -> None:
    wd, seen, done = watchdog
    late = _call(1, 30.0)  # never expires within the test
    wd.add(late)
    # the thread now waits towards the 30 s deadline (it sets _wake_at under
    # the lock it releases in wait(), so add() below finds it waiting)
    wait_until(lambda: wd._wake_at == late.ctx.deadline, what="the watchdog to wait for the 30 s deadline")
    wd.add(_call(3, 0.01))
    _wait_for(done, seen, 1)
    assert seen == [3]


def test_finished_calls_are_skipped_and_pending_ones_reported_in_deadline_order(watchdog) -> None:
    wd, seen, done = watchdog
    calls = [_call(1 + 2 * i, 0.02 + 0.01 * i) for i in range(6)]
    for c in calls:
        wd.add(c)
    for c in calls[::2]:
        assert c.claim(_DONE)
    _wait_for(done, seen, 3)
    # nothing else may come: a pending call due after all of them is reported
    # only once every earlier deadline has been handled (deadline order)
    wd.add(_call(99, 0.2))
    _wait_for(done, seen, 4)
    assert seen == [c.stream_id for c in calls[1::2]] + [99]


def test_workers_run_handlers_concurrently_and_refuse_work_after_shutdown() -> None:
    workers = _Workers(3, "t-handler")
    barrier = threading.Barrier(3, timeout=10)
    ran: list[int] = []
    done = threading.Event()

    def job(i: int) -> None:
        barrier.wait()  # only returns when all three run at the same time
        ran.append(i)
        if len(ran) == 3:
            done.set()

    try:
        for i in range(3):
            workers.submit(lambda i=i: job(i))
        assert done.wait(scaled(10))
        assert sorted(ran) == [0, 1, 2]
        def boom() -> None:
            raise ValueError("boom")

        for _ in range(3):  # a failing job does not cost its thread
            workers.submit(boom)
        ran.clear()
        done.clear()
        barrier.reset()
        for i in range(3):
            workers.submit(lambda i=i: job(i))
        assert done.wait(scaled(10))
    finally:
        workers.shutdown()
    with pytest.raises(RuntimeError):
        workers.submit(lambda: None)
