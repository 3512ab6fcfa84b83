"""Fractional devices of the device plugin door: naming and preferred allocation.

Pure code: no I/O, no clock, no threads. Safe to call from any thread (all
inputs are passed in, nothing is shared).

The extended resource (docs/reference/kubelet-device-plugin.md A.3, A.5):

* one resource, default name ``fracplugin.io/gpu-memory`` (``fracplugin.io``
  is a domain the project owns; anything outside ``kubernetes.io`` /
  ``k8s.io`` is accepted by kubelet's ``IsExtendedResourceName``);
* one device = ``unit_mib`` MiB (default 1024 = 1 GiB) of one GPU;
* device IDs are ``<GPU-UUID>::<n>`` with ``n`` in ``0 .. floor(memory_mib / unit_mib) - 1``;
  the proto comment on ``Device.ID`` caps an ID at 63 characters, which a
  standard NVML UUID (``GPU-`` + 36 chars) plus ``::`` and up to 5 digits fits;
* an ID is accepted only in the canonical form advertised: ``n`` in ASCII
  digits, no sign, no leading zero (``::01``, ``::+1``, ``::\u00b2`` or
  ``::\u0661`` are not IDs of this node), so two IDs name the same device
  exactly when they are equal strings;
* the whole ListAndWatch response must fit kubelet's 4 MiB gRPC receive limit
  (``MAX_LIST_AND_WATCH_BYTES``): a larger table is refused at build time
  (``DeviceTableTooLarge``), else the plugin would re-register forever.
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
KUBELET_MAX_RECV_BYTES = 4 * 1024 * 1024
"""grpc-go's default receive limit (bytes), which kubelet's device plugin client keeps."""
MAX_LIST_AND_WATCH_BYTES = 3584 * 1024
"""Largest encoded ListAndWatchResponse (bytes) a table may produce: 3.5 MiB,
leaving headroom under ``KUBELET_MAX_RECV_BYTES`` for gRPC framing."""
_CANONICAL_N = re.compile(r"(0|[1-9][0-9]{0,17})", re.ASCII)
_HEALTH_WORST = len("Unhealthy")

# docs/reference/kubelet-device-plugin.md A.3: resource_name must be an extended resource
# name; the kubernetes.io domain is rejected. Qualified-name shape
# (<dns-subdomain>/<name>) as in Kubernetes' IsQualifiedName.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


class DeviceIdError(ValueError):
    """A device ID that is not ``<GPU-UUID>::<n>`` of this node."""


class DeviceTableTooLarge(ValueError):
    """The ListAndWatch response of a table would exceed ``MAX_LIST_AND_WATCH_BYTES``;
    the message names the unit, its device count, the response size and the
    smallest unit whose response fits (if any: not on a node with too many GPUs)."""


def _show_id(dev_id: str, limit: int = 80) -> str:
    """repr of a device ID for messages, cut to ``limit`` characters (gRPC
    status details travel in 8 KiB of metadata)."""
    return repr(dev_id) if len(dev_id) <= limit else repr(dev_id[:limit]) + f"... ({len(dev_id)} chars)"


def _varint_len(v: int) -> int:
    n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


def _field_len(payload: int) -> int:
    """Bytes of one length-delimited protobuf field (tag < 16) with ``payload`` bytes."""
    return 1 + _varint_len(payload) + payload


def _topology_len(numa_node: int | None) -> int:
    """Bytes of ``Device.topology`` (field 3) as ``DevicePluginServer`` sets it:
    one NUMANode with the GPU's NUMA node, absent when unknown or negative."""
    if numa_node is None or numa_node < 0:
        return 0
    numa = 0 if numa_node == 0 else 1 + _varint_len(numa_node)  # NUMANode{ID int64 = 1}
    return _field_len(_field_len(numa))  # TopologyInfo{repeated NUMANode nodes = 1}


def list_and_watch_bytes(node: NodeInfo, unit_mib: int) -> int:
    """Encoded size (bytes) of the ListAndWatchResponse for ``node`` cut in
    ``unit_mib`` MiB devices, every device Unhealthy (the longest health
    string) with its GPU's topology: ``repeated Device devices = 1`` with
    ``Device{string ID = 1; string health = 2; TopologyInfo topology = 3}``
    (deviceplugin v1beta1 api.proto, protobuf wire format). Pure arithmetic,
    O(GPUs x digits). Raises ValueError when ``unit_mib`` < 1."""
    if unit_mib < 1:
        raise ValueError(f"device unit {unit_mib} MiB must be >= 1")
    total = 0
    for gpu in node.gpus:
        count = 0 if gpu.mig_enabled else gpu.memory_mib // unit_mib
        fixed = _field_len(_HEALTH_WORST) + _topology_len(gpu.numa_node)
        lo, digits = 0, 1
        while lo < count:
            hi = min(count, 10**digits)  # n in [lo, hi) has `digits` digits
            id_len = len(gpu.uuid.encode()) + len(ID_SEP) + digits
            total += (hi - lo) * _field_len(_field_len(id_len) + fixed)
            lo, digits = hi, digits + 1
    return total


def smallest_fitting_unit(node: NodeInfo) -> int | None:
    """The smallest unit (MiB) whose ListAndWatch response is at most
    ``MAX_LIST_AND_WATCH_BYTES`` (the size only shrinks as the unit grows);
    None when even one device per GPU does not fit."""
    top = max([g.memory_mib for g in node.gpus] + [1])
    if list_and_watch_bytes(node, top) > MAX_LIST_AND_WATCH_BYTES:
        return None
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi) // 2
        if list_and_watch_bytes(node, mid) <= MAX_LIST_AND_WATCH_BYTES:
            hi = mid
        else:
            lo = mid + 1
    return lo


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
    """Split ``<GPU-UUID>::<n>`` into (uuid, n), accepting only the canonical
    form ``device_id`` writes: ``n`` in ASCII digits without sign or leading
    zero, at most 18 digits. Raises DeviceIdError naming the ID (never another
    exception, whatever the string)."""
    uuid, sep, num = dev_id.rpartition(ID_SEP)
    if not sep or not uuid or not _CANONICAL_N.fullmatch(num):
        raise DeviceIdError(
            f"device ID {_show_id(dev_id)} is not <GPU-UUID>{ID_SEP}<n> "
            "(n in ASCII digits, no sign or leading zero)"
        )
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
        two GPUs share a UUID; DeviceTableTooLarge (a ValueError) when the
        ListAndWatch response would exceed ``MAX_LIST_AND_WATCH_BYTES``,
        checked before any per-device work."""
        if unit_mib < 1:
            raise ValueError(f"device unit {unit_mib} MiB must be >= 1")
        size = list_and_watch_bytes(node, unit_mib)
        if size > MAX_LIST_AND_WATCH_BYTES:
            devices = sum(0 if g.mig_enabled else g.memory_mib // unit_mib for g in node.gpus)
            smallest = smallest_fitting_unit(node)
            hint = f"use a device unit of at least {smallest} MiB" if smallest else "no device unit makes it fit"
            raise DeviceTableTooLarge(
                f"device unit {unit_mib} MiB makes {devices} devices; their ListAndWatch response would be {size} "
                f"bytes, over the {MAX_LIST_AND_WATCH_BYTES}-byte bound under kubelet's 4 MiB gRPC receive limit "
                f"(kubelet would never receive the device list); {hint}")
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

    def __len__(self) -> int:
        return sum(self.per_gpu.values())

    def gpu_of(self, dev_id: str) -> GpuInfo:
        """The GPU a device ID belongs to. Only IDs exactly as advertised are
        accepted (canonical form, module docstring). Raises DeviceIdError
        naming the ID for one that is malformed or not canonical, names an
        unknown GPU, or has n out of range."""
        if not isinstance(dev_id, str):
            raise DeviceIdError(f"device ID {dev_id!r} is not a string")
        hit = self.lookup.get(dev_id)
        if hit is not None:
            return hit[0]
        uuid, n = parse_device_id(dev_id)
        count = self.per_gpu.get(uuid)
        gpu = self.node.gpu_by_uuid(uuid)
        if count is None or gpu is None:
            raise DeviceIdError(
                f"device ID {_show_id(dev_id)} names GPU {_show_id(uuid)}, which is not on node {self.node.name}"
            )
        if n >= count:
            raise DeviceIdError(
                f"device ID {_show_id(dev_id)}: GPU {uuid} has devices 0..{count - 1}"
                if count else f"device ID {_show_id(dev_id)}: GPU {uuid} has no devices"
            )
        return gpu

    def group(self, dev_ids: Iterable[str]) -> dict[str, list[str]]:
        """Group device IDs by GPU UUID (GPU index order, IDs in given order).
        Raises DeviceIdError for an unknown or non-canonical ID or a duplicate."""
        seen: set[str] = set()
        by_gpu: dict[str, list[str]] = {}
        for d in dev_ids:
            gpu = self.gpu_of(d)  # canonical IDs only: equal strings <=> same device
            if d in seen:
                raise DeviceIdError(f"device ID {_show_id(d)} appears twice in one request")
            seen.add(d)
            by_gpu.setdefault(gpu.uuid, []).append(d)
        order = {g.uuid: g.index for g in self.node.gpus}
        return dict(sorted(by_gpu.items(), key=lambda kv: order[kv[0]]))


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
    full_of: Callable[[str], bool] = lambda _u: False,
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

    6. a GPU that cannot take another tenant (``full_of``: at the MPS client
       limit, or given whole to another device plugin's container) is only
       used when no split avoids it, like 5.

    When no even split exists, only the must_include IDs are returned: an
    uneven split would be refused by Allocate (issue 10 item 7), so none is
    proposed; kubelet tops up a short preferred answer itself. Never more than
    ``size`` IDs, never a duplicate, never an ID outside ``available`` (except
    must_include IDs, which kubelet guarantees are allocatable).
    Raises ValueError for an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"allocation policy {policy!r} must be one of {', '.join(POLICIES)}")
    if size <= 0:
        return []
    avail_by_gpu, must, must_gpus = _known_devices(table, available, must_include)
    if len(must) >= size:
        return must[:size]
    must_set = set(must)
    free: dict[str, list[str]] = {
        u: [d for _n, d in sorted(lst) if d not in must_set] for u, lst in avail_by_gpu.items()
    }
    rank = _ranking(table, free, must_gpus, mode_of, pod_mode, policy)
    ranked = sorted(free, key=rank)

    def memory_fits(uuid: str, devices: int) -> bool:
        if full_of(uuid):
            return False
        room = free_mib_of(uuid)
        return room is None or room >= devices * table.unit_mib

    # Even split over the fewest GPUs; must_include devices count toward their
    # GPU. First only GPUs with the memory free by the ledger, then any.
    for fits in (memory_fits, None):
        split = _even_split(size, ranked, free, must_gpus, fits)
        if split is not None:
            chosen, per = split
            out = list(must)
            for uuid in sorted(chosen, key=rank):
                out.extend(free[uuid][: per - must_gpus.get(uuid, 0)])
            return out
    return list(must)


def _known_devices(table: DeviceTable, available: Sequence[str], must_include: Sequence[str],
                   ) -> tuple[dict[str, list[tuple[int, str]]], list[str], dict[str, int]]:
    """The IDs of this node among ``must_include`` + ``available`` (first
    occurrence only): ({GPU UUID: [(n, ID)]}, the must_include IDs kept in
    order, {GPU UUID: how many of them it holds})."""
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
    return avail_by_gpu, must, must_gpus


def _ranking(table: DeviceTable, free: dict[str, list[str]], must_gpus: dict[str, int],
             mode_of: Callable[[str], ComputeMode | None], pod_mode: ComputeMode | None,
             policy: str) -> Callable[[str], tuple[int, int, int]]:
    """The sort key of rule 3 (``preferred_allocation``): (tier, fill, GPU index)."""
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

    return rank


def _even_split(size: int, ranked: Sequence[str], free: dict[str, list[str]], must_gpus: dict[str, int],
                fits: Callable[[str, int], bool] | None) -> tuple[list[str], int] | None:
    """The fewest GPUs ``k`` over which ``size`` devices split evenly: (the
    GPUs, ``size // k`` per GPU), or None. GPUs holding must_include devices
    are always among them; the others are taken in ``ranked`` order among
    those with enough free devices and, when ``fits`` is given, for which
    ``fits(uuid, per)`` holds."""
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
            if len(free[uuid]) >= per and (fits is None or fits(uuid, per)):
                chosen.append(uuid)
        if len(chosen) < k or any(len(free[u]) + must_gpus.get(u, 0) < per for u in chosen):
            continue
        return chosen, per
    return None
