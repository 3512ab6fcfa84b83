"""CreateContainer's reading of the pod (``PodReader``) and the plan's mounts
(``MountSources``, ``_check_mounts``): docs/architecture.md section 1; the
concurrency model: ``nri/plugin.py``'s module docstring.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Any, Callable, Mapping, Sequence

from .._proto import nri_pb2
from .. import allocation as al
from ..annotations import form_targets, stray_container_keys
from ..model import ContainerPlan, FractionError, FractionRequest, PodRef
from ..mps.layout import CONTAINER_PIPE_DIR
from ..mps.supervisor import make_dir
from ..noderules import NodeRules
from ..planner import ENFORCED_ENV_KEYS
from ..ports import HookMetrics
from ..reservations import claim_problem, hold_of, proof_of
from .pod_checks import lint_pod, spec_unknown
from .ttrpc import Code, RpcError
from .pluginbase import DoorSettings, _FailOpen, _pod_ref, needs_spec
from ..logs import guarded

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log


class PodReader:
    """CreateContainer's reading of the pod (module docstring). Args as
    ``FracNriPlugin``'s of the same names; ``pod_ready`` says whether the
    pod watch behind ``pod_lookup`` is synced (None: it is taken as synced)."""

    def __init__(self, rules: NodeRules, settings: DoorSettings, *,
                 pod_lookup: Callable[[str, str], Mapping[str, Any] | None] | None = None,
                 pod_ready: Callable[[], bool] | None = None,
                 on_warning: Callable[[PodRef, str, str], None] | None = None,
                 unit_mib: int = 1024, resource_name: str = "fracplugin.io/gpu-memory") -> None:
        self.rules = rules
        self.node = rules.node
        self.ledger = rules.ledger
        self.config = rules.config
        self.settings = settings
        self.pod_lookup = pod_lookup
        self.pod_ready = pod_ready
        self.on_warning = on_warning
        self.unit_mib = unit_mib
        self.resource_name = resource_name
        self._warned_pods: dict[str, None] = {}  # pods whose stray annotations were checked
        self._linted: dict[Any, None] = {}  # pods and (pod, container)s linted (pod_checks.lint_pod)

    def reservation_key(self, container: nri_pb2.Container, fields: Mapping[str, Any], strict: bool = False) -> str:
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
            by_gpu, problem = al.parse_reservation_key(key), ""
        except al.ReservationKeyError as exc:
            by_gpu, problem = {}, f"is not a reservation key: {exc}"
        for uuid, indices in by_gpu.items():
            gpu = self.node.gpu_by_uuid(uuid)
            if gpu is None or max(indices) >= gpu.memory_mib // self.unit_mib:
                problem = f"names devices node {self.node.name} does not advertise: no Allocate of this node made it"
        if not problem:
            return key
        if strict:  # a key no Allocate of ours made is refused, not ignored (issue 25 item 4)
            raise FractionError(al.ENV_RESERVATION, key[:200], problem, "reservation")
        log.warning("nri reservation key ignored", extra={**fields, "reason": f"{key[:120]} {problem}"})
        return ""

    def _spec_names(self, pod: nri_pb2.PodSandbox, container: str = "") -> tuple[list[str] | None, list[str] | None]:
        """``_containers_of`` only when it matters (the hot path stays a dict
        lookup): the pod has pod-level KAI forms without a container name, or
        per-container keys not yet checked for strays."""
        if self.pod_lookup is None:
            return None, None
        annotations = pod.annotations
        # the spec decides: which container is first, or whether the named one exists (issue 25 items 1, 2)
        pod_level = needs_spec(annotations, container)
        unchecked = pod.uid not in self._warned_pods and any(
            k.startswith(self.config.annotation_prefix) for k in annotations) if self.config.annotation_prefix else False
        if not (pod_level or unchecked):
            return None, None
        got = self._containers_of(pod)
        if pod_level and got[0] is None:
            spec_unknown(pod, pod_ready=self.pod_ready, fail_open=self.settings.fail_open)
        return got

    def _containers_of(self, pod: nri_pb2.PodSandbox) -> tuple[list[str] | None, list[str] | None]:
        """(the containers the pod-level forms may apply to: app containers,
        then native sidecars, ``annotations.form_targets``; init + app names)
        from the pod's spec when ``pod_lookup`` knows the pod, else (None, None)."""
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
        return form_targets(spec), inits + apps

    def _warn_stray(self, pod: nri_pb2.PodSandbox, ref: PodRef, container: str, everyone: Sequence[str],
                    fields: Mapping[str, Any]) -> None:
        """Annotations naming no container of the pod: a Warning once per pod
        (the same words as ``fracplugin explain``)."""
        if pod.uid in self._warned_pods:
            return
        self._warned_pods[pod.uid] = None  # checked (the pod's spec was known)
        while len(self._warned_pods) > 4096:
            self._warned_pods.pop(next(iter(self._warned_pods)))
        for k in stray_container_keys(dict(pod.annotations), self.config.annotation_prefix, everyone):
            self.warn(ref, container, f'{k}="{pod.annotations[k]}" names no container of this pod '
                       f"(containers: {', '.join(everyone)}); it has no effect", fields, key=k,
                       value=pod.annotations[k])

    def read(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container, ref: PodRef,
             fields: Mapping[str, Any]) -> tuple[str, list[str] | None]:
        """CreateContainer's reading of the pod: (the reservation key this
        container claims, "" for none; the containers the pod-level forms may
        apply to, app containers then native sidecars, None when its spec is
        not read). Raises FractionError for a key it may not
        claim (forged, unknown, another's, no proof; ADR 0024) and RpcError
        UNAVAILABLE while a needed spec is not known (``pod_checks.spec_unknown``).
        Stray and unread annotations are warned about once (issue 25 item 3)."""
        key = self.reservation_key(container, fields, strict=True)
        if key:  # reservations.claim_problem; a transient reservation_pending code: ADR 0033
            err = claim_problem(self.ledger, key, ref.uid, proof_of(container.annotations, container.env),
                                self.node.name, pod_name=f"{ref.namespace}/{ref.name}")
            if err is not None:
                raise err
        apps, everyone = self._spec_names(pod, container.name)
        if everyone is not None:
            self._warn_stray(pod, ref, container.name, everyone, fields)
        # keys fracplugin does not read and forms it ignores (annotation_lint; issue 25 item 3), once per
        # pod and container
        lint_pod(self._linted, self.warn, self.config.annotation_prefix, pod, ref, container.name, apps,
                 everyone, fields)
        return key, apps

    def hold(self, key: str) -> str:
        """The reservation the ledger records ``key``'s container under: the
        key, or the hold it is an alias of (an init container's devices given
        again with more or fewer to the app container: one hold, memory counted
        once; ``reservations.hold_of``, ADR 0033)."""
        return hold_of(self.ledger, key)

    def reserved_request(self, pod: nri_pb2.PodSandbox, container: str, key: str,
                         apps: Sequence[str] | None) -> tuple[FractionRequest, list[Any]]:
        """The request of a container under kubelet's reservation ``key``
        (its GPUs and count; the limit, mode and portion its annotations add)
        and the annotations not applied. Raises FractionError for annotations
        that break the contract (who may claim ``key`` is ``read``'s check)."""
        by_gpu = al.parse_reservation_key(key)
        gpus = sorted((self.node.gpu_by_uuid(u) for u in by_gpu), key=lambda g: g.index)  # type: ignore[union-attr]
        uuids = [g.uuid for g in gpus]  # type: ignore[union-attr]
        per = len(next(iter(by_gpu.values()))) * self.unit_mib
        count = sum(len(v) for v in by_gpu.values())
        parsed = al.parse_for_kubelet(dict(pod.annotations), container, per, prefix=self.config.annotation_prefix,
                                      containers=apps)
        return al.kubelet_request(
            container, uuids, per, count, parsed, f"resources.limits[{self.resource_name}]",
            gpu_memory_mib=min(g.memory_mib for g in gpus), reserve_mib=self.config.reserve_mib)  # type: ignore[union-attr]

    def plan_running_reserved(self, pod: nri_pb2.PodSandbox, container: str, key: str) -> tuple[ContainerPlan, list[Any]]:
        """The plan of a running container under reservation ``key`` (what
        runs is recorded: ``NodeRules.replan``)."""
        apps, _ = self._containers_of(pod)
        ref = _pod_ref(pod)
        req, ignored = self.reserved_request(pod, container, key, apps)
        return self.rules.replan(req, ref, reservation=key), ignored

    def warn(self, ref: PodRef, container: str, message: str, fields: Mapping[str, Any], **extra: Any) -> None:
        """Log ``nri annotation not applied`` and hand the message to ``on_warning``."""
        log.warning("nri annotation not applied", extra={**fields, **extra, "reason": message})
        if self.on_warning is not None:
            guarded(log, "nri on_warning callback", self.on_warning, ref, container, message, extra=dict(fields))


class MountSources:
    """The bind-mount sources (MPS pipe directories) this door made, so that
    a later plan with the same source costs one ``stat`` (``_made_before``);
    owns that memory (insertion order: oldest first, at most 4096)."""

    def __init__(self, mps_root: str, metrics: HookMetrics, settings: DoorSettings) -> None:
        self.mps_root = mps_root
        self.metrics = metrics
        self.settings = settings
        self._made_sources: dict[str, None] = {}

    def ensure(self, p: ContainerPlan, fields: Mapping[str, Any]) -> None:
        """Create every bind-mount source of ``p`` (mode 0755) before answering:
        the runtime bind-mounts them at task creation, before StartContainer,
        and a missing one fails the container ("stat <dir>: no such file or
        directory", containerd 2.3); MPS later creates its sockets inside.
        Raises RpcError UNAVAILABLE (or _FailOpen) when one cannot be made.
        """
        for m in p.mounts:
            if self._made_before(m.source):
                continue
            try:
                make_dir(m.source, self.mps_root)  # 0755 whatever the umask (issue 12)
                self._made_sources[m.source] = None
                while len(self._made_sources) > 4096:
                    self._made_sources.pop(next(iter(self._made_sources)), None)
            except OSError as exc:
                self.metrics.refusal("mps_unavailable")
                log.warning("nri cannot create a mount source", extra={**fields, "path": m.source, "reason": str(exc)})
                if self.settings.fail_open:
                    raise _FailOpen() from None
                raise RpcError(
                    Code.UNAVAILABLE,
                    f"fracplugin: cannot create the MPS pipe directory {m.source} for {p.pod}/{p.container}: {exc}",
                ) from None

    def _made_before(self, path: str) -> bool:
        """``path`` is a mount source ``make_dir`` made before and still a 0755
        directory (the MPS layer may remove a released namespace's at any
        time): one ``stat`` instead of ``make_dir``'s walk (issue 14)."""
        if path not in self._made_sources:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755


def warn_unenforced(p: ContainerPlan, container: nri_pb2.Container, fields: Mapping[str, Any]) -> None:
    """Pod-authored values of keys we own but do not set in this plan
    (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE without a portion) stay: NRI
    cannot remove env the pod spec set. Say so."""
    missing = [k for k in ENFORCED_ENV_KEYS if k not in p.env]
    env = {kv.partition("=")[0] for kv in container.env} if missing else ()
    left = [k for k in missing if k in env]
    if left:
        log.warning("nri pod sets env that fracplugin owns but does not set here", extra={**fields, "keys": left})


def _check_mounts(p: ContainerPlan, container: nri_pb2.Container, mps_root: str) -> None:
    """Refuse a container that already mounts something where our plan mounts
    the pipe directory (the pod's own volume at ``/tmp/nvidia-mps``): the
    adjustment would silently replace it (issue 10 item 8). Raises
    FractionError naming the mount and the rule. A mount whose source is at or
    below ``mps_root`` is ours (the device plugin door's Allocate answer,
    issue 11): the plan's replaces it."""
    if not container.mounts:
        return
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
