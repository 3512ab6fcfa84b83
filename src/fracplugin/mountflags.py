"""nosuid,nodev for the pipe directory mount that kubelet makes from Allocate.

The device plugin API's ``Mount`` (v1beta1: container_path, host_path,
read_only) carries no mount options: kubelet hands containerd a bind mount and
containerd/runc bind it ``rbind`` + ``rw``/``ro``. A Linux bind mount copies
the mount flags of the mount it is taken from (``clone_mnt`` keeps
``MNT_NOSUID``/``MNT_NODEV``), so the container's pipe directory is
``nosuid,nodev`` exactly when the host directory sits on a mount that is.
The NRI door sets the options itself (``model.Mount.options``); for the
Allocate door (issue 11, D9) the MPS root must be such a mount.

``/run`` (the default MPS root's filesystem) is a ``nosuid,nodev`` tmpfs on
systemd hosts, so usually nothing is needed. ``secure(path)`` makes ``path``
a bind mount of itself and remounts it ``nosuid,nodev`` (keeping ``ro`` /
``noexec`` if set) when its filesystem lacks either flag; ``release`` undoes
what ``secure`` did. Needs CAP_SYS_ADMIN in the host mount namespace.
"""

from __future__ import annotations

import ctypes
import os

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2


class MountFlagError(OSError):
    """The bind/remount failed (message names the path and the errno)."""


def flags(path: str) -> set[str]:
    """The per-mount flags of the mount holding ``path`` among ``nosuid``,
    ``nodev``, ``noexec``, ``ro`` (from statvfs). Raises OSError."""
    f = os.statvfs(path).f_flag
    out = set()
    for name, bit in (("ro", os.ST_RDONLY), ("nosuid", os.ST_NOSUID), ("nodev", os.ST_NODEV),
                      ("noexec", getattr(os, "ST_NOEXEC", 8))):
        if f & bit:
            out.add(name)
    return out


def _mount(source: str | None, target: str, flags_: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(None if source is None else os.fsencode(source), os.fsencode(target), None,
                    ctypes.c_ulong(flags_), None)
    if rc != 0:
        err = ctypes.get_errno()
        raise MountFlagError(err, f"mount({source!r}, {target!r}, flags={flags_:#x}) failed: {os.strerror(err)}")


def secure(path: str) -> bool:
    """Make ``path`` (created 0755 when missing) a ``nosuid,nodev`` mount.
    Returns True when it mounted (call ``release`` at stop), False when the
    flags were already there. Raises MountFlagError (no privilege, ...)."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    have = flags(path)
    if {"nosuid", "nodev"} <= have:
        return False
    _mount(path, path, MS_BIND)
    keep = (MS_RDONLY if "ro" in have else 0) | (MS_NOEXEC if "noexec" in have else 0)
    try:
        _mount(None, path, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | keep)
    except MountFlagError:
        release(path)
        raise
    return True


def release(path: str) -> None:
    """Lazily unmount the bind mount ``secure`` put on ``path`` (errors ignored:
    processes may hold it; the tree underneath is the same directory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(os.fsencode(path), MNT_DETACH)
