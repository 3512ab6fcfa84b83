"""Decode the recorded NRI wire transcripts with our own protos.

Fixtures: ``tests/fixtures/nri/wire-nri-v0.12.2.jsonl`` and
``wire-nri-v0.8.0.jsonl`` (see that directory's README.md): every ttrpc
payload that crossed one plugin connection with the real runtime side of NRI.

Every payload is decoded strictly: the ttrpc envelope with
``ttrpc_pb2.Request``/``Response``, the inner message with the request or
response type that our ``nri.pkg.api.v1alpha1`` service descriptor names for
the method, and then the whole message tree is walked and must carry no
unknown fields. A wrong field number or wire type in our protos would put the
data into unknown fields (or leave the checked field empty) and fail here.

The expected values are those the harness drove (README.md): an existing pod
``kube-system/existing`` during Synchronize, then ``default/gpu-pod`` with
container ``cuda`` through CreateContainer, StopContainer and removal.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from fracplugin._proto import nri_pb2, ttrpc_pb2

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ["v0.12.2", "v0.8.0"]
NRI_PACKAGE = "nri.pkg.api.v1alpha1"



def transcript_path(version: str) -> Path:
    path = REPO / "tests" / "fixtures" / "nri" / f"wire-nri-{version}.jsonl"
    if not path.is_file():
        pytest.fail(f"NRI fixture missing: {path} ")
    return path


# --- strict decoding -------------------------------------------------------------------


class UnknownFieldsError(AssertionError):
    """A decoded message (at ``path``) carried fields our protos do not define."""


def assert_no_unknown_fields(msg: Message, path: str = "") -> None:
    """Walk ``msg`` recursively; raise UnknownFieldsError naming the first offending path."""
    path = path or msg.DESCRIPTOR.full_name
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({(f.field_number, f.wire_type) for f in unknown})
        raise UnknownFieldsError(f"{path}: unknown (field number, wire type) {numbers}")
    for field, value in msg.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        sub = f"{path}.{field.name}"
        if field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                for key, item in value.items():
                    assert_no_unknown_fields(item, f"{sub}[{key!r}]")
        elif field.is_repeated:
            for i, item in enumerate(value):
                assert_no_unknown_fields(item, f"{sub}[{i}]")
        else:
            assert_no_unknown_fields(value, sub)


def decode(cls: type[Message], data: bytes) -> Message:
    """Parse ``data`` as ``cls`` and insist that every field was known."""
    msg = cls.FromString(data)
    assert_no_unknown_fields(msg)
    return msg


def method_types(service: str, method: str) -> tuple[type[Message], type[Message]]:
    """(request class, response class) for ``service``/``method`` from our NRI descriptor."""
    assert service.startswith(NRI_PACKAGE + "."), service
    svc = nri_pb2.DESCRIPTOR.services_by_name[service[len(NRI_PACKAGE) + 1:]]
    m = svc.methods_by_name[method]  # KeyError = an RPC our proto lacks
    return message_factory.GetMessageClass(m.input_type), message_factory.GetMessageClass(m.output_type)


@dataclass
class Call:
    """One unary ttrpc call as recorded: who called, envelope and inner messages."""

    caller: str  # "plugin" or "runtime"
    mux_conn: int
    stream: int
    request_env: ttrpc_pb2.Request
    request: Message
    response_env: ttrpc_pb2.Response | None = None
    response: Message | None = None
    request_bytes: bytes = b""
    response_bytes: bytes = b""


def load_calls(version: str) -> list[Call]:
    """Decode every line of a transcript strictly and pair requests with their responses."""
    lines = [json.loads(line) for line in transcript_path(version).read_text().splitlines() if line.strip()]
    assert lines, "empty transcript"
    calls: dict[tuple[int, int], Call] = {}
    order: list[Call] = []
    last_stream: dict[int, int] = {}
    for rec in lines:
        assert rec["flags"] == 0, rec  # NRI is unary-only
        payload = bytes.fromhex(rec["payload_hex"])
        key = (rec["mux_conn"], rec["stream"])
        if rec["type"] == 1:
            # The caller on conn 1 is the runtime, on conn 2 the plugin (docs/reference/nri-protocol.md 1.1).
            expected_dir = {1: "runtime->plugin", 2: "plugin->runtime"}[rec["mux_conn"]]
            assert rec["dir"] == expected_dir, rec
            assert rec["stream"] % 2 == 1 and rec["stream"] > last_stream.get(rec["mux_conn"], 0), rec
            last_stream[rec["mux_conn"]] = rec["stream"]
            env = decode(ttrpc_pb2.Request, payload)
            req_cls, _ = method_types(env.service, env.method)
            call = Call("runtime" if rec["mux_conn"] == 1 else "plugin", rec["mux_conn"], rec["stream"],
                        env, decode(req_cls, env.payload), request_bytes=payload)
            calls[key] = call
            order.append(call)
        elif rec["type"] == 2:
            call = calls[key]
            assert call.response_env is None, f"second response on {key}"
            env = decode(ttrpc_pb2.Response, payload)
            assert not env.HasField("status") or env.status.code == 0, env.status
            _, resp_cls = method_types(call.request_env.service, call.request_env.method)
            call.response_env = env
            call.response = decode(resp_cls, env.payload)
            call.response_bytes = payload
        else:
            pytest.fail(f"unexpected ttrpc message type {rec['type']}")
    assert all(c.response_env is not None for c in order), "request without response"
    return order


@pytest.fixture(scope="module", params=VERSIONS)
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def calls(version) -> list[Call]:
    return load_calls(version)


def by_method(calls: list[Call], method: str) -> list[Call]:
    return [c for c in calls if c.request_env.method == method]


def only(calls: list[Call], method: str) -> Call:
    found = by_method(calls, method)
    assert len(found) == 1, [c.request_env.method for c in calls]
    return found[0]


# --- the strict checker itself ------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def test_strict_decoder_rejects_an_unknown_field_number():
    # ConfigureRequest{runtime_name="x"} plus field 99 (varint 1): a proto that misnumbered a
    # field would leave exactly such a residue.
    good = nri_pb2.ConfigureRequest(runtime_name="x").SerializeToString()
    decode(nri_pb2.ConfigureRequest, good)
    with pytest.raises(UnknownFieldsError, match=r"\(99, 0\)"):
        decode(nri_pb2.ConfigureRequest, good + tag(99, 0) + varint(1))


def test_strict_decoder_finds_unknown_fields_deep_inside_maps_and_lists():
    inner = nri_pb2.LinuxMemory(limit=nri_pb2.OptionalInt64(value=5)).SerializeToString()
    bad_memory = inner + tag(42, 0) + varint(7)
    req = nri_pb2.CreateContainerRequest(container=nri_pb2.Container(name="c"))
    req.container.linux.resources.memory.ParseFromString(bad_memory)
    with pytest.raises(UnknownFieldsError, match=r"container\.linux\.resources\.memory"):
        decode(nri_pb2.CreateContainerRequest, req.SerializeToString())
    owners = nri_pb2.OwningPlugins()
    owners.owners["ctr"].simple[1] = "10-a"
    owners.owners["ctr"].compound[6].ParseFromString(tag(3, 0) + varint(1))
    with pytest.raises(UnknownFieldsError, match=r"owners\['ctr'\]\.compound\[6\]"):
        decode(nri_pb2.OwningPlugins, owners.SerializeToString())


def test_wrong_wire_type_for_a_known_number_is_caught():
    # Field 4 of ConfigureRequest is an int64 (varint); send it as a length-delimited string.
    with pytest.raises(UnknownFieldsError, match=r"\(4, 2\)"):
        decode(nri_pb2.ConfigureRequest, tag(4, 2) + varint(1) + b"A")


# --- the transcripts ----------------------------------------------------------------------


@pytest.mark.parametrize("ver", VERSIONS)
def test_every_payload_decodes_strictly(ver):
    calls = load_calls(ver)  # raises on any unknown field, unknown RPC or unpaired message
    lines = transcript_path(ver).read_text().splitlines()
    assert 2 * len(calls) == len([line for line in lines if line.strip()])


def test_transcript_has_the_expected_call_sequence(calls, version):
    seq = [(c.caller, c.request_env.service.rsplit(".", 1)[1], c.request_env.method) for c in calls]
    removal = ("runtime", "Plugin", "RemoveContainer") if version == "v0.12.2" else ("runtime", "Plugin", "StateChange")
    assert seq == [
        ("plugin", "Runtime", "RegisterPlugin"),
        ("runtime", "Plugin", "Configure"),
        ("runtime", "Plugin", "Synchronize"),
        ("runtime", "Plugin", "CreateContainer"),
        ("runtime", "Plugin", "StopContainer"),
        removal,
    ]


def test_envelopes(calls):
    for c in calls:
        assert len(c.request_env.metadata) == 0  # NRI sends no metadata (1.3)
        if c.caller == "runtime":
            # The runtime's deadline is its 2 s request timeout, minus a little elapsed time.
            assert 1_000_000_000 < c.request_env.timeout_nano <= 2_000_000_000
    reg = only(calls, "RegisterPlugin")
    assert reg.request_env.timeout_nano == 5_000_000_000
    # The runtime's RegisterPlugin reply is a zero-length Response: no status, Empty payload omitted.
    assert reg.response_bytes == b""
    assert isinstance(reg.response, nri_pb2.Empty)


def test_register_plugin_request(calls):
    reg = only(calls, "RegisterPlugin")
    assert isinstance(reg.request, nri_pb2.RegisterPluginRequest)
    assert reg.request.plugin_name == "pyprobe"
    assert reg.request.plugin_idx == "50"
    # What our encoder would send for the same request is byte-identical to the recording.
    ours = ttrpc_pb2.Request(
        service="nri.pkg.api.v1alpha1.Runtime", method="RegisterPlugin",
        payload=nri_pb2.RegisterPluginRequest(plugin_name="pyprobe", plugin_idx="50").SerializeToString(),
        timeout_nano=5_000_000_000,
    )
    assert ours.SerializeToString() == reg.request_bytes


def test_configure(calls, version):
    cfg = only(calls, "Configure")
    req = cfg.request
    assert isinstance(req, nri_pb2.ConfigureRequest)
    assert req.registration_timeout == 5000  # ms
    assert req.request_timeout == 2000  # ms
    assert req.runtime_name == "nri-harness"
    assert req.runtime_version == "v0.0.0-harness"
    assert req.config == ""  # external plugin
    assert req.NRI_version == ("v0.12.2" if version == "v0.12.2" else "")  # field 6 since v0.12.0
    resp = cfg.response
    assert isinstance(resp, nri_pb2.ConfigureResponse)
    mask = lambda *events: sum(1 << (e - 1) for e in events)  # noqa: E731  (docs/reference/nri-protocol.md 1.4)
    assert resp.events == mask(nri_pb2.CREATE_CONTAINER, nri_pb2.STOP_CONTAINER, nri_pb2.REMOVE_CONTAINER) == 0x608
    assert nri_pb2.ConfigureResponse(events=0x608).SerializeToString() == cfg.response_env.payload


def test_synchronize(calls):
    sync = only(calls, "Synchronize")
    req = sync.request
    assert isinstance(req, nri_pb2.SynchronizeRequest)
    assert req.more is False
    assert len(req.pods) == 1 and len(req.containers) == 1
    pod, ctr = req.pods[0], req.containers[0]
    assert (pod.id, pod.name, pod.uid, pod.namespace) == ("pod-existing-0001", "existing", "uid-existing", "kube-system")
    assert dict(pod.annotations) == {"example.com/existing": "true"}
    assert dict(pod.labels) == {}
    assert pod.linux.cgroup_parent == "/kubepods/besteffort/pod-existing"
    assert (ctr.id, ctr.pod_sandbox_id, ctr.name) == ("ctr-existing-0001", "pod-existing-0001", "existing")
    assert ctr.state == nri_pb2.CONTAINER_RUNNING
    assert list(ctr.env) == ["PATH=/usr/bin:/bin"]
    assert ctr.linux.resources.memory.limit.value == 268435456
    assert ctr.linux.resources.memory.HasField("limit")
    assert not ctr.linux.resources.memory.HasField("swap")
    # Our (only) answer to the last part: no updates, no more.
    assert isinstance(sync.response, nri_pb2.SynchronizeResponse)
    assert len(sync.response.update) == 0 and sync.response.more is False


def check_gpu_pod(pod: nri_pb2.PodSandbox) -> None:
    assert pod.id == "pod-0001"
    assert pod.name == "gpu-pod"
    assert pod.namespace == "default"
    assert pod.uid == "uid-0001"
    assert dict(pod.annotations) == {"gpu.example.com/fraction": "0.25", "gpu.example.com/memory": "4Gi"}
    assert pod.runtime_handler == "runc"
    assert pod.linux.cgroup_parent == "/kubepods/burstable/pod-uid-0001"


def check_cuda_container(ctr: nri_pb2.Container) -> None:
    assert ctr.id == "ctr-0001"
    assert ctr.pod_sandbox_id == "pod-0001"
    assert ctr.name == "cuda"
    assert dict(ctr.annotations) == {}
    assert list(ctr.args) == ["/bin/sh", "-c", "sleep 3600"]
    assert list(ctr.env) == ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    assert len(ctr.mounts) == 1
    m = ctr.mounts[0]
    assert (m.destination, m.type, m.source) == ("/etc/hosts", "bind", "/var/lib/kubelet/pods/uid-0001/etc-hosts")
    assert list(m.options) == ["rbind", "rprivate", "rw"]
    assert [ns.type for ns in ctr.linux.namespaces] == ["pid", "mount"]
    assert ctr.linux.resources.memory.limit.value == 1 << 30
    assert ctr.linux.resources.cpu.shares.value == 1024
    assert ctr.linux.cgroups_path == "kubepods-burstable-poduid_0001.slice:cri-containerd:ctr-0001"


def test_create_container(calls):
    cc = only(calls, "CreateContainer")
    assert isinstance(cc.request, nri_pb2.CreateContainerRequest)
    check_gpu_pod(cc.request.pod)
    check_cuda_container(cc.request.container)
    # containerd leaves the state unset (0) in CreateContainer (1.4).
    assert cc.request.container.state == nri_pb2.CONTAINER_UNKNOWN


def test_create_container_response(calls):
    cc = only(calls, "CreateContainer")
    resp = cc.response
    assert isinstance(resp, nri_pb2.CreateContainerResponse)
    adj = resp.adjust
    assert dict(adj.annotations) == {"gpu.example.com/adjusted": "true"}
    assert [(m.destination, m.type, m.source, list(m.options)) for m in adj.mounts] == [
        ("/tmp/nvidia-mps", "bind", "/run/nvidia/mps", ["rbind", "rw"])
    ]
    assert [(kv.key, kv.value) for kv in adj.env] == [
        ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4096M"),
        ("-REMOVE_ME", ""),  # removal marker (1.8)
    ]
    assert len(resp.update) == 0 and len(resp.evict) == 0
    # Rebuilding the same adjustment with our classes gives the recorded bytes.
    ours = nri_pb2.CreateContainerResponse(adjust=nri_pb2.ContainerAdjustment(
        annotations={"gpu.example.com/adjusted": "true"},
        mounts=[nri_pb2.Mount(destination="/tmp/nvidia-mps", type="bind", source="/run/nvidia/mps",
                              options=["rbind", "rw"])],
        env=[nri_pb2.KeyValue(key=k, value=v) for k, v in [
            ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4096M"), ("-REMOVE_ME", "")]],
    ))
    assert ttrpc_pb2.Response(payload=ours.SerializeToString()).SerializeToString() == cc.response_bytes


def test_stop_container(calls):
    sc = only(calls, "StopContainer")
    assert isinstance(sc.request, nri_pb2.StopContainerRequest)
    check_gpu_pod(sc.request.pod)
    check_cuda_container(sc.request.container)
    assert sc.request.container.state == nri_pb2.CONTAINER_STOPPED
    assert isinstance(sc.response, nri_pb2.StopContainerResponse)
    assert len(sc.response.update) == 0


def test_container_removal(calls, version):
    last = calls[-1]
    if version == "v0.12.2":
        # v0.12+ runtimes use the dedicated RPC (1.7).
        assert isinstance(last.request, nri_pb2.RemoveContainerRequest)
        assert isinstance(last.response, nri_pb2.RemoveContainerResponse)
        pod, ctr = last.request.pod, last.request.container
    else:
        # Older runtimes carry it as StateChange{event, pod, container} (1.7).
        assert isinstance(last.request, nri_pb2.StateChangeEvent)
        assert last.request.event == nri_pb2.REMOVE_CONTAINER
        assert isinstance(last.response, nri_pb2.Empty)
        pod, ctr = last.request.pod, last.request.container
    check_gpu_pod(pod)
    check_cuda_container(ctr)
    assert ctr.state == nri_pb2.CONTAINER_STOPPED
