"""Every fenced shell command of docs/runbooks.md runs against a running
daemon and prints what the page says to look for (issue 36 item 4).

The daemon is ``fracplugin run`` on the simulated four-GPU node as a
subprocess, laid out as the chart lays it out on a node: the fake
``nvidia-cuda-mps-control`` supervised under ``--mps-root`` (both modes), the
fake NRI runtime connected (its Synchronize reports one running container that
lacks fracplugin's env), the fake NVML with ``--memory-limits verify`` (the
inference container it then creates is not enforced), JSON logs.

The page's commands reach a node through ``kubectl``; there is no cluster
here, so ``kubectl`` on the commands' PATH is a stand-in
(tests/component/runbook_kubectl) that does only what the page's commands
need and checks their arguments against the chart: ``get pods`` with the
chart's selector labels prints the node's pod, ``exec <pod> -c fracplugin --
CMD`` runs CMD here (the fracplugin container mounts the MPS root and the
state directory at their host paths, so the same paths hold), ``logs <pod> -c
fracplugin`` prints the daemon's log. Anything else makes it fail. What runs
for real is everything after ``--`` and every filter of the log: the paths,
``jq`` paths, ``sed``/``grep`` patterns the page prints.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.component.test_daemon import FAKE_MPS, NODE, DaemonProc
from tests.component.test_memory_limits import MIB, _pod_with_cgroup
from tests.fakes import nvml as fake
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks.md"
STANDIN = Path(__file__).with_name("runbook_kubectl")
CHART = REPO / "deploy" / "helm" / "fracplugin"

# What each command must print (a regular expression searched in its standard output), as the
# page says to look for it. A command of the page that is not here fails the test: a new
# command gets its expectation here.
EXPECT = {
    'fp fracplugin status --state-dir "$STATE_DIR"':
        r"node gpu-node-1 .*ready: yes[\s\S]*GPU +UUID[\s\S]*MPS daemons \(protocol 3\), ready: yes",
    """kubectl -n "$NS" logs "$POD" -c fracplugin --since=30m | grep -E '"level":"(warning|error)"'""":
        r'"level":"warning"',
    "fp fracplugin status --state-dir \"$STATE_DIR\" | grep -A3 '^MPS daemons'":
        r"time-slicing +healthy +state ready +pid \d+ +restarts 0[\s\S]*sm-sharing +healthy +state ready",
    """kubectl -n "$NS" logs "$POD" -c fracplugin --since=30m | grep '"logger":"fracplugin.mps'""":
        r'"logger":"fracplugin\.mps\.supervisor","msg":"MPS time-slicing daemon ready',
    'fp tail -n 50 "$MPS_ROOT/log/ts/control.log"': r"Starting control daemon",
    'fp tail -n 20 "$MPS_ROOT/log/ts/daemon.out"': r"CUDA_MPS_PIPE_DIRECTORY=\S+/mps/ts",
    """fp fracplugin status --state-dir "$STATE_DIR" -o json | jq -c '.mps.daemons[] | {mode, state, restarts}'""":
        r'\{"mode":"time-slicing","state":"ready","restarts":0\}\n\{"mode":"sm-sharing","state":"ready","restarts":0\}',
    """fp grep -c 'Starting control daemon' "$MPS_ROOT/log/sm/control.log\"""": r"^1$",
    'fp tail -n 20 "$MPS_ROOT/log/ts/control.log"': r"server list",
    """fp fracplugin status --state-dir "$STATE_DIR" -o json | jq -c '.nri | {connected, synchronize_count, sessions, socket}'""":
        r'\{"connected":true,"synchronize_count":1,"sessions":1,"socket":"\S+/nri\.sock"\}',
    """kubectl -n "$NS" logs "$POD" -c fracplugin --since=30m | grep '"logger":"fracplugin.nri'""":
        r'"logger":"fracplugin\.nri[.\w]*"',
    """fp fracplugin status --state-dir "$STATE_DIR" -o json | jq -c '.gpus[] | {index, uuid, healthy, unhealthy_reasons}'""":
        r'\{"index":0,"uuid":"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a01","healthy":true,"unhealthy_reasons":\[\]\}',
    """fp fracplugin status --state-dir "$STATE_DIR" -o json | jq -c '.nri.unadjusted'""":
        r'"pod":"default/stale".*"missing":\[[^\]]*"NVIDIA_GPU_MEMORY_LIMIT"',
    """kubectl -n "$NS" logs "$POD" -c fracplugin | grep "should carry fracplugin's adjustment but does not\"""":
        r"container should carry fracplugin's adjustment but does not.*\"pod\":\"default/stale\"",
    """fp fracplugin status --state-dir "$STATE_DIR" | sed -n '/^memory limits:/,/^$/p'""":
        r"^memory limits: verify, policy warn[\s\S]*cdi_hook +NO[\s\S]*default/inference/app +GPU-\S+ +40960/61440 +0/max"
        r" +- +no \(",
    """fp fracplugin status --state-dir "$STATE_DIR" -o json | jq -c '.memory_limits.containers[] | select(.enforced != "yes") | {pod, container, reason}'""":  # noqa: E501
        r'\{"pod":"default/inference","container":"app","reason":"[^"]*verify mode: not set',
    """fp fracplugin status --state-dir "$STATE_DIR" -o json | jq -c '.over_limit | {mode, polls, episodes, over}'""":
        r'\{"mode":"report","polls":\d+,"episodes":0,"over":\[\]\}',
}


def fenced_blocks(text: str) -> list[str]:
    """The bodies of the page's ```sh blocks, in order."""
    return re.findall(r"^```sh\n(.*?)^```$", text, re.M | re.S)


def commands(block: str) -> list[str]:
    """One block's commands: its lines joined at a trailing backslash, a
    trailing ``# comment`` (two spaces or more before it) dropped."""
    out = []
    for line in re.sub(r"\\\n\s*", "", block).splitlines():
        line = re.sub(r"\s{2,}# .*$", "", line).rstrip()
        if line:
            out.append(line)
    return out


def chart_selector() -> str:
    """The node daemon pods' selector, from the chart (name from Chart.yaml,
    component as templates/daemonset.yaml names the one-process layout's)."""
    name = yaml.safe_load((CHART / "Chart.yaml").read_text())["name"]
    ds = (CHART / "templates" / "daemonset.yaml").read_text()
    m = re.search(r'\$component := ternary "mps" "([\w-]+)" \$mps', ds)
    assert m, "templates/daemonset.yaml no longer names its component as this test reads it"
    return f"app.kubernetes.io/name={name},app.kubernetes.io/component={m.group(1)}"


@pytest.fixture
def node() -> Iterator[tuple[DaemonProc, Path]]:
    """The running daemon and its root (a private /tmp directory)."""
    from nri_runtime import FakeNriRuntime, make_container, make_pod

    root = Path(__import__("tempfile").mkdtemp(prefix="fpr", dir="/tmp"))
    root.chmod(0o755)
    cg = root / "cgroup"
    cg.mkdir()
    spec = yaml.safe_load(NODE.read_text())
    (cg / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc dmem\n")
    (cg / "dmem.capacity").write_text("".join(
        f"nvidia/{g['pci_bus_id'][4:].lower()}/vidmem {g['memory_mib'] * MIB}\n" for g in spec["gpus"]))
    # running before the daemon connected: sm-sharing on GPU 0, without fracplugin's env
    stale = make_pod("stale", "default", "5c1d7e2a-0b3f-4a6e-9d81-7f2c4b9e0a13", {
        "nvidia.com/container.app.gpu-memory.request": "4Gi", "nvidia.com/container.app.gpu-memory.limit": "8Gi",
        "nvidia.com/container.app.gpu-compute.mode": "sm-sharing", "nvidia.com/container.app.gpus.devices": "0"})
    from fracplugin._proto import nri_pb2
    stale_ctr = make_container(stale, "app", container_id="b2" * 32, env=["PATH=/usr/bin"],
                               state=nri_pb2.CONTAINER_RUNNING)
    rt = FakeNriRuntime(root / "nri.sock", initial_sync=([stale], [stale_ctr]))
    d = DaemonProc(root, ["--mps-control-binary", str(FAKE_MPS), "--no-device-plugin",
                          "--nri-socket", str(root / "nri.sock"), "--cgroup-root", str(cg),
                          "--memory-limits", "verify", "--memory-limits-policy", "warn"],
                   fake.env(fake.build_fake_nvml(), fake.node_file(root / "nvml-node", spec), root / "limits"))
    try:
        d.start()
        rt.wait_registered(15)
        wait_until(d.ready, 30, lambda: f"ready: {d.get('/readyz')}\n{d.logs()[-3000:]}")
        pod, c, _leaf = _pod_with_cgroup(cg)
        assert not hasattr(rt.create_container(pod, c), "code")
        assert rt.start_container(pod, c) is None
        yield d, root
    finally:
        d.kill()
        rt.close()
        shutil.rmtree(root, ignore_errors=True)


def test_the_page_has_commands_and_each_has_an_expectation() -> None:
    blocks = fenced_blocks(RUNBOOKS.read_text())
    assert blocks and blocks[0].startswith("NS="), "the page starts with the block that sets its variables"
    cmds = [c for b in blocks[1:] for c in commands(b)]
    assert sorted(set(cmds) - set(EXPECT)) == [], "commands of docs/runbooks.md with no expectation here"
    assert sorted(set(EXPECT) - set(cmds)) == [], "expectations of commands docs/runbooks.md no longer has"


def test_prose_kubectl_names_what_the_chart_and_daemon_name() -> None:
    """The commands the page leaves in prose (they need a cluster: events,
    describe) name Event reasons the daemon posts and workloads the chart makes."""
    text = RUNBOOKS.read_text()
    src = "\n".join(p.read_text() for p in (REPO / "src" / "fracplugin").rglob("*.py"))
    reasons = set(re.findall(r"--field-selector\s+reason=(\w+)", text))
    assert reasons and all(f'"{r}"' in src for r in reasons), reasons
    templates = "\n".join(p.read_text() for p in (CHART / "templates").glob("*.yaml"))
    for kind, name in re.findall(r"`(ds|daemonset)/fracplugin-(\w+)`", text):
        assert f'printf "%s-{name}"' in templates, f"the chart makes no DaemonSet fracplugin-{name}"


def test_the_pages_defaults_are_the_charts() -> None:
    """The variables' defaults are the chart's: the namespace README installs
    into (README's or docs/' helm install), hostPaths.mpsRoot and .stateDir; and the container mounts
    hostPaths.run (which holds both) at its host path, so ``fp cat $MPS_ROOT/...``
    reads the node's files."""
    setup = fenced_blocks(RUNBOOKS.read_text())[0]
    defaults = dict(re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", setup, re.M))
    paths = yaml.safe_load((CHART / "values.yaml").read_text())["hostPaths"]
    assert defaults["MPS_ROOT"] == paths["mpsRoot"] and defaults["STATE_DIR"] == paths["stateDir"], defaults
    assert paths["mpsRoot"].startswith(paths["run"] + "/") and paths["stateDir"].startswith(paths["run"] + "/")
    install = [p for p in [REPO / "README.md", *(REPO / "docs").rglob("*.md")] if p != RUNBOOKS]
    assert any(f"helm install fracplugin deploy/helm/fracplugin -n {defaults['NS']}" in p.read_text()
               for p in install), "no install command (README, docs/) uses the page's namespace"
    ds = (CHART / "templates" / "daemonset.yaml").read_text()
    assert re.search(r"- name: run\n\s+mountPath: \{\{ \$\.Values\.hostPaths\.run \}\}", ds)


def test_every_command_runs_on_the_daemon_and_prints_what_the_page_says(node: tuple[DaemonProc, Path]) -> None:
    d, root = node
    blocks = fenced_blocks(RUNBOOKS.read_text())
    setup = blocks[0]
    bindir = root / "bin"
    bindir.mkdir()
    (bindir / "kubectl").symlink_to(STANDIN)
    (bindir / "fracplugin").symlink_to(Path(sys.executable).with_name("fracplugin"))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "MPS_ROOT": str(root / "mps"),
           "STATE_DIR": str(d.state), "RUNBOOK_LOG": str(d.log_path), "RUNBOOK_SELECTOR": chart_selector(),
           "RUNBOOK_NODE": "gpu-node-1"}
    for var in ("NS", "NODE", "POD"):
        env.pop(var, None)
    # the usage poll has run (the over_limit section counts polls)
    wait_until(lambda: d.get("/status")[1]["over_limit"]["polls"] > 0, 15, "a usage poll")
    failures: list[str] = []
    for cmd in [c for b in blocks[1:] for c in commands(b)]:
        r = subprocess.run(["bash", "-o", "pipefail", "-c", f"{setup}\n{cmd}"], capture_output=True, text=True,
                           env=env, timeout=60)
        if r.returncode != 0 or not re.search(EXPECT[cmd], r.stdout, re.M):
            failures.append(f"{cmd}\n  exit {r.returncode}; want /{EXPECT[cmd]}/\n  stdout: {r.stdout[-1500:]}\n"
                            f"  stderr: {r.stderr[-1500:]}")
    assert failures == [], "\n\n".join(failures)


def test_the_standin_refuses_what_the_chart_does_not_make(tmp_path: Path) -> None:
    """The stand-in is not a yes-machine: another namespace, selector,
    container or verb fails."""
    env: dict[str, Any] = {**os.environ, "RUNBOOK_LOG": str(tmp_path / "log"),
                           "RUNBOOK_SELECTOR": chart_selector(), "RUNBOOK_NODE": "n1"}
    (tmp_path / "log").write_text("x\n")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(STANDIN), *args], capture_output=True, text=True, env=env, timeout=30)

    ok = run("-n", "fracplugin-system", "get", "pods", "-l", chart_selector(), "--field-selector",
             "spec.nodeName=n1", "-o", "name")
    assert ok.returncode == 0 and ok.stdout.startswith("pod/fracplugin-"), ok
    pod = ok.stdout.strip()
    assert run("-n", "default", "get", "pods", "-l", chart_selector(), "--field-selector", "spec.nodeName=n1",
               "-o", "name").returncode != 0
    assert run("-n", "fracplugin-system", "get", "pods", "-l", "app=fracplugin", "--field-selector",
               "spec.nodeName=n1", "-o", "name").returncode != 0
    assert run("-n", "fracplugin-system", "exec", pod, "-c", "mps", "--", "true").returncode != 0
    assert run("-n", "fracplugin-system", "exec", "pod/other", "-c", "fracplugin", "--", "true").returncode != 0
    assert run("-n", "fracplugin-system", "exec", pod, "-c", "fracplugin", "--", "true").returncode == 0
    assert run("-n", "fracplugin-system", "logs", pod, "-c", "fracplugin").stdout == "x\n"
    assert run("-n", "fracplugin-system", "delete", pod).returncode != 0
