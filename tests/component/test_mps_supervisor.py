"""MpsSupervisor against the fake nvidia-cuda-mps-control, run as a real subprocess.

Every test ends by asserting that no process it caused is left: no child of
the test process and no process anywhere whose environment points into the
test's MPS root (daemons and fake servers carry CUDA_MPS_PIPE_DIRECTORY).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil
import pytest

from tests.helpers import wait_for, wait_until

from fracplugin.metrics import Metrics
from fracplugin.model import ComputeMode
from fracplugin.mps.api import MpsApi, MpsError, MpsTimeout, NullMps
from fracplugin.mps.layout import SM_SERVER, MpsLayout, namespace_name
from fracplugin.mps.supervisor import MpsSupervisor
from tests.fakes.mps_client import fake_control_binary

# the compiled client in front of the Python fake (gcc): a control command starts in ~1 ms, where a
# Python start takes seconds on a loaded machine, longer than the command budgets these tests give
FAKE = str(fake_control_binary())
TS, SM = ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING
# The fake's "#!/usr/bin/env python3" resolves to this interpreter, not to a
# (slow) version-manager shim that may come first on PATH.
FAST_PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
CID_A = "a" * 12 + "0123456789abcdef" * 3 + "0123"
CID_B = "b" * 64
POD_A = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
POD_B = "11111111-2222-3333-4444-555555555555"


class Harness:
    def __init__(self, root: str) -> None:
        self.root = root
        self.layout = MpsLayout(os.path.join(root, "mps"))
        self.proc_root = os.path.join(root, "proc")
        os.makedirs(self.proc_root)
        self.sups: list[MpsSupervisor] = []
        self.procs: list[subprocess.Popen] = []
        self.events: list[tuple[ComputeMode, bool]] = []

    def supervisor(self, modes=(TS, SM), driver="615.71.09", protocol=None, **kw) -> MpsSupervisor:
        kw.setdefault("probe_interval_s", 0.5)
        kw.setdefault("probe_timeout_s", 2.0)
        kw.setdefault("backoff_base_s", 0.05)
        kw["env"] = {"PATH": FAST_PATH, **(kw.get("env") or {})}
        sup = MpsSupervisor(self.layout, FAKE, protocol, driver, set(modes), **kw)
        sup.subscribe(lambda m, h: self.events.append((m, h)))
        self.sups.append(sup)
        sup.start()
        return sup

    def env(self, mode):
        e = dict(os.environ)
        e.pop("CUDA_MPS_PROTOCOL_VERSION", None)
        e["PATH"] = FAST_PATH
        e["CUDA_MPS_PIPE_DIRECTORY"] = self.layout.pipe_dir(mode)
        return e

    def ctl(self, mode, *args, stdin=None, check=True) -> str:
        p = subprocess.run([FAKE, *args], input=stdin or "", capture_output=True, text=True,
                           env=self.env(mode), timeout=20)
        if check:
            assert p.returncode == 0, p.stderr
        return p.stdout

    def state(self, mode) -> dict:
        return json.loads(self.ctl(mode, "fake-state"))

    def faults(self, mode, **f) -> None:
        path = os.path.join(self.layout.pipe_dir(mode), "fake-control.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(f, fh)
        os.replace(path + ".tmp", path)

    def client(self, container_id: str, pod_uid: str, mode=SM, namespace="default") -> int:
        """A real sleeping process registered as an MPS client, whose cgroup (in the
        injected proc root) puts it in ``container_id`` of pod ``pod_uid``."""
        p = subprocess.Popen(["sleep", "60"])
        self.procs.append(p)
        d = os.path.join(self.proc_root, str(p.pid))
        os.makedirs(d)
        slice_ = f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"
        with open(os.path.join(d, "cgroup"), "w") as f:
            f.write(f"0::/kubepods.slice/kubepods-burstable.slice/{slice_}/cri-containerd-{container_id}.scope\n")
        args = ["fake-client", "add", str(p.pid), f"--namespace={namespace}"]
        if mode is SM:
            args.append(f"--server={SM_SERVER}")
        self.ctl(mode, *args)
        return p.pid

    def alive(self, pid: int) -> bool:
        for p in self.procs:
            if p.pid == pid:
                return p.poll() is None
        return psutil.pid_exists(pid)

    def close(self) -> None:
        for sup in self.sups:
            sup.stop(timeout_s=1.5)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def leftovers(root: str, before: set[int]) -> list[str]:
    """Our children not in ``before`` (PIDs there when the test began), and any
    process whose MPS pipe directory is under ``root``, now."""
    found = [f"child {c.pid} {_safe(c.cmdline)}" for c in psutil.Process().children(recursive=True)
             if c.pid not in before]
    for p in psutil.process_iter():
        env = _safe(p.environ) or {}
        if env.get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(root):
            found.append(f"orphan {p.pid} {_safe(p.cmdline)}")
    return found


def _safe(fn):
    try:
        return fn()
    except (psutil.Error, OSError):
        return None


@pytest.fixture
def mps():
    root = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    os.chmod(root, 0o755)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    h = Harness(root)
    try:
        yield h
    finally:
        h.close()
        try:
            wait_until(lambda: not leftovers(root, before), 5,
                       lambda: f"no process left behind: {leftovers(root, before)}")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def daemon(sup: MpsSupervisor, mode: ComputeMode) -> dict:
    return next(d for d in sup.status()["daemons"] if d["mode"] == mode.value)


# ---------------------------------------------------------------------------- start / stop


def test_v3_daemons_start_ready_with_expected_flags_and_stop_cleanly(mps):
    sup = mps.supervisor()
    assert sup.protocol == 3
    wait_until(sup.ready, 15)
    assert isinstance(sup, MpsApi)
    for mode in (TS, SM):
        assert os.path.exists(os.path.join(mps.layout.pipe_dir(mode), "control"))
        st = mps.state(mode)
        assert st["protocol"] == 3
        assert st["pid"] == daemon(sup, mode)["pid"]
    assert mps.state(SM)["multiuser"] is True and mps.state(SM)["servers"] == ["shared"]
    # both daemons: multiuser, one named server whose namespaces are the tenants' leaf pipe directories
    assert mps.state(TS)["multiuser"] is True and mps.state(TS)["servers"] == ["shared"]
    cfg = open(os.path.join(mps.layout.log_dir(SM), "mps-control.toml")).read()
    assert "[servers.shared]" in cfg and "[features.memacct]" in cfg
    # every ancestor from the root to the pipe dirs is traversable by other users
    for mode in (TS, SM):
        path = mps.layout.pipe_dir(mode)
        while len(path) >= len(mps.layout.root):
            assert os.stat(path).st_mode & 0o005 == 0o005, path
            path = os.path.dirname(path)
    pids = [daemon(sup, m)["pid"] for m in (TS, SM)]
    status = sup.status()
    assert status["ready"] and status["protocol"] == 3
    assert {d["state"] for d in status["daemons"]} == {"ready"}
    assert (SM, True) in mps.events and (TS, True) in mps.events
    sup.stop(timeout_s=5)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    for mode in (TS, SM):
        assert not os.path.exists(os.path.join(mps.layout.pipe_dir(mode), "control"))
    assert not sup.ready()


def test_stale_control_socket_is_removed_before_start(mps):
    pipe = mps.layout.pipe_dir(TS)
    os.makedirs(pipe)
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(pipe, "control"))
    s.close()  # a socket file nobody listens on: what a killed daemon leaves
    sup = mps.supervisor(modes=(TS,))
    wait_until(sup.ready, 15)
    assert daemon(sup, TS)["restarts"] == 0


# ---------------------------------------------------------------------------- failures


def test_crash_is_restarted_and_healthy_again(mps):
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    old = daemon(sup, SM)["pid"]
    mps.faults(SM, crash=True, pid=old)
    wait_for(lambda: daemon(sup, SM)["pid"] not in (None, old) and sup.healthy(SM), what="restart")
    d = daemon(sup, SM)
    assert d["restarts"] == 1 and d["restart_budget_used"] == 1 and d["wedges"] == 0
    # normally "daemon exited with status 3"; a probe racing the crash may see it first
    assert "exited" in d["last_error"] or "Cannot find MPS control daemon" in d["last_error"]
    assert mps.events.count((SM, False)) >= 1 and mps.events[-1] == (SM, True)
    text = Metrics(mps=sup).render().decode()
    assert 'fracplugin_mps_daemon_up{mode="sm-sharing"} 1.0' in text
    assert 'fracplugin_mps_daemon_restarts_total{mode="sm-sharing"} 1.0' in text
    assert 'fracplugin_mps_daemon_wedges_total{mode="sm-sharing"} 0.0' in text


def test_hung_daemon_is_caught_by_the_probe_and_restarted(mps):
    sup = mps.supervisor(modes=(TS,), probe_timeout_s=0.5)
    wait_until(sup.ready, 15)
    old = daemon(sup, TS)["pid"]
    mps.faults(TS, hang=True, pid=old)
    # the process stays alive while hung: only the active probe can notice
    wait_for(lambda: daemon(sup, TS)["pid"] not in (None, old) and sup.healthy(TS), what="restart")
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
    d = daemon(sup, TS)
    # >= 1: on a starved host the new daemon's first probes may time out too (0.5 s) and cost a second
    # restart; what this test pins is that the hang was caught by the probe
    assert d["restarts"] >= 1 and "probe failed" in d["last_error"]
    assert (TS, False) in mps.events


def test_a_late_answer_alone_does_not_report_a_live_daemon_down(mps):
    # every probe answer takes 0.8 s, longer than the 0.5 s probe timeout: a live daemon on a starved
    # host. The timed-out probe doubles the next one's timeout (1 s), which gets the answer; one late
    # answer is no verdict (threshold 2), so health never drops and nothing is restarted.
    sup = mps.supervisor(modes=(TS,), probe_interval_s=0.2, probe_timeout_s=0.5)
    wait_until(sup.ready, 15)
    pid = daemon(sup, TS)["pid"]
    mps.events.clear()
    mps.faults(TS, slow={"server list": 0.8})
    wait_for(lambda: "timed out" in daemon(sup, TS)["last_error"], what="a timed-out probe")
    assert sup.healthy(TS), daemon(sup, TS)
    wait_for(lambda: daemon(sup, TS)["last_probe_ok"] and daemon(sup, TS)["last_probe_s"] >= 0.8,
             what="the next probe, with a longer timeout, answered")
    assert (TS, False) not in mps.events
    assert daemon(sup, TS)["pid"] == pid and daemon(sup, TS)["restarts"] == 0


def test_a_refused_probe_reports_the_daemon_down_at_once(mps):
    # refused (the daemon answers an error): no waiting for a threshold (set high here: no restart)
    sup = mps.supervisor(modes=(TS,), probe_interval_s=0.2, probe_failure_threshold=100)
    wait_until(sup.ready, 15)
    mps.faults(TS, refuse=["server list"])
    wait_for(lambda: not sup.healthy(TS), what="unhealthy after a refused probe")
    d = daemon(sup, TS)
    assert d["restarts"] == 0 and d["state"] == "unhealthy" and "timed out" not in d["last_error"], d
    mps.faults(TS)
    wait_for(lambda: sup.healthy(TS), what="healthy once probes answer again")


def test_on_a_cpu_starved_host_timeouts_count_only_at_the_longest_probe_timeout(mps):
    # PSI says runnable tasks waited for a CPU 99 % of the last 10 s: timed-out probes are not counted
    # while their timeout can still double (0.2, 0.4, 0.8 s), only at the cap (1.6 s); a hung daemon is
    # still restarted then (threshold 1 here)
    os.makedirs(os.path.join(mps.proc_root, "pressure"))
    with open(os.path.join(mps.proc_root, "pressure", "cpu"), "w") as f:
        f.write("some avg10=99.00 avg60=98.00 avg300=97.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    sup = mps.supervisor(modes=(TS,), proc_root=mps.proc_root, probe_interval_s=0.2, probe_timeout_s=0.2,
                         probe_failure_threshold=1, max_restarts=0)
    wait_until(sup.ready, 15)
    old = daemon(sup, TS)["pid"]
    mps.events.clear()
    mps.faults(TS, hang=True, pid=old)
    seen = wait_for(lambda: d if "not counted" in (d := daemon(sup, TS))["last_error"] else None,
                    what="a timed-out probe excused by CPU pressure")
    assert "CPU-starved" in seen["last_error"] and seen["restarts"] == 0
    assert seen["healthy"] and seen["state"] == "ready", seen  # not counted: health unchanged
    wait_for(lambda: daemon(sup, TS)["restarts"] >= 1, what="the hang confirmed at the longest timeout")
    assert (TS, False) in mps.events
    mps.faults(TS)
    wait_for(lambda: daemon(sup, TS)["pid"] not in (None, old) and sup.healthy(TS), what="a healthy new daemon")


def test_slow_answers_within_the_timeout_keep_the_daemon_healthy(mps):
    sup = mps.supervisor(modes=(SM,), probe_timeout_s=3.0)
    wait_until(sup.ready, 15)
    pid = daemon(sup, SM)["pid"]
    mps.faults(SM, slow_s=0.3)
    # a probe that went through the slowed daemon (it cannot answer in under 0.3 s)
    wait_for(lambda: daemon(sup, SM)["last_probe_s"] >= 0.3 and daemon(sup, SM)["last_probe_ok"], what="a slow probe")
    path = sup.ensure_namespace(POD_A, "app", 50, timeout_s=10)
    assert os.path.isdir(path)
    assert sup.healthy(SM) and daemon(sup, SM)["pid"] == pid and daemon(sup, SM)["restarts"] == 0


def test_a_timed_out_create_is_kept_and_finished_by_the_probe_thread(mps):
    """ADR 0034: a ``namespace create`` answered after the ensure's budget is still carried out by the
    daemon. The ensure raises, but the record stays ("repairing") and the probe thread lists what the
    daemon did and caps it as planned; the namespace is never one that no tenant owns."""
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    mps.faults(SM, slow={"namespace create": 1.0})
    with pytest.raises(MpsTimeout):
        sup.ensure_namespace(POD_A, "app", 50, timeout_s=0.3, pinned_limit_mib=4096)
    name = namespace_name(POD_A, "app")
    assert [n["name"] for n in daemon(sup, SM)["namespaces"]] == [name]  # the record is kept
    assert daemon(sup, SM)["repairing"] == [name]
    key = f"{SM_SERVER}/{name}"
    seen_orphans = []

    def finished() -> bool:
        d = daemon(sup, SM)
        seen_orphans.extend(d["orphans"])
        ns = mps.state(SM)["namespaces"].get(key, {})
        return d["repairing"] == [] and (ns.get("active_thread_percentage"), ns.get("pinned_memory_limit")) == (
            50, "4096M")

    wait_for(finished, what="the timed-out namespace finished with its caps")
    assert seen_orphans == []
    # on a starved host a probe may time out meanwhile (health then recovers on its own): wait for it
    wait_for(lambda: sup.healthy(SM), what="the daemon healthy")


def test_a_namespace_no_tenant_owns_is_counted_and_deleted_when_uncapped(mps):
    """ADR 0034: after each answered probe the daemon's namespaces are listed; those no record owns are
    orphans (status, metric). An uncapped one is deleted (not while a client is attached: then it is
    counted until it can be); a capped one is counted and left to the doors' reconcile."""
    sup = mps.supervisor(modes=(SM,), proc_root=mps.proc_root)
    wait_until(sup.ready, 15)
    for n in ("stray", "attached", "capped"):
        mps.ctl(SM, "namespace", "create", n, f"--server={SM_SERVER}")
    mps.ctl(SM, "namespace", "set", "capped", f"--server={SM_SERVER}", "--active-thread-percentage=20")
    pid = mps.client(CID_A, POD_A, namespace="attached")
    wait_for(lambda: daemon(sup, SM)["orphans"] == [{"name": "attached", "capped": False},
                                                    {"name": "capped", "capped": True}], what="orphans counted")
    assert set(mps.state(SM)["namespaces"]) == {f"{SM_SERVER}/attached", f"{SM_SERVER}/capped"}
    mps.ctl(SM, "fake-client", "remove", str(pid))
    wait_for(lambda: daemon(sup, SM)["orphans"] == [{"name": "capped", "capped": True}], what="uncapped one deleted")
    assert set(mps.state(SM)["namespaces"]) == {f"{SM_SERVER}/capped"}


def test_refused_command_raises_and_daemon_stays_healthy(mps):
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    mps.faults(SM, refuse=["namespace create"])
    with pytest.raises(MpsError, match="refused"):
        sup.ensure_namespace(POD_A, "app", 25, timeout_s=5)
    assert daemon(sup, SM)["namespaces"] == []
    assert sup.healthy(SM) and daemon(sup, SM)["restarts"] == 0


def test_refused_cap_leaves_no_uncapped_namespace(mps):
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    mps.faults(SM, refuse=["namespace set"])
    with pytest.raises(MpsError):
        sup.ensure_namespace(POD_A, "app", 25, timeout_s=5)
    assert mps.state(SM)["namespaces"] == {}


def test_retry_budget_is_exhausted_then_daemon_is_failed(mps):
    sup = mps.supervisor(modes=(TS,), max_restarts=2, env={"FAKE_MPS_FAULTS": json.dumps({"fail_start": True})})
    wait_for(lambda: daemon(sup, TS)["state"] == "failed", what="failed state")
    d = daemon(sup, TS)
    assert d["restart_budget_used"] == 3 and d["restarts"] == 2 and d["pid"] is None
    assert not sup.healthy(TS) and not sup.ready()


def test_budget_resets_after_stable_uptime(mps):
    now = [1000.0]
    lock = threading.Lock()

    def clock():
        with lock:
            return now[0]

    sup = mps.supervisor(modes=(TS,), clock=clock, stable_uptime_s=60, probe_interval_s=1e9)
    wait_until(sup.ready, 15)
    old = daemon(sup, TS)["pid"]
    mps.faults(TS, crash=True, pid=old)
    wait_for(lambda: daemon(sup, TS)["pid"] not in (None, old) and sup.healthy(TS), what="restart")
    assert daemon(sup, TS)["restart_budget_used"] == 1
    with lock:
        now[0] += 61
    wait_for(lambda: daemon(sup, TS)["restart_budget_used"] == 0, what="budget reset")
    assert daemon(sup, TS)["restarts"] == 1


# ---------------------------------------------------------------------------- namespaces


def test_namespace_created_capped_idempotent_and_restored_after_restart(mps):
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    name = namespace_name(POD_A, "app")
    path = sup.ensure_namespace(POD_A, "app", 30, timeout_s=5)
    assert path == mps.layout.namespace_pipe_dir(name)
    assert os.path.exists(os.path.join(path, "control"))
    key = f"{SM_SERVER}/{name}"
    assert mps.state(SM)["namespaces"][key]["active_thread_percentage"] == 30
    assert sup.ensure_namespace(POD_A, "app", 30, timeout_s=5) == path  # idempotent
    sup.ensure_namespace(POD_A, "app", 40, timeout_s=5)  # re-cap while no client is attached
    assert mps.state(SM)["namespaces"][key]["active_thread_percentage"] == 40
    sup.ensure_namespace(POD_B, "other", None, timeout_s=5)
    old = daemon(sup, SM)["pid"]
    mps.faults(SM, crash=True, pid=old)
    wait_for(lambda: daemon(sup, SM)["pid"] not in (None, old) and sup.healthy(SM), what="restart")
    st = mps.state(SM)
    assert st["pid"] != old
    assert st["namespaces"][key]["active_thread_percentage"] == 40
    assert f"{SM_SERVER}/{namespace_name(POD_B, 'other')}" in st["namespaces"]
    assert os.path.exists(os.path.join(path, "control"))
    assert {n["name"] for n in daemon(sup, SM)["namespaces"]} == {name, namespace_name(POD_B, "other")}


def test_recap_refused_while_a_client_is_attached(mps):
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    sup.ensure_namespace(POD_A, "app", 30, timeout_s=5)
    mps.client(CID_A, POD_A, namespace=namespace_name(POD_A, "app"))
    with pytest.raises(MpsError, match="clients attached"):
        sup.ensure_namespace(POD_A, "app", 60, timeout_s=5)
    assert sup.ensure_namespace(POD_A, "app", 30, timeout_s=5)  # same cap: fine


def test_ensure_of_a_namespace_applied_on_this_daemon_asks_mps_nothing(mps):
    # issue 14: every new container of the same pod and name (restarts, the
    # runtime's retries, bench_nri) used to cost a `namespace list` per ensure.
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    key = f"{SM_SERVER}/{namespace_name(POD_A, 'app')}"
    path = sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, pinned_limit_mib=2048)
    mps.faults(SM, refuse=["namespace"])  # from now on MPS refuses every namespace command
    assert sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, pinned_limit_mib=2048) == path  # none sent
    with pytest.raises(MpsError, match="refused"):  # other caps: asked (and refused)
        sup.ensure_namespace(POD_A, "app", 40, timeout_s=5, pinned_limit_mib=2048)
    with pytest.raises(MpsError, match="refused"):  # after a failed apply the state is unknown: asked again
        sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, pinned_limit_mib=2048)
    mps.faults(SM)
    assert sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, pinned_limit_mib=2048) == path
    # A restarted daemon re-applies the recorded namespace before it is healthy;
    # that apply counts: the next ensure asks nothing.
    old = daemon(sup, SM)["pid"]
    mps.faults(SM, crash=True, pid=old)
    wait_for(lambda: daemon(sup, SM)["pid"] not in (None, old) and sup.healthy(SM), what="restart")
    assert mps.state(SM)["namespaces"][key]["active_thread_percentage"] == 30
    mps.faults(SM, refuse=["namespace"])
    assert sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, pinned_limit_mib=2048) == path
    # A release of a namespace the daemon holds deletes it without listing
    # first; it is forgotten: the next ensure creates the namespace again.
    mps.faults(SM, refuse=["namespace list"])
    assert sup.release_namespace(POD_A, "app") is True
    mps.faults(SM)
    assert key not in mps.state(SM)["namespaces"]
    assert sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, pinned_limit_mib=2048) == path
    assert mps.state(SM)["namespaces"][key]["active_thread_percentage"] == 30


def test_release_deletes_namespace_or_retries_until_clients_leave(mps):
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    sup.ensure_namespace(POD_A, "app", 30, timeout_s=5)
    sup.ensure_namespace(POD_B, "b", 30, timeout_s=5)
    assert sup.release_namespace(POD_B, "b") is True
    key_a = f"{SM_SERVER}/{namespace_name(POD_A, 'app')}"
    assert list(mps.state(SM)["namespaces"]) == [key_a]
    pid = mps.client(CID_A, POD_A, namespace=namespace_name(POD_A, "app"))
    assert sup.release_namespace(POD_A, "app") is False  # MPS refuses while attached
    assert key_a in mps.state(SM)["namespaces"]
    assert daemon(sup, SM)["namespaces"] == []
    mps.ctl(SM, "fake-client", "remove", str(pid))
    wait_for(lambda: mps.state(SM)["namespaces"] == {}, what="deferred delete")


def test_namespaces_need_v3_and_an_sm_daemon(mps):
    sup = mps.supervisor(modes=(TS,))
    wait_until(sup.ready, 15)
    with pytest.raises(MpsError, match="sm-sharing"):
        sup.ensure_namespace(POD_A, "app", 30, timeout_s=2)
    with pytest.raises(ValueError):
        sup.ensure_namespace(POD_A, "app", 0, timeout_s=2)


# ---------------------------------------------------------------------------- drain


def test_drain_terminates_only_the_containers_clients(mps):
    sup = mps.supervisor(modes=(TS, SM), proc_root=mps.proc_root)
    wait_until(sup.ready, 15)
    ns = namespace_name(POD_A, "app")
    sup.ensure_namespace(POD_A, "app", 30, timeout_s=5)
    a1 = mps.client(CID_A, POD_A, namespace=ns)
    a2 = mps.client(CID_A, POD_A, mode=TS)
    b1 = mps.client(CID_B, POD_B, mode=TS)
    res = sup.drain(CID_A[:12], timeout_s=10)
    assert sorted(res.clients) == sorted([a1, a2]) and sorted(res.terminated) == sorted([a1, a2])
    assert res.ok and not res.wedged and not res.skipped and res.errors == ()
    assert not mps.alive(a1) and not mps.alive(a2) and mps.alive(b1)
    assert sup.healthy(SM) and sup.healthy(TS)
    assert all(daemon(sup, m)["wedges"] == 0 for m in (TS, SM))
    again = sup.drain(CID_A, timeout_s=5)
    assert again.clients == () and again.ok


def test_slow_drain_makes_the_daemon_unhealthy_but_restarts_nothing(mps):
    # issue 12: a 1.2 s answer used to SIGKILL the daemon (every client's work lost).
    sup = mps.supervisor(modes=(SM,), proc_root=mps.proc_root)
    wait_until(sup.ready, 15)
    sup.ensure_namespace(POD_A, "app", 30, timeout_s=5)
    mps.client(CID_A, POD_A, namespace=namespace_name(POD_A, "app"))
    old = daemon(sup, SM)["pid"]
    mps.faults(SM, slow={"client terminate": 30.0})
    res = sup.drain(CID_A, timeout_s=1.0)
    assert res.wedged and res.restarted == () and res.terminated == ()
    assert res.elapsed_s < 1.0 + 3.0  # bounded by the budget (plus process start slack)
    d = daemon(sup, SM)
    # marked slow; "slow" itself may already be cleared by the probe the drain asked for (an idle machine
    # answers it before this line runs), the reason stays in last_error
    assert d["wedges"] == 1 and d["last_error"].startswith("drain: terminate"), d
    # the immediate probe answers (only terminate is slow): healthy again, same daemon
    wait_for(lambda: sup.healthy(SM) and daemon(sup, SM)["slow"] == "", what="healthy after the probe")
    d = daemon(sup, SM)
    assert d["pid"] == old and d["restarts"] == 0
    assert f"{SM_SERVER}/{namespace_name(POD_A, 'app')}" in mps.state(SM)["namespaces"]


def test_one_slow_daemon_does_not_touch_the_other(mps):
    # issue 12: the ts daemon answering in 1.2 s made the healthy sm daemon be killed too.
    sup = mps.supervisor(modes=(TS, SM), proc_root=mps.proc_root)
    wait_until(sup.ready, 15)
    pids = {m: daemon(sup, m)["pid"] for m in (TS, SM)}
    mps.client(CID_A, POD_A, mode=TS)
    mps.faults(TS, slow_s=1.2)
    res = sup.drain(CID_A, timeout_s=1.0, modes=(TS,))
    assert res.wedged and res.restarted == ()
    assert sup.healthy(SM) and daemon(sup, SM)["wedges"] == 0  # never asked: not the container's mode
    mps.faults(TS)  # the slowness passes
    wait_for(lambda: sup.healthy(TS), what="ts healthy again")
    assert {m: daemon(sup, m)["pid"] for m in (TS, SM)} == pids
    assert daemon(sup, TS)["restarts"] == 0 and daemon(sup, SM)["restarts"] == 0


def test_drain_of_a_hung_daemon_restarts_it_only_after_the_probe_confirms(mps):
    sup = mps.supervisor(modes=(TS,), proc_root=mps.proc_root, probe_interval_s=1e9, probe_timeout_s=0.5)
    wait_until(sup.ready, 15)
    old = daemon(sup, TS)["pid"]
    mps.client(CID_A, POD_A, mode=TS)
    mps.faults(TS, hang=True)
    res = sup.drain(CID_A, timeout_s=0.5)
    assert res.wedged and res.restarted == ()
    assert daemon(sup, TS)["wedges"] == 1
    # probes (threshold 2) confirm the hang: hard restart, a new daemon
    wait_for(lambda: daemon(sup, TS)["restarts"] >= 1, what="restart")
    mps.faults(TS)  # the fault file is in the pipe directory: clear it for the new daemon
    wait_for(lambda: daemon(sup, TS)["pid"] not in (None, old) and sup.healthy(TS), what="healthy new daemon")


def test_drain_without_running_daemons_is_skipped(mps):
    sup = mps.supervisor(modes=(TS,), env={"FAKE_MPS_FAULTS": json.dumps({"fail_start": True})}, max_restarts=1)
    wait_for(lambda: daemon(sup, TS)["state"] == "failed", what="failed")
    res = sup.drain(CID_A, timeout_s=1)
    assert res.skipped and res.clients == ()


# ---------------------------------------------------------------------------- v2


def test_v2_daemon_probe_and_drain(mps):
    sup = mps.supervisor(modes=(TS, SM), driver="550.54.15", proc_root=mps.proc_root)
    assert sup.protocol == 2
    wait_until(sup.ready, 15)
    assert mps.state(SM)["protocol"] == 2
    with pytest.raises(MpsError, match="v3"):
        sup.ensure_namespace(POD_A, "app", 30, timeout_s=2)
    a = mps.client(CID_A, POD_A, mode=TS)
    b = mps.client(CID_B, POD_B, mode=TS)
    res = sup.drain(CID_A, timeout_s=10)
    assert res.clients == (a,) and res.terminated == (a,) and res.ok
    assert not mps.alive(a) and mps.alive(b)
    old = daemon(sup, TS)["pid"]
    mps.faults(TS, hang=True, pid=old)
    wait_for(lambda: daemon(sup, TS)["pid"] not in (None, old) and sup.healthy(TS), what="restart")


def test_protocol_override_beats_driver_version(mps):
    sup = mps.supervisor(modes=(TS,), driver="615.71.09", protocol=2)
    wait_until(sup.ready, 15)
    assert mps.state(TS)["protocol"] == 2


# ---------------------------------------------------------------------------- stop


def _server_copy(root: str) -> str:
    path = os.path.join(root, "bin", "nvidia-cuda-mps-server")
    os.makedirs(os.path.dirname(path))
    shutil.copy(shutil.which("sleep"), path)
    return path


def _servers(path: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/exe") == path:
                    out.append(int(name))
            except OSError:
                pass
    return out


def test_stop_kills_daemons_that_ignore_quit_and_leftover_servers(mps):
    srv = _server_copy(mps.root)
    sup = mps.supervisor(modes=(TS, SM), env={"FAKE_MPS_SERVER_BIN": srv}, probe_interval_s=1e9)
    wait_until(sup.ready, 15)
    wait_for(lambda: len(_servers(srv)) == 2, what="two fake servers")
    old = daemon(sup, SM)["pid"]
    mps.faults(SM, crash=True, pid=old)  # its server outlives it
    wait_for(lambda: daemon(sup, SM)["pid"] not in (None, old) and sup.healthy(SM), what="restart")
    assert len(_servers(srv)) >= 2
    mps.faults(TS, hang=True)  # ignores quit on stdin: SIGKILL path
    sup.stop(timeout_s=1.0)
    assert _servers(srv) == []
    assert daemon(sup, TS)["pid"] is None and daemon(sup, SM)["pid"] is None


def test_stop_spares_mps_servers_of_other_stacks(mps):
    srv = _server_copy(mps.root)
    foreign = subprocess.Popen([srv, "60"], env={"CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps/other/pipe"})
    try:
        sup = mps.supervisor(modes=(TS,), env={"FAKE_MPS_SERVER_BIN": srv}, probe_interval_s=1e9)
        wait_until(sup.ready, 15)
        wait_for(lambda: len(_servers(srv)) == 2, what="our fake server next to the foreign one")
        sup.stop(timeout_s=2.0)
        assert _servers(srv) == [foreign.pid]  # ours killed, the other stack's kept
        assert foreign.poll() is None
    finally:
        foreign.kill()
        foreign.wait()


def test_stop_before_ready_and_double_stop(mps):
    sup = mps.supervisor(modes=(TS,))
    sup.stop(timeout_s=2)
    sup.stop(timeout_s=2)
    assert not sup.ready()


# ---------------------------------------------------------------------------- null


def test_null_mps_is_a_noop_mps_api():
    null = NullMps(MpsLayout("/run/x"))
    assert isinstance(null, MpsApi)
    assert null.ensure_namespace(POD_A, "app", 10, 1.0) == MpsLayout("/run/x").namespace_pipe_dir(namespace_name(POD_A, "app"))
    r = null.drain(CID_A, 1.0)
    assert r.skipped and r.ok and r.clients == ()
    assert null.ready() and null.healthy(SM) and null.status()["enabled"] is False


def test_daemon_that_never_answers_is_killed_after_the_start_timeout(mps):
    sup = mps.supervisor(modes=(TS,), probe_timeout_s=0.3, start_timeout_s=0.5, max_restarts=1,
                         env={"FAKE_MPS_FAULTS": json.dumps({"hang": True})})
    wait_for(lambda: daemon(sup, TS)["state"] == "failed", what="failed state")
    d = daemon(sup, TS)
    assert "not ready within" in d["last_error"] and d["restarts"] == 1 and d["pid"] is None
    assert (TS, True) not in mps.events


def test_a_failing_health_callback_does_not_stop_supervision(mps):
    def boom(mode, healthy):
        raise RuntimeError("subscriber bug")

    sup = mps.supervisor(modes=(TS,))
    sup.subscribe(boom)
    wait_until(sup.ready, 15)
    old = daemon(sup, TS)["pid"]
    mps.faults(TS, crash=True, pid=old)
    wait_for(lambda: daemon(sup, TS)["pid"] not in (None, old) and sup.healthy(TS), what="restart")


def test_refused_terminate_of_a_live_client_is_reported_not_restarted(mps):
    sup = mps.supervisor(modes=(TS,), proc_root=mps.proc_root, probe_interval_s=1e9)
    wait_until(sup.ready, 15)
    old = daemon(sup, TS)["pid"]
    a = mps.client(CID_A, POD_A, mode=TS)
    mps.faults(TS, refuse=["client terminate"])
    res = sup.drain(CID_A, timeout_s=5)
    assert res.clients == (a,) and res.terminated == () and res.wedged and res.restarted == ()
    assert any("refused" in e for e in res.errors)
    wait_for(lambda: sup.healthy(TS), what="probe answers: healthy")
    assert daemon(sup, TS)["restarts"] == 0 and daemon(sup, TS)["pid"] == old


# ---------------------------------------------------------------------------- issue 12: never give up, tell why


def test_failed_daemon_is_retried_forever_and_comes_back_when_the_fault_clears(mps):
    os.makedirs(mps.layout.pipe_dir(TS), exist_ok=True)
    mps.faults(TS, fail_start=True)
    sup = mps.supervisor(modes=(TS,), max_restarts=2, backoff_base_s=0.02, backoff_max_s=0.2)
    wait_for(lambda: daemon(sup, TS)["state"] == "failed", what="reported failed")
    d = daemon(sup, TS)
    assert not sup.healthy(TS) and d["reason"].startswith("failed after 3 restarts, retrying every 0.2s")
    assert "fake fail_start" in open(os.path.join(mps.layout.log_dir(TS), "daemon.out")).read()
    budget = d["restart_budget_used"]
    wait_for(lambda: daemon(sup, TS)["restart_budget_used"] > budget, what="still retried after failed")
    mps.faults(TS)  # the fault is gone
    wait_for(lambda: sup.healthy(TS), timeout_s=20, what="healthy again")
    assert daemon(sup, TS)["state"] == "ready" and daemon(sup, TS)["reason"] == ""


def test_server_crash_loop_in_the_control_log_makes_the_daemon_unhealthy(mps):
    metrics = Metrics()
    sup = mps.supervisor(modes=(TS,), probe_interval_s=0.2, crash_loop_exits=3, crash_loop_window_s=2.0)
    metrics.attach_mps(sup)
    wait_until(sup.ready, 15)
    log_path = os.path.join(mps.layout.log_dir(TS), "control.log")
    with open(log_path, "a") as f:
        f.write("[2026-11-30 19:00:00.000 Control 123] Server 456 exited with status 0\n")  # a clean exit
        for i in range(2):
            f.write(f"[2026-11-30 19:00:0{i}.000 Control 123] Server {500 + i} exited with status 1\n")
    wait_for(lambda: daemon(sup, TS)["server_exits_recent"] == 2, what="a probe read the log")
    assert sup.healthy(TS)  # two failures in the window: below the threshold
    with open(log_path, "a") as f:
        f.write("[2026-11-30 19:00:03.000 Control 123] server exited with status 1\n")  # the wording
    wait_for(lambda: not sup.healthy(TS), what="crash loop detected")
    d = daemon(sup, TS)
    assert d["crash_loop"].startswith("MPS server crash loop: 3 server exits with non-zero status")
    assert d["reason"] == d["crash_loop"] and d["pid"] is not None and d["restarts"] == 0
    assert 'fracplugin_mps_daemon_up{mode="time-slicing"} 0.0' in metrics.render().decode()
    wait_for(lambda: sup.healthy(TS), what="healthy once the window passes without exits")


def test_dirs_are_0755_under_umask_077(mps):
    old = os.umask(0o077)
    try:
        sup = mps.supervisor(modes=(TS, SM))
        wait_until(sup.ready, 15)
        leaf = sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, mode=SM, pinned_limit_mib=12288)
        ts_leaf = sup.ensure_namespace(POD_B, "app", None, timeout_s=5, mode=TS, pinned_limit_mib=4096)
    finally:
        os.umask(old)
    for m in (TS, SM):
        for path in (mps.layout.root, mps.layout.pipe_dir(m), mps.layout.log_dir(m),
                     os.path.dirname(mps.layout.log_dir(m)), os.path.join(mps.layout.pipe_dir(m), SM_SERVER)):
            assert oct(os.stat(path).st_mode & 0o777) == "0o755", path
    for path in (leaf, ts_leaf):
        assert oct(os.stat(path).st_mode & 0o777) == "0o755", path


def test_root_under_an_untraversable_parent_is_not_ready_and_says_which(mps):
    parent = os.path.join(mps.root, "private")
    os.makedirs(parent)
    os.chmod(parent, 0o700)
    sup = MpsSupervisor(MpsLayout(os.path.join(parent, "mps")), FAKE, None, "615.71.09", {TS},
                        backoff_base_s=0.02, backoff_max_s=0.1, env={"PATH": FAST_PATH})
    mps.sups.append(sup)
    sup.start()
    wait_for(lambda: "not traversable" in sup.unhealthy_reason(TS), what="reason")
    assert not sup.ready()
    assert f"directory {parent} is mode 0700" in sup.unhealthy_reason(TS)
    with pytest.raises(MpsError, match=f"directory {parent} is mode 0700"):
        sup.ensure_namespace(POD_A, "app", None, timeout_s=1, mode=TS)
    os.chmod(parent, 0o755)  # fixed by the operator: no restart of fracplugin needed
    wait_for(lambda: sup.healthy(TS), timeout_s=20, what="ready after the fix")


def test_namespace_pinned_limit_is_the_containers_limit_and_restored(mps):
    sup = mps.supervisor(modes=(SM,))
    wait_until(sup.ready, 15)
    sup.ensure_namespace(POD_A, "app", 30, timeout_s=5, mode=SM, pinned_limit_mib=12288)
    ns = mps.state(SM)["namespaces"][f"{SM_SERVER}/{namespace_name(POD_A, 'app')}"]
    assert ns["pinned_memory_limit"] == "12288M" and ns["active_thread_percentage"] == 30
    mps.faults(SM, crash=True)
    wait_for(lambda: daemon(sup, SM)["restarts"] >= 1, what="crash")
    mps.faults(SM)
    wait_for(lambda: sup.healthy(SM), what="restarted")
    ns = mps.state(SM)["namespaces"][f"{SM_SERVER}/{namespace_name(POD_A, 'app')}"]
    assert ns["pinned_memory_limit"] == "12288M" and ns["active_thread_percentage"] == 30


def test_restart_cleans_what_the_dead_daemon_left_and_keeps_tenant_dirs(mps):
    sup = mps.supervisor(modes=(TS,))
    wait_until(sup.ready, 15)
    keep = sup.ensure_namespace(POD_A, "app", None, timeout_s=5, mode=TS, pinned_limit_mib=2048)
    gone = sup.ensure_namespace(POD_B, "app", None, timeout_s=5, mode=TS, pinned_limit_mib=2048)
    ino = os.stat(keep).st_ino  # a running container's bind mount holds this directory
    mps.faults(TS, crash=True, fail_start=True)  # dies like SIGKILL (sockets stay behind), cannot start again
    wait_for(lambda: daemon(sup, TS)["pid"] is None and daemon(sup, TS)["state"] in ("backoff", "failed"),
             what="down")
    assert os.path.isdir(gone)  # still recorded: its directory stays (stale sockets are cleared at each start)
    sup.release_namespace(POD_B, "app", timeout_s=0.2)  # released while no daemon runs
    mps.faults(TS)
    wait_for(lambda: sup.healthy(TS), what="restarted")
    assert not os.path.exists(gone), (os.listdir(gone), daemon(sup, TS))
    assert os.stat(keep).st_ino == ino and stat.S_ISSOCK(os.stat(os.path.join(keep, "control")).st_mode)
    assert list(mps.state(TS)["namespaces"]) == [f"{SM_SERVER}/{namespace_name(POD_A, 'app')}"]
