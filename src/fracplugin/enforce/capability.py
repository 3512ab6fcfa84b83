"""The memory-limit capability gate: can this node enforce CUDA 13.4 limits?

Inputs (issue 23 item 2; facts: docs/reference/mps-nvml.md section 3, docs/reference/enforcement-cdi-dra.md):

* ``driver``: NVIDIA driver r615 or newer (memory partitioning needs CUDA 13.4,
  driver r615; Dynamo's "Per-GPU Compute and Memory Limits with MPS").
* ``mps_protocol``: the MPS control protocol is 3 (MPS v3 carries the memory
  accounting and the soft-limit eviction). Unknown (None) does not block.
* ``cgroup_v2``: the unified hierarchy is mounted at the cgroup root
  (``<root>/cgroup.controllers`` exists; a v1 or hybrid root has none).
* ``memory_accounting``: ``<root>/dmem.capacity`` lists every GPU
  (``nvidia/<pci bdf>/vidmem`` lines; kernel dmem backend), or NVML answers
  ``nvmlDeviceGetMemoryLimits_v1`` on the root cgroup for every GPU (the
  driver's internal ``misc`` backend).
* ``mig_off``: some GPU is not in MIG mode (NVML rejects MIG handles). A
  GPU in MIG mode takes no fraction at any door (``noderules.NodeRules``),
  so it is left out of the other inputs and the rest of the node enforces;
  only a node whose every GPU is in MIG mode cannot (issue 33).
* ``cdi_hook`` (reported, not required): whether the CDI spec of each GPU
  carries the toolkit's ``apply-cuda-memory-limits`` hook; given by the CDI
  reader as a callable ``uuid -> bool | None``. It chooses apply or verify in
  ``--memory-limits auto``.

Every input is pointable at a test tree (``cgroup_root``) or given as a value
or callable; nothing here raises on a missing file: it becomes a reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

from ..atomicfile import read_regular
from ..model import GpuInfo

MIN_DRIVER_MAJOR = 615
"""Memory partitioning needs driver r615+ (CUDA 13.4)."""

REQUIRED = ("driver", "mps_protocol", "cgroup_v2", "memory_accounting", "mig_off")
"""Capabilities that must not be False for memory limits to be enforced."""

CAPABILITIES = REQUIRED + ("cdi_hook",)
"""Every capability reported (``fracplugin_node_capability{capability}``)."""


@dataclass(frozen=True)
class Capability:
    """One input of the gate: ``ok`` True, False, or None (unknown), and a
    sentence saying what was found (the reason when not ok)."""

    name: str
    ok: bool | None
    detail: str


@dataclass(frozen=True)
class NodeCapabilities:
    """The gate's answer. ``items`` in ``CAPABILITIES`` order; ``hook``
    maps GPU UUID -> hook present (True/False/None unknown)."""

    items: tuple[Capability, ...]
    hook: Mapping[str, bool | None] = field(default_factory=dict)

    def get(self, name: str) -> Capability | None:
        return next((c for c in self.items if c.name == name), None)

    @property
    def missing(self) -> list[Capability]:
        """Required capabilities that are False (unknown ones do not block)."""
        return [c for c in self.items if c.name in REQUIRED and c.ok is False]

    @property
    def can_enforce(self) -> bool:
        """True when no required capability is missing."""
        return not self.missing

    @property
    def reason(self) -> str:
        """``""`` when enforceable, else "memory limits cannot be enforced on
        this node: <capability> (<detail>); ...". The name KAI and operators read."""
        if self.can_enforce:
            return ""
        return "memory limits cannot be enforced on this node: " + "; ".join(
            f"{c.name} ({c.detail})" for c in self.missing)

    def to_dict(self) -> dict[str, object]:
        return {"can_enforce": self.can_enforce, "reason": self.reason,
                "capabilities": [asdict(c) for c in self.items],
                "cdi_hook": dict(self.hook)}


def _driver(version: str) -> Capability:
    m = re.match(r"^\s*(\d+)", version or "")
    if not m:
        return Capability("driver", None, f"driver version {version!r} not known")
    major = int(m.group(1))
    if major < MIN_DRIVER_MAJOR:
        return Capability("driver", False, f"driver {version} is older than r{MIN_DRIVER_MAJOR} (CUDA 13.4)")
    return Capability("driver", True, f"driver {version}")


def _mps(protocol: int | None) -> Capability:
    if protocol is None:
        return Capability("mps_protocol", None, "MPS control protocol not known yet")
    if protocol < 3:
        return Capability("mps_protocol", False, f"MPS control protocol {protocol}, memory partitioning needs 3")
    return Capability("mps_protocol", True, f"MPS control protocol {protocol}")


def _cgroup_v2(root: str) -> Capability:
    if os.path.isfile(os.path.join(root, "cgroup.controllers")):
        return Capability("cgroup_v2", True, f"cgroup v2 at {root}")
    if not os.path.isdir(root):
        return Capability("cgroup_v2", False, f"no cgroup filesystem at {root}")
    return Capability("cgroup_v2", False, f"{root} is cgroup v1 or hybrid (no cgroup.controllers)")


def _sysfs_bdf(pci_bus_id: str) -> str:
    """NVML ``00000000:18:00.0`` -> sysfs ``0000:18:00.0`` (lowercase)."""
    bdf = (pci_bus_id or "").lower()
    if len(bdf) == 16 and bdf.count(":") == 2:
        bdf = bdf[4:]
    return bdf


MAX_KERNEL_FILE = 1 << 20
"""Most bytes read from a cgroup interface file (``dmem.capacity``,
``dmem.current``): a few lines per GPU; anything larger is not the kernel's.
Read with ``atomicfile.read_regular``: a FIFO or a device at the path would
block a request path for ever (issue 34 input 8)."""


def dmem_regions(cgroup: str, name: str = "dmem.capacity") -> dict[str, int] | str:
    """``<cgroup>/<name>`` (``dmem.capacity``, ``dmem.current``) as ``{region: bytes}``, or why it cannot be
    used (absent, unreadable, not a regular file, too large:
    ``MAX_KERNEL_FILE``). Lines: ``<region> <bytes>`` (cgroup-v2.rst, DMEM)."""
    path = os.path.join(cgroup, name)
    try:
        text = read_regular(path, MAX_KERNEL_FILE).decode(errors="replace")
    except OSError as exc:
        return f"no {path}" if exc.errno == errno.ENOENT else (exc.strerror or str(exc))
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def gpu_region(gpu: GpuInfo) -> str:
    """The dmem region key of a GPU: ``nvidia/<sysfs pci bdf>/vidmem``."""
    return f"nvidia/{_sysfs_bdf(gpu.pci_bus_id)}/vidmem"


def _accounting(root: str, gpus: Sequence[GpuInfo], nvml_probe: Callable[[str], str | None] | None) -> Capability:
    regions = dmem_regions(root)
    if isinstance(regions, dict) and gpus:
        lacking = [g.uuid for g in gpus if gpu_region(g) not in regions]
        if not lacking:
            return Capability("memory_accounting", True, f"{root}/dmem.capacity lists every GPU (dmem backend)")
    else:
        lacking = [g.uuid for g in gpus]
    if nvml_probe is not None:
        errors = {u: e for u in lacking if (e := nvml_probe(u)) is not None}
        if not errors:  # say why the dmem files were not enough (issue 34 input 8: a FIFO, a huge file)
            why = regions if isinstance(regions, str) else f"{root}/dmem.capacity does not list {', '.join(lacking)}"
            return Capability("memory_accounting", True,
                              "NVML answers nvmlDeviceGetMemoryLimits_v1 for every GPU" + (f" ({why})" if gpus else ""))
        first = next(iter(errors.items()))
        return Capability("memory_accounting", False,
                          f"NVML nvmlDeviceGetMemoryLimits_v1 failed on {len(errors)} GPU(s), {first[0]}: {first[1]}")
    if isinstance(regions, str):
        return Capability("memory_accounting", False, f"{regions} and no NVML to ask")
    return Capability("memory_accounting", False, f"{root}/dmem.capacity does not list {', '.join(lacking)}")


def _mig(gpus: Sequence[GpuInfo]) -> Capability:
    on = [g.uuid for g in gpus if g.mig_enabled]
    if on and len(on) == len(gpus):
        return Capability("mig_off", False, f"MIG mode is on for every GPU ({', '.join(on)})")
    if on:
        return Capability("mig_off", True, f"MIG mode is on for {', '.join(on)}: excluded, no fraction is placed "
                                           "there; the other GPUs enforce")
    return Capability("mig_off", True, "no GPU in MIG mode")


def _hook(gpus: Sequence[GpuInfo], hook_of: Callable[[str], bool | None] | None) -> tuple[Capability, dict[str, bool | None]]:
    if hook_of is None:
        return Capability("cdi_hook", None, "CDI specs not read"), {g.uuid: None for g in gpus}
    hook: dict[str, bool | None] = {g.uuid: None for g in gpus}
    for g in gpus:
        with contextlib.suppress(Exception):  # the CDI reader's fault must not stop the gate
            hook[g.uuid] = hook_of(g.uuid)
    if gpus and all(v is True for v in hook.values()):
        return Capability("cdi_hook", True, "the CDI spec of every GPU carries apply-cuda-memory-limits"), hook
    absent = [u for u, v in hook.items() if v is False]
    if absent:
        return Capability("cdi_hook", False, f"no CDI spec with the apply-cuda-memory-limits hook for "
                                             f"{', '.join(absent)}"), hook
    unknown = [u for u, v in hook.items() if v is None]
    return Capability("cdi_hook", None, f"no CDI spec found for {', '.join(unknown) or 'any GPU'} "
                                        "(memory-limit hook unknown)"), hook


def described(gpus: Sequence[GpuInfo], driver_version: str) -> NodeCapabilities:
    """The gate's inputs a node description alone (a node file: ``fracplugin explain --node``) gives: the
    driver's version and the GPUs' MIG modes; the kernel's inputs and the MPS protocol are unknown (they do not
    block, as in the daemon's gate)."""
    return NodeCapabilities((_driver(driver_version), _mig(gpus)))


def described_can_enforce(gpus: Sequence[GpuInfo], driver_version: str) -> bool:
    """What a node description alone (a node file: ``fracplugin explain --node``) says of the gate: the
    driver is known to be r615+ and some GPU is not in MIG mode. The kernel's inputs (cgroup v2, memory
    accounting) and the MPS protocol are the node's own and not in a file: they do not block here."""
    return _driver(driver_version).ok is True and _mig(gpus).ok is True


def check_capabilities(
    gpus: Sequence[GpuInfo],
    driver_version: str,
    *,
    cgroup_root: str = "/sys/fs/cgroup",
    mps_protocol: int | None = None,
    nvml_probe: Callable[[str], str | None] | None = None,
    hook_of: Callable[[str], bool | None] | None = None,
) -> NodeCapabilities:
    """Evaluate the gate now.

    Args:
        gpus: the node's GPUs (``mig_enabled``, ``pci_bus_id`` are read).
        driver_version: NVML's driver version string (e.g. ``615.71.09``).
        cgroup_root: the cgroup v2 mount (a test tree in tests).
        mps_protocol: 2 or 3, None when not known.
        nvml_probe: ``uuid -> None`` when NVML answers
            ``nvmlDeviceGetMemoryLimits_v1`` on the root cgroup, else the
            error text (None: no NVML).
        hook_of: ``uuid -> True/False/None`` whether the GPU's CDI spec
            carries the memory-limit hook (None: CDI not read).
    Never raises for a missing file or a failing callable: it becomes a reason."""
    usable = [g for g in gpus if not g.mig_enabled] or list(gpus)  # a MIG GPU takes no fraction (_mig)
    hook_cap, hook = _hook(usable, hook_of)
    items = (_driver(driver_version), _mps(mps_protocol), _cgroup_v2(cgroup_root),
             _accounting(cgroup_root, usable, nvml_probe), _mig(gpus), hook_cap)
    return NodeCapabilities(items=items, hook=hook)


REFRESH_S = 10.0
"""Seconds a ``CapabilityGate`` answer is kept."""


class CapabilityGate:
    """``check_capabilities`` kept fresh: re-evaluated when older than
    ``REFRESH_S`` (its inputs are files and cheap NVML reads), so a
    node that changes (a CDI spec written, MIG turned on through NVML, the
    driver upgraded after a restart) is seen without a restart.

    Args: as ``check_capabilities``, with ``gpus`` and ``mps_protocol`` as
    callables read at each evaluation. Thread-safe; ``current()`` never raises."""

    def __init__(self, gpus: Callable[[], Sequence[GpuInfo]], driver_version: str, *,
                 cgroup_root: str = "/sys/fs/cgroup",
                 mps_protocol: Callable[[], int | None] | None = None,
                 nvml_probe: Callable[[str], str | None] | None = None,
                 hook_of: Callable[[str], bool | None] | None = None) -> None:
        self._gpus = gpus
        self.driver_version = driver_version
        self.cgroup_root = cgroup_root
        self._protocol = mps_protocol
        self.nvml_probe = nvml_probe
        self.hook_of = hook_of
        self._lock = threading.Lock()
        self._at = -1.0e18
        self._last: NodeCapabilities | None = None

    def current(self) -> NodeCapabilities:
        """The gate's answer, at most ``REFRESH_S`` old."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._at < REFRESH_S:
                return self._last
        protocol = None
        with contextlib.suppress(Exception):
            protocol = self._protocol() if self._protocol is not None else None
        caps = check_capabilities(list(self._gpus()), self.driver_version, cgroup_root=self.cgroup_root,
                                  mps_protocol=protocol, nvml_probe=self.nvml_probe, hook_of=self.hook_of)
        with self._lock:
            self._last, self._at = caps, now
        return caps

    def reason(self) -> str:
        """``""`` when the node can enforce, else the reason (``NodeCapabilities.reason``)."""
        return self.current().reason
