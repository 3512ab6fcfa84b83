"""A ResourceClaim -> what Prepare gives (pure), and the API read of one claim.

kubelet's NodePrepareResources names a claim only by namespace, name and UID
(docs/reference/kubelet-dra.md §1); its allocation is in the claim's status
(§3), so the door reads the claim from the API server (``ApiClaims``) and
turns it into a ``ClaimRequest`` here (``read_claim``), then into the
planner's ``FractionRequest`` (``fraction_request``) and a ``ContainerPlan``
(``plan_claim``, through the node's rules): the same planner, guards and env as the other doors.

Rules (ADR 0031 items 2-3), each refusal a ``FractionError`` naming key, value
and rule (the texts below, ``NOT_ALLOCATED`` .. ``ADMIN_ACCESS``): the UID kubelet
sent, an allocation with results of our driver on this node's pool, devices
``gpu-<index>`` that ``slices.py`` publishes, ``consumedCapacity.memory`` the
same on every GPU of the claim, no ``adminAccess``; the opaque configs that
apply to our results merged class before claim (``params.parse``), the limit
>= the consumed memory (``contract.LIMIT_BELOW_REQUEST_MIB``).

The request is the consumed memory in MiB (rounded up; the slice's 1 MiB step
makes it exact); the limit defaults to it. No I/O except in ``ApiClaims``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .. import annotations as ann
from .. import contract as C
from ..model import ContainerPlan, FractionError, FractionRequest, GpuInfo, MemorySpec, NodeInfo, PodRef
from ..noderules import NodeRules
from . import CAPACITY_MEMORY, CLAIM_CONTAINER, DRIVER_NAME, REQUEST_TIMEOUT_S, params, reservation_of

RESULTS_KEY = "status.allocation.devices.results"
_DEVICE_RE = re.compile(r"gpu-(0|[1-9][0-9]{0,3})\Z")

NOT_ALLOCATED = "has no status.allocation: the claim is not allocated yet"
NOT_OURS = "has no device of driver {driver}"
WRONG_UID = "is not the UID kubelet asked for ({uid}): the claim was deleted and re-created"
WRONG_POOL = "is not this node's pool ({pool})"
NO_SUCH_DEVICE = "is not a GPU device of node {node} (devices gpu-<index>: {known})"
NO_MEMORY = ("has no consumedCapacity.memory: the device was not allocated with consumable capacity "
             "(resource.k8s.io/v1 allowMultipleAllocations; feature gate DRAConsumableCapacity)")
UNEVEN = "consumes different memory on the claim's GPUs ({amounts}): one amount per GPU of a claim"
ADMIN_ACCESS = "is adminAccess: the driver gives no fraction for admin access"


def device_name(gpu: GpuInfo) -> str:
    """The ResourceSlice device name of a GPU: ``gpu-<index>`` (a DNS label)."""
    return f"gpu-{gpu.index}"


def gpu_of_device(node: NodeInfo, name: str) -> GpuInfo | None:
    """The GPU a device name stands for (``gpu-<index>``), or None."""
    m = _DEVICE_RE.match(name)
    return node.gpu_by_index(int(m.group(1))) if m else None


@dataclass(frozen=True)
class AllocatedDevice:
    """One of our allocation results: the ``request`` it serves, ``pool``,
    ``device`` name, ``share_id`` (consumable capacity) and the GPU."""

    request: str
    pool: str
    device: str
    share_id: str | None
    gpu: GpuInfo


@dataclass(frozen=True)
class ClaimRequest:
    """What one claim asks of this node.

    Attributes:
        namespace, name, uid: the claim.
        devices: our allocation results, in allocation order.
        request_mib: consumed memory per GPU, MiB.
        memory_raw: the consumed quantity as the API wrote it (e.g. ``20Gi``).
        memory_key: the key it was read from (for refusals).
        parameters: the merged, checked opaque parameters.
    """

    namespace: str
    name: str
    uid: str
    devices: tuple[AllocatedDevice, ...]
    request_mib: int
    memory_raw: str
    memory_key: str
    parameters: params.GpuMemoryParameters

    @property
    def pod(self) -> PodRef:
        """The ledger's identity of the claim: namespace, claim name, claim UID."""
        return PodRef(self.namespace, self.name, self.uid)

    @property
    def reservation(self) -> str:
        return reservation_of(self.uid)


def _get(doc: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(doc, Mapping):
            return None
        doc = doc.get(p)
    return doc


def _applies(config: Mapping[str, Any], requests: set[str]) -> bool:
    named = config.get("requests") or []
    if not named:
        return True
    return any(r in named or r.split("/", 1)[0] in named for r in requests)


def _configs(allocation: Mapping[str, Any], requests: set[str]) -> list[Any]:
    """The opaque parameters of our driver that apply to ``requests``, class
    configs first, then claim configs, each group in written order."""
    entries = _get(allocation, "devices", "config") or []
    found: list[tuple[int, int, Any]] = []  # parameters are checked by params.parse
    for i, c in enumerate(entries if isinstance(entries, list) else []):
        opaque = _get(c, "opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != DRIVER_NAME or not _applies(c, requests):
            continue
        rank = 0 if c.get("source") == "FromClass" else 1
        found.append((rank, i, opaque.get("parameters")))
    return [p for _r, _i, p in sorted(found, key=lambda f: (f[0], f[1]))]


def _device(node: NodeInfo, i: int, r: Mapping[str, Any]) -> tuple[AllocatedDevice, str, str]:
    """One result of our driver -> (device, consumed raw quantity, its key)."""
    key = f"{RESULTS_KEY}[{i}]"
    if r.get("adminAccess"):
        raise FractionError(f"{key}.adminAccess", "true", ADMIN_ACCESS, "dra")
    pool, name = str(r.get("pool") or ""), str(r.get("device") or "")
    if pool != node.name:
        raise FractionError(f"{key}.pool", pool, WRONG_POOL.format(pool=node.name), "dra")
    gpu = gpu_of_device(node, name)
    if gpu is None:
        known = ", ".join(known_devices(node))
        raise FractionError(f"{key}.device", name, NO_SUCH_DEVICE.format(node=node.name, known=known), "device")
    mkey = f"{key}.consumedCapacity.{CAPACITY_MEMORY}"
    raw = _get(r, "consumedCapacity", CAPACITY_MEMORY)
    if raw is None:
        raise FractionError(f"{key}.consumedCapacity", None, NO_MEMORY, "dra")
    share = r.get("shareID")
    return (AllocatedDevice(str(r.get("request") or ""), pool, name, None if share is None else str(share), gpu),
            str(raw), mkey)


def read_claim(doc: Mapping[str, Any], node: NodeInfo, *, uid: str = "") -> ClaimRequest:
    """A ResourceClaim document (the API's JSON as a dict) -> ClaimRequest.

    Args:
        doc: the claim (``metadata``, ``status.allocation``).
        node: this node (its name is our pool; device names ``gpu-<index>``).
        uid: the UID kubelet named (checked when given).

    Raises:
        FractionError: a rule of the module docstring, naming key, value and rule.
    """
    meta = _get(doc, "metadata") or {}
    ns, name, doc_uid = str(meta.get("namespace") or ""), str(meta.get("name") or ""), str(meta.get("uid") or "")
    if uid and doc_uid != uid:
        raise FractionError("metadata.uid", doc_uid, WRONG_UID.format(uid=uid), "dra")
    allocation = _get(doc, "status", "allocation")
    if not isinstance(allocation, Mapping):
        raise FractionError(f"resourceclaim {ns}/{name}", None, NOT_ALLOCATED, "dra")
    results = _get(allocation, "devices", "results") or []
    ours: list[tuple[AllocatedDevice, str, str]] = []
    for i, r in enumerate(results if isinstance(results, list) else []):
        if isinstance(r, Mapping) and r.get("driver") == DRIVER_NAME:
            ours.append(_device(node, i, r))
    if not ours:
        raise FractionError(f"resourceclaim {ns}/{name}", None, NOT_OURS.format(driver=DRIVER_NAME), "dra")
    amounts = [ann.parse_quantity_mib(key, raw) for _d, raw, key in ours]
    if len(set(amounts)) > 1:
        raise FractionError(RESULTS_KEY, ",".join(raw for _d, raw, _k in ours),
                            UNEVEN.format(amounts=", ".join(f"{a} MiB" for a in amounts)), "dra")
    gpus = [d.gpu for d, _r, _k in ours]
    if len(set(gpus)) != len(gpus):  # two shares of one GPU in one claim: one fraction, counted once
        raise FractionError(RESULTS_KEY, ",".join(d.device for d, _r, _k in ours),
                            "names one GPU twice: one share per GPU of a claim", "dra")
    parameters = params.parse(_configs(allocation, {d.request for d, _r, _k in ours}))
    _, raw0, key0 = ours[0]
    if parameters.limit_mib is not None and parameters.limit_mib < amounts[0]:
        raise FractionError(params.field_key(params.FIELD_LIMIT), parameters.limit_raw,
                            C.LIMIT_BELOW_REQUEST_MIB.format(request_raw=raw0, request_mib=amounts[0]),
                            "limit_below_request")
    return ClaimRequest(ns, name, doc_uid or uid, tuple(d for d, _r, _k in ours), amounts[0], raw0, key0, parameters)


def fraction_request(claim: ClaimRequest) -> FractionRequest:
    """The planner's request for a claim: its GPUs named (the scheduler
    placed it), the consumed memory as the request, the parameters' limit,
    mode and portion. ``keys`` name where each came from, for refusals."""
    p = claim.parameters
    request = MemorySpec(claim.memory_key, claim.memory_raw, mib=claim.request_mib)
    limit = request if p.limit_mib is None else MemorySpec(params.field_key(params.FIELD_LIMIT), p.limit_raw,
                                                           mib=p.limit_mib)
    keys = {"request": claim.memory_key, "limit": limit.key, "devices": RESULTS_KEY,
            "mode": params.field_key(params.FIELD_MODE), "portion": params.field_key(params.FIELD_PORTION)}
    return FractionRequest(container=CLAIM_CONTAINER, request=request, limit=limit, compute_mode=p.compute_mode,
                           portion=p.portion, devices=tuple(d.gpu.uuid for d in claim.devices),
                           num_devices=len(claim.devices), keys=keys)


def plan_claim(claim: ClaimRequest, rules: NodeRules) -> ContainerPlan:
    """The claim's plan through the node's rules (``NodeRules.plan``) on its
    GPUs, with the claim's own ledger hold not counted against it
    (reservation ``dra:<uid>``). CDI names from devices are not used (the door
    adds the GPUs' own CDI devices). Raises FractionError (an Unhealthy or MIG
    GPU, memory larger than the GPU, limit below request, a guard: compute
    mode, free memory across all doors, client count)."""
    return rules.plan(fraction_request(claim), claim.pod, reservation=claim.reservation)


def custom_objects(api: Any) -> Any:
    """A ``kubernetes.client.CustomObjectsApi`` for the DRA door's API reads
    and writes (claims, ResourceSlices), which serves any group's REST path
    as JSON dicts. ``api``: an ``ApiClient`` (``--kubeconfig``), None for the
    in-cluster config (loaded now, on the caller's thread), or an object that
    already has the ``CustomObjectsApi`` methods (returned as is; tests).
    Raises the client's ``ConfigException`` when None is given outside a pod."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    if api is None:
        kconfig.load_incluster_config()
        return kclient.CustomObjectsApi(kclient.ApiClient())
    if isinstance(api, kclient.ApiClient):
        return kclient.CustomObjectsApi(api)
    return api


class ApiClaims:
    """Reads ResourceClaims from the API server (``resource.k8s.io/v1``).

    Args:
        api: a ``kubernetes.client.ApiClient`` (from ``--kubeconfig``), or
            None for the in-cluster config (loaded on first use).

    ``get`` returns the claim as the API's JSON (a dict, through
    ``CustomObjectsApi``, which serves any group's REST path: the
    client's typed models are not needed for a read). Errors: the client's
    ``ApiException`` (404, 403) and connection errors propagate; the door turns
    them into a per-claim error. Thread-safe (the client pools connections).
    """

    def __init__(self, api: Any = None) -> None:
        self._api = api
        self._objects: Any = None

    def _client(self) -> Any:
        if self._objects is None:
            self._objects = custom_objects(self._api)
        return self._objects

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """``GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>`` as a dict."""
        doc = self._client().get_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims",
                                                          name, _request_timeout=REQUEST_TIMEOUT_S)
        return dict(doc)


def claim_ref_text(namespace: str, name: str, uid: str) -> str:
    """``<ns>/<name> (<uid>)`` for logs and errors."""
    return f"{namespace}/{name} ({uid})"


def known_devices(node: NodeInfo) -> Sequence[str]:
    """Every device name this node publishes (``gpu-<index>``)."""
    return [device_name(g) for g in node.gpus]
