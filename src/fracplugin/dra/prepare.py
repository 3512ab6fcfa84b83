"""NodePrepareResources / NodeUnprepareResources without gRPC: ``Preparer``.

Prepare of one claim (namespace, name, UID), in order (ADR 0031 items 2-7):
read the claim (``claims.ApiClaims``, ``claims.read_claim``); admit it through
the node's rules (``NodeRules.admit``, ADR 0032: every guard, the memory-limit
gate, the one ledger as ``door="dra", reservation="dra:<uid>"``; a refusal's
log carries its status, ``noderules.status_of``); make its MPS namespace
(owner ``(<claim uid>, "dra")``); write its CDI spec (``cdispec.write_spec``)
and answer, per allocated device, the claim's CDI device (on the first) and the
GPU's own CDI device from the node's specs (``cdi.CdiRegistry``).

A repeated Prepare is answered from the record of the claim's first Prepare
while the ledger holds the claim (ADR 0031, addendum "Prepare answers from a
record"). A refusal or a failure undoes what was done and becomes the claim's
``error`` string (a refusal's as ``fracplugin explain`` says it).

Unprepare: drop the record, release the ledger hold, remove the CDI spec,
release the MPS namespace; unknown claims are fine (idempotent).

Concurrency: calls for one claim UID are serialised (the UIDs being worked
on are a set, a call waits until its UID leaves it); calls for different
claims run in parallel (the ledger has its own lock). The API read happens
under the claim's lock only. One lock (``_lock``) guards that set, the
record and the counters; it is never held while calling out.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

from ..cdi import CdiRegistry
from ..model import ComputeMode, ContainerPlan, FractionError, NodeInfo
from ..mps.api import MpsApi
from ..noderules import NodeRules, status_of
from ..allocation import DOOR_DRA
from . import CLAIM_CONTAINER, cdispec, claims, reservation_of

log = logging.getLogger(__name__)

NAMESPACE_TIMEOUT_S = 10.0
"""Seconds Prepare waits for the claim's MPS namespace (kubelet's Prepare
call has its own deadline, 45 s in the kubelets we read; inference)."""
MAX_ERROR = 2048
"""Longest per-claim error string answered (characters)."""


class ClaimSource(Protocol):
    """Where claims are read from: ``claims.ApiClaims`` or a test's stand-in."""

    def get(self, namespace: str, name: str) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as the DRA API's ``Device`` carries it."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class Prepared:
    """The answer for one claim: its devices, or a non-empty ``error``."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    plan: ContainerPlan | None = None


class Preparer:
    """The DRA door's decisions (module docstring).

    Args:
        rules: the node's rules (``noderules.NodeRules``: GPUs, the one
            ledger, planner settings, GPU health, the memory-limit gate); a
            claim is admitted through ``rules.admit``.
        claims_source: reads a claim (``ClaimSource``).
        cdi_dir: where claim CDI specs are written.
        node: this node as the API names it (pool name = node name; default ``rules.node``).
        mps: the MPS interface (None: no namespaces are made).
        cdi: the node's CDI specs (None: no GPU CDI device is answered).
    """

    def __init__(self, rules: NodeRules, claims_source: ClaimSource, cdi_dir: str, *, node: NodeInfo | None = None,
                 mps: MpsApi | None = None, cdi: CdiRegistry | None = None) -> None:
        self.rules = rules
        self.node = node or rules.node
        self.ledger = rules.ledger
        self.claims = claims_source
        self.cdi_dir = cdi_dir
        self.mps = mps
        self.cdi = cdi
        self._lock = threading.Lock()  # guards the four below
        self._busy: set[str] = set()  # claim uids a call is working on (``_free`` is notified when one ends)
        self._record: dict[str, Prepared] = {}  # claim uid -> its Prepare's answer, until its Unprepare
        self._counts = {"prepared": 0, "refused": 0, "failed": 0, "unprepared": 0}
        self._last_error = ""
        self._free = threading.Condition(self._lock)
        if mps is not None:  # a daemon healthy again (a new MPS role's fresh daemons): re-make, ADR 0034
            mps.subscribe(self._mps_back)

    @contextmanager
    def _claim_lock(self, uid: str) -> Iterator[None]:
        """Serialise the calls for claim ``uid`` (nothing is kept once they end)."""
        with self._free:
            self._free.wait_for(lambda: uid not in self._busy)
            self._busy.add(uid)
        try:
            yield
        finally:
            with self._free:
                self._busy.discard(uid)
                self._free.notify_all()

    # ---- Prepare ------------------------------------------------------------
    def prepare(self, namespace: str, name: str, uid: str) -> Prepared:
        """Prepare one claim (module docstring). Never raises: failures are
        the answer's ``error``."""
        ref = claims.claim_ref_text(namespace, name, uid)
        fields = {"claim": f"{namespace}/{name}", "claim_uid": uid}
        missing = [k for k, v in (("uid", uid), ("namespace", namespace), ("name", name)) if not v]
        if missing:  # a broken peer: refused before any work (issue 34 input 9), nothing to undo
            msg = (f"resourceclaim {ref}: claim {', '.join(missing)} is empty; kubelet names every claim by "
                   "namespace, name and UID (NodePrepareResourcesRequest.claims)")
            self._count("refused", uid, error=msg)
            log.warning("dra prepare refused", extra={**fields, "reason": msg})
            return Prepared(error=msg)
        with self._claim_lock(uid):
            with self._lock:
                done = self._record.get(uid)
            if done is not None and self.ledger.reservation(reservation_of(uid)):
                return done
            try:
                try:
                    claim = claims.read_claim(self.claims.get(namespace, name), self.node, uid=uid)
                except FractionError:
                    raise
                except Exception as exc:  # the API read
                    raise _ReadFailed(_api_error(exc)) from exc
                # health, plan, the memory-limit gate, the ledger: the node's one admission (ADR 0032)
                plan = self.rules.admit(claims.fraction_request(claim), claim.pod, door=DOOR_DRA,
                                        reservation=claim.reservation)
            except FractionError as err:
                self._count("refused", uid, error=err.message)
                log.warning("dra prepare refused", extra={**fields, "key": err.key, "value": err.value,
                                                          "rule": err.reason, "status": status_of(err.code).name})
                return Prepared(error=_cut(err.message))
            except Exception as exc:  # the API read (_ReadFailed), or the ledger's write
                why = str(exc) if isinstance(exc, _ReadFailed) else f"preparing it failed: {type(exc).__name__}: {exc}"
                msg = f"resourceclaim {ref}: {why}"
                self._count("failed", uid, error=msg)
                log.warning("dra prepare failed", extra={**fields, "reason": msg})
                return Prepared(error=_cut(msg))
            try:
                self._ensure_namespace(plan)
                cdispec.write_spec(self.cdi_dir, uid, plan)
            except Exception as exc:
                self._undo(uid)
                msg = f"resourceclaim {ref}: preparing GPU {','.join(plan.device_uuids)} failed: {exc}"
                self._count("failed", uid, error=msg)
                log.warning("dra prepare failed", extra={**fields, "reason": str(exc)})
                return Prepared(error=_cut(msg))
            done = Prepared(devices=self._devices(claim, plan), plan=plan)
            self._count("prepared", uid, done)
            log.info("dra claim prepared", extra={**fields, "devices": list(plan.device_uuids),
                                                  "request_mib": plan.request_mib, "limit_mib": plan.limit_mib,
                                                  "mode": plan.compute_mode.value})
            return done

    def _ensure_namespace(self, plan: ContainerPlan) -> None:
        if self.mps is None or plan.mps_namespace is None:
            return
        self.mps.ensure_namespace(plan.pod.uid, CLAIM_CONTAINER, plan.active_thread_percentage,
                                  NAMESPACE_TIMEOUT_S, mode=plan.compute_mode, pinned_limit_mib=plan.limit_mib)

    def _mps_back(self, mode: ComputeMode, healthy: bool) -> None:
        """The MPS layer's health callback: when ``mode``'s daemon is healthy
        again (a restart, or a new MPS role whose fresh daemons know no
        namespace: ADR 0034), re-make the namespaces of the prepared claims of
        that mode, as the NRI door does for its running containers, on a
        thread of its own (each ensure waits on the daemon). Never raises."""
        with self._lock:
            uids = [u for u, d in self._record.items()
                    if d.plan is not None and d.plan.compute_mode is ComputeMode(mode)]
        if healthy and uids:
            threading.Thread(target=self._renew, args=(uids,), name="fracplugin-dra-renew", daemon=True).start()

    def _renew(self, uids: list[str]) -> None:
        """Ensure each still-prepared claim's namespace, under its claim's lock
        (an Unprepare meanwhile wins: nothing is made for a released claim)."""
        for uid in uids:
            with self._claim_lock(uid):
                with self._lock:
                    done = self._record.get(uid)
                try:
                    if done is not None and done.plan is not None:
                        self._ensure_namespace(done.plan)
                except Exception as exc:
                    log.warning("dra claim's MPS namespace not re-made", extra={"claim_uid": uid, "reason": str(exc)})

    def _devices(self, claim: claims.ClaimRequest, plan: ContainerPlan) -> tuple[PreparedDevice, ...]:
        """One answer device per allocated device: the claim's CDI device on
        the first, each GPU's own CDI device (when the node's specs list it)."""
        out = []
        for i, d in enumerate(claim.devices):
            ids = [cdispec.device_id(claim.uid)] if i == 0 else []
            own = self.cdi.device_for(d.gpu.uuid) if self.cdi is not None else None
            if own is not None:
                ids.append(own.name)
            out.append(PreparedDevice((d.request,) if d.request else (), d.pool, d.device, tuple(ids), d.share_id))
        return tuple(out)

    # ---- Unprepare ----------------------------------------------------------
    def unprepare(self, namespace: str, name: str, uid: str) -> str:
        """Undo Prepare of one claim; "" on success (also for a claim never
        prepared), else the error. Never raises."""
        with self._claim_lock(uid):
            try:
                gone = self._undo(uid)
            except Exception as exc:
                msg = f"resourceclaim {claims.claim_ref_text(namespace, name, uid)}: unprepare failed: {exc}"
                self._count("failed", uid, error=msg)
                log.warning("dra unprepare failed", extra={"claim": f"{namespace}/{name}", "claim_uid": uid,
                                                           "reason": str(exc)})
                return _cut(msg)
            self._count("unprepared", uid)
            log.info("dra claim unprepared", extra={"claim": f"{namespace}/{name}", "claim_uid": uid,
                                                    "released": gone})
        return ""

    def _undo(self, uid: str) -> int:
        """Release the ledger hold, the CDI spec and the MPS namespace of a
        claim; returns the ledger entries released. Raises OSError/MpsError."""
        gone = self.ledger.release_reservation(reservation_of(uid))
        cdispec.remove_spec(self.cdi_dir, uid)
        if self.mps is not None and any(t.mps_namespace for t in gone):
            self.mps.release_namespace(uid, CLAIM_CONTAINER, NAMESPACE_TIMEOUT_S)
        return len(gone)

    # ---- state --------------------------------------------------------------
    def _count(self, what: str, uid: str, done: Prepared | None = None, error: str = "") -> None:
        """Count ``what`` and record claim ``uid``'s answer ``done`` (None:
        drop its record), under the one lock."""
        with self._lock:
            self._counts[what] += 1
            self._last_error = error or self._last_error
            if done is None:
                self._record.pop(uid, None)
            else:
                self._record[uid] = done

    def status(self) -> dict[str, Any]:
        """Counters, the claims recorded by this process (uid -> ns/name) and
        the ledger's DRA holds."""
        held = {t.reservation: t.gpu_uuid for t in self.ledger.tenancies() if t.door == DOOR_DRA}
        with self._lock:
            mine = {uid: str(p.plan.pod) for uid, p in self._record.items() if p.plan}
            return {**self._counts, "last_error": self._last_error, "claims": mine, "held": held}


def _cut(msg: str) -> str:
    return msg if len(msg) <= MAX_ERROR else msg[:MAX_ERROR] + "..."


class _ReadFailed(Exception):
    """The claim could not be read from the API (its message: ``_api_error``)."""


def _api_error(exc: BaseException) -> str:
    """A short reason for a failed claim read: the API's status code and
    reason when it answered, else the exception's text."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status:
        return f"reading it from the API failed: {status} {getattr(exc, 'reason', '') or ''}".rstrip()
    return f"reading it from the API failed: {type(exc).__name__}: {exc}"
