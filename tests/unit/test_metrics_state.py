"""The door and GPU-health gauges the alerts need (issue 16): GPU memory total,
GPU healthy, NRI connected / synchronized / unadjusted containers, device
plugin registered, all fed by ``Metrics.attach_state`` at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.ledger import Ledger
from fracplugin.metrics import MIB, Metrics


NODE = "gpu-node-1"  # the simulated node's name: the node label of every series
MODEL = "NVIDIA H100 80GB HBM3"


def scrape(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without ``node``): value}; every sample
    must carry ``node`` = the node's name."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            labels = dict(s.labels)
            assert labels.pop("node", None) == NODE, (s.name, s.labels)
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def gl(gpu, idx):
    return tuple(sorted({"gpu_uuid": gpu, "gpu_index": str(idx),
                         "UUID": gpu, "gpu": str(idx), "modelName": MODEL, "Hostname": NODE}.items()))


def test_gpu_memory_total_is_the_inventory(node_file):
    inv = SimulatedInventory(node_file)
    node = inv.node()
    s = scrape(Metrics(ledger=Ledger(node), inventory=inv))
    for g in node.gpus:
        assert s[("fracplugin_gpu_memory_total_bytes", gl(g.uuid, g.index))] == g.memory_mib * MIB
    # without attach_state the door and health series are absent (not a made-up 0 or 1)
    assert not any(k[0] in ("fracplugin_gpu_healthy", "fracplugin_nri_connected",
                            "fracplugin_device_plugin_registered") for k in s)


def test_state_series_follow_the_state(node_file):
    inv = SimulatedInventory(node_file)
    node = inv.node()
    g0, g1 = node.gpus[0], node.gpus[1]
    state = {"nri": {"connected": True, "synchronized": False, "unadjusted": 2},
             "device_plugin": {"registered": False},
             "gpu_healthy": {g0.uuid: True, g1.uuid: False}}
    m = Metrics(ledger=Ledger(node), inventory=inv)
    m.attach_state(lambda: state)
    s = scrape(m)
    assert s[("fracplugin_gpu_healthy", gl(g0.uuid, 0))] == 1
    assert s[("fracplugin_gpu_healthy", gl(g1.uuid, 1))] == 0
    assert ("fracplugin_gpu_healthy", gl(node.gpus[2].uuid, 2)) not in s  # not reported: no series
    assert s[("fracplugin_nri_connected", ())] == 1
    assert s[("fracplugin_nri_synchronized", ())] == 0
    assert s[("fracplugin_nri_unadjusted_containers", ())] == 2
    assert s[("fracplugin_device_plugin_registered", ())] == 0

    state.update(nri=None, device_plugin={"registered": True})  # NRI door off: its series go away
    s = scrape(m)
    assert ("fracplugin_nri_connected", ()) not in s
    assert s[("fracplugin_device_plugin_registered", ())] == 1


def test_failing_state_skips_only_its_series(node_file):
    inv = SimulatedInventory(node_file)
    m = Metrics(ledger=Ledger(inv.node()), inventory=inv)

    def boom():
        raise RuntimeError("boom")

    m.attach_state(boom)
    s = scrape(m)
    assert s[("fracplugin_ledger_entries", ())] == 0
    assert ("fracplugin_device_plugin_registered", ()) not in s
