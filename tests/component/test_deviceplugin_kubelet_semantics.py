"""Registration against the real kubelet's semantics (issue 11, D2-D7), on the
in-process kubelet that copies them (``fake_kubelet.FakeKubelet``, both
``semantics="1.37"`` and ``"1.35"``), over real unix sockets.

The same scenarios run against a real kubelet in ``tests/kubelet_e2e``; these
are the fast, always-on versions and the small failing inputs of the issue:

* the plugin socket deleted again right after it was re-created -> registered
  at the end (it used to serve on no file: "own socket does not answer");
* a Register while kubelet holds a live connection is never sent (1.37 refuses
  it and then every later one on that path);
* "already connected" from kubelet -> serve on a new socket name and register;
* kubelet down with a dead kubelet.sock left behind (SIGTERM) -> one WARNING,
  not one per attempt; ``last_registration_ms`` excludes the downtime;
* the first Register waits until the devices can be served Healthy.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from fake_kubelet import FakeKubelet
from test_deviceplugin_kubelet import WAIT, EventMps, R, Rig, all_healthy

from tests.helpers import wait_until


@pytest.fixture(params=["1.37", "1.35"])
def rig(node_file, request):
    r = Rig(node_file)
    r.kubelet = FakeKubelet(r.plugin_dir, semantics=request.param)
    yield r
    r.close()


@pytest.fixture
def running(rig):
    rig.kubelet.start()
    s = rig.server()
    s.start()
    assert rig.kubelet.wait_for(lambda: rig.kubelet.updates(R) >= 1 and rig.kubelet.stream_open(R), WAIT)
    assert wait_until(lambda: s.devices.active_streams() == 1)
    return rig, s


def test_register_errors_are_unknown_like_kubelet(rig):
    """D3: kubelet answers Register errors as gRPC UNKNOWN; the plugin keeps
    the message in its status and retries."""
    rig.kubelet.refuse = "the ResourceName 'x' is invalid"
    rig.kubelet.start()
    s = rig.server()
    s.start()
    assert wait_until(lambda: "UNKNOWN" in s.status()["last_registration_error"])
    assert "is invalid" in s.status()["last_registration_error"]
    rig.kubelet.refuse = None
    assert rig.kubelet.wait_for(lambda: rig.kubelet.updates(R) >= 1, WAIT)


def test_socket_deleted_again_right_after_recreation_registers_at_the_end(running):
    """The issue's small failing input: delete our socket, and delete the new
    one as soon as it appears. Registered at the end, serving on an existing
    socket, and kubelet never refused a Register."""
    rig, s = running
    first = s.socket_path
    ino = os.stat(first).st_ino
    os.unlink(first)

    def new_socket():
        p = s.socket_path
        try:
            return os.stat(p).st_ino != ino or p != first
        except FileNotFoundError:
            return False
    assert wait_until(new_socket)
    os.unlink(s.socket_path)
    assert rig.kubelet.wait_for(lambda: len(rig.kubelet.registrations) >= 2, WAIT)
    assert wait_until(lambda: s.registered() and os.path.exists(s.socket_path))
    assert rig.kubelet.wait_for(lambda: rig.kubelet.stream_open(R) and all_healthy(rig.kubelet.devices(R)), WAIT)
    assert wait_until(lambda: s.devices.active_streams() == 1)
    assert rig.kubelet.refusals == []
    assert rig.kubelet.registrations[-1].endpoint == os.path.basename(s.socket_path)


def test_own_socket_deleted_serves_a_new_name_for_the_same_kubelet(running):
    """D2: kubelet (1.37) still has the old path; the plugin serves and
    registers on ``fracplugin-1.sock`` and kubelet accepts it."""
    rig, s = running
    os.unlink(s.socket_path)
    assert rig.kubelet.wait_for(lambda: len(rig.kubelet.registrations) >= 2, WAIT)
    assert rig.kubelet.registrations[-1].endpoint == "fracplugin-1.sock"
    assert rig.kubelet.refusals == []
    assert wait_until(s.registered)
    # a new kubelet starts from the configured name again (and wipes ours)
    rig.kubelet.restart()
    assert rig.kubelet.wait_for(lambda: len(rig.kubelet.registrations) >= 1 and rig.kubelet.updates(R) >= 1, WAIT)
    assert wait_until(lambda: s.socket_path.endswith("/fracplugin.sock") and s.registered())
    assert rig.kubelet.registrations[-1].endpoint == "fracplugin.sock"


@pytest.fixture
def rig137(node_file):
    r = Rig(node_file)  # FakeKubelet's default semantics: 1.37
    yield r
    r.close()


def test_already_connected_refusal_moves_to_a_new_socket_name(rig137):
    """D2: a path kubelet 1.37 considers connected is refused for good; the
    plugin answers the refusal by serving on a new name, and registers."""
    rig = rig137
    assert rig.kubelet.semantics == "1.37"
    rig.kubelet.start()
    rig.kubelet._poisoned.add(os.path.join(rig.plugin_dir, "fracplugin.sock"))
    s = rig.server()
    s.start()
    assert rig.kubelet.wait_for(lambda: rig.kubelet.updates(R) >= 1, WAIT)
    assert rig.kubelet.refusals and "already connected" in rig.kubelet.refusals[0]
    assert rig.kubelet.registrations[-1].endpoint == "fracplugin-1.sock"
    assert wait_until(s.registered)


def test_kick_on_a_live_connection_does_not_register_again(running, caplog):
    """D2: never a second Register while kubelet holds the ListAndWatch.

    The absence is read off the registrar's own decision, not a quiet
    interval: the kick is handled on the registrar's thread, which logs that
    it declines (kubelet holds a live stream) in the same step where it would
    otherwise call Register; once that line is there, a Register for this
    kick can no longer come."""
    rig, s = running
    caplog.set_level(logging.INFO, logger="fracplugin.kubelet.registration")
    n = len(rig.kubelet.registrations)
    s.registrar.kick()
    assert wait_until(lambda: any("holds a live ListAndWatch; not registering" in r.getMessage()
                                  for r in caplog.records), what="the registrar to handle the kick")
    assert len(rig.kubelet.registrations) == n
    assert rig.kubelet.refusals == []
    assert s.registrar.stats.count == 1


def test_kubelet_down_with_socket_left_behind_warns_once_and_times_from_the_new_socket(running, caplog):
    """D4: SIGTERM leaves kubelet.sock; while kubelet is down every attempt
    fails. One WARNING for the failures (not one per attempt), and the
    registration time counts from the new kubelet.sock, not from the stop."""
    rig, s = running
    caplog.set_level(logging.WARNING, logger="fracplugin.kubelet.registration")
    stopped_at = time.monotonic()
    rig.kubelet.restart(downtime_s=2.5, leave_socket=True)
    assert rig.kubelet.wait_for(lambda: len(rig.kubelet.registrations) >= 1 and rig.kubelet.updates(R) >= 1, WAIT)
    assert wait_until(lambda: s.registrar.stats.count == 2)
    # The new kubelet.sock cannot exist before stop + downtime: the figure
    # must fit between that moment and the end of the registration.
    st = s.registrar.stats
    assert st.last_s <= st.registered_at - (stopped_at + 2.5)
    warnings = [r for r in caplog.records if "registration attempt" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_stream_end_marks_every_device_unhealthy_at_kubelet(running):
    """D7, as the simulation now shows it: the plugin stopping leaves kubelet
    with every device Unhealthy until a plugin registers again."""
    rig, s = running
    s.stop(3.0)
    assert rig.kubelet.wait_for(lambda: not rig.kubelet.stream_open(R), WAIT)
    devs = rig.kubelet.devices(R)
    assert devs and all(h == "Unhealthy" for h in devs.values())


def test_first_register_waits_until_devices_can_be_served_healthy(rig):
    """D7 readiness order: with MPS still starting, no Register; once it is
    up, the first list kubelet gets is all Healthy.

    The absence is read off the registrar's own steps, not a quiet interval:
    it asks ``ready()`` before the first Register and registers only once
    that is True; after it was told False twice (it has come round its wait
    loop while not ready), no Register may have been sent."""
    up = threading.Event()
    rig.kubelet.start()
    s = rig.server(mps_health=EventMps(up))
    answers: list[bool] = []  # what ready() told the registrar's thread
    real_ready = s.serving.ready

    def ready() -> bool:
        r = real_ready()
        if threading.current_thread().name == "fracplugin-registrar":
            answers.append(r)
        return r

    s.serving.ready = ready  # the registrar looks it up on its target (the door's server) at each wait (getattr)
    s.start()
    assert wait_until(lambda: answers.count(False) >= 2, what="the registrar to find the devices not ready twice")
    assert rig.kubelet.registrations == []
    assert not s.registered()
    up.set()
    assert rig.kubelet.wait_for(lambda: rig.kubelet.updates(R) >= 1, WAIT)
    assert all_healthy(rig.kubelet.history(R)[0])


def test_pick_passes_must_include_to_get_preferred_allocation(node_file):
    """D6: kubelet reuses an init container's devices for the next container
    and passes them as must_include; the simulation's ``pick`` does the same
    and the plugin's preference keeps them."""
    from fracplugin_demo.kubelet import KubeletSim

    r = Rig(node_file)
    r.kubelet = KubeletSim(r.plugin_dir)
    try:
        r.kubelet.start()
        s = r.server()
        s.start()
        r.kubelet.wait_registered(WAIT)
        init_ids = r.kubelet.pick(1)
        r.kubelet.allocated.update(init_ids)
        ids = r.kubelet.pick(3, must_include=init_ids)
        assert len(ids) == 3 and set(init_ids) <= set(ids)
        assert len({i.split("::")[0] for i in ids}) == 1  # pack: on the init container's GPU
    finally:
        r.close()
