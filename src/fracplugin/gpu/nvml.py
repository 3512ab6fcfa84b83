"""NVML backend on nvidia-ml-py (pynvml).

Concurrency: NVML is thread-safe; a lock serialises the event set and the
utilisation timestamps. Errors from NVML turn into InventoryError with a
sentence an operator can act on (no driver, GPU lost, ...); per-process
queries degrade to missing samples and a counter, never an exception.

Facts: docs/reference/mps-nvml.md section 4 (pynvml 13.615.71 behaviour, events, processes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator

import pynvml

from ..model import GpuInfo, NodeInfo
from .inventory import InventoryError, ProcessSample, XidEvent

log = logging.getLogger(__name__)

_HINTS = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 was not found: is the NVIDIA driver installed and "
    "the container started with the NVIDIA runtime (NVIDIA_DRIVER_CAPABILITIES=utility)?",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded on this node",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to talk to the NVIDIA driver (run privileged)",
    pynvml.NVML_ERROR_GPU_IS_LOST: "a GPU has fallen off the bus (GPU is lost); the node needs attention",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "the NVML library and the kernel driver versions differ; reboot or reload the driver",
}


def _explain(exc: pynvml.NVMLError, what: str) -> InventoryError:
    value = getattr(exc, "value", None)
    hint = _HINTS.get(value, "")
    return InventoryError(f"NVML failed while {what}: {exc}" + (f" ({hint})" if hint else ""))


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlInventory:
    """The real GPUs of this node, through NVML.

    Raises:
        InventoryError: from the constructor when NVML cannot initialise or a
            GPU cannot be read.
    """

    XID_EVENT = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise _explain(exc, "initialising") from None
        self._lock = threading.Lock()
        self._event_set = None
        self._last_util_us: dict[str, int] = {}
        self.sample_failures = 0
        try:
            self._node = self._read_node()
        except InventoryError:
            pynvml.nvmlShutdown()
            raise

    def _read_node(self) -> NodeInfo:
        try:
            driver = _s(pynvml.nvmlSystemGetDriverVersion())
            try:
                cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
            except pynvml.NVMLError:
                cuda = 0
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                gpus.append(self._read_gpu(h, i))
        except pynvml.NVMLError as exc:
            raise _explain(exc, "reading the GPU inventory") from None
        import socket
        return NodeInfo(name=socket.gethostname(), driver_version=driver, cuda_driver_version=cuda,
                        gpus=tuple(gpus))

    @staticmethod
    def _read_gpu(h: object, i: int) -> GpuInfo:
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        try:
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            cc = f"{major}.{minor}"
        except pynvml.NVMLError:
            cc = ""
        try:
            numa: int | None = int(pynvml.nvmlDeviceGetNumaNodeId(h))
        except (pynvml.NVMLError, AttributeError):
            numa = None
        try:
            mig = bool(pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
        except pynvml.NVMLError:
            mig = False
        return GpuInfo(
            index=int(pynvml.nvmlDeviceGetIndex(h)) if hasattr(pynvml, "nvmlDeviceGetIndex") else i,
            uuid=_s(pynvml.nvmlDeviceGetUUID(h)),
            name=_s(pynvml.nvmlDeviceGetName(h)),
            memory_mib=int(mem.total) // (1 << 20),
            minor=int(pynvml.nvmlDeviceGetMinorNumber(h)),
            pci_bus_id=_s(pynvml.nvmlDeviceGetPciInfo(h).busId),
            numa_node=numa,
            compute_capability=cc,
            mig_enabled=mig,
        )

    def node(self) -> NodeInfo:
        return self._node

    def probe_gpu(self, uuid: str) -> bool:
        """A real NVML query of one GPU now (not the list cached at start):
        handle by UUID, memory info and its UUID read back. False on any NVML
        error (GPU lost, fallen off the bus: XID 79). Used before a GPU marked
        by a critical XID is declared Healthy again (issue 12)."""
        with self._lock:
            try:
                h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                pynvml.nvmlDeviceGetMemoryInfo(h)
                return _s(pynvml.nvmlDeviceGetUUID(h)) == uuid
            except pynvml.NVMLError as exc:
                log.warning("NVML re-probe of %s failed: %s", uuid, exc)
                return False

    def processes(self) -> list[ProcessSample]:
        """Compute and MPS-client processes on every GPU, with per-process SM
        utilisation since the previous call. NVML failures count in
        ``sample_failures`` and yield no sample for that GPU."""
        out: list[ProcessSample] = []
        for gpu in self._node.gpus:
            try:
                h = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                procs = {}
                for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                               pynvml.nvmlDeviceGetMPSComputeRunningProcesses):
                    try:
                        for p in getter(h):
                            procs[int(p.pid)] = p.usedGpuMemory
                    except pynvml.NVMLError_NotSupported:
                        continue
                util = self._utilisation(gpu.uuid, h)
            except pynvml.NVMLError as exc:
                self.sample_failures += 1
                log.warning("NVML process sample failed", extra={"gpu_uuid": gpu.uuid, "error": str(exc)})
                continue
            for pid, used in sorted(procs.items()):
                out.append(ProcessSample(gpu_uuid=gpu.uuid, pid=pid,
                                         used_memory_bytes=None if used is None else int(used),
                                         sm_util_percent=util.get(pid)))
        return out

    def _utilisation(self, uuid: str, h: object) -> dict[int, float]:
        with self._lock:
            since = self._last_util_us.get(uuid, 0)
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(h, since)
        except pynvml.NVMLError:  # NOT_FOUND (no new samples) or NVMLError(0)
            return {}
        util: dict[int, float] = {}
        newest = since
        for s in samples:
            if s.pid == 0 or s.smUtil > 100 or s.timeStamp <= since:
                continue
            util[int(s.pid)] = min(100.0, util.get(int(s.pid), 0.0) + float(s.smUtil))
            newest = max(newest, int(s.timeStamp))
        with self._lock:
            self._last_util_us[uuid] = newest
        return util

    def events(self, timeout_s: float) -> Iterator[XidEvent]:
        """XID critical errors within ``timeout_s``. Raises InventoryError when
        the wait itself fails (the caller marks every GPU unhealthy then, as
        NVIDIA's device plugin does)."""
        with self._lock:
            if self._event_set is None:
                self._event_set = pynvml.nvmlEventSetCreate()
                for gpu in self._node.gpus:
                    try:
                        h = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                        pynvml.nvmlDeviceRegisterEvents(h, self.XID_EVENT, self._event_set)
                    except pynvml.NVMLError_NotSupported:
                        log.warning("GPU does not support XID events", extra={"gpu_uuid": gpu.uuid})
            es = self._event_set
        try:
            data = pynvml.nvmlEventSetWait(es, int(timeout_s * 1000))
        except pynvml.NVMLError_Timeout:
            return
        except pynvml.NVMLError as exc:
            raise _explain(exc, "waiting for GPU events") from None
        if data.eventType & self.XID_EVENT:
            yield XidEvent(gpu_uuid=_s(pynvml.nvmlDeviceGetUUID(data.device)), xid=int(data.eventData),
                           timestamp_s=time.monotonic())

    def close(self) -> None:
        with self._lock:
            if self._event_set is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(self._event_set)
                self._event_set = None
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
