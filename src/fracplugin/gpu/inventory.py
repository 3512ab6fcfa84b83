"""The narrow interface every GPU backend implements.

Concurrency: backends are called from any thread; implementations must be
thread-safe for reads. ``events`` is consumed by one health thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

from ..model import NodeInfo


class InventoryError(RuntimeError):
    """The GPU backend cannot start or lost a GPU (no driver, GPU lost, bad node file)."""


@dataclass(frozen=True)
class XidEvent:
    """An NVML XID error on one GPU (``nvmlEventTypeXidCriticalError``).

    ``xid`` is the XID number; ``gpu_uuid`` the GPU it hit; ``timestamp_s`` the
    monotonic time it was observed.
    """

    gpu_uuid: str
    xid: int
    timestamp_s: float = 0.0


@dataclass(frozen=True)
class ProcessSample:
    """One process using a GPU, from NVML's per-process queries.

    ``used_memory_bytes`` from nvmlDeviceGetComputeRunningProcesses /
    GetMPSComputeRunningProcesses (None when NVML does not report it);
    ``sm_util_percent`` from nvmlDeviceGetProcessUtilization since the last
    sample (None when unavailable).
    """

    gpu_uuid: str
    pid: int
    used_memory_bytes: int | None
    sm_util_percent: float | None = None


@runtime_checkable
class Inventory(Protocol):
    """What fracplugin needs from the GPUs of this node."""

    def node(self) -> NodeInfo:
        """The node and its GPUs in index order. Raises InventoryError."""
        ...

    def processes(self) -> list[ProcessSample]:
        """Processes on every GPU now (may be empty; never raises for one GPU's failure)."""
        ...

    def events(self, timeout_s: float) -> Iterator[XidEvent]:
        """XID events that arrived within ``timeout_s`` seconds (may yield none)."""
        ...

    def close(self) -> None:
        """Release NVML / files."""
        ...
