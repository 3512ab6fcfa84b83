"""build_adjustment shares the env part between plans (issue 14): the
adjustment is still, byte for byte, the one built field by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fracplugin._proto import nri_pb2
from fracplugin.gpu.simulated import load_node
from fracplugin.model import PodRef
from fracplugin.nri.plugin import build_adjustment
from fracplugin.planner import EmptyLedger, PlannerConfig
from tests.helpers import plan_container

NODE = load_node(str(Path(__file__).resolve().parents[2] / "examples" / "nodes" / "gpu-node-1.yaml"))
P = "nvidia.com/container.app."


def field_by_field(plan_):
    adj = nri_pb2.ContainerAdjustment()
    for key, value in plan_.env.items():
        adj.env.add(key="-" + key)
        adj.env.add(key=key, value=str(value))
    for m in plan_.mounts:
        adj.mounts.add(destination=m.destination, type="bind", source=m.source, options=list(m.options))
    for name in plan_.cdi_devices:
        adj.CDI_devices.add(name=name)
    return adj


@pytest.mark.parametrize("annotations", [
    {P + "gpu-memory.request": "1Gi", P + "gpus.devices": "0"},
    {P + "gpu-memory.request": "1Gi", P + "gpu-memory.limit": "3Gi", P + "gpus.devices": "0,1"},
    {P + "gpu-memory.request": "2Gi", P + "gpu-compute.mode": "sm-sharing", P + "gpu-compute.portion": "0.3",
     P + "gpus.devices": "k8s.device-plugin.nvidia.com/gpu=1"},
    {P + "gpu-memory.request": "5Gi"},
])
def test_same_bytes_as_field_by_field(annotations):
    for uid in ("pod-a", "pod-b", "pod-a"):  # the second pod and the repeat reuse the shared env part
        p = plan_container(annotations, "app", PodRef("ns", uid, uid), NODE, EmptyLedger(), PlannerConfig())
        assert p is not None
        got, want = build_adjustment(p), field_by_field(p)
        assert got == want
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
        assert got.mounts[0].source.endswith(p.mps_namespace or "")  # the pod's own pipe directory


def test_answers_do_not_share_state():
    p = plan_container({P + "gpu-memory.request": "1Gi", P + "gpus.devices": "0"}, "app",
                       PodRef("ns", "p", "p"), NODE, EmptyLedger(), PlannerConfig())
    assert p is not None
    first = build_adjustment(p)
    first.env.add(key="EXTRA", value="1")  # a caller changing its answer
    assert "EXTRA" not in [kv.key for kv in build_adjustment(p).env]
