"""The DRA door's decode and encode in process (issue 33 item 2), through
grpcio-testing's server (``grpc_testing``): NodePrepareResources and
NodeUnprepareResources of both API versions reach the ``Preparer`` and come
back as kubelet reads them (devices per claim, ``share_id`` only in v1, a
refusal as the claim's ``error``; one claim's refusal does not fail the
others), without a socket. The real-socket tests (tests/component/test_dra_door.py)
and the cluster keep the transport honest; this pins the wire mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import grpc_testing
import pytest

from fracplugin._proto import dra_v1_pb2 as v1
from fracplugin._proto import dra_v1beta1_pb2 as v1beta1
from fracplugin.dra import params
from fracplugin.dra.prepare import Preparer
from fracplugin.dra.server import DraServer, _Dra
from fracplugin.gpu.simulated import load_node
from fracplugin.gpu.health import HealthMonitor
from fracplugin.gpu.inventory import XidEvent
from tests.helpers import node_rules
from tests.peers.resource_api import claim_doc

REPO = Path(__file__).resolve().parents[2]
NODE = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
SM = {"apiVersion": params.API_VERSION, "kind": params.KIND, "gpu-compute.mode": "sm-sharing"}


class Claims:
    def __init__(self, *docs: dict[str, Any]) -> None:
        self.docs = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs}

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.docs[(namespace, name)]


@pytest.fixture
def door(tmp_path: Path) -> DraServer:
    claims = Claims(claim_doc("ns", "ok", "uid-ok", memory="20Gi", parameters=SM),
                    claim_doc("ns", "sick", "uid-sick", memory="8Gi", device="gpu-1"))
    rules = node_rules(NODE)
    assert isinstance(rules.health, HealthMonitor)
    rules.health.record_xid(XidEvent(NODE.gpus[1].uuid, 79))  # gpu-1 fell off the bus
    return DraServer(Preparer(rules, claims, str(tmp_path)), str(tmp_path / "plugins"), str(tmp_path / "reg"))


def _server(door: DraServer, pb: Any) -> Any:
    servicer = _Dra(door, pb, pb is v1)
    return grpc_testing.server_from_dictionary({pb.DESCRIPTOR.services_by_name["DRAPlugin"]: servicer},
                                               grpc_testing.strict_real_time())


def _call(server: Any, pb: Any, method: str, request: Any) -> Any:
    rpc = server.invoke_unary_unary(pb.DESCRIPTOR.services_by_name["DRAPlugin"].methods_by_name[method],
                                    (), request, None)
    response, _metadata, code, details = rpc.termination()
    assert code is grpc.StatusCode.OK, details
    return response


@pytest.mark.parametrize("pb", [v1, v1beta1], ids=["v1", "v1beta1"])
def test_prepare_and_unprepare_decode_and_encode_per_claim(door: DraServer, pb: Any) -> None:
    server = _server(door, pb)
    req = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace="ns", name="ok", uid="uid-ok"),
                                                 pb.Claim(namespace="ns", name="sick", uid="uid-sick")])
    resp = _call(server, pb, "NodePrepareResources", req)
    ok, sick = resp.claims["uid-ok"], resp.claims["uid-sick"]
    assert ok.error == "" and len(ok.devices) == 1
    (dev,) = ok.devices
    assert (list(dev.request_names), dev.pool_name, dev.device_name) == (["gpu"], "gpu-node-1", "gpu-0")
    assert list(dev.cdi_device_ids) == ["gpu-memory.fracplugin.io/claim=uid-ok"]
    # share_id exists in v1 only (consumable capacity); v1beta1 has no such field
    assert (dev.share_id == "share-uid-ok") if pb is v1 else not hasattr(dev, "share_id")
    # the other claim's refusal is its own error, in the node's words (noderules: an Unhealthy GPU)
    assert not sick.devices and f"GPU 1 ({NODE.gpus[1].uuid}), which is Unhealthy (xid 79)" in sick.error
    assert door.calls["prepare"] == 1
    un = _call(server, pb, "NodeUnprepareResources",
               pb.NodeUnprepareResourcesRequest(claims=[pb.Claim(namespace="ns", name="ok", uid="uid-ok")]))
    assert dict(un.claims) == {"uid-ok": pb.NodeUnprepareResourceResponse(error="")}
    assert door.preparer.ledger.tenancies() == []
