"""dcgm-exporter next to fracplugin (docs/operator-guide.md, "### Next to dcgm-exporter").

dcgm-exporter (NVIDIA/dcgm-exporter 4.5.3-4.8.2) attributes a GPU's series to pods from kubelet's
PodResources ``List``. Its rule, written here from its source as the guide states it
(``internal/pkg/transformation/kubernetes.go``: ``iterateGPUDevices``, ``toDeviceToPod``,
``toDeviceToSharingPods``, ``getSharedGPU``; ``internal/pkg/collector/types.go``:
``Metric.GetIDOfType``):

* a device entry counts when its resource is ``nvidia.com/gpu``, one named by
  ``--nvidia-resource-names``, or ``nvidia.com/mig-*``; others are skipped;
* a device ID is keyed as itself and, when it holds ``::`` (and is no ``MIG-`` or GKE ID), also
  as the part before the first ``::``; the part after is the ``vgpu`` label;
* a GPU's series looks its key up by ``--kubernetes-gpu-id-type``: ``uid`` (default) the GPU's
  UUID, ``device-name`` ``nvidia<minor>``;
* without ``--kubernetes-virtual-gpus`` a key holds one container (a later one overwrites it);
  with it, every (container, device ID) is one copy of the GPU's series;
* DRA claims count only for driver ``gpu.nvidia.com`` (``toDeviceToPodsDRA``).

The fixture is kubelet's ``List`` answer on the simulated node with the device plugin door on
(tests/fixtures/podresources/README.md). The last test checks that fracplugin's series carry the
UUID that rule keys on, in dcgm-exporter's own label name, so ``on(UUID)`` joins them.
"""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from fracplugin._proto import podresources_pb2 as pb
from fracplugin.dra import DRIVER_NAME
from fracplugin.kubelet.devices import DEFAULT_RESOURCE_NAME, DeviceTable, parse_device_id
from fracplugin.metrics import DCGM_GPU_LABELS
from fracplugin.gpu.simulated import load_node

REPO = Path(__file__).resolve().parents[2]
NODE = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
FIXTURE = REPO / "tests" / "fixtures" / "podresources" / "list-gpu-node-1.json"
RECORDED = REPO / "tests" / "fixtures" / "podresources" / "kubelet-v1.37.2-dcgm.json"
CAPTURE = REPO / "tests" / "fixtures" / "metrics" / "daemon-metrics.txt"
GUIDE = REPO / "docs" / "operator-guide.md"
UUID = {g.index: g.uuid for g in NODE.gpus}

Who = tuple[str, str, str, str]
"""(namespace, pod, container, vgpu label or "")."""


def listed() -> pb.ListPodResourcesResponse:
    """The fixture parsed with kubelet's PodResources v1 proto (unknown fields are an error)."""
    return json_format.Parse(FIXTURE.read_text(), pb.ListPodResourcesResponse())


def dcgm_keys(device_id: str) -> list[str]:
    """The keys dcgm-exporter files a (non-MIG, non-GKE) device ID under: the part before ``::``,
    when there is one, and the ID itself."""
    assert not device_id.startswith("MIG-") and "/vgpu" not in device_id
    return ([device_id.split("::")[0]] if "::" in device_id else []) + [device_id]


def dcgm_attribution(resp: pb.ListPodResourcesResponse, resource_names: list[str], virtual_gpus: bool,
                     id_type: str = "uid") -> dict[int, list[Who]]:
    """GPU index -> the containers dcgm-exporter puts on that GPU's series (one entry per copy)."""
    by_key: dict[str, list[Who]] = {}
    for pod in resp.pod_resources:
        for ct in pod.containers:
            for dev in ct.devices:
                name = dev.resource_name
                if name != "nvidia.com/gpu" and name not in resource_names and not name.startswith("nvidia.com/mig-"):
                    continue
                for d in dev.device_ids:
                    vgpu = d.split("::")[1] if "::" in d else ""
                    for key in dcgm_keys(d):
                        if virtual_gpus:
                            by_key.setdefault(key, []).append((pod.namespace, pod.name, ct.name, vgpu))
                        else:
                            by_key[key] = [(pod.namespace, pod.name, ct.name, "")]
            for dr in ct.dynamic_resources:  # toDeviceToPodsDRA: NVIDIA's DRA driver only
                assert all(c.driver_name != "gpu.nvidia.com" for c in dr.claim_resources)
    series_id = {g.index: (g.uuid if id_type == "uid" else f"nvidia{g.minor}") for g in NODE.gpus}
    return {i: by_key[k] for i, k in series_id.items() if k in by_key}


def test_fixture_holds_what_the_device_plugin_door_hands_kubelet():
    table = DeviceTable.build(NODE)
    ours = [(dev, d) for p in listed().pod_resources for ct in p.containers for dev in ct.devices for d in dev.device_ids]
    assert ours and all(dev.resource_name == DEFAULT_RESOURCE_NAME for dev, _ in ours)
    for dev, d in ours:
        gpu = table.gpu_of(d)  # raises for an ID the door never advertises
        assert [n.ID for n in dev.topology.nodes] == [gpu.numa_node]
    assert len({d for _, d in ours}) == len(ours)
    claims = [c for p in listed().pod_resources for ct in p.containers for dr in ct.dynamic_resources
              for c in dr.claim_resources]
    assert [c.driver_name for c in claims] == [DRIVER_NAME]


def test_resource_name_flag_attributes_each_gpu_to_one_container_the_last_listed():
    got = dcgm_attribution(listed(), [DEFAULT_RESOURCE_NAME], virtual_gpus=False)
    assert got == {
        0: [("default", "llm-b", "app", "")],  # GPU 0 is shared with default/embeddings, which is lost
        2: [("research", "trainer", "app", "")],
        3: [("research", "trainer", "app", "")],
    }


def test_virtual_gpus_copies_a_gpus_series_per_container_and_unit():
    got = dcgm_attribution(listed(), [DEFAULT_RESOURCE_NAME], virtual_gpus=True)
    assert got[0] == ([("default", "embeddings", "worker", str(n)) for n in range(8)]
                      + [("default", "llm-b", "app", str(n)) for n in range(8, 12)])
    assert got[2] == got[3] == [("research", "trainer", "app", str(n)) for n in range(4)]
    assert set(got) == {0, 2, 3}


def test_nothing_attributed_without_the_flag_or_with_device_names():
    for virtual in (False, True):
        assert dcgm_attribution(listed(), [], virtual) == {}
        assert dcgm_attribution(listed(), [DEFAULT_RESOURCE_NAME], virtual, id_type="device-name") == {}


def test_nri_and_dra_door_pods_are_never_attributed():
    for virtual in (False, True):
        pods = {w[1] for ws in dcgm_attribution(listed(), [DEFAULT_RESOURCE_NAME], virtual).values() for w in ws}
        assert not pods & {"notebook", "claim-pod", "kube-proxy-x7k2p"}


def test_fracplugin_series_carry_the_uuid_dcgm_keys_on_so_on_uuid_joins():
    # the key dcgm-exporter derives from our IDs is the GPU's UUID ...
    for p in listed().pod_resources:
        for ct in p.containers:
            for dev in ct.devices:
                for d in dev.device_ids:
                    assert dcgm_keys(d)[0] == parse_device_id(d)[0] in UUID.values()
    # ... which every per-GPU series of fracplugin's carries under dcgm-exporter's label name
    assert DCGM_GPU_LABELS[:2] == ("UUID", "gpu")
    per_gpu = [s for fam in text_string_to_metric_families(CAPTURE.read_text()) for s in fam.samples
               if "gpu" in s.labels]
    assert any(s.name == "fracplugin_container_gpu_memory_used_bytes" for s in per_gpu)
    for s in per_gpu:
        assert s.labels["UUID"] == UUID[int(s.labels["gpu"])], s
    # the guide's join names that label and reduces dcgm-exporter's copies to one series per GPU
    guide = GUIDE.read_text()
    assert "on(UUID) group_left" in guide and "max by (UUID) (DCGM_FI_DEV_FB_USED)" in guide
    assert json.loads(FIXTURE.read_text())["podResources"]


def test_the_recorded_list_of_a_real_kubelet_reads_the_same():
    """kubelet v1.37.2's own List (recorded in make kubelet-e2e; one ``devices`` entry per ID):
    pods dcgm-a (8 units) and dcgm-b (4 units), both on GPU 0, each unit one copy."""
    resp = json_format.Parse(RECORDED.read_text(), pb.ListPodResourcesResponse())
    got = dcgm_attribution(resp, [DEFAULT_RESOURCE_NAME], virtual_gpus=True)
    assert {i: sorted({w[1] for w in ws}) for i, ws in got.items()} == {0: ["dcgm-a", "dcgm-b"]}
    assert sorted(w[1] for w in got[0]) == ["dcgm-a"] * 8 + ["dcgm-b"] * 4
    (who,) = dcgm_attribution(resp, [DEFAULT_RESOURCE_NAME], virtual_gpus=False)[0]
    assert who[1] in ("dcgm-a", "dcgm-b")
