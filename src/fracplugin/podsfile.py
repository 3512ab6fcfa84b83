"""The simulated API: pods read from a YAML file (``--pods-file``), fed to
an ``InMemoryPodSource`` and re-read when the file changes.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import yaml

from .logs import guarded

if TYPE_CHECKING:
    from .kubelet.podlookup import InMemoryPodSource

log = logging.getLogger("fracplugin.daemon")  # the daemon's log, as before the split

def read_pods_file(path: str) -> list[dict[str, Any]]:
    """Pod documents of a YAML file (``kind: Pod`` docs, or ``kind: List`` /
    ``PodList`` items). A missing or empty file is no pods. A pod whose shape
    the lookup cannot read (``podlookup.pod_problem``, e.g. ``containers: 'abc'``)
    is skipped with a warning naming the pod and the file. Raises ValueError
    for a file that cannot be read as YAML at all (invalid YAML, nesting too
    deep for the parser, not UTF-8, unreadable): never another exception."""
    from .kubelet.podlookup import describe_pod, pod_problem

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"pods file {path} cannot be read: {exc}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"pods file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ValueError(f"pods file {path} is nested too deeply to parse; rejected") from None
    except Exception as exc:  # the parser is not ours: any failure rejects the file, never the daemon
        raise ValueError(f"pods file {path} cannot be parsed: {type(exc).__name__}: {exc}") from None
    pods: list[dict[str, Any]] = []
    candidates: list[Any] = []
    for d in docs:
        if not isinstance(d, dict):
            log.warning("pods file %s: a document that is not an object (%s) skipped", path, type(d).__name__)
            continue
        if d.get("kind") in ("List", "PodList"):
            items = d.get("items") or []
            if not isinstance(items, list):
                log.warning("pods file %s: a %s whose items are not a list skipped", path, d.get("kind"))
                continue
            candidates.extend(items)
        elif d.get("kind", "Pod") == "Pod" and isinstance(d.get("metadata"), dict):
            candidates.append(d)
    for pod in candidates:
        problem = pod_problem(pod)
        if problem is not None:
            log.warning("pods file %s: pod %s skipped: %s", path, describe_pod(pod), problem,
                        extra={"path": path, "pod": describe_pod(pod)})
            continue
        pods.append(pod)
    return pods


class PodsFileWatcher:
    """Feeds an ``InMemoryPodSource`` from a YAML file, re-read when its
    (mtime, size) changes; pods that disappear from the file are deleted
    (like watch DELETED events).

    Concurrency: one daemon thread polling every ``poll_s`` seconds.
    """

    def __init__(self, path: str, source: InMemoryPodSource, poll_s: float = 0.1) -> None:
        self.path = path
        self.source = source
        self.poll_s = poll_s
        self._seen: dict[str, dict[str, Any]] = {}
        self._stamp: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _key(pod: Mapping[str, Any]) -> str:
        md = pod.get("metadata") or {}
        return str(md.get("uid") or f"{md.get('namespace', 'default')}/{md.get('name', '')}")

    def sync(self) -> bool:
        """Re-read the file if it changed; returns True when it was read."""
        try:
            st = os.stat(self.path)
            stamp: tuple[float, int] | None = (st.st_mtime, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            pods = read_pods_file(self.path)
        except ValueError as exc:
            log.warning("%s; keeping the %d pods read before", exc, len(self._seen),
                        extra={"path": self.path})
            return False
        now = {self._key(p): p for p in pods}
        for key, pod in self._seen.items():
            if key not in now:
                self.source.delete(pod)
        for key, pod in now.items():
            if self._seen.get(key) != pod:
                self.source.add(pod)
        self._seen = now
        log.debug("pods file read", extra={"path": self.path, "pods": len(now)})
        return True

    def start(self) -> None:
        """Read the file once (a bad file is logged, never raised: the daemon
        starts with no pods) and start polling."""
        guarded(log, f"pods file {self.path} read", self.sync)
        self._thread = threading.Thread(target=self._run, name="fracplugin-podsfile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            guarded(log, "pods file watcher", self.sync, extra={"path": self.path})  # never lets it die

    def stop(self, timeout_s: float = 1.0) -> None:
        """End the polling thread (waits at most ``timeout_s`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

