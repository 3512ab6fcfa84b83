"""The per-mount flags of the MPS root, for the device plugin door's startup
warning.

The device plugin API's ``Mount`` (v1beta1: container_path, host_path,
read_only) carries no mount options: kubelet hands containerd a bind mount and
containerd/runc bind it ``rbind`` + ``rw``/``ro``. A Linux bind mount copies
the mount flags of the mount it is taken from (``clone_mnt`` keeps
``MNT_NOSUID``/``MNT_NODEV``), so the container's pipe directory is
``nosuid,nodev`` exactly when the host directory sits on a mount that is
(issue 11, D9). The NRI door sets the options itself (``model.Mount.options``).
``/run`` (the default MPS root's filesystem) is a ``nosuid,nodev`` tmpfs on
systemd hosts.
"""

from __future__ import annotations

import os


def flags(path: str) -> set[str]:
    """The per-mount flags of the mount holding ``path`` among ``nosuid``,
    ``nodev``, ``noexec``, ``ro`` (from statvfs). Raises OSError."""
    f = os.statvfs(path).f_flag
    return {name for name, bit in (("ro", os.ST_RDONLY), ("nosuid", os.ST_NOSUID), ("nodev", os.ST_NODEV),
                                   ("noexec", getattr(os, "ST_NOEXEC", 8))) if f & bit}
