"""Who holds what on each GPU, with the node-side guards and atomic persistence.

Concurrency: one ``threading.RLock`` guards all state; every public method is
safe to call from any thread (NRI handlers, gRPC workers, metrics scrapes).
Subscribers are called after the lock is released.

Invariants (checked by ``check_invariants`` and by property tests):

- one compute mode per GPU at a time;
- per GPU, the sum of request MiB held <= the GPU's memory;
- per GPU, at most ``max_clients_per_gpu`` tenants (MPS client limit, 48 on
  Volta and later: kubelet-device-plugin.md B.4);
- an owner (pod uid, container) appears at most once per GPU.

Persistence: a JSON document ``{"version": 1, "node": ..., "tenancies": [...]}``
written to a temp file in the same directory, fsynced, renamed over the old
file, and the directory fsynced. A file that cannot be read back is moved
aside to ``<path>.corrupt-<unix seconds>`` and reported; it is never trusted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .allocation import DOOR_ALLOCATE, DOOR_NRI, DOOR_OTHER_PLUGIN, DOOR_SYNC, to_tenancies
from .model import ComputeMode, ContainerPlan, FractionError, GpuInfo, NodeInfo, Tenancy

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_MAX_CLIENTS_PER_GPU = 48


@dataclass(frozen=True)
class Problem:
    """Why one GPU cannot take a container: ``fact`` about the GPU and the
    ``rule`` it breaks (kept apart so a refusal listing several GPUs states
    each rule once)."""

    fact: str
    rule: str

    def __str__(self) -> str:
        return f"{self.fact}; {self.rule}"


def same_hold(t: Tenancy, owner: tuple[str, str], reservation: str = "") -> bool:
    """True when ``t`` is the hold being (re)admitted: the same kubelet
    reservation (an init container and the app container reusing its device
    IDs are one hold, ADR 0007), or the same bound (pod uid, container)."""
    if reservation and t.reservation == reservation:
        return True
    return bool(owner[0]) and t.owner == owner


def admission_problem(
    gpu: GpuInfo,
    tenants: Sequence[Tenancy],
    owner: tuple[str, str],
    mode: ComputeMode,
    request_mib: int,
    max_clients: int,
    reservation: str = "",
) -> Problem | None:
    """Why ``owner`` cannot take ``request_mib`` MiB of ``gpu`` in ``mode``, or None.

    ``tenants`` are the GPU's current tenancies; the hold's own earlier
    entries (``same_hold``: same owner, or same ``reservation``) are ignored
    (a restarted container replaces its hold). A GPU given whole to a
    container by another device plugin (door ``other-plugin``) takes no
    fraction. Shared by the planner (to choose) and the ledger (to enforce
    atomically).
    """
    others = [t for t in tenants if not same_hold(t, owner, reservation)]
    whole = [t for t in others if t.door in (DOOR_OTHER_PLUGIN, DOOR_SYNC)]
    if whole:
        t = whole[0]
        how = (f"by another device plugin ({t.reservation})" if t.door == DOOR_OTHER_PLUGIN
               else "(a running container fracplugin did not adjust)")
        return Problem(
            f"GPU {gpu.index} ({gpu.uuid}) is used whole by {t.namespace}/{t.pod_name}/{t.container} {how}",
            "a GPU used whole is not shared",
        )
    other_modes = [t for t in others if t.mode is not mode]
    if other_modes:
        t = other_modes[0]
        return Problem(
            f"GPU {gpu.index} ({gpu.uuid}) is in {t.mode.value} mode for {t.namespace}/{t.pod_name}/{t.container}",
            f"one compute mode per GPU, this container wants {mode.value}",
        )
    held = sum(t.request_mib for t in others)
    if held + request_mib > gpu.memory_mib:
        return Problem(
            f"GPU {gpu.index} ({gpu.uuid}) has {gpu.memory_mib - held} MiB of {gpu.memory_mib} MiB free",
            f"this container requests {request_mib} MiB",
        )
    if len(others) >= max_clients:
        return Problem(f"GPU {gpu.index} ({gpu.uuid}) already has {len(others)} tenants",
                       f"the MPS client limit is {max_clients} per GPU")
    return None


class Ledger:
    """Per-GPU tenancy of this node.

    Args:
        node: the node's GPUs (memory sizes bound the guards).
        path: the JSON file to persist to; None keeps the ledger in memory.
        max_clients_per_gpu: tenants allowed per GPU.
        read_only: read ``path`` but never write or move it (``fracplugin explain --ledger``).
    """

    def __init__(self, node: NodeInfo, path: str | os.PathLike[str] | None = None,
                 max_clients_per_gpu: int = DEFAULT_MAX_CLIENTS_PER_GPU, *, read_only: bool = False) -> None:
        self._read_only = read_only
        self._node = node
        self._gpus = {g.uuid: g for g in node.gpus}
        self._path = Path(path) if path is not None else None
        self._max_clients = max_clients_per_gpu
        self._lock = threading.RLock()
        self._entries: list[Tenancy] = []
        self._subscribers: list[Callable[[], None]] = []
        # Serialised form of each tenancy (frozen, hashable): a change encodes
        # only what is new, not every tenancy again (the NRI hot path).
        self._fragments: dict[Tenancy, str] = {}
        self._dir_ready = False

    # ---- reading -----------------------------------------------------------
    @property
    def node(self) -> NodeInfo:
        return self._node

    @property
    def path(self) -> Path | None:
        return self._path

    def tenancies(self) -> list[Tenancy]:
        """All tenancies, in admission order."""
        with self._lock:
            return list(self._entries)

    def tenants(self, gpu_uuid: str) -> list[Tenancy]:
        """Tenancies on one GPU."""
        with self._lock:
            return [t for t in self._entries if t.gpu_uuid == gpu_uuid]

    def held_mib(self, gpu_uuid: str) -> int:
        """Request MiB held on one GPU."""
        return sum(t.request_mib for t in self.tenants(gpu_uuid))

    def mode(self, gpu_uuid: str) -> ComputeMode | None:
        """The compute mode of a GPU's tenants, None when it has none."""
        tenants = self.tenants(gpu_uuid)
        return tenants[0].mode if tenants else None

    def find(self, pod_uid: str, container: str) -> list[Tenancy]:
        """The tenancies of one container (one per GPU)."""
        with self._lock:
            return [t for t in self._entries if t.owner == (pod_uid, container)]

    def find_container_id(self, container_id: str) -> list[Tenancy]:
        """The tenancies recorded under a runtime container id."""
        if not container_id:
            return []
        with self._lock:
            return [t for t in self._entries if t.container_id == container_id]

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every change (outside the lock)."""
        with self._lock:
            self._subscribers.append(callback)

    def reservation(self, key: str) -> list[Tenancy]:
        """The tenancies of one kubelet reservation (one per GPU; empty when none)."""
        if not key:
            return []
        with self._lock:
            return [t for t in self._entries if t.reservation == key]

    def reservations(self) -> dict[str, list[Tenancy]]:
        """Every reservation of the ``allocate`` door: key -> its tenancies."""
        out: dict[str, list[Tenancy]] = {}
        with self._lock:
            for t in self._entries:
                if t.reservation and t.door == DOOR_ALLOCATE:
                    out.setdefault(t.reservation, []).append(t)
        return out

    # ---- changing ----------------------------------------------------------
    def admit(self, plan: ContainerPlan, container_id: str = "", *, door: str = DOOR_NRI,
              reservation: str = "", bound: bool = True) -> list[Tenancy]:
        """Record ``plan`` (``allocation.to_tenancies``): one Tenancy per
        assigned GPU, replacing the hold's earlier entries (same owner, or the
        same ``reservation`` key). ``bound=False`` records a kubelet
        reservation whose holder is not known yet. Atomic: either every GPU is
        admitted or none.

        Raises:
            FractionError: a guard fails (code ``guard``) or a GPU is unknown;
                the ledger is unchanged then.
            OSError: the file could not be written (the ledger is unchanged).
        """
        owner = (plan.pod.uid, plan.container) if bound else ("", "")
        new = to_tenancies(plan, container_id, door=door, reservation=reservation, bound=bound)
        with self._lock:
            for t in new:
                gpu = self._gpus.get(t.gpu_uuid)
                if gpu is None:
                    raise FractionError("node", t.gpu_uuid, f"is not a GPU of node {self._node.name}", "device")
                problem = admission_problem(
                    gpu, [e for e in self._entries if e.gpu_uuid == gpu.uuid], owner,
                    t.mode, t.request_mib, self._max_clients, reservation,
                )
                if problem:
                    raise FractionError("node", str(plan.pod) + "/" + plan.container, str(problem), "guard")
            before = self._entries
            self._entries = [e for e in self._entries if not same_hold(e, owner, reservation)] + new
            self._persist_or_rollback(before)
        self._notify()
        return new

    def release(self, pod_uid: str, container: str) -> list[Tenancy]:
        """Drop one container's tenancies; returns what was dropped."""
        return self._remove(lambda t: t.owner == (pod_uid, container))

    def release_container_id(self, container_id: str) -> list[Tenancy]:
        """Drop the tenancies recorded under a runtime container id."""
        if not container_id:
            return []
        return self._remove(lambda t: t.container_id == container_id)

    def release_reservation(self, key: str) -> list[Tenancy]:
        """Drop one kubelet reservation (kubelet freed its devices)."""
        if not key:
            return []
        return self._remove(lambda t: t.reservation == key)

    def release_stopped(self, container_id: str) -> list[Tenancy]:
        """A container stopped: drop what it holds through the NRI door, and
        unbind it from a kubelet reservation (the reservation stays held for
        its pod until kubelet frees the devices: the pod ends, or the devices
        are allocated again). Returns the dropped tenancies."""
        if not container_id:
            return []
        with self._lock:
            mine = [t for t in self._entries if t.container_id == container_id]
            if not mine:
                return []
            gone = [t for t in mine if t.door != DOOR_ALLOCATE]
            before = self._entries
            self._entries = [
                dataclasses.replace(t, container_id="") if t.container_id == container_id and t.door == DOOR_ALLOCATE
                else t
                for t in self._entries if not (t.container_id == container_id and t.door != DOOR_ALLOCATE)
            ]
            self._persist_or_rollback(before)
        self._notify()
        return gone

    def release_pod(self, pod_uid: str) -> list[Tenancy]:
        """Drop every tenancy of a pod."""
        return self._remove(lambda t: t.pod_uid == pod_uid)

    def transform(self, fn: Callable[[list[Tenancy]], Iterable[Tenancy]]) -> None:
        """Replace the state with ``fn(current entries)`` atomically (under the
        lock, so a concurrent admission is never lost), with ``replace_all``'s
        rules (unknown GPUs dropped, guard breaks logged, never refused)."""
        self._replace(fn)

    def replace_all(self, tenancies: Iterable[Tenancy]) -> None:
        """Replace the whole state (rebuild after a runtime Synchronize).

        Records what is there without refusing: entries on unknown GPUs are
        dropped with a warning; guard violations are logged, since the
        containers already run.
        """
        items = list(tenancies)
        self._replace(lambda _cur: items)

    def _replace(self, fn: Callable[[list[Tenancy]], Iterable[Tenancy]]) -> None:
        with self._lock:
            kept: list[Tenancy] = []
            seen: set[tuple[str, str, str]] = set()
            for t in fn(list(self._entries)):
                if t.gpu_uuid not in self._gpus:
                    log.warning("ledger: dropping tenancy on unknown GPU",
                                extra={"gpu_uuid": t.gpu_uuid, "pod_uid": t.pod_uid})
                    continue
                key = (*t.hold, t.gpu_uuid)
                if key in seen:
                    continue
                seen.add(key)
                kept.append(t)
            before = self._entries
            self._entries = kept
            self._persist_or_rollback(before)
            for problem in self.check_invariants():
                log.warning("ledger: running containers break a guard: %s", problem)
        self._notify()

    def _remove(self, match: Callable[[Tenancy], bool]) -> list[Tenancy]:
        with self._lock:
            gone = [t for t in self._entries if match(t)]
            if not gone:
                return []
            before = self._entries
            self._entries = [t for t in self._entries if not match(t)]
            self._persist_or_rollback(before)
        self._notify()
        return gone

    def _notify(self) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for cb in subscribers:
            try:
                cb()
            except Exception:  # a subscriber never breaks the ledger
                log.exception("ledger subscriber failed")

    # ---- invariants --------------------------------------------------------
    def check_invariants(self) -> list[str]:
        """Every broken invariant, as a sentence (empty when all hold)."""
        problems = []
        with self._lock:
            entries = list(self._entries)
        for gpu in self._node.gpus:
            on = [t for t in entries if t.gpu_uuid == gpu.uuid]
            if len({t.mode for t in on}) > 1:
                problems.append(f"GPU {gpu.uuid} has tenants of more than one compute mode")
            held = sum(t.request_mib for t in on)
            if held > gpu.memory_mib:
                problems.append(f"GPU {gpu.uuid} holds {held} MiB of {gpu.memory_mib} MiB")
            if len(on) > self._max_clients:
                problems.append(f"GPU {gpu.uuid} has {len(on)} tenants, limit {self._max_clients}")
            owners = [t.hold for t in on]
            if len(owners) != len(set(owners)):
                problems.append(f"GPU {gpu.uuid} lists one container twice")
        return problems

    # ---- persistence -------------------------------------------------------
    def load(self) -> list[str]:
        """Read the file (if any) into memory; returns warnings for the operator.

        A file that is not valid JSON of our format is moved aside to
        ``<path>.corrupt-<unix seconds>`` and the ledger starts empty; records
        on GPUs this node does not have are dropped with a warning.
        """
        if self._path is None or not self._path.exists():
            return []
        warnings: list[str] = []
        try:
            doc = json.loads(self._path.read_text())
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format (version {doc.get('version') if isinstance(doc, dict) else None!r})")
            records = doc["tenancies"]
            if not isinstance(records, list):
                raise ValueError("tenancies is not a list")
            entries = [Tenancy.from_dict(r) for r in records]
            for t in entries:
                if not 1 <= t.request_mib <= t.limit_mib:
                    raise ValueError(f"record {t.namespace}/{t.pod_name}/{t.container} has request {t.request_mib} MiB "
                                     f"and limit {t.limit_mib} MiB (need 1 <= request <= limit)")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            if self._read_only:
                return [f"ledger file {self._path} is unreadable ({exc}); ignored"]
            aside = self._path.with_name(f"{self._path.name}.corrupt-{int(time.time())}")
            os.replace(self._path, aside)
            msg = f"ledger file {self._path} is corrupt ({exc}); moved aside to {aside}, starting empty"
            log.error(msg)
            return [msg]
        kept = []
        for t in entries:
            if t.gpu_uuid not in self._gpus:
                warnings.append(f"ledger record for {t.namespace}/{t.pod_name}/{t.container} names GPU {t.gpu_uuid}, "
                                f"which this node does not have; dropped")
                continue
            kept.append(t)
        with self._lock:
            self._entries = kept
            for problem in self.check_invariants():
                warnings.append(f"ledger file breaks a guard: {problem}")
        for w in warnings:
            log.warning(w)
        self._notify()
        return warnings

    def _persist_or_rollback(self, before: list[Tenancy]) -> None:
        try:
            self._persist()
        except OSError:
            self._entries = before
            raise

    def _persist(self) -> None:
        if self._path is None or self._read_only:
            return
        fragments = []
        for t in self._entries:
            frag = self._fragments.get(t)
            if frag is None:
                frag = self._fragments[t] = json.dumps(t.to_dict(), sort_keys=True, separators=(",", ":"))
            fragments.append(frag)
        if len(self._fragments) > 2 * len(self._entries) + 64:
            live = set(self._entries)
            self._fragments = {t: f for t, f in self._fragments.items() if t in live}
        # The document {"node", "tenancies", "version"} in compact JSON, one
        # tenancy per line so the file stays readable with `less`.
        data = ('{"node":%s,"version":%d,"tenancies":[\n%s\n]}\n' % (
            json.dumps(self._node.name), FORMAT_VERSION, ",\n".join(fragments))).encode()
        directory = self._path.parent
        if not self._dir_ready:
            directory.mkdir(parents=True, exist_ok=True)
            self._dir_ready = True
        fd, tmp = tempfile.mkstemp(prefix=f".{self._path.name}.", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def remove_crash_leftovers(path: str | os.PathLike[str]) -> list[str]:
    """Remove what crashes leave next to the ledger file ``path`` (issue 13
    item 5), and return one message per action for the log:

    - ``.<name>.*``: temporary files of an atomic write (``_persist``:
      mkstemp, fsync, rename) that a kill -9 interrupted before the rename;
      ``.endpoints.*`` temps of the daemon's endpoints file likewise;
    - ``<name>.corrupt-<unix seconds>``: copies of corrupt ledgers moved aside
      by ``load``; the newest (largest suffix, then mtime) is kept for a post
      mortem, the others removed.

    Call it at start, after ``load`` and before anything writes the ledger
    (one daemon per node owns the directory). Never raises: a file that
    cannot be removed is reported in the returned messages.
    """
    p = Path(path)
    directory = p.parent
    msgs: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        return [f"state directory {directory} not listed for crash leftovers: {exc}"]
    temps = [n for n in names if n.startswith(f".{p.name}.") or n.startswith(".endpoints.")]
    corrupt = [n for n in names if n.startswith(f"{p.name}.corrupt-")]

    def rank(name: str) -> tuple[int, float]:
        suffix = name.rsplit("-", 1)[-1]
        try:
            mtime = (directory / name).stat().st_mtime
        except OSError:
            mtime = 0.0
        return (int(suffix) if suffix.isdigit() else -1, mtime)

    corrupt.sort(key=rank)
    if corrupt:
        msgs.append(f"kept the newest corrupt ledger copy {directory / corrupt[-1]}")
    for name in temps + corrupt[:-1]:
        target = directory / name
        try:
            if target.is_file() and not target.is_symlink():
                target.unlink()
                msgs.append(f"removed crash leftover {target}")
        except OSError as exc:
            msgs.append(f"cannot remove crash leftover {target}: {exc}")
    return msgs
