"""Memory-limit enforcement: the capability gate, leaf cgroups, NVML apply/verify (issue 23, ADR 0025)."""

from .capability import NodeCapabilities, check_capabilities
from .cgroups import CgroupNotFound, leaf_relpath, resolve_leaf
from .memlimits import ContainerLimits, LimitPolicy, MemoryLimitEnforcer, MemoryLimitMode, NvmlLimits

__all__ = ["NodeCapabilities", "check_capabilities", "CgroupNotFound", "leaf_relpath", "resolve_leaf",
           "ContainerLimits", "LimitPolicy", "MemoryLimitEnforcer", "MemoryLimitMode", "NvmlLimits"]
