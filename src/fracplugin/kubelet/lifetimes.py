"""How long a reservation of the device plugin door lives: released when
its pod is deleted or finishes (the pod source's deletions; a force-deleted
pod's hold lasts until its container stops, issue 25 item 5), and made to
agree with kubelet's PodResources List (``reconcile``: at start and then
periodically).

Split out of ``kubelet/allocator.py`` (issue 26, ADR 0023), moved as it was:
the module docstring of ``kubelet/allocator.py`` describes the decisions and
the lifetimes; ``Allocator`` is the one class to use.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

from .. import allocation as al
from ..model import ComputeMode, ContainerPlan, FractionError, FractionRequest, MemorySpec, PodRef, Tenancy
from . import podlookup
from .allocbase import _AllocatorState
from .devices import DeviceIdError, parse_device_id

log = logging.getLogger("fracplugin.kubelet.allocator")  # the allocator's log, as before the split


class _Lifetimes(_AllocatorState):
    """Reservation lifetimes and the PodResources reconciliation (a mixin of
    ``Allocator``)."""

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
        ``podresources.PodDevices``). Returns warnings.

        * a container listed with devices of our resource holds the
          reservation of those IDs: recorded (planned from the pod when the pod
          source knows it, request-sized otherwise) or bound when unbound;
        * a container listed with devices of another resource that are GPU
          UUIDs of this node holds that GPU whole (door ``other-plugin``);
        * reservations (and whole-GPU holds) not listed are released, except
          reservations younger than ``podresources_grace_s`` (kubelet records
          an allocation only after Allocate returned) unless ``initial``.
        """
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
                        listed.add(key)
                        warnings.extend(self._bind_listed(p, c.name, by_gpu, key))
            current = self.ledger.tenancies()
            running = {t.reservation for t in current if t.door == al.DOOR_ALLOCATE and t.container_id}
            stale = [t for t in current if t.door == al.DOOR_ALLOCATE and t.reservation not in listed
                     and t.reservation not in running  # the runtime still runs its container (issue 25 item 5)
                     and (initial or now - self._made.get(t.reservation, 0.0) > self.podresources_grace_s)]
            old_whole = [t for t in current if t.door == al.DOOR_OTHER_PLUGIN]
            if stale or old_whole != whole:
                gone = {t.reservation for t in stale}
                self.ledger.transform(lambda cur: [
                    t for t in cur if t.door != al.DOOR_OTHER_PLUGIN and not (
                        t.door == al.DOOR_ALLOCATE and t.reservation in gone)] + whole)
            for key in {t.reservation for t in stale}:
                self._forget(key)
                warnings.append(f"reservation {key} is not in PodResources; released")
        return warnings

    def _uid_of(self, p: Any) -> str:
        pod = self.pod_source.get(p.namespace, p.name) if self.pod_source is not None else None
        return podlookup.pod_uid(pod) if pod is not None else f"podresources:{p.namespace}/{p.name}"

    def _bind_listed(self, p: Any, container: str, by_gpu: Mapping[str, list[str]], key: str) -> list[str]:
        existing = self.ledger.reservation(key)
        if existing and existing[0].bound:
            return []
        per = max(len(v) for v in by_gpu.values())
        uuids = tuple(by_gpu)
        count = sum(len(v) for v in by_gpu.values())
        pod = self.pod_source.get(p.namespace, p.name) if self.pod_source is not None else None
        ref = PodRef(p.namespace, p.name, podlookup.pod_uid(pod) if pod is not None else f"podresources:{p.namespace}/{p.name}")
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
