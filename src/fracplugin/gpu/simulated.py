"""A simulated node read from YAML (``examples/nodes/gpu-node-1.yaml``).

Concurrency: a lock guards the injected processes and the XID queue; any
thread may inject, one health thread consumes ``events``.

File shape::

    node: gpu-node-1
    driver_version: "615.71.09"
    cuda_driver_version: 13040
    gpus:
      - {index: 0, uuid: GPU-..., name: ..., memory_mib: 81559, minor: 0,
         pci_bus_id: "00000000:18:00.0", numa_node: 0, compute_capability: "9.0"}
    annotations: {fracplugin.io/cordoned-gpus: "0"}  # optional: the Node's (explain reads the cordon)
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import yaml

from ..model import GpuInfo, NodeInfo
from .inventory import InventoryError, ProcessSample, XidEvent

_REQUIRED = ("index", "uuid", "name", "memory_mib", "minor")
MAX_MEMORY_MIB = 1 << 22  # 4 TiB per GPU: far above any GPU, low enough to catch typos


def load_node(path: str | os.PathLike[str]) -> NodeInfo:
    """Parse a node file into NodeInfo.

    Raises:
        InventoryError: unreadable file, bad YAML, or a GPU entry that lacks a
            field or has a wrong type (the message names the file and the field).
    """
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise InventoryError(f"cannot read node file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InventoryError(f"node file {p} is not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise InventoryError(f"node file {p} is not valid YAML: nested too deeply to parse") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"node file {p} is not valid YAML: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    except Exception as exc:  # the parser is not ours: any failure is the file's (issue 13 item 4)
        raise InventoryError(f"node file {p} cannot be parsed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        raise InventoryError(f"node file {p} must be a mapping with a 'gpus' list")
    gpus = []
    for i, g in enumerate(doc["gpus"]):
        if not isinstance(g, dict):
            raise InventoryError(f"node file {p}: gpus[{i}] must be a mapping")
        for k in _REQUIRED:
            if k not in g:
                raise InventoryError(f"node file {p}: gpus[{i}] lacks '{k}'")
        try:
            gpus.append(GpuInfo(
                index=_int(g["index"]), uuid=str(g["uuid"]), name=str(g["name"]),
                memory_mib=_int(g["memory_mib"]), minor=_int(g["minor"]),
                pci_bus_id=str(g.get("pci_bus_id", "")),
                numa_node=None if g.get("numa_node") is None else _int(g["numa_node"]),
                compute_capability=str(g.get("compute_capability", "")),
                mig_enabled=bool(g.get("mig_enabled", False)),
            ))
        except (TypeError, ValueError, OverflowError) as exc:
            raise InventoryError(f"node file {p}: gpus[{i}]: {exc}") from None
        if not 0 < gpus[-1].memory_mib <= MAX_MEMORY_MIB:
            raise InventoryError(f"node file {p}: gpus[{i}].memory_mib must be 1..{MAX_MEMORY_MIB} MiB")
        if not 0 <= gpus[-1].index < 1024 or not 0 <= gpus[-1].minor < 1024:
            raise InventoryError(f"node file {p}: gpus[{i}] index and minor must be 0..1023")
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids) or len({g.index for g in gpus}) != len(gpus):
        raise InventoryError(f"node file {p}: GPU uuids and indices must be unique")
    try:
        cuda = _int(doc.get("cuda_driver_version", 0))
    except (TypeError, ValueError):
        raise InventoryError(f"node file {p}: cuda_driver_version must be an integer") from None
    return NodeInfo(
        name=str(doc.get("node") or "simulated-node"),
        driver_version=str(doc.get("driver_version", "")),
        cuda_driver_version=cuda,
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
    )


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v


class SimulatedInventory:
    """Inventory backend for a node file; tests and the demo inject XIDs and processes.

    Raises InventoryError from the constructor when the file is bad.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._node = load_node(path)
        self._lock = threading.Lock()
        self._processes: list[ProcessSample] = []
        self._events: "queue.Queue[XidEvent]" = queue.Queue()

    def node(self) -> NodeInfo:
        return self._node

    def processes(self) -> list[ProcessSample]:
        with self._lock:
            return list(self._processes)

    def set_processes(self, samples: list[ProcessSample]) -> None:
        """Replace the processes ``processes()`` reports."""
        with self._lock:
            self._processes = list(samples)

    def probe_gpu(self, uuid: str) -> bool:
        """The simulated NVML re-probe: the GPU exists."""
        return self._node.gpu_by_uuid(uuid) is not None

    def inject_xid(self, gpu_uuid: str, xid: int) -> None:
        """Queue an XID event on a GPU (raises InventoryError for an unknown GPU)."""
        if self._node.gpu_by_uuid(gpu_uuid) is None:
            raise InventoryError(f"no GPU {gpu_uuid} on simulated node {self._node.name}")
        self._events.put(XidEvent(gpu_uuid=gpu_uuid, xid=xid, timestamp_s=time.monotonic()))

    def events(self, timeout_s: float) -> Iterator[XidEvent]:
        with contextlib.suppress(queue.Empty):  # the first within ``timeout_s``, then what is queued
            yield self._events.get(timeout=max(timeout_s, 0.0))
            while True:
                yield self._events.get_nowait()

    def close(self) -> None:
        """Nothing to release."""
