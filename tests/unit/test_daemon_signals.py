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

import os
import signal
import threading

from fracplugin.config import Config
from fracplugin.daemon import Daemon


def test_signals_sent_back_to_back_are_all_handled_in_order() -> None:
    d = Daemon(Config(no_nri=True, no_device_plugin=True, no_mps=True))
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        d.install_signal_handlers()
        for sig in (signal.SIGHUP, signal.SIGHUP, signal.SIGTERM, signal.SIGTERM):
            os.kill(os.getpid(), sig)  # handlers run in this (main) thread before kill returns
        assert d.pending_signals == [signal.SIGHUP, signal.SIGHUP, signal.SIGTERM, signal.SIGTERM]
        assert d.serve_forever() == signal.SIGTERM  # two reloads (not configured: refused), then stop
        assert d.pending_signals == [signal.SIGTERM]
        assert d.serve_forever() == signal.SIGTERM
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_wakeups_from_a_handler_and_another_thread_are_both_seen() -> None:
    """A handler called directly and a wake-up from another thread (the NRI
    fd watcher's path) each queue their signal; the loop returns them in order."""
    d = Daemon(Config(no_nri=True, no_device_plugin=True, no_mps=True))
    old = signal.getsignal(signal.SIGTERM)
    try:
        d.install_signal_handlers()
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        done = threading.Event()

        def from_another_thread() -> None:  # the NRI fd watcher wakes the loop the same way
            d.pending_signals.append(signal.SIGINT)
            d.wakeup()
            done.set()

        handler(signal.SIGTERM, None)
        t = threading.Thread(target=from_another_thread)
        t.start()
        t.join()
        assert done.is_set()
        assert d.serve_forever() == signal.SIGTERM
        assert d.serve_forever() == signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, old)
