"""Kubernetes Events for refusals (docs/reference/design.md section 4: "bad input gets an
error naming key, value and rule, a Kubernetes Event when API access is
configured, a log line, and a counter").

Concurrency model: threads. The queueing methods (``refused``...) may be called from any thread and never
block: a bounded ``queue.Queue`` (full: the event is dropped and counted, ``dropped``). One background thread
(``start``) POSTs them to ``/api/v1/namespaces/<ns>/events`` one at a time, each bounded by
``request_timeout_s``; API errors are logged at WARNING and counted (``failed``), never raised. Counters
are guarded by one lock.

The Event (core/v1, the shape kubelet's own recorder writes, so
``kubectl describe pod`` lists it under Events):

- ``type: Warning``, ``reason: FractionRefused``, ``message``: the refusal's
  ``FractionError.message`` (``<key>="<value>" <rule>``), cut to 1024
  characters;
- ``involvedObject``: the Pod (``apiVersion: v1``, ``kind: Pod``, namespace,
  name, uid) with ``fieldPath: spec.containers{<container>}``;
- ``source``: ``{component, host: node_name}``, and the same as
  ``reportingComponent`` / ``reportingInstance``;
- ``action``: the refused operation (``CreateContainer`` for door ``nri``,
  ``Allocate`` for door ``deviceplugin``, else the door name);
- ``firstTimestamp`` = ``lastTimestamp`` = the refusal time, ``count: 1``;
- ``metadata.name``: ``<pod name>.<refusal time in ns, hex>`` in the pod's
  namespace (kubelet's naming rule, so names do not collide).

Repeats (kubelet retries a refused CreateContainer with back-off): the same (pod uid, container, message)
is sent at most once per ``repeat_window_s``, the others counted (``suppressed``); ``count`` stays 1 and the
API server's event TTL ages them out.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import queue
import threading
import time
from typing import Any

from .model import FractionError, PodRef

log = logging.getLogger(__name__)

REASON_REFUSED = "FractionRefused"
"""``reason`` of the Event written for a refusal."""
REASON_NOT_APPLIED = "AnnotationNotApplied"
"""``reason`` of the Event written for an annotation a door did not apply (ADR 0007)."""
REASON_LIMIT_NOT_ENFORCED = "MemoryLimitNotEnforced"
"""``reason`` of the Event written when a container's CUDA memory limit is not in force (issue 23, ADR 0025)."""
REASON_OVER_LIMIT = "GpuMemoryLimitExceeded"
"""``reason`` of the Event written when a container uses more GPU memory than its limit (issue 35 item 3)."""
REASON_UNFENCED = "ContainerRestartedUnfenced"
"""``reason`` of the Event for a container found running unfenced, restarted or not (issue 35 item 1)."""

MAX_MESSAGE = 1024
"""Characters of the refusal message kept in the Event (longer ones are cut)."""

_ACTIONS = {"nri": "CreateContainer", "deviceplugin": "Allocate"}

_Item = tuple[PodRef, str, str, str, float, str]
"""What the hook side enqueues: (pod, container, message, door, unix seconds, Event reason)."""


def core_v1(api: Any) -> Any:
    """``api`` as a ``kubernetes.client.CoreV1Api``: an ``ApiClient`` is wrapped, None loads the in-cluster
    configuration (the service account; raises ``ConfigException`` outside a pod), anything else (a
    ``CoreV1Api``) is returned as it is."""
    from kubernetes import client, config

    if api is None:
        config.load_incluster_config()
        return client.CoreV1Api()
    return client.CoreV1Api(api) if isinstance(api, client.ApiClient) else api


class EventRecorder:
    """Writes a core/v1 ``Warning`` Event for each refusal, in the background.

    Args:
        api: for ``core_v1``, called when the first Event is sent.
        node_name: this node's name (``source.host``, ``reportingInstance``).
    """

    component = "fracplugin"
    """``source.component`` / ``reportingComponent``."""
    queue_size = 1000
    """Events waiting to be sent before new ones are dropped."""
    request_timeout_s = 5.0
    """Bound of one API request, seconds."""
    repeat_window_s = 60.0
    """The same (pod uid, container, message) is sent at most once per this many seconds (0 = every time)."""

    def __init__(self, api: Any, node_name: str) -> None:
        self._api = api
        self.node_name = node_name
        self._q: queue.Queue[_Item | None] = queue.Queue(maxsize=self.queue_size)
        self._lock = threading.Lock()
        self._sent = self._failed = self._dropped = self._suppressed = 0
        self._recent: dict[tuple[str, str, str], float] = {}  # worker thread only
        self._stop = threading.Event()
        self._deadline = 0.0
        self._thread: threading.Thread | None = None
        self._core: Any = None

    # ------------------------------------------------------------- hook side

    def refused(self, pod: PodRef, container: str, err: FractionError, door: str) -> None:
        """Queue a ``FractionRefused`` Event for ``container`` of ``pod``.
        Never blocks and never raises: a full queue (or a stopped recorder)
        drops the event and counts it in ``dropped``."""
        self._put(pod, container, err.message, door, REASON_REFUSED)

    def limit_not_enforced(self, pod: PodRef, container: str, message: str) -> None:
        """Queue a ``MemoryLimitNotEnforced`` Warning Event (action
        StartContainer; ``message`` names the GPU, the planned and read limits
        and the missing capability). Never blocks, never raises."""
        self._put(pod, container, message, "StartContainer", REASON_LIMIT_NOT_ENFORCED)

    def warned(self, pod: PodRef, container: str, message: str, door: str) -> None:
        """Queue an ``AnnotationNotApplied`` Warning Event (an annotation the
        door did not apply, and why: ADR 0007). Never blocks, never raises."""
        self._put(pod, container, message, door, REASON_NOT_APPLIED)

    def over_limit(self, pod: PodRef, container: str, message: str, action: str) -> None:
        """Queue a ``GpuMemoryLimitExceeded`` Warning Event (issue 35 item 3:
        ``message`` names the GPU, used and limit; ``action`` ``Report`` or
        ``Restart``). Never blocks, never raises."""
        self._put(pod, container, message, action, REASON_OVER_LIMIT)

    def unfenced(self, pod: PodRef, container: str, message: str, action: str) -> None:
        """Queue a ``ContainerRestartedUnfenced`` Warning Event (``action``
        ``Restart``, ``Report`` or ``Backoff``). Never blocks, never raises."""
        self._put(pod, container, message, action, REASON_UNFENCED)

    def _put(self, pod: PodRef, container: str, message: str, action: str, reason: str) -> None:
        """Queue one Event now; a full queue or a stopped recorder drops it (``dropped``)."""
        if not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._q.put_nowait((pod, container, message, action, time.time(), reason))
                return
        with self._lock:
            self._dropped += 1

    def stats(self) -> dict[str, int]:
        """``{"queued", "sent", "failed", "dropped", "suppressed"}`` counts since
        construction (``queued``: waiting now)."""
        with self._lock:
            return {"queued": self._q.qsize(), "sent": self._sent, "failed": self._failed,
                    "dropped": self._dropped, "suppressed": self._suppressed}

    # ------------------------------------------------------------- lifecycle

    def start(self) -> "EventRecorder":
        """Start the sending thread; returns self. RuntimeError when started twice."""
        if self._thread is not None:
            raise RuntimeError("EventRecorder already started")
        self._thread = threading.Thread(target=self._run, name="fracplugin-events", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop accepting events, send what is queued for at most ``timeout_s``
        seconds (the rest is dropped and counted), end the thread. Returns True
        when the thread ended in time. Idempotent."""
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(None)  # wake the thread; a full queue wakes it anyway
        if self._thread is None:
            return True
        self._thread.join(timeout_s + 0.5)
        return not self._thread.is_alive()

    # ----------------------------------------------------------- worker side

    def _run(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is None:
                if self._stop.is_set() and self._q.empty():
                    return
                continue
            if self._stop.is_set() and time.monotonic() > self._deadline:
                self._drop_rest(1)
                return
            try:
                self._send(item)
            except Exception:  # never let the thread die
                log.exception("kubernetes event: unexpected error")
                with self._lock:
                    self._failed += 1

    def _drop_rest(self, already: int) -> None:
        n = already
        while True:
            try:
                if self._q.get_nowait() is not None:
                    n += 1
            except queue.Empty:
                break
        with self._lock:
            self._dropped += n
        if n:
            log.warning("kubernetes events dropped at shutdown", extra={"events": n})

    def _repeat(self, pod: PodRef, container: str, message: str, now: float) -> bool:
        if self.repeat_window_s <= 0:
            return False
        key = (pod.uid, container, message)
        last = self._recent.get(key)
        if last is not None and now - last < self.repeat_window_s:
            return True
        self._recent[key] = now
        if len(self._recent) > 4096:  # forget entries older than the window
            cutoff = now - self.repeat_window_s
            self._recent = {k: t for k, t in self._recent.items() if t >= cutoff}
        return False

    def _send(self, item: _Item) -> None:
        pod, container, message, door, at, reason = item
        if self._repeat(pod, container, message, at):
            with self._lock:
                self._suppressed += 1
            return
        body = self.build_event(pod, container, message, door, at, reason)
        try:
            if self._core is None:
                self._core = core_v1(self._api)
            self._core.create_namespaced_event(pod.namespace, body, _request_timeout=self.request_timeout_s)
        except Exception as exc:  # ApiException, urllib3 errors, config errors
            with self._lock:
                self._failed += 1
            log.warning(
                "kubernetes event not created",
                extra={"pod": str(pod), "container": container, "reason": api_error(exc)},
            )
            return
        with self._lock:
            self._sent += 1

    def build_event(self, pod: PodRef, container: str, message: str, door: str, at: float,
                    reason: str = "") -> Any:
        """The ``kubernetes.client.CoreV1Event`` of one refusal (see the module
        docstring for the fields); ``at`` is the refusal time, Unix seconds."""
        from kubernetes import client

        ts = _dt.datetime.fromtimestamp(at, tz=_dt.timezone.utc)
        return client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{pod.name}.{int(at * 1e9):x}", namespace=pod.namespace),
            involved_object=client.V1ObjectReference(
                api_version="v1", kind="Pod", namespace=pod.namespace, name=pod.name, uid=pod.uid,
                field_path=f"spec.containers{{{container}}}",
            ),
            reason=reason or REASON_REFUSED,
            message=message[:MAX_MESSAGE],
            type="Warning",
            action=_ACTIONS.get(door, door),
            source=client.V1EventSource(component=self.component, host=self.node_name),
            reporting_component=self.component,
            reporting_instance=self.node_name,
            first_timestamp=ts,
            last_timestamp=ts,
            count=1,
        )


def api_error(exc: Exception) -> str:
    """A failed API request in one line: ``HTTP <status> <reason>``, else ``<type>: <exc>`` (300 characters)."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"[:300]


class NullEventRecorder(EventRecorder):
    """The event recorder of a daemon without API access: every Event is
    ignored (the refusal or warning is still logged and counted by the door),
    no thread runs, every count stays 0."""

    def __init__(self) -> None:
        super().__init__(None, "")

    def _put(self, pod: PodRef, container: str, message: str, action: str, reason: str) -> None:
        return None

    def start(self) -> "NullEventRecorder":
        return self

    def stop(self, timeout_s: float = 1.0) -> bool:
        return True
