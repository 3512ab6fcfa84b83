"""GPU health from NVML XID events and MPS daemon health.

Concurrency model: one daemon thread (``HealthMonitor.start``) is the only
consumer of ``Inventory.events`` (the inventory contract). It also polls the
injected MPS health source every ``poll_s`` seconds and expires XID marks.
State is guarded by one lock; ``unhealthy()`` / ``healthy()`` are safe from any
thread; subscribers are called on the monitor thread (or on the thread that
calls ``record_xid`` / ``clear`` / ``check``) after every change, outside the
lock, and must not block.

Rules (docs/reference/kubelet-device-plugin.md D.10, issue 4 item 3):

* An XID in ``ignored_xids`` changes nothing. Default 13, 31, 43, 45, 68, 94:
  the application errors NVIDIA's device plugin ignores (docs/reference/mps-nvml.md 4.5)
  with NVIDIA's XID catalog applied to the two it gets wrong
  (docs/reference/kubelet-device-plugin.md D.10, issue 12): 94 (contained ECC error: restart
  the application, the GPU is fine) is ignored, 109 (context switch timeout,
  a GPU-level fault) is not. Any other XID marks the whole GPU Unhealthy
  (every fraction of it, in one update).
* Recovery rule: a GPU marked by an XID becomes Healthy again when
  ``xid_recovery_s`` seconds (default 300) pass without another critical XID
  on it *and* a real re-probe of that GPU succeeds now
  (``inventory.probe_gpu(uuid)``: an NVML query, not the list cached at start,
  issue 12), or at once on an explicit ``clear(uuid)``. Without a prober (no
  inventory, or one without ``probe_gpu``) the timer alone never recovers.
  ``xid_recovery_s=None`` disables the timed recovery (then only ``clear``).
* MPS: a GPU is Unhealthy while its MPS source says it is down, and Healthy
  again as soon as the source says it is up (see ``MpsHealth``).
* Cordon: a GPU is Unhealthy (reason ``cordoned``) while the node annotation
  ``fracplugin.io/cordoned-gpus`` names it (``cordon``, set by
  ``cordon.CordonWatch``): the device plugin and the DRA slice read health,
  so both withdraw it, and ``NodeRules.unusable`` refuses it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from ..model import ComputeMode
from .inventory import Inventory, InventoryError, XidEvent
from ..logs import guarded

if TYPE_CHECKING:
    from ..mps.api import MpsApi

log = logging.getLogger(__name__)

DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 94})
DEFAULT_XID_RECOVERY_S = 300.0
CORDONED = "cordoned"
"""The health reason of a GPU the node annotation cordons (``HealthMonitor.cordon``)."""

MpsHealth = Optional["MpsApi"]
"""The MPS health source: the one MPS port (``mps.api.MpsApi``: the
supervisor, the MPS role's client, or ``NullMps``), or None (MPS not
supervised: always healthy). A GPU is healthy when the daemon of its tenants'
mode is up (``mode_of(uuid)``), and a GPU with no tenants when any daemon is up."""


def gpu_health_fn(
    mps_health: MpsHealth, mode_of: Callable[[str], ComputeMode | None] = lambda _u: None
) -> Callable[[str], bool]:
    """Normalise the MPS health source into ``(gpu_uuid) -> bool`` (see ``MpsHealth``)."""
    if mps_health is None:
        return lambda _u: True
    mps = mps_health

    def by_mode(uuid: str) -> bool:  # the daemon of its tenants' mode; any daemon for a GPU with none
        mode = mode_of(uuid)
        return any(bool(mps.healthy(m)) for m in (ComputeMode if mode is None else (mode,)))

    return by_mode


@dataclass(frozen=True)
class GpuHealth:
    """Health of one GPU: ``healthy`` and, when not, ``reasons`` (e.g.
    ``["xid 79", "mps down"]``)."""

    uuid: str
    healthy: bool
    reasons: tuple[str, ...] = ()


class HealthMonitor:
    """Tracks per-GPU health.

    Args:
        inventory: the event source (``events(timeout_s)``); may be None (no XIDs).
        gpu_uuids: the GPUs to track.
        ignored_xids: XIDs that change nothing.
        xid_recovery_s: quiet seconds after the last critical XID before the GPU
            is Healthy again (None: only ``clear``).
        mps_health: see ``MpsHealth``.
        mode_of: compute mode of a GPU's tenants (``ledger.mode``), for ``MpsHealth`` objects.
        poll_s: seconds per monitor-loop turn (event wait, MPS poll, recovery check).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        inventory: Inventory | None,
        gpu_uuids: Iterable[str],
        *,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        xid_recovery_s: float | None = DEFAULT_XID_RECOVERY_S,
        mps_health: MpsHealth = None,
        mode_of: Callable[[str], ComputeMode | None] = lambda _u: None,
        poll_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inventory = inventory
        self._uuids = list(gpu_uuids)
        self.ignored_xids = frozenset(ignored_xids)
        self.xid_recovery_s = xid_recovery_s
        self._mps = gpu_health_fn(mps_health, mode_of)
        self._poll_s = poll_s
        self._clock = clock
        self._lock = threading.Lock()
        self._xid: dict[str, tuple[int, float]] = {}  # uuid -> (last xid, time)
        self._mps_down: set[str] = set()
        self._cordoned: frozenset[str] = frozenset()
        self._subs: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.events_seen = 0

    # -- observers ---------------------------------------------------------
    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every health change."""
        self._subs.append(callback)

    def _notify(self) -> None:
        for cb in list(self._subs):
            guarded(log, "health subscriber", cb)

    def health(self, uuid: str) -> GpuHealth:
        """Health of one GPU (an unknown UUID is reported healthy)."""
        with self._lock:
            reasons = []
            if uuid in self._xid:
                reasons.append(f"xid {self._xid[uuid][0]}")
            if uuid in self._mps_down:
                reasons.append("mps down")
            if uuid in self._cordoned:
                reasons.append(CORDONED)
        return GpuHealth(uuid, not reasons, tuple(reasons))

    def healthy(self, uuid: str) -> bool:
        return self.health(uuid).healthy

    def xid_marks(self) -> dict[str, int]:
        """GPU UUID -> its last critical XID, for every GPU an XID marked
        (the GPU's own fault; MPS health is per compute mode and not in it)."""
        with self._lock:
            return {u: x for u, (x, _t) in self._xid.items()}

    def cordoned(self) -> frozenset[str]:
        """The UUIDs of the GPUs the node's cordon names (``cordon``)."""
        return self._cordoned

    def cordon(self, uuids: Iterable[str]) -> bool:
        """Make ``uuids`` the cordoned GPUs (the node annotation's, every
        read); True (and subscribers told) when the set changed."""
        new = frozenset(uuids)
        with self._lock:
            if new == self._cordoned:
                return False
            self._cordoned = new
        self._notify()
        return True

    def unhealthy(self) -> dict[str, list[str]]:
        """GPU UUID -> reasons, for every unhealthy GPU."""
        return {u: list(h.reasons) for u in self._uuids if not (h := self.health(u)).healthy}

    # -- inputs ------------------------------------------------------------
    def record_xid(self, event: XidEvent) -> bool:
        """Apply one XID event. Returns True when it changed a GPU's health."""
        self.events_seen += 1
        if event.xid in self.ignored_xids:
            log.info("ignoring XID %d on %s (in the ignored list)", event.xid, event.gpu_uuid)
            return False
        if event.gpu_uuid not in self._uuids:
            log.warning("XID %d for unknown GPU %s", event.xid, event.gpu_uuid)
            return False
        with self._lock:
            was = event.gpu_uuid in self._xid or event.gpu_uuid in self._mps_down
            self._xid[event.gpu_uuid] = (event.xid, self._clock())
        log.warning("critical XID %d on GPU %s: all its devices Unhealthy", event.xid, event.gpu_uuid)
        if not was:
            self._notify()
        return not was

    def clear(self, uuid: str) -> bool:
        """Forget an XID mark now (operator action). True when health changed."""
        with self._lock:
            had = self._xid.pop(uuid, None) is not None
            changed = had and uuid not in self._mps_down
        if changed:
            log.info("GPU %s XID mark cleared", uuid)
            self._notify()
        return changed

    def check(self) -> bool:
        """One turn of the slow checks: MPS health poll and XID quiet-period
        recovery. Returns True when any GPU's health changed."""
        now = self._clock()
        with self._lock:
            due = [u for u, (_x, t) in self._xid.items()
                   if self.xid_recovery_s is not None and now - t >= self.xid_recovery_s]
        probe = getattr(self._inventory, "probe_gpu", None)
        reprobed: set[str] = set()
        for u in due:
            if not callable(probe):
                continue  # nothing can confirm the GPU works: the timer alone never recovers it
            try:
                if probe(u):
                    reprobed.add(u)
            except Exception as e:  # a driver failure: do not recover now
                log.warning("re-probe of GPU %s failed: %s", u, e)
        mps_down = set()
        for u in self._uuids:
            try:
                if not self._mps(u):
                    mps_down.add(u)
            except Exception as e:
                log.warning("MPS health probe failed for %s: %s", u, e)
                mps_down.add(u)
        with self._lock:
            before = set(self._xid) | self._mps_down
            if self.xid_recovery_s is not None:
                for u, (xid, t) in list(self._xid.items()):
                    if now - t >= self.xid_recovery_s and u in reprobed:
                        log.info("GPU %s quiet for %.0f s after XID %d and re-probed: Healthy again", u, now - t, xid)
                        del self._xid[u]
            self._mps_down = mps_down
            after = set(self._xid) | self._mps_down
            changed = before != after
        if changed:
            self._notify()
        return changed

    # -- thread ------------------------------------------------------------
    def start(self) -> None:
        """Start the monitor thread (idempotent). Runs one ``check`` first so the
        first ListAndWatch answer already reflects MPS health."""
        if self._thread is not None:
            return
        self._stop.clear()
        self.check()
        self._thread = threading.Thread(target=self._run, name="fracplugin-health", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the monitor thread and wait up to ``timeout_s``."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout_s)

    def _run(self) -> None:
        backoff = self._poll_s
        while not self._stop.is_set():
            try:
                t0 = time.monotonic()
                if self._inventory is not None:
                    for ev in self._inventory.events(self._poll_s):
                        self.record_xid(ev)
                        if self._stop.is_set():
                            return
                # An event source that returns at once must not make this spin.
                rest = self._poll_s - (time.monotonic() - t0)
                if rest > 0:
                    self._stop.wait(rest)
                self.check()
                backoff = self._poll_s
            except InventoryError as e:
                log.warning("XID event source failed: %s (retrying in %.1f s)", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception:
                log.exception("health monitor turn failed")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
