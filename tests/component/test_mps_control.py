"""mps.control (one command = one subprocess with a timeout) against the fake
nvidia-cuda-mps-control, plus the pure helpers (protocol choice, TOML)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import psutil
import pytest

from fracplugin.mps import control as ctl
from fracplugin.mps.api import MpsError, MpsTimeout
from fracplugin.mps.control import MpsControl, choose_protocol, render_config_toml
from tests.helpers import scaled, unix_socket_listening, wait_until

FAKE = str(Path(__file__).resolve().parents[1] / "fakes" / "nvidia-cuda-mps-control")
FAST_ENV = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


@pytest.mark.parametrize("driver,override,want", [
    ("615.71.09", None, 3),
    ("620.1", None, 3),
    ("614.99", None, 2),
    ("550.54.15", None, 2),
    ("", None, 2),
    ("garbage", None, 2),
    ("615.71.09", 2, 2),
    ("550.54.15", 3, 3),
])
def test_choose_protocol(driver, override, want):
    assert choose_protocol(driver, override) == want


def test_choose_protocol_rejects_unknown_override():
    with pytest.raises(ValueError):
        choose_protocol("615.1", 4)


def test_config_toml_for_each_daemon():
    sm = tomllib.loads(render_config_toml(sm_sharing=True))
    assert sm["schema_version"] == "1.0"
    assert sm["features"]["memacct"]["enabled"] is True
    assert sm["features"]["context-share"]["enabled"] is True
    assert sm["servers"] == {"shared": {}}
    ts = tomllib.loads(render_config_toml(sm_sharing=False))
    assert ts["features"]["memacct"]["enabled"] is True
    assert ts["features"]["context-share"]["enabled"] is False
    assert ts["servers"] == {"shared": {}}  # issue 12: time-slicing tenants get namespaces of it too
    with pytest.raises(ValueError):
        render_config_toml(sm_sharing=True, servers=("Bad-Name",))


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _start(root: str, procs: list, *args: str, protocol: str = "3") -> MpsControl:
    env = dict(os.environ, **FAST_ENV, CUDA_MPS_PIPE_DIRECTORY=os.path.join(root, "p"),
               CUDA_MPS_LOG_DIRECTORY=os.path.join(root, "l"))
    env.pop("CUDA_MPS_PROTOCOL_VERSION", None)
    p = subprocess.Popen([FAKE, "-p", protocol, *args, "-f"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    procs.append(p)
    control = os.path.join(root, "p", "control")
    wait_until(lambda: unix_socket_listening(control) or p.poll() is not None, 10, f"the fake daemon listening on {control}")
    assert p.poll() is None, f"the fake daemon exited {p.returncode}"
    return MpsControl(FAKE, os.path.join(root, "p"), int(protocol), os.path.join(root, "l"), env=FAST_ENV)


def test_v3_commands_and_csv_parsing(pipe):
    root, procs = pipe
    cfg = os.path.join(root, "c.toml")
    Path(cfg).write_text(render_config_toml(sm_sharing=True))
    c = _start(root, procs, "-m", "-a", cfg)
    assert c.probe(5) >= 0
    servers = c.server_list(5)
    assert [s.name for s in servers] == ["shared"] and servers[0].status == "Ready"
    c.namespace_create("fp_x", "shared", 5)
    c.namespace_set_caps("fp_x", "shared", 25, None, 5)
    rows = c.namespace_list("shared", 5)
    assert [(r.name, r.server, r.active_thread_percentage) for r in rows] == [("fp_x", "shared", 25)]
    assert rows[0].pipe_directory == os.path.join(root, "p", "shared", "fp_x")
    sleeper = subprocess.Popen(["sleep", "30"])
    procs.append(sleeper)
    c.run(["fake-client", "add", str(sleeper.pid), "--server=shared", "--namespace=fp_x", "--cmd=python train.py"], 5)
    clients = c.client_list(5)
    assert [(r.pid, r.server, r.namespace, r.cmd) for r in clients] == [(sleeper.pid, "shared", "fp_x", "python train.py")]
    with pytest.raises(MpsError, match="clients attached"):
        c.namespace_delete("fp_x", "shared", 5)
    c.client_terminate(sleeper.pid, 10)
    assert sleeper.wait(scaled(5)) is not None
    assert c.client_list(5) == []
    c.namespace_delete("fp_x", "shared", 5)
    assert c.namespace_list("shared", 5) == []
    with pytest.raises(ValueError):
        c.namespace_create("Bad", "shared", 5)
    with pytest.raises(ValueError):
        c.namespace_set_caps("fp_x", "shared", 0, None, 5)


def test_v2_stdin_commands(pipe):
    root, procs = pipe
    c = _start(root, procs, protocol="2")
    assert c.v2("get_default_active_thread_percentage", 5).strip() == "100.0"
    c.v2("set_default_active_thread_percentage 40", 5)
    c.v2("set_default_device_pinned_mem_limit GPU-abc 2048M", 5)
    assert c.v2("get_default_device_pinned_mem_limit GPU-abc", 5).strip() == "2048M"
    assert c.v2("get_default_active_thread_percentage", 5).strip() == "40.0"
    assert c.get_server_list(5) == []
    with pytest.raises(MpsError):
        c.run(["server", "list"], 5)  # a v2 daemon does not know v3 modules
    procs[0].stdin.write(b"quit\n")
    procs[0].stdin.flush()
    assert procs[0].wait(scaled(5)) == 0
    assert not os.path.exists(os.path.join(root, "p", "control"))
    with pytest.raises(MpsError, match="Cannot find MPS control daemon"):
        c.probe(5)


def test_foreground_daemon_exits_on_stdin_eof(pipe):
    root, procs = pipe
    _start(root, procs, protocol="2")
    procs[0].stdin.close()
    assert procs[0].wait(scaled(5)) == 0
    assert not os.path.exists(os.path.join(root, "p", "control"))


def test_background_daemon_and_quit_flag(pipe):
    root, _ = pipe
    env = dict(os.environ, **FAST_ENV, CUDA_MPS_PIPE_DIRECTORY=os.path.join(root, "p"),
               CUDA_MPS_LOG_DIRECTORY=os.path.join(root, "l"))
    assert subprocess.run([FAKE, "-d"], env=env, timeout=20).returncode == 0
    assert os.path.exists(os.path.join(root, "p", "control"))  # ready when -d returns
    pid = int(Path(root, "p", "nvidia-cuda-mps-control.pid").read_text())
    assert psutil.pid_exists(pid)
    # a second daemon on the same pipe dir refuses to start
    assert subprocess.run([FAKE, "-d"], env=env, timeout=20, capture_output=True).returncode == 1
    out = subprocess.run([FAKE], input="get_default_active_thread_percentage\n", env=env, capture_output=True,
                         text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "100.0"
    assert subprocess.run([FAKE, "-q"], env=env, timeout=20).returncode == 0
    wait_until(lambda: _ended(pid), 5, f"the daemon {pid} to quit")
    assert not os.path.exists(os.path.join(root, "p", "control"))


def test_timeout_kills_the_client_and_missing_binary_is_an_error(pipe):
    root, procs = pipe
    c = _start(root, procs, protocol="3")
    Path(root, "p", "fake-control.json").write_text('{"hang": true}')
    with pytest.raises(MpsTimeout):
        c.probe(0.5)
    assert [p.pid for p in psutil.Process().children()] == [procs[0].pid]  # the client was reaped
    Path(root, "p", "fake-control.json").write_text("{}")
    assert c.probe(5) >= 0
    with pytest.raises(MpsTimeout):
        c.probe(0)
    with pytest.raises(MpsError, match="cannot run"):
        MpsControl(os.path.join(root, "nope"), os.path.join(root, "p"), 3).probe(5)


def test_set_exclusive_process_reports_per_gpu(monkeypatch):
    import pynvml

    calls = []
    modes = {"GPU-a": pynvml.NVML_COMPUTEMODE_DEFAULT, "GPU-b": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS}
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)

    def handle(uuid):
        if uuid == "GPU-c":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return uuid

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", handle)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeMode", lambda h: modes[h])
    monkeypatch.setattr(pynvml, "nvmlDeviceSetComputeMode", lambda h, m: calls.append((h, m)))
    res = ctl.set_exclusive_process(["GPU-a", "GPU-b", "GPU-c"])
    assert res["GPU-a"] == "ok" and res["GPU-b"] == "ok" and res["GPU-c"] != "ok"
    assert calls == [("GPU-a", pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)]  # only where it was not set


def test_set_exclusive_process_without_nvml(monkeypatch):
    import pynvml

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    res = ctl.set_exclusive_process(["GPU-a"])
    assert res["GPU-a"].startswith("nvml unavailable")
