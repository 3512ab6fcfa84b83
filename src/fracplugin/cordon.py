"""Per-GPU cordon (issue 36 item 6; docs/operator-guide.md "Cordoning a GPU" says what it does at each
door): the node annotation ``fracplugin.io/cordoned-gpus: "<uuid|index>,..."``.

``parse`` turns the annotation into the node's GPU UUIDs (an entry naming no
GPU of the node is a warning naming it, never an error). ``CordonWatch``
reads the daemon's own Node (``GET /api/v1/nodes/<node>``: the ``nodes get``
the node condition already has; a watch would need ``list``/``watch`` on
every node, which a ClusterRole cannot narrow to the node a pod runs on) at
start and then every ``--node-poll-interval`` seconds on its own thread, and
hands the set to the node's health monitor (``HealthMonitor.cordon``). A failed
read keeps the last cordon (a GPU is never uncordoned by an API outage). The
request path never waits for the API server.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .events import api_error, core_v1
from .model import NodeInfo

if TYPE_CHECKING:
    from .gpu.health import HealthMonitor

log = logging.getLogger(__name__)

ANNOTATION = "fracplugin.io/cordoned-gpus"


def parse(value: str, node: NodeInfo) -> tuple[frozenset[str], list[str]]:
    """The annotation's ``value`` (GPU UUIDs or indices, comma-separated;
    blanks ignored) -> (the UUIDs of the node's GPUs it names, one warning
    per entry that names none of them). Never raises."""
    uuids: set[str] = set()
    warnings = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        gpu = node.gpu_by_uuid(entry)
        if gpu is None and entry.isascii() and entry.isdigit() and len(entry) < 5:
            gpu = node.gpu_by_index(int(entry))
        if gpu is None:
            warnings.append(f"annotation {ANNOTATION}: {entry[:80]!r} names no GPU of node {node.name} (an index "
                            f"{', '.join(str(g.index) for g in node.gpus)} or a GPU UUID); ignored")
        else:
            uuids.add(gpu.uuid)
    return frozenset(uuids), warnings


def cordon_of(annotations: Mapping[str, Any] | None, node: NodeInfo, health: HealthMonitor) -> list[str]:
    """Set ``health``'s cordon from a node's ``annotations`` (None: none);
    returns the warnings of ``parse``."""
    uuids, warnings = parse(str((annotations or {}).get(ANNOTATION) or ""), node)
    health.cordon(uuids)
    return warnings


class CordonWatch:
    """Reads the node's cordon annotation (module docstring).

    Args:
        api: for ``events.core_v1``.
        node: the node's GPUs; ``node_name``: its Kubernetes name.
        health: the node's health monitor (``NodeRules.health``).
        poll_s: seconds between reads.
    """

    timeout_s = 2.0
    """Bound of one read, seconds."""

    def __init__(self, api: Any, node: NodeInfo, node_name: str, health: HealthMonitor, *,
                 poll_s: float = 10.0) -> None:
        self._api = api
        self._core: Any = None
        self.node = node
        self.node_name = node_name
        self.health = health
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._value: str | None = None
        self._warnings: list[str] = []
        self._error = ""
        self.reads = 0

    def start(self) -> "CordonWatch":
        """Read once now (bounded by ``timeout_s``), then every ``poll_s`` on a thread."""
        self.poll()
        self._thread = threading.Thread(target=self._run, name="fracplugin-cordon", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """One read of the node; applies its annotation. Never raises."""
        try:
            if self._core is None:
                self._core = core_v1(self._api)
            # the raw JSON: only metadata.annotations is read, no model of the whole Node is built
            resp = self._core.read_node(self.node_name, _request_timeout=self.timeout_s, _preload_content=False)
            annotations = (json.loads(resp.data).get("metadata") or {}).get("annotations") or {}
        except Exception as exc:
            error = f"reading node {self.node_name}: {api_error(exc)}"
            if error != self._error:
                log.warning("cordon: %s; the last cordon stays", error, extra={"annotation": ANNOTATION})
            self._error = error
            return
        self._error = ""
        self.reads += 1
        value = annotations.get(ANNOTATION)
        warnings = cordon_of(annotations, self.node, self.health)
        if value != self._value:
            self._value, self._warnings = value, warnings
            log.info("cordon: %s", f"{ANNOTATION}={value!r}" if value is not None else f"no {ANNOTATION}",
                     extra={"cordoned": sorted(self.health.cordoned())})
            for w in warnings:
                log.warning("cordon: %s", w)

    def status(self) -> dict[str, Any]:
        """``{"annotation", "value", "gpus": [index...], "warnings", "reads", "last_error"}`` for ``/status``."""
        cordoned = self.health.cordoned()
        return {"annotation": ANNOTATION, "value": self._value, "warnings": list(self._warnings),
                "gpus": [g.index for g in self.node.gpus if g.uuid in cordoned], "reads": self.reads,
                "last_error": self._error or None}


def from_node_file(path: str, node: NodeInfo) -> tuple[HealthMonitor, list[str]]:
    """``explain --node FILE``: a health monitor (no XID source) cordoned as
    the file's ``annotations`` say (a Node's ``metadata.annotations``), and
    the warnings of ``parse``. ``path`` was read by ``load_node`` already; a
    file that cannot be read again cordons nothing."""
    import yaml

    from .gpu.health import HealthMonitor

    health = HealthMonitor(None, [g.uuid for g in node.gpus])
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return health, []
    found = doc.get("annotations") if isinstance(doc, dict) else None
    return health, cordon_of(found if isinstance(found, dict) else None, node, health)
