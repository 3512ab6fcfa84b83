"""A container's leaf cgroup directory from NRI's ``linux.cgroups_path``.

CUDA 13.4's per-container memory limit is set on the container's own **leaf**
cgroup (docs/reference/mps-nvml.md section 3: a new leaf with ``+dmem`` starts at
``dmem.max=max`` and does not inherit; the NVML namespace is the full cgroup
directory path). The runtime hands NRI plugins the path it gives runc
(``Container.linux.cgroups_path``, docs/reference/nri-protocol.md), in one of two shapes:

* systemd driver: ``<slice>:<prefix>:<name>``, e.g.
  ``kubepods-burstable-pod<uid_>.slice:cri-containerd:<64hex>`` (containerd)
  or ``kubepods-burstable-pod<uid_>.slice:crio:<64hex>`` (CRI-O). The leaf is
  ``<prefix>-<name>.scope`` under the slice, and a slice ``a-b-c.slice``
  lives at ``a.slice/a-b.slice/a-b-c.slice`` (systemd.slice(5)); ``-.slice``
  is the root.
* cgroupfs driver: an absolute path, e.g.
  ``/kubepods/burstable/pod<uid>/<64hex>`` (containerd) or
  ``/kubepods/burstable/pod<uid>/crio-<64hex>`` (CRI-O); relative paths are
  taken from the root too.

Everything is resolved under a configurable cgroup root
(``--cgroup-root``, default ``/sys/fs/cgroup``) so tests point it at a tree.
"""

from __future__ import annotations

import os
import re

DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"

_SLICE_RE = re.compile(r"^[A-Za-z0-9_.\-@:\\]+\.slice$")


class CgroupNotFound(LookupError):
    """The container's leaf cgroup could not be resolved or does not exist.

    ``reason`` is a sentence naming the cgroups path and the directory tried."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def _expand_slice(slice_name: str) -> str:
    """``a-b-c.slice`` -> ``a.slice/a-b.slice/a-b-c.slice``; ``-.slice`` or ""
    -> "" (systemd.slice(5): dashes name the parent slices). Raises
    CgroupNotFound for a name that is not a slice."""
    if slice_name in ("", "-.slice"):
        return ""
    if not _SLICE_RE.match(slice_name) or "/" in slice_name:
        raise CgroupNotFound(f"cgroups path slice {slice_name!r} is not a systemd slice name (want <name>.slice)")
    stem = slice_name[: -len(".slice")]
    parts = stem.split("-")
    if any(p == "" for p in parts):
        raise CgroupNotFound(f"cgroups path slice {slice_name!r} has an empty component between dashes")
    return "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def leaf_relpath(cgroups_path: str) -> str:
    """The leaf cgroup directory relative to the cgroup root for NRI's
    ``linux.cgroups_path`` (systemd ``slice:prefix:name`` or a cgroupfs path).

    Raises CgroupNotFound for an empty or malformed path, or one that climbs
    out of the root (``..``)."""
    cp = (cgroups_path or "").strip()
    if not cp:
        raise CgroupNotFound("the runtime gave no linux.cgroups_path for this container")
    if ":" in cp and not cp.startswith("/"):
        fields = cp.split(":")
        if len(fields) != 3:
            raise CgroupNotFound(f"cgroups path {cp!r} is neither systemd slice:prefix:name nor a cgroupfs path")
        slice_name, prefix, name = fields
        if not name or "/" in name or "/" in prefix:
            raise CgroupNotFound(f"cgroups path {cp!r}: the unit name must be one path component")
        unit = name if name.endswith((".scope", ".service", ".slice")) else (
            f"{prefix}-{name}.scope" if prefix else f"{name}.scope")
        parent = _expand_slice(slice_name)
        rel = f"{parent}/{unit}" if parent else unit
    else:
        rel = cp.strip("/")
    if not rel or any(part == ".." for part in rel.split("/")):
        raise CgroupNotFound(f"cgroups path {cp!r} does not name a directory under the cgroup root")
    return rel


def resolve_leaf(cgroups_path: str, root: str = DEFAULT_CGROUP_ROOT) -> str:
    """The absolute leaf cgroup directory of a container under ``root``.

    Raises CgroupNotFound (never OSError) when the path is malformed or the
    directory is not there (at StartContainer it exists: runc created it at create time)."""
    path = os.path.join(root, leaf_relpath(cgroups_path))
    if not os.path.isdir(path):
        raise CgroupNotFound(f"cgroup directory {path} for cgroups path {cgroups_path!r} does not exist")
    return path
