"""The node condition KAI Scheduler gates fractional pods on (ADR 0005).

In NvFractions mode KAI's scheduler places a fractional pod only on a node
whose readiness condition is True; otherwise its fit error reads "node is not
ready for fractional GPU scheduling" (KAI-Scheduler scheduler predicate tests). Both names in use
(docs/reference/enforcement-cdi-dra.md "The KAI node condition") are published by default
(``DEFAULT_CONDITION_TYPES``), from the daemon's own readiness:

- ``True``, reason ``FracpluginReady``, when every enabled part is ready
  (NRI synchronized, device plugin registered, MPS daemons healthy);
- ``False`` with the reason of the first part that is not
  (``NRINotReady``, ``DevicePluginNotReady``, ``MPSNotHealthy``,
  ``ShuttingDown``) and a message made of every failing part's detail;
- ``Unknown``, reason ``ShuttingDown``, as the last word of a daemon that
  stops on purpose (SIGTERM): the node's state is not known while no daemon
  runs, as the reference node stack does (``markNodesUnknownOnShutdown``).
  KAI places fractional pods only on True, so Unknown keeps them away too.

Written as ADR 0005 decision 1 says (a strategic merge patch of ``nodes/<node>/status``, transition and
heartbeat times, RBAC nodes/status patch and nodes get): one background thread polls readiness every
``poll_s`` and publishes a state once it has held ``debounce_s``; a patch is retried ``RETRY_ATTEMPTS``
times on connection errors, 5xx, 409 and 429. The doors never wait for the API server. Counters are
guarded by one lock.
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import tenacity

from .events import core_v1

log = logging.getLogger(__name__)

DEFAULT_CONDITION_TYPE = "gpu-fractioning.nvidia.com/Ready"
"""The type the renamed node stack writes and KAI's api module names (current KAI reads it)."""
LEGACY_CONDITION_TYPE = "gpu-sharing.nvidia.com/Ready"
"""The older operator's type, read by some older KAI builds."""
DEFAULT_CONDITION_TYPES = (DEFAULT_CONDITION_TYPE, LEGACY_CONDITION_TYPE)
"""Published by default (issue 23 item 5): both names, same status."""

REASON_READY = "FracpluginReady"
REASON_STOPPING = "ShuttingDown"
#: readiness part (Daemon.checks keys) -> condition reason when it is not ready
PART_REASONS = {
    "daemon": REASON_STOPPING,
    "nri": "NRINotReady",
    "device_plugin": "DevicePluginNotReady",
    "mps": "MPSNotHealthy",
    "memory_limits": "MemoryLimitsNotEnforceable",
    "dra": "DRANotReady",
}
MAX_MESSAGE = 1024
RETRY_ATTEMPTS = 4
"""Tries per publish (tenacity, exponential backoff)."""


@dataclass(frozen=True)
class ConditionState:
    """What the condition should say: ``ready`` (status True/False, or
    ``Unknown`` when ``unknown``), a CamelCase ``reason`` and a human ``message``."""

    ready: bool
    reason: str
    message: str
    unknown: bool = False

    @property
    def status(self) -> str:
        """``True``, ``False`` or ``Unknown`` (Kubernetes ConditionStatus)."""
        if self.unknown:
            return "Unknown"
        return "True" if self.ready else "False"


def condition_from_checks(checks: Mapping[str, Mapping[str, Any]]) -> ConditionState:
    """Daemon readiness (``{part: {"ready": bool, "detail": str}}``, the
    ``/readyz`` checks) -> the condition.

    Ready only when every part is ready (an empty mapping is not ready: no
    door is serving). The reason is the first failing part's, in the order
    ``daemon`` (shutting down), ``nri``, ``device_plugin``, ``mps``, then any
    other part (``<Part>NotReady``); the message lists every failing part's
    detail (``nri: not connected to /var/run/nri/nri.sock; mps: unhealthy:
    sm-sharing``), at most 1024 characters.
    """
    if not checks:
        return ConditionState(False, "NoDoorsEnabled", "fracplugin has no part enabled to serve fractional pods")
    failing = [(p, c) for p, c in checks.items() if not c.get("ready")]
    if not failing:
        msg = "fracplugin ready: " + "; ".join(f"{p}: {c.get('detail', 'ready')}" for p, c in checks.items())
        return ConditionState(True, REASON_READY, msg[:MAX_MESSAGE])
    order = list(PART_REASONS)
    failing.sort(key=lambda pc: order.index(pc[0]) if pc[0] in order else len(order))
    first = failing[0][0]
    reason = PART_REASONS.get(first) or ("".join(w.capitalize() for w in first.split("_")) + "NotReady")
    msg = "; ".join(f"{p}: {c.get('detail', 'not ready')}" for p, c in failing)
    return ConditionState(False, reason, msg[:MAX_MESSAGE])


def _now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _retryable(exc: BaseException) -> bool:
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 400 <= status < 500:
        return status in (409, 429)
    return True


class NodeConditionPublisher:
    """Keeps the KAI readiness node condition(s) current from readiness.

    Args:
        api: for ``events.core_v1``, called on the thread at the first publish.
        node_name: the node whose status is patched.
        readiness: returns the current ``ConditionState`` (cheap, never blocks;
            the daemon passes ``condition_from_checks(self.checks())``).
        types: condition types to publish, all with the same status
            (default ``DEFAULT_CONDITION_TYPES``: both names).

    Raises ValueError for an empty ``types`` or an empty ``node_name``.
    """

    poll_s = 0.5
    """Seconds between readiness polls."""
    debounce_s = 2.0
    """Seconds a new state must hold before it is published."""
    heartbeat_s = 60.0
    """Seconds between re-publishing an unchanged state (``lastHeartbeatTime``)."""
    retry_s = 5.0
    """Seconds after a failed publish before the next try."""
    request_timeout_s = 5.0
    """Bound of one API request, seconds."""
    retry_base_s = 0.2
    """First pause between the ``RETRY_ATTEMPTS`` tries of a publish (tenacity, exponential backoff)."""

    def __init__(self, api: Any, node_name: str, readiness: Callable[[], ConditionState],
                 types: Sequence[str] = DEFAULT_CONDITION_TYPES) -> None:
        if not types:
            raise ValueError("types must name at least one condition type")
        if not node_name:
            raise ValueError("node_name is empty: the node condition needs this node's name (--node-name)")
        self._api = api
        self.node_name = node_name
        self.readiness = readiness
        self.types = tuple(dict.fromkeys(types))
        self._core: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._abort = threading.Event()  # ends retries at once (stop deadline passed)
        self._thread: threading.Thread | None = None
        self._published: ConditionState | None = None
        self._published_at = 0.0
        self._transitions: dict[str, tuple[str, str]] = {}  # type -> (status, lastTransitionTime)
        self._read_node = True
        self._patches = 0
        self._failures = 0
        self._last_error: str | None = None
        self._logged_error: str | None = None

    # ------------------------------------------------------------- lifecycle

    def start(self) -> "NodeConditionPublisher":
        """Start the publishing thread; returns self. RuntimeError when started twice."""
        if self._thread is not None:
            raise RuntimeError("NodeConditionPublisher already started")
        self._thread = threading.Thread(target=self._run, name="fracplugin-nodecondition", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0, message: str = "fracplugin is shutting down") -> bool:
        """Publish ``Unknown`` (reason ``ShuttingDown``) on every type within
        ``timeout_s`` seconds, then end the thread: the daemon stops on purpose
        and the node's readiness is not known until one runs again (the
        reference's ``markNodesUnknownOnShutdown``). Returns True when the last
        publish succeeded. Idempotent (later calls publish nothing)."""
        if self._stop.is_set():
            return False
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:
            self._thread.join(max(timeout_s / 2, 0.05))
            if self._thread.is_alive():  # stuck in a retry: cut it short
                self._abort.set()
                self._thread.join(max(deadline - time.monotonic(), 0.05))
        self._abort.clear()
        ok = False
        final = ConditionState(False, REASON_STOPPING, message, unknown=True)
        timer = threading.Timer(max(deadline - time.monotonic(), 0.05), self._abort.set)
        timer.daemon = True
        timer.start()
        try:
            ok = self._publish(final, attempts=2, timeout_s=max(min(deadline - time.monotonic(), 2.0), 0.1))
        finally:
            timer.cancel()
        return ok

    def _pause(self, seconds: float) -> None:
        """tenacity's sleep between tries: ends early when ``stop`` aborts retries."""
        self._abort.wait(seconds)

    def status(self) -> dict[str, Any]:
        """``{"types", "node", "published": {status, reason, message} | None,
        "patches", "failures", "last_error"}`` for ``/status``."""
        with self._lock:
            pub = self._published
            return {
                "types": list(self.types),
                "node": self.node_name,
                "published": None if pub is None else {"status": pub.status, "reason": pub.reason,
                                                       "message": pub.message},
                "patches": self._patches,
                "failures": self._failures,
                "last_error": self._last_error,
            }

    # ----------------------------------------------------------- worker side

    def _run(self) -> None:
        observed: ConditionState | None = None
        changed_at = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                cur = self.readiness()
            except Exception:  # a readiness bug must not end the thread
                log.exception("node condition: readiness failed")
                cur = ConditionState(False, "ReadinessUnknown", "fracplugin could not compute its readiness")
            if cur != observed:
                observed, changed_at = cur, now
            with self._lock:
                published, published_at = self._published, self._published_at
            settled = now - changed_at >= self.debounce_s
            try:
                if published is None:
                    # the first publish goes out at once (it replaces whatever a
                    # previous daemon left); after a failure, retry every retry_s
                    if published_at == 0.0 or now - published_at >= self.retry_s:
                        self._publish(observed)
                elif observed != published and settled:
                    self._publish(observed)
                elif now - published_at >= self.heartbeat_s:
                    self._publish(published)
            except Exception:  # never let the thread die
                log.exception("node condition: unexpected error")
            self._stop.wait(self.poll_s)

    def _body(self, state: ConditionState) -> dict[str, Any]:
        now = _now_rfc3339()
        conditions = []
        for t in self.types:
            prev = self._transitions.get(t)
            transition = prev[1] if prev is not None and prev[0] == state.status else now
            self._transitions[t] = (state.status, transition)
            conditions.append({"type": t, "status": state.status, "reason": state.reason,
                               "message": state.message, "lastHeartbeatTime": now,
                               "lastTransitionTime": transition})
        return {"status": {"conditions": conditions}}

    def _learn_transitions(self, core: Any) -> None:
        """Once: keep the transition time of conditions already on the node."""
        self._read_node = False
        try:
            node = core.read_node(self.node_name, _request_timeout=self.request_timeout_s)
        except Exception as exc:
            log.info("node condition: cannot read node %s (%s); transition times start now",
                     self.node_name, getattr(exc, "reason", None) or exc)
            return
        for c in (getattr(getattr(node, "status", None), "conditions", None) or []):
            if c.type in self.types and c.status and c.last_transition_time:
                ts = c.last_transition_time
                text = ts.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if hasattr(ts, "astimezone") else str(ts)
                self._transitions[c.type] = (c.status, text)

    def _publish(self, state: ConditionState, attempts: int | None = None, timeout_s: float | None = None) -> bool:
        """Patch the node's status; returns True on success. Never raises."""
        timeout = timeout_s or self.request_timeout_s

        def once() -> None:
            core = self._core = self._core or core_v1(self._api)
            if self._read_node:
                self._learn_transitions(core)
            core.patch_node_status(self.node_name, self._body(state), _request_timeout=timeout,
                                   _content_type="application/strategic-merge-patch+json")

        retry = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts or RETRY_ATTEMPTS) | tenacity.stop_when_event_set(self._abort),
            wait=tenacity.wait_exponential(multiplier=self.retry_base_s, max=5.0),
            retry=tenacity.retry_if_exception(_retryable),
            sleep=self._pause,
            reraise=True,
        )
        try:
            retry(once)
        except Exception as exc:
            text = f"{type(exc).__name__}: {getattr(exc, 'status', '')} {getattr(exc, 'reason', '') or exc}".strip()
            with self._lock:
                self._failures += 1
                self._last_error = text
                self._published = None
                self._published_at = time.monotonic()
            if text != self._logged_error:
                self._logged_error = text
                hint = " (RBAC: the service account needs nodes/status patch)" if getattr(exc, "status", None) == 403 else ""
                log.warning("node condition: patching node %s failed: %s%s", self.node_name, text, hint,
                            extra={"types": list(self.types), "status": state.status, "reason": state.reason})
            return False
        with self._lock:
            changed = self._published != state
            self._published = state
            self._published_at = time.monotonic()
            self._patches += 1
            self._last_error = None
        self._logged_error = None
        if changed:
            log.info("node condition %s", state.status, extra={
                "node": self.node_name, "types": list(self.types), "reason": state.reason, "detail": state.message})
        return True
