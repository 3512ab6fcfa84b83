"""The committed generated code in src/fracplugin/_proto is current, and our
protos carry the wire facts of the references.

- Regenerates with scripts/genproto.py into a temp dir and compares byte for
  byte with the committed package (fails when someone edited proto/** without
  running ``make proto``, or edited generated files by hand).
- Checks service paths and field numbers/types of the kubelet APIs against
  shared reference docs/reference/kubelet-device-plugin.md A.2, A.3, A.7 and of the
  ttrpc envelope against docs/reference/nri-protocol.md 1.3 (NRI itself is checked against
  real wire transcripts in test_nri_fixtures.py).
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD

from fracplugin._proto import deviceplugin_pb2, podresources_pb2, ttrpc_pb2

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "src" / "fracplugin" / "_proto"


@pytest.fixture(scope="module")
def genproto():
    spec = importlib.util.spec_from_file_location("genproto", REPO / "scripts" / "genproto.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def regenerated(genproto, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("proto") / "_proto"
    genproto.generate(out)
    return out


def test_committed_generated_code_is_current(genproto, regenerated):
    problems = genproto.compare(regenerated, COMMITTED)
    assert not problems, "stale generated code; run `make proto`:\n" + "\n".join(problems)


def test_stale_code_is_detected(genproto, regenerated, tmp_path):
    copy = tmp_path / "_proto"
    shutil.copytree(regenerated, copy)
    assert genproto.compare(regenerated, copy) == []
    target = copy / "nri_pb2.py"
    target.write_text(target.read_text().replace("CreateContainer", "CreateContainr", 1))
    (copy / "leftover_pb2.py").write_text("")
    (copy / "ttrpc_pb2.pyi").unlink()
    problems = genproto.compare(regenerated, copy)
    assert any(p.startswith("differs: nri_pb2.py") for p in problems)
    assert "unexpected (stale): leftover_pb2.py" in problems
    assert "missing: ttrpc_pb2.pyi" in problems


def test_generation_is_deterministic(genproto, regenerated, tmp_path):
    again = tmp_path / "again"
    genproto.generate(again)
    assert genproto.compare(regenerated, again) == []


def test_generated_package_imports_cleanly_in_a_fresh_interpreter():
    # -W error: a protobuf gencode/runtime mismatch warning or a grpc version warning fails.
    code = ("import fracplugin._proto.ttrpc_pb2, fracplugin._proto.nri_pb2, "
            "fracplugin._proto.deviceplugin_pb2, fracplugin._proto.deviceplugin_pb2_grpc, "
            "fracplugin._proto.podresources_pb2, fracplugin._proto.podresources_pb2_grpc")
    env_path = str(REPO / "src")
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --- wire facts ---------------------------------------------------------------------------

S, B, I32, I64, U64, BOOL, MSG = FD.TYPE_STRING, FD.TYPE_BYTES, FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT64, FD.TYPE_BOOL, FD.TYPE_MESSAGE
REP = "repeated"
MAP = "map"

# message -> {field name: (number, type[, REP|MAP][, message type name])}
DEVICEPLUGIN = {  # docs/reference/kubelet-device-plugin.md A.3
    "DevicePluginOptions": {"pre_start_required": (1, BOOL), "get_preferred_allocation_available": (2, BOOL)},
    "RegisterRequest": {"version": (1, S), "endpoint": (2, S), "resource_name": (3, S),
                        "options": (4, MSG, "DevicePluginOptions")},
    "ListAndWatchResponse": {"devices": (1, MSG, REP, "Device")},
    "Device": {"ID": (1, S), "health": (2, S), "topology": (3, MSG, "TopologyInfo")},
    "TopologyInfo": {"nodes": (1, MSG, REP, "NUMANode")},
    "NUMANode": {"ID": (1, I64)},
    "PreStartContainerRequest": {"devices_ids": (1, S, REP)},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {"container_requests": (1, MSG, REP, "ContainerPreferredAllocationRequest")},
    "ContainerPreferredAllocationRequest": {"available_deviceIDs": (1, S, REP), "must_include_deviceIDs": (2, S, REP),
                                            "allocation_size": (3, I32)},
    "PreferredAllocationResponse": {"container_responses": (1, MSG, REP, "ContainerPreferredAllocationResponse")},
    "ContainerPreferredAllocationResponse": {"deviceIDs": (1, S, REP)},
    "AllocateRequest": {"container_requests": (1, MSG, REP, "ContainerAllocateRequest")},
    "ContainerAllocateRequest": {"devices_ids": (1, S, REP)},
    "AllocateResponse": {"container_responses": (1, MSG, REP, "ContainerAllocateResponse")},
    "ContainerAllocateResponse": {"envs": (1, MSG, MAP), "mounts": (2, MSG, REP, "Mount"),
                                  "devices": (3, MSG, REP, "DeviceSpec"), "annotations": (4, MSG, MAP),
                                  "cdi_devices": (5, MSG, REP, "CDIDevice")},
    "Mount": {"container_path": (1, S), "host_path": (2, S), "read_only": (3, BOOL)},
    "DeviceSpec": {"container_path": (1, S), "host_path": (2, S), "permissions": (3, S)},
    "CDIDevice": {"name": (1, S)},
    "Empty": {},
}

PODRESOURCES = {  # docs/reference/kubelet-device-plugin.md A.7
    "ListPodResourcesRequest": {},
    "ListPodResourcesResponse": {"pod_resources": (1, MSG, REP, "PodResources")},
    "GetPodResourcesRequest": {"pod_name": (1, S), "pod_namespace": (2, S)},
    "GetPodResourcesResponse": {"pod_resources": (1, MSG, "PodResources")},
    "AllocatableResourcesRequest": {},
    "AllocatableResourcesResponse": {"devices": (1, MSG, REP, "ContainerDevices"), "cpu_ids": (2, I64, REP),
                                     "memory": (3, MSG, REP, "ContainerMemory")},
    "PodResources": {"name": (1, S), "namespace": (2, S), "containers": (3, MSG, REP, "ContainerResources"),
                     "cpu_ids": (4, I64, REP), "memory": (5, MSG, REP, "ContainerMemory")},
    "ContainerResources": {"name": (1, S), "devices": (2, MSG, REP, "ContainerDevices"), "cpu_ids": (3, I64, REP),
                           "memory": (4, MSG, REP, "ContainerMemory"),
                           "dynamic_resources": (5, MSG, REP, "DynamicResource")},
    "ContainerDevices": {"resource_name": (1, S), "device_ids": (2, S, REP), "topology": (3, MSG, "TopologyInfo")},
    "ContainerMemory": {"memory_type": (1, S), "size": (2, U64), "topology": (3, MSG, "TopologyInfo")},
    "TopologyInfo": {"nodes": (1, MSG, REP, "NUMANode")},
    "NUMANode": {"ID": (1, I64)},
    "DynamicResource": {"claim_name": (2, S), "claim_namespace": (3, S),
                        "claim_resources": (4, MSG, REP, "ClaimResource")},
    "ClaimResource": {"cdi_devices": (1, MSG, REP, "CDIDevice"), "driver_name": (2, S), "pool_name": (3, S),
                      "device_name": (4, S), "share_id": (5, S)},
    "CDIDevice": {"name": (1, S)},
}

TTRPC = {  # docs/reference/nri-protocol.md 1.3
    "Request": {"service": (1, S), "method": (2, S), "payload": (3, B), "timeout_nano": (4, I64),
                "metadata": (5, MSG, REP, "KeyValue")},
    "Response": {"status": (1, MSG, "Status"), "payload": (2, B)},
    "KeyValue": {"key": (1, S), "value": (2, S)},
    "StringList": {"list": (1, S, REP)},
    "Status": {"code": (1, I32), "message": (2, S), "details": (3, MSG, REP, "Any")},
}


def _check_messages(module, table):
    for msg_name, fields in table.items():
        desc = module.DESCRIPTOR.message_types_by_name[msg_name]
        assert {f.name for f in desc.fields} == set(fields), msg_name
        for fname, spec in fields.items():
            f = desc.fields_by_name[fname]
            number, ftype, *rest = spec
            assert (f.number, f.type) == (number, ftype), f"{msg_name}.{fname}"
            is_map = f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry
            assert is_map == (MAP in rest), f"{msg_name}.{fname} map"
            assert (f.is_repeated and not is_map) == (REP in rest), f"{msg_name}.{fname} repeated"
            names = [r for r in rest if r not in (REP, MAP)]
            if names:
                assert f.message_type.name == names[0], f"{msg_name}.{fname} type"


def test_deviceplugin_messages():
    _check_messages(deviceplugin_pb2, DEVICEPLUGIN)
    assert deviceplugin_pb2.DESCRIPTOR.package == "v1beta1"


def test_podresources_messages():
    _check_messages(podresources_pb2, PODRESOURCES)
    assert podresources_pb2.DESCRIPTOR.package == "v1"
    cr = podresources_pb2.ClaimResource
    assert cr.DESCRIPTOR.fields_by_name["share_id"].has_presence  # `optional` since 1.35
    dr = podresources_pb2.DynamicResource(claim_name="c")
    assert dr.SerializeToString() == b"\x12\x01c"  # field 2, not 1


def test_ttrpc_envelope():
    _check_messages(ttrpc_pb2, TTRPC)
    assert ttrpc_pb2.Status.DESCRIPTOR.fields_by_name["details"].message_type.full_name == "google.protobuf.Any"
    # A Status with code and message encodes like google.rpc.Status.
    st = ttrpc_pb2.Status(code=12, message="method Foo")
    assert st.SerializeToString() == b"\x08\x0c\x12\x0amethod Foo"


def _rpcs(module, service):
    svc = module.DESCRIPTOR.services_by_name[service]
    return {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in svc.methods}


def test_grpc_service_paths():
    assert deviceplugin_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    assert _rpcs(deviceplugin_pb2, "Registration") == {"Register": ("RegisterRequest", "Empty", False)}
    assert _rpcs(deviceplugin_pb2, "DevicePlugin") == {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }
    assert podresources_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"
    assert _rpcs(podresources_pb2, "PodResourcesLister") == {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse", False),
        "GetAllocatableResources": ("AllocatableResourcesRequest", "AllocatableResourcesResponse", False),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse", False),
    }


def test_grpc_stubs_use_the_kubelet_paths():
    from fracplugin._proto import deviceplugin_pb2_grpc, podresources_pb2_grpc

    seen = []

    class FakeChannel:
        def unary_unary(self, path, **_kw):
            seen.append(path)

        unary_stream = unary_unary

    deviceplugin_pb2_grpc.RegistrationStub(FakeChannel())
    deviceplugin_pb2_grpc.DevicePluginStub(FakeChannel())
    podresources_pb2_grpc.PodResourcesListerStub(FakeChannel())
    assert sorted(seen) == sorted([
        "/v1beta1.Registration/Register",
        "/v1beta1.DevicePlugin/GetDevicePluginOptions", "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation", "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
        "/v1.PodResourcesLister/List", "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/Get",
    ])
