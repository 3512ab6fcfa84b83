#!/usr/bin/env python3
"""The ledger's snapshot + journal (ADR 0010) against a prototype store on
stdlib ``sqlite3`` in WAL mode (issue 26, ADR 0029). Merges ``ledger.*`` keys
into build/bench.json (benchjson.merge).

Variants, all the real ``Ledger`` (same guards, same in-memory indexes):

- ``journal``: the product, ``ledgerstore.LedgerStore`` (journal line
  appended and ``fdatasync``ed before a change is acknowledged);
- ``sqlite_full``: ``SqliteStore`` below (the ledger's ``_store``), WAL, ``synchronous=FULL`` (the WAL
  is fsynced at every commit: the same promise as ours, on a power loss too);
- ``sqlite_normal``: the same with ``synchronous=NORMAL`` (WAL not fsynced at
  commit: survives a process crash, not an OS crash or power loss on a disk);
- ``memory``: ``Ledger(node, None)``, no store: what the guards and indexes
  cost, so the store's share can be read off.

Measured, per variant (state directory on tmpfs, /dev/shm, as production's
/run/fracplugin/state; ``--dir`` for another):

- ``ledger.<v>.put_us_<n>`` / ``ledger.<v>.remove_us_<n>``: one admission
  (``Ledger.admit`` of a new pod's plan) / one release
  (``release_container_id``) with n-1 other tenancies recorded, n in 1, 768
  (16 H100 x 48 MPS clients), 10000; median over rounds of the mean per
  call. ``..._mean_us_<n>``: the plain mean over every call (includes the
  journal's amortised compactions).
- ``ledger.<v>.growth_1_to_10000``: put+remove at 10k over put+remove at 1
  (flat cost is 1.0). Rounds rotate over every (size, variant) pair.
- ``ledger.journal.compact_ms_<n>`` / ``compact_amortised_us_<n>``: one
  compaction of the journal variant, and that spread over the
  ``max(1024, 2 x n)`` changes between two compactions.
- ``ledger.<v>.rss_mib_10000``: resident memory (VmRSS) a fresh process gains
  from building a 10k-tenancy ledger through the store and running 2,000
  changes, imports of the store's own modules (``sqlite3``) included.
- ``ledger.<v>.file_kib_10000``: bytes on disk at that point (snapshot +
  journal; database + ``-wal`` + ``-shm``); ``ledger.<v>.wal_kib_10000`` the
  ``-wal`` file alone (SQLite reuses it without shrinking it).
- ``ledger.<v>.kill9_rounds`` / ``..._lost`` / ``..._bad``: a child process
  changes the ledger in a loop (admit a new pod or release one, at random),
  writing ``+``/``-`` and the key before each change and ``ok`` once it
  returned; it is SIGKILLed at a random point 0-60 ms after it is ready.
  The parent then reopens the store and checks: every acknowledged change is
  there, the one change in flight is either wholly there or not at all,
  nothing else differs, ``check_invariants()`` is empty and the load reports
  no corruption (a torn journal tail dropped is expected and not counted).
  ``lost``: rounds where an acknowledged change was missing; ``bad``: rounds
  with anything else wrong. The next round's child continues on what the
  previous one left. Compaction runs every 8 changes here (``checkpoint``
  every 4 WAL pages for SQLite) so kills land inside it too.

Usage: python tests/bench/bench_ledger_store.py [--rounds R] [--calls N]
[--kills K] [--dir D] [--no-report]. No assertions on the figures (targets
are read by people: ADR 0029); exits 1 when a kill -9 round lost or broke
something.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Collection, Sequence

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fracplugin.gpu.simulated import load_node  # noqa: E402
from fracplugin.ledger import Ledger  # noqa: E402
from fracplugin.ledgerstore import encode_tenancy  # noqa: E402
from fracplugin.model import ComputeMode, NodeInfo, PodRef, Tenancy  # noqa: E402
from tests.helpers import plan_container  # noqa: E402

TMPFS = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
GPUS = 256  # 256 x 48 = 12,288 MPS clients: room for 10k tenancies
SIZES = (1, 768, 10000)
VARIANTS = ("memory", "journal", "sqlite_full", "sqlite_normal")
STORES = ("journal", "sqlite_full", "sqlite_normal")


class SqliteStore:
    """The prototype: the ledger's store (``ledgerstore.LedgerStore``'s
    narrow API: ``load``, ``persist``, ``compact``, ``close``) on one SQLite
    table in WAL mode. One row per tenancy (its ledger record,
    ``encode_tenancy``), in insertion order (``id``); a change is one
    transaction (``BEGIN IMMEDIATE``, the deletes, the inserts, ``COMMIT``),
    committed before ``admit``/``release`` return, as the journal's append +
    fdatasync is. A whole new state (``replace_all``) is one transaction too.
    SQLite errors are raised as OSError (what ``Ledger`` rolls back on)."""

    def __init__(self, path: Path, synchronous: str = "FULL", autocheckpoint_pages: int = 1000) -> None:
        self.path: Path | None = path
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute(f"PRAGMA wal_autocheckpoint={autocheckpoint_pages}")
        self._db.execute("CREATE TABLE IF NOT EXISTS tenancy(id INTEGER PRIMARY KEY, rec TEXT NOT NULL UNIQUE)")

    def load(self) -> tuple[list[Tenancy] | None, list[str]]:
        rows = self._db.execute("SELECT rec FROM tenancy ORDER BY id").fetchall()
        return [Tenancy.from_dict(json.loads(r)) for (r,) in rows], []

    def _txn(self, removed: Sequence[Tenancy], added: Sequence[Tenancy], wipe: bool = False) -> None:
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                if wipe:
                    db.execute("DELETE FROM tenancy")
                else:
                    db.executemany("DELETE FROM tenancy WHERE rec=?", [(encode_tenancy(t),) for t in removed])
                db.executemany("INSERT INTO tenancy(rec) VALUES (?)", [(encode_tenancy(t),) for t in added])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise OSError(f"sqlite: {exc}") from exc

    def persist(self, removed: Sequence[Tenancy], added: Sequence[Tenancy], live: Collection[Tenancy]) -> None:
        self._txn(removed, added)

    def compact(self, live: Collection[Tenancy]) -> None:  # replace_all / transform: a whole new state
        self._txn((), list(live), wipe=True)

    def close(self, live: Collection[Tenancy]) -> None:
        self._db.close()


def node_n(gpus: int = GPUS) -> NodeInfo:
    base = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    g0 = base.gpus[0]
    return dataclasses.replace(base, name=f"bench-node-{gpus}", gpus=tuple(
        dataclasses.replace(g0, index=i, minor=i, uuid=f"GPU-00000000-0000-4000-8000-{i:012d}") for i in range(gpus)))


def open_ledger(variant: str, node: NodeInfo, d: Path, compact_min_records: int = 0, **kw: Any) -> Ledger:
    if variant == "memory":
        return Ledger(node, None, **kw)
    if variant == "journal":
        ledger = Ledger(node, d / "ledger.json", **kw)
        if compact_min_records:
            ledger._store.compact_min = compact_min_records  # noqa: SLF001
        return ledger
    sync = "FULL" if variant == "sqlite_full" else "NORMAL"
    pages = kw.pop("autocheckpoint_pages", 1000)
    ledger = Ledger(node, None, **kw)
    ledger._store = SqliteStore(d / "ledger.db", synchronous=sync, autocheckpoint_pages=pages)  # type: ignore[assignment]  # noqa: SLF001
    return ledger


def tenancy(i: int, gpu: int) -> Tenancy:
    return Tenancy(pod_uid=f"fill-{i}", namespace="fill", pod_name=f"fill-{i}", container="app",
                   gpu_uuid=f"GPU-00000000-0000-4000-8000-{gpu:012d}", request_mib=1024, limit_mib=1024,
                   mode=ComputeMode.TIME_SLICING, container_id=f"fill-{i}")


def fill(ledger: Ledger, n: int) -> None:
    """n tenancies spread over GPUs 0..254 (GPU 255 kept for the measured
    admissions), recorded as one whole state (``replace_all``)."""
    ledger.replace_all(tenancy(i, i % (GPUS - 1)) for i in range(n))
    assert len(ledger.tenancies()) == n


def annotations(gpu: int) -> dict[str, str]:
    p = "nvidia.com/container.app."
    return {p + "gpu-memory.request": "1Gi", p + "gpu-compute.mode": "time-slicing", p + "gpus.devices": str(gpu)}


def run_round(ledger: Ledger, node: NodeInfo, calls: int, seq: list[int]) -> tuple[list[float], list[float]]:
    """Seconds of each admit and each release over ``calls`` new pods on
    the last GPU (planning untimed)."""
    puts, removes = [], []
    for _ in range(calls):
        seq[0] += 1
        k = seq[0]
        plan = plan_container(annotations(GPUS - 1), "app", PodRef("bench", f"m-{k}", f"m-{k}"), node, ledger)
        assert plan is not None
        t0 = time.perf_counter()
        ledger.admit(plan, container_id=f"c-{k}")
        t1 = time.perf_counter()
        gone = ledger.release_container_id(f"c-{k}")
        t2 = time.perf_counter()
        assert gone, k
        puts.append(t1 - t0)
        removes.append(t2 - t1)
    return puts, removes


def timing(node: NodeInfo, base: Path, rounds: int, calls: int) -> dict[str, float]:
    """Every (size, variant) ledger open at once; each round runs ``calls``
    changes on each of them in a rotated order, so machine noise (a shared
    2-core host) hits every size and variant alike."""
    out: dict[str, float] = {}
    ledgers: dict[tuple[int, str], Ledger] = {}
    for n in SIZES:
        for v in VARIANTS:
            d = base / f"t-{v}-{n}"
            d.mkdir()
            ledgers[n, v] = open_ledger(v, node, d)
            fill(ledgers[n, v], n - 1)
    seq = [0]
    keys = list(ledgers)
    for key in keys:  # warm-up (and the journal's first compaction)
        run_round(ledgers[key], node, 20, seq)
    means: dict[tuple[int, str], tuple[list[float], list[float]]] = {k: ([], []) for k in keys}
    every: dict[tuple[int, str], tuple[list[float], list[float]]] = {k: ([], []) for k in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            puts, removes = run_round(ledgers[key], node, calls, seq)
            means[key][0].append(statistics.fmean(puts))
            means[key][1].append(statistics.fmean(removes))
            every[key][0].extend(puts)
            every[key][1].extend(removes)
    for (n, v), (puts, removes) in means.items():
        out[f"ledger.{v}.put_us_{n}"] = statistics.median(puts) * 1e6
        out[f"ledger.{v}.remove_us_{n}"] = statistics.median(removes) * 1e6
        out[f"ledger.{v}.put_mean_us_{n}"] = statistics.fmean(every[n, v][0]) * 1e6
        out[f"ledger.{v}.remove_mean_us_{n}"] = statistics.fmean(every[n, v][1]) * 1e6
        out[f"ledger.{v}.put_max_us_{n}"] = max(every[n, v][0]) * 1e6
    for n in SIZES:
        # The journal's compaction (a whole snapshot + a fresh journal), which
        # runs once every max(1024, 2 x tenancies) changes: its cost spread
        # over those changes is what the medians above do not show.
        j = ledgers[n, "journal"]
        reps = []
        for _ in range(5):
            t0 = time.perf_counter()
            j._store.compact(j._index.entries)  # noqa: SLF001 (the bench measures the store's own step)
            reps.append(time.perf_counter() - t0)
        out[f"ledger.journal.compact_ms_{n}"] = statistics.median(reps) * 1e3
        out[f"ledger.journal.compact_amortised_us_{n}"] = statistics.median(reps) * 1e6 / max(1024, 2 * n)
    for led in ledgers.values():
        led.close()
    for v in VARIANTS:
        out[f"ledger.{v}.growth_1_to_10000"] = (
            (out[f"ledger.{v}.put_us_10000"] + out[f"ledger.{v}.remove_us_10000"])
            / (out[f"ledger.{v}.put_us_1"] + out[f"ledger.{v}.remove_us_1"]))
    return out


# ---- resident memory and file size (one fresh process per variant) ---------

def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def child_footprint(variant: str, d: Path, n: int) -> None:
    """Child: VmRSS before and after building an n-tenancy ledger through
    the store and 2,000 changes (this module has imported ``sqlite3``
    already: ``footprint`` adds that apart); prints JSON."""
    node = node_n()
    before = _rss_kib()
    ledger = open_ledger(variant, node, d)
    fill(ledger, n)
    run_round(ledger, node, 1000, [0])
    after = _rss_kib()
    size = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
    wal = sum(p.stat().st_size for p in d.iterdir() if p.name.endswith("-wal"))
    ledger.close()
    print(json.dumps({"rss_kib": after - before, "bytes": size, "wal": wal}))


def footprint(base: Path, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for v in VARIANTS:
        d = base / f"f-{v}"
        d.mkdir()
        # This module imports sqlite3 for every variant, so the import's share
        # is measured apart (sqlite_import_rss_mib) and added to the SQLite variants.
        r = subprocess.run([sys.executable, __file__, "--child-footprint", v, str(d), str(n)],
                           capture_output=True, text=True, check=True)
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        out[f"ledger.{v}.rss_mib_{n}"] = doc["rss_kib"] / 1024
        if v != "memory":
            out[f"ledger.{v}.file_kib_{n}"] = doc["bytes"] / 1024
        if v.startswith("sqlite"):
            out[f"ledger.{v}.wal_kib_{n}"] = doc["wal"] / 1024
    code = ("f=lambda:int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]);"
            "a=f();import sqlite3;print(f()-a)")
    imp = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    out["ledger.sqlite_import_rss_mib"] = imp / 1024
    for v in ("sqlite_full", "sqlite_normal"):
        out[f"ledger.{v}.rss_mib_{n}"] += imp / 1024
    return out


# ---- kill -9 ----------------------------------------------------------------

def child_writer(variant: str, d: Path, seed: int) -> None:
    """Child: open the store, print ``ready``, then change it in a loop
    forever: ``+ key`` / ``- key`` before each change, ``ok`` after it."""
    node = node_n(4)
    ledger = open_ledger(variant, node, d, compact_min_records=8, **(
        {"autocheckpoint_pages": 4} if variant.startswith("sqlite") else {}))
    warnings = ledger.load()
    out = sys.stdout
    out.write("ready %s\n" % json.dumps(warnings))
    out.flush()
    rng = random.Random(seed)
    k = 0
    while True:
        held = [t.pod_uid for t in ledger.tenancies()]
        if held and (len(held) >= 40 or rng.random() < 0.4):
            uid = rng.choice(held)
            out.write(f"- {uid}\n")
            out.flush()
            ledger.release(uid, "app")
        else:
            k += 1
            uid = f"p{seed}-{k}"
            plan = plan_container(annotations(k % 4), "app", PodRef("kill", uid, uid), node, ledger)
            assert plan is not None
            out.write(f"+ {uid}\n")
            out.flush()
            ledger.admit(plan, container_id=f"c-{uid}")
        out.write("ok\n")
        out.flush()


def kill_rounds(variant: str, base: Path, kills: int, seed: int) -> dict[str, float]:
    d = base / f"k-{variant}"
    d.mkdir()
    node = node_n(4)
    rng = random.Random(seed)
    expected: set[str] = set()
    lost = bad = acked_total = inflight_kills = inflight_applied = torn = 0
    for r in range(kills):
        proc = subprocess.Popen([sys.executable, __file__, "--child-writer", variant, str(d), str(seed * 1000 + r)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        if not first.startswith("ready"):
            raise SystemExit(f"kill -9 {variant}: child did not start: {first!r}")
        time.sleep(rng.uniform(0.0, 0.060))  # the random point of the kill (the thing measured: not a synchronisation)
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()
        proc.wait()
        inflight: tuple[str, str] | None = None
        for line in rest.splitlines():
            if line == "ok":
                assert inflight is not None
                op, uid = inflight
                (expected.add if op == "+" else expected.discard)(uid)
                acked_total += 1
                inflight = None
            elif line[:2] in ("+ ", "- "):
                inflight = (line[0], line[2:])
        reopened = open_ledger(variant, node, d, compact_min_records=8)
        warnings = reopened.load()
        torn += sum("torn" in w for w in warnings)
        have = {t.pod_uid for t in reopened.tenancies()}
        problems = [w for w in warnings if "torn" not in w] + reopened.check_invariants()
        if variant.startswith("sqlite"):
            check = reopened._store._db.execute("PRAGMA integrity_check").fetchone()[0]  # type: ignore[attr-defined]
            if check != "ok":
                problems.append(f"integrity_check: {check}")
        # Close without writing: the next child must find what the kill left.
        store = reopened._store  # noqa: SLF001
        if isinstance(store, SqliteStore):
            store._db.close()
        else:
            store._close_journal()
        allowed = [expected]
        if inflight is not None:
            inflight_kills += 1
            op, uid = inflight
            allowed.append(expected | {uid} if op == "+" else expected - {uid})
        if have not in allowed:
            if expected - have - ({inflight[1]} if inflight and inflight[0] == "-" else set()):
                lost += 1
            else:
                bad += 1
            print(f"kill -9 {variant} round {r}: have {sorted(have)} expected {sorted(expected)} in flight {inflight}",
                  file=sys.stderr)
        elif problems:
            bad += 1
            print(f"kill -9 {variant} round {r}: {problems}", file=sys.stderr)
        if inflight is not None and have != expected:
            inflight_applied += 1
        expected = have
    return {f"ledger.{variant}.kill9_rounds": kills, f"ledger.{variant}.kill9_lost": lost,
            f"ledger.{variant}.kill9_bad": bad, f"ledger.{variant}.kill9_acked_changes": acked_total,
            f"ledger.{variant}.kill9_in_flight": inflight_kills,
            f"ledger.{variant}.kill9_in_flight_applied": inflight_applied,
            f"ledger.{variant}.kill9_torn_tails": torn}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child-footprint"]:
        child_footprint(argv[1], Path(argv[2]), int(argv[3]))
        return 0
    if argv[:1] == ["--child-writer"]:
        child_writer(argv[1], Path(argv[2]), int(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--dir", default=TMPFS, help="where the stores live (default: tmpfs)")
    ap.add_argument("--no-report", action="store_true", help="print, do not merge into build/bench.json")
    ap.add_argument("--prefix", default="ledger", help="key prefix (e.g. ledger.disk for a --dir on a disk)")
    ap.add_argument("--timing-only", action="store_true", help="per-operation costs only")
    a = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="fpls", dir=a.dir))
    values: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        values.update(timing(node_n(), base, a.rounds, a.calls))
        print(f"timing {time.monotonic() - t0:.0f}s", file=sys.stderr)
        if a.timing_only:
            return _report(values, a)
        values.update(footprint(base, 10000))
        for i, v in enumerate(STORES):
            t0 = time.monotonic()
            values.update(kill_rounds(v, base, a.kills, seed=7 + i))
            print(f"kill -9 {v} {time.monotonic() - t0:.0f}s", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    failed = sum(values[f"ledger.{v}.kill9_lost"] + values[f"ledger.{v}.kill9_bad"] for v in STORES)
    return _report(values, a) or (1 if failed else 0)


def _report(values: dict[str, float], a: argparse.Namespace) -> int:
    if a.prefix != "ledger":
        values = {a.prefix + k.removeprefix("ledger"): v for k, v in values.items()}
    print(json.dumps(values, indent=2, sort_keys=True))
    if not a.no_report:
        import benchjson

        benchjson.merge(values)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
