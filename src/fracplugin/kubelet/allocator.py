"""The decisions of the device plugin door (ADR 0007): Allocate,
GetPreferredAllocation and the reconciliation with kubelet's PodResources.

The gRPC server (``deviceplugin.py``) only moves bytes; everything here is
plain Python on the node, the ledger, the device table and the pod source.

Allocate checks the request (``Allocator.validate``), keys the reservation by
the device IDs, plans for the pending pods that may be the one admitted (or
answers the fallback) and records the reservation *unbound*, after every node
guard; the NRI door binds it at CreateContainer. The rules, the lifetimes of a
reservation and its pending and union holds are ADR 0007 decisions 2-5 and
ADR 0033 (docs/reference/kubelet-device-plugin.md A.5, A.6).

``Allocator`` holds Allocate, the reservation lifetimes and the PodResources
reconciliation; its ``preferred`` member (``preferred.PreferredAllocation``)
answers GetPreferredAllocation; ``counters`` (``allocbase.Counters``) counts both.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from .. import allocation as al
from .. import planner as planner_mod
from .. import annotation_lint, reservations
from ..annotations import form_targets
from ..model import ComputeMode, ContainerPlan, FractionError, FractionRequest, MemorySpec, Mount, PodRef, Tenancy
from ..ledger import holder_text
from ..noderules import NodeRules, status_of
from ..mps.layout import CONTAINER_PIPE_DIR
from . import podlookup
from ..rpcstatus import StatusCode
from .allocbase import Answer, Counters, Refusal
from .devices import DeviceIdError, DeviceTable, parse_device_id
from .preferred import PreferredAllocation

log = logging.getLogger(__name__)

RECENT_DELETED_S = 60.0  # how long a deleted, never-bound pod stays a candidate (ADR 0007 decision 2)
PODRESOURCES_GRACE_S = 30.0  # a younger reservation is never released for missing from PodResources (A.6)

class Allocator:
    """Allocate / GetPreferredAllocation / PodResources decisions.

    Args:
        rules: the node's rules (``noderules.NodeRules``): its GPUs, the shared
            ledger, the planner settings, the memory-limit gate; every plan is
            made, gated and recorded through them.
        table: the advertised devices (``devices.DeviceTable``).
        resource_name: the extended resource.
        pod_source: the watch cache (None: every Allocate is a fallback).
        allocate_deadline_s: longest an Allocate waits for its pod (seconds).
        unhealthy: ``() -> {gpu uuid: [reasons]}`` of GPUs Unhealthy now.
        policy: GetPreferredAllocation policy (``pack`` | ``spread``).
    """

    def __init__(
        self,
        rules: NodeRules,
        table: DeviceTable,
        resource_name: str,
        pod_source: podlookup.PodSource | None,
        allocate_deadline_s: float,
        unhealthy: Callable[[], Mapping[str, Sequence[str]]] = dict,
        *,
        policy: str = "pack",
    ) -> None:
        self.rules = rules
        self.node = rules.node
        ledger = self.ledger = rules.ledger
        self.planner_config = rules.config
        self.table = table
        self.unit_mib = table.unit_mib
        self.resource_name = resource_name
        self.pod_source = pod_source
        self.allocate_deadline_s = allocate_deadline_s
        self.unhealthy = unhealthy
        self.policy = policy
        self.counters = Counters()
        self._lock = threading.Lock()
        self._served: set[tuple[str, str]] = set()  # hints only: never recorded as a holder
        self._hints: dict[str, set[str]] = {}  # reservation key -> live candidate pod uids
        self._made: dict[str, float] = {}  # reservation key -> monotonic time of its Allocate
        self._holds: dict[str, str] = {}  # this Allocate's key -> the union hold it is recorded under
        self._pending_hints: dict[str, set[str]] = {}  # pending key -> live candidate pod uids (ADR 0033)
        self._deleted: list[tuple[float, Mapping[str, Any]]] = []
        # reservation key -> pod (ns/name) gone from the API while the runtime
        # still ran its container: released once no container holds it (issue 25 item 5)
        self._gone_keys: dict[str, str] = {}
        self._gone_lock = threading.Lock()
        sub = getattr(pod_source, "subscribe_deleted", None)
        if callable(sub):
            sub(self.pod_gone)
        ledger.subscribe(self._release_gone)
        self.preferred = PreferredAllocation(rules, table, policy, None if pod_source is None else self.candidates,
                                             self.counters)

    # ---- Allocate ------------------------------------------------------------
    def validate(self, device_lists: Sequence[Sequence[str]]) -> tuple[dict[str, list[str]], int]:
        """Check one Allocate request; returns ({gpu uuid: ids}, devices per GPU).
        Raises Refusal (INVALID_ARGUMENT / FAILED_PRECONDITION) naming the rule."""
        n = len(device_lists)
        if n != 1:
            raise Refusal(
                StatusCode.INVALID_ARGUMENT,
                f"AllocateRequest has {n} container requests; kubelet sends exactly one per call "
                "(deviceplugin v1beta1, devicemanager) and fracplugin allocates one container at a time",
                "invalid",
            )
        ids = list(device_lists[0])
        if not ids:
            raise Refusal(StatusCode.INVALID_ARGUMENT,
                          f"Allocate of {self.resource_name} names no device IDs; at least one is needed", "invalid")
        try:
            by_gpu = self.table.group(ids)
        except DeviceIdError as e:
            raise Refusal(
                StatusCode.INVALID_ARGUMENT,
                f"Allocate of {self.resource_name}: {e} (devices are <GPU-UUID>::<n> of node {self.node.name})",
                "invalid",
            ) from None
        counts = {u: len(v) for u, v in by_gpu.items()}
        if len(set(counts.values())) != 1:
            detail = ", ".join(f"{u}: {c}" for u, c in counts.items())
            raise Refusal(
                StatusCode.INVALID_ARGUMENT,
                f"Allocate of {self.resource_name} spans GPUs with different device counts ({detail}); "
                "a container gets the same memory on every GPU, so each GPU must hold the same number of devices",
                "invalid",
            )
        sick = {u: r for u, r in self.unhealthy().items() if u in by_gpu}
        if sick:
            detail = "; ".join(f"{u} ({', '.join(r)})" for u, r in sick.items())
            raise Refusal(status_of("unhealthy"),
                          f"Allocate of {self.resource_name}: devices on Unhealthy GPU(s) {detail}", "unhealthy")
        return by_gpu, next(iter(counts.values()))

    def allocate(self, device_lists: Sequence[Sequence[str]]) -> Answer:
        """Answer one Allocate (module docstring). Raises Refusal. The
        answer's env carries the reservation's proof
        (``reservations.ENV_RESERVATION_PROOF``: new for a new Allocate of
        the key, the same for a re-Allocate answered as recorded; ADR 0024).
        ``kind`` ``pending``: nothing recorded, the key is pending on the
        release of devices a running container holds (ADR 0033)."""
        by_gpu, per_gpu = self.validate(device_lists)
        key = al.reservation_key({u: [parse_device_id(d)[1] for d in v] for u, v in by_gpu.items()})
        before = self.ledger.reservation(key)
        proofs = reservations.proofs_of(self.ledger)
        was_pending = proofs.is_pending(key)
        a = self._allocate(by_gpu, per_gpu, key)
        # the same proof for the same allocation (a re-Allocate answered as recorded,
        # an app container reusing its init container's IDs: the reservation was
        # unbound or still pending); a new one when kubelet gives the IDs to another holder
        if a.kind == "pending":
            same = was_pending
        else:
            same = a.kind == "reserved" or bool(before and not before[0].bound)
        proof = proofs.current_or_issue(a.key) if same else proofs.issue(a.key)
        if a.kind == "pending":
            proofs.pend(a.key)
        elif a.kind != "reserved":
            proofs.settle(a.key)
        return dataclasses.replace(a, env={**a.env, reservations.ENV_RESERVATION_PROOF: proof})

    def _allocate(self, by_gpu: Mapping[str, list[str]], per_gpu: int, key: str) -> Answer:
        count = sum(len(v) for v in by_gpu.values())
        uuids = tuple(by_gpu)
        request_mib = per_gpu * self.unit_mib
        self.counters.bump("allocations")
        with self._lock:
            hold = reservations.hold_of(self.ledger, key)  # the key, or the union hold it is an alias of
            existing = self.ledger.reservation(hold)
            if existing and existing[0].bound:
                if self._holder_live(existing[0]):
                    return self._stored(existing, key, "a re-Allocate of a reservation whose holder is known")
            # A running container's hold ends only with that container (ADR 0033 decision 1): devices
            # one of them holds make this Allocate pending on their release, answered, nothing recorded.
            waits = reservations.running_overlaps(self.ledger, key)
            pending_on = frozenset(t.reservation for t in waits)
            if waits:
                reservations.proofs_of(self.ledger).unalias(key)
                log.warning("Allocate %s: %s names devices %s holds; answered, pending on their release (the "
                            "container waits at CreateContainer until that one stopped)", self.resource_name, key,
                            reservations.waiting_text(waits[0]))
            else:
                existing = self.ledger.reservation(key)
                if existing and existing[0].bound:
                    # The holder ended and no container of it runs: kubelet gives the devices to another pod.
                    self.ledger.release_reservation(key)
                    self._forget(key)
                self._absorb_overlapping(key)
        answer = self._answer(uuids, key, request_mib, count, pending_on)
        if pending_on:
            self.counters.bump("pending")
            return dataclasses.replace(answer, kind="pending")
        return answer

    def _answer(self, uuids: tuple[str, ...], key: str, request_mib: int, count: int,
                pending_on: frozenset[str]) -> Answer:
        """The planned answer for the pod being admitted, or the fallback
        (module docstring); ``pending_on``: the reservations whose running
        holders this one waits on (planned as if they were gone, nothing
        recorded). Raises Refusal."""
        why = "no API access configured (no pod source)"
        deadline = time.monotonic() + self.allocate_deadline_s
        while self.pod_source is not None:
            with self._lock:
                cands = self._candidates(count)
                if cands:
                    return self._allocate_for(cands, uuids, key, request_mib, count, pending_on)
                existing = self.ledger.reservation(key)
                if existing and not pending_on:  # an init container's IDs again, or a re-Allocate: same reservation
                    return self._stored(existing, key, "the same device IDs as a recorded reservation")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                why = (f"no pending pod on node {self.node.name} requests {count} {self.resource_name} "
                       f"within {self.allocate_deadline_s:.1f} s (pod deleted or API slow)")
                break
            if not self.pod_source.ready():
                why = "pod source not ready (API server unreachable or not synced)"
                break
            self.pod_source.wait(min(remaining, 0.1))
        with self._lock:
            return self._fallback(uuids, key, request_mib, True, why, pending_on=pending_on)

    def _holder_live(self, t: Tenancy) -> bool:
        """True unless the pod source shows the holder deleted or finished
        (without a pod source, or for a holder it does not know: True)."""
        if self.pod_source is None or t.pod_uid.startswith("podresources:"):
            return True
        pod = self.pod_source.get(t.namespace, t.pod_name)
        if pod is None or podlookup.pod_uid(pod) != t.pod_uid:
            return not self.pod_source.ready()
        phase = (pod.get("status") or {}).get("phase")
        return phase not in ("Succeeded", "Failed") and not (pod.get("metadata") or {}).get("deletionTimestamp")

    def _stored(self, existing: Sequence[Tenancy], key: str, why: str) -> Answer:
        plan = self._gated(self.rules.recorded(existing), f"reservation {key}")
        self.counters.bump("reserved")
        log.info("Allocate %s: %s, answered as recorded (%s)", self.resource_name, key, why)
        return Answer(dict(plan.env), plan.mounts, plan.device_uuids, key, "reserved")

    def _absorb_overlapping(self, key: str) -> None:
        """Reservations sharing a device with ``key`` (no running container
        holds one: that Allocate is pending instead): one bound to a pod is
        released (kubelet freed its devices); one not bound yet, or a pending
        key nothing blocks any more, stays one hold with ``key`` under the
        union of their devices, every key an alias of it (ADR 0007 decision 5,
        ADR 0033; ``reservations``)."""
        self._holds.pop(key, None)
        keys = {t.reservation for t in self.ledger.tenancies() if t.door == al.DOOR_ALLOCATE and t.reservation != key}
        absorbed: list[str] = []
        for other in keys:
            if not al.overlaps(other, key):
                continue
            gone = self.ledger.release_reservation(other)
            self._forget(other)
            if gone and not gone[0].bound:
                absorbed.append(other)
                log.info("reservation %s (holder not known yet) shares devices with %s: one hold (kubelet reuses "
                         "an init container's devices)", other, key)
            else:
                who = holder_text(gone[0]) if gone else "?"  # bound: namespace/pod/container
                log.info("reservation %s (%s) released: kubelet allocated its devices again (%s)", other, who, key)
        proofs = reservations.proofs_of(self.ledger)
        for other in proofs.pending_keys():
            if other != key and al.overlaps(other, key) and not reservations.running_overlaps(self.ledger, other):
                proofs.settle(other)
                absorbed.append(other)
                log.info("pending reservation %s (nothing in its way any more) shares devices with %s: one hold",
                         other, key)
        proofs.unalias(key)
        if absorbed:
            union = al.union_key([key, *absorbed])
            self._holds[key] = union
            proofs.alias([key, *absorbed], union)

    def _forget(self, key: str) -> None:
        self._hints.pop(key, None)
        self._made.pop(key, None)

    def _owners(self) -> set[tuple[str, str]]:
        return {t.owner for t in self.ledger.tenancies() if t.bound} | self._served

    def candidates(self, count: int) -> list[podlookup.Candidate]:
        """The pending pods that may be the one admitted with ``count``
        devices (under the Allocate lock; needs a pod source)."""
        with self._lock:
            return self._candidates(count)

    def _candidates(self, count: int) -> list[podlookup.Candidate]:
        assert self.pod_source is not None
        owners = self._owners()
        pods = self.pod_source.candidates(self.resource_name, count)
        return podlookup.select_candidates(pods, self.resource_name, count, lambda u, c: (u, c) in owners)

    def _recent_deleted(self, count: int) -> list[podlookup.Candidate]:
        now = time.monotonic()
        self._deleted = [(t, p) for t, p in self._deleted if now - t < RECENT_DELETED_S]
        owners = self._owners()
        pods = [p for _t, p in self._deleted]
        return podlookup.select_candidates(pods, self.resource_name, count, lambda u, c: (u, c) in owners)

    def request_for(self, cand: podlookup.Candidate, uuids: Sequence[str], request_mib: int,
                    count: int) -> tuple[FractionRequest, list[al.Ignored]]:
        """The candidate's FractionRequest under kubelet's allocation
        (``allocation.kubelet_request``). Raises FractionError for an
        annotation that breaks the contract."""
        md = cand.pod.get("metadata") or {}
        annotations = dict(md.get("annotations") or {})
        apps = form_targets(cand.pod.get("spec") or {})  # the app containers, then native sidecars
        prefix = self.planner_config.annotation_prefix
        parsed = al.parse_for_kubelet(annotations, cand.container, request_mib, prefix=prefix, containers=apps)
        smallest = min(g.memory_mib for g in self.node.gpus if g.uuid in uuids)
        return al.kubelet_request(cand.container, uuids, request_mib, count, parsed,
                                  f"resources.limits[{self.resource_name}]", gpu_memory_mib=smallest,
                                  reserve_mib=self.planner_config.reserve_mib)

    def _plan(self, cand: podlookup.Candidate, uuids: Sequence[str], key: str, request_mib: int,
              count: int, pending_on: frozenset[str] = frozenset()) -> ContainerPlan:
        md = cand.pod.get("metadata") or {}
        pod = PodRef(str(md.get("namespace") or "default"), str(md.get("name") or ""), cand.uid)
        req, ignored = self.request_for(cand, uuids, request_mib, count)
        for i in ignored:
            log.info("Allocate: pod %s container %s: %s", podlookup.pod_key(cand.pod), cand.container, i.message)
        spec = cand.pod.get("spec") or {}
        apps = form_targets(spec)
        inits = [str(c.get("name")) for c in spec.get("initContainers") or () if str(c.get("name")) not in apps]
        for x in annotation_lint.unknown_keys(dict(md.get("annotations") or {}), self.planner_config.annotation_prefix,
                                              inits + apps) + annotation_lint.ignored_forms(
                dict(md.get("annotations") or {}), self.planner_config.annotation_prefix, cand.container, apps):
            log.warning("Allocate: pod %s container %s: %s", podlookup.pod_key(cand.pod), cand.container, x.message)
        return self.rules.plan(req, pod, reservation=key, without=pending_on)

    def _allocate_for(self, cands: list[podlookup.Candidate], uuids: tuple[str, ...], key: str,
                      request_mib: int, count: int, pending_on: frozenset[str] = frozenset()) -> Answer:
        """Called under the lock with at least one candidate."""
        everyone = cands + self._recent_deleted(count)
        outcomes: list[ContainerPlan | FractionError] = []
        for c in everyone:
            try:
                outcomes.append(self._plan(c, uuids, key, request_mib, count, pending_on))
            except FractionError as e:
                outcomes.append(e)

        def settings(o: ContainerPlan | FractionError) -> Any:
            if isinstance(o, FractionError):
                return ("error", o.key, o.reason)
            # MPS v3 (issue 12): no pipe-directory mount from this door, mounts tell no pods apart
            return (tuple(sorted(o.env.items())), () if v3 else tuple(o.mounts))

        v3 = self.planner_config.mps_namespaces

        first = settings(outcomes[0])
        if len(everyone) > 1 and any(settings(o) != first for o in outcomes[1:]):
            names = ", ".join(f"{podlookup.pod_key(c.pod)}/{c.container}" for c in everyone[:5])
            self._refuse_mixed_modes(everyone, uuids, key, request_mib, count, pending_on)
            all_ts = all(isinstance(o, ContainerPlan) and o.compute_mode is ComputeMode.TIME_SLICING for o in outcomes)
            return self._fallback(
                uuids, key, request_mib, all_ts,
                f"{len(everyone)} pods may be the one admitted ({names}) and would get different settings; "
                "answering what is right for all, NRI sets the rest", hints={c.uid for c in cands},
                pending_on=pending_on)
        cand, outcome = everyone[0], outcomes[0]
        who = f"pod {podlookup.pod_key(cand.pod)} container {cand.container}"
        if len(everyone) == 1:
            self._served.add(cand.key)  # a hint for the next Allocate; the ledger records no holder
        if isinstance(outcome, FractionError):
            raise Refusal(status_of(outcome.code), f"{who}: {outcome.message}", outcome.code)
        outcome = self._record(outcome, key, who, {c.uid for c in cands}, pending_on)
        self.counters.bump("planned")
        log.info("Allocate %s: %s on %s, request %d MiB, limit %d MiB, %s (reservation %s, holder confirmed by NRI)",
                 self.resource_name, who, ",".join(uuids), outcome.request_mib, outcome.limit_mib,
                 outcome.compute_mode, key)
        return Answer(dict(outcome.env), () if v3 else outcome.mounts, uuids, key, "planned")

    def _refuse_mixed_modes(self, everyone: Sequence[podlookup.Candidate], uuids: tuple[str, ...], key: str,
                            request_mib: int, count: int, pending_on: frozenset[str] = frozenset()) -> None:
        """Candidates that want different compute modes, on GPUs that already
        hold something else: whichever pod this is, one of them would be
        refused at CreateContainer for as long as the other tenant runs (one
        mode per GPU), though kubelet admitted it. Refuse now (kubelet fails
        the admission; GetPreferredAllocation proposes other GPUs) instead of
        leaving an admitted pod stuck (issue 25 item 6, ADR 0024). Raises Refusal."""
        wanted: list[tuple[podlookup.Candidate, ComputeMode]] = []
        for c in everyone:
            try:
                wanted.append((c, self.request_for(c, uuids, request_mib, count)[0].compute_mode))
            except FractionError:
                continue  # refused whatever the GPU
        if len({m for _c, m in wanted}) < 2:
            return
        for u in uuids:
            others = [t for t in self.ledger.tenants(u) if t.reservation != key and t.reservation not in pending_on]
            if others:
                g = self.node.gpu_by_uuid(u)
                t = others[0]
                held = holder_text(t)
                want = ", ".join(f"{podlookup.pod_key(c.pod)}/{c.container} {m.value}" for c, m in wanted[:5])
                raise Refusal(
                    StatusCode.FAILED_PRECONDITION,
                    f"Allocate of {self.resource_name} on GPU {g.index if g else '?'} ({u}): the pods that may be "
                    f"the one admitted want different compute modes ({want}) and the GPU is already held by "
                    f"{held} ({t.mode.value}); one compute mode per GPU, so one of them would be refused at "
                    "CreateContainer for as long as that tenant runs. Devices of a GPU with no other tenant "
                    "(GetPreferredAllocation proposes them) avoid this", "mode_ambiguous")

    def _gated(self, plan: ContainerPlan, who: str) -> ContainerPlan:
        """``NodeRules.gate``: the plan Allocate may answer with (the
        toolkit hook's env withheld where the hook would fail the start: the
        NRI door cannot take Allocate's env back, issue 33). Raises Refusal."""
        try:
            return self.rules.gate(plan)
        except FractionError as e:
            raise Refusal(status_of(e.code), f"{who}: {e.message}", e.code) from None

    def _record(self, plan: ContainerPlan, key: str, who: str, hints: set[str],
                pending_on: frozenset[str] = frozenset()) -> ContainerPlan:
        """Gate and record ``plan`` as an unbound reservation (a pending one,
        ``pending_on`` not empty: gated, not recorded); returns the plan to
        answer with. Raises Refusal."""
        plan = self._gated(plan, who)
        if pending_on:  # nothing recorded; dropped when every pod it may be for is gone (pod_gone)
            self._pending_hints[key] = set(hints)
            return plan
        hold = self._holds.pop(key, key)
        charged = plan
        if hold != key:  # one hold with an init container's devices: the union of both, counted once
            mib = max(al.charge_mib(hold, self.unit_mib).values())
            charged = dataclasses.replace(plan, request_mib=max(plan.request_mib, mib),
                                          limit_mib=max(plan.limit_mib, mib))
        try:
            self.rules.record(charged, door=al.DOOR_ALLOCATE, reservation=hold, bound=False)
        except FractionError as e:
            raise Refusal(status_of(e.code), f"{who}: {e.message}", e.code) from None
        except OSError as e:
            raise Refusal(status_of("ledger_io"), f"{who}: cannot persist the ledger: {e}", "ledger_io") from None
        self._hints[hold] = set(hints)
        self._made[hold] = time.monotonic()
        return plan

    def _fallback(self, uuids: Sequence[str], key: str, request_mib: int, pipe_dir: bool, reason: str,
                  hints: set[str] | None = None, *, pending_on: frozenset[str] = frozenset()) -> Answer:
        """The answer that is right for every candidate, recorded after every
        node guard like a planned one. ``pipe_dir``: every candidate is
        time-slicing, or none is known, so the time-slicing pipe directory
        is right for all. Raises Refusal when a guard says no."""
        modes = {t.mode for u in uuids for t in self.ledger.tenants(u) if t.reservation not in pending_on}
        mode = ComputeMode.TIME_SLICING if pipe_dir or len(modes) != 1 else modes.pop()
        spec = MemorySpec(f"resources.limits[{self.resource_name}]", f"{request_mib} MiB per GPU", mib=request_mib)
        req = FractionRequest(container="", request=spec, limit=spec, compute_mode=mode, devices=tuple(uuids),
                              num_devices=len(uuids), keys={"request": spec.key, "devices": spec.key})
        who = f"reservation {key} (pod not known)"
        try:
            plan = self.rules.plan(req, PodRef("", "", ""), reservation=key, without=pending_on)
        except FractionError as e:
            raise Refusal(status_of(e.code), f"{who}: {e.message}", e.code) from None
        plan = self._record(plan, key, who, set(hints or ()), pending_on)
        self.counters.bump("fallbacks", last_fallback=reason)
        log.warning("Allocate fallback for %s on %s: %s", self.resource_name, ",".join(uuids), reason)
        env = {k: v for k, v in plan.env.items()
               if k not in (planner_mod.ENV_PIPE_DIRECTORY, planner_mod.ENV_ACTIVE_THREAD_PERCENTAGE)}
        mounts: tuple[Mount, ...] = ()
        if pipe_dir:
            env[planner_mod.ENV_PIPE_DIRECTORY] = CONTAINER_PIPE_DIR
            if not self.planner_config.mps_namespaces:  # v2: the shared time-slicing directory, read-only
                mounts = (Mount(source=self.planner_config.layout.pipe_dir(ComputeMode.TIME_SLICING),
                                destination=CONTAINER_PIPE_DIR, read_only=True),)
        return Answer(env, mounts, tuple(uuids), key, "fallback")

    # ---- lifetimes --------------------------------------------------------------
    def pod_gone(self, pod: Mapping[str, Any]) -> None:
        """A pod was deleted or finished (Succeeded/Failed): kubelet frees its
        devices. Its bound reservations are released, and unbound ones whose
        every candidate is gone."""
        uid = podlookup.pod_uid(pod)
        with self._lock:
            was_served = any(k[0] == uid for k in self._served) or any(t.pod_uid == uid for t in self.ledger.tenancies())
            self._served = {k for k in self._served if k[0] != uid}
            finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if not finished and not was_served:
                self._deleted.append((time.monotonic(), pod))
            for key, tenancies in self.ledger.reservations().items():
                hints = self._hints.get(key)
                if hints is not None:
                    hints.discard(uid)
                bound_here = any(t.pod_uid == uid for t in tenancies)
                orphan = not tenancies[0].bound and hints is not None and not hints
                if bound_here and not finished and any(t.container_id for t in tenancies):
                    # The API object is gone (a force delete) but the runtime
                    # still runs the container: the hold lasts until NRI says it
                    # stopped (Stop/Remove, or a Synchronize without it). A pod
                    # Succeeded/Failed has no running container (kubelet saw them end).
                    with self._gone_lock:
                        self._gone_keys[key] = podlookup.pod_key(pod)
                    log.info("reservation %s kept: pod %s is gone from the API but its container still runs",
                             key, podlookup.pod_key(pod))
                    continue
                if bound_here or orphan:
                    self.ledger.release_reservation(key)
                    self._forget(key)
                    log.info("reservation %s released: pod %s %s", key, podlookup.pod_key(pod),
                             "finished" if not bound_here or pod.get("status") else "gone")
            proofs = reservations.proofs_of(self.ledger)
            for key, hints in list(self._pending_hints.items()):
                hints.discard(uid)
                if not hints:
                    del self._pending_hints[key]
                    if proofs.is_pending(key):
                        proofs.settle(key)
                        log.info("pending reservation %s dropped: every pod it may be for is gone", key)

    def _release_gone(self) -> None:
        """Ledger subscriber: release the reservations of pods gone from the
        API once no running container holds them any more (issue 25 item 5)."""
        with self._gone_lock:
            if not self._gone_keys:
                return
            keys = list(self._gone_keys.items())
        for key, who in keys:
            held = self.ledger.reservation(key)
            if held and any(t.container_id for t in held):
                continue
            with self._gone_lock:
                if self._gone_keys.pop(key, None) is None:
                    continue
            if held:
                self.ledger.release_reservation(key)
                self._forget(key)
                log.info("reservation %s released: pod %s is gone and its container stopped", key, who)

    # ---- PodResources ------------------------------------------------------------
    def reconcile(self, pods: Sequence[Any], *, initial: bool = False) -> list[str]:
        """Make the ledger agree with kubelet's PodResources List (``pods``:
        ``podresources.PodDevices``; ADR 0007 decisions 3, 5 and 6). Returns
        warnings. A listed container holds the reservation of its IDs (recorded,
        or bound when unbound), or a GPU given whole by another device plugin
        (door ``other-plugin``); what is not listed is released (a pending key
        dropped), except a reservation younger than ``PODRESOURCES_GRACE_S``
        unless ``initial``, or one whose container still runs."""
        warnings: list[str] = []
        listed: set[str] = set()
        whole: list[Tenancy] = []
        now = time.monotonic()
        with self._lock:
            for p in pods:
                for c in p.containers:
                    for res, ids in c.devices.items():
                        if res != self.resource_name:
                            for d in ids:
                                g = self.node.gpu_by_uuid(d)
                                if g is not None:
                                    whole.append(Tenancy(
                                        pod_uid=self._uid_of(p), namespace=p.namespace, pod_name=p.name,
                                        container=c.name, gpu_uuid=g.uuid, request_mib=g.memory_mib,
                                        limit_mib=g.memory_mib, mode=ComputeMode.TIME_SLICING,
                                        door=al.DOOR_OTHER_PLUGIN, reservation=f"{res}={g.uuid}"))
                            continue
                        if not ids:
                            continue
                        try:
                            by_gpu = self.table.group(ids)
                        except DeviceIdError as e:
                            warnings.append(f"PodResources lists {p.namespace}/{p.name}/{c.name} with {e}; skipped")
                            continue
                        key = al.reservation_key({u: [parse_device_id(d)[1] for d in v] for u, v in by_gpu.items()})
                        hold = reservations.hold_of(self.ledger, key)  # an alias: the union hold (ADR 0033)
                        if not self.ledger.reservation(hold):
                            hold = reservations.join_pod_hold(self.ledger, key, self.unit_mib, (
                                self._uid_of(p), f"podresources:{p.namespace}/{p.name}"), f"{p.namespace}/{p.name}")
                        listed.add(hold)
                        warnings.extend(self._bind_listed(p, c.name, by_gpu, hold))
            current = self.ledger.tenancies()
            running = {t.reservation for t in current if t.door == al.DOOR_ALLOCATE and t.container_id}
            stale = [t for t in current if t.door == al.DOOR_ALLOCATE and t.reservation not in listed
                     and t.reservation not in running  # the runtime still runs its container (issue 25 item 5)
                     and (initial or now - self._made.get(t.reservation, 0.0) > PODRESOURCES_GRACE_S)]
            old_whole = [t for t in current if t.door == al.DOOR_OTHER_PLUGIN]
            if stale or old_whole != whole:
                gone = {t.reservation for t in stale}
                self.ledger.transform(lambda cur: [
                    t for t in cur if t.door != al.DOOR_OTHER_PLUGIN and not (
                        t.door == al.DOOR_ALLOCATE and t.reservation in gone)] + whole)
            for key in {t.reservation for t in stale}:
                self._forget(key)
                warnings.append(f"reservation {key} is not in PodResources; released")
            proofs = reservations.proofs_of(self.ledger)
            wall = time.time()
            for key, at in proofs.pending_items():  # kubelet lists a pending key's pod once Allocate returned
                if key not in listed and (initial or wall - at > PODRESOURCES_GRACE_S):
                    proofs.settle(key)
                    self._pending_hints.pop(key, None)
                    warnings.append(f"pending reservation {key} is not in PodResources; dropped")
        return warnings

    def _uid_of(self, p: Any) -> str:
        pod = self.pod_source.get(p.namespace, p.name) if self.pod_source is not None else None
        return podlookup.pod_uid(pod) if pod is not None else f"podresources:{p.namespace}/{p.name}"

    def _bind_listed(self, p: Any, container: str, by_gpu: Mapping[str, list[str]], key: str) -> list[str]:
        existing = self.ledger.reservation(key)
        if existing and existing[0].bound:
            return []
        uid = self._uid_of(p)
        if reservations.running_overlaps(self.ledger, key, uid):
            # kubelet lists devices a running container of another pod still holds (a pending
            # reservation, ADR 0033): recorded once that one stopped, never both
            return []
        reservations.take_over(self.ledger, key, uid)  # a pending key: the holds it waited on go (their holders stopped)
        per = max(len(v) for v in by_gpu.values())
        uuids = tuple(by_gpu)
        count = sum(len(v) for v in by_gpu.values())
        pod = self.pod_source.get(p.namespace, p.name) if self.pod_source is not None else None
        ref = PodRef(p.namespace, p.name, uid)
        plan: ContainerPlan | None = None
        warnings: list[str] = []
        if existing:
            plan = self.rules.recorded(existing, pod=ref, container=container)
        elif pod is not None:
            cand = podlookup.Candidate(pod, container, False, ("", 0, 0, ""))
            try:
                req, _ = self.request_for(cand, uuids, per * self.unit_mib, count)
                plan = self.rules.replan(req, ref, reservation=key)
            except FractionError as e:
                warnings.append(f"{p.namespace}/{p.name}/{container}: {e.message}; recorded request-sized")
        if plan is None:
            spec = MemorySpec(f"resources.limits[{self.resource_name}]", f"{per * self.unit_mib} MiB", mib=per * self.unit_mib)
            modes = {m for u in uuids if (m := self.ledger.mode(u)) is not None}
            req = FractionRequest(container=container, request=spec, limit=spec,
                                  compute_mode=modes.pop() if len(modes) == 1 else ComputeMode.TIME_SLICING,
                                  devices=uuids, num_devices=len(uuids), keys={"request": spec.key})
            plan = self.rules.replan(req, ref)
        # What runs is recorded, never refused (replace_all logs guard breaks).
        cid = existing[0].container_id if existing else ""
        new = al.to_tenancies(plan, cid, door=al.DOOR_ALLOCATE, reservation=key)
        self.ledger.transform(lambda cur: [t for t in cur if t.reservation != key] + new)
        self._hints.pop(key, None)
        return warnings
