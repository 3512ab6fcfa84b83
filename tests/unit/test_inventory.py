"""GPU inventory: the simulated backend and the NVML backend with pynvml patched."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from fracplugin.gpu.inventory import Inventory, InventoryError, ProcessSample
from fracplugin.gpu.simulated import SimulatedInventory, load_node


def test_simulated_node_file(node_file):
    inv = SimulatedInventory(node_file)
    assert isinstance(inv, Inventory)
    node = inv.node()
    assert node.name == "gpu-node-1" and node.driver_version == "615.71.09" and node.cuda_driver_version == 13040
    assert [g.index for g in node.gpus] == [0, 1, 2, 3]
    g = node.gpus[2]
    assert (g.memory_mib, g.minor, g.pci_bus_id, g.numa_node, g.compute_capability) == (81559, 2, "00000000:9a:00.0", 1, "9.0")


def test_simulated_injection(node_file):
    inv = SimulatedInventory(node_file)
    uuid = inv.node().gpus[1].uuid
    assert list(inv.events(0.01)) == []
    inv.inject_xid(uuid, 79)
    inv.inject_xid(uuid, 48)
    assert [e.xid for e in inv.events(0.01)] == [79, 48]
    with pytest.raises(InventoryError):
        inv.inject_xid("GPU-none", 79)
    inv.set_processes([ProcessSample(uuid, 42, 1 << 30, 12.5)])
    assert inv.processes()[0].pid == 42


@pytest.mark.parametrize("text,fragment", [
    ("gpus: nope", "must be a mapping with a 'gpus' list"),
    ("gpus: [{index: 0, uuid: a, name: n, memory_mib: '1', minor: 0}]", "expected an integer"),
    ("gpus: [{index: 0, uuid: a, name: n, memory_mib: 0, minor: 0}]", "memory_mib must be 1.."),
    ("gpus: [{index: 0, uuid: a, name: n, memory_mib: 1, minor: 0}, {index: 1, uuid: a, name: n, memory_mib: 1, minor: 1}]", "unique"),
    (": : :", "not valid YAML"),
])
def test_bad_node_files(tmp_path, text, fragment):
    p = tmp_path / "n.yaml"
    p.write_text(text)
    with pytest.raises(InventoryError) as ei:
        load_node(p)
    assert fragment in str(ei.value)


class FakeNvml:
    """Patches the pynvml functions NvmlInventory calls; raises pynvml's own error classes."""

    def __init__(self, monkeypatch, gpus=2, init_error=None, lost_at=None):
        self.handles = [SimpleNamespace(i=i) for i in range(gpus)]
        self.shutdowns = 0
        m = monkeypatch

        def init():
            if init_error is not None:
                raise pynvml.NVMLError(init_error)

        def by_index(i):
            if lost_at == i:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return self.handles[i]

        m.setattr(pynvml, "nvmlInit", init)
        m.setattr(pynvml, "nvmlShutdown", lambda: setattr(self, "shutdowns", self.shutdowns + 1))
        m.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: "615.71.09")
        m.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: 13040)
        m.setattr(pynvml, "nvmlDeviceGetCount", lambda: gpus)
        m.setattr(pynvml, "nvmlDeviceGetHandleByIndex", by_index)
        m.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda u: self.handles[int(u[-1])])
        m.setattr(pynvml, "nvmlDeviceGetIndex", lambda h: h.i)
        m.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-fake-{h.i}")
        m.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
        m.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=81559 * 2**20))
        m.setattr(pynvml, "nvmlDeviceGetMinorNumber", lambda h: h.i)
        m.setattr(pynvml, "nvmlDeviceGetPciInfo", lambda h: SimpleNamespace(busId=f"00000000:1{h.i}:00.0".encode()))
        m.setattr(pynvml, "nvmlDeviceGetCudaComputeCapability", lambda h: (9, 0))
        m.setattr(pynvml, "nvmlDeviceGetNumaNodeId", lambda h: 0)
        m.setattr(pynvml, "nvmlDeviceGetMigMode", lambda h: [0, 0])

        def procs(h):
            if h.i == 1:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return [SimpleNamespace(pid=100, usedGpuMemory=2**30), SimpleNamespace(pid=101, usedGpuMemory=None)]

        def util(h, since):
            if since:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
            return [SimpleNamespace(pid=100, smUtil=30, timeStamp=5), SimpleNamespace(pid=0, smUtil=5, timeStamp=5),
                    SimpleNamespace(pid=101, smUtil=0xFFFFFFFF, timeStamp=5)]

        m.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", procs)
        m.setattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses", lambda h: (_ for _ in ()).throw(pynvml.NVMLError_NotSupported()))
        m.setattr(pynvml, "nvmlDeviceGetProcessUtilization", util)


def test_nvml_inventory_reads_every_field(monkeypatch):
    from fracplugin.gpu.nvml import NvmlInventory
    FakeNvml(monkeypatch)
    inv = NvmlInventory()
    node = inv.node()
    assert node.driver_version == "615.71.09" and node.cuda_driver_version == 13040
    g = node.gpus[1]
    assert (g.index, g.uuid, g.memory_mib, g.minor, g.pci_bus_id, g.compute_capability, g.mig_enabled) == (
        1, "GPU-fake-1", 81559, 1, "00000000:11:00.0", "9.0", False)


def test_nvml_processes_degrade_per_gpu(monkeypatch):
    from fracplugin.gpu.nvml import NvmlInventory
    FakeNvml(monkeypatch)
    inv = NvmlInventory()
    samples = inv.processes()
    assert [(s.gpu_uuid, s.pid, s.used_memory_bytes, s.sm_util_percent) for s in samples] == [
        ("GPU-fake-0", 100, 2**30, 30.0), ("GPU-fake-0", 101, None, None)]
    assert inv.sample_failures == 1  # GPU 1 was lost: no sample, a counter, no exception
    assert [s.sm_util_percent for s in inv.processes()] == [None, None]  # no new utilisation samples


@pytest.mark.parametrize("code,fragment", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 was not found"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
])
def test_nvml_startup_errors_are_clear(monkeypatch, code, fragment):
    from fracplugin.gpu.nvml import NvmlInventory
    FakeNvml(monkeypatch, init_error=code)
    with pytest.raises(InventoryError) as ei:
        NvmlInventory()
    assert fragment in str(ei.value) and "initialising" in str(ei.value)


def test_nvml_lost_gpu_at_startup(monkeypatch):
    from fracplugin.gpu.nvml import NvmlInventory
    fake = FakeNvml(monkeypatch, lost_at=1)
    with pytest.raises(InventoryError) as ei:
        NvmlInventory()
    assert "GPU is lost" in str(ei.value) and fake.shutdowns == 1


@pytest.mark.parametrize("text,fragment", [
    ("gpus: [{index: 0, uuid: a, name: n, memory_mib: 100000000000000000000, minor: 0}]", "memory_mib must be 1.."),
    ("gpus: [{index: 5000, uuid: a, name: n, memory_mib: 1, minor: 0}]", "index and minor"),
    ("[" * 50000 + "]" * 50000, "not valid YAML"),
])
def test_absurd_node_files(tmp_path, text, fragment):
    p = tmp_path / "n.yaml"
    p.write_text(text)
    with pytest.raises(InventoryError) as ei:
        load_node(p)
    assert fragment in str(ei.value)
