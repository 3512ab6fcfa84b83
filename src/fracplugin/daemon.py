"""``fracplugin run``'s daemon (entered from ``runcmd.main``): build every part (``builders.Builder``), start
them, serve, stop them in order. ``Daemon`` keeps the lifecycle and the read side (``checks``, ``status``).

Start order: ``builders.Builder.build``'s steps (each part switchable); the bound addresses are logged and
written to ``<state-dir>/endpoints.json``. Stop order (SIGTERM/SIGINT): ``Daemon.stop``, within
``--shutdown-timeout`` seconds in all; nothing is released from the ledger (containers keep running, the next
start reads the same tenancy back). SIGHUP re-reads the configuration and hands it to every part
(``parts.Part.reload``, ADR 0014: ``config.RELOADABLE`` applied, the rest reported as needing a restart).

Concurrency model: the main thread owns the lifecycle: it starts the parts,
then sleeps on an event that the signal handlers set (handlers only set
flags; the work happens on the main thread). Each part runs its own threads
(stated in its module). Stops run on short-lived helper threads so that one
stuck part cannot eat the whole shutdown budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from functools import partial
from typing import Any, Callable, Mapping, TypeVar

from . import __version__
from .atomicfile import write_atomically
from . import config as configmod
from .config import Config, ConfigError
from .parts import LogsPart, Part, Readiness
from .parts import bounded as _bounded
from .builders import POD_SOURCE_MISSING, Builder, Hooks, StartupError
from .enforce.memlimits import what_holds
from .gpu.health import CORDONED

log = logging.getLogger("fracplugin.daemon")


# ---- helpers -----------------------------------------------------------------
def _write_json_atomic(path: str, doc: Any) -> None:
    write_atomically(path, json.dumps(doc, indent=1) + "\n", mode=0o600, make_parents=True)


_T = TypeVar("_T")

# Stop order of the parts before MPS, with each one's share of what is left
# (``left / weight``; the node condition is capped at 2 s): KAI stops placing
# pods here before the doors close, the doors close before their helpers.
_STOP_FIRST: tuple[tuple[str, int], ...] = (("node condition", 5), ("device plugin", 4), ("dra", 4), ("nri", 3),
                                           ("events", 3), ("pod source", 3), ("cordon", 1), ("metrics", 1))


# ---- the daemon ----------------------------------------------------------------
class Daemon:
    """All parts of the node daemon, with their lifecycle.

    Args:
        cfg: the effective configuration.
        sources: where each non-default setting came from (for the start log).
        reload: returns a freshly loaded (Config, sources) for SIGHUP; None
            disables reloading.

    ``self.parts`` holds the parts (``parts.Part``) by name in start order; ``self.built``
    (``builders.Builder``) builds them at ``start()`` and holds what it built (node, ledger, doors, rules, ...).
    ``start()`` raises StartupError (after stopping what had started); ``stop()`` is idempotent and bounded
    by ``cfg.shutdown_timeout_s``.
    """

    def __init__(self, cfg: Config, sources: Mapping[str, str] | None = None,
                 reload: Callable[[], tuple[Config, dict[str, str]]] | None = None) -> None:
        if cfg.role == "mps":  # the MPS role runs no door (ADR 0009)
            cfg = dataclasses.replace(cfg, no_nri=True, no_device_plugin=True, dra=False)
        self.cfg = cfg
        self.sources = dict(sources or {})
        self._reload = reload
        self.started_at = time.time()
        self.parts: dict[str, Part] = {"logs": LogsPart(cfg)}
        self.built = Builder(cfg, self.parts, Hooks(checks=self.checks, status=self.status, alive=self.alive,
                                                    metric_state=self.metric_state, request_stop=self.request_stop))
        self.startup_ms: float | None = None
        self._stopping = threading.Event()
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.pending_signals: list[int] = []
        # Signal handlers must take no lock: one that runs while the main thread
        # holds the lock it wants (a threading.Event's, between two signals of
        # the same killpg) deadlocks the process. They append to
        # ``pending_signals`` (atomic) and write a byte here; the main thread
        # blocks reading it (PEP 475: the read resumes after each handler).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def start(self) -> None:
        """Build and start every enabled part, in order. Raises StartupError
        (having stopped whatever already started)."""
        t0 = time.monotonic()
        log.info("fracplugin %s starting", __version__, extra={
            "config": self.cfg.to_dict(), "sources": self.sources, "pid": os.getpid()})
        try:
            self.built.build()
        except StartupError:
            self.stop()
            raise
        self.startup_ms = round((time.monotonic() - t0) * 1000, 1)
        endpoints = self.built.endpoints
        doc = {**endpoints, "pid": os.getpid(), "node": self.built.node_name, "started_at": self.started_at,
               "startup_ms": self.startup_ms}
        _write_json_atomic(self.cfg.endpoints_path, doc)
        log.info("fracplugin started", extra={"endpoints": endpoints, "startup_ms": self.startup_ms,
                                               "endpoints_file": self.cfg.endpoints_path})

    # ---- state -------------------------------------------------------------
    def alive(self) -> str | None:
        """None while the daemon is live (``/healthz`` 200), else why not: it is
        shutting down, or the NRI stub's run thread ended on its own (it
        reconnects forever in external mode, so that is a bug worth a restart)."""
        if self._stopping.is_set():
            return "shutting down"
        if self.built.nri is not None and self.built.nri.stub.exited:  # its run thread ended on its own
            return "the NRI plugin stub stopped"
        return None

    @staticmethod
    def _read(part: Part, what: str, fn: Callable[[], _T], default: _T) -> _T:
        """``fn()`` (``what`` of ``part``: its readiness or status); an exception
        is logged and gives ``default`` (a broken part must not break ``/status``)."""
        try:
            return fn()
        except Exception:
            log.exception("%s of part %s failed", what, part.name)
            return default

    def checks(self) -> dict[str, dict[str, Any]]:
        """Readiness of each enabled part: {part: {"ready": bool, "detail": str}}
        (``Part.readiness`` of the parts whose ``check`` is set)."""
        out: dict[str, dict[str, Any]] = {}
        for name, check, enabled in (("nri", "nri", not self.cfg.no_nri),
                                     ("device plugin", "device_plugin", not self.cfg.no_device_plugin),
                                     ("mps", "mps", not self.cfg.no_mps),
                                     ("dra", "dra", self.cfg.dra),
                                     ("memory limits", "memory_limits", False)):
            part = self.parts.get(name)
            if part is not None:
                r = self._read(part, "readiness", part.readiness, Readiness(False, f"{name} readiness unavailable"))
                out[check] = {"ready": r.ok, "detail": r.reason}
            elif enabled:
                out[check] = {"ready": False, "detail": "not started"}
        pods, rules = self.built.pod_source, self.built.rules
        if "nri" in out and (pods is None or not pods.ready()):  # said, not gated on (issue 25 item 1)
            why = "no API access" if pods is None else "pod watch not synced"
            out["nri"]["detail"] = f"{out['nri']['detail']}; {why}: {POD_SOURCE_MISSING}"
        if rules is not None and (excluded := rules.excluded()):
            out["gpus"] = {"ready": True, "detail": excluded}  # the rest of the node serves (issue 33)
        if self._stopping.is_set():
            out["daemon"] = {"ready": False, "detail": "shutting down"}
        return out

    def _gpu_healthy(self) -> dict[str, tuple[bool, list[str]]]:
        """Per GPU UUID (healthy, reasons) from the node's health monitor (XID
        marks, the MPS daemon of its tenants' mode), whichever doors are on;
        (True, []) before the monitor is built, {} before the ledger."""
        node, rules = self.built.node, self.built.rules
        if node is None or self.built.ledger is None:
            return {}
        if rules is None or rules.health is None:
            return {g.uuid: (True, []) for g in node.gpus}
        return {g.uuid: (h.healthy, list(h.reasons)) for g in node.gpus for h in [rules.health.health(g.uuid)]}

    def metric_state(self) -> dict[str, Any]:
        """What ``Metrics.attach_state`` exports at scrape time: NRI connected /
        synchronized / unadjusted containers / unfenced counts (None when the door is off or not
        started), device plugin registered (likewise), and per GPU whether the
        device plugin reports it Healthy (critical XID or its mode's MPS daemon
        down; without the device plugin door: its mode's MPS daemon). A cordon
        (``cordon.py``) is an operator's choice, not a fault: not in it."""
        nri, door = None, self.built.nri
        if door is not None:
            nri = {"connected": door.stub.connected(), "synchronized": door.stub.ready(),
                   "unadjusted": len(door.plugin.status().get("unadjusted") or ()),
                   "unfenced": door.plugin.reconciler.unfenced_status()}
        dp = self.parts.get("device plugin")
        return {"nri": nri, "device_plugin": None if dp is None else {"registered": dp.readiness().ok},
                "gpu_healthy": {u: not [x for x in r if x != CORDONED] for u, (_h, r) in self._gpu_healthy().items()}}

    def _status_of(self, name: str) -> dict[str, Any] | None:
        part = self.parts.get(name)
        empty: dict[str, Any] = {}
        return None if part is None else self._read(part, "status", part.status, empty)

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (see status.py for the rendering)."""
        checks = self.checks()
        gpus = []
        health = self._gpu_healthy()
        b = self.built
        ml, mps_on = b.memory_limits, not self.cfg.no_mps
        if b.node is not None and b.ledger is not None:
            for g in b.node.gpus:
                tenants = b.ledger.tenants(g.uuid)
                held = sum(t.charged_mib for t in tenants)
                mode = tenants[0].mode if tenants else None
                healthy, reasons = health.get(g.uuid, (True, []))
                gpus.append({
                    "index": g.index, "uuid": g.uuid, "name": g.name, "memory_mib": g.memory_mib,
                    "held_mib": held, "free_mib": g.memory_mib - held, "mode": mode.value if mode else None,
                    "healthy": healthy, "unhealthy_reasons": reasons,
                    # what holds each tenant's total on this GPU (issue 35): the one rule, what_holds
                    "tenants": [{**t.to_dict(), "holds": what_holds(
                        ml is not None and ml.enforcer.enforced_on(t.container_id, g.uuid), mps_on)}
                        for t in tenants],
                })
        events = self._status_of("events")
        if events is None and b.events is not None:
            events = {"enabled": False, **b.events.stats()}
        mps = self._status_of("mps")
        if mps is None:
            mps = b.mps.status() if b.mps is not None else {"enabled": False, "daemons": []}
        return {
            "node": b.node_name,
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "ready": all(c["ready"] for c in checks.values()),
            "checks": checks,
            "doors": {"nri": not self.cfg.no_nri, "device_plugin": not self.cfg.no_device_plugin,
                      "mps": not self.cfg.no_mps, **({"dra": True} if self.cfg.dra else {})},
            "fail_open": self.cfg.fail_open,
            "gpus": gpus,
            "mps": mps,
            "device_plugin": self._status_of("device plugin"),
            "nri": self._status_of("nri"),
            "dra": self._status_of("dra"),
            "pod_source": self._status_of("pod source"),
            "events": events,
            "node_condition": self._status_of("node condition"),
            "cordon": self._status_of("cordon"),
            "memory_limits": self._status_of("memory limits"),
            "over_limit": b.over_limit.status() if b.over_limit is not None else None,
            "cdi": b.cdi.status() if b.cdi is not None else None,
            "endpoints": dict(b.endpoints),
            "ledger": {"path": self.cfg.ledger_path, "warnings": b.ledger_warnings},
            "config": self.cfg.to_dict(),
        }

    # ---- signals, reload ----------------------------------------------------
    def reload(self) -> dict[str, Any]:
        """Apply a SIGHUP: reload the configuration and hand it to every part
        (``Part.reload``): each applies the ``config.RELOADABLE`` settings it
        can change while running and reports the changed settings it reads
        that need a restart. Returns ``{"applied": {key: (old, new)},
        "needs_restart": [key, ...], "parts": {part: {"applied": [...],
        "needs_restart": [...]}}}`` (parts with nothing changed are left out),
        or ``{"error": ...}`` when the new configuration is invalid: nothing
        changes then. A setting that needs a restart keeps its old value."""
        if self._reload is None:
            return {"error": "reload not configured"}
        try:
            new, sources = self._reload()
        except ConfigError as exc:
            log.error("SIGHUP: configuration not reloaded: %s", exc)
            return {"error": str(exc)}
        except Exception as exc:  # the loader's own failure: the running configuration stays
            log.exception("SIGHUP: configuration not reloaded: the loader failed")
            return {"error": f"loading the configuration failed: {type(exc).__name__}: {exc}"}
        if new.role == "mps":
            new = dataclasses.replace(new, no_nri=True, no_device_plugin=True, dra=False)
        applied, ignored = configmod.reloadable_changes(self.cfg, new)
        per_part: dict[str, dict[str, Any]] = {}
        for name, part in list(self.parts.items()):
            try:
                r = part.reload(new)
            except Exception as exc:  # one part's failure neither stops the others nor the daemon
                log.exception("SIGHUP: part %s failed to reload; it keeps its configuration", name)
                per_part[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            if r.applied or r.needs_restart:
                per_part[name] = r.to_dict()
        kept = {k: getattr(self.cfg, k) for k in ignored}  # config fields by name, not a part
        self.cfg = dataclasses.replace(new, **kept)
        self.sources.update({k: v for k, v in sources.items() if k in applied})
        log.info("SIGHUP: configuration reloaded", extra={
            "applied": {k: {"old": a, "new": b} for k, (a, b) in applied.items()},
            "needs_restart": ignored, "reloadable": list(configmod.RELOADABLE), "parts": per_part})
        return {"applied": applied, "needs_restart": ignored, "parts": per_part}

    def wakeup(self) -> None:
        """Wake ``serve_forever`` (lock-free: safe in a signal handler and from any thread)."""
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the main thread has wake-ups queued already
            os.write(self._wake_w, b"\0")

    def request_stop(self, why: str) -> None:
        """Stop as at SIGTERM (from any thread; nothing once stopping): the NRI
        stub's fd-3 connection ended (``Builder``'s watch)."""
        if not self._stopping.is_set():
            log.info("%s: shutting down", why)
            self.pending_signals.append(signal.SIGTERM)
            self.wakeup()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT -> stop; SIGHUP -> reload (main thread only). The
        handler only records the signal and ``wakeup()``s: it takes no lock.

        The kernel may deliver a process signal to any thread; Python runs the
        handler in the main thread only when that thread next executes
        bytecode, and a main thread blocked in ``serve_forever``'s ``read``
        is not interrupted by a signal another thread received. So the wake
        pipe is also the interpreter's wakeup fd (``signal.set_wakeup_fd``):
        the C-level handler writes to it from whichever thread got the
        signal, the read returns, and the Python handler runs."""
        def handler(signum: int, _frame: Any) -> None:
            self.pending_signals.append(signum)
            self.wakeup()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def serve_forever(self) -> int:
        """Sleep until SIGTERM/SIGINT (handling SIGHUPs); returns the signal number.

        A stop signal wins over the SIGHUPs queued with it (they are dropped:
        a SIGHUP storm cannot hold the shutdown back), and the SIGHUPs queued
        together are one reload (a reload reads the configuration as it is
        when it runs, so N queued SIGHUPs are worth one). ``reload`` never
        raises (a failure is logged and answered as an error)."""
        while True:
            if not self.pending_signals:
                os.read(self._wake_r, 4096)
            stop = next((s for s in list(self.pending_signals) if s != signal.SIGHUP), None)
            hups = self.pending_signals.count(signal.SIGHUP)
            for _ in range(hups):  # remove() by value: a handler may append meanwhile
                self.pending_signals.remove(signal.SIGHUP)
            if stop is not None:
                self.pending_signals.remove(stop)
                log.info("received %s: shutting down", signal.Signals(stop).name,
                         extra={"reloads_dropped": hups})
                return stop
            if hups:
                self.reload()

    # ---- stopping ------------------------------------------------------------
    def stop(self) -> None:
        """Stop every part in order within ``shutdown_timeout_s`` (idempotent):
        ``_STOP_FIRST``, then the MPS API and MPS (the biggest share: it must
        quit its daemons), the inventory, the health server, the ledger."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._stopping.set()
        t0 = time.monotonic()
        deadline = t0 + self.cfg.shutdown_timeout_s
        mps = self.parts.get("mps")
        reserve_for_mps = min(self.cfg.shutdown_timeout_s * 0.4, 5.0) if mps is not None else 0.0

        def left(reserve: float = 0.0) -> float:
            return max(deadline - time.monotonic() - reserve, 0.05)

        first = [(self.parts[n], w) for n, w in _STOP_FIRST if n in self.parts]
        for i, (part, weight) in enumerate(first):
            budget = left(reserve_for_mps) / weight
            if part.name == "node condition":
                budget = min(budget, 2.0)
            _bounded(part.name, partial(part.stop, budget), left(reserve_for_mps) / max(len(first) - i, 1) + 0.5)
        api = self.parts.get("mps api")
        if api is not None:
            _bounded(api.name, lambda: api.stop(1.0), 2.0)
        if mps is not None and not _bounded(mps.name, lambda: mps.stop(left()), left() + 0.5) \
                and self.cfg.role == "all":
            self._kill_mps_leftovers()
        inventory = self.parts.get("inventory")
        if inventory is not None:
            _bounded(inventory.name, lambda: inventory.stop(1.0), 1.0)
        health = self.parts.get("health")
        if health is not None:
            health.stop(2.0)
        with contextlib.suppress(OSError):
            os.unlink(self.cfg.endpoints_path)
        ledger = self.parts.get("ledger")
        if ledger is not None:
            ledger.stop(1.0)  # journal folded into the snapshot: a clean stop leaves one file
        book = self.built.ledger
        problems = book.check_invariants() if book is not None else []
        log.info("fracplugin stopped", extra={
            "elapsed_ms": round((time.monotonic() - t0) * 1000, 1),
            "tenancies": len(book.tenancies()) if book is not None else 0,
            "ledger_consistent": not problems})

    def _kill_mps_leftovers(self) -> None:
        """Last resort when the MPS supervisor did not stop in time: SIGKILL the
        process group of every MPS control daemon it reported (each runs in its
        own session) and their servers, so that no MPS process outlives us."""
        try:
            assert self.built.mps is not None
            daemons = self.built.mps.status().get("daemons") or []
        except Exception:
            log.exception("MPS status unavailable; cannot kill leftover MPS processes")
            return
        for d in daemons:
            for pid in [d.get("pid"), *(d.get("server_pids") or [])]:
                if not pid:
                    continue
                for kill in (os.killpg, os.kill):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        kill(int(pid), signal.SIGKILL)
                log.error("MPS did not stop in time: killed pid %s", pid, extra={"mode": d.get("mode"), "pid": pid})


def serve(cfg: Config, sources: dict[str, str], reload: Callable[[], tuple[Config, dict[str, str]]]) -> int:
    """Run the daemon with ``cfg`` (``sources``: where each setting came
    from, ``config.load``; ``reload``: re-reads the settings at SIGHUP) until
    SIGTERM/SIGINT; ``fracplugin run`` calls it after the settings and
    logging are set up (``runcmd.main``). Returns 0 after an orderly stop, 1
    when a part cannot start."""
    daemon = Daemon(cfg, sources, reload=reload)
    daemon.install_signal_handlers()
    try:
        daemon.start()
    except StartupError as exc:
        log.error("fracplugin could not start: %s", exc)
        print(f"fracplugin run: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"event": "started", **daemon.built.endpoints, "pid": os.getpid()}), flush=True)
    daemon.serve_forever()
    daemon.stop()
    return 0
