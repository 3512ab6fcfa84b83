"""The MPS role's keeper (``runcmd.keep_mps_role``, ADR 0009): a SIGTERM
that lands while the keeper is starting its child (after the previous check,
before the child is known to the handler) still reaches that child.

The child here is a real process (a sleeper standing in for the MPS role
process); ``subprocess.Popen`` is wrapped only to deliver the SIGTERM to the
keeper at that exact moment, which a real kubelet can do at any time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fracplugin import runcmd


def test_a_sigterm_while_the_child_starts_is_forwarded_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(argv, env=None):  # noqa: ANN001 - the keeper's call shape
        proc = real_popen([sys.executable, "-c", "import time; time.sleep(30)"])
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # the keeper's handler runs before Popen returns to it
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen_then_sigterm)
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        rc = runcmd.keep_mps_role()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(started) == 1
    assert started[0].returncode == -signal.SIGTERM  # stopped by the forwarded signal, not slept out
    assert rc == 0


@pytest.mark.parametrize("fails", [False, True])
def test_a_sigterm_quits_mps_on_purpose_before_it_is_forwarded(fails: bool, caplog: pytest.LogCaptureFixture) -> None:
    """``mps.keeper.keep``: the quit runs while the child still lives (the
    MPS role answers it), then the SIGTERM reaches the child; a quit that
    cannot be made is logged and the signal is still forwarded."""
    from fracplugin.mps.api import MpsError
    from fracplugin.mps.keeper import keep

    events: list[str] = []  # what reached the child, in order: "quit" (MPS asked), "kill <signal>"
    child_pid: list[int] = []
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        if child_pid and pid == child_pid[0]:
            events.append(f"kill {signal.Signals(sig).name}")
        real_kill(pid, sig)

    def quit_mps() -> None:
        events.append("quit")
        if fails:
            raise MpsError("MPS API /run/x/api.sock not reachable")

    argv = [sys.executable, "-c", "import os, sys, time; print(os.getpid(), flush=True); time.sleep(30)"]
    real_popen = subprocess.Popen

    def popen(a, env=None):  # noqa: ANN001 - the keeper's call shape
        proc = real_popen(a, env=env)
        child_pid.append(proc.pid)
        real_kill(os.getpid(), signal.SIGTERM)  # a container stop while the role runs
        return proc

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess, "Popen", popen)
    mp.setattr(os, "kill", kill)
    try:
        with caplog.at_level("INFO", logger="fracplugin.daemon"):
            rc = keep(quit_mps, argv)
    finally:
        mp.undo()
        for s, h in old.items():
            signal.signal(s, h)
    assert events == ["quit", "kill SIGTERM"] and rc == 0  # MPS asked while the child lives, then forwarded
    text = caplog.text
    assert "MPS is stopped on purpose" in text
    if fails:
        assert "could not quit MPS on purpose (MPS API /run/x/api.sock not reachable)" in text
    else:
        assert "MPS stopped on purpose: every MPS control daemon quit" in text
