"""The GPU-free parts of ``make gpu-check`` (tests/gpu/): report building and
step order, the skip logic, env construction from a plan, the judgements of
each figure, the carried-wheel bootstrap, and the client's allocation loop with
an injected allocator. The parts that need a GPU run only on a GPU machine
(docs/gpu-check.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fracplugin.procfs import parse_cgroup
from tests.gpu import cuda_client, gpu_check as gc

MIB = 1 << 20


# ---- the client's allocation loop ------------------------------------------------------------
class FakeAllocator:
    """Fails once ``limit_bytes`` would be passed, as an MPS pinned limit does
    (context overhead ``overhead_bytes`` counted against it)."""

    def __init__(self, limit_bytes: int, overhead_bytes: int = 0) -> None:
        self.limit, self.used, self.calls = limit_bytes, overhead_bytes, 0

    def __call__(self, n: int) -> tuple[object | None, str]:
        self.calls += 1
        if self.used + n > self.limit:
            return None, "CUDA_ERROR_OUT_OF_MEMORY"
        self.used += n
        return self.calls, ""


def test_allocation_loop_stops_at_the_first_failure():
    alloc = FakeAllocator(2048 * MIB, overhead_bytes=300 * MIB)
    r = cuda_client.allocate_until_failure(alloc, 256 * MIB, 4096 * MIB)
    assert (r.allocated_mib, r.steps, r.stopped_by, r.error) == (1536, 6, "error", "CUDA_ERROR_OUT_OF_MEMORY")
    assert r.handles == [1, 2, 3, 4, 5, 6] and alloc.calls == 7


def test_allocation_loop_exact_fit_then_failure():
    r = cuda_client.allocate_until_failure(FakeAllocator(2048 * MIB), 256 * MIB, 4096 * MIB)
    assert (r.allocated_mib, r.steps, r.stopped_by) == (2048, 8, "error")


def test_allocation_loop_stops_at_the_cap_when_nothing_fails():
    alloc = FakeAllocator(10**15)
    r = cuda_client.allocate_until_failure(alloc, 256 * MIB, 1000 * MIB)
    assert (r.allocated_mib, r.steps, r.stopped_by, r.error) == (768, 3, "cap", "")
    assert alloc.calls == 3  # never asks past the cap


@pytest.mark.parametrize("step,cap", [(0, 10), (-1, 10), (1, -1)])
def test_allocation_loop_bad_arguments(step, cap):
    with pytest.raises(ValueError):
        cuda_client.allocate_until_failure(FakeAllocator(10), step, cap)


def test_client_without_libcuda_reports_one_json_line_and_exits_1(tmp_path):
    p = subprocess.run([sys.executable, str(gc.CLIENT), "--cap-mib", "512", "--lib", str(tmp_path / "nope.so")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    rep = json.loads(lines[0])
    assert rep["ok"] is False and "cannot load" in rep["error"] and rep["pid"] > 0


def test_client_that_cannot_join_its_cgroup_says_so(tmp_path):
    p = subprocess.run([sys.executable, str(gc.CLIENT), "--cap-mib", "512", "--lib", str(tmp_path / "nope.so"),
                        "--cgroup", str(tmp_path / "no-such-cgroup")], capture_output=True, text=True, timeout=60)
    rep = json.loads(p.stdout)
    assert rep["cgroup"] == "" and rep["cgroup_error"].startswith(f"{tmp_path / 'no-such-cgroup'}: ")


# ---- env from the plan ------------------------------------------------------------------------
PLAN_TS = {
    "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa",
    "NVIDIA_GPU_MEMORY_REQUEST": "2048",
    "NVIDIA_GPU_MEMORY_LIMIT": "2048",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "GPU-aaaa=2048M",
    "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
}


def test_client_env_maps_the_pipe_directory_to_the_mount_source():
    base = {"PATH": "/usr/bin", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "3", "PYTHONPATH": "/x",
            "CUDA_MPS_PIPE_DIRECTORY": "/stale", "NVIDIA_VISIBLE_DEVICES": "all"}
    env, notes = gc.client_env(PLAN_TS, [("/run/fp/mps/ts", "/tmp/nvidia-mps")], base, gpu_count=1)
    assert env == {"PATH": "/usr/bin", "HOME": "/root", **PLAN_TS, "CUDA_MPS_PIPE_DIRECTORY": "/run/fp/mps/ts"}
    assert any("/run/fp/mps/ts" in n for n in notes)


def test_client_env_hides_other_gpus_only_when_the_node_has_more():
    env, _ = gc.client_env(PLAN_TS, [("/h", "/tmp/nvidia-mps")], {}, gpu_count=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"
    env, _ = gc.client_env(PLAN_TS, [("/h", "/tmp/nvidia-mps")], {}, gpu_count=1)
    assert "CUDA_VISIBLE_DEVICES" not in env
    plan = {**PLAN_TS, "CUDA_VISIBLE_DEVICES": "0"}  # a plan that sets it (issue 12) is taken as is
    env, _ = gc.client_env(plan, [("/h", "/tmp/nvidia-mps")], {}, gpu_count=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_client_env_refuses_a_pipe_directory_without_a_mount():
    with pytest.raises(ValueError, match="CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps is not under any mount"):
        gc.client_env(PLAN_TS, [("/h", "/elsewhere")], {}, gpu_count=1)


def test_host_path_deepest_mount_wins_and_prefixes_are_whole_components():
    mounts = [("/a", "/tmp"), ("/b", "/tmp/nvidia-mps"), ("/c", "/tmp/nvidia")]
    assert gc.host_path("/tmp/nvidia-mps", mounts) == "/b"
    assert gc.host_path("/tmp/nvidia-mps/x", mounts) == "/b/x"
    assert gc.host_path("/tmp/other", mounts) == "/a/other"
    assert gc.host_path("/var", mounts) is None


# ---- judgements ---------------------------------------------------------------------------------
@pytest.mark.parametrize("allocated,stopped,ok,why", [
    (1792, "error", True, ""),
    (2048, "error", True, ""),
    (1280, "error", True, ""),
    (1024, "error", False, "far below the limit"),      # limit - 1024: too little
    (2304, "error", False, "above the 2048 MiB limit"),
    (4096, "cap", False, "the limit is not enforced"),  # never failed: MPS ignored the limit
])
def test_judge_pinned(allocated, stopped, ok, why):
    got_ok, expected, reason = gc.judge_pinned(allocated, 2048, stopped)
    assert got_ok is ok and why in reason
    assert expected == "allocation fails; 1024 < allocated MiB <= 2048"


@pytest.mark.parametrize("sm_ctx,sm_total,atp,status", [
    (33, 132, 25, "pass"),      # floor(132 * 0.25)
    (40, 132, 25, "pass"),      # one 8-SM chunk of slack
    (42, 132, 25, "fail"),
    (132, 132, 25, "fail"),     # ATP not applied
    (0, 132, 25, "fail"),
    (132, 132, None, "pass"),   # time-slicing: everything
    (66, 132, None, "fail"),
    (None, 132, 25, "skipped"),  # no cuCtxGetExecAffinity
])
def test_judge_atp(sm_ctx, sm_total, atp, status):
    assert gc.judge_atp(sm_ctx, sm_total, atp)[0] == status


@pytest.mark.parametrize("seen,assigned,gpus,cvd,status", [
    (1, 1, 1, False, "pass"), (8, 1, 8, False, "skipped"), (8, 1, 8, True, "fail"), (2, 1, 1, False, "fail"),
    (0, 1, 1, False, "fail")])
def test_judge_devices(seen, assigned, gpus, cvd, status):
    assert gc.judge_devices(seen, assigned, gpus, cvd)[0] == status


def test_mps_namespaces_are_skipped_before_r615_never_passed():
    assert "MPS v3 (driver r615+)" in gc.mps_namespace_skip(2)
    assert gc.mps_namespace_skip(3) == ""


METRICS = """# HELP fracplugin_container_gpu_memory_used_bytes NVML used memory
# TYPE fracplugin_container_gpu_memory_used_bytes gauge
fracplugin_container_gpu_memory_used_bytes{container="app",gpu_index="0",gpu_uuid="GPU-a",namespace="ns",pod="p",pod_uid="u1"} 2.2e+09
fracplugin_container_gpu_memory_used_bytes{container="app",gpu_index="1",gpu_uuid="GPU-b",namespace="ns",pod="p",pod_uid="u1"} 1.0e+08
fracplugin_container_gpu_memory_used_bytes{container="other",gpu_index="0",gpu_uuid="GPU-a",namespace="ns",pod="p",pod_uid="u1"} 5.0e+09
fracplugin_container_gpu_memory_limit_bytes{container="app",gpu_index="0",gpu_uuid="GPU-a",namespace="ns",pod="p",pod_uid="u1"} 9.0e+09
"""


def test_used_bytes_sums_one_containers_series():
    assert gc.used_bytes(METRICS, "u1", "app") == 2_300_000_000
    assert gc.used_bytes(METRICS, "u2", "app") is None


@pytest.mark.parametrize("used,allocated,status", [
    (2048 * MIB + 500 * MIB, 2048, "pass"), (2048 * MIB, 2048, "pass"), (1024 * MIB, 2048, "fail"),
    (4096 * MIB, 2048, "fail"), (None, 2048, "fail")])
def test_judge_metric(used, allocated, status):
    assert gc.judge_metric(used, allocated)[0] == status


def test_pod_manifest_uses_the_annotation_contract():
    m = gc.pod_manifest("gpucheck-sm", "sm-sharing", 4096, "GPU-x", "0.25")
    ann = m["metadata"]["annotations"]
    assert ann == {"nvidia.com/container.app.gpu-memory.limit": "4096Mi",
                   "nvidia.com/container.app.gpu-compute.mode": "sm-sharing",
                   "nvidia.com/container.app.gpus.devices": "GPU-x",
                   "nvidia.com/container.app.gpu-compute.portion": "0.25"}
    assert m["spec"]["containers"][0]["name"] == "app"


# ---- the report -----------------------------------------------------------------------------------
def test_report_orders_steps_and_never_counts_a_skip_as_a_pass(tmp_path, capsys):
    r = gc.Report()
    r.add(5, "metric", "x", 1, "pass")
    r.skip(3, "namespace", "leaf", "MPS protocol 2")
    r.check(1, "GPUs", ">= 1", 1, True)
    r.check(6, "leftovers", "none", [123], False, "MPS processes left running")
    doc = r.to_dict()
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    st = {s["step"]: s["status"] for s in doc["steps"]}
    assert st == {1: "pass", 2: "skipped", 3: "skipped", 4: "skipped", 5: "pass", 6: "fail", 7: "skipped",
                  8: "skipped", 9: "skipped"}
    assert doc["result"] == "fail" and r.exit_code() == 1
    assert doc["steps"][2]["figures"] == [{"name": "namespace", "expected": "leaf", "observed": None,
                                           "status": "skipped", "reason": "MPS protocol 2"}]
    out = tmp_path / "gpu-check.json"
    r.write(out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc, default=str))
    assert not (tmp_path / "gpu-check.json.tmp").exists()
    assert "[FAIL] step 6 leftovers" in capsys.readouterr().out


def test_report_with_only_passes_and_skips_exits_0():
    r = gc.Report()
    r.add(1, "a", "x", 1, "pass")
    r.skip(3, "b", "y", "not on this driver")
    assert r.exit_code() == 0 and r.to_dict()["result"] == "pass"


@pytest.mark.parametrize("step,status", [(0, "pass"), (10, "pass"), (1, "ok"), (1, "passed")])
def test_report_refuses_unknown_steps_and_statuses(step, status):
    with pytest.raises(ValueError):
        gc.Report().add(step, "x", "y", 1, status)


# ---- bootstrap ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,fits", [
    ("tenacity-9.2.1-py3-none-any.whl", True),
    ("kubernetes-37.0.2-py2.py3-none-any.whl", True),
    ("grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
    ("grpcio-1.85.3-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", False),
    ("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", True),
    ("psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.whl", True),
    ("grpcio-1.85.3-cp312-cp312-manylinux2014_aarch64.whl", False),
    ("grpcio-1.85.3-cp312-cp312-win_amd64.whl", False),
    ("notawheel.zip", False),
])
def test_wheel_fits_python_312_on_x86_64(name, fits):
    assert gc.wheel_fits(name, (3, 12), "x86_64") is fits


def _wheel(path: Path, module: str, body: str) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", body)


def test_unpack_wheels_makes_carried_packages_importable(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels / "fpgcdemo-1.0-py3-none-any.whl", "fpgcdemo", "VALUE = 1\n")
    _wheel(wheels / "fpgcfar-1.0-cp39-cp39-manylinux2014_x86_64.whl", "fpgcfar", "VALUE = 2\n")
    site = tmp_path / "site"
    used = gc.unpack_wheels(wheels, site)
    assert used == ["fpgcdemo-1.0-py3-none-any.whl"]  # the cp39 binary does not fit this interpreter
    p = subprocess.run([sys.executable, "-c", "import fpgcdemo; print(fpgcdemo.VALUE)"], capture_output=True,
                       text=True, env={"PYTHONPATH": str(site)}, timeout=60)
    assert p.stdout.strip() == "1"
    assert gc.unpack_wheels(tmp_path / "none", site) == []


def test_no_gpu_one_line_exit_2(tmp_path):
    p = subprocess.run([sys.executable, str(gc.HERE / "gpu_check.py"), "--nvml-lib", str(tmp_path / "libnvidia-ml.so.1"),
                        "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stdout.count("\n") == 1 and p.stderr == ""
    assert p.stdout.startswith("gpu-check: no NVIDIA GPU on this machine (")
    assert not (tmp_path / "r.json").exists()


def test_detect_gpu_names_the_library():
    ok, why = gc.detect_gpu("/nonexistent/libnvidia-ml.so.1")
    assert not ok and "/nonexistent/libnvidia-ml.so.1 cannot be loaded" in why


def test_find_mps_binary(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert gc.find_mps_binary(str(exe)) == str(exe)
    assert gc.find_mps_binary(str(tmp_path / "missing")) is None
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gc.find_mps_binary() == str(exe)


# ---- cgroups named as containerd names them ----------------------------------------------------------
def test_client_cgroup_is_seen_by_the_daemon_as_the_container(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    cg = gc.Cgroups(str(tmp_path))
    cid = "ab" * 32
    leaf = cg.for_container(cid)
    assert leaf and Path(leaf).is_dir()
    rel = "/" + str(Path(leaf).relative_to(tmp_path))
    ref = parse_cgroup(f"0::{rel}\n")  # what /proc/<pid>/cgroup shows for a process in that leaf
    assert ref is not None and ref.container_id == cid and ref.runtime == "containerd"
    cg.cleanup()
    assert not any(tmp_path.glob("fracplugin-gpu-check-*"))


def test_cgroups_unusable_says_why(tmp_path):
    ro = tmp_path / "missing" / "deeper"
    cg = gc.Cgroups(str(ro))
    assert cg.base is None and cg.for_container("ab" * 32) == "" and "No such file" in cg.reason


def test_own_leftovers_finds_a_process_naming_the_work_directory(tmp_path):
    work = tmp_path / "fpgcwork"
    p = subprocess.Popen(["sleep", "60"], env={"CUDA_MPS_PIPE_DIRECTORY": str(work / "mps" / "ts")})
    try:
        from tests.helpers import wait_for

        wait_for(lambda: any(x.startswith(f"{p.pid}: sleep 60") for x in gc.own_leftovers(work)), 10, "the sleeper")
    finally:
        p.kill()
        p.wait()
    assert not any(x.startswith(f"{p.pid}:") for x in gc.own_leftovers(work))


@pytest.mark.parametrize("attr,pid,clients,ok,why", [
    (1, 42, [7, 42], True, ""),
    (None, 42, [42], True, ""),                 # driver without the attribute: the client list decides
    (0, 42, [42], False, "not shared via MPS"),
    (1, 42, [7], False, "PID 42 is not among"),
    (1, 42, None, False, "could not be read"),
])
def test_judge_through_mps(attr, pid, clients, ok, why):
    got, reason = gc.judge_through_mps(attr, pid, clients)
    assert got is ok and why in reason


def test_compute_modes_through_pynvml(monkeypatch):
    import pynvml

    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h}".encode() if h else "GPU-0")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeMode", lambda h: 3 if h else 0)
    assert gc.compute_modes() == {"GPU-0": 0, "GPU-1": 3}
    assert calls == ["init", "shutdown"]

    def lost(h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeMode", lost)
    assert gc.compute_modes() is None and calls[-1] == "shutdown"


# ---- step 8: CUDA memory limits (issue 23 item 7) ----------------------------------------------------
def test_memory_limits_skip_names_what_is_missing(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory dmem\n")
    assert gc.memory_limits_skip("615.71.09", str(v2), False, True) == ""
    assert "r615" in gc.memory_limits_skip("580.159.03", str(v2), False, True)
    assert "cgroup v2" in gc.memory_limits_skip("615.71.09", str(tmp_path), False, True)
    assert "MIG" in gc.memory_limits_skip("615.71.09", str(v2), True, True)
    assert "nvmlDeviceGetMemoryLimits_v1" in gc.memory_limits_skip("615.71.09", str(v2), False, False)
    assert "cannot be read" in gc.memory_limits_skip("", str(v2), False, True)


def test_judge_limits_reads_bytes_against_the_plan():
    assert gc.judge_limits((1024 * MIB, 2048 * MIB), 1024, 2048)[0]
    ok, _, why = gc.judge_limits((0, gc.NVML_DEVICE_MEMORY_LIMIT_MAX), 1024, 2048)
    assert not ok and why == "no limit set on the cgroup"
    ok, _, why = gc.judge_limits((1024, 2048), 1024, 2048)  # MiB where bytes are due
    assert not ok and "soft 1024 B" in why
    assert gc.judge_limits(None, 1024, 2048)[:1] == (False,)


def test_judge_total_and_capped():
    assert gc.judge_total(2048.0, 2048, "x")[0] and gc.judge_total(2047, 2048, "x")[0]
    ok, _, why = gc.judge_total(81559, 2048, "nvidia-smi memory.total")
    assert not ok and "81559" in why
    assert not gc.judge_total(None, 2048, "x")[0]
    assert gc.judge_capped([1024, 768], ["error", "error"], 2048)[0]
    ok, _, why = gc.judge_capped([2048, 2048], ["error", "error"], 2048)  # per process, not per container
    assert not ok and "4096" in why
    ok, _, why = gc.judge_capped([3072], ["cap"], 2048)
    assert not ok and "own cap" in why


def test_pod_manifest_with_a_request():
    m = gc.pod_manifest("x", "time-slicing", 2048, "GPU-x", request_mib=1024)
    ann = m["metadata"]["annotations"]
    assert ann["nvidia.com/container.app.gpu-memory.request"] == "1024Mi"
    assert ann["nvidia.com/container.app.gpu-memory.limit"] == "2048Mi"


# ---- step 9 (issue 35 item 6): the pure parts ---------------------------------------------------
def test_read_reservation_nvml_and_dmem_min(tmp_path):
    (tmp_path / "dmem.min").write_text("nvidia/0000:3b:00.0/vidmem 1073741824\nnvidia/0000:5e:00.0/vidmem 0\n")
    got = gc.read_reservation(lambda c: 4096, str(tmp_path), "nvidia/0000:3b:00.0/vidmem")
    assert got == {"cgroup": str(tmp_path), "dmem_min": "1073741824", "nvml_soft": 4096}

    def refused(c):
        raise RuntimeError("Not Supported")
    got = gc.read_reservation(refused, str(tmp_path / "none"), "nvidia/0000:3b:00.0/vidmem")
    assert got == {"cgroup": str(tmp_path / "none"), "dmem_min": None, "nvml_soft": None,
                   "nvml_error": "RuntimeError: Not Supported"}


def test_leftover_per_parent():
    before = [{"cgroup": "/a", "nvml_soft": 0}, {"cgroup": "/a/p", "nvml_soft": None}]
    after = [{"cgroup": "/a", "nvml_soft": 64 << 20}, {"cgroup": "/a/p", "nvml_soft": 64 << 20}]
    assert gc.leftover(before, after) == {"/a": 64 << 20, "/a/p": None}


def test_find_over_limit_reads_metrics_and_log():
    metrics = ('# HELP fracplugin_container_gpu_over_limit x\n'
               'fracplugin_container_gpu_over_limit{pod="gpucheck-overlimit",container="app"} 1.0\n'
               'fracplugin_container_gpu_memory_used_bytes{pod="gpucheck-overlimit"} 2.0\n'
               'fracplugin_container_gpu_memory_over_limit{pod="gpucheck-overlimit",container="side"} 0.0\n'
               'fracplugin_container_gpu_over_limit{pod="other"} 1.0\n')
    log = ('{"msg": "container above its GPU memory limit", "pod": "x/gpucheck-overlimit"}\n'
           '{"msg": "GpuMemoryLimitExceeded", "pod": "x/other"}\n{"msg": "other", "pod": "x/gpucheck-overlimit"}\n')
    assert gc.find_over_limit(metrics, log, "gpucheck-overlimit") == {
        "metric_series": ['fracplugin_container_gpu_over_limit{pod="gpucheck-overlimit",container="app"} 1.0'],
        "log_lines": ['{"msg": "container above its GPU memory limit", "pod": "x/gpucheck-overlimit"}']}
    assert gc.find_over_limit("", "", "p") == {"metric_series": [], "log_lines": []}
