"""Fractional devices of the device plugin door: naming and preferred allocation.

Pure code: no I/O, no clock, no threads. Safe to call from any thread (all
inputs are passed in, nothing is shared).

The extended resource (kubelet-device-plugin.md A.3, A.5):

* one resource, default name ``fracplugin.io/gpu-memory`` (``fracplugin.io``
  is a domain the project owns; anything outside ``kubernetes.io`` /
  ``k8s.io`` is accepted by kubelet's ``IsExtendedResourceName``);
* one device = ``unit_mib`` MiB (default 1024 = 1 GiB) of one GPU;
* device IDs are ``<GPU-UUID>::<n>`` with ``n`` in ``0 .. floor(memory_mib / unit_mib) - 1``;
  the proto comment on ``Device.ID`` caps an ID at 63 characters, which a
  standard NVML UUID (``GPU-`` + 36 chars) plus ``::`` and up to 5 digits fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from ..model import ComputeMode, GpuInfo, NodeInfo

DEFAULT_RESOURCE_NAME = "fracplugin.io/gpu-memory"
DEFAULT_UNIT_MIB = 1024
MAX_DEVICE_ID_LEN = 63
ID_SEP = "::"
POLICIES = ("pack", "spread")

# kubelet-device-plugin.md A.3: resource_name must be an extended resource
# name; the kubernetes.io domain is rejected. Qualified-name shape
# (<dns-subdomain>/<name>) as in Kubernetes' IsQualifiedName.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


class DeviceIdError(ValueError):
    """A device ID that is not ``<GPU-UUID>::<n>`` of this node."""


def validate_resource_name(name: str) -> str:
    """Return ``name`` if it is an extended resource name kubelet accepts.

    Rule (Kubernetes ``IsExtendedResourceName``, reference A.3): ``<domain>/<name>``,
    domain a DNS subdomain (<= 253 chars) not ``kubernetes.io`` / ``*.kubernetes.io``
    / ``k8s.io``, name <= 63 chars; the name may not start with ``requests.``.
    Raises ValueError naming the rule.
    """
    if name.count("/") != 1:
        raise ValueError(f"resource name {name!r} must be <domain>/<name> (an extended resource name)")
    domain, short = name.split("/")
    if not domain or len(domain) > 253 or not _DNS_SUBDOMAIN.match(domain):
        raise ValueError(f"resource name {name!r}: domain {domain!r} is not a DNS subdomain")
    if domain in ("kubernetes.io", "k8s.io") or domain.endswith(".kubernetes.io") or domain.endswith(".k8s.io"):
        raise ValueError(f"resource name {name!r}: the {domain} domain is reserved; kubelet rejects it")
    if not short or len(short) > 63 or not _NAME.match(short):
        raise ValueError(f"resource name {name!r}: name part {short!r} is not a qualified name (<= 63 chars)")
    if name.startswith("requests."):
        raise ValueError(f"resource name {name!r} may not start with 'requests.'")
    return name


def device_id(gpu_uuid: str, n: int) -> str:
    """``<GPU-UUID>::<n>``."""
    return f"{gpu_uuid}{ID_SEP}{n}"


def parse_device_id(dev_id: str) -> tuple[str, int]:
    """Split ``<GPU-UUID>::<n>`` into (uuid, n). Raises DeviceIdError."""
    uuid, sep, num = dev_id.rpartition(ID_SEP)
    if not sep or not uuid or not num.isdigit():
        raise DeviceIdError(f"device ID {dev_id!r} is not <GPU-UUID>{ID_SEP}<n>")
    return uuid, int(num)


@dataclass(frozen=True)
class DeviceTable:
    """The devices advertised for one node.

    Attributes:
        node: the node (GPUs in index order).
        unit_mib: MiB per device.
        per_gpu: GPU UUID -> number of devices on it (floor(memory_mib / unit_mib)).
    """

    node: NodeInfo
    unit_mib: int
    per_gpu: Mapping[str, int]
    lookup: Mapping[str, tuple[GpuInfo, int]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, node: NodeInfo, unit_mib: int = DEFAULT_UNIT_MIB) -> "DeviceTable":
        """Build the table. Raises ValueError when ``unit_mib`` < 1, when a GPU's
        IDs would exceed 63 characters (reference A.3, ``Device.ID``), or when
        two GPUs share a UUID."""
        if unit_mib < 1:
            raise ValueError(f"device unit {unit_mib} MiB must be >= 1")
        per: dict[str, int] = {}
        for gpu in node.gpus:
            if gpu.uuid in per:
                raise ValueError(f"GPU UUID {gpu.uuid} appears twice in the inventory")
            count = gpu.memory_mib // unit_mib if not gpu.mig_enabled else 0
            if count > 0:
                longest = device_id(gpu.uuid, count - 1)
                if len(longest) > MAX_DEVICE_ID_LEN:
                    raise ValueError(
                        f"device ID {longest!r} is {len(longest)} characters; kubelet's limit is "
                        f"{MAX_DEVICE_ID_LEN} (deviceplugin v1beta1 Device.ID)"
                    )
            per[gpu.uuid] = count
        lookup = {device_id(g.uuid, n): (g, n) for g in node.gpus for n in range(per[g.uuid])}
        return cls(node=node, unit_mib=unit_mib, per_gpu=per, lookup=lookup)

    def ids(self, gpu_uuid: str) -> list[str]:
        """All device IDs of one GPU, n ascending."""
        return [device_id(gpu_uuid, n) for n in range(self.per_gpu.get(gpu_uuid, 0))]

    def all_ids(self) -> list[str]:
        """All device IDs, GPUs in index order, n ascending."""
        out: list[str] = []
        for gpu in self.node.gpus:
            out.extend(self.ids(gpu.uuid))
        return out

    def __len__(self) -> int:
        return sum(self.per_gpu.values())

    def gpu_of(self, dev_id: str) -> GpuInfo:
        """The GPU a device ID belongs to. Raises DeviceIdError for an ID that
        is malformed, names an unknown GPU, or has n out of range."""
        hit = self.lookup.get(dev_id)
        if hit is not None:
            return hit[0]
        uuid, n = parse_device_id(dev_id)
        count = self.per_gpu.get(uuid)
        gpu = self.node.gpu_by_uuid(uuid)
        if count is None or gpu is None:
            raise DeviceIdError(f"device ID {dev_id!r} names GPU {uuid}, which is not on node {self.node.name}")
        if n >= count:
            raise DeviceIdError(f"device ID {dev_id!r}: GPU {uuid} has devices 0..{count - 1}")
        return gpu

    def group(self, dev_ids: Iterable[str]) -> dict[str, list[str]]:
        """Group device IDs by GPU UUID (GPU index order, IDs in given order).
        Raises DeviceIdError for an unknown ID or a duplicate."""
        seen: set[str] = set()
        by_gpu: dict[str, list[str]] = {}
        for d in dev_ids:
            if d in seen:
                raise DeviceIdError(f"device ID {d!r} appears twice in one request")
            seen.add(d)
            by_gpu.setdefault(self.gpu_of(d).uuid, []).append(d)
        order = {g.uuid: g.index for g in self.node.gpus}
        return dict(sorted(by_gpu.items(), key=lambda kv: order[kv[0]]))


@dataclass(frozen=True)
class GpuView:
    """What GetPreferredAllocation knows about one GPU.

    ``mode`` is the compute mode of its current tenants (ledger), None when it
    has none.
    """

    uuid: str
    index: int
    total: int
    mode: ComputeMode | None = None


def preferred_allocation(
    table: DeviceTable,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    *,
    mode_of: Callable[[str], ComputeMode | None] = lambda _u: None,
    pod_mode: ComputeMode | None = None,
    policy: str = "pack",
    free_mib_of: Callable[[str], int | None] = lambda _u: None,
) -> list[str]:
    """Choose ``size`` device IDs for one container (GetPreferredAllocation).

    Rules (issue 4 item 4), in order:

    1. every ID of ``must_include`` that is known and available is taken
       (kubelet passes reusable init-container devices here, reference A.5);
       IDs that are unknown to this node are ignored, never returned;
    2. the rest is spread over the fewest GPUs ``k`` (1, 2, ...) such that
       ``size`` splits evenly (``size / k`` devices on each, the Allocate rule)
       and each chosen GPU has that many available: a request that fits one GPU
       lands on one GPU;
    3. GPUs are ranked: GPUs that already hold must_include devices first, then
       GPUs whose tenants share ``pod_mode`` (or any tenant mode when the pod's
       mode is unknown), then empty GPUs, then GPUs of another mode; inside a
       tier ``pack`` prefers the GPU with fewer available devices (fill before
       opening), ``spread`` the one with more; ties by GPU index;
    4. inside a GPU the lowest ``n`` first;
    5. a GPU whose free memory by the ledger (``free_mib_of``: GPU memory
       minus what tenants of both doors hold; None = unknown) is below the
       devices' MiB is only used when no split avoids it (NRI-door tenants
       hold memory kubelet's device count does not see).

    When no even split exists, a greedy fill in rank order is returned (kubelet
    tops up or ignores a preferred answer it cannot use). Never more than
    ``size`` IDs, never a duplicate, never an ID outside ``available`` (except
    must_include IDs, which kubelet guarantees are allocatable).
    Raises ValueError for an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"allocation policy {policy!r} must be one of {', '.join(POLICIES)}")
    if size <= 0:
        return []
    avail_by_gpu: dict[str, list[tuple[int, str]]] = {}
    seen: set[str] = set()
    lookup = table.lookup
    for d in list(must_include) + list(available):
        if d in seen:
            continue
        hit = lookup.get(d)
        if hit is None:  # not a device of this node: never returned
            continue
        seen.add(d)
        avail_by_gpu.setdefault(hit[0].uuid, []).append((hit[1], d))
    must: list[str] = []
    must_gpus: dict[str, int] = {}
    for d in must_include:
        if d in seen and d not in must:
            must.append(d)
            uuid = lookup[d][0].uuid
            must_gpus[uuid] = must_gpus.get(uuid, 0) + 1
    if len(must) >= size:
        return must[:size]
    must_set = set(must)
    free: dict[str, list[str]] = {
        u: [d for _n, d in sorted(lst) if d not in must_set] for u, lst in avail_by_gpu.items()
    }
    index = {g.uuid: g.index for g in table.node.gpus}

    def rank(uuid: str) -> tuple[int, int, int]:
        gpu_mode = mode_of(uuid)
        if uuid in must_gpus:
            tier = 0
        elif gpu_mode is not None and (pod_mode is None or gpu_mode == pod_mode):
            tier = 1
        elif gpu_mode is None:
            tier = 2
        else:
            tier = 3
        n_avail = len(free.get(uuid, ()))
        fill = n_avail if policy == "pack" else -n_avail
        return (tier, fill, index.get(uuid, 1 << 30))

    ranked = sorted(free, key=rank)

    def memory_fits(uuid: str, devices: int) -> bool:
        room = free_mib_of(uuid)
        return room is None or room >= devices * table.unit_mib

    # Even split over the fewest GPUs; must_include devices count toward their
    # GPU. First only GPUs with the memory free by the ledger, then any.
    for check_memory in (True, False):
        for k in range(1, len(ranked) + 1):
            if size % k:
                continue
            per = size // k
            if any(c > per for c in must_gpus.values()) or len(must_gpus) > k:
                continue
            chosen: list[str] = list(must_gpus)
            for uuid in ranked:
                if len(chosen) == k:
                    break
                if uuid in must_gpus:
                    continue
                if len(free[uuid]) >= per and (not check_memory or memory_fits(uuid, per)):
                    chosen.append(uuid)
            if len(chosen) < k or any(len(free[u]) + must_gpus.get(u, 0) < per for u in chosen):
                continue
            out = list(must)
            for uuid in sorted(chosen, key=rank):
                need = per - must_gpus.get(uuid, 0)
                out.extend(free[uuid][:need])
            return out
    out = list(must)
    for uuid in ranked:
        for d in free[uuid]:
            if len(out) == size:
                return out
            out.append(d)
    return out
