"""PID -> container id / pod UID through ``/proc/<pid>/cgroup``.

Concurrency: stateless apart from the (immutable) proc root; every function is
safe to call from any thread. Callers that look up many PIDs in one sampling
cycle should keep their own per-cycle cache (PIDs are reused; exited PIDs are a
normal race and read as ``None``).

Rules (docs/reference/mps-nvml.md section 4.6; gpu-fractioning ``mpsd/internal/procfs``,
dcgm-exporter ``pidmapper.go``):

* ``/proc/<pid>/cgroup`` lines are ``hierarchy-id:controllers:path``. cgroup v2
  has a single ``0::<path>`` line; v1 has one line per hierarchy. We take the
  first line (v2 first, then v1 ``name=systemd``, then any other) whose path
  names a container.
* Path shapes accepted (matched on the path's tail, never assuming a root,
  because a private cgroup namespace shows ``/../..`` prefixes):

  - systemd driver: ``.../kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<64hex>.scope``
    (also ``crio-<id>.scope``, ``docker-<id>.scope``; ``crio-conmon-<id>.scope`` is CRI-O's
    monitor, not the container, and is ignored);
  - cgroupfs driver: ``/kubepods/burstable/pod<uid-with-dashes>/<64hex>``
    (and ``/kubepods/pod<uid>/<64hex>`` for guaranteed pods).
* The pod UID is taken from the ``pod<uid>`` path element (``_`` -> ``-``); a UID
  shorter than 32 hex digits is rejected (dcgm-exporter's rule).
"""

from __future__ import annotations

import os
from typing import Iterable
import re
from dataclasses import dataclass

# <prefix>-<64 hex>.scope (systemd driver) or a bare 64-hex leaf (cgroupfs driver).
_SCOPE_RE = re.compile(r"^(?:(?P<rt>cri-containerd|crio|docker|containerd)-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$")
_POD_RE = re.compile(r"pod(?P<uid>[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_RUNTIME = {"cri-containerd": "containerd", "containerd": "containerd", "crio": "cri-o", "docker": "docker"}


@dataclass(frozen=True)
class ContainerRef:
    """The container a process belongs to.

    Attributes:
        container_id: the runtime's container id (64 lowercase hex).
        pod_uid: the pod UID with dashes (``""`` when the path has no pod element).
        runtime: ``containerd``, ``cri-o``, ``docker`` or ``""`` (cgroupfs driver: unknown).
        cgroup_path: the cgroup path it was parsed from (as read, namespace-relative).
    """

    container_id: str
    pod_uid: str
    runtime: str
    cgroup_path: str


def container_id_matches(a: str, b: str, min_len: int = 12) -> bool:
    """True when two container ids name the same container: equal, or one is a
    prefix of the other and the shorter has at least ``min_len`` characters
    (runtimes and ``crictl`` print 12/13-char short ids; gpu-fractioning uses
    12 as the minimum)."""
    if not a or not b:
        return False
    if a == b:
        return True
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return len(short) >= min_len and long_.startswith(short)


def parse_cgroup_path(path: str) -> ContainerRef | None:
    """Parse one cgroup path; ``None`` when it does not name a container."""
    parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
    if not parts:
        return None
    # The container leaf is the deepest element that looks like one; runtimes
    # may nest further (e.g. a "container" sub-cgroup for systemd-in-container).
    for i in range(len(parts) - 1, -1, -1):
        m = _SCOPE_RE.match(parts[i])
        if m is None:
            continue
        pod_uid = ""
        for elem in reversed(parts[:i]):
            pm = _POD_RE.search(elem)
            if pm:
                pod_uid = pm.group("uid").replace("_", "-")
                break
        # A bare 64-hex leaf only counts under a pod element or kubepods
        # (cgroupfs driver); otherwise it is too easy to mistake.
        if m.group("rt") is None and not pod_uid and not any("kubepods" in e for e in parts[:i]):
            return None
        return ContainerRef(
            container_id=m.group("id"),
            pod_uid=pod_uid,
            runtime=_RUNTIME.get(m.group("rt") or "", ""),
            cgroup_path=path.strip(),
        )
    return None


def parse_cgroup(text: str) -> ContainerRef | None:
    """Parse the contents of ``/proc/<pid>/cgroup`` (v1 or v2).

    Returns the container of the first line that names one, preferring the v2
    unified line (``0::``), then v1 ``name=systemd``, then other v1 lines.
    Returns ``None`` for host processes and unparseable text; never raises.
    """
    entries: list[tuple[int, str]] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hid, controllers, path = fields
        if hid == "0" and controllers == "":
            rank = 0
        elif controllers == "name=systemd":
            rank = 1
        else:
            rank = 2
        entries.append((rank, path))
    entries.sort(key=lambda e: e[0])
    for _, path in entries:
        ref = parse_cgroup_path(path)
        if ref is not None:
            return ref
    return None


class ProcFs:
    """Reads a proc filesystem rooted at ``root`` (default ``/proc``; tests pass
    a temporary directory holding ``<pid>/cgroup`` files and ``<pid>/exe``
    symlinks).

    Needs the host PID namespace in production (``hostPID: true``): NVML and the
    MPS control daemon report host PIDs (docs/reference/mps-nvml.md section 4.3, 2.3).
    """

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def _path(self, pid: int, leaf: str) -> str:
        return os.path.join(self.root, str(int(pid)), leaf)

    def cgroup_text(self, pid: int) -> str | None:
        """Raw ``/proc/<pid>/cgroup`` text, or ``None`` if the PID is gone/unreadable."""
        try:
            with open(self._path(pid, "cgroup"), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def container_of(self, pid: int) -> ContainerRef | None:
        """The container ``pid`` runs in, or ``None`` (host process, exited, unreadable)."""
        text = self.cgroup_text(pid)
        if text is None:
            return None
        return parse_cgroup(text)

    def exe_basename(self, pid: int) -> str | None:
        """Basename of the ``/proc/<pid>/exe`` link target (``None`` when unreadable).

        Match MPS binaries by this, not by ``comm``: comm is truncated to 15
        characters and both MPS binaries read back as ``nvidia-cuda-mps``
        (docs/reference/mps-nvml.md section 1.2). A deleted binary's `` (deleted)`` suffix is stripped.
        """
        try:
            target = os.readlink(self._path(pid, "exe"))
        except OSError:
            return None
        if target.endswith(" (deleted)"):
            target = target[: -len(" (deleted)")]
        return os.path.basename(target)

    def _stat_field(self, pid: int, n: int) -> int | None:
        """Field ``n`` (1-based, proc(5), ``n`` >= 3) of ``/proc/<pid>/stat`` as
        an integer; None when the PID is gone or the field unreadable."""
        try:
            fd = os.open(self._path(pid, "stat"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            data = os.read(fd, 4096)
        except OSError:
            return None
        finally:
            os.close(fd)
        # comm (field 2) may hold spaces and ')': fields 3.. follow the last ')'.
        rest = data.rpartition(b")")[2].split()
        try:
            return int(rest[n - 3])
        except (IndexError, ValueError):
            return None

    def ppid(self, pid: int) -> int | None:
        """Parent PID (``stat`` field 4; None when gone/unreadable)."""
        return self._stat_field(pid, 4)

    def pids(self) -> list[int]:
        """All numeric entries of the proc root (ascending)."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def environ_value(self, pid: int, name: str) -> str | None:
        """One variable of ``/proc/<pid>/environ`` (None when absent or unreadable)."""
        try:
            with open(self._path(pid, "environ"), "rb") as f:
                data = f.read()
        except OSError:
            return None
        prefix = name.encode() + b"="
        for entry in data.split(b"\0"):
            if entry.startswith(prefix):
                return entry[len(prefix):].decode(errors="replace")
        return None

    def pids_by_exe(self, basename: str) -> list[int]:
        """PIDs whose ``exe`` basename equals ``basename``."""
        return [p for p in self.pids() if self.exe_basename(p) == basename]


class CachedProcFs(ProcFs):
    """``ProcFs`` whose ``container_of`` and ``exe_basename`` answers are
    cached per PID, for the metrics scrape (issue 14: every scrape used to
    re-read and re-parse the cgroup file of every GPU process).

    A PID's answers are kept while its start time (``/proc/<pid>/stat``
    field 22, ``starttime``, clock ticks since boot: proc(5)) is the one read
    when they were cached: a PID reused by a new process has another start
    time, so its cgroup is read again. A PID whose ``stat`` cannot be read
    (gone, or a test proc root without one) is looked up uncached. Call
    ``prune(pids)`` with the PIDs still of interest to drop the others.
    Thread-safe enough for one scraper at a time (dict operations only).
    """

    def __init__(self, root: str = "/proc") -> None:
        super().__init__(root)
        self._cache: dict[int, tuple[int, ContainerRef | None, str | None]] = {}

    def start_time(self, pid: int) -> int | None:
        """Field 22 (``starttime``) of ``/proc/<pid>/stat``; None when unreadable."""
        return self._stat_field(pid, 22)

    def _entry(self, pid: int) -> tuple[int, ContainerRef | None, str | None] | None:
        start = self.start_time(pid)
        if start is None:
            self._cache.pop(pid, None)
            return None
        hit = self._cache.get(pid)
        if hit is not None and hit[0] == start:
            return hit
        ref = ProcFs.container_of(self, pid)
        exe = ProcFs.exe_basename(self, pid) if ref is None else None  # only host processes (MPS servers) need it
        entry = self._cache[pid] = (start, ref, exe)
        return entry

    def container_of(self, pid: int) -> ContainerRef | None:
        """``ProcFs.container_of``, cached while the PID's start time holds."""
        entry = self._entry(pid)
        return ProcFs.container_of(self, pid) if entry is None else entry[1]

    def exe_basename(self, pid: int) -> str | None:
        """``ProcFs.exe_basename`` for a host process, cached likewise (a
        process in a container is never an MPS server here: None is not read)."""
        entry = self._entry(pid)
        if entry is None:
            return ProcFs.exe_basename(self, pid)
        return entry[2] if entry[1] is None else ProcFs.exe_basename(self, pid)

    def prune(self, pids: Iterable[int]) -> None:
        """Forget every cached PID not in ``pids``."""
        keep = set(pids)
        for pid in [p for p in self._cache if p not in keep]:
            del self._cache[pid]
