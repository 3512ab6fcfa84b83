"""The DRA door's ``Preparer`` in process (issue 33 item 5): a repeated
Prepare answers from the record, a stale record or a restart takes the full
path, the claim lock table empties, two concurrent Prepares of one claim make
one hold. Claims come from a stand-in ``ClaimSource``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from fracplugin.dra import cdispec, params
from fracplugin.dra.prepare import Preparer
from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.mps.api import NullMps
from tests.helpers import wait_until
from tests.peers.resource_api import claim_doc
from tests.helpers import node_rules

REPO = Path(__file__).resolve().parents[2]
NODE = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
SM = {"apiVersion": params.API_VERSION, "kind": params.KIND, "gpu-compute.mode": "sm-sharing"}


class Claims:
    """A ``ClaimSource`` over a dict; counts reads; ``gate`` (when set) holds
    every read until it is set."""

    def __init__(self, *docs: dict[str, Any]) -> None:
        self.docs = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs}
        self.reads = 0
        self.gate: threading.Event | None = None

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        if self.gate is not None:
            assert self.gate.wait(30)
        return self.docs[(namespace, name)]


class CountingMps(NullMps):
    def __init__(self) -> None:
        self.ensured = 0

    def ensure_namespace(self, *args: Any, **kwargs: Any) -> str:
        self.ensured += 1
        return "ns"


def _preparer(tmp_path: Path, source: Claims, ledger: Ledger | None = None) -> tuple[Preparer, CountingMps]:
    mps = CountingMps()
    return Preparer(node_rules(NODE, ledger), source, str(tmp_path), mps=mps), mps  # type: ignore[arg-type]


def test_a_repeated_prepare_answers_from_the_record(tmp_path: Path) -> None:
    source = Claims(claim_doc("ns", "c", "uid-1", memory="20Gi", parameters=SM))
    p, mps = _preparer(tmp_path, source)
    first = p.prepare("ns", "c", "uid-1")
    assert first.error == "" and first.plan is not None and len(first.devices) == 1
    spec = cdispec.spec_path(str(tmp_path), "uid-1").stat().st_ino
    again = p.prepare("ns", "c", "uid-1")
    assert again is first
    assert (source.reads, mps.ensured, len(p.ledger.reservation("dra:uid-1"))) == (1, 1, 1)
    assert cdispec.spec_path(str(tmp_path), "uid-1").stat().st_ino == spec  # not rewritten (temp + rename)
    st = p.status()
    assert (st["prepared"], st["claims"], st["held"]) == (1, {"uid-1": "ns/c"}, {"dra:uid-1": NODE.gpus[0].uuid})
    assert p.unprepare("ns", "c", "uid-1") == "" and p.status()["claims"] == {}
    # after Unprepare the full path runs again
    assert p.prepare("ns", "c", "uid-1").devices == first.devices and source.reads == 2


def test_a_stale_record_or_a_restart_takes_the_full_path(tmp_path: Path) -> None:
    source = Claims(claim_doc("ns", "c", "uid-1", memory="20Gi", parameters=SM))
    p, mps = _preparer(tmp_path, source)
    first = p.prepare("ns", "c", "uid-1")
    p.ledger.release_reservation("dra:uid-1")  # the ledger no longer holds it (e.g. rebuilt)
    again = p.prepare("ns", "c", "uid-1")
    assert again == first and (source.reads, mps.ensured, len(p.ledger.reservation("dra:uid-1"))) == (2, 2, 1)
    # a restarted daemon: an empty record, the persisted ledger still holding the claim
    restarted, _ = _preparer(tmp_path, source, p.ledger)
    assert restarted.prepare("ns", "c", "uid-1") == first
    assert source.reads == 3 and len(p.ledger.reservation("dra:uid-1")) == 1


def test_a_refused_claim_is_not_recorded(tmp_path: Path) -> None:
    source = Claims(claim_doc("ns", "big", "uid-1", memory="90Gi"))
    p, _ = _preparer(tmp_path, source)
    assert p.prepare("ns", "big", "uid-1").error and p.prepare("ns", "big", "uid-1").error
    assert source.reads == 2 and p.status()["claims"] == {} and p.status()["refused"] == 2


def test_the_claim_lock_table_is_empty_after_prepare_and_unprepare(tmp_path: Path) -> None:
    uids = [f"uid-{i}" for i in range(32)]
    source = Claims(*(claim_doc("ns", u, u, memory="1Gi", device=f"gpu-{i % 4}") for i, u in enumerate(uids)))
    p, _ = _preparer(tmp_path, source)
    for u in uids:
        assert p.prepare("ns", u, u).error == ""
    assert len(p.status()["claims"]) == 32 and not p._busy
    for u in uids:
        assert p.unprepare("ns", u, u) == ""
    assert not p._busy and not p._record and p.ledger.tenancies() == []
    assert p.status()["unprepared"] == 32


def test_two_concurrent_prepares_of_one_claim_make_one_hold_and_the_same_answer(tmp_path: Path) -> None:
    source = Claims(claim_doc("ns", "c", "uid-1", memory="20Gi", parameters=SM))
    source.gate = threading.Event()
    p, mps = _preparer(tmp_path, source)
    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(p.prepare("ns", "c", "uid-1"))) for _ in range(2)]
    for t in threads:
        t.start()
    # one call reads the claim (held at the gate), the other waits for the claim's lock
    wait_until(lambda: source.reads == 1 and len(p._free._waiters) == 1)  # type: ignore[attr-defined]
    source.gate.set()
    for t in threads:
        t.join(30)
    assert len(answers) == 2 and answers[0] == answers[1] and answers[0].error == ""
    assert (source.reads, mps.ensured, len(p.ledger.reservation("dra:uid-1"))) == (1, 1, 1)
    assert not p._busy


class SubscribingMps(CountingMps):
    """Records the health callback the Preparer subscribes; each ensure is logged with its claim uid."""

    def __init__(self) -> None:
        super().__init__()
        self.callbacks: list[Any] = []
        self.owners: list[str] = []

    def subscribe(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def ensure_namespace(self, owner: str, *args: Any, **kwargs: Any) -> str:
        self.owners.append(owner)
        return super().ensure_namespace(owner, *args, **kwargs)


def test_a_daemon_healthy_again_gets_the_prepared_claims_namespaces_back(tmp_path: Path) -> None:
    """Issue 35 item 4 (ADR 0034), the DRA door's part: when an MPS daemon is healthy again (a new MPS
    role's fresh daemons know no namespace), the namespaces of the claims prepared in that mode are
    made again; claims of another mode and unprepared claims are not."""
    from fracplugin.model import ComputeMode

    ts = {**SM, "gpu-compute.mode": "time-slicing"}
    source = Claims(claim_doc("ns", "a", "uid-a", memory="20Gi", parameters=SM, device="gpu-0"),
                    claim_doc("ns", "b", "uid-b", memory="20Gi", parameters=SM, device="gpu-1"),
                    claim_doc("ns", "t", "uid-t", memory="20Gi", parameters=ts, device="gpu-2"))
    mps = SubscribingMps()
    p = Preparer(node_rules(NODE), source, str(tmp_path), mps=mps)  # type: ignore[arg-type]
    [back] = mps.callbacks
    for c, u in (("a", "uid-a"), ("b", "uid-b"), ("t", "uid-t")):
        assert p.prepare("ns", c, u).error == ""
    assert p.unprepare("ns", "b", "uid-b") == ""
    mps.owners.clear()
    back(ComputeMode.SM_SHARING, False)  # down: nothing to do yet
    back(ComputeMode.SM_SHARING, True)
    wait_until(lambda: mps.owners, what="a namespace re-made")
    for t in threading.enumerate():
        if t.name == "fracplugin-dra-renew":
            t.join(30)
    assert mps.owners == ["uid-a"] and not p._busy
