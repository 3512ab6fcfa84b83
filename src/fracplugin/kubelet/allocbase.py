"""The answer types of the device plugin door's decisions (``kubelet/allocator.py``):
``Refusal``, ``Answer`` and ``Counters``. Like the decisions, this module loads no gRPC library.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping

from ..model import Mount
from ..rpcstatus import StatusCode


class Refusal(Exception):
    """An Allocate / GetPreferredAllocation answered with a gRPC error.

    ``code`` is the gRPC status kubelet gets (``rpcstatus.StatusCode``: our own
    type, the canonical gRPC numbers, so this module loads no gRPC library),
    ``message`` the text kubelet shows as the pod's admission error, ``label``
    the metrics reason."""

    def __init__(self, code: StatusCode, message: str, label: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.label = label


@dataclass(frozen=True)
class Answer:
    """What Allocate answers: env, mounts, the GPUs (ordinal order), the
    reservation key and ``kind`` (``planned``, ``reserved`` = a recorded
    reservation answered again, ``fallback``, or ``pending`` = nothing
    recorded: a running container still holds some of the devices, ADR 0033)."""

    env: Mapping[str, str]
    mounts: tuple[Mount, ...]
    uuids: tuple[str, ...]
    key: str
    kind: str


@dataclass
class Counters:
    """What the door did since start (``/status`` ``device_plugin``): Allocates
    answered, of which planned / reserved (a recorded reservation answered
    again) / fallbacks, and pending (planned or fallback, answered while a
    running container still held some of the devices: ADR 0033), refusals,
    GetPreferredAllocation calls, and the last fallback and refusal reasons.
    ``bump`` from any thread."""

    allocations: int = 0
    planned: int = 0
    reserved: int = 0
    fallbacks: int = 0
    pending: int = 0
    refusals: int = 0
    preferred: int = 0
    last_fallback: str = ""
    last_refusal: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def bump(self, counter: str, **last: str) -> None:
        """Add one to ``counter`` and set the ``last_*`` reasons given."""
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
            for k, v in last.items():
                setattr(self, k, v)
