"""fracplugin's NRI handlers: plan, record and fence each fractional container.

Concurrency model: threads. ``NriStub`` calls these handlers from its worker
pool, several at once. The plugin keeps no mutable state of its own beyond a
few flags; the ledger is thread-safe and ``Ledger.admit`` re-checks every
guard atomically, so two concurrent creations cannot both take the last MiB of
a GPU. Handlers must finish within the stub's budget (``ctx.remaining()``);
MPS calls get a timeout derived from it.

Behaviour (DESIGN.md sections 2 and 4; issue 3 item 3):

- CreateContainer: ``planner.plan_container(pod annotations, container name,
  PodRef, node, ledger, config)``. ``None`` -> empty response (untouched). A
  plan -> for sm-sharing, ``mps.ensure_namespace`` first; then
  ``ledger.admit(plan, container_id)``; the answer is a ContainerAdjustment
  with every env var of the plan set *by value* (a removal marker ``-KEY``
  precedes each, which clears an earlier plugin's claim on the key so our
  value wins the runtime's merge; ``-KEY`` alone would not remove a value the
  pod spec set, nri-protocol.md section 1.8) and the plan's bind mounts.
  A ``FractionError`` becomes INVALID_ARGUMENT with ``err.message`` (key,
  value, rule), shown by ``kubectl describe pod``; with ``fail_open`` the
  container is left unadjusted and a warning is logged. An MPS failure is
  UNAVAILABLE (or unadjusted with ``fail_open``).
- StopContainer: ``mps.drain(container_id, timeout)`` with at most half the
  request timeout.
- RemoveContainer: ``ledger.release_container_id`` and, when the container no
  longer holds anything, ``mps.release_namespace``.
- Synchronize: rebuild the ledger from the containers the runtime reports
  (re-planned against their pod annotations and the devices they actually got,
  never refused on guards: what runs is recorded) and log containers that
  should carry our env but do not. ``ready()`` turns true afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Mapping, Protocol, Sequence

from .._proto import nri_pb2
from ..annotations import parse as parse_annotations
from ..ledger import Ledger
from ..model import ComputeMode, ContainerPlan, FractionError, NodeInfo, PodRef, Tenancy
from ..planner import ENFORCED_ENV_KEYS, ENV_VISIBLE_DEVICES, EmptyLedger, PlannerConfig, plan, plan_container
from .stub import CallContext, event_mask
from .ttrpc import Code, RpcError

__all__ = ["MpsHooks", "HookMetrics", "NoMps", "NoMetrics", "FracNriPlugin", "NRI_EVENTS", "build_adjustment"]

log = logging.getLogger(__name__)

NRI_EVENTS = event_mask(nri_pb2.CREATE_CONTAINER, nri_pb2.STOP_CONTAINER, nri_pb2.REMOVE_CONTAINER)
"""0x608: CreateContainer | StopContainer | RemoveContainer (nri-protocol.md 1.4)."""

_DEFAULT_REQUEST_TIMEOUT_S = 2.0
_MARGIN_S = 0.15


class MpsHooks(Protocol):
    """What the NRI door needs from the MPS layer (``fracplugin.mps.api.MpsApi``
    satisfies it). Every call must return within the ``timeout_s`` given."""

    def ensure_namespace(
        self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float
    ) -> str: ...

    def release_namespace(self, pod_uid: str, container: str) -> bool: ...

    def drain(self, container_id: str, timeout_s: float) -> Any: ...


class HookMetrics(Protocol):
    """What the NRI door reports (``fracplugin.metrics.Metrics`` may satisfy it)."""

    def observe_hook(self, door: str, seconds: float) -> None: ...

    def refusal(self, reason_code: str) -> None: ...


class NoMps:
    """No-op MPS: namespaces need nothing, drains find no clients."""

    def ensure_namespace(
        self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float
    ) -> str:
        return ""

    def release_namespace(self, pod_uid: str, container: str) -> bool:
        return True

    def drain(self, container_id: str, timeout_s: float) -> None:
        return None


class NoMetrics:
    """No-op metrics."""

    def observe_hook(self, door: str, seconds: float) -> None:
        return None

    def refusal(self, reason_code: str) -> None:
        return None


def build_adjustment(plan_: ContainerPlan) -> Any:
    """The ``ContainerAdjustment`` of a plan: for each env key ``-KEY`` then
    ``KEY=value`` (plan order), and each mount as ``type: bind`` with
    ``Mount.options`` (``rbind``, ``rw``/``ro``, ``nosuid``, ``nodev``)."""
    adj = nri_pb2.ContainerAdjustment()
    for key, value in plan_.env.items():
        adj.env.add(key="-" + key)
        adj.env.add(key=key, value=str(value))
    for m in plan_.mounts:
        adj.mounts.add(destination=m.destination, type="bind", source=m.source, options=list(m.options))
    return adj


def _env_map(container: Any) -> dict[str, str]:
    env: dict[str, str] = {}
    for kv in container.env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def _pod_ref(pod: Any) -> PodRef:
    return PodRef(pod.namespace, pod.name, pod.uid)


def _tenancies(p: ContainerPlan, container_id: str) -> list[Tenancy]:
    """The tenancies ``Ledger.admit`` would record for ``p``."""
    return [
        Tenancy(
            pod_uid=p.pod.uid,
            namespace=p.pod.namespace,
            pod_name=p.pod.name,
            container=p.container,
            gpu_uuid=g.uuid,
            request_mib=p.request_mib,
            limit_mib=p.limit_mib,
            mode=p.compute_mode,
            container_id=container_id,
            mps_namespace=p.mps.namespace,
            active_thread_percentage=p.active_thread_percentage,
        )
        for g in p.devices
    ]


class FracNriPlugin:
    """The handler object ``NriStub`` drives (see the module docstring).

    Args:
        node: this node's GPUs.
        ledger: the node's ledger (thread-safe; shared with the device plugin).
        config: planner settings (prefix, reserve, MPS layout, client limit).
        mps: the MPS layer (``ensure_namespace``/``release_namespace``/``drain``);
            None = ``NoMps``.
        metrics: ``observe_hook("nri", seconds)`` per CreateContainer and
            ``refusal(code)`` per refusal; None = ``NoMetrics``.
        fail_open: refusals and MPS failures leave the container unadjusted
            (warning logged, refusal still counted) instead of failing it.
    """

    events = NRI_EVENTS

    def __init__(
        self,
        node: NodeInfo,
        ledger: Ledger,
        config: PlannerConfig,
        mps: MpsHooks | None = None,
        metrics: HookMetrics | None = None,
        fail_open: bool = False,
    ) -> None:
        self.node = node
        self.ledger = ledger
        self.config = config
        self.mps: MpsHooks = mps if mps is not None else NoMps()
        self.metrics: HookMetrics = metrics if metrics is not None else NoMetrics()
        self.fail_open = fail_open
        self._synced = threading.Event()
        self.unadjusted: list[dict[str, Any]] = []
        """Containers found by the last Synchronize that lack our env (dicts
        with pod, container, container_id, missing, different)."""

    # -------------------------------------------------------------- status

    def ready(self) -> bool:
        """True after the first Synchronize rebuilt the ledger."""
        return self._synced.is_set()

    # ------------------------------------------------------------ handlers

    def configure(self, request: Any, ctx: CallContext) -> None:
        log.info(
            "nri plugin configured",
            extra={"runtime": f"{request.runtime_name} {request.runtime_version}", "events": f"0x{self.events:x}"},
        )

    def create_container(self, pod: Any, container: Any, ctx: CallContext | None = None) -> Any:
        """CreateContainer: a ``CreateContainerResponse`` (empty when the
        container is not fractional or ``fail_open`` swallowed a refusal).
        Raises ``RpcError`` INVALID_ARGUMENT (refusal) or UNAVAILABLE (MPS)."""
        start = time.monotonic()
        ref = _pod_ref(pod)
        fields = {"pod": str(ref), "pod_uid": ref.uid, "container": container.name, "container_id": container.id}
        try:
            try:
                p = plan_container(dict(pod.annotations), container.name, ref, self.node, self.ledger, self.config)
                if p is None:
                    log.debug("nri container not fractional; untouched", extra=fields)
                    return None
                if p.compute_mode is ComputeMode.SM_SHARING:
                    self._ensure_namespace(p, ctx, fields)
                self.ledger.admit(p, container.id)
            except FractionError as err:
                return self._refuse(err, fields)
            except _FailOpen:
                return None
            self._warn_unenforced(p, container, fields)
            log.info(
                "nri container admitted",
                extra={
                    **fields,
                    "devices": ",".join(p.device_uuids),
                    "compute_mode": p.compute_mode.value,
                    "request_mib": p.request_mib,
                    "limit_mib": p.limit_mib,
                },
            )
            return nri_pb2.CreateContainerResponse(adjust=build_adjustment(p))
        finally:
            self.metrics.observe_hook("nri", time.monotonic() - start)

    def _ensure_namespace(self, p: ContainerPlan, ctx: CallContext | None, fields: Mapping[str, Any]) -> None:
        timeout = self._mps_timeout(ctx, share=0.5)
        try:
            self.mps.ensure_namespace(p.pod.uid, p.container, p.active_thread_percentage, timeout)
        except Exception as exc:
            log.warning("nri MPS namespace not ready", extra={**fields, "reason": str(exc), "timeout_s": timeout})
            self.metrics.refusal("mps_unavailable")
            if self.fail_open:
                log.warning("nri fail-open: container runs unfenced", extra={**fields, "reason": str(exc)})
                raise _FailOpen() from None
            raise RpcError(
                Code.UNAVAILABLE,
                f"fracplugin: MPS namespace for {p.pod}/{p.container} is not ready: {exc}",
            ) from None

    def _refuse(self, err: FractionError, fields: Mapping[str, Any]) -> None:
        self.metrics.refusal(err.code)
        extra = {**fields, "key": err.key, "value": err.value, "rule": err.reason, "code": err.code}
        if self.fail_open:
            log.warning("nri refusal ignored (fail-open): container runs unfenced", extra=extra)
            return None
        log.warning("nri container refused", extra=extra)
        raise RpcError(Code.INVALID_ARGUMENT, err.message)

    def _warn_unenforced(self, p: ContainerPlan, container: Any, fields: Mapping[str, Any]) -> None:
        """Pod-authored values of keys we own but do not set in this plan
        (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE without a portion) stay: NRI
        cannot remove env the pod spec set. Say so."""
        env = _env_map(container)
        left = [k for k in ENFORCED_ENV_KEYS if k in env and k not in p.env]
        if left:
            log.warning("nri pod sets env that fracplugin owns but does not set here", extra={**fields, "keys": left})

    def stop_container(self, pod: Any, container: Any, ctx: CallContext | None = None) -> None:
        """StopContainer: drain the container's MPS clients within at most half
        the request timeout (and the handler budget)."""
        timeout = self._mps_timeout(ctx, share=0.5)
        try:
            result = self.mps.drain(container.id, timeout)
        except Exception as exc:
            log.warning(
                "nri MPS drain failed",
                extra={"pod": f"{pod.namespace}/{pod.name}", "container_id": container.id, "reason": str(exc)},
            )
            return None
        if result is not None:
            log.info(
                "nri container drained",
                extra={"container_id": container.id, "drain": getattr(result, "to_dict", lambda: str(result))()},
            )
        return None

    def remove_container(self, pod: Any, container: Any, ctx: CallContext | None = None) -> None:
        """RemoveContainer: release the ledger entries of this container id and
        its MPS namespace when nothing else holds it."""
        gone = self.ledger.release_container_id(container.id)
        if gone:
            log.info(
                "nri container released",
                extra={"pod_uid": pod.uid, "container": container.name, "container_id": container.id, "gpus": len(gone)},
            )
            self._release_namespace(gone)
        return None

    def _release_namespace(self, gone: Sequence[Tenancy]) -> None:
        for owner in {t.owner for t in gone if t.mps_namespace}:
            if self.ledger.find(*owner):
                continue  # a newer container of the same pod/name holds it
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
        gone = self.ledger.release_container_id(request.container.id)
        log.warning(
            "nri late CreateContainer result dropped; admission undone",
            extra={"container_id": request.container.id, "gpus": len(gone)},
        )
        self._release_namespace(gone)

    def synchronize(self, pods: Sequence[Any], containers: Sequence[Any], ctx: CallContext | None = None) -> list[Any]:
        """Rebuild the ledger from what runs. Returns no updates."""
        pods_by_id = {p.id: p for p in pods}
        tenancies: list[Tenancy] = []
        recorded: set[tuple[str, str]] = set()
        unadjusted: list[dict[str, Any]] = []
        for c in containers:
            pod = pods_by_id.get(c.pod_sandbox_id)
            if pod is None:
                log.warning("nri sync: container without its pod", extra={"container_id": c.id, "container": c.name})
                continue
            fields = {"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid, "container": c.name, "container_id": c.id}
            try:
                p, adjusted = self._replan(pod, c)
            except FractionError as err:
                log.warning(
                    "nri sync: running container has annotations fracplugin refuses; not recorded",
                    extra={**fields, "key": err.key, "value": err.value, "rule": err.reason},
                )
                continue
            if p is None:
                continue
            env = _env_map(c)
            missing = sorted(k for k in p.env if k not in env)
            different = sorted(k for k in p.env if k in env and env[k] != p.env[k])
            if missing or different:
                unadjusted.append({**fields, "missing": missing, "different": different})
                log.warning(
                    "nri sync: container should carry fracplugin's adjustment but does not",
                    extra={**fields, "missing": missing, "different": different},
                )
            if not adjusted and p.placed_by_node:
                # Unknown placement: it never got our devices; do not invent one.
                continue
            tenancies.extend(_tenancies(p, c.id))
            recorded.add((pod.uid, c.name))
        # Keep holds recorded by the other door (no container id) for pods that
        # still exist and that NRI did not re-derive.
        live_uids = {p.uid for p in pods}
        for t in self.ledger.tenancies():
            if not t.container_id and t.pod_uid in live_uids and t.owner not in recorded:
                tenancies.append(t)
        self.ledger.replace_all(tenancies)
        self.unadjusted = unadjusted
        self._synced.set()
        log.info(
            "nri synchronized",
            extra={"pods": len(pods), "containers": len(containers), "tenancies": len(tenancies), "unadjusted": len(unadjusted)},
        )
        return []

    def _replan(self, pod: Any, c: Any) -> tuple[ContainerPlan | None, bool]:
        """Plan a running container against an empty ledger (no guard refusals),
        on the devices its env says it got when that is our
        ``NVIDIA_VISIBLE_DEVICES``. Returns (plan or None, devices known)."""
        request = parse_annotations(dict(pod.annotations), c.name, prefix=self.config.annotation_prefix)
        if request is None:
            return None, False
        env = _env_map(c)
        seen = [d.strip() for d in env.get(ENV_VISIBLE_DEVICES, "").split(",") if d.strip()]
        known = bool(seen) and all(self.node.gpu_by_uuid(u) is not None for u in seen)
        if known:
            request = dataclasses.replace(request, devices=tuple(seen), num_devices=len(seen))
        p = plan(request, _pod_ref(pod), self.node, EmptyLedger(), self.config)
        return p, known or not p.placed_by_node

    # ------------------------------------------------------------- helpers

    @staticmethod
    def _mps_timeout(ctx: CallContext | None, share: float) -> float:
        """Seconds an MPS call may take: ``share`` of the request timeout,
        never past the handler's budget (minus a margin)."""
        if ctx is None:
            return _DEFAULT_REQUEST_TIMEOUT_S * share
        return max(0.05, min(ctx.request_timeout_s * share, ctx.remaining() - _MARGIN_S))


class _FailOpen(Exception):
    pass
