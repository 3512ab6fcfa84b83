"""``fracplugin explain POD.yaml --node NODE.yaml``: the planner as an operator tool.

Pure apart from reading the two files: plans every container of the pod on an
empty node (or on the tenancy of a ledger file given with ``--ledger``) and
prints what each would get, or why it is refused.

Exit status: 0 every container planned or not fractional; 1 any refused;
2 usage errors (missing file, bad YAML, unknown container) with one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from .annotations import DEFAULT_PREFIX, stray_container_keys  # noqa: F401 (stray_container_keys: re-exported)
from .gpu.inventory import InventoryError
from .gpu.simulated import load_node
from .ledger import Ledger
from .model import FractionError, PodRef
from .planner import DEFAULT_RESERVE_MIB, PlannerConfig, plan_container


class UsageError(Exception):
    """Bad invocation or unreadable input (exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pod", help="pod manifest (YAML or JSON; the first Pod document is used)")
    p.add_argument("--node", required=True, help="node file (as examples/nodes/gpu-node-1.yaml)")
    p.add_argument("--container", help="explain only this container")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")
    p.add_argument("--ledger", help="a ledger.json whose tenants already hold the node's GPUs")
    p.add_argument("--annotation-prefix", default=DEFAULT_PREFIX)
    p.add_argument("--reserve-mib", type=_non_negative, default=DEFAULT_RESERVE_MIB,
                   help=f"MiB per GPU kept out of fraction resolution (default {DEFAULT_RESERVE_MIB}: "
                        "KAI's NvFractions binder reserve; 0 = the whole GPU)")


def _non_negative(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number of MiB") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{raw!r} must be 0 or more MiB")
    return value


def load_pod(path: str) -> dict[str, Any]:
    """The first ``kind: Pod`` document of a YAML/JSON file. Raises UsageError."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except OSError as exc:
        raise UsageError(f"cannot read pod file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"pod file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    for d in docs:
        if isinstance(d, dict) and d.get("kind", "Pod") == "Pod" and isinstance(d.get("metadata"), dict):
            return d
    raise UsageError(f"pod file {path} holds no Pod")


def explain(pod: dict[str, Any], node_path: str, *, container: str | None = None, ledger_path: str | None = None,
            config: PlannerConfig = PlannerConfig()) -> dict[str, Any]:
    """The explain report as a dict (the ``--output json`` shape). Raises UsageError."""
    try:
        node = load_node(node_path)
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    # The pod's containers are placed against each other (issue 10 item 6):
    # a scratch in-memory ledger starts as the node's tenants (or empty) and
    # each planned container is admitted into it before the next is planned.
    ledger = Ledger(node, max_clients_per_gpu=config.max_clients_per_gpu)
    if ledger_path:
        if not Path(ledger_path).exists():
            raise UsageError(f"ledger file {ledger_path} does not exist")
        current = Ledger(node, ledger_path, read_only=True)
        for w in current.load():
            print(f"warning: {w}", file=sys.stderr)
        ledger.replace_all(current.tenancies())
    md = pod["metadata"]
    annotations = {str(k): str(v) for k, v in (md.get("annotations") or {}).items()}
    spec = pod.get("spec") or {}
    names = [c.get("name", "") for c in spec.get("containers") or [] if isinstance(c, dict)]
    init_names = [c.get("name", "") for c in spec.get("initContainers") or [] if isinstance(c, dict)]
    if container is not None and container not in names:
        raise UsageError(f"pod has no container {container!r} (it has: {', '.join(names) or 'none'})")
    ref = PodRef(str(md.get("namespace", "default")), str(md.get("name", "")), str(md.get("uid", "")))
    out = []
    for name in names:
        if container is not None and name != container:
            continue
        try:
            plan = plan_container(annotations, name, ref, node, ledger, config, containers=names)
        except FractionError as err:
            out.append({"name": name, "fractional": True, "devices": [], "compute_mode": None,
                        "request_mib": None, "limit_mib": None, "env": {}, "mounts": [], "error": err.to_dict()})
            continue
        if plan is None:
            out.append({"name": name, "fractional": False, "devices": [], "compute_mode": None,
                        "request_mib": None, "limit_mib": None, "env": {}, "mounts": [], "error": None})
        else:
            out.append(plan.to_dict())
            try:
                ledger.admit(plan)
            except FractionError as err:  # the pod's own earlier containers took the room
                out[-1] = {**out[-1], "devices": [], "env": {}, "mounts": [], "error": err.to_dict()}
    everyone = init_names + names
    warnings = [f"annotation {k} names no container of this pod (containers: {', '.join(everyone)}); it has no effect"
                for k in stray_container_keys(annotations, config.annotation_prefix, everyone)]
    return {"pod": str(ref), "node": node.name, "containers": out, "warnings": warnings}


def render_table(report: dict[str, Any]) -> str:
    """Human rendering of an explain report."""
    lines = [f"pod {report['pod']} on node {report['node']}"]
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    for c in report["containers"]:
        lines.append("")
        if c["error"]:
            e = c["error"]
            lines.append(f"container {c['name']}: REFUSED")
            lines.append(f"  key:    {e['key']}")
            lines.append(f"  value:  {e['value']!r}" if e["value"] is not None else "  value:  (absent)")
            lines.append(f"  reason: {e['reason']}")
            continue
        if not c["fractional"]:
            lines.append(f"container {c['name']}: not fractional (no GPU memory annotation): left untouched")
            continue
        lines.append(f"container {c['name']}: {c['compute_mode']}, {c['request_mib']} MiB request / "
                     f"{c['limit_mib']} MiB limit per GPU")
        lines.append("  devices: " + ", ".join(c["devices"]))
        if c.get("portion") is not None:
            lines.append(f"  compute portion: {c['portion']:g}")
        if c.get("cdi_devices"):
            lines.append("  CDI devices: " + ", ".join(c["cdi_devices"]))
        lines.append("  env:")
        for k, v in c["env"].items():
            lines.append(f"    {k}={v}")
        lines.append("  mounts:")
        for m in c["mounts"]:
            lines.append(f"    {m['source']} -> {m['destination']} ({'ro' if m['read_only'] else 'rw'})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        pod = load_pod(args.pod)
        config = PlannerConfig(reserve_mib=args.reserve_mib, annotation_prefix=args.annotation_prefix)
        report = explain(pod, args.node, container=args.container, ledger_path=args.ledger, config=config)
    except UsageError as exc:
        print(f"fracplugin explain: {exc}", file=sys.stderr)
        return 2
    if args.output == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render_table(report))
    return 1 if any(c["error"] for c in report["containers"]) else 0
