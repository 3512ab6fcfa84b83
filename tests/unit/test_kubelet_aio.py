"""The kubelet door's event loop thread (``fracplugin.kubelet.aio``, ADR 0018):
blocking calls into the loop from the loop thread are refused instead of
deadlocking, deadlines cancel the coroutine, a stopped loop answers at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fracplugin.kubelet.aio import LoopStopped, LoopThread
from fracplugin.kubelet.podresources import PodResourcesClient, PodResourcesError


@pytest.fixture
def lt():
    t = LoopThread("test-loop", workers=2).start()
    yield t
    t.stop()


def test_call_runs_on_the_loop_thread_and_returns_its_result(lt):
    async def where() -> str:
        return threading.current_thread().name

    assert lt.call(where(), 5.0) == "test-loop"


def test_a_blocking_call_from_the_loop_thread_is_refused_not_deadlocked(lt):
    async def inner() -> int:
        return 1

    async def outer() -> str:
        try:
            lt.call(inner(), 5.0)  # would wait for itself forever
        except RuntimeError as e:
            return str(e)
        return "no error"

    msg = lt.call(outer(), 5.0)
    assert "would deadlock" in msg and "loop thread" in msg


def test_podresources_client_called_on_the_loop_thread_is_refused(lt, tmp_path):
    client = PodResourcesClient(str(tmp_path / "kubelet.sock"), timeout_s=0.5, loop=lt)

    async def from_loop() -> str:
        try:
            client.list()
        except RuntimeError as e:
            return type(e).__name__ + ": " + str(e)
        return "no error"

    assert "would deadlock" in lt.call(from_loop(), 5.0)
    with pytest.raises(PodResourcesError, match="UNAVAILABLE"):  # from another thread: a clean error
        client.list()
    client.close()


def test_a_deadline_cancels_the_coroutine(lt):
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
        lt.call(forever(), 0.2)
    assert cancelled.wait(5.0)


def test_run_blocking_uses_the_executor_not_the_loop_thread(lt):
    async def offload() -> str:
        return await lt.run_blocking(lambda: threading.current_thread().name)

    name = lt.call(offload(), 5.0)
    assert name.startswith("fracplugin-dp") and name != "test-loop"


def test_a_stopped_loop_answers_loop_stopped_at_once(lt):
    lt.stop()
    assert not lt.running()

    async def nothing() -> None:
        return None

    with pytest.raises(LoopStopped, match="not running"):
        lt.call(nothing(), 5.0)
    lt.start()  # a stopped loop thread can start again (the door's start after stop)
    assert lt.call(nothing(), 5.0) is None


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="executor workers 0 must be at least 1"):
        LoopThread("x", workers=0)
