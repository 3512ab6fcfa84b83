"""A container above its GPU memory limit is noticed (issue 35 item 3, ADR 0035).

On every usage poll (``Metrics.poll``) each tenancy of the ledger has its used memory (the leaf's
``dmem.current``, else NVML's per-process sum as metrics.py attributes it) compared with its hard limit, and
*episodes* above it start and end as ADR 0035 decision 2 says: at its start one Warning Event
``GpuMemoryLimitExceeded`` (numbered), the episode counter, and with ``--over-limit restart`` a restart
(restart.py). A poll whose NVML query failed changes nothing.

Concurrency: ``check`` runs on the poll thread; ``over``, ``episodes`` and
``status`` may be read from any thread (one lock).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Sequence

from .model import PodRef, Tenancy

log = logging.getLogger(__name__)

MIB = 1 << 20
_Key = tuple[str, str, str]  # (pod UID, container, GPU UUID)


class OverLimitWatch:
    """Episodes of containers above their limit (module docstring).

    Args:
        mode: ``report`` or ``restart`` (``--over-limit``).
        events: the event recorder (``over_limit(pod, container, message, action)``).
        restarter: ``restart.Restarter`` (None: no API access; ``restart``
            then reports and says the restart is unavailable).
        dmem_used: ``(container id, GPU UUID) -> bytes | None`` from the
            container's ``dmem.current``; None = NVML only."""

    def __init__(self, mode: str, events: Any, restarter: Any = None,
                 dmem_used: Callable[[str, str], int | None] | None = None) -> None:
        self.mode = mode
        self.events = events
        self.restarter = restarter
        self.dmem_used = dmem_used
        self._lock = threading.Lock()
        self._over: dict[_Key, int] = {}  # key -> used bytes at the last poll
        self.episodes = self.polls = 0

    def check(self, tenancies: Sequence[Tenancy], usage: Mapping[_Key, Any] | None) -> None:
        """Compare one poll's usage with the limits and start/end episodes.
        ``usage``: (pod UID, container, GPU UUID) -> an object with ``used``
        (bytes, NVML), None when the NVML query failed (nothing changes)."""
        with self._lock:
            self.polls += 1
        if usage is None:
            return
        over: dict[_Key, int] = {}
        started: list[tuple[Tenancy, int, str]] = []
        for t in tenancies:
            key = (t.pod_uid, t.container, t.gpu_uuid)
            used = self.dmem_used(t.container_id, t.gpu_uuid) if self.dmem_used and t.container_id else None
            source = "dmem.current"
            if used is None:
                u = usage.get(key)
                used, source = (u.used if u is not None else 0), "NVML per-process"
            if used > t.limit_mib * MIB and t.pod_uid:
                over[key] = used
                if key not in self._over:
                    started.append((t, used, source))
        with self._lock:
            self._over = over
            first = self.episodes + 1
            self.episodes += len(started)
        for n, (t, used, source) in enumerate(started, first):
            self._episode(t, used, source, n)

    def _episode(self, t: Tenancy, used: int, source: str, n: int) -> None:
        pod = PodRef(t.namespace, t.pod_name, t.pod_uid)
        msg = (f"GPU {t.gpu_uuid}: used {used // MIB} MiB ({source} usage), above the container's limit "
               f"{t.limit_mib} MiB (episode {n} on this node)")
        restart = self.mode == "restart"
        if restart and self.restarter is None:
            msg += "; not restarted: no API access to evict its pod"
        elif restart:
            msg += f"; restarting it (evicting pod {pod})"
        log.warning("container above its GPU memory limit", extra={
            "pod": str(pod), "container": t.container, "gpu_uuid": t.gpu_uuid, "used_bytes": used,
            "limit_bytes": t.limit_mib * MIB, "action": self.mode})
        self.events.over_limit(pod, t.container, msg, "Restart" if restart else "Report")
        if restart and self.restarter is not None:
            self.restarter.restart(pod, t.container, msg)

    def over(self) -> dict[_Key, int]:
        """(pod UID, container, GPU UUID) -> used bytes of the episodes in progress."""
        with self._lock:
            return dict(self._over)

    def status(self) -> dict[str, Any]:
        """``/status`` ``over_limit``: mode, polls and episodes so far, those in progress, restart counts."""
        with self._lock:
            over = [{"pod_uid": k[0], "container": k[1], "gpu": k[2], "used_bytes": v} for k, v in self._over.items()]
            out: dict[str, Any] = {"mode": self.mode, "polls": self.polls, "episodes": self.episodes, "over": over}
        out["restarts"] = self.restarter.stats() if self.restarter is not None else None
        return out
