"""This node's ResourceSlice for the DRA door: builder (pure) and publisher.

One slice per node (docs/reference/kubelet-dra.md §4), ``resource.k8s.io/v1``,
named ``<node>-gpu-memory.fracplugin.io``, pool = the node's name, one device
``gpu-<index>`` per healthy GPU (``build_device``): many claims share it, its
``memory`` capacity is (GPU memory - reserve) bytes in whole MiB, the whole GPU
by default (ADR 0031 item 7).

``computeMode`` is the compute mode the GPU's held fractions use now
(``Ledger.mode``: ``time-slicing``, ``sm-sharing`` or ``none`` when nothing is
held), so a DeviceClass's CEL selector can keep a claim of the other mode off
the GPU (ADR 0031, addendum "the compute mode in the slice"). The reserve is
the planner's ``--reserve-mib``. An Unhealthy GPU's device leaves the slice;
claims already allocated keep it (the ledger still holds them).

Publisher (ADR 0031 item 7): one background thread builds the slice every
``poll_s`` seconds and at once after ``poke``, and writes it (GET, then PUT
with the read ``resourceVersion`` or, on 404, POST) when it changed or every
``resync_s``. Errors are logged and retried at the next poll; nothing here is
on the Prepare path. RBAC: resourceslices get, create, update, delete.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable, Mapping

from ..model import ComputeMode, GpuInfo, NodeInfo
from . import CAPACITY_MEMORY, DRIVER_NAME, REQUEST_TIMEOUT_S
from .claims import custom_objects, device_name

log = logging.getLogger(__name__)

GROUP = "resource.k8s.io"
VERSION = "v1"
PLURAL = "resourceslices"
MIB = 1 << 20
LABEL_NODE = "fracplugin.io/node"
LABEL_DRIVER = "fracplugin.io/dra-driver"
ATTR_COMPUTE_MODE = "computeMode"
MODE_NONE = "none"
"""``computeMode`` of a GPU no fraction is held on (any mode is admitted there)."""


def slice_name(node_name: str) -> str:
    """``<node>-<driver>`` (both DNS subdomains, so is the name)."""
    return f"{node_name}-{DRIVER_NAME}"


def capacity_bytes(gpu: GpuInfo, reserve_mib: int) -> int:
    """The ``memory`` capacity of one GPU, bytes: (memory - reserve) MiB, at least 0."""
    return max(gpu.memory_mib - reserve_mib, 0) * MIB


def mode_text(mode: ComputeMode | None) -> str:
    """The ``computeMode`` attribute value: the mode's contract spelling
    (``time-slicing``, ``sm-sharing``), ``none`` for None (nothing held)."""
    return MODE_NONE if mode is None else mode.value


def build_device(gpu: GpuInfo, driver_version: str, reserve_mib: int,
                 mode: ComputeMode | None = None) -> dict[str, Any]:
    """One GPU's device entry (module docstring); ``mode``: the compute mode
    of its held fractions, None when none is held."""
    memory = str(capacity_bytes(gpu, reserve_mib))
    return {
        "name": device_name(gpu),
        "allowMultipleAllocations": True,
        "attributes": {
            "uuid": {"string": gpu.uuid},
            "productName": {"string": gpu.name},
            "driverVersion": {"string": driver_version},
            "computeCapability": {"string": gpu.compute_capability},
            ATTR_COMPUTE_MODE: {"string": mode_text(mode)},
            "index": {"int": gpu.index},
        },
        "capacity": {
            CAPACITY_MEMORY: {
                "value": memory,
                "requestPolicy": {"default": memory, "validRange": {"min": str(MIB), "step": str(MIB)}},
            },
        },
    }


def build_slice(node: NodeInfo, *, reserve_mib: int, healthy: Mapping[str, bool] | None = None,
                modes: Mapping[str, ComputeMode | None] | None = None, generation: int = 1) -> dict[str, Any]:
    """This node's ResourceSlice (a dict in the API's JSON shape).

    Args:
        node: the inventory (GPU order = device order).
        reserve_mib: MiB per GPU kept out of the ``memory`` capacity.
        healthy: GPU UUID -> healthy; a GPU mapped to False is left out.
        modes: GPU UUID -> compute mode of its held fractions (None or
            absent: nothing held, ``computeMode: none``).
        generation: ``spec.pool.generation``.

    MIG-enabled GPUs are left out (a MIG GPU takes no fraction). Pure.
    """
    health = healthy or {}
    held = modes or {}
    devices = [build_device(g, node.driver_version, reserve_mib, held.get(g.uuid)) for g in node.gpus
               if health.get(g.uuid, True) and not g.mig_enabled and capacity_bytes(g, reserve_mib) > MIB]
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node.name),
                     "labels": {LABEL_NODE: node.name, LABEL_DRIVER: DRIVER_NAME}},
        "spec": {"driver": DRIVER_NAME, "nodeName": node.name,
                 "pool": {"name": node.name, "generation": generation, "resourceSliceCount": 1},
                 "devices": devices},
    }


def _content(doc: Mapping[str, Any]) -> Any:
    """What a change is measured on: the spec without the generation."""
    spec = copy.deepcopy(dict(doc.get("spec") or {}))
    (spec.get("pool") or {}).pop("generation", None)
    return spec


class SlicePublisher:
    """Keeps this node's ResourceSlice in the API (module docstring).

    Args:
        api: a ``kubernetes.client.ApiClient`` (``--kubeconfig``), None for
            the in-cluster config, or an object with the four
            ``CustomObjectsApi`` cluster methods (tests).
        node: the inventory.
        reserve_mib: MiB per GPU kept out of the capacity.
        healthy: () -> {GPU UUID: healthy}, read at each poll.
        modes: () -> {GPU UUID: compute mode of its held fractions, or
            None}, read at each poll (the daemon gives the ledger's
            ``mode`` per GPU and calls ``poke`` on every ledger change).
        poll_s: seconds between builds.
    """

    def __init__(self, api: Any, node: NodeInfo, *, reserve_mib: int,
                 healthy: Callable[[], Mapping[str, bool]] | None = None,
                 modes: Callable[[], Mapping[str, ComputeMode | None]] | None = None, poll_s: float = 5.0) -> None:
        self._api = api
        self._objects: Any = None
        self.node = node
        self.reserve_mib = reserve_mib
        self.healthy = healthy or (lambda: {})
        self.modes = modes or (lambda: {})
        self.poll_s = poll_s
        self.resync_s = 300.0  # seconds after which an unchanged slice is written again
        self.name = slice_name(node.name)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._written: Any = None
        self._written_at = 0.0
        self._generation: int | None = None
        self.writes = 0
        self.errors = 0
        self.last_error = ""

    def _client(self) -> Any:
        if self._objects is None:
            self._objects = custom_objects(self._api)
        return self._objects

    # ---- lifecycle ----------------------------------------------------------
    def start(self) -> "SlicePublisher":
        """Start the thread (the first write happens on it, at once)."""
        self._thread = threading.Thread(target=self._run, name="dra-slices", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0, delete: bool = False) -> None:
        """End the thread; with ``delete``, delete the slice (one try, within
        ``timeout_s``; a failure is logged)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if delete:
            try:
                self._client().delete_cluster_custom_object(GROUP, VERSION, PLURAL, self.name,
                                                            _request_timeout=max(timeout_s, 0.1))
                log.info("dra resource slice deleted", extra={"slice": self.name})
            except Exception as exc:
                if getattr(exc, "status", None) != 404:
                    log.warning("dra resource slice not deleted", extra={"slice": self.name, "reason": str(exc)})

    def poke(self) -> None:
        """Build and compare now (inventory, health or the ledger changed).
        Cheap and non-blocking (sets an event): safe as a ledger subscriber."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the build: a poke during it is not lost
            if self._stop.is_set():  # stop() sets _stop before _wake: a wake cleared here was stop's
                break
            self.sync()
            self._wake.wait(self.poll_s)

    # ---- one pass -----------------------------------------------------------
    def desired(self) -> dict[str, Any]:
        """The slice as it should be now (generation not decided yet)."""
        return build_slice(self.node, reserve_mib=self.reserve_mib, healthy=self.healthy(), modes=self.modes())

    def sync(self) -> bool:
        """Write the slice if it changed or the resync time passed; True when
        it is as desired in the API after this call. Never raises."""
        try:
            want = self.desired()
            content = _content(want)
            now = time.monotonic()
            with self._lock:
                fresh = self._written == content and now - self._written_at < self.resync_s
            if fresh:
                return True
            self._write(want, content)
            with self._lock:
                self._written, self._written_at = content, now
                self.writes += 1
            return True
        except Exception as exc:
            with self._lock:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {getattr(exc, 'status', '')} {exc}"[:500]
            log.warning("dra resource slice not written", extra={"slice": self.name, "reason": self.last_error})
            return False

    def _write(self, want: dict[str, Any], content: Any) -> None:
        api = self._client()
        try:
            have = api.get_cluster_custom_object(GROUP, VERSION, PLURAL, self.name, _request_timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise
            have = None
        found = int(((have or {}).get("spec") or {}).get("pool", {}).get("generation") or 0) if have else 0
        gen = max(self._generation or 0, found)
        if have is None or _content(have) != content:
            gen += 1
        gen = max(gen, 1)
        want["spec"]["pool"]["generation"] = gen
        if have is None:
            api.create_cluster_custom_object(GROUP, VERSION, PLURAL, want, _request_timeout=REQUEST_TIMEOUT_S)
        else:
            want["metadata"]["resourceVersion"] = (have.get("metadata") or {}).get("resourceVersion")
            api.replace_cluster_custom_object(GROUP, VERSION, PLURAL, self.name, want,
                                              _request_timeout=REQUEST_TIMEOUT_S)
        self._generation = gen
        log.info("dra resource slice written", extra={"slice": self.name, "generation": gen,
                                                      "devices": [d["name"] for d in want["spec"]["devices"]]})

    def status(self) -> dict[str, Any]:
        """Name, generation, writes, errors, the last error."""
        with self._lock:
            return {"slice": self.name, "generation": self._generation, "writes": self.writes,
                    "errors": self.errors, "last_error": self.last_error}
