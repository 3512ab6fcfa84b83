"""The daemon's signal handling: handlers take no lock, the main thread wakes.

A handler that took a lock (``threading.Event.set``) deadlocked the process
when it ran while the main thread held that lock: SIGTERM to the MPS role's
process group reaches the daemon twice (once from ``killpg``, once forwarded
by its keeper), and the second could land while the main thread was inside
``Event.wait``/``clear`` after the first (the flaky 30 s wait of
``test_mps_roles``). Now a handler appends to ``pending_signals`` and writes a
byte to a pipe that ``serve_forever`` reads.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path

from fracplugin.config import Config
from fracplugin.daemon import Daemon
from fracplugin.parts import PartBase
from tests.helpers import wait_until


class CountingReload:
    """A reload loader that counts its calls and, from the ``fail_after``-th
    on, raises ``exc`` (a loader or part failing in a way nobody planned for)."""

    def __init__(self, cfg: Config, exc: BaseException | None = None) -> None:
        self.cfg, self.exc, self.calls = cfg, exc, 0

    def __call__(self) -> tuple[Config, dict[str, str]]:
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return self.cfg, {}


def _with_handlers(test):
    def run() -> None:
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            test()
        finally:
            signal.set_wakeup_fd(-1)
            for s, h in old.items():
                signal.signal(s, h)
    run.__name__ = test.__name__
    return run


@_with_handlers
def test_signals_sent_back_to_back_all_reach_the_loop_and_a_stop_wins_over_queued_reloads() -> None:
    cfg = Config(no_nri=True, no_device_plugin=True, no_mps=True)
    loader = CountingReload(cfg)
    d = Daemon(cfg, reload=loader)
    d.install_signal_handlers()
    for sig in (signal.SIGHUP, signal.SIGHUP, signal.SIGTERM, signal.SIGTERM):
        os.kill(os.getpid(), sig)  # handlers run in this (main) thread before kill returns
    assert d.pending_signals == [signal.SIGHUP, signal.SIGHUP, signal.SIGTERM, signal.SIGTERM]
    assert d.serve_forever() == signal.SIGTERM  # the stop is not held behind the reloads queued with it
    assert loader.calls == 0
    assert d.pending_signals == [signal.SIGTERM]
    assert d.serve_forever() == signal.SIGTERM


@_with_handlers
def test_a_sighup_storm_is_one_reload_and_a_sigterm_after_it_still_stops() -> None:
    cfg = Config(no_nri=True, no_device_plugin=True, no_mps=True)
    loader = CountingReload(cfg)
    d = Daemon(cfg, reload=loader)
    d.install_signal_handlers()
    for _ in range(500):
        os.kill(os.getpid(), signal.SIGHUP)
    assert d.pending_signals.count(signal.SIGHUP) == 500
    done = threading.Event()

    def stop_after_the_reload() -> None:  # SIGTERM lands once the reload ran (or during it)
        while loader.calls == 0:
            done.wait(0.001)
        d.pending_signals.append(signal.SIGTERM)
        d.wakeup()

    t = threading.Thread(target=stop_after_the_reload)
    t.start()
    assert d.serve_forever() == signal.SIGTERM
    t.join()
    assert loader.calls == 1  # 500 queued SIGHUPs: one reload of the file as it is now
    assert d.pending_signals == []


@_with_handlers
def test_a_reload_that_fails_unexpectedly_is_reported_and_the_loop_goes_on() -> None:
    cfg = Config(no_nri=True, no_device_plugin=True, no_mps=True)
    d = Daemon(cfg, reload=CountingReload(cfg, OSError(5, "Input/output error")))
    res = d.reload()
    assert "OSError" in res["error"] and "Input/output error" in res["error"]
    assert d.cfg is cfg

    class Broken(PartBase):
        name = "broken"
        reads = reloads = frozenset({"fail_open"})

        def _apply(self, cfg: Config, keys) -> None:
            raise RuntimeError("cannot apply")

    class Good(PartBase):
        name = "good"
        reads = reloads = frozenset({"fail_open"})

    loader = CountingReload(dataclasses.replace(cfg, fail_open=True))
    d2 = Daemon(cfg, reload=loader)
    d2.parts["broken"] = Broken(cfg)
    d2.parts["good"] = Good(cfg)
    d2.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGHUP)

    def stop_after_the_reload() -> None:
        while loader.calls == 0:
            threading.Event().wait(0.001)
        d2.pending_signals.append(signal.SIGTERM)
        d2.wakeup()

    t = threading.Thread(target=stop_after_the_reload)
    t.start()
    assert d2.serve_forever() == signal.SIGTERM  # the failing part did not end the loop
    t.join()
    assert d2.parts["broken"].cfg.fail_open is False  # a failed part keeps its configuration
    assert d2.parts["good"].cfg.fail_open is True  # the others still reload
    res = d2.reload()  # nothing changed for the good part since; the broken one fails again
    assert res["parts"] == {"broken": {"error": "RuntimeError: cannot apply"}}


_SYS_READ = {"x86_64": 0, "aarch64": 63}.get(os.uname().machine, 0)


@_with_handlers
def test_a_stop_signal_delivered_to_another_thread_wakes_the_loop() -> None:
    """The kernel may hand a process signal to any thread (here: forced with
    pthread_kill); the main thread blocked in serve_forever must still wake
    (the CI hang: SIGTERM never logged, the daemon killed after 30 s)."""
    cfg = Config(no_nri=True, no_device_plugin=True, no_mps=True)
    d = Daemon(cfg, reload=CountingReload(cfg))
    d.install_signal_handlers()
    returned = threading.Event()
    rescued: list[bool] = []

    main_tid = threading.get_native_id()

    def blocked_in_read() -> bool:  # /proc/<tid>/syscall: the number of the syscall the thread sleeps in
        return Path(f"/proc/self/task/{main_tid}/syscall").read_text().split()[0] == str(_SYS_READ)

    def signal_this_thread() -> None:
        wait_until(blocked_in_read, what="the main thread to block in serve_forever's read")
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        if not returned.wait(10):  # the loop never woke: end it another way so the test reports
            rescued.append(True)
            d.pending_signals.append(signal.SIGINT)
            d.wakeup()

    t = threading.Thread(target=signal_this_thread)
    t.start()
    got = d.serve_forever()
    returned.set()
    t.join()
    assert (got, rescued) == (signal.SIGTERM, [])
