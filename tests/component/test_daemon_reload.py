"""SIGHUP reload, part by part (``Daemon.reload`` after editing the config file).

One daemon runs in this process on the simulated node with both doors, MPS
(the fake ``nvidia-cuda-mps-control``), metrics and health; no runtime and no
kubelet are attached (the doors keep trying in the background, which is all
a reload needs). Each test edits ``config.yaml``, calls ``Daemon.reload()`` (what
the SIGHUP handler runs on the main thread) and checks, for one part, that a
reloadable setting it reads took effect in the running part, and that a
changed setting it reads but cannot reload is reported ``needs_restart`` for
that part and keeps its old value. The config file is restored (and reloaded)
after each test. ``test_daemon.py`` sends real SIGHUPs to a subprocess.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from fracplugin import config as configmod
from fracplugin import logs
from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin._proto import nri_pb2
from fracplugin.daemon import Daemon
from fracplugin.kubelet.allocbase import Refusal
from fracplugin.rpcstatus import StatusCode
from fracplugin.kubelet.deviceplugin import ALLOCATE_UNADJUSTED, ANNOTATION_ALLOCATE
from fracplugin.nri.ttrpc import RpcError
from fracplugin.parts import PartBase
from tests.helpers import wait_until
from tests.leakguard import LONG_LIVED_ROOTS

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
FAKE_MPS = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
GPU0 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01"


class Rig:
    """A daemon built from a config file in ``root`` (``base``: its settings;
    default: all doors with the fake MPS and a pods file)."""

    def __init__(self, root: Path, base: dict[str, Any] | None = None) -> None:
        self.root = root
        self.config = root / "config.yaml"
        self.base: dict[str, Any] = base if base is not None else {
            "simulate_node": str(NODE), "state_dir": str(root / "state"), "mps_root": str(root / "mps"),
            "mps_control_binary": str(FAKE_MPS), "health_address": "127.0.0.1:0",
            "metrics_address": "127.0.0.1:0", "nri_socket": str(root / "nri.sock"),
            "device_plugin_dir": str(root / "dp"), "pod_resources_socket": str(root / "podresources.sock"),
            "pods_file": str(root / "pods.yaml"), "log_level": "info", "fail_open": False,
            "shutdown_timeout_s": 8.0,
            # in process: whether NVML loads depends on what other tests loaded into this
            # interpreter (the fake libnvidia-ml.so.1), so auto would vary; test_memory_limits
            # covers that part through a daemon of its own
            "memory_limits": "off",
        }
        self.write()
        parser = argparse.ArgumentParser()
        configmod.add_arguments(parser)
        self.args = parser.parse_args(["--config", str(self.config)])
        cfg, sources = configmod.load(self.args, env={})
        self.daemon = Daemon(cfg, sources, reload=lambda: configmod.load(self.args, env={}))

    def write(self, **changes: Any) -> None:
        self.config.write_text(yaml.safe_dump({**self.base, **changes}))

    def reload(self, **changes: Any) -> dict[str, Any]:
        self.write(**changes)
        return self.daemon.reload()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    root = Path(tempfile.mkdtemp(prefix="fprl", dir="/tmp"))  # short: unix socket paths
    root.chmod(0o755)  # the MPS root must be traversable (containers reach their pipe directories)
    r = Rig(root)
    LONG_LIVED_ROOTS.add(str(root))  # its MPS daemons may restart during any test of the module
    r.daemon.start()
    try:
        wait_until(lambda: r.daemon.checks()["mps"]["ready"], what="the MPS daemons to be ready")
        yield r
    finally:
        r.daemon.stop()
        root_logger = logging.getLogger()
        for h in list(root_logger.handlers):
            if h.get_name() == logs._HANDLER_NAME:
                root_logger.removeHandler(h)
        root_logger.setLevel(logging.WARNING)
        LONG_LIVED_ROOTS.discard(str(root))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fresh(rig: Rig) -> Iterator[Rig]:
    """The rig; its config file restored and reloaded afterwards."""
    yield rig
    res = rig.reload()
    assert "error" not in res, res


def test_every_reloadable_setting_is_reloaded_by_some_part(rig: Rig) -> None:
    reloaded = {k for p in rig.daemon.parts.values() for k in p.reloads}
    assert reloaded == set(configmod.RELOADABLE)
    for part in rig.daemon.parts.values():
        assert isinstance(part, PartBase)
        assert part.reloads <= part.reads, part.name
        assert part.reads <= set(configmod.Config.__dataclass_fields__), part.name
    assert set(rig.daemon.parts) == {"logs", "inventory", "ledger", "metrics", "mps", "pod source", "gpu health",
                                     "cdi", "nri", "device plugin", "health"}


def test_logs_reload_level(fresh: Rig) -> None:
    res = fresh.reload(log_level="debug")
    assert res["parts"]["logs"] == {"applied": ["log_level"], "needs_restart": []}
    assert logging.getLogger().level == logging.DEBUG


def _refused_container() -> tuple[Any, Any]:
    """A pod whose annotations break the contract (limit below request), as
    containerd sends it at CreateContainer."""
    pod = nri_pb2.PodSandbox(id="sb-bad", name="bad", namespace="default", uid="uid-bad", annotations={
        "nvidia.com/container.app.gpu-memory.request": "40Gi", "nvidia.com/container.app.gpu-memory.limit": "20Gi",
        "io.kubernetes.cri.sandbox-name": "bad", "io.kubernetes.cri.sandbox-namespace": "default",
        "io.kubernetes.cri.sandbox-uid": "uid-bad"})
    container = nri_pb2.Container(id="ctr-bad", pod_sandbox_id="sb-bad", name="app", env=["PATH=/bin"],
                                  annotations={"io.kubernetes.cri.container-name": "app",
                                               "io.kubernetes.cri.container-type": "container"})
    return pod, container


def test_nri_door_reloads_fail_open_and_reports_its_restart_settings(fresh: Rig) -> None:
    d = fresh.daemon
    assert d.built.nri is not None
    pod, container = _refused_container()
    with pytest.raises(RpcError):
        d.built.nri.plugin.create_container(pod, container)
    res = fresh.reload(fail_open=True, nri_plugin_idx="60")
    assert res["parts"]["nri"] == {"applied": ["fail_open"], "needs_restart": ["nri_plugin_idx"]}
    assert d.built.nri.plugin.settings.fail_open is True
    assert d.built.nri.plugin.create_container(pod, container) is None  # unadjusted: the stub answers an empty response
    assert d.built.ledger is not None and d.built.ledger.tenancies() == []
    assert d.status()["nri"]["fail_open"] is True
    assert d.cfg.nri_plugin_idx == "50" and d.built.nri.cfg.nri_plugin_idx == "50"


def _allocate_gpu0(d: Daemon) -> pb.AllocateResponse:
    assert d.built.device_plugin is not None
    ids = d.built.device_plugin.table.ids(GPU0)[:2]
    return d.built.device_plugin.allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
        devices_ids=ids)]))


def test_device_plugin_reloads_fail_open_and_reports_its_restart_settings(fresh: Rig) -> None:
    d = fresh.daemon
    dp = d.built.device_plugin
    assert dp is not None
    d.built.simulate_xid(GPU0, 79)  # a critical XID: GPU0 Unhealthy, Allocate on it refused
    wait_until(lambda: dp.health.unhealthy().get(GPU0) == ["xid 79"], what="the XID to mark GPU0 Unhealthy")
    try:
        with pytest.raises(Refusal) as refused:
            _allocate_gpu0(d)
        assert refused.value.code == StatusCode.UNAVAILABLE  # it may recover (noderules.status_of)
        refusals = dp.counters.refusals
        res = fresh.reload(fail_open=True, device_unit_mib=2048)
        assert res["parts"]["device plugin"] == {"applied": ["fail_open"], "needs_restart": ["device_unit_mib"]}
        assert dp.fail_open is True and dp.unit_mib == 1024
        resp = _allocate_gpu0(d)  # fail-open: the container runs unadjusted
        (c,) = resp.container_responses
        assert dict(c.envs) == {} and list(c.mounts) == []
        assert c.annotations[ANNOTATION_ALLOCATE] == ALLOCATE_UNADJUSTED
        assert dp.counters.refusals == refusals + 1  # still counted
        with pytest.raises(Refusal):  # a malformed request is refused either way
            dp.allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x"])]))
    finally:
        assert dp.health.clear(GPU0)


@pytest.mark.parametrize("part, key, value", [
    ("mps", "mps_protocol", "2"),
    ("inventory", "exclusive_process", True),
    ("ledger", "max_clients_per_gpu", 8),
    ("metrics", "metrics_address", "127.0.0.1:1"),
    ("health", "health_address", "127.0.0.1:1"),
    ("pod source", "pods_file", "/tmp/elsewhere.yaml"),
])
def test_part_reports_a_changed_setting_that_needs_a_restart(fresh: Rig, part: str, key: str, value: Any) -> None:
    before = getattr(fresh.daemon.cfg, key)
    res = fresh.reload(**{key: value})
    assert res["parts"][part] == {"applied": [], "needs_restart": [key]}
    assert key in res["needs_restart"]
    assert getattr(fresh.daemon.cfg, key) == before  # the running value stays
    assert set(res["applied"]) == set()


def test_reload_reports_per_part_and_keeps_running(fresh: Rig) -> None:
    res = fresh.reload(fail_open=True, reserve_mib=0)
    # reserve_mib is a planner setting: both doors read it, neither reloads it
    assert res["parts"]["nri"] == {"applied": ["fail_open"], "needs_restart": ["reserve_mib"]}
    assert res["parts"]["device plugin"] == {"applied": ["fail_open"], "needs_restart": ["reserve_mib"]}
    assert set(res["applied"]) == {"fail_open"} and res["needs_restart"] == ["reserve_mib"]
    st = fresh.daemon.status()
    assert st["fail_open"] is True and st["config"]["reserve_mib"] == 1024
    bad = fresh.reload(log_level="loud")
    assert "error" in bad and fresh.daemon.cfg.log_level == "info"


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: not-a-token}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.fixture(scope="module")
def api_rig() -> Iterator[Rig]:
    """A daemon with API access (a kubeconfig whose server refuses connections):
    the API watch, the event recorder and the node condition publisher run."""
    root = Path(tempfile.mkdtemp(prefix="fpra", dir="/tmp"))
    root.chmod(0o755)
    (root / "kubeconfig").write_text(KUBECONFIG)
    r = Rig(root, {"simulate_node": str(NODE), "state_dir": str(root / "state"), "mps_root": str(root / "mps"),
                   "no_mps": True, "health_address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0",
                   "nri_socket": str(root / "nri.sock"), "device_plugin_dir": str(root / "dp"),
                   "pod_resources_socket": str(root / "pr.sock"), "kubeconfig": str(root / "kubeconfig"),
                   "node_name": "gpu-node-1", "shutdown_timeout_s": 4.0})
    r.daemon.start()
    try:
        yield r
    finally:
        r.daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("part, key, value", [
    ("events", "kubeconfig", "/tmp/other-kubeconfig"),
    ("node condition", "node_condition_types", ["gpu-fractioning.nvidia.com/Ready"]),
    ("pod source", "node_name", "gpu-node-2"),
])
def test_api_parts_report_a_changed_setting_that_needs_a_restart(api_rig: Rig, part: str, key: str,
                                                                 value: Any) -> None:
    assert {"events", "node condition", "pod source"} <= set(api_rig.daemon.parts)
    before = getattr(api_rig.daemon.cfg, key)
    try:
        res = api_rig.reload(**{key: value})
        assert res["parts"][part] == {"applied": [], "needs_restart": [key]}
        assert getattr(api_rig.daemon.cfg, key) == before
        assert api_rig.daemon.status()[part.replace(" ", "_")] is not None
    finally:
        assert "error" not in api_rig.reload()


def test_mps_role_parts_report_their_restart_settings() -> None:
    """Role mps (the supervisor of detached daemons and its API socket)."""
    root = Path(tempfile.mkdtemp(prefix="fprm", dir="/tmp"))
    root.chmod(0o755)
    r = Rig(root, {"role": "mps", "simulate_node": str(NODE), "state_dir": str(root / "state"),
                   "mps_root": str(root / "mps"), "mps_control_binary": str(FAKE_MPS),
                   "health_address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "shutdown_timeout_s": 4.0})
    r.daemon.start()
    try:
        assert set(r.daemon.parts) == {"logs", "inventory", "metrics", "mps", "mps api", "health"}
        res = r.reload(mps_api_socket=str(root / "other.sock"), fail_open=True)
        assert res["parts"]["mps api"] == {"applied": [], "needs_restart": ["mps_api_socket"]}
        assert res["parts"]["mps"] == {"applied": [], "needs_restart": ["mps_api_socket"]}
        assert r.daemon.cfg.mps_api_socket == "" and Path(r.daemon.cfg.effective_mps_api_socket).exists()
    finally:
        r.daemon.stop()
        if r.daemon.built.mps is not None:
            r.daemon.built.mps.quit_daemons(5.0)  # role mps leaves its daemons running on stop (ADR 0009)
        shutil.rmtree(root, ignore_errors=True)
