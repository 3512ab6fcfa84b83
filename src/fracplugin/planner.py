"""FractionRequest + node + ledger -> ContainerPlan (pure: no I/O, no clock, no globals).

Same inputs, same plan. The ledger is only read (``tenants``); recording the
plan is the caller's job (``Ledger.admit``), which re-checks the guards
atomically.

Rules (docs/reference/design.md section 4; docs/reference/gpu-fractioning-reference.md section 3):

- devices named by the scheduler (``.gpus.devices``) must exist on the node;
  entries are UUIDs, indices or CDI names (``vendor/class=<uuid|index>``);
- otherwise the node places the container: GPUs with enough free memory for
  the request and no tenant of the other compute mode, fewest tenants first,
  then lowest index;
- per GPU: request <= GPU memory, limit <= GPU memory, limit >= request,
  one compute mode, held MiB <= memory, tenants <= MPS client limit;
- env: ``NVIDIA_VISIBLE_DEVICES`` (UUIDs in container-ordinal order),
  ``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT`` (MiB), ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (``<uuid>=<limit>M,...``, the planned GPUs only, keyed by UUID: issue 35), ``CUDA_VISIBLE_DEVICES``
  (the planned GPU UUIDs in that order), ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
  (sm-sharing with a portion), ``CUDA_MPS_PIPE_DIRECTORY``; one read-only bind
  mount of the container's own pipe directory (its MPS v3 namespace leaf in
  every mode; the mode's daemon pipe directory under classic v2);
- fractions resolve against GPU memory minus ``reserve_mib`` (1024 by default,
  KAI's binder reserve); a container without ``.gpu-compute.portion`` gets the
  portion KAI would write (``kai_compute_portion``), which caps sm-sharing;
- devices written as CDI names are also passed on as CDI devices (ADR 0005).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Protocol, Sequence

from . import annotations as ann
from .ledger import DEFAULT_MAX_CLIENTS_PER_GPU, admission_problem, same_hold
from .model import (
    ComputeMode,
    ContainerPlan,
    FractionError,
    FractionRequest,
    GpuInfo,
    Mount,
    NodeInfo,
    PodRef,
    Tenancy,
)
from .mps.layout import CONTAINER_PIPE_DIR, MpsLayout, namespace_name

ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_MEMORY_REQUEST = "NVIDIA_GPU_MEMORY_REQUEST"
ENV_MEMORY_LIMIT = "NVIDIA_GPU_MEMORY_LIMIT"
ENV_PINNED_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: Every env key fracplugin owns; pod-authored values of these are overridden.
ENFORCED_ENV_KEYS = (
    ENV_VISIBLE_DEVICES, ENV_MEMORY_REQUEST, ENV_MEMORY_LIMIT,
    ENV_PINNED_LIMIT, ENV_ACTIVE_THREAD_PERCENTAGE, ENV_PIPE_DIRECTORY, ENV_CUDA_VISIBLE_DEVICES,
)


_INDEX_RE = re.compile(r"(0|[1-9][0-9]{0,3})\Z")

#: MiB per GPU kept out of fraction resolution by default: KAI's NvFractions
#: binder holds back 1Gi per GPU ("leaving the MPS server room for its own
#: device context", KAI-Scheduler pkg/binder/plugins/nvfractions/nv_fractions.go,
#: ``reservedGpuMemoryMiB``, shipped default 1Gi), so a fraction resolved on
#: the node gets the MiB KAI's binder would have written.
DEFAULT_RESERVE_MIB = 1024


class Unusable(NamedTuple):
    """Why a GPU takes no new fraction now (``NodeRules.unusable``): ``why``
    completes "GPU <index> (<uuid>) ..." (``is Unhealthy (xid 79)``, ``is in
    MIG mode``) and ``code`` is the refusal's code (``unhealthy``, ``cordoned``, ``mig``)."""

    why: str
    code: str


NO_UNUSABLE: Mapping[str, Unusable] = {}
UNUSABLE_RULE = "no new fraction on an Unhealthy, cordoned or MIG-mode GPU"


class LedgerView(Protocol):
    """The read-only part of the ledger the planner needs."""

    def tenants(self, gpu_uuid: str) -> Sequence[Tenancy]: ...


class EmptyLedger:
    """A ledger view with no tenants (``fracplugin explain`` on an idle node)."""

    def tenants(self, gpu_uuid: str) -> Sequence[Tenancy]:
        return ()


@dataclass(frozen=True)
class PlannerConfig:
    """Node-side settings of the planner.

    Attributes:
        reserve_mib: MiB per GPU kept out of fraction resolution (room for the
            MPS server's own context): ``floor((memory - reserve) * fraction)``.
        max_clients_per_gpu: tenants per GPU (MPS client limit).
        layout: where MPS pipe directories live on the host.
        annotation_prefix: prefix of the per-container keys.
        mps_namespaces: True with MPS v3 (driver r615+): each sm-sharing
            container gets its own namespace (own pipe directory, own cap).
            False with classic v2, which has no namespaces: sm-sharing
            containers share the sm-sharing daemon's pipe directory and the
            active thread percentage is carried by the env only.
        cdi_devices: True: devices written as CDI names are also requested
            as CDI devices in the NRI adjustment (needs containerd 2.1+ or
            CRI-O 1.34+, docs/reference/nri-protocol.md 1.10); False: env only (ADR 0005).
    """

    reserve_mib: int = DEFAULT_RESERVE_MIB
    max_clients_per_gpu: int = DEFAULT_MAX_CLIENTS_PER_GPU
    layout: MpsLayout = field(default_factory=MpsLayout)
    annotation_prefix: str = ann.DEFAULT_PREFIX
    mps_namespaces: bool = True
    cdi_devices: bool = True


def is_cdi_name(entry: str) -> bool:
    """True for a fully qualified CDI device name ``<vendor>/<class>=<device>``
    (e.g. ``k8s.device-plugin.nvidia.com/gpu=GPU-...``, KAI's
    ``gpuDevicePluginUsesCdi`` form)."""
    if "=" not in entry:
        return False
    kind, _, dev = entry.partition("=")
    vendor, slash, cls = kind.partition("/")
    return bool(slash and vendor and cls and dev)


def kai_compute_portion(request: FractionRequest, gpus: Sequence[GpuInfo], request_mib: int,
                        reserve_mib: int) -> float | None:
    """The compute portion KAI's NvFractions binder writes for ``request``, in (0, 1].

    KAI's scheduler puts the pod's GPU portion in its BindRequest as
    ``fmt.Sprintf("%.2f", portion)`` (pkg/scheduler/cache/cache.go): the
    fraction itself for ``gpu-fraction`` pods, and for memory requests
    ``ceil(memory / gpu_memory * 100) / 100`` (node_info.go,
    ``getGpuMemoryFractionalOnNode``, against the node's per-GPU memory, not
    reserve-adjusted). The binder writes that value, capped at 1, as
    ``.gpu-compute.portion``; when it parses to 0 it falls back to request MiB
    / (GPU memory - reserve) (nv_fractions.go, ``resolveComputePortion``).
    Python's ``round(x, 2)`` (the correctly rounded ``%.2f``) rounds the exact binary value as Go's does.

    Args:
        request: the parsed request (fraction or absolute MiB).
        gpus: the assigned GPUs; the smallest one's memory (MiB) is used.
        request_mib: the resolved request, MiB per GPU.
        reserve_mib: the per-GPU reserve, MiB (fallback only).

    Returns:
        The portion, or None when the GPUs report no memory.
    """
    memory = min(g.memory_mib for g in gpus)
    if memory <= 0:
        return None
    if request.request.fraction is not None:
        exact = request.request.fraction
    else:
        exact = math.ceil(request_mib / memory * 100) / 100
    portion = min(round(exact, 2), 1.0)
    if portion > 0:
        return portion
    usable = memory - reserve_mib
    return min(request_mib / usable, 1.0) if usable > 0 else None


def resolve_device(node: NodeInfo, entry: str) -> GpuInfo | None:
    """One ``.gpus.devices`` entry -> a GPU of ``node``, or None.

    Accepts a UUID (``GPU-...``), an index (``2``) or a CDI name whose device
    part is either (``k8s.device-plugin.nvidia.com/gpu=GPU-...``, KAI's
    ``gpuDevicePluginUsesCdi`` form).
    """
    if is_cdi_name(entry):
        entry = entry.split("=", 1)[1]
    if _INDEX_RE.match(entry):  # ASCII digits, no sign, no leading zero, bounded
        return node.gpu_by_index(int(entry))
    return node.gpu_by_uuid(entry)


def _resolve_devices(request: FractionRequest, node: NodeInfo,
                     unusable: Mapping[str, Unusable]) -> tuple[GpuInfo, ...]:
    key = request.keys.get("devices", "devices")
    raw = ",".join(request.devices)
    if request.devices == ("all",):
        return _usable(node.gpus, unusable, key, raw)
    if len(request.devices) > len(node.gpus):
        raise FractionError(key, raw, f"names {len(request.devices)} devices, node {node.name} has {len(node.gpus)} GPUs", "device")
    gpus = []
    for entry in request.devices:
        gpu = resolve_device(node, entry)
        if gpu is None:
            known = ", ".join(f"{g.index}={g.uuid}" for g in node.gpus)
            raise FractionError(key, raw, f"names {entry!r}, which is not a GPU of node {node.name} (it has {known})", "device")
        if gpu in gpus:
            raise FractionError(key, raw, f"names GPU {gpu.index} ({gpu.uuid}) twice", "device")
        gpus.append(gpu)
    return _usable(gpus, unusable, key, raw)


def _usable(gpus: Sequence[GpuInfo], unusable: Mapping[str, Unusable], key: str, raw: str) -> tuple[GpuInfo, ...]:
    """``gpus`` when none is unusable; else the refusal naming the first one."""
    for g in gpus:
        bad = unusable.get(g.uuid)
        if bad is not None:
            raise FractionError(key, raw, f"names GPU {g.index} ({g.uuid}), which {bad.why}: {UNUSABLE_RULE}",
                                bad.code)
    return tuple(gpus)


def _memory(request: FractionRequest, gpus: Sequence[GpuInfo], reserve_mib: int) -> tuple[int, int]:
    """Per-GPU request and limit MiB: the smallest over the GPUs (fractions of
    different-sized GPUs resolve differently; the env carries one number)."""
    req = min(request.request.resolve_mib(g.memory_mib, reserve_mib) for g in gpus)
    lim = min(request.limit.resolve_mib(g.memory_mib, reserve_mib) for g in gpus)
    if req < 1:
        raise FractionError(request.request.key, request.request.raw, "resolves to less than 1 MiB on this node's GPUs", "quantity")
    if lim < req:
        raise FractionError(
            request.limit.key, request.limit.raw,
            f"resolves to {lim} MiB, below the request {request.request.raw} ({req} MiB): the limit must be >= the request",
            "limit_below_request",
        )
    for g in gpus:
        for spec, mib in ((request.request, req), (request.limit, lim)):
            if mib > g.memory_mib:
                raise FractionError(spec.key, spec.raw, f"is {mib} MiB, more than GPU {g.index} ({g.uuid}) has "
                                    f"({g.memory_mib} MiB)", "too_large")
    return req, lim


def _place(request: FractionRequest, pod: PodRef, node: NodeInfo, ledger: LedgerView, config: PlannerConfig,
           reservation: str, unusable: Mapping[str, Unusable]) -> tuple[GpuInfo, ...]:
    owner = (pod.uid, request.container)
    key = request.keys.get("request", "request")
    if request.num_devices > len(node.gpus):
        nkey = request.keys.get("num_devices", key)
        raise FractionError(nkey, str(request.num_devices), f"asks for more GPUs than node {node.name} has ({len(node.gpus)})", "device")
    largest = max(node.gpus, key=lambda g: g.memory_mib)
    if request.request.resolve_mib(largest.memory_mib, config.reserve_mib) > largest.memory_mib:
        _memory(request, (largest,), config.reserve_mib)  # raises the precise too_large error
    fits: list[tuple[int, int, GpuInfo]] = []
    facts: list[str] = []
    rules: list[str] = []
    for g in node.gpus:
        bad = unusable.get(g.uuid)
        if bad is not None:
            facts.append(f"GPU {g.index} ({g.uuid}) {bad.why}")
            if UNUSABLE_RULE not in rules:
                rules.append(UNUSABLE_RULE)
            continue
        req = request.request.resolve_mib(g.memory_mib, config.reserve_mib)
        tenants = ledger.tenants(g.uuid)
        problem = admission_problem(g, tenants, owner, request.compute_mode, req, config.max_clients_per_gpu,
                                    reservation)
        if problem:
            facts.append(problem.fact)
            if problem.rule not in rules:
                rules.append(problem.rule)
        else:
            fits.append((len([t for t in tenants if not same_hold(t, owner, reservation)]), g.index, g))
    if len(fits) < request.num_devices:
        raise FractionError(
            key, request.request.raw,
            f"cannot be placed on {request.num_devices} GPU(s) of node {node.name} "
            f"(only {len(fits)} fit): " + "; ".join(facts) + " (" + "; ".join(rules) + ")",
            "no_fit",
        )
    chosen = sorted(fits, key=lambda f: (f[0], f[1]))[: request.num_devices]
    return tuple(sorted((f[2] for f in chosen), key=lambda g: g.index))


def plan(
    request: FractionRequest,
    pod: PodRef,
    node: NodeInfo,
    ledger: LedgerView,
    config: PlannerConfig = PlannerConfig(),
    *,
    reservation: str = "",
    unusable: Mapping[str, Unusable] = NO_UNUSABLE,
) -> ContainerPlan:
    """Decide what ``request`` gets on ``node`` given who holds what.

    ``reservation``: the kubelet reservation key this plan is for (its own
    ledger entries do not count against it: ``ledger.same_hold``).
    ``unusable``: GPU UUID -> why it takes no new fraction (``Unusable``;
    the node's rules, ``noderules.NodeRules.unusable``): node placement skips
    it, naming it refuses with its code.

    Returns:
        The ContainerPlan (env values are strings; MiB integers).

    Raises:
        FractionError: a device does not exist, the memory does not fit a GPU,
            the limit is below the request, a named GPU is unusable (code
            ``unhealthy`` or ``mig``), or a guard (compute mode, free memory,
            client count) refuses; the message names key, value, rule.
    """
    placed = not request.devices
    gpus = (_place(request, pod, node, ledger, config, reservation, unusable) if placed
            else _resolve_devices(request, node, unusable))
    request_mib, limit_mib = _memory(request, gpus, config.reserve_mib)
    if not placed:
        owner = (pod.uid, request.container)
        for g in gpus:
            problem = admission_problem(g, ledger.tenants(g.uuid), owner, request.compute_mode,
                                        request_mib, config.max_clients_per_gpu, reservation)
            if problem:
                raise FractionError(request.keys.get("devices", "devices"), ",".join(request.devices), str(problem), "guard")

    portion = request.portion
    if portion is None:
        portion = kai_compute_portion(request, gpus, request_mib, config.reserve_mib)
    atp = None
    if request.compute_mode is ComputeMode.SM_SHARING and portion is not None:
        # floor(portion x 100), at least 1 (docs/reference/gpu-fractioning-reference.md 2a)
        atp = max(1, math.floor(portion * 100))
    cdi = tuple(e for e in request.devices if is_cdi_name(e)) if (config.cdi_devices and not placed) else ()
    ns = namespace_name(pod.uid, request.container) if config.mps_namespaces else None
    return _finish(pod, request.container, gpus, request_mib, limit_mib, request.compute_mode, atp, ns, config,
                   placed, cdi=cdi, portion=portion)


def plan_from_tenancies(tenancies: Sequence[Tenancy], node: NodeInfo, config: PlannerConfig = PlannerConfig(),
                        pod: PodRef | None = None, container: str | None = None) -> ContainerPlan:
    """The plan a recorded hold stands for (one Tenancy per GPU, as
    ``allocation.to_tenancies`` wrote them): same GPUs in ordinal order,
    request, limit, mode, active thread percentage and MPS namespace, so a
    re-Allocate of the same device IDs gets the first answer again at once
    (docs/reference/kubelet-device-plugin.md A.5). Raises ValueError when ``tenancies`` is
    empty or names a GPU the node does not have."""
    if not tenancies:
        raise ValueError("no tenancies")
    gpus = []
    for t in tenancies:
        g = node.gpu_by_uuid(t.gpu_uuid)
        if g is None:
            raise ValueError(f"tenancy names GPU {t.gpu_uuid}, which node {node.name} does not have")
        gpus.append(g)
    t0 = tenancies[0]
    ref = pod or PodRef(t0.namespace, t0.pod_name, t0.pod_uid)
    return _finish(ref, container if container is not None else t0.container, tuple(gpus), t0.request_mib,
                   t0.limit_mib, t0.mode, t0.active_thread_percentage, t0.mps_namespace, config, False,
                   portion=None if t0.active_thread_percentage is None else t0.active_thread_percentage / 100)


@functools.lru_cache(maxsize=1024)  # on every CreateContainer (issue 14); a pure function of its arguments
def _pinned_limit(uuids: tuple[str, ...], limit_mib: int) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: ``<uuid>=<limit>M,...`` for the
    container's own GPUs only (docs/reference/mps-nvml.md 2.1: ``<ordinal or
    UUID>=<size>``). UUID keys, never ordinals: NVIDIA measured that a list
    naming a GPU the process cannot see (a worker that narrows
    ``CUDA_VISIBLE_DEVICES``) makes the client drop every pinned limit
    (docs/reference/enforcement-cdi-dra.md, "NVIDIA's measured behaviour")."""
    return ",".join(f"{u}={limit_mib}M" for u in uuids)


@functools.lru_cache(maxsize=4096)  # frozen values, shared between plans (issue 14)
def _pipe_mounts(host_pipe: str) -> tuple[Mount, ...]:
    """The one bind mount of a plan: the pipe directory, read-only:
    connecting to a unix socket works on a read-only mount, unlinking or
    replacing it does not (issue 12)."""
    return (Mount(source=host_pipe, destination=CONTAINER_PIPE_DIR, read_only=True),)


def _finish(pod: PodRef, container: str, gpus: tuple[GpuInfo, ...], request_mib: int, limit_mib: int,
            mode: ComputeMode, atp: int | None, ns: str | None, config: PlannerConfig,
            placed: bool, *, cdi: tuple[str, ...] = (), portion: float | None = None) -> ContainerPlan:
    """Env, mounts and MPS namespace of a decided placement."""
    layout = config.layout
    # MPS v3: every container, in every mode, gets its own namespace leaf; no
    # container ever sees a daemon's control socket (issue 12). Classic v2 has
    # no namespaces: the mode's daemon pipe directory, read-only (the
    # supervisor reports this exposure).
    host_pipe = layout.namespace_pipe_dir(ns, mode) if ns else layout.pipe_dir(mode)
    uuids = gpus[0].uuid if len(gpus) == 1 else ",".join([g.uuid for g in gpus])
    env: dict[str, str] = {
        ENV_VISIBLE_DEVICES: uuids,
        # The MPS server spans every GPU of its daemon: restrict the client to
        # its own, in plan order (docs/reference/mps-nvml.md 1.3 and 2.1).
        ENV_CUDA_VISIBLE_DEVICES: uuids,
        ENV_MEMORY_REQUEST: str(request_mib),
        ENV_MEMORY_LIMIT: str(limit_mib),
        ENV_PINNED_LIMIT: _pinned_limit(tuple(g.uuid for g in gpus), limit_mib),
    }
    if atp is not None:
        env[ENV_ACTIVE_THREAD_PERCENTAGE] = str(atp)
    env[ENV_PIPE_DIRECTORY] = CONTAINER_PIPE_DIR
    return ContainerPlan(
        pod=pod, container=container, devices=gpus, request_mib=request_mib, limit_mib=limit_mib,
        compute_mode=mode, active_thread_percentage=atp, env=env,
        # read-only: connecting to a unix socket works on a read-only mount,
        # unlinking or replacing it does not (issue 12)
        mounts=_pipe_mounts(host_pipe),
        mps_namespace=ns, placed_by_node=placed, cdi_devices=cdi, portion=portion,
    )


