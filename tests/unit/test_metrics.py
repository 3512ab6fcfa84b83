"""Metrics against a simulated node, a real Ledger and processes attributed to
containers through an injected /proc (cgroup files and exe links)."""

from __future__ import annotations

import os
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fracplugin.gpu.inventory import ProcessSample
from fracplugin.gpu.simulated import SimulatedInventory
from fracplugin.ledger import Ledger
from fracplugin.metrics import MIB, Metrics
from fracplugin.model import ComputeMode, Tenancy

CID_A = "a1" * 32
CID_B = "b2" * 32
CID_C = "c3" * 32
UID_A = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
UID_B = "11111111-2222-3333-4444-555555555555"
UID_C = "99999999-8888-7777-6666-555555555555"
UID_D = "dddddddd-eeee-ffff-0000-111111111111"
GPU0 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01"
GPU1 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a02"
GPU_MIB = 81559


def _cg_systemd(uid: str, cid: str) -> str:
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
            f"cri-containerd-{cid}.scope\n")


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()

    def add(pid: int, cgroup: str | None = None, exe: str | None = None) -> None:
        d = root / str(pid)
        d.mkdir()
        if cgroup is not None:
            (d / "cgroup").write_text(cgroup)
        if exe is not None:
            os.symlink(exe, d / "exe")

    add(101, _cg_systemd(UID_A, CID_A))
    add(102, _cg_systemd(UID_A, CID_A))
    # CRI-O container on cgroup v1 with the cgroupfs driver
    add(201, f"4:memory:/kubepods/burstable/pod{UID_B}/{CID_B}\n1:name=systemd:/kubepods/burstable/pod{UID_B}/{CID_B}\n")
    add(300, "0::/system.slice/fracplugin.service\n", exe="/usr/bin/nvidia-cuda-mps-server")  # the MPS server
    add(400, "0::/user.slice/user-0.slice/session-1.scope\n")  # a host process
    add(501, f"0::/kubepods.slice/kubepods-pod{UID_D.replace('-', '_')}.slice/crio-{'e4' * 32}.scope\n")
    add(601, _cg_systemd(UID_C, CID_C))  # a container fracplugin does not know
    return str(root)


def _tenancy(uid, name, container, gpu, req, lim, mode=ComputeMode.TIME_SLICING, cid="", atp=None):
    return Tenancy(pod_uid=uid, namespace="ml", pod_name=name, container=container, gpu_uuid=gpu,
                   request_mib=req, limit_mib=lim, mode=mode, container_id=cid, active_thread_percentage=atp)


@pytest.fixture
def setup(node_file, proc):
    inv = SimulatedInventory(node_file)
    ledger = Ledger(inv.node())
    ledger.replace_all([
        _tenancy(UID_A, "trainer", "main", GPU0, 10240, 20480, cid=CID_A),
        _tenancy(UID_B, "infer", "srv", GPU1, 8192, 8192, ComputeMode.SM_SHARING, cid=CID_B, atp=30),
        _tenancy(UID_C, "idle", "x", GPU0, 1024, 2048, cid="f" * 64),  # no processes: zero series
        _tenancy(UID_D, "legacy", "only", GPU1, 2048, 4096, ComputeMode.SM_SHARING),  # Allocate door: no id
    ])
    inv.set_processes([
        ProcessSample(GPU0, 101, 1 * 1024 * MIB, 10.0),
        ProcessSample(GPU0, 102, 2 * 1024 * MIB, 15.0),
        ProcessSample(GPU1, 201, 512 * MIB, 12.0),
        ProcessSample(GPU0, 300, 4 * 1024 * MIB, 60.0),  # MPS server: not a tenant
        ProcessSample(GPU0, 400, 256 * MIB, 5.0),
        ProcessSample(GPU1, 501, 100 * MIB, None),  # joined by pod uid (no container id in the ledger)
        ProcessSample(GPU0, 601, 300 * MIB, 20.0),  # unknown container
        ProcessSample(GPU0, 999, 1 * MIB, 1.0),  # exited before the scrape
        ProcessSample(GPU1, 101, 64 * MIB, 3.0),  # A on a GPU it holds no tenancy of: ignored
    ])
    metrics = Metrics(ledger=ledger, inventory=inv, proc_root=proc)
    return metrics, ledger, inv


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


def cl(uid, pod, container, gpu, idx):
    return tuple(sorted({"namespace": "ml", "pod": pod, "pod_uid": uid, "container": container,
                         "gpu_uuid": gpu, "gpu_index": str(idx),
                         "UUID": gpu, "gpu": str(idx), "modelName": MODEL, "Hostname": NODE}.items()))


def gl(gpu, idx, **extra):
    return tuple(sorted({"gpu_uuid": gpu, "gpu_index": str(idx), "UUID": gpu, "gpu": str(idx),
                              "modelName": MODEL, "Hostname": NODE, **extra}.items()))


def test_per_container_series_are_attributed_through_cgroups(setup):
    metrics, _, _ = setup
    s = scrape(metrics)
    a = cl(UID_A, "trainer", "main", GPU0, 0)
    assert s[("fracplugin_container_gpu_memory_used_bytes", a)] == 3 * 1024 * MIB  # not the server's 4 GiB
    assert s[("fracplugin_container_gpu_memory_request_bytes", a)] == 10240 * MIB
    assert s[("fracplugin_container_gpu_memory_limit_bytes", a)] == 20480 * MIB
    assert s[("fracplugin_container_sm_utilization_percent", a)] == 25.0
    assert s[("fracplugin_container_sm_utilization_share_percent", a)] == pytest.approx(min(100, 25 / (20480 / GPU_MIB)))
    b = cl(UID_B, "infer", "srv", GPU1, 1)
    assert s[("fracplugin_container_gpu_memory_used_bytes", b)] == 512 * MIB
    assert s[("fracplugin_container_sm_utilization_percent", b)] == 12.0
    assert s[("fracplugin_container_sm_utilization_share_percent", b)] == pytest.approx(40.0)  # 12 % of a 30 % share
    c = cl(UID_C, "idle", "x", GPU0, 0)
    assert s[("fracplugin_container_gpu_memory_used_bytes", c)] == 0
    assert s[("fracplugin_container_sm_utilization_percent", c)] == 0
    d = cl(UID_D, "legacy", "only", GPU1, 1)
    assert s[("fracplugin_container_gpu_memory_used_bytes", d)] == 100 * MIB
    # nothing is reported for the unknown container or host processes
    assert not any(k[0].startswith("fracplugin_container") and ("pod_uid", UID_C) in k[1] and ("container", "x") not in k[1]
                   for k in s)
    used_total = sum(v for k, v in s.items() if k[0] == "fracplugin_container_gpu_memory_used_bytes")
    assert used_total == (3 * 1024 + 512 + 100) * MIB


def test_sm_is_clamped_to_100(setup):
    metrics, _, inv = setup
    inv.set_processes([ProcessSample(GPU0, 101, 0, 80.0), ProcessSample(GPU0, 102, 0, 70.0)])
    s = scrape(metrics)
    a = cl(UID_A, "trainer", "main", GPU0, 0)
    assert s[("fracplugin_container_sm_utilization_percent", a)] == 100.0
    assert s[("fracplugin_container_sm_utilization_share_percent", a)] == 100.0


def test_per_gpu_and_ledger_series(setup):
    metrics, ledger, _ = setup
    s = scrape(metrics)
    assert s[("fracplugin_gpu_tenants", gl(GPU0, 0))] == 2
    assert s[("fracplugin_gpu_tenants", gl(GPU1, 1))] == 2
    assert s[("fracplugin_gpu_memory_held_bytes", gl(GPU0, 0))] == sum(t.request_mib for t in ledger.tenants(GPU0)) * MIB == (10240 + 1024) * MIB
    assert s[("fracplugin_gpu_compute_mode_info", gl(GPU0, 0, mode="time-slicing"))] == 1
    assert s[("fracplugin_gpu_compute_mode_info", gl(GPU1, 1, mode="sm-sharing"))] == 1
    gpu2 = ledger.node.gpus[2]
    assert s[("fracplugin_gpu_compute_mode_info", gl(gpu2.uuid, 2, mode="none"))] == 1
    assert s[("fracplugin_gpu_tenants", gl(gpu2.uuid, 2))] == 0
    assert s[("fracplugin_ledger_entries", ())] == 4
    ledger.release(UID_A, "main")
    s = scrape(metrics)
    assert s[("fracplugin_ledger_entries", ())] == 3
    assert not any(k[0] == "fracplugin_container_gpu_memory_request_bytes" and ("pod_uid", UID_A) in k[1] for k in s)


def test_nvml_failure_drops_usage_series_and_counts(setup, node_file, proc):
    _, ledger, _ = setup

    class Broken(SimulatedInventory):
        def processes(self):
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    metrics = Metrics(ledger=ledger, inventory=Broken(node_file), proc_root=proc)
    s = scrape(metrics)
    a = cl(UID_A, "trainer", "main", GPU0, 0)
    assert ("fracplugin_container_gpu_memory_used_bytes", a) not in s
    assert ("fracplugin_container_sm_utilization_percent", a) not in s
    assert s[("fracplugin_container_gpu_memory_request_bytes", a)] == 10240 * MIB
    assert s[("fracplugin_nvml_failures_total", ())] == 1
    scrape(metrics)
    assert scrape(metrics)[("fracplugin_nvml_failures_total", ())] == 3


def test_hooks_refusals_and_daemon_series(setup):
    metrics, _, _ = setup
    metrics.observe_hook("nri", 0.003)
    metrics.observe_hook("nri", 0.2)
    metrics.observe_hook("allocate", 0.001)
    metrics.refusal("limit_below_request")
    metrics.refusal("limit_below_request")

    class Status:
        def status(self):
            return {"daemons": [
                {"mode": "sm-sharing", "healthy": True, "restarts": 2, "wedges": 1, "last_probe_s": 0.04,
                 "server_pids": [300]},
                {"mode": "time-slicing", "healthy": False, "restarts": 0, "wedges": 0, "last_probe_s": None},
            ]}

    metrics.attach_mps(Status())
    s = scrape(metrics)
    assert s[("fracplugin_hook_duration_seconds_count", (("door", "nri"),))] == 2
    assert s[("fracplugin_hook_duration_seconds_bucket", (("door", "nri"), ("le", "0.005")))] == 1
    assert s[("fracplugin_hook_duration_seconds_count", (("door", "allocate"),))] == 1
    assert s[("fracplugin_refusals_total", (("reason", "limit_below_request"),))] == 2
    assert s[("fracplugin_mps_daemon_up", (("mode", "sm-sharing"),))] == 1
    assert s[("fracplugin_mps_daemon_up", (("mode", "time-slicing"),))] == 0
    assert s[("fracplugin_mps_daemon_restarts_total", (("mode", "sm-sharing"),))] == 2
    assert s[("fracplugin_mps_daemon_wedges_total", (("mode", "sm-sharing"),))] == 1
    assert s[("fracplugin_mps_probe_duration_seconds", (("mode", "sm-sharing"),))] == 0.04
    assert ("fracplugin_mps_probe_duration_seconds", (("mode", "time-slicing"),)) not in s


def test_failing_sources_never_break_a_scrape(node_file, proc):
    class BadLedger:
        def tenancies(self):
            raise OSError("disk gone")

    class BadMps:
        def status(self):
            raise RuntimeError("boom")

    m = Metrics(ledger=BadLedger(), inventory=SimulatedInventory(node_file), mps=BadMps(), proc_root=proc)
    s = scrape(m)
    assert s[("fracplugin_ledger_entries", ())] == 0


def test_own_registry_and_http_serving(setup):
    metrics, _, _ = setup
    other = Metrics()
    metrics.refusal("x")
    assert b"fracplugin_refusals_total{reason=\"x\"}" not in other.render()
    assert b"process_cpu_seconds_total" not in metrics.render()  # no default collectors
    server = metrics.serve("127.0.0.1:0")
    try:
        host, port = server.bound
        assert port > 0
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
        assert "fracplugin_container_gpu_memory_used_bytes{" in body
    finally:
        metrics.stop()
    with pytest.raises(ValueError):
        metrics.serve("nonsense")


def test_render_matches_prometheus_client_exposition(setup):
    from prometheus_client import generate_latest

    metrics, _, _ = setup
    metrics.observe_hook("nri", 0.01)
    metrics.refusal('we"ird\\reason\nx')

    def parsed(text: str) -> dict:
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out[(fam.name, fam.type, s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    ours = parsed(metrics.render().decode())
    theirs = parsed(generate_latest(metrics.registry).decode())
    # render adds the node label to every series; prometheus-client has no such option
    assert {k[:3] + (tuple(sorted((*k[3], ("node", NODE)))),): v for k, v in theirs.items()} == ours
    assert any(k[2] == "fracplugin_refusals_total" and ("reason", 'we"ird\\reason\nx') in k[3] for k in ours)


def test_build_info_and_gpu_info_use_dcgm_exporters_label_names(setup):
    import platform

    from fracplugin import __version__

    metrics, ledger, _ = setup
    s = scrape(metrics)
    assert s[("fracplugin_build_info", (("python_version", platform.python_version()), ("version", __version__)))] == 1
    info = {k[1]: v for k, v in s.items() if k[0] == "fracplugin_gpu_info"}
    assert info == {tuple(sorted({"UUID": g.uuid, "gpu": str(g.index), "modelName": g.name, "Hostname": NODE,
                                  "device": f"nvidia{g.minor}", "pci_bus_id": g.pci_bus_id}.items())): 1.0
                    for g in ledger.node.gpus}
    assert len(info) == 4 and all(dict(k)["pci_bus_id"] for k in info)


def test_node_label_is_the_node_name_given(setup, proc):
    _, ledger, inv = setup
    text = Metrics(ledger=ledger, inventory=inv, proc_root=proc, node_name="k8s-node-7").render().decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert samples and {s.labels.get("node") for s in samples} == {"k8s-node-7"}
    gpu_series = [s for s in samples if "UUID" in s.labels]
    assert gpu_series and {s.labels["Hostname"] for s in gpu_series} == {"k8s-node-7"}
    # no node known: no node label (not an empty one)
    bare = Metrics().render().decode()
    assert "node=" not in bare and "fracplugin_build_info{" in bare


def test_render_keeps_a_collectors_own_node_label():
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    from fracplugin.metrics import render_text

    class Own:
        def collect(self):
            g = GaugeMetricFamily("x_peer", "peer", labels=("node",))
            g.add_metric(["other"], 1.0)
            yield g

    reg = CollectorRegistry()
    reg.register(Own())
    assert render_text(reg, {"node": "n1"}).decode().splitlines()[-1] == 'x_peer{node="other"} 1.0'
    assert render_text(reg, {"node": 'a"b'}).decode().count('node="other"') == 1
