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
  replaces a queued release with its ensure, ``Namespaces._queue_ensure``).

A pod UID is never reused (Kubernetes UIDs are unique), and NRI delivers
Synchronize before any other event of a connection, so a namespace of a pod
the runtime does not have cannot gain a container afterwards. The MPS
layer's status may be a poll old (``RemoteMps`` polls the MPS role every
``poll_interval_s``; it refreshes once before the doors register): a
namespace made since is not a candidate (kept), one released since is
released again (the MPS layer answers that it is gone). An MPS layer that
reports nothing (``NullMps``, an unreachable MPS role: ``reachable`` false)
is not reconciled; the next Synchronize tries again.

Where it is done: ``Reconciler`` (``nri/reconcile.py``) reads the MPS
layer's status and logs; the decision, under the namespace table's lock
(``Namespaces.adopt``, ``release_orphan``, the "held" rule in
``Namespaces._held_locked``), is ``nri/namespaces.py``'s; this module parses
the status (``mps_namespaces``) and scans the ledger (``ledger_holds``).

Concurrency model: as ``nri/plugin.py``. The decision is made under
the namespace table's lock against the ledger read once; the Synchronize handler's thread
makes no MPS control call (``status()`` reads a polled or locked in-memory
copy; releases run on the MPS queue, inline only when it is closed, the
plugin shutting down).
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
