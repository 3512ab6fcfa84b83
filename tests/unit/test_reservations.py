"""reservations: who may claim a kubelet reservation (issue 25 item 4, ADR 0024; issue 34, ADR 0033)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.model import ComputeMode, FractionError, Tenancy
from fracplugin.noderules import status_of
from fracplugin.reservations import (CODE_CLAIM, CODE_PENDING, ReservationProofs, claim_problem, hold_of, proof_of,
                                     proofs_of, running_overlaps, take_over, unbind_gone)
from fracplugin.rpcstatus import StatusCode

REPO = Path(__file__).resolve().parents[2]
KEY = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01::0-3"


def _held(ledger: Ledger, uid: str = "", cid: str = "") -> None:
    ledger.replace_all([Tenancy(pod_uid=uid, namespace="default" if uid else "", pod_name="owner" if uid else "",
                                container="app" if uid else "", gpu_uuid=KEY.split("::")[0], request_mib=4096,
                                limit_mib=4096, mode=ComputeMode.TIME_SLICING, container_id=cid, door="allocate",
                                reservation=KEY)])


def test_proofs_are_new_per_allocate_and_kept_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "reservation-proofs.json"
    proofs = ReservationProofs(path)
    first = proofs.issue(KEY)
    assert len(first) == 32 and proofs.current_or_issue(KEY) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ReservationProofs(path).matches(KEY, first)  # a restarted daemon knows it
    second = proofs.issue(KEY)
    assert second != first and not proofs.matches(KEY, first) and proofs.matches(KEY, second)


def test_claim_rules(tmp_path: Path) -> None:
    node = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    ledger = Ledger(node, tmp_path / "ledger.json")
    assert "no Allocate of this node answered it" in str(claim_problem(ledger, KEY, "uid-x", "", node.name))
    _held(ledger)
    proof = proofs_of(ledger).issue(KEY)
    assert proofs_of(ledger) is proofs_of(ledger)
    assert "carries no FRACPLUGIN_RESERVATION_PROOF" in str(claim_problem(ledger, KEY, "uid-x", "", node.name))
    assert "wrong" in str(claim_problem(ledger, KEY, "uid-x", "f" * 32, node.name))
    assert claim_problem(ledger, KEY, "uid-x", proof, node.name) is None
    _held(ledger, "uid-owner", "c1")
    assert claim_problem(ledger, KEY, "uid-owner", "", node.name) is None  # bound to this pod
    assert "held by running container default/owner/app" in str(claim_problem(ledger, KEY, "uid-x", proof, node.name))
    _held(ledger, "uid-owner")  # bound to its pod, no container runs: still the pod's (issue 34 item 2)
    assert "belongs to pod default/owner" in str(claim_problem(ledger, KEY, "uid-x", proof, node.name))
    assert claim_problem(ledger, KEY, "uid-owner", "", node.name) is None
    _held(ledger, "podresources:default/owner")  # PodResources bound it, the pod source did not know the uid
    assert claim_problem(ledger, KEY, "uid-owner", "", node.name, pod_name="default/owner") is None
    assert "belongs to pod" in str(claim_problem(ledger, KEY, "uid-x", proof, node.name, pod_name="default/x"))


def test_an_alias_claims_its_hold_with_its_own_proof(tmp_path: Path) -> None:
    """An init container's key given again in part to the app container:
    one hold under the union, each key claims it with its own proof."""
    node = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    ledger = Ledger(node, tmp_path / "ledger.json")
    small = KEY.split("::")[0] + "::0-1"
    _held(ledger)  # the union, KEY (::0-3), holder not known yet
    proofs = proofs_of(ledger)
    own = proofs.issue(small)
    assert hold_of(ledger, small) == small  # not an alias yet
    proofs.alias([small], KEY)
    assert hold_of(ledger, small) == KEY and hold_of(ledger, KEY) == KEY
    assert claim_problem(ledger, small, "uid-x", own, node.name) is None
    assert "carries no" in str(claim_problem(ledger, small, "uid-x", "", node.name))
    assert ReservationProofs(tmp_path / "reservation-proofs.json").alias_of(small) == KEY  # kept on disk
    ledger.replace_all([])  # the hold released: the alias names nothing
    assert hold_of(ledger, small) == small and "names no reservation" in str(
        claim_problem(ledger, small, "uid-x", own, node.name))
    proofs.unalias(small)
    assert proofs.alias_of(small) is None


def test_proof_of_reads_the_annotation_then_the_last_env_value() -> None:
    assert proof_of({"fracplugin.io/reservation-proof": "a"}, ["FRACPLUGIN_RESERVATION_PROOF=b"]) == "a"
    assert proof_of({}, ["FRACPLUGIN_RESERVATION_PROOF=b", "FRACPLUGIN_RESERVATION_PROOF=c"]) == "c"
    assert proof_of(None, []) == ""


def test_unbind_gone_clears_containers_the_runtime_no_longer_runs() -> None:
    t = Tenancy("u", "d", "p", "c", "g", 1, 1, ComputeMode.TIME_SLICING, container_id="c1", door="allocate",
                reservation=KEY)
    assert [x.container_id for x in unbind_gone([t], {"c1"})] == ["c1"]
    assert [x.container_id for x in unbind_gone([t], set())] == [""]


def test_a_pending_key_waits_for_the_running_holder_then_takes_its_devices_over(tmp_path: Path) -> None:
    """ADR 0033 decision 2: a key Allocated while a running container of
    another pod holds its devices is pending (kept on disk); its container
    is refused transiently while that one runs, accepted once it stopped,
    and ``take_over`` then releases the stopped holder's overlapping
    reservation (the key's own entries are replaced by the admission)."""
    node = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    ledger = Ledger(node, tmp_path / "ledger.json")
    other = KEY.split("::")[0] + "::2-5"
    _held(ledger, "uid-owner", "c1")  # KEY (::0-3) held by a running container of pod owner
    proofs = proofs_of(ledger)
    proof = proofs.issue(other)
    proofs.pend(other)
    assert ReservationProofs(tmp_path / "reservation-proofs.json").is_pending(other)  # survives a restart
    assert [t.reservation for t in running_overlaps(ledger, other)] == [KEY]
    assert running_overlaps(ledger, other, "uid-owner") == []  # the holder's own pod is not in its way
    err = claim_problem(ledger, other, "uid-new", proof, node.name)
    assert err is not None and err.code == CODE_PENDING and status_of(err.code) == StatusCode.UNAVAILABLE
    assert "running container default/owner/app (pod uid uid-owner, container id c1" in err.message, err.message
    wrong = claim_problem(ledger, other, "uid-new", "f" * 32, node.name)
    assert wrong is not None and wrong.code == CODE_CLAIM and "names no reservation" in wrong.message
    with pytest.raises(FractionError) as exc:
        take_over(ledger, other, "uid-new")
    assert exc.value.code == CODE_PENDING and [t.reservation for t in ledger.tenancies()] == [KEY]
    _held(ledger, "uid-owner")  # its container stopped (the reservation stays with its pod)
    assert claim_problem(ledger, other, "uid-new", proof, node.name) is None
    assert [t.reservation for t in take_over(ledger, other, "uid-new")] == [KEY]
    assert ledger.tenancies() == []
    proofs.settle(other)
    assert not proofs.is_pending(other) and take_over(ledger, other, "uid-new") == []  # not pending: nothing
