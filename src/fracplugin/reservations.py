"""Who may claim a kubelet reservation at the NRI door (ADR 0024 decision 4, ADR 0033 decisions 1-2).

The reservation key (``FRACPLUGIN_RESERVATION``, ``<uuid>::<ranges>``) is readable by any pod, so each
Allocate answer also carries a *proof* (128 random bits, env ``FRACPLUGIN_RESERVATION_PROOF``; a container
annotation ``fracplugin.io/reservation-proof`` is still read), new for each new holder of the device IDs and
the same for a re-Allocate. The NRI door takes it out of the container's environment once checked
(docs/reference/nri-protocol.md "Env removal caveat").

*Aliases* (ADR 0033 decision 3): an app container handed an init container's devices plus or minus some
joins the init's hold, recorded under the union of their devices; each other key is an alias (``hold_of``).
*Pending* keys (ADR 0033 decision 2): an Allocate of devices a running container of another pod still holds
is answered without recording anything (``ReservationProofs.pend``); its container is refused transiently
(``reservation_pending``) while such a holder runs (``running_overlaps``), then ``NodeRules.admit`` calls
``take_over``. Proofs, aliases and pending keys live in memory and in ``<state-dir>/reservation-proofs.json``
(mode 0600, beside the ledger), so a restarted daemon still knows them.

``claim_problem`` is the rule the NRI door applies at CreateContainer (on the
hold the key names, itself or through its alias):

1. the reservation is bound to this pod (PodResources or an earlier
   container of the pod bound it): accepted, proof or not;
2. the key is pending and the container shows its current proof: refused
   TRANSIENTLY naming the running container while one of another pod holds
   one of its devices, accepted once none does;
3. no reservation with that key in the ledger: refused (a key no Allocate of
   this node made, or one already released);
4. bound to another pod (PodResources or a container of that pod bound it):
   refused naming that pod and, when one runs, its running container,
   whatever proof the container shows;
5. otherwise (no pod bound yet) the container must show its key's current proof.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import secrets
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Container, Iterable, Mapping, Sequence

from . import allocation as al
from .atomicfile import write_atomically
from .model import FractionError, Tenancy

if TYPE_CHECKING:
    from .ledger import Ledger

log = logging.getLogger(__name__)

ENV_RESERVATION_PROOF = "FRACPLUGIN_RESERVATION_PROOF"
CODE_CLAIM = "reservation"
"""Refusal code of a claim that breaks the rules (INVALID_ARGUMENT: ``noderules.status_of``)."""
CODE_PENDING = "reservation_pending"
"""Refusal code of a pending reservation's container while the devices'
running holder runs (UNAVAILABLE: ``noderules.TRANSIENT``; kubelet retries)."""
ANNOTATION_RESERVATION_PROOF = "fracplugin.io/reservation-proof"
PROOFS_FILE = "reservation-proofs.json"
MAX_PROOFS = 8192
"""Proofs kept (oldest dropped first); a node has at most ~79 x GPUs reservations."""


class ReservationProofs:
    """Reservation key -> the proof of its latest Allocate (thread-safe),
    the aliases (module docstring) and the pending keys (key -> unix seconds
    of the Allocate that left it pending).

    Args:
        path: the JSON file to keep them in (None: memory only). An unreadable
            file is logged and ignored (the owners are then accepted through
            rule 1 once PodResources binds their reservations).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._proofs: dict[str, str] = {}
        self._aliases: dict[str, str] = {}  # a key kubelet gave again in part -> the hold that covers it
        self._pending: dict[str, float] = {}  # a key answered while a running container held its devices
        if self.path is not None and self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                if isinstance(doc, dict) and isinstance(doc.get("proofs"), dict):
                    self._proofs = {str(k): str(v) for k, v in doc["proofs"].items()}
                    self._aliases = {str(k): str(v) for k, v in (doc.get("aliases") or {}).items()}
                    self._pending = {str(k): float(v) for k, v in (doc.get("pending") or {}).items()}
                elif isinstance(doc, dict):  # the file before issue 34: proofs only
                    self._proofs = {str(k): str(v) for k, v in doc.items()}
            except (OSError, ValueError) as exc:
                log.warning("reservation proofs unreadable; starting empty", extra={"path": str(self.path),
                                                                                    "reason": str(exc)})

    def issue(self, key: str) -> str:
        """A new proof for ``key`` (a new Allocate of these device IDs)."""
        proof = secrets.token_hex(16)
        with self._lock:
            self._proofs.pop(key, None)
            self._proofs[key] = proof
            while len(self._proofs) > MAX_PROOFS:
                self._proofs.pop(next(iter(self._proofs)))
            self._save()
        return proof

    def current(self, key: str) -> str | None:
        """The proof of ``key``'s latest Allocate, or None."""
        with self._lock:
            return self._proofs.get(key)

    def current_or_issue(self, key: str) -> str:
        """The current proof of ``key`` (a re-Allocate of the same
        reservation), or a new one when there is none."""
        cur = self.current(key)
        return cur if cur is not None else self.issue(key)

    def matches(self, key: str, proof: str) -> bool:
        """True when ``proof`` is ``key``'s current proof (constant time)."""
        cur = self.current(key)
        return cur is not None and bool(proof) and hmac.compare_digest(cur, proof)

    def alias(self, keys: Iterable[str], hold: str) -> None:
        """Make each of ``keys`` (and every alias of one of them) an alias of
        ``hold``: one hold under the union of their devices (module docstring)."""
        with self._lock:
            moved = set(keys) - {hold}
            for a, target in list(self._aliases.items()):
                if target in moved:
                    self._aliases[a] = hold
            for k in moved:
                self._aliases[k] = hold
            self._aliases.pop(hold, None)
            while len(self._aliases) > MAX_PROOFS:
                self._aliases.pop(next(iter(self._aliases)))
            self._save()

    def unalias(self, key: str) -> None:
        """``key`` is a reservation of its own again (a new Allocate of it)."""
        with self._lock:
            if self._aliases.pop(key, None) is not None:
                self._save()

    def alias_of(self, key: str) -> str | None:
        """The hold ``key`` is an alias of, or None."""
        with self._lock:
            return self._aliases.get(key)

    def pend(self, key: str) -> None:
        """``key``'s latest Allocate was answered while a running container
        held one of its devices: its container waits for their release
        (module docstring, pending reservations)."""
        with self._lock:
            self._pending.pop(key, None)
            self._pending[key] = time.time()
            while len(self._pending) > MAX_PROOFS:
                self._pending.pop(next(iter(self._pending)))
            self._save()

    def is_pending(self, key: str) -> bool:
        """True while ``key`` is pending (``pend``, not ``settle``d yet)."""
        with self._lock:
            return key in self._pending

    def pending_keys(self) -> list[str]:
        """The pending keys, oldest first."""
        with self._lock:
            return list(self._pending)

    def pending_items(self) -> list[tuple[str, float]]:
        """(pending key, unix seconds of the Allocate that left it pending), oldest first."""
        with self._lock:
            return list(self._pending.items())

    def settle(self, key: str) -> None:
        """``key`` is pending no more: its container was admitted, or a new
        Allocate of it was answered with nothing in its way."""
        with self._lock:
            if self._pending.pop(key, None) is not None:
                self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            write_atomically(self.path, json.dumps({"proofs": self._proofs, "aliases": self._aliases,
                                                    "pending": self._pending}), mode=0o600)
        except OSError as exc:
            log.warning("reservation proofs not saved", extra={"path": str(self.path), "reason": str(exc)})


_BY_LEDGER: "weakref.WeakKeyDictionary[Ledger, ReservationProofs]" = weakref.WeakKeyDictionary()
_BY_LEDGER_LOCK = threading.Lock()


def proofs_of(ledger: Ledger) -> ReservationProofs:
    """The one ``ReservationProofs`` of a ledger (both doors share the
    ledger, so they share its proofs), kept beside the ledger file."""
    with _BY_LEDGER_LOCK:
        got = _BY_LEDGER.get(ledger)
        if got is None:
            path = ledger.path
            got = ReservationProofs(path.with_name(PROOFS_FILE) if path is not None else None)
            _BY_LEDGER[ledger] = got
        return got


def proof_of(annotations: Mapping[str, str] | None, env: Iterable[str]) -> str:
    """The proof a container shows: its annotation, else the last
    ``FRACPLUGIN_RESERVATION_PROOF=`` of its env (``KEY=value`` strings)."""
    if annotations and annotations.get(ANNOTATION_RESERVATION_PROOF):
        return str(annotations[ANNOTATION_RESERVATION_PROOF])
    prefix = ENV_RESERVATION_PROOF + "="
    for kv in reversed(list(env)):
        if kv.startswith(prefix):
            return str(kv[len(prefix):])
    return ""


def hold_of(ledger: Ledger, key: str) -> str:
    """The reservation ``key`` is recorded under: ``key`` itself when the
    ledger has it, else the hold it is an alias of when the ledger has that
    (module docstring, aliases), else ``key``."""
    if not key or ledger.reservation(key):
        return key
    target = proofs_of(ledger).alias_of(key)
    return target if target and ledger.reservation(target) else key


def running_overlaps(ledger: Ledger, key: str, pod_uid: str = "") -> list[Tenancy]:
    """The holds that stand in the way of ``key`` (a canonical reservation
    key): one tenancy per kubelet reservation, ``key`` itself or one sharing
    a device with it, that a running container (bound, with a container id)
    of a pod other than ``pod_uid`` holds. A running container's hold ends
    only with that container (ADR 0033 decision 1)."""
    out: list[Tenancy] = []
    for other, held in ledger.reservations().items():
        running = next((t for t in held if t.bound and t.container_id and t.pod_uid != pod_uid), None)
        if running is not None and (other == key or overlaps(other, key)):
            out.append(running)
    return out


def overlaps(a: str, b: str) -> bool:
    """``allocation.overlaps``, False for a key that is not device IDs."""
    try:
        return al.overlaps(a, b)
    except al.ReservationKeyError:  # a whole GPU of another plugin, a sync hold: not device IDs
        return False


def waiting_text(t: Tenancy) -> str:
    """The running container a pending reservation waits on, in words."""
    return f"running container {t.namespace}/{t.pod_name}/{t.container} (pod uid {t.pod_uid}, container id " \
           f"{t.container_id}, reservation {t.reservation})"


def claim_problem(ledger: Ledger, key: str, pod_uid: str, proof: str, node_name: str, *,
                  pod_name: str = "") -> FractionError | None:
    """Why the container of pod ``pod_uid`` (``pod_name``: namespace/name)
    showing ``proof`` may not claim reservation ``key`` (module docstring,
    rules 1-5), or None. The refusal's key is ``FRACPLUGIN_RESERVATION``,
    its value ``key``, its message names the key's holder and the rule; its
    code is ``CODE_PENDING`` (transient) for a pending key whose devices a
    running container holds, else ``CODE_CLAIM``."""
    held = ledger.reservation(hold_of(ledger, key))
    if any(t.pod_uid == pod_uid or (pod_name and t.pod_uid == f"podresources:{pod_name}") for t in held):
        return None
    proofs = proofs_of(ledger)
    if proofs.is_pending(key) and proofs.matches(key, proof):
        waits = running_overlaps(ledger, key, pod_uid)
        if not waits:
            return None
        return FractionError(
            al.ENV_RESERVATION, key,
            f"was allocated by kubelet while {waiting_text(waits[0])} still holds its devices; a running "
            "container's hold ends only when the runtime stops it, so this container waits (retried) until it "
            "stopped", CODE_PENDING)
    if not held:
        return _refused(key, f"names no reservation of node {node_name}: no Allocate of this node answered it (a "
                        "key copied or made up, or one already released); only the container kubelet allocated "
                        "those devices to can claim them")
    running = next((t for t in held if t.bound and t.container_id), None)
    if running is not None:
        return _refused(key, f"is held by running container {running.namespace}/{running.pod_name}/"
                        f"{running.container}; kubelet gives a device to one pod at a time, so this container "
                        "cannot claim it until that container stops and kubelet allocates the devices again")
    owner = next((t for t in held if t.bound), None)
    if owner is not None:
        return _refused(key, f"belongs to pod {owner.namespace}/{owner.pod_name} (uid {owner.pod_uid}), which "
                        "PodResources or one of its containers bound it to; a reservation belongs to one pod, so "
                        "another pod cannot claim it whatever it shows")
    if proofs.matches(key, proof):
        return None
    what = "carries no" if not proof else "carries a wrong"
    return _refused(key, f"{what} {ENV_RESERVATION_PROOF}: the reservation was allocated by kubelet to another "
                    "container (its Allocate answer holds the proof); a pod cannot claim another pod's devices")


def _refused(key: str, why: str) -> FractionError:
    return FractionError(al.ENV_RESERVATION, key, why, CODE_CLAIM)


def join_pod_hold(ledger: Ledger, key: str, unit_mib: int, pod_uids: Container[str], pod: str) -> str:
    """The hold a key PodResources lists for pod ``pod`` (namespace/name,
    for the log; ``pod_uids``: the uids its entries may carry) belongs to,
    when ``key`` is not in the ledger: when a reservation bound to that pod
    shares a device with it (kubelet reused the init container's devices for
    the app, both answered pending), both become one hold under the union of
    their devices, charged ``unit_mib`` per device of the union on each GPU
    (``held_mib``: the container's own request and limit unchanged),
    its entries kept (holder, container id), both keys aliases of it and
    pending no more (ADR 0033 decision 3: one pod never holds the same
    devices twice). Otherwise ``key``."""
    for other, held in ledger.reservations().items():
        if (held[0].door != al.DOOR_ALLOCATE or not any(t.bound and t.pod_uid in pod_uids for t in held)
                or not overlaps(other, key)):
            continue
        union = al.union_key([other, key])
        per = al.charge_mib(union, unit_mib)
        new = [dataclasses.replace(t, reservation=union).charged_at_least(per.get(t.gpu_uuid, 0)) for t in held]
        ledger.transform(lambda cur: [t for t in cur if t.reservation not in (other, key)] + new)
        proofs = proofs_of(ledger)
        for k in (key, other):
            proofs.settle(k)
        proofs.alias([key, other], union)
        log.info("reservation %s of pod %s shares devices with its %s: one hold %s (kubelet reuses an init "
                 "container's devices)", key, pod, other, union)
        return union
    return key


def take_over(ledger: Ledger, key: str, pod_uid: str) -> list[Tenancy]:
    """Before a pending ``key``'s container of pod ``pod_uid`` is admitted
    (``NodeRules.admit``): release every other reservation sharing a device
    with it that no running container holds (the holds it waited on, their
    containers stopped: kubelet gave their devices to this pod). ``key``'s
    own earlier entries are replaced by the admission (``Ledger.admit``).
    Returns what was released; nothing for a key that is not pending.

    Raises:
        FractionError: (code ``reservation_pending``) a running container of
            another pod still holds one of its devices (``claim_problem``
            rule 2; checked again here, so no door can admit around it).
    """
    if not proofs_of(ledger).is_pending(key):
        return []
    waits = running_overlaps(ledger, key, pod_uid)
    if waits:
        raise FractionError(al.ENV_RESERVATION, key, f"waits for {waiting_text(waits[0])} to stop", CODE_PENDING)
    gone: list[Tenancy] = []
    for other, held in ledger.reservations().items():
        if other != key and overlaps(other, key) and not any(t.container_id for t in held):
            gone += ledger.release_reservation(other)
            log.info("reservation %s released: kubelet gave its devices to pending reservation %s (pod uid %s) and "
                     "its holder stopped", other, key, pod_uid)
    return gone


def unbind_gone(tenancies: Sequence[Tenancy], live_container_ids: Container[str]) -> list[Tenancy]:
    """``tenancies`` with the container id cleared where the runtime no longer
    reports that container (an NRI Synchronize): a kubelet reservation stays
    with its pod, but no running container holds it any more (issue 25 item 5:
    a force-deleted pod's hold then ends)."""
    return [dataclasses.replace(t, container_id="") if t.container_id and t.container_id not in live_container_ids
            else t for t in tenancies]
