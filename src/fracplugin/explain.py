"""``fracplugin explain POD.yaml --node NODE.yaml``: the planner as an operator tool.

Pure apart from reading the two files: plans every container of the pod on an
empty node (or on the tenancy of a ledger file given with ``--ledger``) and
prints what each would get, or why it is refused.

Exit status: 0 every container planned or not fractional; 1 any refused;
2 usage errors (missing file, bad YAML, a file that is not a pod or not a
node, unknown container) with one line on stderr naming the file and what is
wrong, never a traceback (issue 13 item 4: "refused" must mean the planner
said no, never "the file could not be read").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from .annotations import DEFAULT_PREFIX, stray_container_keys  # noqa: F401 (stray_container_keys: re-exported)
from .cdi import DEFAULT_SPEC_DIRS, CdiRegistry, with_node_cdi_devices
from .gpu.inventory import InventoryError
from .gpu.simulated import load_node
from .ledger import Ledger
from .model import FractionError, PodRef
from .planner import DEFAULT_RESERVE_MIB, PlannerConfig, plan_container
from .safetext import escape_controls, quote


class UsageError(Exception):
    """Bad invocation or unreadable input (exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pod", help="pod manifest (YAML or JSON; the first Pod document is used)")
    p.add_argument("--node", required=True, help="node file (as examples/nodes/gpu-node-1.yaml)")
    p.add_argument("--container", help="explain only this container")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")
    p.add_argument("--ledger", help="a ledger.json whose tenants already hold the node's GPUs")
    p.add_argument("--annotation-prefix", default=DEFAULT_PREFIX)
    p.add_argument("--cdi-spec-dirs", metavar="DIR[,DIR]", default=",".join(DEFAULT_SPEC_DIRS),
                   help="comma list of CDI spec directories: each planned GPU's CDI device is listed as the daemon "
                        f"would request it (default {','.join(DEFAULT_SPEC_DIRS)}; empty = none)")
    p.add_argument("--cdi-kind", metavar="KIND", default=None,
                   help="an operator-named CDI kind looked up first (as fracplugin run --cdi-kind)")
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


MAX_POD_FILE_BYTES = 8 << 20
"""Largest pod file read (8 MiB; etcd stores objects up to 1.5 MiB)."""


def _one_line(text: str) -> str:
    return escape_controls(" ".join(str(text).split()))[:300]


def load_pod(path: str) -> dict[str, Any]:
    """The first ``kind: Pod`` document of a YAML/JSON file, checked to have the
    shape of a core/v1 Pod where explain reads it (``pod_shape_problem``).
    Raises UsageError naming the file and what is wrong: unreadable, larger
    than ``MAX_POD_FILE_BYTES``, not UTF-8, not YAML, nested too deeply, no
    Pod, or a Pod of the wrong shape."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_POD_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read pod file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_POD_FILE_BYTES:
        raise UsageError(f"pod file {path} is larger than {MAX_POD_FILE_BYTES} bytes; not a pod manifest")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"pod file {path} is not UTF-8 text (byte {exc.start})") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise UsageError(f"pod file {path} is not valid YAML: {_one_line(str(exc).splitlines()[0] if str(exc) else repr(exc))}") from None
    except RecursionError:
        raise UsageError(f"pod file {path} is nested too deeply to parse") from None
    except Exception as exc:  # the parser is not ours: whatever it raises is the file's fault
        raise UsageError(f"pod file {path} cannot be parsed: {type(exc).__name__}: {_one_line(str(exc))}") from None
    for d in docs:
        if isinstance(d, dict) and d.get("kind", "Pod") == "Pod" and "metadata" in d:
            problem = pod_shape_problem(d)
            if problem is not None:
                raise UsageError(f"pod file {path}: {problem}")
            return d
    raise UsageError(f"pod file {path} holds no Pod")


def _type(v: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def pod_shape_problem(pod: dict[str, Any]) -> str | None:
    """What in ``pod`` does not have the core/v1 Pod shape explain reads, in one
    line (None when it is fine): ``metadata`` a mapping whose ``name``,
    ``namespace``, ``uid`` are strings and whose ``annotations`` map strings to
    strings (numbers are read as their text, as an unquoted YAML value);
    ``spec`` a mapping whose ``containers`` is a list of mappings, each with a
    non-empty, unique string ``name`` (Kubernetes API types, core/v1)."""
    md = pod.get("metadata")
    if not isinstance(md, dict):
        return f"metadata must be a mapping, got {_type(md)}"
    for key in ("name", "namespace", "uid"):
        if md.get(key) is not None and not isinstance(md.get(key), str):
            return f"metadata.{key} must be a string, got {_type(md.get(key))}"
    ann = md.get("annotations")
    if ann is not None:
        if not isinstance(ann, dict):
            return f"metadata.annotations must be a mapping of strings, got {_type(ann)}"
        for k, v in ann.items():
            if not isinstance(k, str):
                return f"metadata.annotations key {_one_line(repr(k))[:80]} must be a string, got {_type(k)}"
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                return f"metadata.annotations[{_one_line(repr(k))[:80]}] must be a string, got {_type(v)}"
    spec = pod.get("spec")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return f"spec must be a mapping, got {_type(spec)}"
    containers = spec.get("containers")
    if containers is None:
        return None
    if not isinstance(containers, list):
        return f"spec.containers must be a list of containers, got {_type(containers)}"
    seen: set[str] = set()
    for i, c in enumerate(containers):
        if not isinstance(c, dict):
            return f"spec.containers[{i}] must be a mapping, got {_type(c)}"
        name = c.get("name")
        if not isinstance(name, str) or not name:
            return f"spec.containers[{i}].name must be a non-empty string, got {_type(name)}"
        if name in seen:
            return f"spec.containers[{i}].name {quote(name)} is used twice"
        seen.add(name)
    return None


def explain(pod: dict[str, Any], node_path: str, *, container: str | None = None, ledger_path: str | None = None,
            config: PlannerConfig = PlannerConfig(), cdi_spec_dirs: Sequence[str] = (),
            cdi_kind: str | None = None) -> dict[str, Any]:
    """The explain report as a dict (the ``--output json`` shape): each
    container's plan with ``cdi_devices`` (the CDI devices the daemon would
    request: the scheduler's names plus each GPU's device from the specs in
    ``cdi_spec_dirs``, ADR 0025b), and ``cdi`` (``CdiRegistry.status`` less
    its per-GPU devices; None without spec directories). Raises UsageError."""
    try:
        node = load_node(node_path)
    except InventoryError as exc:
        raise UsageError(str(exc)) from None
    cdi = CdiRegistry(cdi_spec_dirs, node.gpus, kind=cdi_kind) if cdi_spec_dirs else None
    # The pod's containers are placed against each other (issue 10 item 6):
    # a scratch in-memory ledger starts as the node's tenants (or empty) and
    # each planned container is admitted into it before the next is planned.
    ledger = Ledger(node, max_clients_per_gpu=config.max_clients_per_gpu)
    if ledger_path:
        lp = Path(ledger_path)
        if not lp.exists() and not lp.parent.is_dir():
            raise UsageError(f"ledger file {ledger_path} does not exist (nor its directory)")
        if not lp.exists():  # a daemon with no tenants yet has written no ledger
            print(f"warning: no ledger at {escape_controls(ledger_path)}: the node has no tenants yet "
                  "(or this is not the daemon's --state-dir); planning against an empty node", file=sys.stderr)
        current = Ledger(node, ledger_path, read_only=True)
        for w in current.load():
            if "is unreadable" in w:  # not a ledger: planning against an empty node would mislead
                raise UsageError(_one_line(w.replace("; ignored", "")))
            print(f"warning: {escape_controls(w)}", file=sys.stderr)
        ledger.replace_all(current.tenancies())
    problem = pod_shape_problem(pod)
    if problem is not None:
        raise UsageError(f"pod: {problem}")
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
                        "request_mib": None, "limit_mib": None, "env": {}, "mounts": [], "cdi_devices": [],
                        "error": err.to_dict()})
            continue
        if plan is None:
            out.append({"name": name, "fractional": False, "devices": [], "compute_mode": None,
                        "request_mib": None, "limit_mib": None, "env": {}, "mounts": [], "cdi_devices": [],
                        "error": None})
        else:
            out.append(with_node_cdi_devices(plan, cdi).to_dict())
            try:
                ledger.admit(plan)
            except FractionError as err:  # the pod's own earlier containers took the room
                out[-1] = {**out[-1], "devices": [], "env": {}, "mounts": [], "cdi_devices": [], "error": err.to_dict()}
    everyone = init_names + names
    warnings = [f"annotation {k} names no container of this pod (containers: {', '.join(everyone)}); it has no effect"
                for k in stray_container_keys(annotations, config.annotation_prefix, everyone)]
    cdi_doc = None
    if cdi is not None:
        st = cdi.status()
        cdi_doc = {k: st[k] for k in ("spec_dirs", "specs", "invalid_specs", "gpus_without_spec")}
        warnings += [f"CDI spec {i['path']} ignored: {i['reason']}" for i in st["invalid_specs"]]
    return {"pod": str(ref), "node": node.name, "containers": out, "warnings": warnings, "cdi": cdi_doc}


def render_table(report: dict[str, Any]) -> str:
    """Human rendering of an explain report."""
    lines = [f"pod {escape_controls(report['pod'])} on node {escape_controls(report['node'])}"]
    lines += [f"warning: {escape_controls(w)}" for w in report.get("warnings", [])]
    for c in report["containers"]:
        lines.append("")
        if c["error"]:
            e = c["error"]
            lines.append(f"container {escape_controls(c['name'])}: REFUSED")
            lines.append(f"  key:    {escape_controls(e['key'])}")
            lines.append(f"  value:  {e['value']!r}" if e["value"] is not None else "  value:  (absent)")
            lines.append(f"  reason: {escape_controls(e['reason'])}")
            continue
        if not c["fractional"]:
            lines.append(f"container {escape_controls(c['name'])}: not fractional (no GPU memory annotation): left untouched")
            continue
        lines.append(f"container {escape_controls(c['name'])}: {c['compute_mode']}, {c['request_mib']} MiB request / "
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
        raw_dirs = getattr(args, "cdi_spec_dirs", ",".join(DEFAULT_SPEC_DIRS))  # callers that build args by hand
        dirs = [d.strip() for d in (raw_dirs or "").split(",") if d.strip()]
        report = explain(pod, args.node, container=args.container, ledger_path=args.ledger, config=config,
                         cdi_spec_dirs=dirs, cdi_kind=getattr(args, "cdi_kind", None))
    except UsageError as exc:
        print(f"fracplugin explain: {exc}", file=sys.stderr)
        return 2
    if args.output == "json":
        print(json.dumps(report, indent=2))
    else:
        print(render_table(report))
    return 1 if any(c["error"] for c in report["containers"]) else 0
