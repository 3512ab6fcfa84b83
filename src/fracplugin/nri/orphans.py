"""The NRI door's reconciliation of the MPS layer's namespaces at
Synchronize (ADR 0030, "Namespaces the doors forgot": the classes of
namespace, held / of a live pod / orphaned, and why a namespace of a pod the
runtime does not have cannot gain a container afterwards).

Each namespace the MPS layer reports is compared, after the ledger is rebuilt,
with the ledger and the sandboxes Synchronize lists (an MPS layer that reports
nothing is not reconciled). ``Reconciler`` reads the status; the decision is
``Namespaces.adopt`` / ``release_orphan`` / ``_held_locked``'s, under the
namespace table's lock; this module parses the status (``mps_namespaces``) and
scans the ledger (``ledger_holds``). Releases run on the keyed MPS queue.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..ledger import Ledger
from ..model import ComputeMode
from .pluginbase import Owner


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


def ledger_holds(ledger: Ledger) -> tuple[set[str], set[Owner]]:
    """One scan of the ledger: (the MPS namespace names its entries name,
    the owners (pod UID, container) it holds)."""
    tenancies = ledger.tenancies()
    return {t.mps_namespace for t in tenancies if t.mps_namespace}, {t.owner for t in tenancies}
