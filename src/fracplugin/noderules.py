"""The node's rules, in one place every door calls (issue 33, ADR 0032).

A door decodes its wire request into a ``FractionRequest`` (NRI: the pod's
annotations or Allocate's reservation; kubelet: the device IDs and the
candidate pod; DRA: the claim's allocation), makes one call down here, and
encodes what comes back. ``NodeRules.admit`` runs each step once, in the
order of ADR 0032 decision 2, whichever door asks: **health** (``unusable()``:
an XID mark, the node's cordon annotation (``cordon.py``), or MIG mode,
docs/reference/mps-nvml.md) -> **plan** (naming an unusable GPU refuses, code
``unhealthy`` / ``cordoned`` / ``mig``) -> the door's ``check`` -> **the
memory-limit gate** (code ``memory_limits_unenforceable``) -> **the ledger**.

A kubelet reservation that is *pending* (Allocate answered while a running
container still held its devices: ``reservations``, ADR 0033 decision 2)
first takes over those devices (``reservations.take_over``: refused
transiently while their holder runs, else the holds it waited on are
released), then goes through steps 1-5 like any other.

The door then adds what only it can (the MPS namespace intent, CDI devices)
and answers. A refusal is a ``FractionError`` whose ``code`` says its kind;
``status_of(code)`` is the one mapping from that kind to the status code each
door answers with (NRI's ttrpc status, kubelet's gRPC status, the DRA
answer's log and counters), so the same refusal reads the same at every door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Mapping, Sequence

from . import reservations
from .cordon import ANNOTATION as CORDON_ANNOTATION
from .allocation import DOOR_ALLOCATE, DOOR_NRI
from .ledger import Ledger
from .model import ContainerPlan, FractionRequest, NodeInfo, PodRef, Tenancy
from .planner import NO_UNUSABLE, EmptyLedger, PlannerConfig, Unusable, plan, plan_from_tenancies
from .rpcstatus import StatusCode

if TYPE_CHECKING:
    from .enforce.nri import LimitGate, NriMemoryLimits
    from .gpu.health import HealthMonitor

TRANSIENT = frozenset({"unhealthy", "mps_unavailable", "ledger_io", reservations.CODE_PENDING})
"""Refusal codes that may pass on their own (a GPU recovers, a daemon comes
back, the state directory is writable again, the running container a
pending reservation waits on stops): UNAVAILABLE, the caller retries."""

PRECONDITION = frozenset({"guard", "no_fit", "mig", "cordoned", "memory_limits_unenforceable", "mode_ambiguous"})
"""Refusal codes of a request that is well formed but the node cannot take
now (other tenants, the GPU's mode, an operator's cordon, what the node can enforce): FAILED_PRECONDITION."""


def status_of(code: str) -> StatusCode:
    """The status code every door answers a refusal of kind ``code`` with
    (``FractionError.code``): ``TRANSIENT`` -> UNAVAILABLE, ``PRECONDITION``
    -> FAILED_PRECONDITION, anything else (the request breaks the contract:
    a bad quantity, an unknown device, a forged reservation) ->
    INVALID_ARGUMENT. gRPC's own guide to the codes (grpc/grpc
    doc/statuscodes.md) draws the same lines."""
    if code in TRANSIENT:
        return StatusCode.UNAVAILABLE
    if code in PRECONDITION:
        return StatusCode.FAILED_PRECONDITION
    return StatusCode.INVALID_ARGUMENT


class NodeRules:
    """The node's admission: what every door calls (module docstring).

    Args:
        node: the node's GPUs (``mig_enabled`` read once: MIG mode is set
            while no process uses the GPU, and NVML reports it at start).
        ledger: the one ledger (thread-safe).
        config: the planner settings.
        health: the node's one GPU health monitor (XID marks, the cordon);
            None: no XIDs are watched, no GPU is cordoned (unit tests).
        limits: the memory-limit admission and enforcement; None: ``--memory-limits off``.
        gate: the memory-limit admission alone, where nothing is enforced (``explain``); default ``limits``.

    Thread-safe: it keeps no state of its own beyond the MIG table.
    """

    def __init__(self, node: NodeInfo, ledger: Ledger, config: PlannerConfig, *,
                 health: HealthMonitor | None = None, limits: NriMemoryLimits | None = None,
                 gate: LimitGate | None = None) -> None:
        self.node = node
        self.ledger = ledger
        self.config = config
        self.health = health
        self.limits = limits
        self._gate = gate or limits
        self._mig: dict[str, Unusable] = {g.uuid: Unusable("is in MIG mode", "mig")
                                          for g in node.gpus if g.mig_enabled}

    def unusable(self) -> Mapping[str, Unusable]:
        """GPU UUID -> why it takes no new fraction now (MIG mode, an XID
        mark, the node's cordon annotation). Cheap: a dict lookup on the
        common path (no MIG, no mark, no cordon)."""
        marks = self.health.xid_marks() if self.health is not None else {}
        cordoned = self.health.cordoned() if self.health is not None else ()
        if not marks and not cordoned:
            return self._mig or NO_UNUSABLE
        out = dict(self._mig)
        for uuid, xid in marks.items():
            out.setdefault(uuid, Unusable(f"is Unhealthy (xid {xid})", "unhealthy"))
        for uuid in cordoned:
            out.setdefault(uuid, Unusable(f"is cordoned (node annotation {CORDON_ANNOTATION})", "cordoned"))
        return out

    def excluded(self) -> str:
        """The GPUs excluded for good (MIG), as one phrase for readiness and
        the node condition; "" when none."""
        if not self._mig:
            return ""
        gpus = ", ".join(f"GPU {g.index} ({g.uuid})" for g in self.node.gpus if g.uuid in self._mig)
        return f"{gpus} in MIG mode: no fraction placed on {'it' if len(self._mig) == 1 else 'them'}"

    def plan(self, request: FractionRequest, pod: PodRef, *, reservation: str = "",
             without: Collection[str] = ()) -> ContainerPlan:
        """Steps 1-2: ``planner.plan`` against the ledger with ``unusable()``.
        ``without``: reservation keys whose entries do not count (the
        running holds a pending Allocate waits on: its answer is what the
        container gets once they are gone; nothing is recorded then).
        Raises FractionError."""
        view = _Without(self.ledger, frozenset(without)) if without else self.ledger
        return plan(request, pod, self.node, view, self.config, reservation=reservation,
                    unusable=self.unusable())

    def replan(self, request: FractionRequest, pod: PodRef, *, reservation: str = "") -> ContainerPlan:
        """The plan of something that already runs or is about to (a
        Synchronize rebuild, a pod's namespaces at RunPodSandbox, a
        PodResources reconcile): against an empty ledger and with no GPU
        unusable, since what runs is recorded, not admitted. Raises
        FractionError for a request that breaks the contract."""
        return plan(request, pod, self.node, EmptyLedger(), self.config, reservation=reservation)

    def recorded(self, tenancies: Sequence[Tenancy], pod: PodRef | None = None,
                 container: str | None = None) -> ContainerPlan:
        """The plan a recorded hold stands for (``planner.plan_from_tenancies``:
        a re-Allocate is answered from the record). Raises ValueError."""
        return plan_from_tenancies(tenancies, self.node, self.config, pod=pod, container=container)

    def gate(self, p: ContainerPlan) -> ContainerPlan:
        """Step 4: the plan to answer with (the toolkit hook's env withheld
        while the hook would fail). Raises FractionError
        (``memory_limits_unenforceable``) under policy refuse."""
        return p if self._gate is None else self._gate.admit(p)

    def record(self, p: ContainerPlan, *, door: str = DOOR_NRI, container_id: str = "", reservation: str = "",
               bound: bool = True) -> list[Tenancy]:
        """Step 5: ``Ledger.admit`` (every guard re-checked atomically).
        Raises FractionError (``guard``) or OSError (the ledger's file)."""
        return self.ledger.admit(p, container_id, door=door, reservation=reservation, bound=bound)

    def admit(self, request: FractionRequest, pod: PodRef, *, door: str = DOOR_NRI, container_id: str = "",
              reservation: str = "", bound: bool = True,
              check: Callable[[ContainerPlan], None] | None = None) -> ContainerPlan:
        """Steps 1-5 for one request: plan, the door's ``check``, gate,
        ledger; a pending kubelet reservation takes over its devices first
        (module docstring). Returns the plan recorded (what the door
        answers). Raises FractionError (a refusal: ``status_of(err.code)``),
        OSError (the ledger's file), and whatever ``check`` raises."""
        pending = (door == DOOR_ALLOCATE and bool(reservation) and bound
                   and reservations.proofs_of(self.ledger).is_pending(reservation))
        if pending:
            reservations.take_over(self.ledger, reservation, pod.uid)
        p = self.plan(request, pod, reservation=reservation)
        if check is not None:
            check(p)
        p = self.gate(p)
        self.record(p, door=door, container_id=container_id, reservation=reservation, bound=bound)
        if pending:
            reservations.proofs_of(self.ledger).settle(reservation)
        return p


class _Without:
    """The ledger as the planner sees it with the entries of ``keys``
    (reservation keys) left out (``NodeRules.plan``'s ``without``)."""

    def __init__(self, ledger: Ledger, keys: frozenset[str]) -> None:
        self.ledger = ledger
        self.keys = keys

    def tenants(self, gpu_uuid: str) -> Sequence[Tenancy]:
        return [t for t in self.ledger.tenants(gpu_uuid) if t.reservation not in self.keys]
