"""The test peers' own NRI wire code (``tests/peers/ttrpc_wire.py``) against
the transcripts recorded from containerd/nri's Go runtime side
(``tests/fixtures/nri/``): it decodes every message and re-encodes it byte
for byte, so the component tests' runtime speaks what Go speaks without
borrowing the product's mux/ttrpc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fracplugin._proto import nri_pb2
from tests.peers import ttrpc_wire as w

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nri"
TRANSCRIPTS = ["wire-nri-v0.12.2.jsonl", "wire-nri-v0.8.0.jsonl"]


def _load(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("name", TRANSCRIPTS)
def test_envelopes_decode_and_reencode_byte_for_byte(name: str) -> None:
    for rec in _load(name):
        raw = bytes.fromhex(rec["payload_hex"])
        if rec["type"] == w.REQUEST:
            req = w.decode_request(raw)
            assert req.service in ("nri.pkg.api.v1alpha1.Plugin", "nri.pkg.api.v1alpha1.Runtime"), rec
            assert w.encode_request(req) == raw, rec
        else:
            assert rec["type"] == w.RESPONSE
            resp = w.decode_response(raw)
            assert resp.ok, rec
            assert w.encode_response(resp) == raw, rec


@pytest.mark.parametrize("name", TRANSCRIPTS)
def test_the_whole_socket_stream_splits_back_into_the_recorded_messages(name: str) -> None:
    recs = _load(name)
    sent_by_runtime = b"".join(
        w.mux_frames(r["mux_conn"], w.ttrpc_frame(r["stream"], r["type"], bytes.fromhex(r["payload_hex"]), r["flags"]),
                     max_frame=64)  # many small frames: a message spans several
        for r in recs if r["dir"] == "runtime->plugin")
    mux = w.MuxReader(max_frame=4096)
    per_conn = {w.PLUGIN_SERVICE_CONN: w.TtrpcReader(), w.RUNTIME_SERVICE_CONN: w.TtrpcReader()}
    got = []
    for i in range(0, len(sent_by_runtime), 7):  # fed in odd-sized reads
        for conn, payload in mux.feed(sent_by_runtime[i : i + 7]):
            got += [(conn, m.stream_id, m.msg_type, m.flags, m.data) for m in per_conn[conn].feed(payload)]
    want = [(r["mux_conn"], r["stream"], r["type"], r["flags"], bytes.fromhex(r["payload_hex"]))
            for r in recs if r["dir"] == "runtime->plugin"]
    assert got == want
    assert mux.pending == 0 and all(r.pending == 0 for r in per_conn.values())


@pytest.mark.parametrize("name", TRANSCRIPTS)
def test_the_recorded_conversation_means_what_the_peer_assumes(name: str) -> None:
    # Conn 2 carries the plugin's calls, conn 1 the runtime's; the runtime's
    # stream ids are odd and increasing; it sends its request timeout.
    recs = _load(name)
    first = recs[0]
    assert (first["dir"], first["mux_conn"], first["stream"], first["type"]) == ("plugin->runtime", 2, 1, 1)
    reg = w.decode_request(bytes.fromhex(first["payload_hex"]))
    assert (reg.service, reg.method) == ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin")
    body = nri_pb2.RegisterPluginRequest.FromString(reg.payload)
    assert (body.plugin_name, body.plugin_idx) == ("pyprobe", "50")
    assert recs[1]["payload_hex"] == ""  # the Go server's OK reply to RegisterPlugin: an empty Response
    calls = [(r["stream"], w.decode_request(bytes.fromhex(r["payload_hex"]))) for r in recs
             if r["dir"] == "runtime->plugin" and r["type"] == w.REQUEST]
    streams = [s for s, _ in calls]
    assert streams == sorted(streams) and all(s % 2 == 1 for s in streams) and len(set(streams)) == len(streams)
    assert {r.service for _, r in calls} == {"nri.pkg.api.v1alpha1.Plugin"}
    assert all(1_900_000_000 <= r.timeout_nano <= 2_000_000_000 for _, r in calls)  # the 2 s request timeout
    methods = [r.method for _, r in calls]
    assert methods[:3] == ["Configure", "Synchronize", "CreateContainer"]
    conf = nri_pb2.ConfigureRequest.FromString(calls[0][1].payload)
    assert (conf.runtime_name, conf.request_timeout, conf.registration_timeout) == ("nri-harness", 2000, 5000)
    create = nri_pb2.CreateContainerRequest.FromString(calls[2][1].payload)
    assert (create.pod.namespace, create.pod.name, create.container.name) == ("default", "gpu-pod", "cuda")
    if "v0.8" in name:  # RemoveContainer travels as StateChange before v0.12
        assert methods[-1] == "StateChange"
        ev = nri_pb2.StateChangeEvent.FromString(calls[-1][1].payload)
        assert ev.event == nri_pb2.REMOVE_CONTAINER and ev.container.name == "cuda"
    else:
        assert methods[-1] == "RemoveContainer" and conf.NRI_version == "v0.12.2"


def test_error_status_and_metadata_round_trip() -> None:
    resp = w.Response(code=3, message="bad annotation")
    raw = w.encode_response(resp)
    assert raw == b"\x0a\x12\x08\x03\x12\x0ebad annotation"  # Status{code=3, message} as field 1, no payload
    assert w.decode_response(raw) == w.Response(3, "bad annotation", b"", has_status=True)
    req = w.Request("svc", "M", b"\x01", timeout_nano=-1, metadata=(("k", "v"), ("", "")))
    raw = w.encode_request(req)
    assert raw.count(b"\xff") == 9  # a negative int64 is a 10-byte varint
    assert w.decode_request(raw) == req


def test_framing_limits() -> None:
    big = w.mux_frames(1, b"x" * 10_000)  # the default: frames a Go reader accepts
    sizes = []
    r = w.MuxReader(max_frame=4096)
    for conn, payload in r.feed(big):
        assert conn == 1
        sizes.append(len(payload) + w.MUX_HEADER_SIZE)
    assert max(sizes) == 4096 and sum(sizes) - 8 * len(sizes) == 10_000
    with pytest.raises(w.WireError, match="4097 bytes on conn 1 exceeds the reader's buffer of 4096"):
        w.MuxReader(max_frame=4096).feed(w.mux_frames(1, b"y" * 4089, max_frame=5000))
    t = w.TtrpcReader()
    over = w.TTRPC_MAX_DATA + 1
    msgs = t.feed(w.ttrpc_frame(5, w.REQUEST, b"z" * over) + w.ttrpc_frame(7, w.REQUEST, b"ok"))
    assert [(m.stream_id, m.data, m.length) for m in msgs] == [(5, None, over), (7, b"ok", 2)]
    stream = w.ttrpc_frame(9, w.RESPONSE, b"q" * over) + w.ttrpc_frame(11, w.RESPONSE, b"")
    t = w.TtrpcReader()
    msgs = t.feed(stream[:1000]) + t.feed(stream[1000:2_000_000]) + t.feed(stream[2_000_000:])
    assert [(m.stream_id, m.data) for m in msgs] == [(9, None), (11, b"")] and t.pending == 0
    with pytest.raises(w.WireError, match="not a ttrpc stream"):
        w.TtrpcReader().feed(b"\xde\xad\xbe\xef" + b"\x00" * 6)
    with pytest.raises(w.WireError):
        w.decode_request(b"\x0a\x05ab")  # a string field cut short
