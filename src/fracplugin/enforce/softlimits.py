"""Soft limits that must not outlive their container (issue 35 item 5, ADR 0036).

NVIDIA: "The driver adds each soft limit to the parent cgroups' reservations.
Deleting a cgroup without zeroing its soft limit leaves that reservation on the
parents." No NRI event sees a stopped container's leaf under containerd, and
runc and crun run OCI ``poststop`` hooks after they removed it (ADR 0036), so
``LeafWatch`` zeroes it when the leaf empties: the kernel marks
``<leaf>/cgroup.events`` ``populated 0`` (with an inotify modify event, Linux
``cgroup-v2.rst`` "Un-populated Notification") when the container's last process
exits, before the runtime deletes the leaf. ``reservation_drift`` measures what
is left anyway on the ancestors.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import struct
import threading
from typing import Callable, Iterable

from ..logs import guarded

log = logging.getLogger(__name__)

_IN_MODIFY, _IN_IGNORED = 0x2, 0x8000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)


class LeafWatch:
    """Calls ``on_empty(key)`` once per watched leaf, from its own thread, when
    ``<leaf>/cgroup.events`` reads ``populated 0`` or the file (the leaf) goes.

    Raises OSError at construction when inotify is unavailable. ``watch`` and
    ``unwatch`` are thread-safe; ``on_empty`` must not block for long (one
    thread serves every leaf) and its exceptions are logged."""

    def __init__(self, on_empty: Callable[[str], None]) -> None:
        self.on_empty = on_empty
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._wds: dict[int, tuple[str, str]] = {}  # watch descriptor -> (key, cgroup.events path)
        self._thread = threading.Thread(target=self._run, name="leaf-watch", daemon=True)
        self._thread.start()

    def watch(self, key: str, leaf: str) -> bool:
        """Watch ``leaf`` for ``key``; False when its ``cgroup.events`` cannot
        be watched (no cgroup v2 leaf there). A leaf already empty fires at once."""
        path = os.path.join(leaf, "cgroup.events")
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), _IN_MODIFY)
        if wd < 0:
            return False
        with self._lock:
            self._wds[wd] = (key, path)
        self._check(wd)
        return True

    def unwatch(self, key: str) -> None:
        """Stop watching ``key``'s leaf (nothing fires for it any more)."""
        with self._lock:
            wds = [wd for wd, (k, _p) in self._wds.items() if k == key]
            for wd in wds:
                del self._wds[wd]
                self._libc.inotify_rm_watch(self._fd, wd)

    def watched(self) -> int:
        """How many leaves are watched."""
        with self._lock:
            return len(self._wds)

    def close(self) -> None:
        """Stop the thread and close the inotify descriptor."""
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        for fd in (self._fd, self._wake_r, self._wake_w):
            os.close(fd)

    def _check(self, wd: int, gone: bool = False) -> None:
        with self._lock:
            item = self._wds.get(wd)
            if item is None:
                return
            if not gone:
                try:
                    with open(item[1], "rb") as f:
                        gone = b"populated 0" in f.read(256)
                except OSError:
                    gone = True
            if not gone:
                return
            del self._wds[wd]
        guarded(log, "leaf watch: on_empty", self.on_empty, item[0], extra={"key": item[0]})

    def _run(self) -> None:
        while True:
            ready, _w, _x = select.select([self._fd, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                continue
            off = 0
            while off + _EVENT.size <= len(data):
                wd, mask, _cookie, n = _EVENT.unpack_from(data, off)
                off += _EVENT.size + n
                self._check(wd, gone=bool(mask & _IN_IGNORED))


def ancestors(leaf: str, root: str) -> list[str]:
    """The cgroup directories between ``root`` (excluded: the root cgroup has
    no reservation file) and ``leaf`` (excluded), outermost first."""
    rel = os.path.relpath(leaf, root).split(os.sep)
    return [] if rel[0] == ".." else [os.path.join(root, *rel[: i + 1]) for i in range(len(rel) - 1)]


def reservation_drift(soft_of: Callable[[str, str], int | None], gpus: Iterable[str],
                      parents: Iterable[str]) -> list[dict[str, object]]:
    """Per (parent cgroup, GPU): ``reserved`` (the soft limit NVML reads on the
    parent, bytes), ``children`` (the sum it reads on the parent's child
    cgroups) and ``drift`` = reserved - children: soft limits reserved on the
    parent that no existing child carries (a child deleted without zeroing;
    each such reservation is counted once, at its lowest surviving ancestor).
    ``soft_of(gpu, cgroup)``: None when NVML cannot read it (the row is left
    out). Parents that no longer exist are left out."""
    rows: list[dict[str, object]] = []
    gpus = list(gpus)
    for parent in sorted(set(parents)):
        try:
            kids = [e.path for e in os.scandir(parent) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for gpu in gpus:
            reserved = soft_of(gpu, parent)
            if reserved is not None:
                children = sum(soft_of(gpu, k) or 0 for k in kids)
                rows.append({"cgroup": parent, "gpu": gpu, "reserved": reserved, "children": children,
                             "drift": reserved - children})
    return rows
