"""``fracplugin status``: the running daemon's GPUs, tenants, MPS daemons and readiness.

Reads ``GET /status`` from the daemon's health endpoint (where: see
``resolve_address``) and prints a table, or the JSON document with
``--output json``.

Exit status: 0 the daemon answered and is ready; 1 it answered but is not
ready; 2 it could not be reached (one line on stderr, no traceback).

Concurrency: a one-shot client, single-threaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping

DEFAULT_ADDRESS = "127.0.0.1:8080"
DEFAULT_CONFIG = Path("/etc/fracplugin/config.yaml")  # the ConfigMap, as the DaemonSet mounts it
DEFAULT_STATE_DIR = Path("/run/fracplugin/state")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--health-address", metavar="HOST:PORT", default=None,
                   help=f"the daemon's health endpoint (env FRACPLUGIN_HEALTH_ADDRESS; default {DEFAULT_ADDRESS})")
    p.add_argument("--state-dir", metavar="DIR", default=None,
                   help="read the health endpoint from DIR/endpoints.json (what `run` wrote)")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="HTTP timeout")


def url_for(address: str, path: str = "/status") -> str:
    """``HOST:PORT`` -> ``http://HOST:PORT/status``; an empty or wildcard host
    means this machine (``127.0.0.1``)."""
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{port}{path}"


def fetch(address: str, path: str = "/status", timeout_s: float = 5.0) -> tuple[int, Any]:
    """GET ``path`` from the daemon; returns (http status, parsed JSON or text).

    Raises OSError (connection refused, timeout) with a readable message.
    """
    try:
        with urllib.request.urlopen(url_for(address, path), timeout=timeout_s) as resp:
            code, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        code, body = exc.code, exc.read()
    except urllib.error.URLError as exc:
        raise OSError(f"cannot reach the daemon at {url_for(address, path)}: {exc.reason}") from None
    text = body.decode(errors="replace")
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text


def _yn(b: Any) -> str:
    return "yes" if b else "no"


def render_gpus(doc: Mapping[str, Any]) -> str:
    """The GPU tenancy table of a status document (also used by the demo)."""
    rows = [("GPU", "UUID", "MODE", "HELD/TOTAL MiB", "TENANTS", "HEALTH")]
    tenant_lines: dict[int, list[str]] = {}
    ml = doc.get("memory_limits") if isinstance(doc.get("memory_limits"), dict) else {}
    enforced = {c.get("container_id"): c for c in (ml or {}).get("containers") or []}
    for g in doc.get("gpus", []):
        tenants = g.get("tenants", [])
        rows.append((str(g["index"]), g["uuid"], g.get("mode") or "-", f"{g['held_mib']}/{g['memory_mib']}",
                     str(len(tenants)), "healthy" if g.get("healthy", True) else
                     "CORDONED" if g.get("unhealthy_reasons") == ["cordoned"] else
                     "UNHEALTHY: " + ", ".join(g.get("unhealthy_reasons") or ["?"])))
        lines = []
        for t in tenants:
            atp = f"  ATP {t['active_thread_percentage']}%" if t.get("active_thread_percentage") else ""
            cid = f"  id {t['container_id'][:12]}" if t.get("container_id") else ""
            holder = (f"{t['namespace']}/{t['pod_name']}/{t['container']}" if t.get("pod_name") or t.get("pod_uid")
                      else "(holder not known yet)")
            door = t.get("door") or "nri"
            res = f"  reservation {t['reservation']}" if t.get("reservation") else ""
            c = enforced.get(t.get("container_id")) if t.get("container_id") else None
            enf = f"  ENFORCED {enforced_cell(c.get('enforced', 'unknown'), c.get('reason') or '')}" if c else ""
            holds = f"  HOLDS {t['holds']}" if t.get("holds") else ""  # cgroup | per-process | none (issue 35)
            held = f", held {t['held_mib']} MiB" if t.get("held_mib") else ""  # its pod's union hold (ADR 0033)
            lines.append(f"{holder}: request {t['request_mib']} MiB, "
                         f"limit {t['limit_mib']} MiB{held}, {t['mode']}{atp}{cid}  door {door}{res}{enf}{holds}")
        tenant_lines[len(rows) - 1] = lines
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        for line in tenant_lines.get(n, []):
            out.append("    - " + line)
    return "\n".join(out)


def _mib(v: Any) -> str:
    if v is None:
        return "-"
    return "max" if int(v) == 0xFFFFFFFFFFFFFFFF else str(int(v) >> 20)


def enforced_cell(enforced: str, reason: str) -> str:
    """The ENFORCED column: ``yes``, ``no (why)`` or ``unknown``."""
    return f"no ({reason})" if enforced == "no" and reason else enforced


def render_memory_limits(ml: Mapping[str, Any]) -> str:
    """The CUDA memory limits section of ``/status`` (issue 23): mode, the
    node's capability gate, and per container and GPU the planned and read
    soft/hard limits (MiB) with the ENFORCED column (yes / no (why) / unknown)."""
    out = [f"memory limits: {ml.get('mode')}, policy {ml.get('policy')}, cgroup root {ml.get('cgroup_root')}"]
    node = ml.get("node") or {}
    if node:
        out.append("  node can enforce: " + ("yes" if node.get("can_enforce") else f"no ({node.get('reason')})"))
        for c in node.get("capabilities") or []:
            state = {True: "yes", False: "NO", None: "unknown"}.get(c.get("ok"), "unknown")
            out.append(f"    {c.get('name', '?'):<18} {state:<8} {c.get('detail', '')}".rstrip())
    rows = [("CONTAINER", "GPU", "PLANNED SOFT/HARD MiB", "READ SOFT/HARD MiB", "USED MiB", "ENFORCED")]
    for c in ml.get("containers") or []:
        for g in c.get("gpus") or []:
            ok = {True: "yes", False: "no", None: "unknown"}.get(g.get("enforced"), "unknown")
            rows.append((f"{c.get('pod')}/{c.get('container')}", str(g.get("gpu")),
                         f"{_mib(g.get('planned_soft_bytes'))}/{_mib(g.get('planned_hard_bytes'))}",
                         f"{_mib(g.get('read_soft_bytes'))}/{_mib(g.get('read_hard_bytes'))}",
                         _mib(g.get("used_bytes")), enforced_cell(ok, g.get("reason") or c.get("reason") or "")))
    if len(rows) > 1:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            out.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1])
    return "\n".join(out)


def render_cdi(cdi: Mapping[str, Any]) -> str:
    """The ``cdi`` section of ``/status`` (``CdiRegistry.status``): the spec
    directories, each GPU's CDI device and memory-limit hook, the GPUs no spec
    lists (their containers get the env only) and the specs ignored."""
    out = [f"CDI specs in {','.join(cdi.get('spec_dirs') or []) or '-'}: {len(cdi.get('specs') or [])} read"]
    for d, why in (cdi.get("unreadable_dirs") or {}).items():
        out.append(f"  spec directory {d} {why}: no spec read from it")
    for uuid, d in (cdi.get("devices") or {}).items():
        hook = "memory-limit hook" if d.get("memory_limit_hook") else "NO memory-limit hook"
        out.append(f"  {uuid}  {d.get('name')}  {hook}")
    missing = cdi.get("gpus_without_spec") or []
    if missing:
        out.append(f"  GPUs without a CDI spec (env only, no CDI device): {', '.join(missing)}")
    for bad in cdi.get("invalid_specs") or []:
        out.append(f"  ignored spec {bad.get('path')}: {bad.get('reason')}")
    return "\n".join(out)


def render_mps(mps: Mapping[str, Any]) -> list[str]:
    """The MPS section of ``/status`` as lines: protocol, the MPS role, each daemon's health."""
    out: list[str] = []
    if not mps.get("enabled"):
        out.append("MPS: not supervised (--no-mps)")
    else:
        where = f" through the MPS role at {mps['remote']}" if mps.get("remote") else ""
        protocol = mps.get("protocol")
        proto = f" (protocol {protocol})" if protocol is not None else " (protocol unknown)"
        out.append(f"MPS daemons{proto}{where}, ready: {_yn(mps.get('ready'))}")
        if mps.get("reachable") is False:
            out.append(f"  MPS role: {mps.get('error')}")  # the error names the socket and why
        if mps.get("exposure"):
            out.append(f"  exposure: {mps['exposure']}")
        for d in mps.get("daemons", []):
            why = "reason" if d.get("reason") else "last_error"
            extra = "  ".join(f"{k} {d[k]}" for k in ("state", "pid", "restarts", "pipe_dir", why)
                              if d.get(k) not in (None, ""))
            if d.get("adopted"):
                extra += "  adopted"
            if d.get("repairing") or d.get("orphans"):  # ADR 0034
                extra += f"  repairing {len(d.get('repairing') or ())}  orphans {len(d.get('orphans') or ())}"
            out.append(f"  {d.get('mode', '?'):<13} {'healthy' if d.get('healthy') else 'UNHEALTHY':<9} {extra}".rstrip())
    return out


def render_table(doc: Mapping[str, Any]) -> str:
    """The human rendering of a ``/status`` document."""
    out = []
    ready = doc.get("ready")
    out.append(f"node {doc.get('node', '?')}  fracplugin {doc.get('version', '?')}  pid {doc.get('pid', '?')}  "
               f"ready: {_yn(ready)}")
    doors = doc.get("doors", {})
    out.append("doors: " + "  ".join(f"{k}={'on' if v else 'off'}" for k, v in doors.items())
               + f"  fail-open={'on' if doc.get('fail_open') else 'off'}")
    for part, c in (doc.get("checks") or {}).items():
        out.append(f"  {part:<14} {'ready' if c.get('ready') else 'NOT READY':<10} {c.get('detail', '')}".rstrip())
    out += ["", render_gpus(doc), "", *render_mps(doc.get("mps") or {})]
    nri = doc.get("nri")
    if isinstance(nri, dict):
        out.append("")
        out.append(f"NRI plugin: {nri.get('plugin_idx')}-{nri.get('plugin_name')} on {nri.get('socket')}, "
                   f"connected: {_yn(nri.get('connected'))}, runtime: {nri.get('runtime') or '-'}, "
                   f"events {nri.get('events')}, sessions {nri.get('sessions')}, "
                   f"synchronized {nri.get('synchronize_count')} time(s)")
        unadjusted = nri.get("unadjusted") or []
        if unadjusted:
            out.append(f"  {len(unadjusted)} running container(s) lack fracplugin's settings (see /status)")
        uf = nri.get("unfenced") or {}
        if any(uf.get(k) for k in ("restarted", "reported", "backed_off", "waiting")):
            out.append(f"  unfenced containers ({uf['mode']}): restarted {uf['restarted']}, reported {uf['reported']}, "
                       f"backed off {uf['backed_off']}, waiting {len(uf['waiting'])} (see /status)")
    dp = doc.get("device_plugin")
    if isinstance(dp, dict):
        out.append("")
        out.append(f"device plugin: {dp.get('resource_name')} ({dp.get('unit_mib')} MiB per device), "
                   f"{dp.get('healthy_devices')}/{dp.get('devices')} devices healthy, "
                   f"registered: {_yn(dp.get('registered'))}, ListAndWatch streams: {dp.get('list_and_watch_streams')}")
        out.append(f"  allocations {dp.get('allocations')}  planned {dp.get('planned')}  "
                   f"fallbacks {dp.get('fallbacks')}  refusals {dp.get('refusals')}"
                   + (f"  last refusal: {dp['last_refusal']}" if dp.get("last_refusal") else ""))
    ev = doc.get("events")
    if isinstance(ev, dict):
        out.append("")
        if ev.get("enabled"):
            out.append("Kubernetes Events for refusals: " + "  ".join(
                f"{k} {ev.get(k, 0)}" for k in ("sent", "failed", "dropped", "suppressed", "queued")))
        else:
            out.append("Kubernetes Events for refusals: off (no API access, or the NRI door is off)")
    nc = doc.get("node_condition")
    if isinstance(nc, dict):  # KAI's readiness gate (ADR 0005)
        pub = nc.get("published") or {}
        out.append("")
        out.append(f"node condition {', '.join(nc.get('types') or [])}: "
                   + (f"{pub.get('status')} ({pub.get('reason')})" if pub else "not published")
                   + f"  patches {nc.get('patches', 0)}  failures {nc.get('failures', 0)}"
                   + (f"  last error: {nc['last_error']}" if nc.get("last_error") else ""))
    co = doc.get("cordon")
    if isinstance(co, dict) and (co.get("value") is not None or co.get("last_error")):  # cordon.py
        out.append("")
        out.append(f"cordon {co.get('annotation')}={co.get('value')!r}: GPU(s) "
                   f"{', '.join(str(i) for i in co.get('gpus') or []) or 'none'} take no new fraction"
                   + "".join(f"\n  warning: {w}" for w in co.get("warnings") or [])
                   + (f"\n  last error: {co['last_error']}" if co.get("last_error") else ""))
    ml = doc.get("memory_limits")
    if isinstance(ml, dict):
        out += ["", render_memory_limits(ml)]
    cdi = doc.get("cdi")
    if isinstance(cdi, dict):  # CDI-native GPU injection (ADR 0025b)
        out += ["", render_cdi(cdi)]
    eps = doc.get("endpoints") or {}
    if eps:
        out += ["", "endpoints: " + "  ".join(f"{k}={v}" for k, v in eps.items() if v)]
    return "\n".join(out)


def check_address(address: str, source: str) -> str:
    """``address`` if it is ``HOST:PORT`` with a port in 1..65535 (``HOST`` may be
    empty, a name, an IPv4 address or a bracketed IPv6 address).

    Raises OSError naming ``source`` (the flag, env variable or file it came
    from), the value and the rule; ``main`` turns it into one line, exit 2.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or "/" in host:
        raise OSError(f"{source} {address!r} must be HOST:PORT with a port from 1 to 65535 "
                      "(e.g. 127.0.0.1:8080; no scheme, no path)")
    return address


def _endpoints_health(path: Path) -> str:
    """The ``health`` address recorded in an ``endpoints.json``. Raises OSError."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, not UTF-8
        raise OSError(f"cannot read the health address from {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("health"), str):
        raise OSError(f"cannot read the health address from {path}: not an object with a \"health\" string")
    return check_address(doc["health"], str(path))


def _from_config_file(path: Path) -> str | None:
    """The address a daemon configured by ``path`` (``--config``, the ConfigMap
    at ``/etc/fracplugin/config.yaml`` in the DaemonSet) serves on: its state
    directory's ``endpoints.json`` when present (the port it really bound),
    else its ``health_address``; None when the file names neither."""
    import yaml  # only on this fallback path

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict):
        return None
    state_dir = doc.get("state_dir")
    if isinstance(state_dir, str) and (Path(state_dir) / "endpoints.json").is_file():
        return _endpoints_health(Path(state_dir) / "endpoints.json")
    if isinstance(doc.get("health_address"), str):
        return check_address(doc["health_address"], f"health_address in {path}")
    return None


def resolve_address(args: argparse.Namespace) -> str:
    """Where the daemon's ``/status`` is, first found of: ``--health-address``;
    ``--state-dir``/endpoints.json; env ``FRACPLUGIN_HEALTH_ADDRESS``; the
    daemon's config file (``/etc/fracplugin/config.yaml``, as mounted in the
    DaemonSet, so a changed health port is followed); the default state
    directory's endpoints.json; ``127.0.0.1:8080``.

    Raises OSError when a named source is unreadable or an address is not
    ``HOST:PORT``.
    """
    if args.health_address:
        return check_address(str(args.health_address), "--health-address")
    if args.state_dir:
        return _endpoints_health(Path(args.state_dir) / "endpoints.json")
    env = os.environ.get("FRACPLUGIN_HEALTH_ADDRESS")
    if env:
        return check_address(env, "env FRACPLUGIN_HEALTH_ADDRESS")
    if DEFAULT_CONFIG.is_file():
        found = _from_config_file(DEFAULT_CONFIG)
        if found:
            return found
    if (DEFAULT_STATE_DIR / "endpoints.json").is_file():
        return _endpoints_health(DEFAULT_STATE_DIR / "endpoints.json")
    return DEFAULT_ADDRESS


def main(args: argparse.Namespace) -> int:
    try:
        address = resolve_address(args)
        code, doc = fetch(address, "/status", args.timeout)
    except OSError as exc:
        print(f"fracplugin status: {exc}", file=sys.stderr)
        return 2
    if code != 200 or not isinstance(doc, dict):
        print(f"fracplugin status: {url_for(address)} answered HTTP {code}: {str(doc)[:200]}", file=sys.stderr)
        return 2
    if args.output == "json":
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(doc))
    return 0 if doc.get("ready") else 1
