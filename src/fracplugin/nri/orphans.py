"""The NRI door's reconciliation of the MPS layer's namespaces at
Synchronize (ADR 0030, "Namespaces the doors forgot"): what the MPS layer
holds is compared with what the runtime still has, so that a namespace
whose owner went while the doors did not see it does not stay in the MPS
layer (which has no garbage collection of its own) until the MPS role
restarts.

The class it closes: the early table (``nri/early.py``) and the namespace
jobs live in the doors' memory. When the doors restart (or the NRI
connection drops), a pod deleted before its containers were created leaves
the namespace made for it at RunPodSandbox; a container created and removed
while the doors were away leaves its own; a kubelet reservation freed
while the ledger still named its namespace leaves that one.

At every Synchronize (which carries every pod sandbox and container the
runtime has, docs/reference/nri-protocol.md 1.6), after the ledger is
rebuilt, each namespace the MPS layer reports (``MpsApi.status()``:
``daemons[].namespaces[]`` with ``name``, ``pod_uid``, ``container`` and
its caps; the MPS role's records, ADR 0022) is one of:

- **held**: the ledger holds its owner (pod UID, container name), or a
  ledger entry names the namespace (``Tenancy.mps_namespace``: a kubelet
  reservation recorded at Allocate has no owner yet, only the namespace its
  candidate would get, ``allocation.to_tenancies``), or an early entry, a
  container awaiting its namespace job, or a queued or running job of the
  owner exists here. Left alone.
- **of a live pod**: the runtime still reports a sandbox with the owner's
  pod UID, and nothing holds it (its containers are not created yet, or
  none of them is recorded). Adopted into the early table
  under the pod's sandbox (the last one Synchronize lists with that UID),
  with no ensure of ours to await; RemovePodSandbox (or a later
  Synchronize without the pod) then releases it like an early namespace,
  and a CreateContainer of the owner takes it over with its own ensure
  (the MPS layer answers an ensure of a namespace it applied with the same
  caps without a control command).
- **orphaned**: no sandbox of its pod UID is left in the runtime and
  nothing holds it: released in the background, on the keyed MPS queue as
  RemoveContainer's releases; the job checks again that nothing holds it
  before it asks the MPS layer (a container of the owner created since
  replaces a queued release with its ensure, ``_queue_ensure``).

A pod UID is never reused (Kubernetes UIDs are unique), and NRI delivers
Synchronize before any other event of a connection, so a namespace of a pod
the runtime does not have cannot gain a container afterwards. The MPS
layer's status may be a poll old (``RemoteMps`` polls the MPS role every
``poll_interval_s``; it refreshes once before the doors register): a
namespace made since is not a candidate (kept), one released since is
released again (the MPS layer answers that it is gone). An MPS layer that
reports nothing (``NullMps``, an unreachable MPS role: ``reachable`` false)
is not reconciled; the next Synchronize tries again.

Concurrency model: as ``nri/plugin.py``. The decision is made under
``_ns_lock`` against the ledger read once; the Synchronize handler's thread
makes no MPS control call (``status()`` reads a polled or locked in-memory
copy; releases run on the MPS queue, inline only when it is closed, the
plugin shutting down).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterable, NamedTuple

from .._proto import nri_pb2
from ..model import ComputeMode
from ..mps.layout import namespace_name
from . import early
from .early import _Early
from .pluginbase import _RELEASE, Owner

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log

class HeldNamespace(NamedTuple):
    """One namespace the MPS layer reports: its name, owner (pod UID,
    container name) and settings (compute mode, active thread percentage
    1..100 or None, pinned limit MiB per GPU or None: what ``_ns_settings``
    gives for a plan)."""

    name: str
    owner: Owner
    settings: tuple[Any, ...]


def mps_namespaces(status: Any) -> list[HeldNamespace] | None:
    """The namespaces of an ``MpsApi.status()`` document
    (``daemons[].namespaces[]``), or None when it reports none it can vouch
    for: MPS disabled (``enabled`` false), an MPS role the doors cannot reach
    (``reachable`` false: its daemons list is the last poll's), or not a
    mapping. Rows without a pod UID, container or name, or of a daemon whose
    mode is not a ``ComputeMode``, are skipped. Never raises."""
    if not isinstance(status, dict) or status.get("enabled") is False or status.get("reachable") is False:
        return None
    out: list[HeldNamespace] = []
    for d in status.get("daemons") or ():
        if not isinstance(d, dict):
            continue
        try:
            mode = ComputeMode(d.get("mode"))
        except ValueError:
            continue
        for n in d.get("namespaces") or ():
            if not isinstance(n, dict):
                continue
            uid, ctr, name = n.get("pod_uid"), n.get("container"), n.get("name")
            if not (isinstance(uid, str) and uid and isinstance(ctr, str) and ctr and isinstance(name, str)):
                continue
            out.append(HeldNamespace(name, (uid, ctr),
                                     (mode, n.get("active_thread_percentage"), n.get("pinned_limit_mib"))))
    return out


class _Orphans(_Early):
    """Synchronize's reconciliation of the MPS layer's namespaces (a mixin
    of ``FracNriPlugin``; the module docstring says what it does)."""

    def _reconcile_mps_namespaces(self, pods: Iterable[nri_pb2.PodSandbox]) -> dict[str, int]:
        """Compare the MPS layer's namespaces with ``pods`` (Synchronize's
        sandboxes) and the ledger: adopt those of live pods nothing holds
        into the early table, queue the release of those of
        pods the runtime no longer has (module docstring). Returns
        ``{"held", "adopted", "orphaned"}`` (counts of this call). Never
        raises: an error is logged, nothing is released."""
        counts = {"held": 0, "adopted": 0, "orphaned": 0}
        try:
            status = getattr(self.mps, "status", None)
            doc = status() if callable(status) else None
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
        names, owners = self._ledger_holds()
        orphans: list[HeldNamespace] = []
        with self._ns_lock:
            for ns in found:
                o = ns.owner
                if self._held_locked(ns, names, owners, queued=True):
                    counts["held"] += 1
                elif o[0] not in live:
                    orphans.append(ns)
                elif len(self._ns_early) >= early.EARLY_MAX:  # the early table's bound
                    log.info("nri sync: too many early MPS namespaces; a live pod's namespace not adopted",
                             extra={"pod_uid": o[0], "container": o[1], "early_max": early.EARLY_MAX})
                else:
                    self._ns_early[o] = (ns.settings, None, live[o[0]])
                    self._ns_made.setdefault(o, None)  # may exist: a release of the owner must run
                    counts["adopted"] += 1
            counts["orphaned"] = len(orphans)
            self._early_counts["adopted"] += counts["adopted"]
            self._early_counts["orphaned"] += counts["orphaned"]
        if counts["adopted"] or orphans:
            log.info("nri sync: MPS namespaces reconciled with the runtime",
                     extra={**counts, "pod_uid": ",".join(sorted({ns.owner[0] for ns in orphans}))})
        for ns in orphans:
            self._queue_orphan_release(ns)
        return counts

    def _queue_orphan_release(self, ns: HeldNamespace) -> None:
        """Queue the release of an orphaned namespace on the keyed MPS queue
        (key of its owner, tag ``release``: a later ensure of the owner
        replaces it). Inline when the queue is closed."""
        job = functools.partial(self._orphan_job, ns)
        with self._ns_lock:
            try:
                self._ns_work().put(("ns", *ns.owner), job, tag=_RELEASE)
                return
            except RuntimeError:
                pass  # closed meanwhile
        job()

    def _orphan_job(self, ns: HeldNamespace) -> None:
        """Release ``ns`` unless something here holds it now (a container of
        its owner, a ledger entry naming it, an early entry, an awaited
        job); MPS errors are logged by ``_release_job``."""
        if self._holds(ns):
            log.info("nri sync: an orphaned MPS namespace is held again; kept",
                     extra={"pod_uid": ns.owner[0], "container": ns.owner[1]})
            return
        log.info("nri sync: releasing an MPS namespace whose pod the runtime no longer has",
                 extra={"pod_uid": ns.owner[0], "container": ns.owner[1], "mps_namespace": ns.name})
        self._release_job(ns.owner)

    def _holds(self, ns: HeldNamespace) -> bool:
        """Whether anything of the doors holds ``ns`` now (``_held_locked``,
        from inside the owner's own queued job: the queue is not asked)."""
        names, owners = self._ledger_holds()
        with self._ns_lock:
            return self._held_locked(ns, names, owners, queued=False)

    def _ledger_holds(self) -> tuple[set[str], set[tuple[str, str]]]:
        """One scan of the ledger: (the MPS namespace names its entries name,
        the owners (pod UID, container) it holds)."""
        tenancies = self.ledger.tenancies()
        return {t.mps_namespace for t in tenancies if t.mps_namespace}, {t.owner for t in tenancies}

    def _held_locked(self, ns: HeldNamespace, names: set[str], owners: set[tuple[str, str]], *,
                     queued: bool) -> bool:
        """The one "held" rule (module docstring): the ledger holds the
        owner (``owners``) or names the namespace (``names``, by its name or
        the owner's derived name), the early table has the owner, a container
        awaits it, or (``queued``) a job of the owner is queued or running.
        The caller holds ``_ns_lock``."""
        o = ns.owner
        if ns.name in names or namespace_name(*o) in names or o in owners or o in self._ns_early:
            return True
        if any(p == o for p, _f in self._ns_pending.values()):
            return True
        q = self._ns_queue
        return queued and q is not None and q.busy(("ns", *o))
