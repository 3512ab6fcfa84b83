"""One CDI spec file per prepared claim (the DRA door's container edits).

The runtime applies a CDI device's ``containerEdits`` to every container
kubelet hands it to (docs/reference/kubelet-dra.md §1: Prepare answers CDI
device IDs, kubelet passes them on). A claim's spec is::

    {"cdiVersion": "0.6.0", "kind": "gpu-memory.fracplugin.io/claim",
     "devices": [{"name": "<claim uid>", "containerEdits": {
         "env": ["NVIDIA_VISIBLE_DEVICES=GPU-...", "NVIDIA_GPU_MEMORY_REQUEST=20480", ...,
                 "FRACPLUGIN_DRA_CLAIM=<claim uid>"],
         "mounts": [{"hostPath": "<namespace pipe dir>", "containerPath": "/tmp/nvidia-mps",
                     "type": "bind", "options": ["rbind", "ro", "nosuid", "nodev"]}]}}]}

written to ``<dir>/gpu-memory.fracplugin.io-claim_<uid>.json`` (temp file,
fsync, rename: a reader never sees half a spec) and removed at Unprepare
(ADR 0031 item 6). ``FRACPLUGIN_DRA_CLAIM`` tells the NRI door's Synchronize
that a DRA container's GPUs are the claim's. The GPU's own CDI device
(``cdi.CdiRegistry``) is answered beside ours, not copied into this spec.

Concurrency: one file per claim UID; the door serialises work per claim.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..atomicfile import write_atomically
from ..cdi import OWN_CLAIM_SPEC_PREFIX
from ..model import ContainerPlan
from . import DRIVER_NAME, ENV_CLAIM

CDI_VERSION = "0.6.0"
CDI_CLASS = "claim"
CDI_KIND = f"{DRIVER_NAME}/{CDI_CLASS}"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*\Z")  # CDI device name syntax


def device_id(claim_uid: str) -> str:
    """The fully qualified CDI device of a claim: ``gpu-memory.fracplugin.io/claim=<uid>``."""
    return f"{CDI_KIND}={claim_uid}"


def spec_path(cdi_dir: str, claim_uid: str) -> Path:
    """``<dir>/gpu-memory.fracplugin.io-claim_<uid>.json``. Raises ValueError
    for a UID that is not a CDI device name (a path must never come from it)."""
    if not _NAME_RE.match(claim_uid):
        raise ValueError(f"claim uid {claim_uid!r} is not a CDI device name ([A-Za-z0-9][A-Za-z0-9_.:-]*)")
    return Path(cdi_dir) / f"{OWN_CLAIM_SPEC_PREFIX}{claim_uid}.json"


def claim_env(claim_uid: str, plan: ContainerPlan) -> dict[str, str]:
    """The env a claim's containers get: the plan's, plus ``FRACPLUGIN_DRA_CLAIM``
    naming the claim (``dra.ENV_CLAIM``). What the spec carries and what
    ``explain`` shows."""
    return {**plan.env, ENV_CLAIM: claim_uid}


def spec_document(claim_uid: str, plan: ContainerPlan) -> dict[str, Any]:
    """The CDI spec of one claim's plan (env sorted by key; mounts read-only,
    nosuid, nodev as ``model.Mount.options``)."""
    env = [f"{k}={v}" for k, v in sorted(claim_env(claim_uid, plan).items())]
    mounts = [{"hostPath": m.source, "containerPath": m.destination, "type": "bind", "options": list(m.options)}
              for m in plan.mounts]
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND,
            "devices": [{"name": claim_uid, "containerEdits": {"env": env, "mounts": mounts}}]}


def write_spec(cdi_dir: str, claim_uid: str, plan: ContainerPlan) -> Path:
    """Write the claim's spec atomically (0644; the directory is created).
    Returns its path. Raises OSError, ValueError (bad UID)."""
    path = spec_path(cdi_dir, claim_uid)
    data = json.dumps(spec_document(claim_uid, plan), indent=1, sort_keys=True).encode()
    return write_atomically(path, data, mode=0o644, make_parents=True)


def remove_spec(cdi_dir: str, claim_uid: str) -> bool:
    """Remove the claim's spec; True when it was there. Raises OSError
    (other than not found), ValueError (bad UID)."""
    try:
        spec_path(cdi_dir, claim_uid).unlink()
        return True
    except FileNotFoundError:
        return False


