"""The NRI door's side of memory-limit enforcement (issue 23 item 3; rules: ADR 0025 decisions 2-3, ADR 0031
item 7 for DRA containers, ADR 0036 for the soft-limit zeroing).

``NriMemoryLimits`` is what ``FracNriPlugin`` calls: ``admit`` at CreateContainer, ``start`` at
StartContainer (soft = request, hard = limit on the container's leaf cgroup; a limit not enforced is
reported: status, metric, Warning Event ``MemoryLimitNotEnforced``), ``remove`` at RemoveContainer and
``adopt`` after Synchronize. While the node lacks what the toolkit's ``apply-cuda-memory-limits`` hook fails
on (``HOOK_FAILS_ON``) the hook's env (``HOOK_ENV``) is withheld: it would fail the container's start.
Nothing here lets an exception other than the refusals out.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

from .._proto import nri_pb2
from ..dra import claim_tenancies
from ..logs import guarded
from ..model import ContainerPlan, FractionError, PodRef, Tenancy
from ..planner import ENV_MEMORY_LIMIT, ENV_MEMORY_REQUEST
from .capability import NodeCapabilities
from ..rpcstatus import StatusCode as Code
from .memlimits import LIMIT_MAX, MIB, ContainerLimits, LimitPolicy, MemoryLimitEnforcer, plan_gpus

if TYPE_CHECKING:
    from ..ledger import Ledger

log = logging.getLogger(__name__)

REFUSAL_CODE = "memory_limits_unenforceable"

HOOK_ENV = (ENV_MEMORY_REQUEST, ENV_MEMORY_LIMIT)
"""What the toolkit hook reads (both needed, else it does nothing)."""

HOOK_FAILS_ON = ("driver", "cgroup_v2", "memory_accounting", "mig_off")
"""Capabilities whose absence makes the toolkit hook fail the container's start."""


class LimitGate:
    """The memory-limit step of every door's admission (``NodeRules.gate``, ADR 0025 decision 3): a plan
    refused under policy refuse while the node cannot enforce, else answered without the toolkit hook's env
    where the hook would fail the start. Also what ``explain`` builds from a node file.

    Args:
        policy: warn or refuse.
        capabilities: ``() -> NodeCapabilities`` (the node's gate): why it cannot enforce, and which env the
            toolkit hook must not get."""

    def __init__(self, policy: LimitPolicy, capabilities: Callable[[], NodeCapabilities]) -> None:
        self.policy = policy
        self.capabilities = capabilities

    def withheld_keys(self) -> tuple[str, ...]:
        """Env keys not handed to containers now (``HOOK_ENV`` while a
        capability in ``HOOK_FAILS_ON`` is missing; else none)."""
        return HOOK_ENV if any(c.name in HOOK_FAILS_ON for c in self.capabilities().missing) else ()

    def admit(self, plan: ContainerPlan) -> ContainerPlan:
        """The plan to answer with (``withheld_keys`` removed from its env).
        Raises FractionError (key ``node``, code ``REFUSAL_CODE``) when the policy refuses and the node cannot
        enforce."""
        if self.policy is LimitPolicy.REFUSE:
            why = self.capabilities().reason
            if why:
                raise FractionError("node", None, f"{why} (--memory-limits-policy refuse; --memory-limits off "
                                                  f"admits fractional pods here without CUDA memory limits)",
                                    code=REFUSAL_CODE)
        withheld = self.withheld_keys()
        if withheld and any(k in plan.env for k in withheld):
            return dataclasses.replace(plan, env={k: v for k, v in plan.env.items() if k not in withheld})
        return plan


class NriMemoryLimits(LimitGate):
    """The gate (``LimitGate``) and the apply/verify of each container's limits. Args, beside the gate's:
        enforcer: the per-container apply/verify engine.
        observe: ``f(seconds)`` per StartContainer apply/verify (a histogram).
        on_not_enforced: ``f(pod ref, container, message)`` when a started
            container's limit is not in force (the ``MemoryLimitNotEnforced``
            Warning Event); must not block; its exceptions are logged.

    Built with ``--memory-limits`` not off only (``wiring.MemoryLimits``)."""

    def __init__(self, enforcer: MemoryLimitEnforcer, policy: LimitPolicy, observe: Callable[[float], None],
                 on_not_enforced: Callable[[PodRef, str, str], None] | None,
                 capabilities: Callable[[], NodeCapabilities]) -> None:
        super().__init__(policy, capabilities)
        self.enforcer = enforcer
        self.observe = observe
        self.on_not_enforced = on_not_enforced

    def start(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container, ledger: Ledger) -> ContainerLimits | None:
        """Apply/verify for a container the ledger holds by container id, or
        whose DRA claim it holds (``held_tenancies``). Raises ``RpcError``
        FAILED_PRECONDITION when not enforced and the policy refuses."""
        gpus = plan_gpus(held_tenancies(container, ledger))
        if not gpus:
            return None
        t0 = time.perf_counter()
        res = self.enforcer.start(container.id, _cgroups_path(container), gpus,
                                  pod=f"{pod.namespace}/{pod.name}", container=container.name)
        self.observe(time.perf_counter() - t0)
        if res is None or res.enforced == "yes":
            return res
        fields = {"pod": res.pod, "container": res.container, "container_id": container.id, "cgroup": res.cgroup,
                  "reason": res.why, "enforced": res.enforced}
        if self.policy is LimitPolicy.REFUSE:
            self._report(pod, res)
            from ..nri.ttrpc import RpcError  # noqa: PLC0415

            log.warning("memory limit not enforced: start refused", extra=fields)
            raise RpcError(Code.FAILED_PRECONDITION,
                           f"fracplugin: GPU memory limit of {res.pod}/{res.container} is not enforced: {res.why}")
        self._report(pod, res)
        log.warning("memory limit not enforced: container starts (policy warn)", extra=fields)
        return res

    def _report(self, pod: nri_pb2.PodSandbox, res: ContainerLimits) -> None:
        if self.on_not_enforced is not None:
            guarded(log, "memory limits: on_not_enforced", self.on_not_enforced,
                    PodRef(namespace=pod.namespace, name=pod.name, uid=pod.uid), res.container,
                    not_enforced_message(res))

    def adopt(self, pods: Iterable[nri_pb2.PodSandbox], containers: Iterable[nri_pb2.Container],
              ledger: Ledger) -> None:
        """Start (apply/verify, no Event) the running containers with held
        GPUs and no kept result, in a background thread: the leaf watch
        then zeroes their soft limits when they end (ADR 0036)."""
        names = {getattr(p, "id", ""): f"{p.namespace}/{p.name}" for p in pods}
        todo = [(c, names.get(getattr(c, "pod_sandbox_id", ""), ""), gpus) for c in containers
                if getattr(c, "state", 0) == nri_pb2.CONTAINER_RUNNING and self.enforcer.result(c.id) is None
                and (gpus := plan_gpus(held_tenancies(c, ledger)))]

        def run() -> None:
            for c, pod, gpus in todo:
                self.enforcer.start(c.id, _cgroups_path(c), gpus, pod=pod, container=c.name)
        if todo:
            threading.Thread(target=run, name="memory-limits-adopt", daemon=True).start()

    def remove(self, container: nri_pb2.Container, gpus: Callable[[], Iterable[str]] | None = None) -> None:
        """Zero the soft limit of a removed container (never raises). Without
        a result kept from its start (started before this daemon), its leaf
        from ``linux.cgroups_path`` is checked on every GPU of ``gpus()``
        (UUIDs)."""
        all_gpus = list(gpus()) if gpus is not None and self.enforcer.result(container.id) is None else []
        self.enforcer.remove(container.id, _cgroups_path(container), all_gpus)


def _cgroups_path(container: nri_pb2.Container) -> str:
    """NRI ``linux.cgroups_path`` of the container ("" when it has none)."""
    return str(getattr(getattr(container, "linux", None), "cgroups_path", "") or "")


def held_tenancies(container: nri_pb2.Container, ledger: Ledger) -> list[Tenancy]:
    """The ledger tenancies whose limits a container gets: those held under
    its container id (NRI door); else, when its env (NRI ``env``, ``K=V``
    strings, the last value wins) carries ``FRACPLUGIN_DRA_CLAIM=<uid>``, the
    DRA door's tenancies of the reservation ``dra:<uid>`` (ADR 0031: the
    runtime applied the claim's CDI env before NRI sees the container). Empty
    when neither holds anything."""
    held = list(ledger.find_container_id(container.id))
    return held or claim_tenancies(getattr(container, "env", ()) or (), ledger)


def _mib(v: int | None) -> str:
    if v is None:
        return "unread"
    return "max" if v == LIMIT_MAX else f"{v // MIB} MiB"


def not_enforced_message(res: ContainerLimits) -> str:
    """The Event text: per GPU not enforced, its planned and read soft/hard
    limits and the reason (the missing capability or NVML's refusal)."""
    parts = []
    for g in res.gpus:
        if g.enforced:
            continue
        parts.append(f"GPU {g.gpu_uuid}: planned soft {_mib(g.planned_soft)} / hard {_mib(g.planned_hard)}, "
                     f"read soft {_mib(g.read_soft)} / hard {_mib(g.read_hard)}: {g.reason or res.reason}")
    head = f"CUDA memory limit of container {res.container} not enforced"
    return head + ("; " + "; ".join(parts) if parts else f": {res.why}")

