"""Replay the recorded NRI wire transcripts through the sans-I/O layer.

Fixtures: ``tests/fixtures/nri/wire-nri-{v0.12.2,v0.8.0}.jsonl`` (every ttrpc
message of one plugin connection with the real runtime side). The runtime's
messages are re-framed the way the Go runtime sends them (mux frames of up to
16 KB, docs/reference/nri-protocol.md 1.2), decoded by ``MuxDecoder`` + ``TtrpcConnection``,
handled by the stub's ``Dispatcher`` with fracplugin's handlers, and our
answers are encoded back: every frame we write is <= 4096 bytes and decodes to
the expected response.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from fracplugin._proto import nri_pb2, ttrpc_pb2
from fracplugin.gpu.simulated import load_node
from fracplugin.ledger import Ledger
from fracplugin.nri.mux import MAX_WRITE_FRAME, MuxDecoder, encode_frames
from fracplugin.nri.plugin import FracNriPlugin
from fracplugin.nri.dispatch import PLUGIN_SERVICE, RUNTIME_SERVICE, Dispatcher
from fracplugin.nri.ttrpc import Code, MessageType, RequestReceived, ResponseReceived, Role, TtrpcConnection
from tests.peers.ttrpc_wire import mux_frames, ttrpc_frame as encode_message
from fracplugin.planner import PlannerConfig
from tests.helpers import node_rules

REPO = Path(__file__).resolve().parents[2]
GO_FRAME = 16406  # a frame size the Go runtime was seen sending


def _transcript(version: str) -> list[dict]:
    path = REPO / "tests" / "fixtures" / "nri" / f"wire-nri-{version}.jsonl"
    if not path.is_file():
        pytest.fail(f"NRI fixture missing: {path} ")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _frame_sizes(stream: bytes) -> list[int]:
    sizes, pos = [], 0
    while pos < len(stream):
        _, length = struct.unpack_from(">II", stream, pos)
        sizes.append(8 + length)
        pos += 8 + length
    return sizes


@pytest.fixture
def plugin() -> FracNriPlugin:
    node = load_node(REPO / "examples" / "nodes" / "gpu-node-1.yaml")
    return FracNriPlugin(node_rules(node))


def _runtime_stream(records: list[dict]) -> bytes:
    """The runtime->plugin bytes as the Go runtime frames them."""
    out = bytearray()
    for r in records:
        if r["dir"] != "runtime->plugin":
            continue
        msg = encode_message(r["stream"], r["type"], bytes.fromhex(r["payload_hex"]), r["flags"])
        out += mux_frames(r["mux_conn"], msg, max_frame=GO_FRAME)
    return bytes(out)


@pytest.mark.parametrize("version", ["v0.12.2", "v0.8.0"])
def test_transcript_replays_and_our_answers_fit_4096_byte_frames(version, plugin):
    records = _transcript(version)
    # Our RegisterPlugin, as the stub sends it, is byte-identical to the recorded one
    # (same name/index as the recording plugin, 5 s registration timeout).
    client = TtrpcConnection(Role.CLIENT)
    reg = nri_pb2.RegisterPluginRequest(plugin_name="pyprobe", plugin_idx="50")
    sid = client.send_request(RUNTIME_SERVICE, "RegisterPlugin", reg.SerializeToString(), timeout_nano=5_000_000_000)
    sent = client.data_to_send()
    first = records[0]
    assert (first["dir"], first["mux_conn"], first["stream"]) == ("plugin->runtime", 2, sid)
    assert sent[10:] == bytes.fromhex(first["payload_hex"])

    server = TtrpcConnection(Role.SERVER)
    decoder = MuxDecoder()
    dispatcher = Dispatcher(plugin, plugin.events, "fracplugin")
    recorded_answers = {r["stream"]: r for r in records if r["dir"] == "plugin->runtime" and r["mux_conn"] == 1}
    methods = []
    stream = _runtime_stream(records)
    # Feed in odd-sized reads, as a socket would deliver them.
    for start in range(0, len(stream), 777):
        for conn_id, payload in decoder.receive_data(stream[start : start + 777]):
            conn = server if conn_id == 1 else client
            for ev in conn.receive_data(payload):
                if isinstance(ev, ResponseReceived):
                    assert ev.stream_id == sid and ev.code == Code.OK  # the RegisterPlugin reply: absent status = OK
                    continue
                assert isinstance(ev, RequestReceived) and ev.service == PLUGIN_SERVICE
                assert 0 < ev.timeout_nano <= 2_000_000_000
                methods.append(ev.method)
                ctx = dispatcher.context(ev, 0.75)
                req = dispatcher.decode(ev)
                resp = dispatcher.routes[ev.method].serve(req, ctx)
                server.send_response(ev.stream_id, resp.SerializeToString())
                wire = encode_frames(1, server.data_to_send())
                assert all(size <= MAX_WRITE_FRAME for size in _frame_sizes(wire))
                ours = ttrpc_pb2.Response.FromString(wire[18:])
                theirs = ttrpc_pb2.Response.FromString(bytes.fromhex(recorded_answers[ev.stream_id]["payload_hex"]))
                assert not ours.HasField("status") and not theirs.HasField("status")
                if ev.method == "Configure":
                    assert req.registration_timeout == 5000 and req.request_timeout == 2000
                    # An explicit mask valid for every runtime: RunPod|RemovePod|Create|Start|Stop|Remove
                    # (the recording plugin sent Create|Stop|Remove).
                    events = nri_pb2.ConfigureResponse.FromString(ours.payload).events
                    assert events == plugin.events == 0x62d
                    assert nri_pb2.ConfigureResponse.FromString(theirs.payload).events == 0x608
                elif ev.method == "Synchronize":
                    assert [p.name for p in req.pods] == ["existing"]
                    assert nri_pb2.SynchronizeResponse.FromString(ours.payload) == nri_pb2.SynchronizeResponse()
                elif ev.method == "CreateContainer":
                    assert (req.pod.namespace, req.pod.name, req.pod.uid, req.container.name) == (
                        "default", "gpu-pod", "uid-0001", "cuda")
                    # Not our annotation contract: the container is left untouched.
                    assert nri_pb2.CreateContainerResponse.FromString(ours.payload) == nri_pb2.CreateContainerResponse()
    decoder.receive_eof()
    removal = "RemoveContainer" if version == "v0.12.2" else "StateChange"
    assert methods == ["Configure", "Synchronize", "CreateContainer", "StopContainer", removal]
    assert dispatcher.request_timeout_s == 2.0
    assert plugin.ready()


def _recorded_create(version: str) -> tuple[int, nri_pb2.CreateContainerRequest]:
    for r in _transcript(version):
        if r["dir"] == "runtime->plugin" and r["type"] == MessageType.REQUEST:
            req = ttrpc_pb2.Request.FromString(bytes.fromhex(r["payload_hex"]))
            if req.method == "CreateContainer":
                return r["stream"], nri_pb2.CreateContainerRequest.FromString(req.payload)
    raise AssertionError("no CreateContainer in the transcript")


@pytest.mark.parametrize("version", ["v0.12.2", "v0.8.0"])
def test_recorded_create_with_our_annotations_gets_the_adjustment_in_small_frames(version, plugin):
    sid, req = _recorded_create(version)
    uuids = [g.uuid for g in plugin.rules.node.gpus[:4]]
    req.pod.annotations.update(
        {
            "nvidia.com/container.cuda.gpu-memory.request": "40Gi",
            "nvidia.com/container.cuda.gpu-memory.limit": "60Gi",
            "nvidia.com/container.cuda.gpu-compute.mode": "sm-sharing",
            "nvidia.com/container.cuda.gpu-compute.portion": "0.5",
            "nvidia.com/container.cuda.gpus.devices": ",".join(uuids),
        }
    )
    # Hundreds of extra annotations: the request crosses several 16 KB Go frames.
    for i in range(400):
        req.pod.annotations[f"example.com/padding-{i:03d}"] = "x" * 40
    dispatcher = Dispatcher(plugin, plugin.events)
    body = ttrpc_pb2.Request(
        service=PLUGIN_SERVICE, method="CreateContainer", payload=req.SerializeToString(), timeout_nano=2_000_000_000
    ).SerializeToString()
    stream = mux_frames(1, encode_message(sid, MessageType.REQUEST, body), max_frame=GO_FRAME)
    assert len(_frame_sizes(stream)) > 1
    server = TtrpcConnection(Role.SERVER)
    events = []
    for _, payload in MuxDecoder().receive_data(stream):
        events.extend(server.receive_data(payload))
    (ev,) = events
    resp = dispatcher.routes[ev.method].serve(dispatcher.decode(ev), dispatcher.context(ev, 0.75))
    server.send_response(ev.stream_id, resp.SerializeToString())
    wire = encode_frames(1, server.data_to_send())
    assert all(size <= MAX_WRITE_FRAME for size in _frame_sizes(wire))
    env = {kv.key: kv.value for kv in resp.adjust.env if not kv.key.startswith("-")}
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == ",".join(f"{u}=61440M" for u in uuids)
    assert [t.container_id for t in plugin.rules.ledger.tenancies()] == [req.container.id] * 4
