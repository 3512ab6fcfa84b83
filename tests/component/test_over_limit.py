"""A container above its GPU memory limit is noticed (issue 35 item 3, small
failing input 3; ADR 0035), through the daemon's real sockets.

``fracplugin run`` as a subprocess on the fake ``libnvidia-ml.so.1``
(tests/fakes/nvml: the real NvmlInventory reads its processes), with
``--memory-limits off``, ``--proc-root`` a test tree whose ``<pid>/cgroup``
puts the fake's process in the container's cgroup, the fake NRI runtime
creating the container, and a fake API server recording what the daemon
POSTs (Events, pod evictions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.component.test_memory_limits import NODE, Daemon, _samples, root  # noqa: F401 (fixture)
from tests.fakes import nvml as fake
from tests.helpers import wait_until
from tests.peers.posts_api import Api

GIB = 1 << 30
GPU0 = "GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01"
UID = "3d6b1f0e-9c2a-4e7b-8a15-6f0c2d9e4b71"
CID = "a1" * 32
PID = 4242
PREFIX = "nvidia.com/container.app."
OVER = "GpuMemoryLimitExceeded"


@pytest.fixture
def node(root: Path) -> Iterator[Any]:  # noqa: F811
    """``start(over_limit)``: the daemon, its fake API and runtime, with the
    container ``app`` (limit 8Gi on GPU 0) created and started, and the fake
    NVML's process 4242 (10 GiB on GPU 0) in its cgroup."""
    from nri_runtime import FakeNriRuntime, make_container, make_pod

    daemons: list[Daemon] = []
    peers: list[Any] = []

    def start(over_limit: str) -> tuple[Daemon, Api, Path]:
        api = Api(root)
        proc = root / "proc" / str(PID)
        proc.mkdir(parents=True)
        cgroup = proc / "cgroup"
        cgroup.write_text(f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n")
        nf = fake.node_file(root / "nvml-node", yaml.safe_load(NODE.read_text()), procs=[(0, PID, 10 * GIB)])
        rt = FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
        d = Daemon(root, ["--memory-limits", "off", "--over-limit", over_limit, "--usage-poll-interval", "0.2",
                          "--proc-root", str(root / "proc"), "--kubeconfig", str(api.kubeconfig),
                          "--node-condition-types", ""],
                   fake.env(fake.build_fake_nvml(), nf, root / "limits"), simulate=False)
        daemons.append(d)
        peers.extend([rt, api])
        rt.wait_registered(15)
        pod = make_pod("trainer", "default", UID, {f"{PREFIX}gpu-memory.request": "4Gi",
                                                   f"{PREFIX}gpu-memory.limit": "8Gi", f"{PREFIX}gpus.devices": "0"})
        c = make_container(pod, "app", container_id=CID)
        assert not hasattr(rt.create_container(pod, c), "code")
        assert rt.start_container(pod, c) is None
        return d, api, cgroup

    yield start
    for d in daemons:
        d.stop()
    for p in peers:
        p.close()


def _over(d: Daemon) -> dict[str, Any]:
    return d.get("/status")[1]["over_limit"]


def test_a_container_above_its_limit_gets_one_event_per_episode(node: Any) -> None:
    """Input 3 under the default ``--over-limit report``: one Warning Event
    GpuMemoryLimitExceeded naming the GPU, used and limit; no second one
    while the episode lasts; /metrics says over; a new episode after the
    usage goes back under gets a new Event; nothing is evicted."""
    d, api, cgroup = node("report")
    wait_until(lambda: api.events(OVER), 15, lambda: f"a GpuMemoryLimitExceeded Event; posted {api.posted}\n{d.logs()[-3000:]}")
    [ev] = api.events(OVER)
    assert ev["type"] == "Warning" and ev["action"] == "Report"
    assert ev["involvedObject"]["uid"] == UID and ev["involvedObject"]["fieldPath"] == "spec.containers{app}"
    assert f"GPU {GPU0}: used 10240 MiB" in ev["message"] and "limit 8192 MiB" in ev["message"], ev["message"]
    polls = _over(d)["polls"]
    wait_until(lambda: _over(d)["polls"] >= polls + 3, 15, lambda: f"three more polls: {_over(d)}")
    assert len(api.events(OVER)) == 1 and _over(d)["episodes"] == 1, api.events(OVER)
    code, text = d.get("/metrics", "metrics")
    lab = {"pod": "trainer", "container": "app", "UUID": GPU0}

    def value(name: str) -> float:
        return next(v for lbl, v in _samples(text, name) if lab.items() <= lbl.items())
    assert (value("fracplugin_container_gpu_memory_used_bytes"), value("fracplugin_container_gpu_memory_limit_bytes"),
            value("fracplugin_container_gpu_memory_over_limit")) == (10 * GIB, 8 * GIB, 1.0), text
    assert [v for _, v in _samples(text, "fracplugin_gpu_memory_over_limit_episodes_total")] == [1.0]
    cgroup.unlink()  # the process leaves the container: usage 0, the episode ends
    wait_until(lambda: _over(d)["over"] == [], 15, lambda: f"episode over: {_over(d)}")
    cgroup.write_text(f"0::/kubepods/burstable/pod{UID}/{CID}\n")  # back (cgroupfs driver path)
    wait_until(lambda: len(api.events(OVER)) == 2, 15, lambda: f"a second Event; {api.events(OVER)}")
    assert _over(d)["episodes"] == 2 and api.evictions() == [] and _over(d)["restarts"] is None


def test_restart_evicts_the_pod_of_a_container_above_its_limit(node: Any) -> None:
    """Input 3 under ``--over-limit restart``: the Event says it restarts the
    container, and the restart request reaches the API server: an Eviction
    of exactly that pod, with its UID as precondition."""
    d, api, _ = node("restart")
    wait_until(api.evictions, 15, lambda: f"a pod eviction; posted {api.posted}\n{d.logs()[-3000:]}")
    [(path, body)] = api.evictions()
    assert path == "/api/v1/namespaces/default/pods/trainer/eviction", path
    assert body["metadata"] == {"name": "trainer", "namespace": "default"}
    assert body["deleteOptions"]["preconditions"] == {"uid": UID}, body
    wait_until(lambda: api.events(OVER), 15, lambda: f"the Event; posted {api.posted}")
    [ev] = api.events(OVER)
    assert ev["action"] == "Restart" and "restarting it (evicting pod default/trainer)" in ev["message"], ev
    wait_until(lambda: _over(d)["restarts"]["evicted"] == 1, 15, lambda: f"counted: {_over(d)}")
