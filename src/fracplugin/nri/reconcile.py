"""The NRI door's Synchronize (``Reconciler``, its steps in ``synchronize``):
rebuild the ledger from the containers the runtime reports and report those
that lack fracplugin's adjustment. ``ready()`` is true after the first.
Containers found running unfenced (ADR 0035 decisions 5-9): ``_decide`` says
which, ``Unfenced`` restarts or reports them.

The module docstring of ``nri/plugin.py`` describes the behaviour and the
concurrency model; ``FracNriPlugin`` is the one class to use.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from .._proto import nri_pb2
from .. import allocation as al
from ..annotations import parse as parse_annotations
from ..model import ComputeMode, ContainerPlan, FractionError, Tenancy
from ..dra import ENV_CLAIM, claim_tenancies_of
from ..ledger import keep_charge
from ..mps.api import MpsApi
from ..noderules import NodeRules
from ..planner import ENV_MEMORY_LIMIT, ENV_MEMORY_REQUEST, ENV_PINNED_LIMIT, ENV_VISIBLE_DEVICES
from ..reservations import unbind_gone
from .admission import PodReader
from .namespaces import Namespaces
from .orphans import mps_namespaces
from .pluginbase import _env_map, _pod_ref, needs_spec

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log

_HOLD_RANK = {nri_pb2.CONTAINER_RUNNING: 4, nri_pb2.CONTAINER_PAUSED: 3, nri_pb2.CONTAINER_CREATED: 2,
              nri_pb2.CONTAINER_UNKNOWN: 1, nri_pb2.CONTAINER_STOPPED: 0}
"""Which of several containers of one (pod, container name) a Synchronize
lists holds (``Reconciler._holders``): the running one before a paused,
created, unknown (what older runtimes report) or stopped one."""

FENCE_KEYS = (ENV_MEMORY_REQUEST, ENV_MEMORY_LIMIT, ENV_PINNED_LIMIT)
"""Only an adjustment gives these: a container with none is unfenced, one with
any (whatever the value) has an adjustment (ADR 0035 decision 5)."""
RECHECK_S = 1.0  # seconds between decisions on the containers waiting for their pod's spec

class Reconciler:
    """Synchronize (module docstring); owns the last report (``unadjusted``)
    and whether one ran (``ready``)."""

    def __init__(self, rules: NodeRules, reader: PodReader, namespaces: Namespaces, mps: MpsApi,
                 unfenced: Unfenced | None = None) -> None:
        self.rules = rules
        self.reader = reader
        self.namespaces = namespaces
        self.mps = mps
        self._synced = threading.Event()
        self.unadjusted: list[dict[str, Any]] = []
        """Containers found by the last Synchronize that lack our env (dicts
        with pod, container, container_id, missing, different)."""
        self.unfenced = unfenced or Unfenced()
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[nri_pb2.PodSandbox, nri_pb2.Container]] = {}  # by container id
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def ready(self) -> bool:
        """True after the first Synchronize rebuilt the ledger."""
        return self._synced.is_set()

    def synchronize(self, pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]) -> None:
        """Rebuild the ledger from what runs, then release the early MPS
        namespaces of pods the runtime no longer reports (``nri/early.py``),
        then reconcile the MPS layer's namespaces with the runtime's pods
        (``nri/orphans.py``: adopt a live pod's unheld ones, release those of
        pods gone while the doors did not see it)."""
        self._rebuild(pods, containers)
        if self.rules.limits is not None:  # watch the leaves of running containers started before us (ADR 0036)
            self.rules.limits.adopt(pods, containers, self.rules.ledger)
        live = {p.id for p in pods}
        self.namespaces.release_early(lambda uid, sandbox: sandbox not in live)
        self._reconcile_mps_namespaces(pods)

    def _rebuild(self, pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]) -> None:
        """Rebuild the ledger from what runs and re-ensure its namespaces."""
        pods_by_id = {p.id: p for p in pods}
        tenancies: list[Tenancy] = []
        recorded: set[tuple[str, str]] = set()
        shared: dict[str, tuple[int, list[Tenancy]]] = {}  # kubelet hold -> (its holder's rank, its entries)
        unadjusted: list[dict[str, Any]] = []
        unfenced: list[tuple[nri_pb2.PodSandbox, nri_pb2.Container]] = []
        for c in self._holders(pods_by_id, containers):
            pod = pods_by_id[c.pod_sandbox_id]
            fields = {"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid, "container": c.name, "container_id": c.id}
            key = self.reader.reservation_key(c, fields)
            if key:
                # kubelet's allocation: recorded as it runs, never refused.
                try:
                    p, _ignored = self.reader.plan_running_reserved(pod, c.name, key)
                except FractionError as err:
                    log.warning("nri sync: running container's annotations are refused; recorded request-sized",
                                extra={**fields, "key": err.key, "value": err.value, "rule": err.reason})
                    p = None
                if p is not None:
                    # an init's devices reused by the app: one hold (ADR 0033), held by the container
                    # that runs (an exited init listed beside its running app holds nothing); an exited
                    # container leaves the reservation with its pod, unbound from it (as at its Stop)
                    hold = self.reader.hold(key)
                    rank = _HOLD_RANK.get(c.state, 0)
                    if hold not in shared or rank > shared[hold][0]:
                        cid = "" if c.state == nri_pb2.CONTAINER_STOPPED else c.id
                        shared[hold] = (rank, al.to_tenancies(p, cid, door=al.DOOR_ALLOCATE, reservation=hold))
                    recorded.add((pod.uid, c.name))
                    continue
            try:
                p, adjusted = self._replan(pod, c)
            except FractionError as err:
                log.warning(
                    "nri sync: running container has annotations fracplugin refuses; not recorded",
                    extra={**fields, "key": err.key, "value": err.value, "rule": err.reason},
                )
                continue
            if p is None:
                tenancies.extend(self._unadjusted_gpu_user(pod, c, fields))
                continue
            env = _env_map(c)
            limits = self.rules.limits
            withheld = limits.withheld_keys() if limits is not None else ()
            missing = sorted(k for k in p.env if k not in env and k not in withheld)
            different = sorted(k for k in p.env if k in env and env[k] != p.env[k])
            if missing or different:
                unadjusted.append({**fields, "missing": missing, "different": different})
                log.warning(
                    "nri sync: container should carry fracplugin's adjustment but does not",
                    extra={**fields, "missing": missing, "different": different},
                )
                unfenced.append((pod, c))  # maybe: _decide says
            if not adjusted and p.placed_by_node:
                # Unknown placement: it never got our devices; do not invent one.
                continue
            tenancies.extend(al.to_tenancies(p, c.id))
            recorded.add((pod.uid, c.name))
        # Keep kubelet's reservations NRI did not re-derive (bound or not:
        # kubelet frees them, not the runtime; PodResources reconciles them),
        # whole GPUs of other device plugins, and DRA claims (kubelet's
        # Unprepare frees them, ADR 0031).
        tenancies.extend(t for _rank, held in shared.values() for t in held)
        reserved = set(shared)
        rebuilt = list(tenancies)
        live = {c.id for c in containers}  # a kept reservation's container the runtime no longer runs is unbound
        self.rules.ledger.transform(lambda cur: keep_charge(rebuilt, cur) + unbind_gone([
            t for t in cur if (t.door in (al.DOOR_ALLOCATE, al.DOOR_OTHER_PLUGIN) and t.reservation not in reserved)
            or t.door == al.DOOR_DRA],
            live))
        self.namespaces.renew(tenancies)
        self.unadjusted = unadjusted
        self._synced.set()
        log.info(
            "nri synchronized",
            extra={"pods": len(pods), "containers": len(containers), "tenancies": len(tenancies), "unadjusted": len(unadjusted)},
        )
        self._wait_unfenced(unfenced)

    def _wait_unfenced(self, unfenced: list[tuple[nri_pb2.PodSandbox, nri_pb2.Container]]) -> None:
        """Decide each unfenced container now; those whose pod cannot be read
        yet wait for the recheck thread (``_recheck``)."""
        waiting = {c.id: (pod, c) for pod, c in unfenced if self._decide(pod, c, "at Synchronize") is None}
        with self._lock:
            self._waiting = waiting
            if waiting and self._thread is None and self.reader.pod_lookup is not None:
                self._closed.clear()
                self._thread = threading.Thread(target=self._recheck, name="fracplugin-unfenced", daemon=True)
                self._thread.start()

    def _decide(self, pod: nri_pb2.PodSandbox, c: nri_pb2.Container, when: str) -> bool | None:
        """The one decision of issue 35 item 1: is ``c`` created or running,
        without any of ``FENCE_KEYS``, and does its pod ask a fraction for it?
        True: handed to ``Unfenced.act``; False: left alone; None: the pod's
        spec decides (``needs_spec``) and the pod watch lacks it: it waits."""
        env = _env_map(c)
        if c.state not in (nri_pb2.CONTAINER_CREATED, nri_pb2.CONTAINER_RUNNING) or any(k in env for k in FENCE_KEYS):
            return False
        apps = None
        if needs_spec(pod.annotations, c.name):
            apps, _ = self.reader._containers_of(pod)
            if apps is None:
                return None
        try:
            if parse_annotations(dict(pod.annotations), c.name, prefix=self.rules.config.annotation_prefix,
                                 containers=apps) is None:
                return False
        except FractionError:
            return False
        self.unfenced.act(pod, c, f"found {when} running without fracplugin's adjustment (its env has none of "
                                  f"{', '.join(FENCE_KEYS)}: it was created while fracplugin was not attached to "
                                  "the runtime), although its pod asks for a GPU fraction for it")
        return True

    def _recheck(self) -> None:
        """Decide the waiting containers every ``RECHECK_S`` until none waits."""
        while not self._closed.wait(RECHECK_S):
            with self._lock:
                items = list(self._waiting.items())
                if not items:
                    break
            for cid, (pod, c) in items:
                if self._decide(pod, c, "when the pod watch learned its pod") is not None:
                    with self._lock:
                        self._waiting.pop(cid, None)
        with self._lock:
            self._thread = None

    def unfenced_status(self) -> dict[str, Any]:
        """``Unfenced.status()`` plus ``waiting``: containers not restarted
        while their pod's spec is unknown (issue 35 item 1)."""
        with self._lock:
            waiting = [{"pod": f"{p.namespace}/{p.name}", "pod_uid": p.uid, "container": c.name, "container_id": cid,
                        "why": "the pod watch does not know the pod's spec yet (pod-level fraction annotations)"}
                       for cid, (p, c) in self._waiting.items()]
        return {**self.unfenced.status(), "waiting": waiting}

    def close(self) -> None:
        """End the re-check thread (at its next wake)."""
        self._closed.set()


    def _holders(self, pods_by_id: Mapping[str, nri_pb2.PodSandbox],
                 containers: Sequence[nri_pb2.Container]) -> list[nri_pb2.Container]:
        """The containers that hold, in list order: one per (pod UID,
        container name). When the runtime lists several of one (a restart:
        the old container, created or exited, beside the new one), the one
        that runs holds and the others hold nothing, whatever the list's
        order (issue 34): ``_HOLD_RANK`` of its state first, then the newest
        (``created_at``, NRI v0.10+), then the one the ledger binds now,
        then the later in the list (docs/user-guide.md, "What each door decides when both are on")."""
        best: dict[tuple[str, str], tuple[tuple[int, int, int, int], nri_pb2.Container]] = {}
        for i, c in enumerate(containers):
            pod = pods_by_id.get(c.pod_sandbox_id)
            if pod is None:
                log.warning("nri sync: container without its pod", extra={"container_id": c.id, "container": c.name})
                continue
            held = 1 if c.id and self.rules.ledger.find_container_id(c.id) else 0
            rank = (_HOLD_RANK.get(c.state, 0), c.created_at, held, i)
            key = (pod.uid, c.name)
            cur = best.get(key)
            if cur is not None:
                loser = cur[1] if rank > cur[0] else c
                winner = c if loser is cur[1] else cur[1]
                log.info("nri sync: an older container of the same pod and name holds nothing; the newer one holds",
                         extra={"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid, "container": c.name,
                                "container_id": loser.id, "holder_id": winner.id})
            if cur is None or rank > cur[0]:
                best[key] = (rank, c)
        chosen = {id(c) for _rank, c in best.values()}
        return [c for c in containers if id(c) in chosen]

    def _unadjusted_gpu_user(self, pod: nri_pb2.PodSandbox, c: nri_pb2.Container, fields: Mapping[str, Any]) -> list[Tenancy]:
        """A created or running container that fracplugin did not adjust
        (no annotations, no reservation key) but whose env names GPUs of this
        node in ``NVIDIA_VISIBLE_DEVICES`` uses those GPUs unfenced: it holds
        each of them whole (door ``sync``), so placement, the free-memory guard
        and the metrics see it (issue 10 item 5). Released at its
        StopContainer / RemoveContainer."""
        if c.state not in (nri_pb2.CONTAINER_CREATED, nri_pb2.CONTAINER_RUNNING):
            return []
        env = _env_map(c)
        if claim_tenancies_of(env.get(ENV_CLAIM, ""), self.rules.ledger):
            return []  # a DRA container: its claim's hold counts its GPUs (dra/cdispec.py, ADR 0031)
        seen = [d.strip() for d in env.get(ENV_VISIBLE_DEVICES, "").split(",") if d.strip()]
        gpus = [self.rules.node.gpu_by_uuid(u) for u in seen]
        if not seen or any(g is None for g in gpus):
            return []
        log.warning("nri sync: container uses GPUs fracplugin did not give it; counted as holding them whole",
                    extra={**fields, "devices": ",".join(seen)})
        return [Tenancy(pod_uid=pod.uid, namespace=pod.namespace, pod_name=pod.name, container=c.name,
                        gpu_uuid=g.uuid, request_mib=g.memory_mib, limit_mib=g.memory_mib,  # type: ignore[union-attr]
                        mode=ComputeMode.TIME_SLICING, container_id=c.id, door=al.DOOR_SYNC,
                        reservation=f"{al.DOOR_SYNC}:{c.id}={g.uuid}")  # type: ignore[union-attr]
                for g in gpus]

    def _replan(self, pod: nri_pb2.PodSandbox, c: nri_pb2.Container) -> tuple[ContainerPlan | None, bool]:
        """Plan a running container against an empty ledger (no guard refusals),
        on the devices its env says it got when that is our
        ``NVIDIA_VISIBLE_DEVICES``. Returns (plan or None, devices known)."""
        request = parse_annotations(dict(pod.annotations), c.name, prefix=self.rules.config.annotation_prefix)
        if request is None:
            return None, False
        env = _env_map(c)
        seen = [d.strip() for d in env.get(ENV_VISIBLE_DEVICES, "").split(",") if d.strip()]
        known = bool(seen) and all(self.rules.node.gpu_by_uuid(u) is not None for u in seen)
        if known:
            request = dataclasses.replace(request, devices=tuple(seen), num_devices=len(seen))
        p = self.rules.replan(request, _pod_ref(pod))
        return p, known or not p.placed_by_node

    def _reconcile_mps_namespaces(self, pods: Iterable[nri_pb2.PodSandbox]) -> dict[str, int]:
        """Compare the MPS layer's namespaces with ``pods`` (Synchronize's
        sandboxes) and the ledger: adopt those of live pods nothing holds
        into the early table, queue the release of those of
        pods the runtime no longer has (``nri/orphans.py``). Returns
        ``{"held", "adopted", "orphaned"}`` (counts of this call). Never
        raises: an error is logged, nothing is released."""
        counts = {"held": 0, "adopted": 0, "orphaned": 0}
        try:
            doc = self.mps.status()
            found = mps_namespaces(doc)
        except Exception:
            log.exception("nri sync: the MPS layer's namespaces could not be read; not reconciled")
            return counts
        if not found:
            if isinstance(doc, dict) and doc.get("reachable") is False:
                log.info("nri sync: the MPS role is not reachable; its namespaces are not reconciled",
                         extra={"reason": str(doc.get("error", ""))})
            return counts
        live = {p.uid: p.id for p in pods}  # the last sandbox listed of each pod UID
        counts, orphans = self.namespaces.adopt(found, live)
        if counts["adopted"] or orphans:
            log.info("nri sync: MPS namespaces reconciled with the runtime",
                     extra={**counts, "pod_uid": ",".join(sorted({ns.owner[0] for ns in orphans}))})
        for ns in orphans:
            self.namespaces.release_orphan(ns)
        return counts


class Unfenced:
    """What is done with a container ``Reconciler._decide`` found unfenced
    (ADR 0035 decisions 7-9): ``restart`` evicts its pod (``restarter``) at
    most once per pod name per ``window``, ``report`` (or no restarter) reports
    once per container; each with a Warning Event (``events.unfenced``) and a
    count. ``clock``: monotonic seconds. Thread-safe (one lock)."""

    BACKOFF_S = 300.0
    BACKOFF_MAX_S = 3600.0

    def __init__(self, mode: str = "report", restarter: Any = None, events: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mode, self.restarter, self.events, self.clock = mode, restarter, events, clock
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], tuple[int, float, str]] = {}  # (ns, name) -> (restarts, last, UID)
        self._reported: dict[str, None] = {}  # container ids reported, oldest first
        self.counts = {"restarted": 0, "reported": 0, "backed_off": 0}

    def window(self, restarts: int) -> float:
        """Seconds after a pod's ``restarts``-th restart before the next (0 for none)."""
        return min(self.BACKOFF_S * 2 ** (restarts - 1), self.BACKOFF_MAX_S) if restarts else 0.0

    def act(self, pod: nri_pb2.PodSandbox, c: nri_pb2.Container, why: str) -> str:
        """Returns ``restarted``, ``backed_off``, ``reported`` or ``asked``
        (nothing new). Never blocks (the restarter evicts on its thread)."""
        ref, key, now = _pod_ref(pod), (pod.namespace, pod.name), self.clock()
        restart = self.mode == "restart" and self.restarter is not None
        with self._lock:
            n, last, uid = self._pods.get(key, (0, float("-inf"), ""))
            if now - last > 2 * self.BACKOFF_MAX_S:
                n = 0
            left = last + self.window(n) - now
            if not restart:
                if c.id in self._reported:
                    return "asked"
                self._reported[c.id] = None
                while len(self._reported) > 4096:
                    self._reported.pop(next(iter(self._reported)))
                action = "reported"
            elif left > 0 and uid == pod.uid:
                return "asked"
            elif left > 0:
                action = "backed_off"
            else:
                self._pods.pop(key, None)
                self._pods[key] = (n + 1, now, pod.uid)
                while len(self._pods) > 4096:
                    self._pods.pop(next(iter(self._pods)))
                action = "restarted"
            self.counts[action] += 1
        if action == "restarted":
            msg = f"{why}; restarting it so that it comes back fenced: evicting pod {ref} (restart {n + 1} of this pod)"
        elif action == "backed_off":
            msg = (f"{why}; not restarted: pod {ref.namespace}/{ref.name} came back unfenced after {n} restart(s) "
                   f"for this, the last {now - last:.0f} s ago; the next no sooner than in {left:.0f} s (backoff)")
        else:
            msg = f"{why}; not restarted: " + (
                "no API access to evict its pod" if self.mode == "restart" else "--unfenced-containers report")
        log.warning("nri: a fractional container runs unfenced", extra={
            "pod": str(ref), "pod_uid": ref.uid, "container": c.name, "container_id": c.id, "action": action})
        if self.events is not None:
            self.events.unfenced(ref, c.name, msg, {"restarted": "Restart", "backed_off": "Backoff"}.get(action, "Report"))
        if action == "restarted":
            self.restarter.restart(ref, c.name, msg)
        return action

    def status(self) -> dict[str, Any]:
        """``{mode, restarted, reported, backed_off, backoff: [{pod, restarts, next_restart_in_s}], restarts}``."""
        now = self.clock()
        with self._lock:
            backoff = [{"pod": f"{k[0]}/{k[1]}", "restarts": n, "next_restart_in_s": round(last + self.window(n) - now, 1)}
                       for k, (n, last, _uid) in self._pods.items() if last + self.window(n) > now]
            out: dict[str, Any] = {"mode": self.mode, **self.counts, "backoff": backoff}
        out["restarts"] = self.restarter.stats() if self.restarter is not None else None
        return out
