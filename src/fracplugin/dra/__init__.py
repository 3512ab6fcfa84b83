"""The DRA door (issue 29, ADR 0031): kubelet's Dynamic Resource Allocation
plugin for the driver ``gpu-memory.fracplugin.io``.

A ResourceClaim allocated by the scheduler on one of this node's GPUs, with a
``memory`` capacity consumed from it, becomes the same ``ContainerPlan`` the
other two doors make, held in the same ledger (keyed by the claim's UID) and
enforced the same way (env, MPS namespace, the GPU's own CDI device).

Its modules, in reading order (params, claims, cdispec, prepare, server,
slices): docs/architecture.md section 2b. Facts: docs/reference/kubelet-dra.md.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..allocation import DOOR_DRA
from ..model import Tenancy

DRIVER_NAME = "gpu-memory.fracplugin.io"
"""The DRA driver name (ResourceSlice ``spec.driver``, allocation results'
``driver``, the DeviceClass's selector, the registration's ``name``)."""
REQUEST_TIMEOUT_S = 5.0
"""Seconds each API request of the DRA door (claim reads, slice writes) may take."""
CAPACITY_MEMORY = "memory"
"""The consumable capacity of each GPU device, in bytes."""
CLAIM_CONTAINER = "dra"
"""The ``container`` of a claim's ledger owner (claim UID, ``dra``) and MPS
namespace: one fraction per claim, whichever containers use it (ADR 0031)."""

RESERVATION_PREFIX = "dra:"
"""A claim's hold is the ledger reservation ``dra:<claim uid>``."""


def reservation_of(claim_uid: str) -> str:
    """The ledger reservation key of a claim: ``dra:<claim uid>``."""
    return RESERVATION_PREFIX + claim_uid


ENV_CLAIM = "FRACPLUGIN_DRA_CLAIM"
"""Env var of a DRA container (the claim's CDI spec, ``dra/cdispec.py``): the
UID of the claim whose fraction it uses."""


def claim_tenancies(env: Iterable[str], ledger: Any) -> list[Tenancy]:
    """The DRA door's ledger tenancies (reservation ``dra:<uid>``) of the claim
    a container's env names (``env``: NRI ``K=V`` strings, the last
    ``FRACPLUGIN_DRA_CLAIM`` wins; the runtime applied the claim's CDI env
    before NRI sees the container, ADR 0031). Empty when the env names no
    claim or the ledger holds none of it."""
    uid = ""
    for kv in env:
        k, sep, v = str(kv).partition("=")
        if sep and k == ENV_CLAIM:
            uid = v
    return claim_tenancies_of(uid, ledger)


def claim_tenancies_of(claim_uid: str, ledger: Any) -> list[Tenancy]:
    """The DRA door's ledger tenancies of claim ``claim_uid`` (reservation
    ``dra:<uid>``); empty for an empty UID or a claim the ledger does not hold."""
    uid = claim_uid.strip()
    if not uid:
        return []
    return [t for t in ledger.reservation(reservation_of(uid)) if t.door == DOOR_DRA]
