"""Finding the pod behind an Allocate call (which carries only device IDs).

docs/reference/kubelet-device-plugin.md A.5/A.6: kubelet calls Allocate once per
container during pod admission, naming device IDs only. We keep a watch cache of
the pods bound to this node (``spec.nodeName=<node>``) and pick the candidates
among them (``select_candidates``).

Pods are plain dicts in the Kubernetes JSON shape (camelCase keys, as the API
server, ``ApiClient.sanitize_for_serialization`` and the YAML examples give
them): ``metadata.{name,namespace,uid,annotations,creationTimestamp,deletionTimestamp}``,
``spec.{nodeName,containers,initContainers}`` with ``resources.{requests,limits}``,
``status.{phase,containerStatuses,initContainerStatuses}``.

Malformed pods (wrong JSON types where the lookup reads, ``pod_problem``)
are skipped with a warning naming the pod, whether they come from a list, a
watch event or the caller: one bad object never breaks the cache or the watch.

Concurrency model: both sources are thread-safe. ``InMemoryPodSource`` is
mutated by the caller; ``KubernetesPodSource`` runs one daemon thread
(list, then watch; relist on 410 Gone or any error, with backoff) that writes
the store under a lock and notifies waiters through a condition variable.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

from ..logs import guarded

log = logging.getLogger(__name__)

Pod = Mapping[str, Any]
_TERMINAL = ("Succeeded", "Failed")
_COUNT = re.compile(r"[0-9]{1,18}", re.ASCII)
REQUEST_TIMEOUT_S = 30.0  # client read timeout of the pod list/watch requests, seconds


@runtime_checkable
class PodSource(Protocol):
    """Where Allocate finds pods: a watch cache of the pods on this node."""

    def candidates(self, resource_name: str, count: int) -> list[Pod]:
        """Pods bound to this node, not terminal and not being deleted, with at
        least one container (init or app) requesting exactly ``count`` of
        ``resource_name``. Any order."""
        ...

    def get(self, namespace: str, name: str) -> Pod | None:
        """One pod of the cache by namespace/name, or None."""
        ...

    def ready(self) -> bool:
        """True when the cache is synced and its API connection is up."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block until the cache changes or ``timeout_s`` passes; True on a change."""
        ...


def resource_count(container: Mapping[str, Any], resource_name: str) -> int:
    """How many of ``resource_name`` one container requests: ``resources.limits``
    (extended resources must have requests == limits; limits win when both are
    given, as kubelet's device manager reads limits), else ``resources.requests``.
    0 when absent or not an integer."""
    res = container.get("resources") or {}
    for part in ("limits", "requests"):
        val = (res.get(part) or {}).get(resource_name)
        if val is not None:
            if isinstance(val, bool):
                return 0
            text = str(val) if isinstance(val, (int, str)) else ""
            # A device count is a plain decimal quantity (ASCII digits; int()
            # alone would take Unicode digits and fail past 4300 digits).
            return int(text) if _COUNT.fullmatch(text) else 0
    return 0


def pod_problem(pod: Any) -> str | None:
    """Why ``pod`` cannot be used as a pod (None when it can).

    Only the shape the lookup reads is checked, as the Kubernetes API types it
    (core/v1 Pod): the pod, ``metadata``, ``spec``, ``status`` and each
    ``resources`` / ``limits`` / ``requests`` are objects; ``metadata.annotations``
    is a map of string to string; ``spec.containers`` / ``spec.initContainers``
    and ``status.containerStatuses`` / ``status.initContainerStatuses`` are
    lists of objects; a container's ``name`` is a string. Missing (or null)
    fields are fine: they read as empty. Never raises.
    """
    if not isinstance(pod, Mapping):
        return f"a pod must be an object, got {type(pod).__name__}"
    for part in ("metadata", "spec", "status"):
        v = pod.get(part)
        if v is not None and not isinstance(v, Mapping):
            return f"{part} must be an object, got {type(v).__name__}"
    md = pod.get("metadata") or {}
    ann = md.get("annotations")
    if ann is not None:
        if not isinstance(ann, Mapping):
            return f"metadata.annotations must be a map of strings, got {type(ann).__name__}"
        for k, v in ann.items():
            if not isinstance(k, str) or not isinstance(v, str):
                return f"metadata.annotations[{str(k)[:80]!r}] must be a string, got {type(v).__name__}"
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers"):
        lst = spec.get(key)
        if lst is None:
            continue
        if not isinstance(lst, (list, tuple)):
            return f"spec.{key} must be a list of containers, got {type(lst).__name__}"
        for i, c in enumerate(lst):
            if not isinstance(c, Mapping):
                return f"spec.{key}[{i}] must be an object, got {type(c).__name__}"
            if c.get("name") is not None and not isinstance(c.get("name"), str):
                return f"spec.{key}[{i}].name must be a string"
            res = c.get("resources")
            if res is None:
                continue
            if not isinstance(res, Mapping):
                return f"spec.{key}[{i}].resources must be an object, got {type(res).__name__}"
            for part in ("limits", "requests"):
                v = res.get(part)
                if v is not None and not isinstance(v, Mapping):
                    return f"spec.{key}[{i}].resources.{part} must be an object, got {type(v).__name__}"
    status = pod.get("status") or {}
    for key in ("initContainerStatuses", "containerStatuses"):
        lst = status.get(key)
        if lst is None:
            continue
        if not isinstance(lst, (list, tuple)) or not all(isinstance(x, Mapping) for x in lst):
            return f"status.{key} must be a list of objects"
    return None


def describe_pod(pod: Any) -> str:
    """``namespace/name`` (or ``uid``) of a possibly malformed pod, for messages; never raises."""
    md = pod.get("metadata") if isinstance(pod, Mapping) else None
    if not isinstance(md, Mapping):
        return "<pod without metadata>"
    name, ns = md.get("name"), md.get("namespace") or "default"
    if name:
        return f"{str(ns)[:80]}/{str(name)[:120]}"
    return f"uid {str(md.get('uid') or '?')[:80]}"


def pod_uid(pod: Pod) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def pod_key(pod: Pod) -> str:
    md = pod.get("metadata") or {}
    return f"{md.get('namespace') or 'default'}/{md.get('name') or ''}"


def _created_container_names(pod: Pod) -> set[str]:
    """Containers the runtime already created (status has a containerID):
    kubelet allocated them long ago."""
    status = pod.get("status") or {}
    out: set[str] = set()
    for key in ("initContainerStatuses", "containerStatuses"):
        for st in status.get(key) or ():
            if st.get("containerID"):
                out.add(str(st.get("name")))
    return out


def _live_on_node(pod: Pod, node_name: str | None) -> bool:
    md = pod.get("metadata") or {}
    if md.get("deletionTimestamp"):
        return False
    if ((pod.get("status") or {}).get("phase") or "") in _TERMINAL:
        return False
    if node_name is not None and (pod.get("spec") or {}).get("nodeName") != node_name:
        return False
    return True


_FRACTION_KEYS = ("gpu-fraction", "gpu-memory", "gpu-fraction.limit", "gpu-fraction-num-devices",
                  "gpu-fraction-container-name")
_FRACTION_SUFFIXES = (".gpu-memory.request", ".gpu-memory.limit", ".gpu-compute.mode", ".gpu-compute.portion",
                      ".gpus.devices", ".gpu-memory.portion.limit")


def _wanted(pod: Pod, resource_name: str) -> bool:
    """Pods the cache keeps: those requesting the resource (Allocate's
    candidates) and those with GPU-fraction annotations, pod-level KAI forms or
    per-container keys whatever their prefix (the NRI door reads their spec:
    which containers exist, which is the first app container; ADR 0007)."""
    spec = pod.get("spec") or {}
    if any(resource_count(c, resource_name) > 0 for k in ("initContainers", "containers") for c in spec.get(k) or ()):
        return True
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return any(k in _FRACTION_KEYS or str(k).endswith(_FRACTION_SUFFIXES) for k in annotations)


@dataclass(frozen=True)
class Candidate:
    """One (pod, container) that an Allocate of ``count`` devices may be for.

    ``order`` sorts candidates: (creationTimestamp, init first, spec position,
    namespace/name)."""

    pod: Pod
    container: str
    init: bool
    order: tuple[str, int, int, str]

    @property
    def uid(self) -> str:
        return pod_uid(self.pod)

    @property
    def key(self) -> tuple[str, str]:
        """(pod uid, container): the identity served-tracking and the ledger use."""
        return (self.uid, self.container)


def select_candidates(
    pods: Iterable[Pod],
    resource_name: str,
    count: int,
    served: Callable[[str, str], bool] = lambda _u, _c: False,
) -> list[Candidate]:
    """Every container of ``pods`` that requests exactly ``count`` of
    ``resource_name``, was not created yet, and is not ``served(uid, container)``,
    oldest pod first, init containers before app containers (reference A.5).

    Inside one pod only the *first* such container is a candidate: kubelet
    allocates a pod's containers in order, so a later container of the same pod
    cannot be the one being admitted while an earlier one is pending.
    """
    out: list[Candidate] = []
    for pod in pods:
        md = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        created = _created_container_names(pod)
        uid = pod_uid(pod)
        ts = str(md.get("creationTimestamp") or "")
        done = False
        for init, key in ((0, "initContainers"), (1, "containers")):
            for pos, c in enumerate(spec.get(key) or ()):
                n = resource_count(c, resource_name)
                if n <= 0:
                    continue
                name = str(c.get("name") or "")
                if name in created or served(uid, name):
                    continue
                # The first unserved container of this pod that uses the resource.
                if n == count:
                    out.append(Candidate(pod, name, init == 0, (ts, init, pos, pod_key(pod))))
                done = True
                break
            if done:
                break
    out.sort(key=lambda c: c.order)
    return out


def _pending_counts(pod: Pod) -> set[tuple[str, int]]:
    """Every (resource name, count) a container of the pod requests, for
    resources with a domain (``<domain>/<name>``: extended resources), among
    the containers the runtime has not created yet (no ``containerID`` in the
    status): the only ones kubelet may still call Allocate for, hence the only
    ones ``select_candidates`` can return. A pod whose containers all run is
    in no bucket, so an Allocate looks at the pending pods only (issue 14)."""
    out: set[tuple[str, int]] = set()
    spec = pod.get("spec") or {}
    created = _created_container_names(pod)
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or ():
            if str(c.get("name") or "") in created:
                continue
            res = c.get("resources") or {}
            names = set((res.get("limits") or {})) | set((res.get("requests") or {}))
            for name in names:
                if "/" in str(name):
                    n = resource_count(c, str(name))
                    if n > 0:
                        out.add((str(name), n))
    return out


class _Store:
    """Thread-safe pod store with a (resource, count) index of the pending
    pods (live: on this node, not terminal, not being deleted; and with a
    container using the resource that the runtime has not created yet), so a
    lookup does not scan every pod (``_pending_counts``)."""

    def __init__(self, node_name: str | None, resource_name: str | None) -> None:
        self.node_name = node_name
        self.resource_name = resource_name
        self._pods: dict[str, Pod] = {}
        self._names: dict[tuple[str, str], str] = {}  # (namespace, name) -> key
        self._index: dict[tuple[str, int], dict[str, Pod]] = {}
        self._indexed: dict[str, set[tuple[str, int]]] = {}
        self._cond = threading.Condition()
        self._version = 0
        self.on_delete: list[Callable[[Pod], None]] = []

    def _key(self, pod: Pod) -> str:
        return pod_uid(pod) or pod_key(pod)

    def _unindex(self, key: str) -> None:
        for ent in self._indexed.pop(key, ()):
            bucket = self._index.get(ent)
            if bucket is not None:
                bucket.pop(key, None)
                if not bucket:
                    del self._index[ent]

    @staticmethod
    def _name_of(pod: Pod) -> tuple[str, str]:
        md = pod.get("metadata") or {}
        return (str(md.get("namespace") or "default"), str(md.get("name") or ""))

    def _insert(self, key: str, pod: Pod) -> None:
        self._unindex(key)
        self._pods[key] = pod
        self._names[self._name_of(pod)] = key
        if _live_on_node(pod, self.node_name):
            ents = _pending_counts(pod)
            self._indexed[key] = ents
            for ent in ents:
                self._index.setdefault(ent, {})[key] = pod

    def put(self, pod: Pod) -> None:
        problem = pod_problem(pod)
        if problem is not None:  # never let one bad object break the cache
            log.warning("pod %s skipped: %s", describe_pod(pod), problem)
            return
        if self.resource_name is not None and not _wanted(pod, self.resource_name):
            self.remove(pod)
            return
        with self._cond:
            key = self._key(pod)
            before = self._pods.get(key)
            self._insert(key, pod)
            self._version += 1
            self._cond.notify_all()
        phase = (pod.get("status") or {}).get("phase") or ""
        if phase in _TERMINAL and (before is None or ((before.get("status") or {}).get("phase") or "") not in _TERMINAL):
            # kubelet frees a finished pod's devices (Succeeded / Failed): the
            # same callbacks as a deletion (ADR 0007, lifetimes).
            self._deleted([pod], "pod finished callback")

    def remove(self, pod: Pod) -> None:
        if not isinstance(pod, Mapping) or not isinstance(pod.get("metadata") or {}, Mapping):
            log.warning("pod deletion of %s skipped: not a pod object", describe_pod(pod))
            return
        with self._cond:
            key = self._key(pod)
            old = self._pods.pop(key, None)
            if old is not None and self._names.get(self._name_of(old)) == key:
                del self._names[self._name_of(old)]
            self._unindex(key)
            self._version += 1
            self._cond.notify_all()
        if old is not None:
            self._deleted([old])

    def replace(self, pods: Iterable[Pod]) -> None:
        new = {}
        for p in pods:
            problem = pod_problem(p)
            if problem is not None:
                log.warning("pod %s skipped: %s", describe_pod(p), problem)
                continue
            if self.resource_name is None or _wanted(p, self.resource_name):
                new[self._key(p)] = p
        with self._cond:
            gone = [p for k, p in self._pods.items() if k not in new]
            self._pods = {}
            self._names = {}
            self._index = {}
            self._indexed = {}
            for k, p in new.items():
                self._insert(k, p)
            self._version += 1
            self._cond.notify_all()
        self._deleted(gone)

    def _deleted(self, pods: Iterable[Pod], what: str = "pod delete callback") -> None:
        """Run the ``on_delete`` callbacks for each of ``pods`` (outside the lock)."""
        for pod in pods:
            for cb in list(self.on_delete):
                guarded(log, what, cb, pod)

    def candidates(self, resource_name: str, count: int) -> list[Pod]:
        with self._cond:
            return list(self._index.get((resource_name, count), {}).values())

    def get(self, namespace: str, name: str) -> Pod | None:
        with self._cond:
            key = self._names.get((namespace, name))
            return self._pods.get(key) if key is not None else None

    def pods(self) -> list[Pod]:
        with self._cond:
            return list(self._pods.values())

    def wait(self, timeout_s: float) -> bool:
        with self._cond:
            v = self._version
            return self._cond.wait_for(lambda: self._version != v, timeout=max(timeout_s, 0.0))

    def __len__(self) -> int:
        with self._cond:
            return len(self._pods)


class _StoreBackedSource:
    """The PodSource methods both sources answer from their ``_Store``;
    subclasses set ``self._store`` and ``self._ready``."""

    _store: _Store
    _ready: bool

    def candidates(self, resource_name: str, count: int) -> list[Pod]:
        return self._store.candidates(resource_name, count)

    def get(self, namespace: str, name: str) -> Pod | None:
        return self._store.get(namespace, name)

    def ready(self) -> bool:
        return self._ready

    def wait(self, timeout_s: float) -> bool:
        return self._store.wait(timeout_s)

    def pods(self) -> list[Pod]:
        return self._store.pods()

    def __len__(self) -> int:
        return len(self._store)

    def subscribe_deleted(self, callback: Callable[[Pod], None]) -> None:
        """Call ``callback(pod)`` when a pod leaves the cache or reaches
        Succeeded / Failed (kubelet frees its devices either way)."""
        self._store.on_delete.append(callback)


class InMemoryPodSource(_StoreBackedSource):
    """A PodSource fed by the caller (tests, the demo, the benchmark).

    Args:
        node_name: only pods with ``spec.nodeName`` equal to it are candidates
            (None: every pod).
        pods: initial pods.
    """

    def __init__(self, node_name: str | None = None, pods: Iterable[Pod] = ()) -> None:
        self._store = _Store(node_name, None)
        self._ready = True
        for p in pods:
            self._store.put(p)

    def add(self, pod: Pod) -> None:
        """Add or replace a pod (keyed by uid, else namespace/name)."""
        self._store.put(pod)

    def delete(self, pod: Pod) -> None:
        """Remove a pod (as a watch DELETED event would)."""
        self._store.remove(pod)

    def set_ready(self, ready: bool) -> None:
        """Simulate the API connection going down (False) or up (True)."""
        self._ready = ready


class KubernetesPodSource(_StoreBackedSource):
    """A PodSource backed by the API server (kubernetes Python client).

    List, then watch pods with field selector ``spec.nodeName=<node_name>``;
    relist on ``410 Gone``, on a closed watch, or on any error (exponential
    backoff 0.5 s .. 30 s). Only pods that request ``resource_name`` are kept
    (all pods when None). ``ready()`` is False until the first list succeeds
    and while the connection is failing.

    Args:
        node_name: this node's name.
        resource_name: the extended resource to keep pods for.
        api_client: a ``kubernetes.client.ApiClient``; None loads in-cluster
            config, then the kubeconfig.
        watch_timeout_s: server-side watch timeout before a re-watch.
    """

    def __init__(
        self,
        node_name: str,
        resource_name: str | None = None,
        api_client: Any = None,
        *,
        watch_timeout_s: int = 300,
    ) -> None:
        self.node_name = node_name
        self._store = _Store(node_name, resource_name)
        self._api_client = api_client
        self._watch_timeout_s = watch_timeout_s
        self._ready = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self.last_error: str | None = None

    def start(self) -> None:
        """Start the list/watch thread (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fracplugin-podwatch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; waits up to ``timeout_s`` (a watch blocked in a read
        ends at its read timeout; the thread is a daemon)."""
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout_s)

    def _client(self) -> Any:
        from kubernetes import client, config  # heavy import, only when used

        if self._api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api_client = client.ApiClient()
        return client.CoreV1Api(self._api_client)

    def _run(self) -> None:
        from kubernetes import watch

        backoff = 0.5
        selector = f"spec.nodeName={self.node_name}"
        while not self._stop.is_set():
            try:
                v1 = self._client()
                lst = v1.list_pod_for_all_namespaces(
                    field_selector=selector, _request_timeout=REQUEST_TIMEOUT_S
                )
                ser = self._api_client.sanitize_for_serialization
                self._store.replace(ser(p) for p in lst.items)
                self._ready = True
                self.last_error = None
                backoff = 0.5
                rv = lst.metadata.resource_version
                self._watch = watch.Watch()
                for ev in self._watch.stream(
                    v1.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=rv,
                    timeout_seconds=self._watch_timeout_s,
                    _request_timeout=self._watch_timeout_s + REQUEST_TIMEOUT_S,
                ):
                    if self._stop.is_set():
                        break
                    kind = ev.get("type") if isinstance(ev, Mapping) else None
                    obj = ev.get("object") if isinstance(ev, Mapping) else None
                    if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old
                        code = obj.get("code") if isinstance(obj, dict) else getattr(obj, "code", None)
                        log.info("pod watch error event (code %s); relisting", code)
                        break
                    try:
                        pod = obj if isinstance(obj, Mapping) else ser(obj)
                        if kind == "DELETED":
                            self._store.remove(pod)
                        elif kind in ("ADDED", "MODIFIED"):
                            self._store.put(pod)
                    except Exception as e:  # one odd object must not end the watch
                        log.warning("pod watch event %s skipped: %s: %s", kind, type(e).__name__, e)
            except Exception as e:  # ApiException, urllib3 errors, config errors
                self._ready = False
                self.last_error = str(e)
                log.warning("pod watch on node %s failed: %s (retry in %.1f s)", self.node_name, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
        self._ready = False

