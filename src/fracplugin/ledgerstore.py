"""The ledger's persistence (issue 14, ADR 0010): the snapshot and its
append-only journal (load, replay, append, compact, close), the record
encoding, and the checks of the state directory (tmpfs, crash leftovers).

``LedgerStore`` is a member of ``Ledger`` (issue 33 item 3: composition,
not a mixin); ADR 0010 gives the file formats (``Ledger`` is the one
class to use).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Collection, Sequence

from .atomicfile import write_atomically
from .model import Tenancy

log = logging.getLogger("fracplugin.ledger")  # the ledger's log, as before the split

FORMAT_VERSION = 1
JOURNAL_SUFFIX = ".journal"

_str = json.encoder.encode_basestring_ascii  # json.dumps' own string encoder


def _int(v: int | None) -> str:
    if v is None:
        return "null"
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {v!r}")
    return int.__repr__(v)


def encode_tenancy(t: Tenancy) -> str:
    """One tenancy as its ledger record: exactly
    ``json.dumps(t.to_dict(), sort_keys=True, separators=(",", ":"))``
    (keys sorted, compact, ASCII with ``\\uXXXX`` escapes), written field by
    field (issue 14: 2 us instead of 5 us per admission). A property test
    keeps the two identical. Raises TypeError for a non-integer MiB field."""
    ns = t.mps_namespace
    held = '"held_mib":%s,' % _int(t.held_mib) if t.held_mib else ""  # only when set: older records read as before
    return ('{"active_thread_percentage":%s,"container":%s,"container_id":%s,"door":%s,"gpu_uuid":%s,%s'
            '"limit_mib":%s,"mode":%s,"mps_namespace":%s,"namespace":%s,"pod_name":%s,"pod_uid":%s,'
            '"request_mib":%s,"reservation":%s}' % (
                _int(t.active_thread_percentage), _str(t.container), _str(t.container_id), _str(t.door),
                _str(t.gpu_uuid), held, _int(t.limit_mib), _str(t.mode.value), "null" if ns is None else _str(ns),
                _str(t.namespace), _str(t.pod_name), _str(t.pod_uid), _int(t.request_mib), _str(t.reservation)))


class _Corrupt(ValueError):
    """The snapshot or the journal cannot be trusted (the message says why)."""


class LedgerStore:
    """The persistence of one ``Ledger`` (a member of it, issue 33 item 3):
    ``load``, ``persist`` one change, ``compact``, ``close``. ``path`` None
    keeps nothing; ``read_only`` reads ``path`` but never writes or moves
    it. Not thread-safe: the ledger calls it under its lock, and hands it
    ``live``, its current entries (what a compaction writes)."""

    compact_min = 1024
    """The journal is compacted into the snapshot once it holds more than ``max(compact_min, 2 x tenancies)``
    changes (amortised O(1) per change, issue 14)."""

    def __init__(self, node_name: str, path: str | os.PathLike[str] | None, *, read_only: bool = False) -> None:
        self._node_name = node_name
        self.path = Path(path) if path is not None else None
        self.journal_path = self.path.with_name(self.path.name + JOURNAL_SUFFIX) if self.path else None
        self._read_only = read_only
        # Serialised form of each tenancy (frozen, hashable): a change encodes
        # only what is new (the NRI hot path).
        self._fragments: dict[Tenancy, str] = {}
        self._dir_ready = False
        self._journal_fd: int | None = None  # open (O_APPEND) journal of the current generation
        self._journal_size = 0
        self._journal_records = 0
        self._replayed = False  # load() replayed journal lines: close() folds them into the snapshot

    def load(self) -> tuple[list[Tenancy] | None, list[str]]:
        """Read the snapshot and replay its journal (if any); returns the
        entries (None: nothing to load, or nothing trusted) and warnings for
        the operator. Recovery as ADR 0010 says: a corrupt snapshot or journal is moved aside to
        ``<path>[.journal].corrupt-<unix seconds>`` (the ledger starts empty), a torn last journal line is
        dropped with a warning, a journal of another generation is stale. Writes nothing.
        """
        if self.path is None or not self.path.exists():
            return None, []
        warnings: list[str] = []
        try:
            doc = json.loads(self.path.read_text())
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format (version {doc.get('version') if isinstance(doc, dict) else None!r})")
            records = doc["tenancies"]
            if not isinstance(records, list):
                raise ValueError("tenancies is not a list")
            entries = {Tenancy.from_dict(r): None for r in records}
            generation = doc.get("generation")
            if isinstance(generation, str) and generation:
                entries, torn, replayed = self._replay(entries, generation)
                self._replayed = replayed or bool(torn)
                if torn:
                    warnings.append(f"ledger journal {self.journal_path}: {torn}; dropped")
            for t in entries:
                if not 1 <= t.request_mib <= t.limit_mib or t.held_mib < 0:
                    raise ValueError(f"record {t.namespace}/{t.pod_name}/{t.container} has request {t.request_mib} MiB, "
                                     f"limit {t.limit_mib} MiB and held {t.held_mib} MiB "
                                     "(need 1 <= request <= limit, held >= 0)")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            what = "journal" if isinstance(exc, _Corrupt) else "file"
            if self._read_only:
                return None, [f"ledger {what} {self.path} is unreadable ({exc}); ignored"]
            stamp = int(time.time())
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            os.replace(self.path, aside)
            assert self.journal_path is not None
            if self.journal_path.exists():
                os.replace(self.journal_path, self.journal_path.with_name(f"{self.journal_path.name}.corrupt-{stamp}"))
            msg = f"ledger {what} {self.path} is corrupt ({exc}); moved aside to {aside}, starting empty"
            log.error(msg)
            return None, [msg]
        self._close_journal()  # the next change compacts: a new generation
        return list(entries), warnings

    def _replay(self, entries: dict[Tenancy, None], generation: str) -> tuple[dict[Tenancy, None], str, bool]:
        """Apply the journal of ``generation`` to the snapshot's ``entries``.
        Returns the entries, why a torn tail was dropped ('' when none) and
        whether any change was replayed.
        Raises _Corrupt for a bad record that is not the last line."""
        assert self.journal_path is not None
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            return entries, "", False
        lines = raw.split(b"\n")
        # A complete file ends with "\n": the last element is then b"".
        tail_cut = lines[-1] != b""
        lines = lines[:-1] if not tail_cut else lines
        if not lines:
            return entries, "", False
        try:
            header = json.loads(lines[0])
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("generation") != generation:
            return entries, "", False  # stale (or torn header): every change is in the snapshot
        torn = ""
        replayed = False
        order = dict(entries)
        for i, line in enumerate(lines[1:], start=1):
            last = i == len(lines) - 1
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("a journal record must be an object")
                removed = [Tenancy.from_dict(r) for r in rec.get("del", [])]
                added = [Tenancy.from_dict(r) for r in rec.get("add", [])]
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                if last:
                    torn = f"line {i + 1} is a torn (unfinished) change ({exc})"
                    break
                raise _Corrupt(f"journal line {i + 1}: {exc}") from None
            if last and tail_cut:
                torn = f"line {i + 1} is a torn (unfinished) change (no end of line)"
                break
            for t in removed:
                order.pop(t, None)
            for t in added:
                order[t] = None
            replayed = True
        return order, torn, replayed

    def close(self, live: Collection[Tenancy]) -> None:
        """Compact the journal into the snapshot (a clean stop leaves one
        file) and close it. Errors are logged, never raised: every change is
        already durable in the journal."""
        if not self._read_only and ((self._journal_fd is not None and self._journal_records) or self._replayed):
            try:
                self.compact(live)
            except OSError as exc:
                log.warning("ledger: compaction at close failed: %s", exc)
        self._close_journal()

    def _close_journal(self) -> None:
        if self._journal_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._journal_fd)
        self._journal_fd = None
        self._journal_records = 0
        self._journal_size = 0

    def _fragment(self, t: Tenancy) -> str:
        frag = self._fragments.get(t)
        if frag is None:
            frag = self._fragments[t] = encode_tenancy(t)
        return frag

    def persist(self, removed: Sequence[Tenancy], added: Sequence[Tenancy], live: Collection[Tenancy]) -> None:
        """Make one change durable: one journal line appended and fsynced
        (O(size of the change)); the first change after a load, and every
        ``max(compact_min, 2 x tenancies)`` changes, compact instead
        (``live``: the entries with the change applied). Raises OSError with
        nothing of the change left in the journal."""
        if self.path is None or self._read_only:
            return
        if self._journal_fd is None:
            self.compact(live)
            return
        line = ('{"del":[%s],"add":[%s]}\n' % (
            ",".join(map(self._fragment, removed)), ",".join(map(self._fragment, added)))).encode()
        fd = self._journal_fd
        try:
            view = memoryview(line)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fdatasync(fd)
        except OSError:
            # Cut what may have reached the file, so a rolled-back change is
            # not replayed; the next change compacts from memory either way.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._journal_size)
            self._close_journal()
            raise
        self._journal_size += len(line)
        self._journal_records += 1
        if self._journal_records > max(self.compact_min, 2 * len(live)):
            try:
                self.compact(live)
            except OSError as exc:  # the change is durable in the journal already
                log.warning("ledger: compaction failed (the journal keeps every change): %s", exc)
                self._close_journal()

    def compact(self, live: Collection[Tenancy]) -> None:
        """Write ``live`` as a new snapshot generation, then start an
        empty journal of that generation. Order (crash-safe at every step):
        snapshot temp, fsync, rename, fsync dir; journal temp (header line),
        fsync, rename, fsync dir. A crash between the two renames leaves the
        old journal, whose generation no longer matches: it is ignored, and
        the snapshot already holds all of its changes."""
        if self.path is None or self._read_only:
            return
        assert self.journal_path is not None
        self._close_journal()
        self._replayed = False
        if len(self._fragments) > 2 * len(live) + 64:
            self._fragments = {t: f for t, f in self._fragments.items() if t in live}
        generation = os.urandom(8).hex()
        # The document in compact JSON, one tenancy per line so the file stays
        # readable with `less`.
        data = ('{"node":%s,"version":%d,"generation":"%s","tenancies":[\n%s\n]}\n' % (
            json.dumps(self._node_name), FORMAT_VERSION, generation,
            ",\n".join(self._fragment(t) for t in live))).encode()
        directory = self.path.parent
        if not self._dir_ready:
            directory.mkdir(parents=True, exist_ok=True)
            self._dir_ready = True
        write_atomically(self.path, data, mode=0o600)
        # From here the state is durable in the snapshot: a failure to start
        # the journal must not undo the change (the old journal, if any, is
        # of another generation: stale). The next change compacts again.
        header = ('{"journal":%d,"generation":"%s"}\n' % (FORMAT_VERSION, generation)).encode()
        try:
            write_atomically(self.journal_path, header, mode=0o600)
            fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("ledger: snapshot written, journal not started (the next change writes a snapshot again): %s",
                        exc)
            return
        self._journal_fd = fd
        self._journal_size = len(header)
        self._journal_records = 0


TMPFS_MAGIC = 0x01021994
"""``f_type`` of tmpfs in statfs(2) (linux/magic.h TMPFS_MAGIC); ramfs is 0x858458f6."""
RAMFS_MAGIC = 0x858458F6


def filesystem_type(path: str | os.PathLike[str]) -> int | None:
    """The ``f_type`` that statfs(2) reports for ``path`` (None when the call
    fails or is not available). Python's os.statvfs has no f_type, so this
    calls libc's statfs through ctypes (struct statfs: f_type is the first
    field, a ``long`` on Linux: man 2 statfs)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64 and arm64
        if libc.statfs(os.fsencode(os.fspath(path)), buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value
    except (OSError, AttributeError, ValueError):
        return None


def state_dir_warning(state_dir: str | os.PathLike[str]) -> str:
    """A warning for the operator when ``state_dir`` is not on tmpfs (or
    ramfs), '' otherwise (or when the type cannot be told). On a disk, each
    ledger change waits for an fsync of the journal: bench_nri measured a
    64-queued CreateContainer p99 of 1.37 s with the state on a disk before
    the journal (issue 14), against containerd's 2 s NRI budget."""
    probe = Path(state_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    ftype = filesystem_type(probe)
    if ftype is None or ftype in (TMPFS_MAGIC, RAMFS_MAGIC):
        return ""
    return (f"--state-dir {state_dir} is not on tmpfs (statfs f_type 0x{ftype:x}, tmpfs is 0x{TMPFS_MAGIC:08x}): "
            f"every ledger change waits for a disk fsync inside the runtime's CreateContainer budget; "
            f"use a tmpfs such as /run/fracplugin/state")


def remove_crash_leftovers(path: str | os.PathLike[str]) -> list[str]:
    """Remove what crashes leave next to the ledger file ``path`` (issue 13
    item 5), and return one message per action for the log:

    - ``.<name>.*``: temporary files of an atomic write (``LedgerStore.compact``:
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
