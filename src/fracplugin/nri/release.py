"""The NRI door's StopContainer and RemoveContainer (``Releases``): drain,
release the ledger holds and, in the background, the MPS namespaces nothing
holds any more; and undoing an admission whose answer came too late.

The module docstring of ``nri/plugin.py`` describes the behaviour and the
concurrency model; ``FracNriPlugin`` is the one class to use.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .._proto import nri_pb2
from ..model import Tenancy
from ..noderules import NodeRules
from .interfaces import CallContext
from .mpscalls import MpsCalls
from .namespaces import Namespaces
from .pluginbase import mps_timeout

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log


class Releases:
    """StopContainer, RemoveContainer and ``abandoned``; owns the holds
    released at StopContainer (container id -> tenancies, under its own
    lock) until RemoveContainer."""

    def __init__(self, rules: NodeRules, namespaces: Namespaces, calls: MpsCalls) -> None:
        self.rules = rules
        self.namespaces = namespaces
        self.calls = calls
        self._lock = threading.Lock()
        self._stopped_holds: dict[str, list[Tenancy]] = {}  # container id -> holds released at StopContainer

    def stop(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container, ctx: CallContext | None = None) -> None:
        """StopContainer: drain the container's MPS clients on the daemon of its
        mode only (from the ledger; every daemon when unknown). The drain runs
        off the runtime's critical path: in a worker, awaited for at most half
        the request timeout (and the handler budget); it keeps its own budget
        (``drain_timeout_s``) if it needs longer (issue 12)."""
        ledger = self.rules.ledger
        timeout = mps_timeout(ctx, share=0.5)
        modes = sorted({t.mode for t in ledger.find_container_id(container.id)}, key=lambda m: m.value) or None
        fields = {"pod": f"{pod.namespace}/{pod.name}", "container_id": container.id}
        # One drain per container: a second StopContainer shares the queued or
        # running one (the MPS layer would skip a concurrent second drain).
        fut = self.namespaces.drain(container.id, functools.partial(self.calls.drain, container.id, modes, fields))
        try:
            fut.result(timeout)
        except FutureTimeout:
            log.info("nri drain continues in the background", extra={**fields, "waited_s": timeout})
        except Exception:
            pass  # logged by the job
        # A stopped container holds no memory (ADR 0007 decision 5); its MPS namespace goes
        # at RemoveContainer (an MPS call here could outlast the budget the drain used).
        gone = ledger.release_stopped(container.id)
        if gone:
            with self._lock:
                self._stopped_holds[container.id] = gone
                while len(self._stopped_holds) > 4096:
                    self._stopped_holds.pop(next(iter(self._stopped_holds)))

    def remove(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container) -> None:
        """RemoveContainer: release the ledger entries of this container id and,
        in the background, its MPS namespace when nothing else holds it (the
        delete waits on MPS: off the runtime's critical path, issue 12). A drain
        of the container still queued is dropped (its processes are gone)."""
        owners = self.namespaces.forget(container.id)
        limits = self.rules.limits
        if limits is not None:  # zero the soft limit before the cgroup goes
            limits.remove(container, lambda: [g.uuid for g in self.rules.node.gpus])
        with self._lock:
            stopped = self._stopped_holds.pop(container.id, [])
        self.namespaces.cancel_drain(container.id)
        gone = stopped + self.rules.ledger.release_stopped(container.id)
        if gone:
            log.info(
                "nri container released",
                extra={"pod_uid": pod.uid, "container": container.name, "container_id": container.id, "gpus": len(gone)},
            )
        self.namespaces.release(owners | {t.owner for t in gone if t.mps_namespace})

    def abandoned(self, method: str, request: Any, response: Any) -> None:
        """The stub answered a CreateContainer itself (budget overrun) and
        dropped our late result: the runtime failed that creation, so undo the
        admission recorded for it."""
        if method != "CreateContainer" or request is None:
            return
        if not isinstance(response, nri_pb2.CreateContainerResponse) or not response.adjust.env:
            return
        owners = self.namespaces.forget(request.container.id)
        gone = self.rules.ledger.release_container_id(request.container.id)
        log.warning(
            "nri late CreateContainer result dropped; admission undone",
            extra={"container_id": request.container.id, "gpus": len(gone)},
        )
        self.namespaces.release(owners | {t.owner for t in gone if t.mps_namespace})
