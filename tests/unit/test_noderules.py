"""The node's rules (``noderules.NodeRules``, issue 33) at the pipeline's
level: each rule as a table row, with narrow fakes (no daemon, no socket):
the GPU health monitor is the real ``HealthMonitor`` fed an XID by hand, the
memory-limit gate a stand-in with the ``admit`` contract, the ledger the real
in-memory one."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fracplugin.allocation import DOOR_ALLOCATE, DOOR_NRI
from fracplugin.annotations import parse
from fracplugin.allocation import DOOR_DRA
from fracplugin.cordon import ANNOTATION, cordon_of
from fracplugin.cordon import parse as parse_cordon
from fracplugin.gpu.health import HealthMonitor
from fracplugin.gpu.inventory import XidEvent
from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import ContainerPlan, FractionError, PodRef
from fracplugin.noderules import PRECONDITION, TRANSIENT, NodeRules, status_of
from fracplugin.planner import ENV_MEMORY_LIMIT, ENV_MEMORY_REQUEST, PlannerConfig
from fracplugin.rpcstatus import StatusCode

P = "nvidia.com/container.app."
POD = PodRef("team", "p", "uid-p")


@pytest.fixture
def node(node_file: Any) -> Any:
    return load_node(node_file)


class Gate:
    """The memory-limit gate's contract (``NriMemoryLimits.admit``): refuse, or withhold the hook's env."""

    def __init__(self, refuse: str = "", withhold: bool = False) -> None:
        self.refuse, self.withhold, self.seen = refuse, withhold, 0

    def admit(self, plan: ContainerPlan) -> ContainerPlan:
        self.seen += 1
        if self.refuse:
            raise FractionError("node", None, self.refuse, code="memory_limits_unenforceable")
        if self.withhold:
            env = {k: v for k, v in plan.env.items() if k not in (ENV_MEMORY_REQUEST, ENV_MEMORY_LIMIT)}
            return dataclasses.replace(plan, env=env)
        return plan


def rules(node: Any, *, mig: tuple[int, ...] = (), xid: dict[int, int] | None = None,
          gate: Gate | None = None, cordon: str = "") -> NodeRules:
    if mig:
        node = dataclasses.replace(node, gpus=tuple(dataclasses.replace(g, mig_enabled=g.index in mig)
                                                    for g in node.gpus))
    health = HealthMonitor(None, [g.uuid for g in node.gpus])
    for index, x in (xid or {}).items():
        health.record_xid(XidEvent(node.gpus[index].uuid, x))
    cordon_of({ANNOTATION: cordon}, node, health)
    return NodeRules(node, Ledger(node), PlannerConfig(), health=health, limits=gate)  # type: ignore[arg-type]


SUFFIX = {"gpu_memory_request": "gpu-memory.request", "gpu_memory_limit": "gpu-memory.limit",
          "gpus_devices": "gpus.devices", "gpu_compute_mode": "gpu-compute.mode"}


def request(**annotations: str) -> Any:
    return parse({P + SUFFIX[k]: v for k, v in annotations.items()}, "app")


# (rule, node shape, annotations) -> the GPUs a node-placed container lands on, or the refusal's code
PLACED = [
    ("healthy node: the first GPU", {}, {}, [0]),
    ("XID 79 on GPU 0: placed past it", {"xid": {0: 79}}, {}, [1]),
    ("MIG on GPU 0: placed past it", {"mig": (0,)}, {}, [1]),
    ("both: GPU 2", {"xid": {1: 79}, "mig": (0,)}, {}, [2]),
    ("GPUs 0 and 1 cordoned (index, UUID): GPU 2", {"cordon": "0, GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a02"}, {}, [2]),
    ("devices \"all\" on a node with a MIG GPU: refused naming it", {"xid": {1: 79}, "mig": (0,)},
     {"gpus_devices": "all"}, "mig"),
    ("every GPU unusable: no fit naming each", {"xid": {0: 79, 1: 79, 2: 48}, "mig": (3,)}, {}, "no_fit"),
]


@pytest.mark.parametrize("what,shape,extra,want", PLACED, ids=[r[0] for r in PLACED])
def test_unusable_gpus_are_never_planned(node: Any, what: str, shape: dict[str, Any], extra: dict[str, str],
                                         want: Any) -> None:
    r = rules(node, **shape)
    req = request(gpu_memory_request="8Gi", **extra)
    try:
        p = r.admit(req, POD)
    except FractionError as err:
        assert err.code == want, err.message
        assert status_of(err.code) is not StatusCode.INVALID_ARGUMENT  # the node, not the request
        return
    assert [g.index for g in p.devices] == want
    assert [t.gpu_uuid for t in r.ledger.tenancies()] == [node.gpus[i].uuid for i in want]


@pytest.mark.parametrize("shape,code,words", [
    ({"xid": {0: 79}}, "unhealthy", "which is Unhealthy (xid 79)"),
    ({"mig": (0,)}, "mig", "which is in MIG mode"),
    ({"cordon": "0"}, "cordoned", "which is cordoned (node annotation fracplugin.io/cordoned-gpus)"),
])
def test_naming_an_unusable_gpu_is_refused_with_its_kind(node: Any, shape: dict[str, Any], code: str,
                                                         words: str) -> None:
    r = rules(node, **shape)
    with pytest.raises(FractionError) as err:
        r.admit(request(gpu_memory_request="8Gi", gpus_devices="0"), POD)
    assert err.value.code == code and f"GPU 0 ({node.gpus[0].uuid}), {words}" in err.value.message
    assert err.value.key == P + "gpus.devices" and r.ledger.tenancies() == []


def test_the_no_fit_refusal_names_each_unusable_gpu_once_with_the_rule(node: Any) -> None:
    r = rules(node, xid={0: 79, 1: 79, 2: 48}, mig=(3,))
    with pytest.raises(FractionError) as err:
        r.admit(request(gpu_memory_request="8Gi"), POD)
    msg = err.value.message
    assert "is Unhealthy (xid 79)" in msg and "is Unhealthy (xid 48)" in msg and "is in MIG mode" in msg
    assert msg.count("no new fraction on an Unhealthy, cordoned or MIG-mode GPU") == 1


def test_what_runs_is_replanned_whatever_the_gpu(node: Any) -> None:
    """A Synchronize records what runs: ``replan`` plans on an Unhealthy, MIG or cordoned GPU, against an
    empty ledger."""
    r = rules(node, xid={0: 79}, mig=(1,), cordon="2")
    assert [g.index for g in r.replan(request(gpu_memory_request="8Gi", gpus_devices="0,1,2"), POD).devices] == [
        0, 1, 2]


def test_a_cordon_entry_naming_no_gpu_is_a_warning_naming_it(node: Any) -> None:
    uuids, warnings = parse_cordon(" 1,,7, GPU-nope,٣,99999999999999999999", node)
    assert uuids == {node.gpus[1].uuid}
    assert [w.split(": ", 1)[1].split(" names")[0] for w in warnings] == [
        "'7'", "'GPU-nope'", "'٣'", "'99999999999999999999'"]
    assert all(w.startswith(f"annotation {ANNOTATION}: ") for w in warnings)
    health = HealthMonitor(None, [g.uuid for g in node.gpus])
    assert cordon_of({ANNOTATION: "3"}, node, health) == [] and health.cordoned() == {node.gpus[3].uuid}
    assert health.health(node.gpus[3].uuid).reasons == ("cordoned",)
    cordon_of(None, node, health)  # the annotation removed: uncordoned
    assert health.cordoned() == frozenset() and health.healthy(node.gpus[3].uuid)


def test_the_steps_run_once_in_order_and_a_refusal_leaves_no_hold(node: Any) -> None:
    seen: list[str] = []
    gate = Gate()
    r = rules(node, gate=gate)
    p = r.admit(request(gpu_memory_request="8Gi"), POD, check=lambda plan: seen.append(f"check {plan.request_mib}"))
    assert seen == ["check 8192"] and gate.seen == 1 and len(r.ledger.tenancies()) == 1
    # a door's check that refuses stops before the gate and the ledger
    def no(plan: ContainerPlan) -> None:
        raise FractionError("mounts[/tmp/nvidia-mps]", "/x", "conflicts", "mount_conflict")

    with pytest.raises(FractionError):
        r.admit(request(gpu_memory_request="8Gi"), PodRef("team", "q", "uid-q"), check=no)
    assert gate.seen == 1 and len(r.ledger.tenancies()) == 1
    assert p.device_uuids == (node.gpus[0].uuid,)


def test_the_gate_refuses_or_withholds_the_hooks_env_at_every_door(node: Any) -> None:
    r = rules(node, gate=Gate(refuse="memory limits cannot be enforced on this node: cgroup_v2 (v1)"))
    with pytest.raises(FractionError) as err:
        r.admit(request(gpu_memory_request="8Gi"), POD, door=DOOR_ALLOCATE, reservation="k", bound=False)
    assert err.value.code == "memory_limits_unenforceable" and "cgroup_v2" in err.value.message
    assert status_of(err.value.code) is StatusCode.FAILED_PRECONDITION and r.ledger.tenancies() == []
    w = rules(node, gate=Gate(withhold=True))
    p = w.admit(request(gpu_memory_request="8Gi", gpu_memory_limit="12Gi"), POD, door=DOOR_DRA)
    assert ENV_MEMORY_REQUEST not in p.env and ENV_MEMORY_LIMIT not in p.env
    assert w.ledger.tenancies()[0].limit_mib == 12288  # the hold keeps the limit; only the hook's env is withheld


def test_one_compute_mode_per_gpu_reads_the_same_from_every_door(node: Any) -> None:
    r = rules(node)
    r.admit(request(gpu_memory_request="8Gi", gpus_devices="0", gpu_compute_mode="sm-sharing"), POD)
    words = set()
    for door in (DOOR_NRI, DOOR_ALLOCATE, DOOR_DRA):
        with pytest.raises(FractionError) as err:
            r.admit(request(gpu_memory_request="8Gi", gpus_devices="0"), PodRef("team", door, f"uid-{door}"),
                    door=door)
        words.add(err.value.message.replace(door, "<door>"))
        assert status_of(err.value.code) is StatusCode.FAILED_PRECONDITION
    assert len(words) == 1 and "one compute mode per GPU" in words.pop()


@pytest.mark.parametrize("code,status", [
    *[(c, StatusCode.UNAVAILABLE) for c in sorted(TRANSIENT)],
    *[(c, StatusCode.FAILED_PRECONDITION) for c in sorted(PRECONDITION)],
    ("quantity", StatusCode.INVALID_ARGUMENT), ("device", StatusCode.INVALID_ARGUMENT),
    ("reservation", StatusCode.INVALID_ARGUMENT), ("limit_below_request", StatusCode.INVALID_ARGUMENT),
])
def test_one_mapping_from_a_refusals_kind_to_the_status(code: str, status: StatusCode) -> None:
    assert status_of(code) is status


def test_excluded_names_the_mig_gpus_for_readiness(node: Any) -> None:
    assert rules(node).excluded() == ""
    assert rules(node, mig=(0,)).excluded() == f"GPU 0 ({node.gpus[0].uuid}) in MIG mode: no fraction placed on it"
