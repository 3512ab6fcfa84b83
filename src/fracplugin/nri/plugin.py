"""fracplugin's NRI handlers: plan, record and fence each fractional container.

Concurrency model: threads. ``NriStub`` calls these handlers from its
reader thread when ``may_block(method)`` says the call cannot wait
(CreateContainer while every MPS daemon is healthy and the namespace is
deferred; RemoveContainer), else from its worker pool, several at once (ADR
nri-reader-thread-serving). Its own mutable state is the background MPS work
(a keyed work queue, ``nsqueue.KeyedWorkQueue``, 4 workers: one pending job
per MPS namespace owner and per drained container, so its memory is bounded
by the owners with work, not by the runtime's event rate; issue 14), the
table of namespace jobs StartContainer awaits and the owners whose namespace
may exist (dicts under ``_ns_lock``), the mount sources made before, and the
last Synchronize report; the ledger is thread-safe and ``Ledger.admit``
re-checks every guard atomically, so two concurrent creations cannot both take
the last MiB of a GPU. Handlers finish within the stub's budget
(``ctx.remaining()``); MPS calls made inside a handler get a timeout derived
from it, background jobs ``namespace_timeout_s``.

Behaviour (DESIGN.md sections 2 and 4; issue 3 item 3):

- CreateContainer: ``planner.plan_container(pod annotations, container name,
  PodRef, node, ledger, config)``. ``None`` -> empty response (untouched). A
  plan -> ``ledger.admit(plan, container_id)``; for sm-sharing,
  ``mps.ensure_namespace`` runs in the background and StartContainer waits
  for it (``defer_namespace=True``, the default) or runs before the admission
  (``defer_namespace=False``); the answer is a ContainerAdjustment
  with every env var of the plan set *by value* (a removal marker ``-KEY``
  precedes each, which clears an earlier plugin's claim on the key so our
  value wins the runtime's merge; ``-KEY`` alone would not remove a value the
  pod spec set, nri-protocol.md section 1.8) and the plan's bind mounts.
  A ``FractionError`` becomes INVALID_ARGUMENT with ``err.message`` (key,
  value, rule), shown by ``kubectl describe pod``; with ``fail_open`` the
  container is left unadjusted and a warning is logged. Either way every
  refusal is also handed to ``on_refusal(pod, container, err)`` (for a
  Kubernetes Event, ``fracplugin.events.EventRecorder``), which only
  enqueues. An MPS failure is UNAVAILABLE (or unadjusted with ``fail_open``).
- A container that kubelet allocated devices of the extended resource to
  (its env or annotations carry Allocate's reservation key,
  ``allocation.ENV_RESERVATION``) gets kubelet's allocation (GPUs, request)
  plus what its annotations may add; the reservation is bound to the pod UID,
  container name and container id (ADR 0007). Annotations not applied are
  logged and handed to ``on_warning``. A container mounting something at the
  pipe directory destination is refused, naming the mount.
- StopContainer: ``mps.drain(container_id, timeout)`` with at most half the
  request timeout; then the container's NRI-door hold is released (a stopped
  container holds no memory) and it is unbound from a kubelet reservation,
  which stays with its pod.
- RemoveContainer: the same release and, when the container no longer holds
  anything, ``mps.release_namespace``.
- Start-up: the plugin registers with the runtime at once, even while the MPS
  daemons are still starting. An sm-sharing container that starts in that
  window fails its StartContainer with UNAVAILABLE and kubelet retries it;
  registering only once MPS is up would instead let every container created
  meanwhile run unfenced (an unregistered plugin is simply not asked).
- Synchronize: rebuild the ledger from the containers the runtime reports
  (re-planned against their pod annotations and the devices they actually got,
  never refused on guards: what runs is recorded) and log containers that
  should carry our env but do not; sm-sharing namespaces of the recorded
  containers are re-ensured in the background (a restarted daemon's MPS layer
  knows none). ``ready()`` turns true afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import stat
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping, Sequence

from .._proto import nri_pb2
from .. import allocation as al
from ..annotations import parse as parse_annotations
from ..annotations import KEY_CONTAINER_NAME, KEY_GPU_FRACTION, KEY_GPU_FRACTION_LIMIT, KEY_GPU_MEMORY, KEY_NUM_DEVICES
from ..annotations import stray_container_keys
from ..ledger import Ledger
from ..model import ComputeMode, ContainerPlan, FractionError, NodeInfo, PodRef, Tenancy
from ..mps.api import MpsApi, NullMps
from ..mps.layout import CONTAINER_PIPE_DIR
from ..parts import HookMetrics, NoMetrics
from ..mps.supervisor import make_dir
from ..planner import ENFORCED_ENV_KEYS, ENV_VISIBLE_DEVICES, EmptyLedger, PlannerConfig, plan, plan_container
from ..reservations import claim_problem, proof_of, unbind_gone
from .nsqueue import KeyedWorkQueue
from .pod_checks import lint_pod, spec_unknown
from .stub import CallContext, event_mask
from .ttrpc import Code, RpcError

__all__ = [
    "MpsHooks",
    "HookMetrics",
    "NoMps",
    "NoMetrics",
    "FracNriPlugin",
    "NRI_EVENTS",
    "NRI_EVENTS_DEFERRED",
    "build_adjustment",
]

log = logging.getLogger(__name__)

NRI_EVENTS = event_mask(nri_pb2.CREATE_CONTAINER, nri_pb2.STOP_CONTAINER, nri_pb2.REMOVE_CONTAINER)
"""0x608: CreateContainer | StopContainer | RemoveContainer (nri-protocol.md 1.4)."""

NRI_EVENTS_DEFERRED = NRI_EVENTS | event_mask(nri_pb2.START_CONTAINER)
"""0x628: the above plus StartContainer, where a deferred MPS namespace is awaited."""

_DEFAULT_REQUEST_TIMEOUT_S = 2.0
_POD_LEVEL_KEYS = (KEY_GPU_FRACTION, KEY_GPU_MEMORY, KEY_GPU_FRACTION_LIMIT, KEY_NUM_DEVICES)
_MARGIN_S = 0.15
_MODES = tuple(ComputeMode)
_NS_WORKERS = 4
_ENSURE = "ensure"
_RELEASE = "release"
_DRAIN = "drain"

Owner = tuple[str, str]
"""An MPS namespace owner: (pod UID, container name) (``Tenancy.owner``)."""


MpsHooks = MpsApi
"""What the NRI door needs from the MPS layer: the one MPS port (``mps.api.MpsApi``)."""

NoMps = NullMps
"""No MPS: the one null object (``mps.api.NullMps``)."""


def build_adjustment(plan_: ContainerPlan) -> Any:
    """The ``ContainerAdjustment`` of a plan: for each env key ``-KEY`` then
    ``KEY=value`` (plan order), and each mount as ``type: bind`` with
    ``Mount.options`` (``rbind``, ``rw``/``ro``, ``nosuid``, ``nodev``), and
    each of the plan's CDI device names as ``CDI_devices`` (field 8, NRI
    v0.7+; the runtime resolves it from its CDI spec dirs, ADR 0005)."""
    adj = nri_pb2.ContainerAdjustment.FromString(_env_adjustment(tuple(plan_.env.items())))
    for m in plan_.mounts:
        adj.mounts.add(destination=m.destination, type="bind", source=m.source, options=list(m.options))
    for name in plan_.cdi_devices:
        adj.CDI_devices.add(name=name)
    return adj


@functools.lru_cache(maxsize=1024)
def _env_adjustment(env: tuple[tuple[str, str], ...]) -> bytes:
    """The serialized ``ContainerAdjustment`` holding only ``build_adjustment``'s
    env part for ``env`` (issue 14: 13 ``env.add`` calls cost ~5 us per
    CreateContainer; the env depends on the GPUs, the MiB and the portion,
    not on the pod, so plans share it; parsing it back costs ~1 us)."""
    adj = nri_pb2.ContainerAdjustment()
    for key, value in env:
        adj.env.add(key="-" + key)
        adj.env.add(key=key, value=str(value))
    return adj.SerializeToString()


def _env_map(container: Any) -> dict[str, str]:
    env: dict[str, str] = {}
    for kv in container.env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def _pod_ref(pod: Any) -> PodRef:
    return PodRef(pod.namespace, pod.name, pod.uid)


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
        defer_namespace: True (default): CreateContainer admits and answers at
            once and creates the sm-sharing MPS namespace in the background;
            StartContainer (subscribed then: mask 0x628) waits for it within
            its budget and fails the start with UNAVAILABLE when it is not
            there. The container process cannot reach MPS before it starts, so
            this keeps MPS control commands off CreateContainer's critical
            path. False: the namespace is created inside CreateContainer.
        namespace_timeout_s: bound of one background namespace creation.
        drain_timeout_s: budget of one background drain (StopContainer waits
            for it at most half the request timeout; gpu-fractioning's
            terminate budget is 30 s, mps-nvml.md 2.7).
        on_refusal: ``f(pod: PodRef, container: str, err: FractionError)``
            called for every refusal of CreateContainer (also with
            ``fail_open``), in the handler thread, before the answer is sent.
            It must not block: it is meant to enqueue (e.g.
            ``functools.partial(EventRecorder.refused, door="nri")``, which
            writes a Kubernetes Event in the background). An exception it
            raises is logged and ignored.
        on_warning: ``f(pod, container, message)`` for an annotation that was
            not applied (kubelet's allocation wins, an annotation names no
            container of the pod); same rules as ``on_refusal`` (a Warning
            Event, ``EventRecorder.warned``).
        pod_lookup: ``f(namespace, name) -> pod dict | None`` (the watch cache
            of the device plugin door): with the pod's spec the NRI door knows
            its init and app containers, so pod-level KAI forms apply to the
            named or first app container only and annotations naming no
            container are reported, exactly as ``fracplugin explain`` does.
            None: one container at a time (ADR 0001 item 6).
        unit_mib: MiB per device of the device plugin door (``--device-unit-mib``),
            to read a reservation key (ADR 0007).
        resource_name: the extended resource (named in messages).
        gpu_health: ``uuid -> GpuHealth`` (``.healthy``, ``.reasons``; the device
            plugin door's XID + MPS monitor): no fraction is placed on an
            Unhealthy GPU (node placement skips it; a container bound to one
            gets UNAVAILABLE, the runtime retries). None: every GPU healthy.
    """

    def __init__(
        self,
        node: NodeInfo,
        ledger: Ledger,
        config: PlannerConfig,
        mps: MpsHooks | None = None,
        metrics: HookMetrics | None = None,
        fail_open: bool = False,
        *,
        defer_namespace: bool = True,
        namespace_timeout_s: float = 5.0,
        drain_timeout_s: float = 30.0,
        on_refusal: Callable[[PodRef, str, FractionError], None] | None = None,
        on_warning: Callable[[PodRef, str, str], None] | None = None,
        pod_lookup: Callable[[str, str], Mapping[str, Any] | None] | None = None,
        unit_mib: int = 1024,
        resource_name: str = "fracplugin.io/gpu-memory",
        gpu_health: Callable[[str], Any] | None = None,
    ) -> None:
        self.node = node
        self.gpu_health = gpu_health
        self.on_refusal = on_refusal
        self.on_warning = on_warning
        self.pod_lookup = pod_lookup
        self.unit_mib = unit_mib
        self.resource_name = resource_name
        self._warned_pods: dict[str, None] = {}
        self.ledger = ledger
        self.config = config
        self.mps: MpsHooks = mps if mps is not None else NoMps()
        self.metrics: HookMetrics = metrics if metrics is not None else NoMetrics()
        self.fail_open = fail_open
        self.defer_namespace = defer_namespace
        self.namespace_timeout_s = namespace_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.events = NRI_EVENTS_DEFERRED if defer_namespace else NRI_EVENTS
        """Subscription mask sent in ConfigureResponse (0x628 deferred, 0x608 not)."""
        self._ns_lock = threading.Lock()
        # container id -> (owner, future of the namespace job StartContainer awaits)
        self._ns_pending: dict[str, tuple[Owner, Future[Any]]] = {}
        # owners whose namespace may exist: an ensure for them started (or a
        # Synchronize found them) since their last release ran. The value, once
        # an ensure of the queue made it, is (its settings: mode, portion, pinned
        # limit; that ensure's done future): while no job of the owner is queued
        # or running, a new container of the owner with the same settings awaits
        # that outcome instead of queueing another ensure (issue 14: a restart or
        # retry of a container costs no MPS work); None = not known to be made so.
        self._ns_made: dict[Owner, tuple[tuple[Any, ...], Future[Any]] | None] = {}
        self._stopped_holds: dict[str, list[Tenancy]] = {}  # container id -> holds released at StopContainer
        self._ns_queue: KeyedWorkQueue | None = None
        self._made_sources: dict[str, None] = {}  # mount sources made before (insertion order: oldest first)
        self._synced = threading.Event()
        self.unadjusted: list[dict[str, Any]] = []
        """Containers found by the last Synchronize that lack our env (dicts
        with pod, container, container_id, missing, different)."""

    # -------------------------------------------------------------- status

    def ready(self) -> bool:
        """True after the first Synchronize rebuilt the ledger."""
        return self._synced.is_set()

    def status(self) -> dict[str, Any]:
        """JSON-able state: ``{"ready", "fail_open", "events",
        "defer_namespace", "pending_namespaces", "mps_jobs", "unadjusted"}``
        where ``pending_namespaces`` counts containers whose background MPS
        namespace job is not done yet, ``mps_jobs`` is the background MPS work
        queue's ``{"queued", "running", "threads"}`` (at most one queued job per
        namespace owner and per drained container) and ``unadjusted`` lists what
        the last Synchronize reported."""
        with self._ns_lock:
            pending = sum(1 for _, f in self._ns_pending.values() if not f.done())
            q = self._ns_queue
        return {
            "ready": self.ready(),
            "fail_open": self.fail_open,
            "events": f"0x{self.events:x}",
            "defer_namespace": self.defer_namespace,
            "pending_namespaces": pending,
            "mps_jobs": q.stats() if q is not None else {"queued": 0, "running": 0, "threads": 0},
            "unadjusted": list(self.unadjusted),
        }

    def may_block(self, method: str) -> bool:
        """Whether serving ``method`` may wait now (``NriStub`` serves the
        calls that cannot on its reader thread, the others on its handler
        threads; ``interfaces.MayBlockInterface``).

        CreateContainer waits only when it creates the MPS namespace itself
        (``defer_namespace=False``) or an MPS daemon is not healthy
        (``_require_mode_up`` waits for it to come back); otherwise it plans,
        admits (a journal append and fdatasync) and answers. RemoveContainer
        never waits (its MPS work runs in the background). StartContainer
        (awaits the namespace), StopContainer (awaits the drain), Synchronize
        (the whole node) and StateChange (v0.8 StartContainer) may."""
        if method == "CreateContainer":
            return not self.defer_namespace or not self._mps_healthy_now()
        return method != "RemoveContainer"

    def _mps_healthy_now(self) -> bool:
        """Every MPS daemon answers its probe (True when the MPS layer cannot
        tell, as ``_wait_mps_healthy``)."""
        healthy = getattr(self.mps, "healthy", None)
        return not callable(healthy) or all(healthy(mode) for mode in _MODES)

    # ------------------------------------------------------------ handlers

    def create_container(self, pod: Any, container: Any, ctx: CallContext | None = None) -> Any:
        """CreateContainer: a ``CreateContainerResponse`` (empty when the
        container is not fractional or ``fail_open`` swallowed a refusal).
        Raises ``RpcError`` INVALID_ARGUMENT (refusal) or UNAVAILABLE (MPS).

        A container whose env (or annotations) carries a reservation key from
        Allocate (``allocation.ENV_RESERVATION``) gets kubelet's allocation:
        its GPUs and request, plus the limit, mode and portion its annotations
        may add; the reservation is bound to this pod, container and container
        id. Annotations that were not applied are logged and reported
        (``on_warning``). Other containers are planned from the annotations."""
        start = time.monotonic()
        ref = _pod_ref(pod)
        fields = {"pod": str(ref), "pod_uid": ref.uid, "container": container.name, "container_id": container.id}
        try:
            try:
                key = self._reservation_key(container, fields, strict=True)
                if key:
                    self._check_claim(pod, container, key, ref)
                apps, everyone = self._spec_names(pod, container.name)
                if everyone is not None:
                    self._warn_stray(pod, ref, container.name, everyone, fields)
                self._lint(pod, ref, container.name, apps, everyone, fields)
                ignored: list[Any] = []
                p: ContainerPlan | None
                if key:
                    p, ignored = self._plan_reserved(pod, container.name, ref, key, apps)
                else:
                    p = plan_container(dict(pod.annotations), container.name, ref, self.node, self.ledger,
                                       self.config, containers=apps)
                if p is None:
                    log.debug("nri container not fractional; untouched", extra=fields)
                    return None
                # the mode's MPS daemon first: while it is down every GPU may read
                # Unhealthy, and that is transient (issue 25 item 7)
                self._require_mode_up(p, ctx, fields)
                p = self._avoid_unhealthy(p, pod, container.name, ref, fields)
                _check_mounts(p, container, self.config.layout.root)
                sm = p.mps.namespace is not None  # MPS v3 namespace to create (none with classic v2)
                self._ensure_mount_sources(p, fields)
                if sm and not self.defer_namespace:
                    self._ensure_namespace(p, ctx, fields)
                if key:
                    self.ledger.admit(p, container.id, door=al.DOOR_ALLOCATE, reservation=key)
                else:
                    self.ledger.admit(p, container.id)
                if sm and self.defer_namespace:
                    self._start_namespace(p, container.id, fields)
            except FractionError as err:
                return self._refuse(err, fields, ref, container.name)
            except _FailOpen:
                return None
            for i in ignored:
                self._warn(ref, container.name, i.message, fields, key=i.key, value=i.value)
            self._warn_unenforced(p, container, fields)
            # DEBUG, not INFO: this runs on every creation, inside the runtime's
            # serialised CreateContainer path; formatting and writing a log
            # record there cost ~0.1 ms per call (bench_nri). Admissions stay
            # visible in the ledger, /status and the metrics.
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "nri container admitted",
                    extra={
                        **fields,
                        "devices": ",".join(p.device_uuids),
                        "compute_mode": p.compute_mode.value,
                        "request_mib": p.request_mib,
                        "limit_mib": p.limit_mib,
                        "reservation": key,
                    },
                )
            return nri_pb2.CreateContainerResponse(adjust=build_adjustment(p))
        finally:
            self.metrics.observe_hook("nri", time.monotonic() - start)

    # ------------------------------------------------- one allocation (ADR 0007)

    def _reservation_key(self, container: Any, fields: Mapping[str, Any], strict: bool = False) -> str:
        """The reservation key Allocate answered for this container, or "".
        The container annotation is preferred (kubelet copies Allocate's
        annotations into the CRI config; runtimes may not pass them on), then
        the env (the pod spec cannot remove it, but could set its own value: a
        key that is not canonical or names devices this node does not
        advertise is ignored with a warning)."""
        key = container.annotations.get(al.ANNOTATION_RESERVATION, "") if container.annotations else ""
        if not key:
            prefix = al.ENV_RESERVATION + "="
            for kv in reversed(container.env):  # the last value is the one the container sees
                if kv.startswith(prefix):
                    key = kv[len(prefix):]
                    break
        if not key:
            return ""
        try:
            by_gpu = al.parse_reservation_key(key)
        except al.ReservationKeyError as exc:
            if strict:  # a key no Allocate of ours made is refused, not ignored (issue 25 item 4)
                raise FractionError(al.ENV_RESERVATION, key[:200], f"is not a reservation key: {exc}",
                                    "reservation") from None
            log.warning("nri reservation key ignored", extra={**fields, "reason": str(exc)})
            return ""
        for uuid in by_gpu:
            gpu = self.node.gpu_by_uuid(uuid)
            if gpu is None or max(by_gpu[uuid]) >= gpu.memory_mib // self.unit_mib:
                if strict:
                    raise FractionError(al.ENV_RESERVATION, key[:200], f"names devices node {self.node.name} does "
                                        "not advertise: no Allocate of this node made it", "reservation")
                log.warning("nri reservation key ignored", extra={
                    **fields, "reason": f"{key[:120]} names devices node {self.node.name} does not advertise"})
                return ""
        return key

    def _spec_names(self, pod: Any, container: str = "") -> tuple[list[str] | None, list[str] | None]:
        """``_containers_of`` only when it matters (the hot path stays a dict
        lookup): the pod has pod-level KAI forms without a container name, or
        per-container keys not yet checked for strays."""
        if self.pod_lookup is None:
            return None, None
        annotations = pod.annotations
        named = annotations.get(KEY_CONTAINER_NAME)
        # the spec decides: which container is first, or whether the named one exists (issue 25 items 1, 2)
        pod_level = (named is None and any(k in annotations for k in _POD_LEVEL_KEYS)) or (
            named is not None and named != container)
        unchecked = pod.uid not in self._warned_pods and any(
            k.startswith(self.config.annotation_prefix) for k in annotations) if self.config.annotation_prefix else False
        if not (pod_level or unchecked):
            return None, None
        got = self._containers_of(pod)
        if pod_level and got[0] is None:
            spec_unknown(self, pod)
        return got

    def _containers_of(self, pod: Any) -> tuple[list[str] | None, list[str] | None]:
        """(app container names, init + app names) from the pod's spec when
        ``pod_lookup`` knows the pod, else (None, None)."""
        if self.pod_lookup is None:
            return None, None
        try:
            spec_pod = self.pod_lookup(pod.namespace, pod.name)
        except Exception:
            log.exception("nri pod lookup failed")
            return None, None
        if not spec_pod:
            return None, None
        md = spec_pod.get("metadata") or {}
        if md.get("uid") and md.get("uid") != pod.uid:
            return None, None  # another pod of the same name
        spec = spec_pod.get("spec") or {}
        apps = [str(c.get("name")) for c in spec.get("containers") or () if isinstance(c, Mapping)]
        inits = [str(c.get("name")) for c in spec.get("initContainers") or () if isinstance(c, Mapping)]
        return apps, inits + apps

    def _warn_stray(self, pod: Any, ref: PodRef, container: str, everyone: Sequence[str],
                    fields: Mapping[str, Any]) -> None:
        """Annotations naming no container of the pod: a Warning once per pod
        (the same words as ``fracplugin explain``)."""
        if pod.uid in self._warned_pods:
            return
        self._warned_pods[pod.uid] = None  # checked (the pod's spec was known)
        while len(self._warned_pods) > 4096:
            self._warned_pods.pop(next(iter(self._warned_pods)))
        stray = stray_container_keys(dict(pod.annotations), self.config.annotation_prefix, everyone)
        if not stray:
            return
        for k in stray:
            self._warn(ref, container, f'{k}="{pod.annotations[k]}" names no container of this pod '
                       f"(containers: {', '.join(everyone)}); it has no effect", fields, key=k,
                       value=pod.annotations[k])

    def _check_claim(self, pod: Any, container: Any, key: str, ref: PodRef) -> None:
        """Raise FractionError when this container may not claim reservation
        ``key`` (``reservations.claim_problem``: forged, unknown, held by
        another running container, or without the proof Allocate answered;
        issue 25 item 4)."""
        proof = proof_of(container.annotations, container.env)
        why = claim_problem(self.ledger, key, ref.uid, proof, self.node.name)
        if why is not None:
            raise FractionError(al.ENV_RESERVATION, key, why, "reservation")

    def _lint(self, pod: Any, ref: PodRef, container: str, apps: Sequence[str] | None,
              everyone: Sequence[str] | None, fields: Mapping[str, Any]) -> None:
        """Warn (log + ``on_warning``) about annotation keys fracplugin does
        not read and forms it ignores (``annotation_lint``; issue 25 item 3),
        once per pod and container."""
        lint_pod(self, pod, ref, container, apps, everyone, fields)

    def _plan_reserved(self, pod: Any, container: str, ref: PodRef, key: str,
                       apps: Sequence[str] | None, ledger: Any = None) -> tuple[ContainerPlan, list[Any]]:
        """Plan a container under kubelet's reservation ``key``. Raises
        FractionError for annotations that break the contract or a guard
        (the reservation's own hold does not count against it)."""
        by_gpu = al.parse_reservation_key(key)
        if ledger is None:
            held = self.ledger.reservation(key)
            if held and held[0].bound and held[0].pod_uid != ref.uid and held[0].container_id:
                t = held[0]
                raise FractionError(
                    al.ENV_RESERVATION, key,
                    f"is held by running container {t.namespace}/{t.pod_name}/{t.container}; kubelet gives a "
                    "device to one pod at a time, so this container cannot claim it", "reservation")
        gpus = sorted((self.node.gpu_by_uuid(u) for u in by_gpu), key=lambda g: g.index)  # type: ignore[union-attr]
        uuids = [g.uuid for g in gpus]  # type: ignore[union-attr]
        per = len(next(iter(by_gpu.values()))) * self.unit_mib
        count = sum(len(v) for v in by_gpu.values())
        parsed = al.parse_for_kubelet(dict(pod.annotations), container, per, prefix=self.config.annotation_prefix,
                                      containers=apps)
        req, ignored = al.kubelet_request(
            container, uuids, per, count, parsed, f"resources.limits[{self.resource_name}]",
            gpu_memory_mib=min(g.memory_mib for g in gpus), reserve_mib=self.config.reserve_mib)  # type: ignore[union-attr]
        return plan(req, ref, self.node, self.ledger if ledger is None else ledger, self.config,
                    reservation=key), ignored

    def _plan_reserved_unguarded(self, pod: Any, container: str, key: str) -> tuple[ContainerPlan, list[Any]]:
        """``_plan_reserved`` against an empty ledger (what runs is recorded)."""
        apps, _ = self._containers_of(pod)
        return self._plan_reserved(pod, container, _pod_ref(pod), key, apps, ledger=EmptyLedger())

    def _warn(self, ref: PodRef, container: str, message: str, fields: Mapping[str, Any], **extra: Any) -> None:
        log.warning("nri annotation not applied", extra={**fields, **extra, "reason": message})
        if self.on_warning is not None:
            try:
                self.on_warning(ref, container, message)
            except Exception:
                log.exception("nri on_warning callback failed", extra=dict(fields))
    def _avoid_unhealthy(self, p: ContainerPlan, pod: Any, name: str, ref: PodRef,
                         fields: Mapping[str, Any]) -> ContainerPlan:
        """No fraction on an Unhealthy GPU (issue 12): a node-placed container is
        planned again on the healthy GPUs only; a container bound to an
        Unhealthy GPU is refused with UNAVAILABLE naming the GPU and why."""
        if self.gpu_health is None:
            return p
        bad = {g.uuid: h for g in p.devices if not (h := self.gpu_health(g.uuid)).healthy}
        if not bad:
            return p
        if p.placed_by_node:
            healthy = tuple(g for g in self.node.gpus if self.gpu_health(g.uuid).healthy)
            view = dataclasses.replace(self.node, gpus=healthy)
            try:
                again = plan_container(dict(pod.annotations), name, ref, view, self.ledger, self.config)
            except FractionError:
                again = None  # no healthy GPU fits now: transient, UNAVAILABLE below (issue 25 item 7)
            if again is not None:
                return again
        what = "; ".join(f"GPU {self.node.gpu_by_uuid(u).index} ({u}): {', '.join(h.reasons)}"  # type: ignore[union-attr]
                         for u, h in bad.items())
        self.metrics.refusal("gpu_unhealthy")
        log.warning("nri container bound to an Unhealthy GPU", extra={**fields, "gpus": what})
        if self.fail_open:
            raise _FailOpen()
        raise RpcError(Code.UNAVAILABLE, f"fracplugin: {ref}/{name} is bound to Unhealthy GPU(s) {what}")

    def _ensure_mount_sources(self, p: ContainerPlan, fields: Mapping[str, Any]) -> None:
        """Create every bind-mount source of ``p`` (mode 0755) before answering.

        The runtime bind-mounts them when it creates the task (runc create),
        which comes before the NRI StartContainer event: a deferred MPS
        namespace directory must already exist then, or the container fails
        with "stat <dir>: no such file or directory" (seen with containerd 2.3
        in tests/e2e). MPS later creates its sockets inside the directory,
        which the bind mount shows. Raises RpcError UNAVAILABLE (or
        _FailOpen) when the directory cannot be made.
        """
        for m in p.mounts:
            if self._made_before(m.source):
                continue
            try:
                make_dir(m.source, self.config.layout.root)  # 0755 whatever the umask (issue 12)
                self._made_sources[m.source] = None
                while len(self._made_sources) > 4096:
                    self._made_sources.pop(next(iter(self._made_sources)), None)
            except OSError as exc:
                self.metrics.refusal("mps_unavailable")
                log.warning("nri cannot create a mount source", extra={**fields, "path": m.source, "reason": str(exc)})
                if self.fail_open:
                    raise _FailOpen() from None
                raise RpcError(
                    Code.UNAVAILABLE,
                    f"fracplugin: cannot create the MPS pipe directory {m.source} for {p.pod}/{p.container}: {exc}",
                ) from None

    def _made_before(self, path: str) -> bool:
        """``path`` is a mount source ``make_dir`` made (or checked) before and
        it still is a 0755 directory: one ``stat`` instead of ``make_dir``'s
        walk up to the MPS root (issue 14: 30-40 us per CreateContainer). The
        MPS layer may remove a released namespace's directory at any time, so
        the directory itself is always checked."""
        if path not in self._made_sources:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755

    def _ensure_namespace(self, p: ContainerPlan, ctx: CallContext | None, fields: Mapping[str, Any]) -> None:
        # The namespace must exist before the container starts: give MPS all
        # the budget that is left (minus a margin to answer in time).
        timeout = self._mps_timeout(ctx, share=1.0)
        deadline = time.monotonic() + timeout
        try:
            self._wait_mps_healthy(deadline, p.compute_mode)
            self.mps.ensure_namespace(
                p.pod.uid, p.container, p.active_thread_percentage, max(0.01, deadline - time.monotonic()),
                mode=p.compute_mode, pinned_limit_mib=p.limit_mib,
            )
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

    def _start_namespace(self, p: ContainerPlan, container_id: str, fields: Mapping[str, Any]) -> None:
        """Create the namespace of ``p`` in the background (deferred mode):
        one queued ensure per owner (``_queue_ensure``). When an ensure of the
        owner already made it with the same settings (compute mode, active
        thread percentage, pinned limit), no release of the owner ran since and
        no job of the owner is queued or running, the container awaits that
        ensure's outcome instead: nothing is queued (issue 14; the MPS layer
        keeps the namespace, and re-applies it after a daemon restart before
        the daemon counts as healthy again, which CreateContainer waited for)."""
        owner = (p.pod.uid, p.container)
        with self._ns_lock:
            cur = self._ns_made.get(owner)
            if (cur is not None and cur[0] == (p.compute_mode, p.active_thread_percentage, p.limit_mib)
                    and self._ns_queue is not None
                    and not self._ns_queue.busy(("ns", *owner))):
                self._ns_pending[container_id] = (owner, cur[1])
                return
            self._queue_ensure(container_id, owner, functools.partial(self._namespace_job, p, dict(fields)))

    def _namespace_job(self, p: ContainerPlan, fields: Mapping[str, Any]) -> str:
        return self._ensure_job((p.pod.uid, p.container), p.active_thread_percentage, fields,
                                p.compute_mode, p.limit_mib)

    def start_container(self, pod: Any, container: Any, ctx: CallContext | None = None) -> None:
        """StartContainer (deferred mode): wait, within the handler budget, for
        the container's MPS namespace. Raises ``RpcError`` UNAVAILABLE when it
        failed or is not there yet (the runtime fails the start; kubelet
        retries), unless ``fail_open``."""
        if not self.defer_namespace:
            return None
        fields = {"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid, "container": container.name,
                  "container_id": container.id}
        with self._ns_lock:
            job = self._ns_pending.get(container.id)
        fut = job[1] if job is not None else None
        timeout = self._mps_timeout(ctx, share=1.0)
        if fut is None:
            # Nothing pending: not ours, already awaited, or the daemon restarted
            # between create and start; then make sure synchronously.
            held = [t for t in self.ledger.find_container_id(container.id) if t.mps_namespace]
            if not held:
                return None
            t = held[0]
            with self._ns_lock:
                self._ns_made[t.owner] = None  # made here, outside the queue: not reused
            try:
                deadline = time.monotonic() + timeout
                self._wait_mps_healthy(deadline, t.mode)
                self.mps.ensure_namespace(t.pod_uid, t.container, t.active_thread_percentage,
                                          max(0.01, deadline - time.monotonic()),
                                          mode=t.mode, pinned_limit_mib=t.limit_mib)
            except Exception as exc:
                return self._mps_failed(exc, fields, f"{pod.namespace}/{pod.name}/{container.name}")
            return None
        try:
            fut.result(timeout)
        except FutureTimeout:
            self.metrics.refusal("mps_unavailable")
            if self.fail_open:
                log.warning("nri fail-open: container starts before its MPS namespace exists", extra=fields)
                return None
            raise RpcError(
                Code.UNAVAILABLE,
                f"fracplugin: MPS namespace for {pod.namespace}/{pod.name}/{container.name} is still being created",
            ) from None
        except Exception as exc:
            self._forget_namespace_job(container.id, fut)
            return self._mps_failed(exc, fields, f"{pod.namespace}/{pod.name}/{container.name}")
        self._forget_namespace_job(container.id, fut)
        return None

    def _forget_namespace_job(self, container_id: str, fut: Future[Any] | None = None) -> set[Owner]:
        """Stop tracking the namespace job of ``container_id`` (only if it is
        ``fut``, when given). Returns its owner (empty set when none was
        tracked). The job itself is not cancelled here: other containers of
        the same owner may await it; ``_release_owners`` drops it when nothing
        holds the owner."""
        with self._ns_lock:
            cur = self._ns_pending.get(container_id)
            if cur is not None and (fut is None or cur[1] is fut):
                del self._ns_pending[container_id]
                return {cur[0]}
        return set()

    def _mps_failed(self, exc: Exception, fields: Mapping[str, Any], who: str) -> None:
        self.metrics.refusal("mps_unavailable")
        if self.fail_open:
            log.warning("nri fail-open: container runs without its MPS namespace", extra={**fields, "reason": str(exc)})
            return None
        raise RpcError(Code.UNAVAILABLE, f"fracplugin: MPS namespace for {who} is not ready: {exc}")

    def close(self) -> None:
        """Stop the background MPS workers without waiting (queued jobs are
        cancelled; a running one ends within its own budget,
        ``namespace_timeout_s`` or ``drain_timeout_s``). A later call queues on
        a new queue."""
        with self._ns_lock:
            q, self._ns_queue = self._ns_queue, None
            self._ns_pending.clear()
            self._ns_made = dict.fromkeys(self._ns_made)  # no queue to have made them any more
        if q is not None:
            q.close()

    def _wait_mps_healthy(self, deadline: float, mode: ComputeMode = ComputeMode.SM_SHARING) -> bool:
        """Absorb a short window where the daemon of ``mode`` is (re)starting:
        when the MPS layer offers ``healthy(mode)``, poll it until ``deadline``
        (the MPS time share of this call). Returns the last answer (True when
        the layer cannot tell); the namespace call reports whatever is still wrong."""
        healthy = getattr(self.mps, "healthy", None)
        if not callable(healthy):
            return True
        pause = 0.01
        while not (ok := bool(healthy(mode))) and time.monotonic() + pause < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        return ok

    def _require_mode_up(self, p: ContainerPlan, ctx: CallContext | None, fields: Mapping[str, Any]) -> None:
        """Refuse (UNAVAILABLE: the runtime retries) a container whose mode's MPS
        daemon is down or crash-looping, after waiting up to half the budget for
        it to come back: without its daemon CUDA runs without MPS and without a
        limit (issue 12). Not with ``fail_open`` (the container runs, warned)."""
        if self._wait_mps_healthy(time.monotonic() + self._mps_timeout(ctx, share=0.5), p.compute_mode):
            return
        why_fn = getattr(self.mps, "unhealthy_reason", None)
        why = why_fn(p.compute_mode) if callable(why_fn) else "not healthy"
        self.metrics.refusal("mps_unavailable")
        log.warning("nri MPS daemon of the container's mode is down", extra={**fields, "mode": p.compute_mode.value,
                                                                           "reason": why})
        if self.fail_open:
            log.warning("nri fail-open: container runs without MPS", extra=dict(fields))
            raise _FailOpen()
        raise RpcError(Code.UNAVAILABLE,
                       f"fracplugin: the {p.compute_mode.value} MPS daemon is down ({why}); "
                       f"{p.pod}/{p.container} is refused until it is back")

    def _refuse(self, err: FractionError, fields: Mapping[str, Any], pod: PodRef, container: str) -> None:
        self.metrics.refusal(err.code)
        if self.on_refusal is not None:
            try:
                self.on_refusal(pod, container, err)
            except Exception:
                log.exception("nri on_refusal callback failed", extra=dict(fields))
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
                                        functools.partial(self._drain_job, container.id, modes, fields), tag=_DRAIN)
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

    def _ns_work(self) -> KeyedWorkQueue:
        """The background MPS work queue (namespace creations and releases,
        keyed by owner; drains, keyed by container id), made on first use (and
        again after ``close``); the caller holds ``_ns_lock``. Its threads keep
        the daemon's CPU priority: StartContainer awaits their namespace jobs
        within its own budget (ADR 0015 says why not lower)."""
        if self._ns_queue is None:
            self._ns_queue = KeyedWorkQueue(workers=_NS_WORKERS, name="nri-mps-ns")
        return self._ns_queue

    def _queue_ensure(self, container_id: str, owner: Owner, job: Callable[[], Any]) -> None:
        """Queue ``job`` (an ensure of ``owner``'s namespace) as the job
        StartContainer of ``container_id`` awaits; the caller holds
        ``_ns_lock``. An ensure of the owner still queued (another container of
        the same pod and name, or a Synchronize renewal) is replaced by this
        newer one and its waiters get this one's outcome (the namespace is the
        owner's); a queued release is replaced (desired state: the namespace
        exists); a job of the owner that runs now finishes first."""
        q = self._ns_work()
        key = ("ns", *owner)
        fut = q.put(key, job, join=q.pending_tag(key) == _ENSURE, tag=_ENSURE)
        self._ns_pending[container_id] = (owner, fut)

    def remove_container(self, pod: Any, container: Any, ctx: CallContext | None = None) -> None:
        """RemoveContainer: release the ledger entries of this container id and,
        in the background, its MPS namespace when nothing else holds it (the
        delete waits on MPS: off the runtime's critical path, issue 12). A drain
        of the container still queued is dropped (its processes are gone)."""
        owners = self._forget_namespace_job(container.id)
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

    def synchronize(self, pods: Sequence[Any], containers: Sequence[Any], ctx: CallContext | None = None) -> list[Any]:
        """Rebuild the ledger from what runs. Returns no updates."""
        pods_by_id = {p.id: p for p in pods}
        tenancies: list[Tenancy] = []
        recorded: set[tuple[str, str]] = set()
        reserved: set[str] = set()
        unadjusted: list[dict[str, Any]] = []
        for c in containers:
            pod = pods_by_id.get(c.pod_sandbox_id)
            if pod is None:
                log.warning("nri sync: container without its pod", extra={"container_id": c.id, "container": c.name})
                continue
            fields = {"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid, "container": c.name, "container_id": c.id}
            key = self._reservation_key(c, fields)
            if key:
                # kubelet's allocation: recorded as it runs, never refused.
                try:
                    p, _ignored = self._plan_reserved_unguarded(pod, c.name, key)
                except FractionError as err:
                    log.warning("nri sync: running container's annotations are refused; recorded request-sized",
                                extra={**fields, "key": err.key, "value": err.value, "rule": err.reason})
                    p = None
                if p is not None:
                    tenancies.extend(al.to_tenancies(p, c.id, door=al.DOOR_ALLOCATE, reservation=key))
                    recorded.add((pod.uid, c.name))
                    reserved.add(key)
                    continue
            try:
                p, adjusted = self._replan(pod, c)
            except FractionError as err:
                log.warning(
                    "nri sync: running container has annotations fracplugin refuses; not recorded",
                    extra={**fields, "key": err.key, "value": err.value, "rule": err.reason},
                )
                continue
            if p is None:
                tenancies.extend(self._unadjusted_gpu_user(pod, c, fields))
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
            tenancies.extend(al.to_tenancies(p, c.id))
            recorded.add((pod.uid, c.name))
        # Keep kubelet's reservations NRI did not re-derive (bound or not:
        # kubelet frees them, not the runtime; PodResources reconciles them)
        # and whole GPUs of other device plugins.
        rebuilt = list(tenancies)
        live = {c.id for c in containers}  # a kept reservation's container the runtime no longer runs is unbound
        self.ledger.transform(lambda cur: rebuilt + unbind_gone([
            t for t in cur if t.door in (al.DOOR_ALLOCATE, al.DOOR_OTHER_PLUGIN) and t.reservation not in reserved],
            live))
        self._renew_namespaces(tenancies)
        self.unadjusted = unadjusted
        self._synced.set()
        log.info(
            "nri synchronized",
            extra={"pods": len(pods), "containers": len(containers), "tenancies": len(tenancies), "unadjusted": len(unadjusted)},
        )
        return []

    def _renew_namespaces(self, tenancies: Sequence[Tenancy]) -> None:
        """After a (re)synchronization, make sure (in the background) that every
        sm-sharing container's MPS namespace exists again: a restarted daemon's
        MPS layer only re-creates the namespaces it was told about. A container
        created but not yet started awaits its job at StartContainer."""
        if not self.defer_namespace:
            return
        seen: set[str] = set()
        with self._ns_lock:  # owners no container holds any more will not be released by us
            self._ns_made = {o: v for o, v in self._ns_made.items() if self.ledger.find(*o)}
        for t in tenancies:
            if not t.mps_namespace or not t.container_id or t.container_id in seen:
                continue
            seen.add(t.container_id)
            with self._ns_lock:
                if t.container_id in self._ns_pending:
                    continue
                fields = {"pod_uid": t.pod_uid, "container": t.container, "container_id": t.container_id}
                self._ns_made.setdefault(t.owner, None)  # the MPS layer (a split MPS role) may hold it from before
                self._queue_ensure(t.container_id, t.owner, functools.partial(
                    self._ensure_job, t.owner, t.active_thread_percentage, fields, t.mode, t.limit_mib))

    def _ensure_job(self, owner: Owner, atp: int | None, fields: Mapping[str, Any],
                    mode: ComputeMode, limit_mib: int | None) -> str:
        """A queued namespace creation: from its start the namespace may
        exist (a later release of the owner must then run)."""
        with self._ns_lock:
            self._ns_made[owner] = None  # not known to be made until this ensure succeeds
        path = self._renew_job(owner[0], owner[1], atp, fields, mode, limit_mib)
        done: Future[Any] = Future()
        done.set_result(path)
        with self._ns_lock:
            if owner in self._ns_made:  # not released meanwhile
                self._ns_made[owner] = ((mode, atp, limit_mib), done)
        return path

    def _renew_job(self, pod_uid: str, container: str, atp: int | None, fields: Mapping[str, Any],
                   mode: ComputeMode = ComputeMode.SM_SHARING, limit_mib: int | None = None) -> str:
        deadline = time.monotonic() + self.namespace_timeout_s
        try:
            self._wait_mps_healthy(deadline, mode)
            return self.mps.ensure_namespace(pod_uid, container, atp, max(0.01, deadline - time.monotonic()),
                                             mode=mode, pinned_limit_mib=limit_mib)
        except Exception as exc:
            log.warning("nri MPS namespace creation failed", extra={**fields, "reason": str(exc)})
            raise

    def _unadjusted_gpu_user(self, pod: Any, c: Any, fields: Mapping[str, Any]) -> list[Tenancy]:
        """A created or running container that fracplugin did not adjust
        (no annotations, no reservation key) but whose env names GPUs of this
        node in ``NVIDIA_VISIBLE_DEVICES`` uses those GPUs unfenced: it holds
        each of them whole (door ``sync``), so placement, the free-memory guard
        and the metrics see it (issue 10 item 5). Released at its
        StopContainer / RemoveContainer."""
        if c.state not in (nri_pb2.CONTAINER_CREATED, nri_pb2.CONTAINER_RUNNING):
            return []
        seen = [d.strip() for d in _env_map(c).get(ENV_VISIBLE_DEVICES, "").split(",") if d.strip()]
        gpus = [self.node.gpu_by_uuid(u) for u in seen]
        if not seen or any(g is None for g in gpus):
            return []
        log.warning("nri sync: container uses GPUs fracplugin did not give it; counted as holding them whole",
                    extra={**fields, "devices": ",".join(seen)})
        return [Tenancy(pod_uid=pod.uid, namespace=pod.namespace, pod_name=pod.name, container=c.name,
                        gpu_uuid=g.uuid, request_mib=g.memory_mib, limit_mib=g.memory_mib,  # type: ignore[union-attr]
                        mode=ComputeMode.TIME_SLICING, container_id=c.id, door=al.DOOR_SYNC,
                        reservation=f"{al.DOOR_SYNC}:{c.id}={g.uuid}")  # type: ignore[union-attr]
                for g in gpus]

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


def _check_mounts(p: ContainerPlan, container: Any, mps_root: str) -> None:
    """Refuse a container that already mounts something at a destination our
    plan mounts the pipe directory on (the pod's own volume at
    ``/tmp/nvidia-mps``): the adjustment would silently replace it (issue 10
    item 8). Raises FractionError naming the mount and the rule.

    A mount whose source is at or below ``mps_root`` is fracplugin's own: the
    device plugin door's Allocate answer, which a real kubelet passes to the
    runtime in the CRI request (issue 11: with both doors on, every container
    with devices of our resource has it); the adjustment replaces it with the
    plan's (same pipe directory, plus ``nosuid,nodev``)."""
    ours = {m.destination.rstrip("/") for m in p.mounts}
    root = mps_root.rstrip("/") + "/"
    for m in container.mounts:
        dest = m.destination.rstrip("/") or "/"
        if dest in ours and m.source and (m.source.rstrip("/") + "/").startswith(root):
            continue
        if dest in ours:
            raise FractionError(
                f"mounts[{m.destination}]", m.source or m.type,
                f"is the container's own mount at {CONTAINER_PIPE_DIR}, where fracplugin mounts the MPS pipe "
                "directory; it would be replaced. Mount the volume elsewhere",
                "mount_conflict",
            )
