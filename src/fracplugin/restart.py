"""Restart a running container: the one action behind ``--over-limit restart``
(issue 35 item 3) and ``--unfenced-containers restart`` (item 1).

Route (ADR 0035 decision 4, which says why not NRI or CRI): the Kubernetes Eviction API, ``POST
/api/v1/namespaces/<ns>/pods/<name>/eviction`` (``policy/v1``, a UID precondition so a new pod of the same
name is never hit). The pod's controller recreates it; a PodDisruptionBudget's 429 is logged and counted,
not retried.

Concurrency: ``restart`` returns at once; each request runs on its own short
daemon thread, bounded by ``request_timeout_s``, at most ``MAX_IN_FLIGHT``
at a time and one per pod (a second request for a pod in flight is dropped).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .events import api_error, core_v1
from .model import PodRef

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 16
"""Eviction requests in flight at once; more are dropped (counted ``failed``)."""


class Restarter:
    """Evicts pods so their containers come back (module docstring).

    Args:
        api: for ``events.core_v1``, called at the first eviction.

    ``stats()``: ``{"requested", "evicted", "failed", "last_error"}`` counts
    since construction."""

    request_timeout_s = 5.0
    """Bound of one API request, seconds."""

    def __init__(self, api: Any) -> None:
        self._api = api
        self._core: Any = None
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # pod UIDs with a request in flight
        self._counts = {"requested": 0, "evicted": 0, "failed": 0}
        self._last_error = ""

    def restart(self, pod: PodRef, container: str, why: str) -> bool:
        """Ask for ``container`` of ``pod`` to be restarted because ``why``
        (logged). Never blocks, never raises. Returns False when dropped (a
        request for the pod is in flight, or ``MAX_IN_FLIGHT`` are)."""
        with self._lock:
            if pod.uid in self._busy or len(self._busy) >= MAX_IN_FLIGHT:
                self._counts["failed"] += pod.uid not in self._busy
                return False
            self._busy.add(pod.uid)
            self._counts["requested"] += 1
        log.warning("restarting a container: evicting its pod", extra={"pod": str(pod), "container": container,
                                                                      "reason": why})
        threading.Thread(target=self._evict, args=(pod, container), name="fracplugin-restart", daemon=True).start()
        return True

    def _evict(self, pod: PodRef, container: str) -> None:
        try:
            from kubernetes import client

            core = self._core = self._core or core_v1(self._api)
            body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod.name, namespace=pod.namespace),
                                     delete_options=client.V1DeleteOptions(
                                         preconditions=client.V1Preconditions(uid=pod.uid)))
            core.create_namespaced_pod_eviction(pod.name, pod.namespace, body, _request_timeout=self.request_timeout_s)
            ok, err = True, ""
        except Exception as exc:  # ApiException (429 PDB, 404 gone), connection errors, config errors
            ok, err = False, api_error(exc)
            log.warning("pod eviction failed", extra={"pod": str(pod), "container": container, "error": err})
        with self._lock:
            self._busy.discard(pod.uid)
            self._counts["evicted" if ok else "failed"] += 1
            self._last_error = err or self._last_error

    def stats(self) -> dict[str, Any]:
        """Counts since construction and the last error (module docstring)."""
        with self._lock:
            return {**self._counts, "in_flight": len(self._busy), "last_error": self._last_error}
