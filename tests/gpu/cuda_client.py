"""A tiny CUDA client for ``make gpu-check``: stdlib only, CUDA driver API through ctypes.

It is what a tenant container's process does, reduced to what the check needs:

1. (``--cgroup DIR``) moves itself into that cgroup (``DIR/cgroup.procs``),
   as the runtime puts a container's processes in the container's cgroup, so
   the daemon's metrics join its PID to the container (``/proc/<pid>/cgroup``);
2. ``cuInit``, ``cuDeviceGetCount``, for each device its UUID
   (``cuDeviceGetUuid``), SM count (``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``)
   and whether contexts go through MPS (``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``,
   CUDA 12.4+; ``None`` where the driver does not know the attribute);
3. retains device 0's primary context (``cuDevicePrimaryCtxRetain`` +
   ``cuCtxSetCurrent``) and reads the SMs it may use
   (``cuCtxGetExecAffinity(CU_EXEC_AFFINITY_TYPE_SM_COUNT)``: under MPS the
   active thread percentage shows there, rounded down to whole SMs,
   docs/reference/mps-nvml.md 2.8);
4. allocates ``--step-mib`` (256 MiB) blocks with ``cuMemAlloc`` until one
   fails or ``--cap-mib`` would be passed (the cap keeps an unenforced limit
   from taking the whole GPU);
5. prints ONE JSON line (the figures below) and holds the memory until a line
   arrives on stdin or stdin closes; then frees it and exits 0.

Output (one line of JSON on stdout)::

    {"pid": int, "ok": bool, "error": str, "devices": int, "uuids": [str],
     "mps_enabled": 0 | 1 | None, "sm_total": int | None, "sm_ctx": int | None,
     "allocated_mib": int, "steps": int, "stopped_by": "error" | "cap",
     "alloc_error": str, "cgroup": str, "mem_free_mib": int | None, "mem_total_mib": int | None}

Exit status: 0 after a release, 1 when CUDA could not be initialised (the
JSON line says why), 2 for bad arguments.

It never imports anything outside the standard library: it runs under
whatever ``python3`` the GPU machine has, with only the env the daemon's plan
gives (issue 17 step 3).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

MIB = 1 << 20
CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133  # cuda.h (CUDA 12.4+): "contexts created on this device will be shared via MPS"
CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0


class CudaError(Exception):
    """A CUDA driver call failed: ``call`` is the function, ``code`` the CUresult, ``name`` its name."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


@dataclass
class AllocResult:
    """What the allocation loop got: ``handles`` (what ``alloc`` returned, to
    free later), ``allocated_bytes`` (sum of the successful steps, bytes),
    ``steps`` (successful allocations), ``stopped_by`` (``"error"``: an
    allocation failed; ``"cap"``: the next step would pass ``cap_bytes``) and
    ``error`` (the failing call's error name, ``""`` when capped)."""

    handles: list[object] = field(default_factory=list)
    allocated_bytes: int = 0
    steps: int = 0
    stopped_by: str = "cap"
    error: str = ""

    @property
    def allocated_mib(self) -> int:
        return self.allocated_bytes // MIB


def allocate_until_failure(alloc: Callable[[int], tuple[object | None, str]], step_bytes: int,
                           cap_bytes: int) -> AllocResult:
    """Call ``alloc(step_bytes)`` until it fails or the total would pass ``cap_bytes``.

    Args:
        alloc: returns ``(handle, "")`` on success, ``(None, error_name)`` on failure.
        step_bytes: bytes per allocation (> 0; the check uses 256 MiB, issue 17 step 3).
        cap_bytes: the most to allocate in all (bytes, >= 0).

    Returns an ``AllocResult``. Raises ValueError for a step <= 0 or a cap < 0.
    """
    if step_bytes <= 0:
        raise ValueError(f"step must be > 0 bytes, got {step_bytes}")
    if cap_bytes < 0:
        raise ValueError(f"cap must be >= 0 bytes, got {cap_bytes}")
    r = AllocResult()
    while r.allocated_bytes + step_bytes <= cap_bytes:
        handle, err = alloc(step_bytes)
        if handle is None:
            r.stopped_by, r.error = "error", err or "unknown error"
            return r
        r.handles.append(handle)
        r.allocated_bytes += step_bytes
        r.steps += 1
    r.stopped_by = "cap"
    return r


class CudaDriver:
    """The few CUDA driver API calls the check needs, through ctypes on
    ``libcuda.so.1`` (the driver's own library: no toolkit needed).

    Every method raises ``CudaError`` for a failing call; ``OSError`` from the
    constructor when the library cannot be loaded."""

    def __init__(self, lib: str = "libcuda.so.1") -> None:
        self.lib = ctypes.CDLL(lib)

    def _fn(self, *names: str) -> tuple[str, object]:
        for n in names:
            f = getattr(self.lib, n, None)
            if f is not None:
                return n, f
        raise CudaError(names[0], -1, "symbol not found")

    def error_name(self, code: int) -> str:
        """``cuGetErrorName`` of ``code`` (e.g. ``CUDA_ERROR_OUT_OF_MEMORY``), or ``CUresult <n>``."""
        s = ctypes.c_char_p()
        try:
            _, f = self._fn("cuGetErrorName")
            if f(ctypes.c_int(code), ctypes.byref(s)) == CUDA_SUCCESS and s.value:
                return s.value.decode()
        except CudaError:
            pass
        return f"CUresult {code}"

    def _call(self, names: tuple[str, ...], *args: object) -> None:
        name, f = self._fn(*names)
        rc = f(*args)  # type: ignore[operator]
        if rc != CUDA_SUCCESS:
            raise CudaError(name, rc, self.error_name(rc))

    def init(self) -> None:
        """``cuInit(0)``: where the driver connects to MPS when the pipe directory is reachable."""
        self._call(("cuInit",), ctypes.c_uint(0))

    def device_count(self) -> int:
        """``cuDeviceGetCount``: the devices this process sees."""
        n = ctypes.c_int()
        self._call(("cuDeviceGetCount",), ctypes.byref(n))
        return n.value

    def device(self, ordinal: int) -> int:
        """``cuDeviceGet``: the device handle of an ordinal."""
        d = ctypes.c_int()
        self._call(("cuDeviceGet",), ctypes.byref(d), ctypes.c_int(ordinal))
        return d.value

    def uuid(self, dev: int) -> str:
        """``cuDeviceGetUuid``, formatted as NVML prints it (``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``)."""
        raw = (ctypes.c_ubyte * 16)()
        self._call(("cuDeviceGetUuid_v2", "cuDeviceGetUuid"), raw, ctypes.c_int(dev))
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def attribute(self, attr: int, dev: int) -> int:
        """``cuDeviceGetAttribute`` (``CU_DEVICE_ATTRIBUTE_*``)."""
        v = ctypes.c_int()
        self._call(("cuDeviceGetAttribute",), ctypes.byref(v), ctypes.c_int(attr), ctypes.c_int(dev))
        return v.value

    def retain_primary(self, dev: int) -> ctypes.c_void_p:
        """``cuDevicePrimaryCtxRetain`` + ``cuCtxSetCurrent``: the context the allocations go to."""
        ctx = ctypes.c_void_p()
        self._call(("cuDevicePrimaryCtxRetain",), ctypes.byref(ctx), ctypes.c_int(dev))
        self._call(("cuCtxSetCurrent",), ctx)
        return ctx

    def release_primary(self, dev: int) -> None:
        """``cuDevicePrimaryCtxRelease``."""
        self._call(("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"), ctypes.c_int(dev))

    def ctx_sm_count(self) -> int:
        """SMs the current context may use (``cuCtxGetExecAffinity``, CUDA 11.4+)."""
        # CUexecAffinityParam: {int type; union {CUexecAffinitySmCount smCount;} param;} = two 32-bit words.
        param = (ctypes.c_uint * 2)()
        self._call(("cuCtxGetExecAffinity",), param, ctypes.c_int(CU_EXEC_AFFINITY_TYPE_SM_COUNT))
        return int(param[1])

    def mem_info(self) -> tuple[int, int]:
        """``cuMemGetInfo``: ``(free, total)`` bytes as this context sees them."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._call(("cuMemGetInfo_v2", "cuMemGetInfo"), ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def alloc(self, nbytes: int) -> tuple[object | None, str]:
        """``cuMemAlloc``: ``(device pointer, "")`` or ``(None, error name)``."""
        ptr = ctypes.c_uint64()
        name, f = self._fn("cuMemAlloc_v2", "cuMemAlloc")
        rc = f(ctypes.byref(ptr), ctypes.c_size_t(nbytes))  # type: ignore[operator]
        if rc != CUDA_SUCCESS:
            return None, self.error_name(rc)
        return ptr.value, ""

    def free(self, ptr: object) -> None:
        """``cuMemFree`` (errors ignored: the process is about to exit)."""
        name, f = self._fn("cuMemFree_v2", "cuMemFree")
        f(ctypes.c_uint64(int(ptr)))  # type: ignore[operator, call-overload]


def join_cgroup(cgroup_dir: str) -> None:
    """Move this process into ``cgroup_dir`` (write its PID to ``cgroup.procs``). Raises OSError."""
    with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def measure(cuda: CudaDriver, step_mib: int, cap_mib: int) -> tuple[dict[str, object], AllocResult | None]:
    """Steps 2-4 of the module docstring on ``cuda``; returns the report dict
    (without pid/cgroup) and the allocation (None when CUDA failed first)."""
    rep: dict[str, object] = {"ok": False, "error": "", "devices": 0, "uuids": [], "mps_enabled": None,
                              "sm_total": None, "sm_ctx": None, "allocated_mib": 0, "steps": 0,
                              "stopped_by": "", "alloc_error": "", "mem_free_mib": None, "mem_total_mib": None}
    try:
        cuda.init()
        n = cuda.device_count()
        rep["devices"] = n
        rep["uuids"] = [cuda.uuid(cuda.device(i)) for i in range(n)]
        if n == 0:
            rep["error"] = "cuDeviceGetCount: no device visible"
            return rep, None
        dev = cuda.device(0)
        rep["sm_total"] = cuda.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        try:
            rep["mps_enabled"] = cuda.attribute(CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev)
        except CudaError:
            rep["mps_enabled"] = None  # driver older than CUDA 12.4: attribute unknown
        cuda.retain_primary(dev)
        try:
            rep["sm_ctx"] = cuda.ctx_sm_count()
        except CudaError:
            rep["sm_ctx"] = None
        free, total = cuda.mem_info()
        rep["mem_free_mib"], rep["mem_total_mib"] = free // MIB, total // MIB
    except CudaError as exc:
        rep["error"] = str(exc)
        return rep, None
    res = allocate_until_failure(cuda.alloc, step_mib * MIB, cap_mib * MIB)
    rep.update(ok=True, allocated_mib=res.allocated_mib, steps=res.steps, stopped_by=res.stopped_by,
               alloc_error=res.error)
    return rep, res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-mib", type=int, default=256)
    p.add_argument("--cap-mib", type=int, required=True, help="never allocate more than this (MiB)")
    p.add_argument("--cgroup", default="", help="cgroup directory to join before cuInit")
    p.add_argument("--lib", default="libcuda.so.1")
    p.add_argument("--no-hold", action="store_true", help="free and exit at once after reporting")
    a = p.parse_args(argv)
    rep: dict[str, object] = {"pid": os.getpid(), "cgroup": ""}
    if a.cgroup:
        try:
            join_cgroup(a.cgroup)
            rep["cgroup"] = a.cgroup
        except OSError as exc:
            rep["cgroup_error"] = f"{a.cgroup}: {exc}"
    try:
        cuda = CudaDriver(a.lib)
    except OSError as exc:
        rep.update(ok=False, error=f"cannot load {a.lib}: {exc}")
        print(json.dumps(rep), flush=True)
        return 1
    figures, res = measure(cuda, a.step_mib, a.cap_mib)
    rep.update(figures)
    print(json.dumps(rep), flush=True)
    if res is None:
        return 1
    if not a.no_hold:
        sys.stdin.readline()
    for h in res.handles:
        cuda.free(h)
    try:
        cuda.release_primary(0)
    except CudaError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
