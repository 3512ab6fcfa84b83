"""fracplugin's NRI handlers: plan, record and fence each fractional container.

Behaviour, step by step, and the parts ``FracNriPlugin`` delegates to:
docs/architecture.md section 1 (items 8-12; docs/reference/design.md sections
2 and 4). Concurrency model: threads. ``NriStub`` calls these handlers from
its reader thread when ``may_block(method)`` says the call cannot wait, else
from its worker pool, several at once (ADR 0015). The handler holds no
mutable state of its own; each part owns its own, under its own lock. The
ledger is thread-safe and ``Ledger.admit`` re-checks every guard atomically,
so two concurrent creations cannot both take the last MiB of a GPU. Handlers
finish within the stub's budget (``ctx.remaining()``).

Rules kept here:

- the adjustment sets every env var of the plan *by value*, after a removal
  marker ``-KEY`` that clears an earlier plugin's claim on the key so our
  value wins the runtime's merge (``-KEY`` alone would not remove a value the
  pod spec set, docs/reference/nri-protocol.md section 1.8);
- a refusal (``FractionError``) is answered with the status of its kind
  (``noderules.status_of``) and ``err.message`` (key, value, rule), shown by
  ``kubectl describe pod``, and handed to ``on_refusal``; an MPS failure is
  UNAVAILABLE; with ``fail_open`` the container is left unadjusted instead;
- the plugin registers at once, even while the MPS daemons are starting: an
  sm-sharing container started in that window fails its StartContainer with
  UNAVAILABLE and kubelet retries it, whereas an unregistered plugin is not
  asked and every container created meanwhile would run unfenced.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from .._proto import nri_pb2
from .. import allocation as al
from ..cdi import CdiRegistry, container_cdi_devices, with_node_cdi_devices
from ..annotations import parse
from ..model import ComputeMode, ContainerPlan, FractionError, FractionRequest, PodRef
from ..mps.api import MpsApi, NullMps
from ..ports import HookMetrics, NoMetrics
from ..reservations import ENV_RESERVATION_PROOF
from ..noderules import NodeRules, status_of
from .interfaces import (
    AbandonedInterface,
    CallContext,
    CloseInterface,
    CreateContainerInterface,
    MayBlockInterface,
    RemoveContainerInterface,
    RemovePodInterface,
    RunPodInterface,
    StartContainerInterface,
    StopContainerInterface,
    SynchronizeInterface,
    event_mask,
)
from .admission import MountSources, PodReader, _check_mounts, warn_unenforced
from .early import early_plans
from .mpscalls import MpsCalls
from .namespaces import Namespaces
from .pluginbase import DoorSettings, _FailOpen, _pod_ref
from .reconcile import Reconciler, Unfenced
from .release import Releases
from .ttrpc import RpcError
from ..logs import guarded

log = logging.getLogger(__name__)

NRI_EVENTS_EARLY = event_mask(nri_pb2.CREATE_CONTAINER, nri_pb2.STOP_CONTAINER, nri_pb2.REMOVE_CONTAINER,
                              nri_pb2.START_CONTAINER, nri_pb2.RUN_POD_SANDBOX, nri_pb2.REMOVE_POD_SANDBOX)
"""0x62d, the subscription mask (docs/reference/nri-protocol.md 1.4): Create|Stop|RemoveContainer
(0x608), StartContainer (0x20: the MPS namespace is awaited), RunPodSandbox and RemovePodSandbox
(``nri/early.py``, ADR 0030; a v0.8 runtime sends both as StateChange)."""


def build_adjustment(plan_: ContainerPlan,
                     adj: nri_pb2.ContainerAdjustment | None = None) -> nri_pb2.ContainerAdjustment:
    """The ``ContainerAdjustment`` of a plan: for each env key ``-KEY`` then
    ``KEY=value`` (plan order), and each mount as ``type: bind`` with
    ``Mount.options`` (``rbind``, ``rw``/``ro``, ``nosuid``, ``nodev``), and
    each of the plan's CDI device names as ``CDI_devices`` (field 8, NRI
    v0.7+; the runtime resolves it from its CDI spec dirs, ADR 0005).
    ``adj``: the message to fill (a response's ``adjust``: filled in place,
    not copied into it); default a new one."""
    adj = nri_pb2.ContainerAdjustment() if adj is None else adj
    adj.MergeFromString(_env_adjustment(tuple(plan_.env.items())))
    for m in plan_.mounts:
        adj.mounts.add(destination=m.destination, type="bind", source=m.source, options=list(m.options))
    for name in plan_.cdi_devices:
        adj.CDI_devices.add(name=name)
    return adj


_PROOF_REMOVAL = (nri_pb2.KeyValue(key="-" + ENV_RESERVATION_PROOF), nri_pb2.KeyValue(key=ENV_RESERVATION_PROOF, value=""))
"""The reservation proof taken out of a container's env once checked (ADR 0033): the removal,
which containerd does not forward for a variable kubelet added (docs/reference/nri-protocol.md,
"Env removal caveat"), then the key set empty, which it does (a bound reservation no longer needs
it: reservations rule 1)."""


@functools.lru_cache(maxsize=1024)
def _env_adjustment(env: tuple[tuple[str, str], ...]) -> bytes:
    """The serialized ``ContainerAdjustment`` holding only ``build_adjustment``'s
    env part for ``env``, cached: the env depends on the GPUs, the MiB and the
    portion, not on the pod, so plans share it (issue 14)."""
    adj = nri_pb2.ContainerAdjustment()
    for key, value in env:
        adj.env.add(key="-" + key)
        adj.env.add(key=key, value=str(value))
    return adj.SerializeToString()


class FracNriPlugin(CreateContainerInterface, StartContainerInterface, StopContainerInterface,
                    RemoveContainerInterface, SynchronizeInterface, AbandonedInterface, MayBlockInterface,
                    CloseInterface, RunPodInterface, RemovePodInterface):
    """The handler object ``NriStub`` drives: the NRI interface methods, each
    delegating to the part that owns the work (``reader``, ``mounts``,
    ``calls``, ``namespaces``, ``releases``, ``reconciler``: docs/architecture.md
    section 1), sharing ``settings`` (``pluginbase.DoorSettings``). Its bases
    are the ``nri.interfaces`` Protocols it implements, so mypy checks every
    handler method against the protobuf messages they declare (issue 26 item 3).

    Args:
        rules: the node's rules (``noderules.NodeRules``: its GPUs, the one
            ledger, the planner settings, GPU health, the memory-limit gate);
            CreateContainer admits through ``rules.admit``.
        mps: the MPS layer (``ensure_namespace``/``release_namespace``/``drain``);
            None = ``mps.api.NullMps``.
        metrics: ``observe_hook("nri", seconds)`` per CreateContainer and
            ``refusal(code)`` per refusal; None = ``NoMetrics``.
        fail_open: refusals and MPS failures leave the container unadjusted
            (warning logged, refusal still counted) instead of failing it.
        start_wait_s: most seconds StartContainer waits for a namespace still
            being made (never past its handler budget); then the container
            starts and the log says so (ADR 0028; ``--nri-start-wait-s``).
        on_refusal: ``f(pod: PodRef, container: str, err: FractionError)``
            called for every refusal of CreateContainer (also with
            ``fail_open``), in the handler thread, before the answer is sent:
            it must only enqueue (``EventRecorder.refused``); an exception it
            raises is logged and ignored.
        on_warning: ``f(pod, container, message)`` for an annotation that was
            not applied; same rules (``EventRecorder.warned``).
        pod_lookup: ``f(namespace, name) -> pod dict | None`` (the pod
            watch's cache): with the pod's spec, pod-level KAI forms apply to
            the named or the first app container only and annotations naming
            no container are reported, as ``fracplugin explain`` does. None:
            one container at a time (ADR 0001 item 6).
        pod_ready: ``f() -> bool``, whether the pod watch behind
            ``pod_lookup`` is synced (the pod source's ``ready``): while it
            is not, a pod whose spec is needed and unknown is planned alone
            instead of refused (``pod_checks.spec_unknown``). None: synced.
        unit_mib: MiB per device of the device plugin door (``--device-unit-mib``),
            to read a reservation key (ADR 0007).
        resource_name: the extended resource (named in messages).
        cdi: the node's CDI specs (``cdi.CdiRegistry``): the adjustment also
            requests each planned GPU's CDI device, unless the container
            already has one for that GPU (``cdi.with_node_cdi_devices``;
            ADR 0025b). None: only the CDI names the scheduler wrote.
        unfenced: ``reconcile.Unfenced`` (None: report, no Events).
    """

    def __init__(
        self,
        rules: NodeRules,
        mps: MpsApi | None = None,
        metrics: HookMetrics | None = None,
        fail_open: bool = False,
        *,
        on_refusal: Callable[[PodRef, str, FractionError], None] | None = None,
        on_warning: Callable[[PodRef, str, str], None] | None = None,
        pod_lookup: Callable[[str, str], Mapping[str, Any] | None] | None = None,
        pod_ready: Callable[[], bool] | None = None,
        unit_mib: int = 1024,
        resource_name: str = "fracplugin.io/gpu-memory",
        cdi: CdiRegistry | None = None,
        start_wait_s: float = 1.0,
        unfenced: Unfenced | None = None,
    ) -> None:
        self.rules = rules
        self.settings = DoorSettings(fail_open=fail_open, start_wait_s=start_wait_s)
        self.cdi = cdi
        """Each planned GPU's CDI device joins the adjustment (ADR 0025b); None: not."""
        self.on_refusal = on_refusal
        self.metrics: HookMetrics = metrics if metrics is not None else NoMetrics()
        self.events = NRI_EVENTS_EARLY
        """Subscription mask sent in ConfigureResponse (0x62d)."""
        self.calls = MpsCalls(mps if mps is not None else NullMps(), self.metrics, self.settings)
        self.namespaces = Namespaces(rules.ledger, self.calls, self.settings)
        self.reader = PodReader(rules, self.settings, pod_lookup=pod_lookup, pod_ready=pod_ready,
                                on_warning=on_warning, unit_mib=unit_mib, resource_name=resource_name)
        self.mounts = MountSources(rules.config.layout.root, self.metrics, self.settings)
        self.releases = Releases(rules, self.namespaces, self.calls)
        self.reconciler = Reconciler(rules, self.reader, self.namespaces, self.calls.mps, unfenced)
        subscribe = getattr(self.calls.mps, "subscribe", None)
        if callable(subscribe):  # a daemon healthy again (fresh daemons of a new MPS role): re-ensure, ADR 0034
            subscribe(self._mps_back)

    def _mps_back(self, mode: ComputeMode, healthy: bool) -> None:
        """The MPS layer's health callback: when the daemon of ``mode`` is healthy again (a restart, or a
        new MPS role whose fresh daemons know no namespace: keeper SIGTERM, ADR 0034), re-ensure the
        namespaces of the running containers of that mode at once, as Synchronize does (before the first
        Synchronize the ledger is not the runtime's yet: Synchronize does it). Only queues; never raises."""
        if healthy and self.reconciler.ready():
            try:
                mode = ComputeMode(mode)
                self.namespaces.renew([t for t in self.rules.ledger.tenancies() if t.mode is mode])
            except Exception:
                log.exception("nri MPS namespaces not re-ensured after the daemon came back", extra={"mode": mode})

    # -------------------------------------------------------------- status

    def ready(self) -> bool:
        """True after the first Synchronize rebuilt the ledger."""
        return self.reconciler.ready()

    def status(self) -> dict[str, Any]:
        """JSON-able state: ``{"ready", "fail_open", "events", "pending_namespaces"
        (containers whose MPS namespace job is not done), "early_namespaces"
        (``Namespaces.early_status()``), "mps_jobs" (the MPS work queue's
        ``{"queued", "running", "threads"}``), "unadjusted" (what the last
        Synchronize reported), "unfenced" (``Reconciler.unfenced_status()``)}``."""
        ns = self.namespaces.status()
        return {
            "ready": self.ready(),
            "fail_open": self.settings.fail_open,
            "events": f"0x{self.events:x}",
            "pending_namespaces": ns["pending"],
            "early_namespaces": self.namespaces.early_status(),
            "mps_jobs": ns["jobs"],
            "unadjusted": list(self.reconciler.unadjusted),
            "unfenced": self.reconciler.unfenced_status(),
        }

    def may_block(self, method: str) -> bool:
        """Whether serving ``method`` may wait now (``interfaces.MayBlockInterface``;
        ``NriStub`` serves the calls that cannot on its reader thread).
        CreateContainer waits only for an MPS daemon that is not healthy
        (``MpsCalls.require_up``); RemoveContainer, RunPodSandbox and
        RemovePodSandbox never wait (their MPS work runs in the background);
        the others may (a namespace, a drain, the whole node)."""
        if method == "CreateContainer":
            return not self.calls.all_up()
        return method not in ("RemoveContainer", "RunPodSandbox", "RemovePodSandbox")

    # ------------------------------------------------------------ handlers

    def create_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                         ctx: CallContext | None = None) -> nri_pb2.CreateContainerResponse | None:
        """CreateContainer (docs/architecture.md section 1 item 8): a
        ``CreateContainerResponse``, None when the container is not fractional
        or ``fail_open`` swallowed a refusal. A container with a reservation
        key from Allocate (ADR 0007) gets kubelet's allocation plus what its
        annotations add; others are planned from the annotations. Raises
        ``RpcError``: a refusal with its kind's status
        (``noderules.status_of``), or UNAVAILABLE (MPS)."""
        start = time.monotonic()
        ref = _pod_ref(pod)
        fields = {"pod": str(ref), "pod_uid": ref.uid, "container": container.name, "container_id": container.id}
        config = self.rules.config
        try:
            try:
                key, apps = self.reader.read(pod, container, ref, fields)
                ignored: list[Any] = []
                req: FractionRequest | None
                if key:
                    req, ignored = self.reader.reserved_request(pod, container.name, key, apps)
                else:
                    req = parse(pod.annotations, container.name, prefix=config.annotation_prefix, containers=apps)
                if req is None:
                    log.debug("nri container not fractional; untouched", extra=fields)
                    return None

                def check(plan: ContainerPlan) -> None:  # this door's own look at the plan, before the gate
                    self.calls.require_up(plan, ctx, fields)
                    _check_mounts(plan, container, config.layout.root)
                    self.mounts.ensure(plan, fields)

                p = self.rules.admit(req, ref, door=al.DOOR_ALLOCATE if key else al.DOOR_NRI,
                                     container_id=container.id, reservation=self.reader.hold(key), check=check)
                if p.mps_namespace is not None:  # MPS v3: made in the background, StartContainer waits
                    self.namespaces.start(p, container.id, fields)
            except FractionError as err:
                self._refuse(err, fields, ref, container.name)  # raises unless fail_open
                return None
            except _FailOpen:
                return None
            for i in ignored:
                self.reader.warn(ref, container.name, i.message, fields, key=i.key, value=i.value)
            warn_unenforced(p, container, fields)
            if self.cdi is not None:  # the node's CDI device of each GPU, never twice (ADR 0025b)
                p = with_node_cdi_devices(p, self.cdi, container_cdi_devices(container))
            # DEBUG: a log record per creation costs ~0.1 ms (bench_nri); admissions show in the ledger and /status
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
            resp = nri_pb2.CreateContainerResponse()
            build_adjustment(p, resp.adjust)
            if key:  # the proof was checked: out of the container's env (ADR 0033)
                resp.adjust.env.extend(_PROOF_REMOVAL)
            return resp
        finally:
            self.metrics.observe_hook("nri", time.monotonic() - start)

    def _refuse(self, err: FractionError, fields: Mapping[str, Any], pod: PodRef, container: str) -> None:
        """Count and report a refusal (``on_refusal``); raise its status
        (``noderules.status_of``) unless ``fail_open``."""
        self.metrics.refusal(err.code)
        if self.on_refusal is not None:
            guarded(log, "nri on_refusal callback", self.on_refusal, pod, container, err, extra=dict(fields))
        extra = {**fields, "key": err.key, "value": err.value, "rule": err.reason, "code": err.code}
        if self.settings.fail_open:
            log.warning("nri refusal ignored (fail-open): container runs unfenced", extra=extra)
            return None
        log.warning("nri container refused", extra=extra)
        raise RpcError(status_of(err.code), err.message)

    def start_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                        ctx: CallContext | None = None) -> None:
        """StartContainer: with the memory-limit gate the container's CUDA
        memory limits are applied/verified first (``NriMemoryLimits.start``);
        then the wait for its MPS namespace job (``Namespaces.await_start``,
        ADR 0028)."""
        if self.rules.limits is not None:
            self.rules.limits.start(pod, container, self.rules.ledger)
        return self.namespaces.await_start(pod, container, ctx)

    def stop_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                       ctx: CallContext | None = None) -> None:
        """StopContainer: drain, then release the container's holds (``Releases.stop``)."""
        return self.releases.stop(pod, container, ctx)

    def remove_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container,
                         ctx: CallContext | None = None) -> None:
        """RemoveContainer: release the container and, in the background, the
        MPS namespaces nothing holds any more (``Releases.remove``)."""
        return self.releases.remove(pod, container)

    def abandoned(self, method: str, request: Any, response: Any) -> None:
        """The stub dropped our late CreateContainer answer: undo its
        admission (``Releases.abandoned``)."""
        return self.releases.abandoned(method, request, response)

    def synchronize(self, pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container],
                    ctx: CallContext | None = None) -> list[nri_pb2.ContainerUpdate]:
        """Synchronize (``Reconciler.synchronize``: the ledger rebuilt, the
        early namespaces of pods gone released, the MPS layer's namespaces
        reconciled). Returns no updates."""
        self.reconciler.synchronize(pods, containers)
        return []

    def run_pod_sandbox(self, pod: nri_pb2.PodSandbox, ctx: CallContext | None = None) -> None:
        """RunPodSandbox: queue the pod's early namespace ensures
        (``nri/early.py``). Never raises: errors are logged, the sandbox goes on."""
        try:
            self.namespaces.queue_early(pod.id, early_plans(self.rules, pod, self.calls.up))
        except Exception:
            log.exception("nri RunPodSandbox: early MPS namespaces not queued",
                          extra={"pod": f"{pod.namespace}/{pod.name}", "pod_uid": pod.uid})

    def remove_pod_sandbox(self, pod: nri_pb2.PodSandbox, ctx: CallContext | None = None) -> None:
        """RemovePodSandbox: release the early namespaces of this sandbox
        that no container ever held (in the background; never raises). An
        entry a newer sandbox of the same pod claimed (kubelet recreates a
        dead sandbox, then removes the old one) stays."""
        self.namespaces.release_early(lambda uid, sandbox: uid == pod.uid and sandbox == pod.id)

    def close(self) -> None:
        """Stop the background MPS workers without waiting
        (``Namespaces.close``; a later call queues on a new queue) and the
        unfenced containers' re-check (``Reconciler.close``)."""
        self.namespaces.close()
        self.reconciler.close()

