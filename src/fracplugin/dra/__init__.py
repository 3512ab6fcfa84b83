"""The DRA door (issue 29, ADR 0031): kubelet's Dynamic Resource Allocation
plugin for the driver ``gpu-memory.fracplugin.io``.

A ResourceClaim allocated by the scheduler on one of this node's GPUs, with a
``memory`` capacity consumed from it, becomes the same ``ContainerPlan`` the
other two doors make, held in the same ledger (keyed by the claim's UID) and
enforced the same way (env, MPS namespace, the GPU's own CDI device).

Modules (read in this order):

- ``params.py``: the opaque parameters type ``GpuMemoryParameters``
  (``gpu-memory.fracplugin.io/v1alpha1``), checked with the contract's rules;
- ``claims.py``: a ResourceClaim document -> ``ClaimRequest`` -> plan (pure),
  and ``ApiClaims``, the API read of one claim;
- ``cdispec.py``: one CDI spec file per prepared claim;
- ``prepare.py``: ``Preparer``, NodePrepareResources / NodeUnprepareResources
  without gRPC (ledger, MPS namespace, CDI spec);
- ``server.py``: ``DraServer``, the grpcio servers (the DRA service and the
  registration socket kubelet's plugin watcher dials);
- ``slices.py``: the ResourceSlice of this node's GPUs and its publisher.

Facts: docs/reference/kubelet-dra.md.
"""

from __future__ import annotations

from ..allocation import DOOR_DRA

DRIVER_NAME = "gpu-memory.fracplugin.io"
"""The DRA driver name (ResourceSlice ``spec.driver``, allocation results'
``driver``, the DeviceClass's selector, the registration's ``name``)."""
CAPACITY_MEMORY = "memory"
"""The consumable capacity of each GPU device, in bytes."""
CLAIM_CONTAINER = "dra"
"""The ``container`` of a claim's ledger owner (claim UID, ``dra``) and MPS
namespace: one fraction per claim, whichever containers use it (ADR 0031)."""
__all__ = ["DRIVER_NAME", "CAPACITY_MEMORY", "DOOR_DRA", "CLAIM_CONTAINER", "RESERVATION_PREFIX", "reservation_of"]

RESERVATION_PREFIX = "dra:"
"""A claim's hold is the ledger reservation ``dra:<claim uid>``."""


def reservation_of(claim_uid: str) -> str:
    """The ledger reservation key of a claim: ``dra:<claim uid>``."""
    return RESERVATION_PREFIX + claim_uid
