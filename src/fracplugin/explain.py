"""``fracplugin explain POD|- (--node FILE | --node-from-status URL | --live)``:
the planner as an operator tool (docs/operator-guide.md, "Why would my pod be
refused?", gives the inputs and how to run it on a cluster).

Plans every container of the pod on an empty node (or on the tenancy of a
ledger file given with ``--ledger``, or on the running daemon's tenants with
``--live``) through the door that would take it, with that door's own code:
the NRI door's planning for annotations, the device plugin door
(GetPreferredAllocation, Allocate, then CreateContainer of its reservation)
for a container asking for the extended resource, the DRA door's Prepare for
a ResourceClaim. With a ``/status`` document the daemon's own planner
settings are used unless given on the command line.

Exit status (the worst over the pods): 0 every container planned or not
fractional; 1 any refused; 2 usage errors, with one line on stderr naming the
file and what is wrong, never a traceback (issue 13 item 4: "refused" must
mean the planner said no, never "the file could not be read").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from . import cordon
from .annotation_lint import lint
from .annotations import DEFAULT_PREFIX, form_targets, native_sidecars, parse, stray_container_keys  # noqa: F401 (stray_container_keys: re-exported)
from .cdi import DEFAULT_SPEC_DIRS, CdiRegistry, with_node_cdi_devices
from .enforce.capability import Capability, NodeCapabilities, described, described_can_enforce
from .enforce.memlimits import LimitPolicy, what_holds
from .enforce.nri import LimitGate
from .gpu.health import HealthMonitor
from .gpu.inventory import InventoryError
from .kubelet.devices import DEFAULT_RESOURCE_NAME, DEFAULT_UNIT_MIB
from .kubelet.podlookup import resource_count
from .gpu.simulated import MAX_MEMORY_MIB, load_node
from .ledger import DEFAULT_MAX_CLIENTS_PER_GPU, Ledger
from .model import FractionError, GpuInfo, NodeInfo, PodRef, Tenancy
from .mps.layout import MpsLayout
from .noderules import NodeRules
from .planner import DEFAULT_RESERVE_MIB, PlannerConfig
from .safetext import escape_controls, quote


class UsageError(Exception):
    """Bad invocation or unreadable input (exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pod", nargs="?", help="pod manifest (YAML or JSON; every Pod and ResourceClaim, a List's "
                   "items too), or - for standard input (kubectl get pods -o yaml | fracplugin explain - ...)")
    node = p.add_mutually_exclusive_group(required=True)
    node.add_argument("--node", metavar="FILE", help="node file (as examples/nodes/gpu-node-1.yaml)")
    node.add_argument("--node-from-status", metavar="URL",
                      help="the daemon's /status JSON (e.g. http://127.0.0.1:8080/status; a file path also works): "
                           "its GPUs and settings, no tenants")
    node.add_argument("--live", action="store_true",
                      help="ask the running daemon (its health address: --health-address, env "
                           "FRACPLUGIN_HEALTH_ADDRESS, /etc/fracplugin/config.yaml, 127.0.0.1:8080) for its GPUs, "
                           "settings and current tenants")
    p.add_argument("--health-address", metavar="HOST:PORT", default=None,
                   help="with --live: the daemon's health endpoint")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="HTTP timeout of --live and "
                   "--node-from-status")
    p.add_argument("--container", help="explain only this container")
    p.add_argument("--output", "-o", choices=("table", "json"), default="table")
    p.add_argument("--ledger", help="a ledger.json whose tenants already hold the node's GPUs")
    p.add_argument("--annotation-prefix", default=None,
                   help=f"per-container key prefix (default: the daemon's with a /status, else {DEFAULT_PREFIX})")
    p.add_argument("--cdi-spec-dirs", metavar="DIR[,DIR]", default=",".join(DEFAULT_SPEC_DIRS),
                   help="comma list of CDI spec directories: each planned GPU's CDI device is listed as the daemon "
                        f"would request it (default {','.join(DEFAULT_SPEC_DIRS)}; empty = none)")
    p.add_argument("--cdi-kind", metavar="KIND", default=None,
                   help="an operator-named CDI kind looked up first (as fracplugin run --cdi-kind)")
    p.add_argument("--memory-limits", choices=("auto", "apply", "verify", "off"), default=None,
                   help="the daemon's --memory-limits, for what holds each GPU's total (cgroup, per-process, none): "
                        "default the daemon's with a /status, else auto; with --node the file's driver (r615+) and "
                        "MIG modes stand for the node's capability gate, with a /status the daemon's own gate")
    p.add_argument("--memory-limits-policy", choices=("warn", "refuse"), default=None,
                   help="the daemon's --memory-limits-policy: refuse refuses fractional containers while the node "
                        "cannot enforce memory limits, warn admits them without the toolkit hook's env where the "
                        "hook would fail; default the daemon's with a /status, else refuse")
    p.add_argument("--device-unit-mib", type=_non_negative, default=None, metavar="MIB",
                   help="MiB per device of the extended resource (as fracplugin run --device-unit-mib; default: "
                        f"the daemon's with a /status, else {DEFAULT_UNIT_MIB})")
    p.add_argument("--claim", metavar="FILE", help="an allocated ResourceClaim: what the DRA door's Prepare gives "
                   "(a claim given as the pod argument works too)")
    p.add_argument("--reserve-mib", type=_non_negative, default=None,
                   help=f"MiB per GPU kept out of fraction resolution (default: the daemon's with a /status, else "
                        f"{DEFAULT_RESERVE_MIB}: KAI's NvFractions binder reserve; 0 = the whole GPU)")


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


def load_pods(path: str) -> list[dict[str, Any]]:
    """Every ``kind: Pod`` and ``kind: ResourceClaim`` document of a YAML/JSON
    file (``-``: standard input), a ``List``'s items included (``kubectl get
    pods -o yaml``), each pod checked to have the shape of a core/v1 Pod where
    explain reads it (``pod_shape_problem``); a claim is explained as the DRA
    door's Prepare (ADR 0031); everything else of the document (``status``,
    ``managedFields``, ``ownerReferences``...) is ignored.
    Raises UsageError naming the file and what is wrong: unreadable, larger
    than ``MAX_POD_FILE_BYTES``, not UTF-8, not YAML, nested too deeply, no
    Pod, or a Pod of the wrong shape."""
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_POD_FILE_BYTES + 1)
            path = "(standard input)"
        else:
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
    # `kubectl get pods -o yaml` wraps the pods in a List: its items are read too.
    docs = [i for d in docs for i in ((d.get("items") or []) if isinstance(d, dict) and d.get("kind") == "List"
                                      and isinstance(d.get("items"), list) else [d])]
    out = []
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "ResourceClaim" and isinstance(d.get("metadata"), dict):
            out.append(d)  # the DRA door's Prepare is explained instead (explain -> _explain_claim)
        elif isinstance(d, dict) and d.get("kind", "Pod") == "Pod" and "metadata" in d:
            problem = pod_shape_problem(d)
            if problem is not None:
                raise UsageError(f"pod file {path}: {problem}")
            out.append(d)
    if out:
        return out
    if path == "(standard input)" and not docs:
        raise UsageError("standard input is empty: pipe a pod in (kubectl get pod NAME -o yaml | fracplugin explain - ...)")
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


STATUS_GPU_FIELDS = ("index", "uuid", "name", "memory_mib")
"""The fields of each ``gpus[]`` entry of ``/status`` that planning needs.
``minor`` (the /dev/nvidiaN number) is not one: the planner places by UUID
and index, only the device plugin door's device nodes use it."""

MAX_STATUS_BYTES = 64 << 20
"""Largest ``/status`` document read (64 MiB: 8 GPUs x 48 tenants is ~200 KiB)."""


def read_status(source: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The daemon's ``/status`` document from an ``http(s)://`` URL (``/status``
    appended when the URL has no path) or a file holding it (``fracplugin
    status -o json > status.json``; ``-`` is not allowed, it is the pod's).

    Raises UsageError naming the URL and what went wrong: unreachable, an
    HTTP status other than 200 (with the first line of the body: a non-loopback
    client gets 404, health.py), larger than ``MAX_STATUS_BYTES``, not JSON,
    or not a JSON object."""
    parsed = urllib.parse.urlsplit(source)
    if parsed.scheme in ("http", "https"):
        url = source if parsed.path not in ("", "/") else urllib.parse.urlunsplit(parsed._replace(path="/status"))
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                body = resp.read(MAX_STATUS_BYTES + 1)
        except urllib.error.HTTPError as exc:
            first = exc.read(300).decode(errors="replace").strip().splitlines()
            raise UsageError(f"{url} answered HTTP {exc.code}: {_one_line(first[0] if first else exc.reason)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UsageError(f"cannot reach the daemon at {url}: {_one_line(str(reason))}") from None
        except ValueError as exc:  # a malformed URL (bad port)
            raise UsageError(f"--node-from-status {source!r} is not a usable URL: {_one_line(str(exc))}") from None
    elif parsed.scheme:
        raise UsageError(f"--node-from-status {source!r}: only http://, https:// or a file path")
    else:
        url = source
        try:
            with open(source, "rb") as f:
                body = f.read(MAX_STATUS_BYTES + 1)
        except OSError as exc:
            raise UsageError(f"cannot read status file {source}: {exc.strerror or exc}") from None
    if len(body) > MAX_STATUS_BYTES:
        raise UsageError(f"{url}: the status document is larger than {MAX_STATUS_BYTES} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise UsageError(f"{url} is not JSON (is it the daemon's /status? `fracplugin status -o json` shows it)") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{url} is not a status document: a JSON object was expected, got {_type(doc)}")
    return doc


def node_from_status(doc: Mapping[str, Any], source: str) -> NodeInfo:
    """The node of a ``/status`` document: its name (``node``) and each entry
    of ``gpus`` (``STATUS_GPU_FIELDS``; ``minor`` defaults to the index when
    absent, as /status does not carry it and planning does not need it).

    Raises UsageError naming ``source``, the entry and the missing or bad
    field (e.g. ``gpus[0] lacks 'memory_mib' (planning needs index, uuid,
    name, memory_mib)``)."""
    gpus_doc = doc.get("gpus")
    if not isinstance(gpus_doc, list):
        raise UsageError(f"{source} is not a fracplugin /status document: it has no 'gpus' list")
    gpus = []
    for i, g in enumerate(gpus_doc):
        if not isinstance(g, dict):
            raise UsageError(f"{source}: gpus[{i}] must be an object, got {_type(g)}")
        missing = [k for k in STATUS_GPU_FIELDS if k not in g]
        if missing:
            raise UsageError(f"{source}: gpus[{i}] lacks {', '.join(repr(k) for k in missing)} "
                             f"(planning needs {', '.join(STATUS_GPU_FIELDS)})")
        for k in ("index", "memory_mib") + (("minor",) if "minor" in g else ()):
            if isinstance(g[k], bool) or not isinstance(g[k], int):
                raise UsageError(f"{source}: gpus[{i}].{k} must be an integer, got {_type(g[k])}")
        if not 0 < g["memory_mib"] <= MAX_MEMORY_MIB:
            raise UsageError(f"{source}: gpus[{i}].memory_mib must be 1..{MAX_MEMORY_MIB} MiB, got {g['memory_mib']}")
        if not isinstance(g["uuid"], str) or not g["uuid"]:
            raise UsageError(f"{source}: gpus[{i}].uuid must be a non-empty string, got {_type(g['uuid'])}")
        gpus.append(GpuInfo(index=g["index"], uuid=g["uuid"], name=str(g["name"]), memory_mib=g["memory_mib"],
                            minor=g["minor"] if "minor" in g else g["index"]))
    if len({g.uuid for g in gpus}) != len(gpus) or len({g.index for g in gpus}) != len(gpus):
        raise UsageError(f"{source}: GPU uuids and indices must be unique")
    return NodeInfo(name=str(doc.get("node") or "unnamed-node"), driver_version="", cuda_driver_version=0,
                    gpus=tuple(sorted(gpus, key=lambda g: g.index)))


def tenancies_from_status(doc: Mapping[str, Any], source: str) -> list[Tenancy]:
    """Every tenant of a ``/status`` document (``gpus[].tenants[]``, each a
    ``Tenancy.to_dict``). Raises UsageError naming the bad record."""
    out = []
    for i, g in enumerate(doc.get("gpus") or []):
        tenants = g.get("tenants") or [] if isinstance(g, dict) else []
        if not isinstance(tenants, list):
            raise UsageError(f"{source}: gpus[{i}].tenants must be a list, got {_type(tenants)}")
        for j, t in enumerate(tenants):
            try:
                out.append(Tenancy.from_dict(t))
            except (KeyError, ValueError, TypeError) as exc:
                raise UsageError(f"{source}: gpus[{i}].tenants[{j}] is not a tenancy: {_one_line(str(exc))}") from None
    return out


def config_from_status(doc: Mapping[str, Any], *, reserve_mib: int | None,
                       annotation_prefix: str | None) -> PlannerConfig:
    """The planner settings of the daemon that served ``doc`` (its ``config``:
    ``reserve_mib``, ``annotation_prefix``, ``max_clients_per_gpu``,
    ``mps_root``, ``no_cdi_devices``); the two arguments, when not None, win
    (given on the command line). A missing or mistyped setting keeps the
    default."""
    found = doc.get("config")
    cfg: dict[str, Any] = found if isinstance(found, dict) else {}

    def setting(name: str, kind: type, default: Any) -> Any:
        v = cfg.get(name)
        return v if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else default

    try:
        layout = MpsLayout(setting("mps_root", str, MpsLayout().root))
    except ValueError:
        layout = MpsLayout()
    return PlannerConfig(
        reserve_mib=reserve_mib if reserve_mib is not None else max(0, setting("reserve_mib", int, DEFAULT_RESERVE_MIB)),
        annotation_prefix=annotation_prefix if annotation_prefix is not None
        else setting("annotation_prefix", str, DEFAULT_PREFIX),
        max_clients_per_gpu=max(1, setting("max_clients_per_gpu", int, DEFAULT_MAX_CLIENTS_PER_GPU)),
        layout=layout,
        cdi_devices=not setting("no_cdi_devices", bool, False),
    )


def explain(pod: dict[str, Any], node_path: str | NodeInfo, *, container: str | None = None,
            ledger_path: str | None = None, config: PlannerConfig = PlannerConfig(),
            tenancies: Sequence[Tenancy] = (), cdi_spec_dirs: Sequence[str] = (),
            cdi_kind: str | None = None, memory_limits: str = "auto", can_enforce: bool | None = None,
            policy: str = "refuse", capabilities: NodeCapabilities | None = None, mps: bool = True,
            unit_mib: int = DEFAULT_UNIT_MIB, resource_name: str = DEFAULT_RESOURCE_NAME) -> dict[str, Any]:
    """The explain report as a dict (the ``--output json`` shape): each
    container's plan with ``cdi_devices`` (the CDI devices the daemon would
    request: the scheduler's names plus each GPU's device from the specs in
    ``cdi_spec_dirs``, ADR 0025b), ``holds`` (GPU UUID -> what would hold the
    container's total there: ``memlimits.what_holds`` of ``memory_limits`` not
    ``off`` and ``can_enforce``, None = ``described_can_enforce`` of the node,
    and ``mps``, an MPS daemon serves it), and ``cdi``
    (``CdiRegistry.status`` less its per-GPU devices; None without spec directories).

    ``node_path``: a node file, or the node itself (``node_from_status``);
    ``tenancies``: tenants already on the node (``--live``), as the ledger
    file of ``ledger_path`` would give them. A container asking for
    ``resource_name`` (``unit_mib`` MiB per device) is explained through the
    device plugin door (``_KubeletDoor``), the others through the NRI door's
    planning; every door with the node's rules (``_node_rules``). Raises UsageError."""
    rules, cordon_warnings = _node_rules(node_path, config, tenancies, ledger_path,
                                         None if memory_limits == "off" else policy, capabilities)
    node, ledger = rules.node, rules.ledger
    cdi = CdiRegistry(cdi_spec_dirs, node.gpus, kind=cdi_kind) if cdi_spec_dirs else None
    if pod.get("kind") == "ResourceClaim":
        return _explain_claim(pod, node, rules, cdi)
    if (problem := pod_shape_problem(pod)) is not None:
        raise UsageError(f"pod: {problem}")
    md = pod["metadata"]
    annotations = {str(k): str(v) for k, v in (md.get("annotations") or {}).items()}
    spec = pod.get("spec") or {}
    init_names, names, listed, specs = _containers(spec)
    targets = form_targets(spec)
    if container is not None and container not in listed:
        raise UsageError(f"pod has no container {container!r} (it has: {', '.join(listed) or 'none'})")
    ref = PodRef(str(md.get("namespace", "default")), str(md.get("name", "")), str(md.get("uid", "")))
    if can_enforce is None:
        can_enforce = described_can_enforce(node.gpus, node.driver_version)
    holds = what_holds(memory_limits != "off" and can_enforce, mps)
    out = []
    kubelet: _KubeletDoor | None = None
    for name in listed:
        if container is not None and name != container:
            continue
        if (count := resource_count(specs.get(name, {}), resource_name)) > 0:  # the device plugin door
            kubelet = kubelet or _KubeletDoor(rules, pod, resource_name, unit_mib)
            entry = kubelet.explain(name, count, ref, cdi)
            out.append({**entry, "holds": dict.fromkeys(entry["devices"], holds)} if entry["devices"] else entry)
            continue
        try:
            req = parse(annotations, name, prefix=config.annotation_prefix, containers=targets)
            plan = rules.gate(rules.plan(req, ref)) if req is not None else None
        except FractionError as err:
            out.append(_unplanned(name, err))
            continue
        if plan is None:
            out.append(_unplanned(name))
        else:
            out.append({**with_node_cdi_devices(plan, cdi).to_dict(), "holds": dict.fromkeys(plan.device_uuids, holds)})
            try:
                ledger.admit(plan)
            except FractionError as err:  # the pod's own earlier containers took the room
                out[-1] = {**out[-1], "devices": [], "env": {}, "mounts": [], "cdi_devices": [], "error": err.to_dict()}
    everyone = init_names + names
    warnings = [f"annotation {k} names no container of this pod (containers: {', '.join(everyone)}); it has no effect"
                for k in stray_container_keys(annotations, config.annotation_prefix, everyone)]
    # keys not in the contract and forms ignored: the NRI door's words (issue 25 item 3)
    warnings += [x.message for x in lint(annotations, config.annotation_prefix, targets, everyone)] + cordon_warnings
    warnings += kubelet.warnings if kubelet else []
    return {"pod": str(ref), "node": node.name, "containers": out, "warnings": warnings,
            "cdi": _cdi_report(cdi, warnings)}


def _node_rules(node_path: str | NodeInfo, config: PlannerConfig, tenancies: Sequence[Tenancy],
                ledger_path: str | None, policy: str | None,
                capabilities: NodeCapabilities | None) -> tuple[NodeRules, list[str]]:
    """The daemon's rules for the node of ``node_path`` (a node file, or the node itself), and the warnings of
    the file's cordon annotation: its GPUs (MIG and cordoned ones excluded, ``cordon.from_node_file``), its
    tenants (``_scratch_ledger``) and the memory-limit step under ``policy`` (None: ``--memory-limits off``)
    on the node's gate: the daemon's own ``capabilities`` (from /status), or what the file says (driver, MIG
    modes: ``capability.described``). Raises UsageError."""
    health: HealthMonitor | None = None
    warnings: list[str] = []
    if isinstance(node_path, NodeInfo):
        node = node_path
    else:
        try:
            node = load_node(node_path)
        except InventoryError as exc:
            raise UsageError(str(exc)) from None
        health, warnings = cordon.from_node_file(node_path, node)
    caps = capabilities or described(node.gpus, node.driver_version)
    gate = None if policy is None else LimitGate(LimitPolicy(policy), lambda: caps)
    ledger = _scratch_ledger(node, config, tenancies, ledger_path)
    return NodeRules(node, ledger, config, health=health, gate=gate), warnings


def _containers(spec: Mapping[str, Any]) -> tuple[list[str], list[str], list[str], dict[str, Any]]:
    """(init container names, app container names, the containers explained:
    native sidecars first, then the app containers, spec by name). Native
    sidecars (init containers with restartPolicy Always) run beside the app
    containers and start first; the pod-level forms may name them
    (annotations.form_targets)."""
    names = [str(c.get("name", "")) for c in spec.get("containers") or [] if isinstance(c, dict)]
    init_names = [str(c.get("name", "")) for c in spec.get("initContainers") or [] if isinstance(c, dict)]
    specs = {str(c.get("name")): c for k in ("initContainers", "containers") for c in spec.get(k) or ()
             if isinstance(c, dict)}
    return init_names, names, [n for n in native_sidecars(spec) if n not in names] + names, specs


class _KubeletDoor:
    """The device plugin door of the scratch node for one pod, as kubelet and
    the runtime call it: GetPreferredAllocation (``preferred.PreferredAllocation``),
    Allocate (``allocator.Allocator``, the pod its only pending pod, its
    answer recorded in the scratch ledger as on the node) and the NRI door's
    CreateContainer of the reservation (``Allocator.request_for`` +
    ``NodeRules.admit``, as ``nri/admission.py`` reserved_request does).
    ``unit_mib``: MiB per device (``--device-unit-mib``). Raises UsageError
    for a unit the device table refuses."""

    def __init__(self, rules: NodeRules, pod: dict[str, Any], resource_name: str, unit_mib: int) -> None:
        from .kubelet.allocator import Allocator
        from .kubelet.devices import DeviceTable
        from .kubelet.podlookup import InMemoryPodSource

        try:
            self.table = DeviceTable.build(rules.node, unit_mib)
        except ValueError as exc:
            raise UsageError(f"--device-unit-mib {unit_mib}: {_one_line(str(exc))}") from None
        self.pod = {**pod, "status": {}}  # kubelet allocates before the runtime creates any container
        self.alloc = Allocator(rules, self.table, resource_name, InMemoryPodSource(None, [self.pod]), 0.0)
        self.resource_name = resource_name
        self.warnings: list[str] = []

    def explain(self, name: str, count: int, ref: PodRef, cdi: CdiRegistry | None) -> dict[str, Any]:
        """Container ``name``'s entry (the ``ContainerPlan.to_dict`` shape plus
        ``kubelet_devices``, the device IDs Allocate gets) or its refusal."""
        from . import allocation as al
        from .kubelet.allocbase import Refusal
        from .kubelet.devices import parse_device_id
        from .kubelet.podlookup import Candidate
        from .reservations import ENV_RESERVATION_PROOF, hold_of

        rules, key = self.alloc.rules, f"resources.limits[{self.resource_name}]"
        held = {(u, n) for t in rules.ledger.tenancies() if t.door == al.DOOR_ALLOCATE
                for u, ns in al.parse_reservation_key(t.reservation).items() for n in ns}
        unusable = rules.unusable()  # the device plugin lists their units Unhealthy: kubelet allocates none
        free = [d for g in rules.node.gpus if g.uuid not in unusable for d in self.table.ids(g.uuid)
                if parse_device_id(d) not in held]
        try:
            ids = self.alloc.preferred.devices(free, [], count)
            ids += [d for d in free if d not in ids][:count - len(ids)]  # kubelet tops a short answer up
            if len(ids) < count:
                raise FractionError(key, str(count), f"the node has {len(free)} free {self.resource_name} devices "
                                    f"of {self.table.unit_mib} MiB; kubelet cannot admit {count}", code="no_fit")
            answer = self.alloc.allocate([ids])
            per = count // len(answer.uuids) * self.table.unit_mib
            req, ignored = self.alloc.request_for(Candidate(self.pod, name, False, ("", 0, 0, "")),
                                                  answer.uuids, per, count)
            plan = rules.admit(req, ref, door=al.DOOR_ALLOCATE, reservation=hold_of(rules.ledger, answer.key))
        except Refusal as r:
            return {**_unplanned(name), "fractional": True, "error": {"key": key, "value": str(count),
                                                                      "reason": r.message}}
        except FractionError as err:
            return _unplanned(name, err)
        self.warnings += [f"container {name}: {i.message}" for i in ignored]
        env = {k: v for k, v in {**answer.env, al.ENV_RESERVATION: answer.key, **plan.env}.items()
               if k != ENV_RESERVATION_PROOF}  # the NRI door takes the proof out (ADR 0033)
        mounts = {m.destination: m for m in (*answer.mounts, *plan.mounts)}
        return {**with_node_cdi_devices(plan, cdi).to_dict(), "env": env, "kubelet_devices": ids,
                "mounts": [m.to_dict() for m in mounts.values()]}


def _live_capabilities(ml: dict[str, Any]) -> NodeCapabilities | None:
    """The daemon's own gate from its /status ``memory_limits.node.capabilities`` (None when it reports none)."""
    items = (ml.get("node") or {}).get("capabilities")
    if not isinstance(items, list):
        return None
    return NodeCapabilities(tuple(Capability(str(c.get("name")), c.get("ok"), str(c.get("detail", "")))
                                  for c in items if isinstance(c, dict)))


def _unplanned(name: str, err: FractionError | None = None) -> dict[str, Any]:
    """The report entry of a container that gets nothing: not fractional, or
    (``err``) refused with the refusal's ``{"key","value","reason"}``."""
    return {"name": name, "fractional": err is not None, "devices": [], "compute_mode": None, "request_mib": None,
            "limit_mib": None, "env": {}, "mounts": [], "cdi_devices": [],
            "error": None if err is None else err.to_dict()}


def _scratch_ledger(node: NodeInfo, config: PlannerConfig, tenancies: Sequence[Tenancy],
                    ledger_path: str | None) -> Ledger:
    """An in-memory ledger holding the node's tenants: ``tenancies`` (``--live``)
    or the ledger file at ``ledger_path``, else empty. Raises UsageError."""
    # The pod's containers are placed against each other (issue 10 item 6):
    # a scratch in-memory ledger starts as the node's tenants (or empty) and
    # each planned container is admitted into it before the next is planned.
    ledger = Ledger(node, max_clients_per_gpu=config.max_clients_per_gpu)
    if tenancies:
        ledger.replace_all(tenancies)
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
    return ledger


def _explain_claim(doc: dict[str, Any], node: NodeInfo, rules: NodeRules, cdi: CdiRegistry | None) -> dict[str, Any]:
    """What the DRA door's Prepare would give an allocated ResourceClaim
    (``status.allocation`` filled; issue 29 item 6, ADR 0031): one entry,
    the claim's plan (env, mount, the CDI devices Prepare answers: the claim's
    own and each GPU's) or the refusal Prepare would answer."""
    from .dra import cdispec
    from .dra import claims as dra_claims

    meta = doc.get("metadata")
    md: dict[str, Any] = meta if isinstance(meta, dict) else {}
    name = f"resourceclaim {md.get('namespace', 'default')}/{md.get('name', '')}"
    entry: dict[str, Any]
    try:
        claim = dra_claims.read_claim(doc, node)
        plan = with_node_cdi_devices(dra_claims.plan_claim(claim, rules), cdi)
    except FractionError as err:
        entry = _unplanned(name, err)
    else:
        entry = {**plan.to_dict(), "name": name, "env": cdispec.claim_env(claim.uid, plan),
                 "cdi_devices": [cdispec.device_id(claim.uid), *plan.cdi_devices]}
    warnings: list[str] = []
    return {"pod": name, "node": node.name, "containers": [entry], "warnings": warnings,
            "cdi": _cdi_report(cdi, warnings)}


def _cdi_report(cdi: CdiRegistry | None, warnings: list[str]) -> dict[str, Any] | None:
    """The report's ``cdi`` block (``CdiRegistry.status`` less its per-GPU
    devices; None without spec directories); each ignored spec and each
    unreadable directory given (not a default one) joins ``warnings``."""
    if cdi is None:
        return None
    st = cdi.status()
    warnings += [f"CDI spec {i['path']} ignored: {i['reason']}" for i in st["invalid_specs"]]
    warnings += [f"CDI spec directory {d}: {why}; no spec is read from it" for d, why in st["unreadable_dirs"].items()
                 if d not in DEFAULT_SPEC_DIRS]  # the defaults are absent where no GPU node is: no noise
    return {k: st[k] for k in ("spec_dirs", "specs", "invalid_specs", "gpus_without_spec")}


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
            lines.append(f"container {escape_controls(c['name'])}: not fractional (no GPU memory annotation or extended resource): left untouched")
            continue
        lines.append(f"container {escape_controls(c['name'])}: {c['compute_mode']}, {c['request_mib']} MiB request / "
                     f"{c['limit_mib']} MiB limit per GPU")
        lines.append("  devices: " + ", ".join(c["devices"]))
        if c.get("kubelet_devices"):
            lines.append(f"  kubelet devices (GetPreferredAllocation, Allocate): {', '.join(c['kubelet_devices'])}")
        if c.get("portion") is not None:
            lines.append(f"  compute portion: {c['portion']:g}")
        if c.get("cdi_devices"):
            lines.append("  CDI devices: " + ", ".join(c["cdi_devices"]))
        if c.get("holds"):
            lines.append("  what holds the total per GPU: " + ", ".join(f"{u} {h}" for u, h in c["holds"].items()))
        lines.append("  env:")
        for k, v in c["env"].items():
            lines.append(f"    {k}={v}")
        lines.append("  mounts:")
        for m in c["mounts"]:
            lines.append(f"    {m['source']} -> {m['destination']} ({'ro' if m['read_only'] else 'rw'})")
    return "\n".join(lines)


def _live_status(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """(/status document, its URL) of the running daemon, found as ``fracplugin
    status`` finds it (status.resolve_address). Raises UsageError."""
    from . import status as statusmod

    ns = argparse.Namespace(health_address=args.health_address, state_dir=None)
    try:
        address = statusmod.resolve_address(ns)
    except OSError as exc:
        raise UsageError(str(exc)) from None
    url = statusmod.url_for(address, "/status")
    return read_status(url, args.timeout), url


def main(args: argparse.Namespace) -> int:
    """Explain every pod and claim of ``args.pod`` and ``args.claim``; returns
    the worst exit status of them (module docstring). A closed standard
    output (``| head -n 1``) ends the output quietly, the status unchanged."""
    logging.getLogger("fracplugin").addHandler(logging.NullHandler())  # the doors' log lines: the report says it
    try:
        if args.health_address and not args.live:
            raise UsageError("--health-address is for --live (give --node-from-status a URL)")
        if args.pod is None and args.claim is None:
            raise UsageError("give a pod file (or -) or --claim FILE")
        docs = [d for path in (args.pod, args.claim) if path is not None for d in load_pods(path)]
        node: str | NodeInfo
        tenancies: list[Tenancy] = []
        limits, can, mps = args.memory_limits, None, True
        policy, caps = args.memory_limits_policy, None
        dp: Any = {}
        if args.node is not None:
            node = args.node
            config = PlannerConfig(
                reserve_mib=DEFAULT_RESERVE_MIB if args.reserve_mib is None else args.reserve_mib,
                annotation_prefix=DEFAULT_PREFIX if args.annotation_prefix is None else args.annotation_prefix)
        else:
            if args.live:
                if args.ledger:
                    raise UsageError("--live plans against the daemon's own tenants; --ledger is for --node")
                doc, source = _live_status(args)
            else:
                source = args.node_from_status
                doc = read_status(source, args.timeout)
            node = node_from_status(doc, source)
            if args.live:
                tenancies = tenancies_from_status(doc, source)
            config = config_from_status(doc, reserve_mib=args.reserve_mib, annotation_prefix=args.annotation_prefix)
            ml: dict[str, Any] = doc["memory_limits"] if isinstance(doc.get("memory_limits"), dict) else {}
            limits = limits or str(ml.get("mode") or "off")  # the daemon's own gate, when it reports one
            can = bool((ml.get("node") or {}).get("can_enforce"))
            policy = policy or str(ml.get("policy") or "refuse")
            caps = _live_capabilities(ml)
            mps = not (isinstance(doc.get("config"), dict) and doc["config"].get("no_mps"))
            dp = doc.get("device_plugin") if isinstance(doc.get("device_plugin"), dict) else {}
        unit = args.device_unit_mib if args.device_unit_mib is not None else (
            dp["unit_mib"] if isinstance(dp.get("unit_mib"), int) else DEFAULT_UNIT_MIB)
        resource = dp.get("resource_name") if isinstance(dp.get("resource_name"), str) else DEFAULT_RESOURCE_NAME
        dirs = [d.strip() for d in (args.cdi_spec_dirs or "").split(",") if d.strip()]
        reports = [explain(d, node, container=args.container, ledger_path=args.ledger, config=config,
                           tenancies=tenancies, cdi_spec_dirs=dirs, cdi_kind=args.cdi_kind,
                           memory_limits=limits or "auto", can_enforce=can, policy=policy or "refuse",
                           capabilities=caps, mps=mps,
                           unit_mib=unit, resource_name=resource) for d in docs]
    except UsageError as exc:
        print(f"fracplugin explain: {exc}", file=sys.stderr)
        return 2
    rc = 1 if any(c["error"] for r in reports for c in r["containers"]) else 0
    try:
        if args.output == "json":
            print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
        else:
            print("\n\n".join(render_table(r) for r in reports))
        sys.stdout.flush()
    except BrokenPipeError:  # the reader is gone (| head): the rest is dropped, never a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return rc
