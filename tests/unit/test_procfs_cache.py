"""CachedProcFs: PID -> container answers cached while the PID's start time
(/proc/<pid>/stat field 22, proc(5)) holds (issue 14, metrics scrape)."""

from __future__ import annotations

import os

from fracplugin.procfs import CachedProcFs, ProcFs

UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
CID_A = "a1" * 32
CID_B = "b2" * 32


def _cgroup(cid: str) -> str:
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
            f"cri-containerd-{cid}.scope\n")


def _stat(pid: int, start: int, comm: str = "python3") -> str:
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 12 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def _write(root, pid, cid, start=None, comm="python3"):
    d = root / str(pid)
    d.mkdir(exist_ok=True)
    (d / "cgroup").write_text(_cgroup(cid))
    if start is not None:
        (d / "stat").write_text(_stat(pid, start, comm))


def test_start_time_is_field_22_even_with_odd_comm(tmp_path):
    _write(tmp_path, 7, CID_A, start=123456, comm="a) b (c")
    assert CachedProcFs(str(tmp_path)).start_time(7) == 123456
    assert CachedProcFs(str(tmp_path)).start_time(8) is None


def test_real_proc_start_time_matches_ps():
    """Our own process, against the kernel's /proc: field 22 is what the
    stat file says after the comm, and is stable across reads."""
    fs = CachedProcFs()
    st = fs.start_time(os.getpid())
    with open(f"/proc/{os.getpid()}/stat") as f:
        assert st == int(f.read().rpartition(")")[2].split()[19])
    assert fs.start_time(os.getpid()) == st


def test_cached_while_start_time_holds_and_reread_when_pid_is_reused(tmp_path):
    _write(tmp_path, 100, CID_A, start=1000)
    fs = CachedProcFs(str(tmp_path))
    assert fs.container_of(100).container_id == CID_A
    # same process (same start time): the cgroup file is not read again
    (tmp_path / "100" / "cgroup").write_text(_cgroup(CID_B))
    assert fs.container_of(100).container_id == CID_A
    assert ProcFs(str(tmp_path)).container_of(100).container_id == CID_B  # what an uncached read sees
    # the PID reused by a new process (new start time): read again
    (tmp_path / "100" / "stat").write_text(_stat(100, 2000))
    assert fs.container_of(100).container_id == CID_B
    assert sorted(fs._cache) == [100]


def test_without_stat_lookups_are_uncached_and_prune_forgets(tmp_path):
    _write(tmp_path, 5, CID_A)  # no stat file: cannot tell a reused PID
    _write(tmp_path, 6, CID_A, start=10)
    fs = CachedProcFs(str(tmp_path))
    assert fs.container_of(5).container_id == CID_A and fs.container_of(6).container_id == CID_A
    (tmp_path / "5" / "cgroup").write_text(_cgroup(CID_B))
    assert fs.container_of(5).container_id == CID_B
    assert sorted(fs._cache) == [6]
    fs.prune([5])
    assert sorted(fs._cache) == []


def test_host_process_exe_is_cached(tmp_path):
    d = tmp_path / "300"
    d.mkdir()
    (d / "cgroup").write_text("0::/system.slice/fracplugin.service\n")
    (d / "stat").write_text(_stat(300, 77, "nvidia-cuda-mps"))
    os.symlink("/usr/bin/nvidia-cuda-mps-server", d / "exe")
    fs = CachedProcFs(str(tmp_path))
    assert fs.container_of(300) is None and fs.exe_basename(300) == "nvidia-cuda-mps-server"
    os.unlink(d / "exe")
    assert fs.exe_basename(300) == "nvidia-cuda-mps-server"  # same process: cached
    (d / "stat").write_text(_stat(300, 78, "nvidia-cuda-mps"))
    assert fs.exe_basename(300) is None  # a new process under that PID: read again (no exe now)


def test_scrape_follows_a_reused_pid_to_its_new_container(tmp_path):
    """Through Metrics.render: usage of PID 100 goes to container A; the PID
    is reused by a process of container B (new start time): the next scrape
    gives B the usage, A none."""
    from prometheus_client.parser import text_string_to_metric_families

    from fracplugin.gpu.inventory import ProcessSample
    from fracplugin.ledger import Ledger
    from fracplugin.metrics import MIB, Metrics
    from fracplugin.model import ComputeMode, GpuInfo, NodeInfo, Tenancy

    gpu = GpuInfo(index=0, uuid="GPU-00000000-0000-0000-0000-000000000000", name="H100", memory_mib=81559, minor=0)
    node = NodeInfo(name="n", driver_version="615.71.09", cuda_driver_version=13040, gpus=(gpu,))
    ledger = Ledger(node)
    ledger.replace_all([Tenancy(pod_uid=UID, namespace="ml", pod_name="p", container=name, gpu_uuid=gpu.uuid,
                                request_mib=1024, limit_mib=2048, mode=ComputeMode.TIME_SLICING, container_id=cid)
                        for name, cid in (("a", CID_A), ("b", CID_B))])
    _write(tmp_path, 100, CID_A, start=1000)

    class Inv:
        def node(self):
            return node

        def processes(self):
            return [ProcessSample(gpu.uuid, 100, 700 * MIB, 10.0)]

    metrics = Metrics(ledger=ledger, inventory=Inv(), node=node, proc_root=str(tmp_path))

    def used():
        fams = text_string_to_metric_families(metrics.render().decode())
        fam = next(f for f in fams if f.name == "fracplugin_container_gpu_memory_used_bytes")
        return {s.labels["container"]: s.value for s in fam.samples}

    assert used() == {"a": 700 * MIB, "b": 0.0}
    assert used() == {"a": 700 * MIB, "b": 0.0}  # from the cache
    _write(tmp_path, 100, CID_B, start=5000)
    assert used() == {"a": 0.0, "b": 700 * MIB}
