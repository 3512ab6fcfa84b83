"""Value types shared by every part of fracplugin.

Everything here is a frozen dataclass or an enum: no I/O, no behaviour beyond
small derived properties. Units are in the field names (``*_mib`` = MiB,
``*_bytes`` = bytes, ``*_s`` = seconds).

The flow (docs/reference/design.md section 2)::

    annotations.parse(...)  -> FractionRequest
    planner.plan(request, inventory, ledger, ...) -> ContainerPlan   (or raises FractionError)
    ledger.Ledger.admit(plan) records one Tenancy per assigned GPU
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import Mapping

from .safetext import escape_controls


class ComputeMode(str, enum.Enum):
    """How co-tenants of one GPU share its SMs (docs/reference/design.md section 4).

    ``time-slicing``: each client gets the whole GPU in turns (own fault domain).
    ``sm-sharing``: clients run concurrently under one MPS server, optionally
    capped by an active thread percentage.
    """

    TIME_SLICING = "time-slicing"
    SM_SHARING = "sm-sharing"

    def __str__(self) -> str:  # "sm-sharing", not "ComputeMode.SM_SHARING"
        return self.value


class FractionError(ValueError):
    """A refusal: bad input or a node-side guard said no.

    Every refusal of fracplugin is this one type, so the NRI door, the device
    plugin door and ``fracplugin explain`` report it the same way.

    Attributes:
        key: the annotation key (or pseudo-key such as ``node`` / ``gpu:<uuid>``)
            the refusal is about.
        value: the offending value, verbatim up to ``MAX_QUOTED`` characters and
            cut after that (``None`` when the key is absent).
        reason: the rule that was broken, in words an operator can act on.
        code: a short stable label for metrics (``fracplugin_refusals_total{reason}``).
    """

    #: Longest value quoted verbatim; longer ones are cut (a 1 MiB annotation
    #: must not become a 1 MiB log line, Event and error message per retry).
    MAX_QUOTED = 256

    def __init__(self, key: str, value: str | None, reason: str, code: str = "invalid") -> None:
        self.key = key
        if value is not None and len(value) > self.MAX_QUOTED:
            value = f"{value[:self.MAX_QUOTED]}... ({len(value)} characters)"
        self.value = value
        self.reason = reason
        self.code = code
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """``<key>="<value>" <reason>``, e.g.
        ``nvidia.com/container.app.gpu-memory.limit="20Gi" is below the request ...``."""
        # Control characters escaped (safetext.py): a value with a newline must not forge lines
        # in `kubectl describe pod`, an Event or a text log (issue 13 item 6).
        if self.value is None:
            return escape_controls(f"{self.key}: {self.reason}")
        return escape_controls(f'{self.key}="{self.value}" {self.reason}')

    def to_dict(self) -> dict[str, str | None]:
        """JSON shape used by ``fracplugin explain``: ``{"key","value","reason"}``."""
        return {"key": self.key, "value": self.value, "reason": self.reason}


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as the inventory reports it.

    ``memory_mib`` is the total framebuffer in MiB as NVML reports it
    (``nvmlDeviceGetMemoryInfo().total // 2**20``).
    """

    index: int
    uuid: str
    name: str
    memory_mib: int
    minor: int
    pci_bus_id: str = ""
    numa_node: int | None = None
    compute_capability: str = ""
    mig_enabled: bool = False


@dataclass(frozen=True)
class NodeInfo:
    """The node: its name, driver and GPUs (index order)."""

    name: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[GpuInfo, ...]

    def gpu_by_uuid(self, uuid: str) -> GpuInfo | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def gpu_by_index(self, index: int) -> GpuInfo | None:
        return next((g for g in self.gpus if g.index == index), None)


@dataclass(frozen=True)
class PodRef:
    """Identity of a pod: namespace, name and UID (the UID keys the ledger)."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class MemorySpec:
    """A memory amount as written: absolute MiB, or a fraction of the GPU.

    Exactly one of ``mib`` / ``fraction`` is set. ``key`` and ``raw`` name the
    annotation it came from, for error messages.
    """

    key: str
    raw: str
    mib: int | None = None
    fraction: float | None = None

    def resolve_mib(self, gpu_memory_mib: int, reserve_mib: int = 0) -> int:
        """MiB on a GPU of ``gpu_memory_mib``: the absolute value, or
        ``floor((gpu_memory_mib - reserve_mib) * fraction)`` (KAI's nvfractions
        binder formula, docs/reference/gpu-fractioning-reference.md section 2b)."""
        if self.mib is not None:
            return self.mib
        assert self.fraction is not None
        usable = max(gpu_memory_mib - reserve_mib, 0)
        # float64 floor, exactly as KAI's Go binder computes it
        return math.floor(usable * self.fraction)


@dataclass(frozen=True)
class FractionRequest:
    """What one container asks for, parsed from the pod's annotations.

    Attributes:
        container: the container name the keys were looked up for.
        request: guaranteed memory per GPU (absolute or fraction).
        limit: maximum memory per GPU (absolute or fraction); defaults to request.
        compute_mode: time-slicing (default) or sm-sharing.
        portion: compute portion in (0, 1] or None.
        devices: device entries as written (UUIDs, indices, CDI names), in order;
            empty when the scheduler assigned none (the node places the container).
        num_devices: how many GPUs the container needs (len(devices) when given).
        keys: annotation keys that fed each field (``request``, ``limit``,
            ``mode``, ``portion``, ``devices``, ``num_devices``) for error messages.
    """

    container: str
    request: MemorySpec
    limit: MemorySpec
    compute_mode: ComputeMode = ComputeMode.TIME_SLICING
    portion: float | None = None
    devices: tuple[str, ...] = ()
    num_devices: int = 1
    keys: Mapping[str, str] = field(default_factory=dict)

    @property
    def active_thread_percentage(self) -> int | None:
        """floor(portion * 100), at least 1, only in sm-sharing with a portion
        (docs/reference/gpu-fractioning-reference.md section 2a)."""
        if self.compute_mode is not ComputeMode.SM_SHARING or self.portion is None:
            return None
        # float64 floor like the reference (0.29 -> 28, not 29)
        return max(1, math.floor(self.portion * 100))


@dataclass(frozen=True)
class Mount:
    """A bind mount into the container."""

    source: str
    destination: str
    read_only: bool = False

    @property
    def options(self) -> tuple[str, ...]:
        """OCI mount options for a bind mount."""
        return ("rbind", "ro" if self.read_only else "rw", "nosuid", "nodev")

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source, "destination": self.destination, "read_only": self.read_only}


@dataclass(frozen=True)
class ContainerPlan:
    """Exactly what one fractional container gets (docs/reference/design.md section 4).

    ``devices`` are the assigned GPUs in container-ordinal order
    (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` names each by UUID). ``request_mib`` and
    ``limit_mib`` are per GPU. ``env`` holds every injected variable (values are
    strings); ``mounts`` the bind mounts (the MPS pipe directory);
    ``mps_namespace`` the container's MPS v3 namespace (None with classic v2).
    ``cdi_devices`` are the fully qualified CDI device names the scheduler
    wrote in ``.gpus.devices`` (e.g. ``k8s.device-plugin.nvidia.com/gpu=GPU-...``),
    verbatim, for the NRI adjustment's ``CDI_devices`` (empty for UUIDs or
    indices; ADR 0005). ``portion`` is the compute portion in (0, 1] the plan
    used: the annotation's, or the one derived the way KAI derives it
    (``planner.kai_compute_portion``); None when none applies.
    """

    pod: PodRef
    container: str
    devices: tuple[GpuInfo, ...]
    request_mib: int
    limit_mib: int
    compute_mode: ComputeMode
    active_thread_percentage: int | None
    env: Mapping[str, str]
    mounts: tuple[Mount, ...]
    mps_namespace: str | None
    placed_by_node: bool = False
    cdi_devices: tuple[str, ...] = ()
    portion: float | None = None

    @property
    def device_uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.devices)

    def to_dict(self) -> dict[str, object]:
        """The ``fracplugin explain`` JSON shape for one planned container."""
        return {
            "name": self.container,
            "fractional": True,
            "devices": list(self.device_uuids),
            "compute_mode": self.compute_mode.value,
            "request_mib": self.request_mib,
            "limit_mib": self.limit_mib,
            "env": dict(self.env),
            "mounts": [m.to_dict() for m in self.mounts],
            "cdi_devices": list(self.cdi_devices),
            "portion": self.portion,
            "error": None,
        }


@dataclass(frozen=True)
class Tenancy:
    """One container's hold on one GPU, as the ledger records it.

    ``request_mib``/``limit_mib`` are for this GPU. ``container_id`` is the
    runtime's id when known (NRI CreateContainer), empty otherwise.
    ``held_mib`` (0: none) is what the hold keeps charged on this GPU beyond
    the container's own request: a pod's union hold while its smaller init
    container runs (ADR 0033); ``charged_mib`` is what the GPU counts.

    ``door`` says where the hold comes from (ADR 0007): ``nri`` (planned from
    the pod's annotations at CreateContainer), ``allocate`` (kubelet's device
    plugin allocation; ``reservation`` is then its key, see
    ``fracplugin.allocation.reservation_key``), ``other-plugin`` (a whole GPU
    another device plugin gave a container, seen in PodResources) or ``sync``
    (a running container found at an NRI Synchronize). A reservation of the
    ``allocate`` door whose holder is not known yet has an empty ``pod_uid``
    and ``container``: it is held for kubelet, not attributed to a guess.
    """

    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    gpu_uuid: str
    request_mib: int
    limit_mib: int
    mode: ComputeMode
    container_id: str = ""
    mps_namespace: str | None = None
    active_thread_percentage: int | None = None
    door: str = "nri"
    reservation: str = ""
    held_mib: int = 0

    @property
    def charged_mib(self) -> int:
        """MiB this entry counts on its GPU: ``max(request_mib, held_mib)``."""
        return max(self.request_mib, self.held_mib)

    def charged_at_least(self, mib: int) -> "Tenancy":
        """This entry, counting at least ``mib`` MiB on its GPU: ``held_mib``
        raised where ``mib`` is more than ``charged_mib``; the container's own
        request and limit unchanged (a union hold, ADR 0033)."""
        return replace(self, held_mib=mib) if mib > self.charged_mib else self

    @property
    def owner(self) -> tuple[str, str]:
        """(pod_uid, container): the identity a tenancy is released by."""
        return (self.pod_uid, self.container)

    @property
    def hold(self) -> tuple[str, str]:
        """The identity of the hold: ``("reservation", key)`` for a kubelet
        reservation (one hold whoever holds it: an init container and the app
        container that reuses its device IDs share it), else ``owner``."""
        return ("reservation", self.reservation) if self.reservation else (self.pod_uid, self.container)

    @property
    def bound(self) -> bool:
        """True when the holder (pod and container) is known."""
        return bool(self.pod_uid)

    def to_dict(self) -> dict[str, object]:
        """Every field by name (``mode`` as its value; ``held_mib`` only when not 0, so a record
        without it reads as before): the ledger's record and ``/status``'s tenant."""
        d: dict[str, object] = {f: getattr(self, f) for f in _TENANCY_FIELDS}
        d["mode"] = self.mode.value
        if not self.held_mib:
            del d["held_mib"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "Tenancy":
        """Inverse of ``to_dict``; raises KeyError/ValueError/TypeError on a bad record."""
        if not isinstance(d, Mapping):
            raise TypeError(f"a tenancy record must be an object, got {type(d).__name__}")
        atp = d.get("active_thread_percentage")
        ns = d.get("mps_namespace")
        return cls(
            pod_uid=str(d["pod_uid"]),
            namespace=str(d["namespace"]),
            pod_name=str(d["pod_name"]),
            container=str(d["container"]),
            gpu_uuid=str(d["gpu_uuid"]),
            request_mib=_as_int(d["request_mib"]),
            limit_mib=_as_int(d["limit_mib"]),
            mode=ComputeMode(d["mode"]),
            container_id=str(d.get("container_id") or ""),
            mps_namespace=None if ns is None else str(ns),
            active_thread_percentage=None if atp is None else _as_int(atp),
            door=str(d.get("door") or "nri"),
            reservation=str(d.get("reservation") or ""),
            held_mib=_as_int(d.get("held_mib", 0)),
        )


_TENANCY_FIELDS = tuple(f.name for f in fields(Tenancy))


def _as_int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v
