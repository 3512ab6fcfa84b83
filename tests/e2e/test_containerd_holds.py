"""End to end: a hold ends only with its own container, through a real containerd 2.x + runc + crictl
(issue 34 "Done when": small failing inputs 2 and 3 through the real containerd e2e; ADR 0033, README
"What each door decides").

- Input 3 (a restart listed beside its old container): the KAI shape (``gpu-memory.request: 50Gi``,
  ``gpus.devices: "0"``); the pod's container ``app`` is created and never started (``old``, attempt 0),
  then created again and started (``new``, attempt 1: a pod may hold several containers of one name with
  different attempts, as after kubelet restarts one); fracplugin (or containerd) restarts, so containerd
  Synchronizes the plugin with both, ``old`` CREATED and ``new`` RUNNING; ``old`` is removed; then a
  40Gi pod on GPU 0 is refused, and ``new`` holds 51200 MiB on GPU 0 at every step.
- Input 2 in the shape this runtime can produce (the NRI door, KAI annotations): sandbox A of pod ``web``
  runs a container holding 60Gi of GPU 0; sandbox B (same name and namespace, a new UID: the pod deleted
  and created again) asks for the same GPU at 60Gi and is refused (no fit) while A's container runs; once
  it stops, B's container is admitted; GPU 0 never holds more than 61440 MiB. The device plugin half of
  input 2 (an Allocate of the IDs a running container holds) needs kubelet's Allocate, which containerd and
  crictl do not make: it is covered by tests/component (the device plugin door) and tests/kubelet_e2e.

Each test starts its own daemon (``start_daemon``: registered with containerd and ready) so it may restart
it; every wait is on a condition. Requirements and fixtures as test_containerd.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

import harness as h
from test_containerd import (  # noqa: F401 - fixtures are used by name
    EXPECTED_UUIDS, Pods, _connected_since, _log_offset, _wait_ledger_empty, bins, ctrd, pods, start_daemon)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ANN = "nvidia.com/container.app."
GPU0 = EXPECTED_UUIDS[0]
OLDER_HOLDS_NOTHING = "nri sync: an older container of the same pod and name holds nothing; the newer one holds"


def _kai(request: str, devices: str = "0") -> dict[str, str]:
    """The KAI shape: the binder's request and device annotations for container ``app``."""
    return {ANN + "gpu-memory.request": request, ANN + "gpus.devices": devices}


def _holds(d) -> list[tuple[str, str, int]]:
    """(container id, GPU UUID, request MiB) of every tenancy the daemon's /status lists, sorted."""
    return sorted((t["container_id"], t["gpu_uuid"], t["request_mib"]) for t in d.tenancies())


def _gpu0_mib(d) -> int:
    """MiB the ledger holds on GPU 0 (sum of its tenancies' charges: the request, or a union hold's
    ``held_mib`` when larger)."""
    return sum(max(t["request_mib"], t.get("held_mib", 0)) for t in d.tenancies() if t["gpu_uuid"] == GPU0)


def _state(ctrd: h.Containerd, cid: str) -> str:
    return json.loads(ctrd.crictl("inspect", cid).stdout)["status"]["state"]


def _log_lines(d, offset: int = 0) -> list[dict]:
    """The daemon's JSON log lines from byte ``offset`` (lines that are not JSON skipped)."""
    with open(d.log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _restart_runtime(ctrd: h.Containerd, d) -> None:
    """Restart containerd; return once ``d`` is connected and synchronized again."""
    offset = _log_offset(ctrd)
    ctrd.restart()
    try:
        h.wait_for(lambda: _connected_since(ctrd, offset, lambda n: n == d.plugin_name), 60,
                   f"{d.plugin_name} to reconnect after containerd's restart")
    except h.HarnessError as e:
        pytest.fail(f"{e}\n--- fracplugin log:\n{d.tail()}", pytrace=False)


@pytest.mark.parametrize("restart", ["fracplugin, state kept", "fracplugin, state lost", "containerd"])
def test_input3_a_running_restart_keeps_its_hold_through_synchronize_and_the_old_ones_remove(
        ctrd, pods, request, restart):
    """Issue 34 input 3 with the real runtime. ``restart``: what restarts between the two containers and the
    old one's removal: the daemon with its state directory (its journal) kept, the daemon with it gone (the
    ledger rebuilt from Synchronize alone), or containerd (which reconnects the plugin and synchronizes it
    again). In each, containerd's Synchronize lists ``old`` (CREATED) and ``new`` (RUNNING)."""
    d = start_daemon(ctrd, request)
    pid, cfg = pods.run("restarted", _kai("50Gi"))
    old = pods.create(pid, cfg, attempt=0).stdout.strip()  # created, never started
    new = pods.create_and_start(pid, cfg, attempt=1)
    want = [(new, GPU0, 51200)]
    assert _holds(d) == want
    assert _state(ctrd, old) == "CONTAINER_CREATED"

    if restart == "containerd":
        log_offset = d.log.stat().st_size
        _restart_runtime(ctrd, d)
    else:
        d.stop()
        if restart == "fracplugin, state lost":
            shutil.rmtree(d.state_dir)
        log_offset = d.log.stat().st_size  # every daemon of the module appends to one log file
        d = start_daemon(ctrd, request)
    assert (_state(ctrd, old), _state(ctrd, new)) == ("CONTAINER_CREATED", "CONTAINER_RUNNING")
    assert _holds(d) == want

    ctrd.crictl("rm", old)
    h.wait_for(lambda: old not in ctrd.crictl("ps", "-a", "-q").stdout.split(), 30, f"container {old} removed")
    assert _holds(d) == want  # the old container's Remove releases nothing of the new one's hold

    pid2, cfg2 = pods.run("forty", _kai("40Gi"))
    res = pods.create(pid2, cfg2, check=False)
    assert res.returncode != 0, f"a 40Gi pod was admitted beside the running 50Gi on GPU 0: {res.stdout}"
    assert "FailedPrecondition" in res.stderr and "GPU 0" in res.stderr and "40960 MiB" in res.stderr, res.stderr
    print(f"40Gi pod refused: {res.stderr.strip().splitlines()[-1]}")
    assert _holds(d) == want
    assert d.alive(), d.tail()
    # containerd's Synchronize listed both (so this was the case of input 3): the daemon logged which held
    told = [ln for ln in _log_lines(d, log_offset) if ln.get("msg") == OLDER_HOLDS_NOTHING]
    assert [(ln.get("container_id"), ln.get("holder_id")) for ln in told] == [(old, new)], told

    pods.remove_all()
    _wait_ledger_empty(d)


def test_input2_a_recreated_pod_waits_for_the_running_containers_gpu(ctrd, pods, request):
    """Issue 34 input 2 where containerd can produce it (the NRI door, KAI shape): pod ``web`` deleted and
    created again with a new UID while its old sandbox's container still runs on GPU 0 with 60Gi; the new
    sandbox's container asking 60Gi of GPU 0 is refused (no fit, naming GPU 0) as long as the old one runs,
    and admitted once it has stopped (kubelet retries a failed create; here the test does). GPU 0 never
    holds more than 61440 MiB."""
    d = start_daemon(ctrd, request)
    pid_a, cfg_a = pods.run("web", _kai("60Gi"), uid="uid-web-old")
    ctr_old = pods.create_and_start(pid_a, cfg_a)
    assert _holds(d) == [(ctr_old, GPU0, 61440)]

    # the pod object is replaced: same name and namespace, a new UID, a new sandbox (its own directory)
    cfg_b = h.pod_config(ctrd.base, "web-again", "uid-web-new", _kai("60Gi"))
    doc = json.loads(cfg_b.read_text())
    doc["metadata"]["name"] = "web"
    cfg_b.write_text(json.dumps(doc, indent=1))
    pid_b = ctrd.crictl("runp", str(cfg_b), timeout=120).stdout.strip()
    pods.ids.append(pid_b)
    for _ in range(2):  # refused, and refused again on kubelet's retry while the old container runs
        res = pods.create(pid_b, cfg_b, check=False)
        assert res.returncode != 0, f"admitted beside the running {ctr_old}: {res.stdout}"
        assert "FailedPrecondition" in res.stderr and "GPU 0" in res.stderr and "61440 MiB" in res.stderr, \
            res.stderr
        print(f"the new pod refused: {res.stderr.strip().splitlines()[-1]}")
        assert _holds(d) == [(ctr_old, GPU0, 61440)]
        assert _state(ctrd, ctr_old) == "CONTAINER_RUNNING"

    ctrd.crictl("stop", ctr_old, timeout=120)  # the old pod's container ends (kubelet kills it)
    h.wait_for(lambda: _state(ctrd, ctr_old) == "CONTAINER_EXITED", 30, f"container {ctr_old} exited")
    h.wait_for(lambda: _gpu0_mib(d) == 0, 30, "the stopped container's hold to end")
    ctr_new = pods.create_and_start(pid_b, cfg_b)
    assert _holds(d) == [(ctr_new, GPU0, 61440)]
    assert _gpu0_mib(d) <= 61440
    assert d.alive(), d.tail()

    pods.remove_all()
    _wait_ledger_empty(d)
