"""XID and MPS health of GPUs: fracplugin.gpu.health (driven with a fake clock)."""

from __future__ import annotations

import threading

import pytest

from fracplugin.gpu.health import (
    DEFAULT_IGNORED_XIDS,
    HealthMonitor,
    gpu_health_fn,
)
from fracplugin.gpu.inventory import XidEvent
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.model import ComputeMode
from fracplugin.mps.api import NullMps
from tests.helpers import scaled


class ModeMps(NullMps):
    """The MPS port with a settable health per mode (``healthy(mode)``), or
    one ``up()`` answer for every mode."""

    def __init__(self, up=lambda: True, per_mode=None) -> None:
        super().__init__()
        self.up = up
        self.per_mode = per_mode

    def healthy(self, mode: ComputeMode) -> bool:
        return self.per_mode[mode] if self.per_mode is not None else self.up()

GPUS = ["GPU-a", "GPU-b"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def monitor(**kw) -> tuple[HealthMonitor, Clock, list[int]]:
    clock = Clock()
    changes: list[int] = []
    m = HealthMonitor(None, GPUS, clock=clock, **kw)
    m.subscribe(lambda: changes.append(1))
    return m, clock, changes


def test_default_ignored_xids_are_the_application_ones():
    # NVIDIA's XID catalog (issue 12): 94 contained ECC = restart the application (ignored), 109 is fatal
    assert DEFAULT_IGNORED_XIDS == {13, 31, 43, 45, 68, 94}


def test_xid_94_is_ignored_and_109_is_fatal_by_default():
    m, _, changes = monitor()
    assert m.record_xid(XidEvent("GPU-a", 94)) is False and m.healthy("GPU-a")
    assert m.record_xid(XidEvent("GPU-a", 109)) is True
    assert m.unhealthy() == {"GPU-a": ["xid 109"]} and changes == [1]


@pytest.mark.parametrize("xid", sorted(DEFAULT_IGNORED_XIDS))
def test_ignored_xid_changes_nothing(xid):
    m, _, changes = monitor()
    assert m.record_xid(XidEvent("GPU-a", xid)) is False
    assert m.unhealthy() == {}
    assert changes == []


class Prober:
    """An inventory whose ``probe_gpu`` answers like a live NVML query of one GPU."""

    def __init__(self) -> None:
        self.lost: set[str] = set()
        self.probes: list[str] = []

    def probe_gpu(self, uuid: str) -> bool:
        self.probes.append(uuid)
        return uuid not in self.lost

    def events(self, timeout_s: float):
        return iter(())


def test_no_recovery_by_the_timer_alone_only_after_a_successful_reprobe():
    # issue 12: a GPU that fell off the bus (XID 79) must not come back on a timer
    inv = Prober()
    clock = Clock()
    m = HealthMonitor(inv, GPUS, clock=clock, xid_recovery_s=60)
    m.record_xid(XidEvent("GPU-a", 79))
    inv.lost.add("GPU-a")
    clock.t += 1000
    assert m.check() is False and not m.healthy("GPU-a")
    assert inv.probes == ["GPU-a"]  # it was re-probed, and the probe failed
    inv.lost.clear()
    assert m.check() is True and m.healthy("GPU-a")
    # without anything that can re-probe, the timer never recovers it
    m2, clock2, _ = monitor(xid_recovery_s=60)
    m2.record_xid(XidEvent("GPU-b", 79))
    clock2.t += 10_000
    assert m2.check() is False and not m2.healthy("GPU-b")


def test_critical_xid_marks_the_gpu_once_and_recovers_after_the_quiet_period():
    clock = Clock()
    changes: list[int] = []
    m = HealthMonitor(Prober(), GPUS, clock=clock, xid_recovery_s=60)
    m.subscribe(lambda: changes.append(1))
    assert m.record_xid(XidEvent("GPU-a", 79)) is True
    assert m.unhealthy() == {"GPU-a": ["xid 79"]}
    assert m.healthy("GPU-b")
    assert changes == [1]
    # A second XID on an already unhealthy GPU restarts the quiet period, no new update.
    clock.t += 50
    assert m.record_xid(XidEvent("GPU-a", 48)) is False
    assert changes == [1]
    clock.t += 50  # 50 s after the last XID: still unhealthy
    assert m.check() is False
    assert not m.healthy("GPU-a")
    clock.t += 10
    assert m.check() is True
    assert m.healthy("GPU-a")
    assert changes == [1, 1]


def test_without_timed_recovery_only_clear_recovers():
    m, clock, changes = monitor(xid_recovery_s=None)
    m.record_xid(XidEvent("GPU-b", 48))
    clock.t += 10_000
    m.check()
    assert not m.healthy("GPU-b")
    assert m.clear("GPU-b") is True
    assert m.healthy("GPU-b")
    assert m.clear("GPU-b") is False
    assert len(changes) == 2


def test_configured_ignore_list_replaces_the_default():
    m, _, _ = monitor(ignored_xids=frozenset({79, 48}))
    m.record_xid(XidEvent("GPU-a", 79))
    assert m.healthy("GPU-a")
    m.record_xid(XidEvent("GPU-a", 13))
    assert not m.healthy("GPU-a")


def test_xid_for_unknown_gpu_is_ignored():
    m, _, changes = monitor()
    assert m.record_xid(XidEvent("GPU-zzz", 79)) is False
    assert m.unhealthy() == {} and changes == []


def test_mps_down_marks_every_gpu_and_recovers():
    up = {"v": True}
    m, _, changes = monitor(mps_health=ModeMps(lambda: up["v"]))
    assert m.check() is False
    up["v"] = False
    assert m.check() is True
    assert m.unhealthy() == {"GPU-a": ["mps down"], "GPU-b": ["mps down"]}
    up["v"] = True
    assert m.check() is True
    assert m.unhealthy() == {}
    assert len(changes) == 2


def test_mps_down_and_xid_both_reported_and_both_must_clear():
    up = {"v": False}
    m, _, _ = monitor(mps_health=ModeMps(lambda: up["v"]), xid_recovery_s=None)
    m.check()
    m.record_xid(XidEvent("GPU-a", 79))
    assert m.unhealthy()["GPU-a"] == ["xid 79", "mps down"]
    up["v"] = True
    m.check()
    assert m.unhealthy() == {"GPU-a": ["xid 79"]}


def test_mps_health_by_the_mode_of_the_gpus_tenants():
    sup = ModeMps(per_mode={ComputeMode.TIME_SLICING: True, ComputeMode.SM_SHARING: False})
    modes = {"GPU-a": ComputeMode.SM_SHARING, "GPU-b": ComputeMode.TIME_SLICING}
    fn = gpu_health_fn(sup, modes.get)
    assert not fn("GPU-a")  # its tenants' daemon is down
    assert fn("GPU-b")
    assert fn("GPU-c")  # no tenants: some daemon is up
    sup.per_mode[ComputeMode.TIME_SLICING] = False
    assert not fn("GPU-c")
    assert gpu_health_fn(None)("GPU-a")  # MPS not supervised
    assert gpu_health_fn(NullMps())("GPU-a")  # the null object: nothing to be unhealthy


def test_probe_that_raises_counts_as_down():
    def boom() -> bool:
        raise RuntimeError("control socket gone")

    m, _, _ = monitor(mps_health=ModeMps(boom))
    m.check()
    assert set(m.unhealthy()) == set(GPUS)


def test_thread_consumes_inventory_events(node_file):
    inv = SimulatedInventory(node_file)
    uuids = [g.uuid for g in inv.node().gpus]
    flipped = threading.Event()
    m = HealthMonitor(inv, uuids, poll_s=0.05)
    m.subscribe(flipped.set)
    m.start()
    try:
        inv.inject_xid(uuids[1], 13)  # ignored
        inv.inject_xid(uuids[2], 79)
        assert flipped.wait(scaled(5))
        assert m.unhealthy() == {uuids[2]: ["xid 79"]}
        assert m.events_seen == 2
    finally:
        m.stop()
