"""The NRI door's StopContainer and RemoveContainer: drain, release the
ledger holds and, in the background, the MPS namespaces nothing holds any
more; and undoing an admission whose answer came too late.

Split out of ``nri/plugin.py`` (issue 26, ADR 0023), moved as it was: the
module docstring of ``nri/plugin.py`` describes the behaviour and the
concurrency model; ``FracNriPlugin`` is the one class to use.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Mapping

from .._proto import nri_pb2
from .interfaces import CallContext
from .pluginbase import _DRAIN, _ENSURE, _RELEASE, Owner
from .namespaces import _Namespaces

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log, as before the split



class _Release(_Namespaces):
    """Release and stop (a mixin of ``FracNriPlugin``)."""

    def stop_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                       ctx: CallContext | None = None) -> None:
        """StopContainer: drain the container's MPS clients on the daemon of its
        mode only (from the ledger; every daemon when unknown). The drain runs
        off the runtime's critical path: in a worker, awaited for at most half
        the request timeout (and the handler budget); it keeps its own budget
        (``drain_timeout_s``) if it needs longer (issue 12)."""
        timeout = self._mps_timeout(ctx, share=0.5)
        modes = sorted({t.mode for t in self.ledger.find_container_id(container.id)}, key=lambda m: m.value) or None
        fields = {"pod": f"{pod.namespace}/{pod.name}", "container_id": container.id}
        # One drain per container: a second StopContainer shares the queued or
        # running one (the MPS layer would skip a concurrent second drain).
        with self._ns_lock:
            fut = self._ns_work().share((_DRAIN, container.id),
                                        functools.partial(self._drain_job, container.id, modes, fields), tag=_DRAIN,
                                        urgent=True)
        try:
            fut.result(timeout)
        except FutureTimeout:
            log.info("nri drain continues in the background", extra={**fields, "waited_s": timeout})
        except Exception:
            pass  # logged by the job
        # A stopped container holds no memory (issue 10 item 4): its NRI-door
        # hold goes now; a kubelet reservation stays with its pod (kubelet
        # frees those devices when the pod ends), unbound from this container.
        # Its MPS namespace goes at RemoveContainer (an MPS call here could
        # outlast StopContainer's budget, which the drain already used).
        gone = self.ledger.release_stopped(container.id)
        if gone:
            with self._ns_lock:
                self._stopped_holds[container.id] = gone
                while len(self._stopped_holds) > 4096:
                    self._stopped_holds.pop(next(iter(self._stopped_holds)))
        return None

    def _drain_job(self, container_id: str, modes: Any, fields: Mapping[str, Any]) -> Any:
        try:
            result = self.mps.drain(container_id, self.drain_timeout_s, modes=modes)
        except Exception as exc:
            log.warning("nri MPS drain failed", extra={**fields, "reason": str(exc)})
            raise
        if result is not None:
            log.info("nri container drained",
                     extra={**fields, "drain": getattr(result, "to_dict", lambda: str(result))()})
        return result


    def remove_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                         ctx: CallContext | None = None) -> None:
        """RemoveContainer: release the ledger entries of this container id and,
        in the background, its MPS namespace when nothing else holds it (the
        delete waits on MPS: off the runtime's critical path, issue 12). A drain
        of the container still queued is dropped (its processes are gone)."""
        owners = self._forget_namespace_job(container.id)
        if self.memory_limits is not None:  # zero the soft limit before the cgroup goes
            self.memory_limits.remove(container, lambda: [g.uuid for g in self.node.gpus])
        with self._ns_lock:
            stopped = self._stopped_holds.pop(container.id, [])
            if self._ns_queue is not None:
                self._ns_queue.cancel((_DRAIN, container.id))
        gone = stopped + self.ledger.release_stopped(container.id)
        if gone:
            log.info(
                "nri container released",
                extra={"pod_uid": pod.uid, "container": container.name, "container_id": container.id, "gpus": len(gone)},
            )
        self._release_owners(owners | {t.owner for t in gone if t.mps_namespace})
        return None

    def _release_owners(self, owners: set[Owner]) -> None:
        """For each owner nothing in the ledger holds any more: drop its
        queued namespace creation and queue the release of its namespace,
        unless that creation was all there was (it never started, and no other
        ensure started since the owner's last release: there is nothing to
        release). A queued release of an owner that a newer container then
        holds is replaced by that container's ensure (``_queue_ensure``) or, if
        it already started waiting, skipped when it runs (``_release_job``)."""
        inline: list[Owner] = []
        for owner in owners:
            with self._ns_lock:
                if self.ledger.find(*owner):
                    continue  # a newer container of the same pod/name holds it
                q = self._ns_work()
                key = ("ns", *owner)
                if q.cancel(key, tag=_ENSURE, only_idle=True) and owner not in self._ns_made:
                    continue  # created and removed before MPS got to it
                try:
                    q.put(key, functools.partial(self._release_job, owner), tag=_RELEASE)
                except RuntimeError:  # queue closed meanwhile: release inline
                    inline.append(owner)
        for owner in inline:
            self._release_job(owner)

    def _release_job(self, owner: Owner) -> None:
        """Release ``owner``'s namespace unless a newer container of the same
        pod and name holds it now (MPS errors are logged, never raised)."""
        if self.ledger.find(*owner):
            return
        with self._ns_lock:
            self._ns_made.pop(owner, None)
        try:
            self.mps.release_namespace(*owner)
        except Exception as exc:
            log.warning("nri MPS namespace release failed", extra={"pod_uid": owner[0], "container": owner[1], "reason": str(exc)})

    def abandoned(self, method: str, request: Any, response: Any) -> None:
        """The stub answered a CreateContainer itself (budget overrun) and
        dropped our late result: the runtime failed that creation, so undo the
        admission recorded for it."""
        if method != "CreateContainer" or request is None:
            return
        if not isinstance(response, nri_pb2.CreateContainerResponse) or not response.adjust.env:
            return
        owners = self._forget_namespace_job(request.container.id)
        gone = self.ledger.release_container_id(request.container.id)
        log.warning(
            "nri late CreateContainer result dropped; admission undone",
            extra={"container_id": request.container.id, "gpus": len(gone)},
        )
        self._release_owners(owners | {t.owner for t in gone if t.mps_namespace})
