"""Memory-limit enforcement: the capability gate, leaf cgroups, NVML apply/verify (issue 23, ADR 0025)."""
