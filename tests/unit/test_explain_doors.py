"""``fracplugin explain`` answers for every door (issue 36 items 1 and 2,
small failing inputs 1-6): the extended resource as the device plugin door's
GetPreferredAllocation + Allocate + the NRI door's CreateContainer give it, a
DRA claim with ``--claim``, every pod of a ``List``, a closed pipe, the
warnings of a prefix typo, a pod-level form on the first of several
containers and a missing CDI spec directory. A real subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from fracplugin.gpu.simulated import load_node
from fracplugin.kubelet.allocator import Allocator
from fracplugin.kubelet.devices import DeviceTable
from fracplugin.kubelet.podlookup import InMemoryPodSource
from fracplugin.ledger import Ledger
from fracplugin.noderules import NodeRules
from fracplugin.planner import PlannerConfig


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def pod(name: str, annotations: dict[str, str] | None = None, units: int | None = None,
        containers: tuple[str, ...] = ("app",)) -> dict:
    res = {"resources": {"limits": {"fracplugin.io/gpu-memory": units}}} if units else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"containers": [{"name": c, **res} for c in containers]}}


def test_input1_readme_default_scheduler_pod_gets_what_allocate_and_create_container_give(examples, node_file):
    path = examples / "pods/default-scheduler.yaml"
    r = run(str(path), "--node", str(node_file), "-o", "json")
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)["containers"]
    assert (c["request_mib"], c["limit_mib"], c["compute_mode"], c["error"]) == (8192, 12288, "time-slicing", None)
    # what the device plugin door itself answers on the same empty node, for the same pod
    node = load_node(str(node_file))
    rules = NodeRules(node, Ledger(node), PlannerConfig())
    table = DeviceTable.build(node, 1024)
    manifest = yaml.safe_load(path.read_text())
    door = Allocator(rules, table, "fracplugin.io/gpu-memory", InMemoryPodSource(None, [manifest]), 0.0)
    ids = door.preferred.devices([d for g in node.gpus for d in table.ids(g.uuid)], [], 8)
    answer = door.allocate([ids])
    assert c["kubelet_devices"] == ids == [f"{node.gpus[0].uuid}::{n}" for n in range(8)]
    assert c["devices"] == list(answer.uuids) == [node.gpus[0].uuid]
    assert c["env"]["FRACPLUGIN_RESERVATION"] == answer.key
    assert c["env"]["NVIDIA_GPU_MEMORY_REQUEST"] == "8192" and c["env"]["NVIDIA_GPU_MEMORY_LIMIT"] == "12288"
    assert c["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{node.gpus[0].uuid}=12288M"
    assert {k: v for k, v in answer.env.items() if k != "FRACPLUGIN_RESERVATION_PROOF"}.items() <= c["env"].items()
    assert "FRACPLUGIN_RESERVATION_PROOF" not in c["env"]  # the NRI door takes it out at CreateContainer
    table_out = run(str(path), "--node", str(node_file)).stdout
    assert "container app: time-slicing, 8192 MiB request / 12288 MiB limit per GPU" in table_out, table_out


def test_input2_extended_resource_only(tmp_path, node_file):
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod("only", units=4)))
    r = run(str(f), "--node", str(node_file), "-o", "json")
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)["containers"]
    assert (c["fractional"], c["request_mib"], c["limit_mib"]) == (True, 4096, 4096)
    # --device-unit-mib: the unit the daemon advertises
    (c,) = json.loads(run(str(f), "--node", str(node_file), "-o", "json", "--device-unit-mib", "512").stdout)["containers"]
    assert (c["request_mib"], c["limit_mib"]) == (2048, 2048)


def test_extended_resource_containers_are_placed_against_each_other_and_refused_past_the_node(tmp_path, node_file):
    f = tmp_path / "pod.yaml"
    # two containers of 60 units: GetPreferredAllocation packs the first on GPU 0, the second does not fit there
    f.write_text(yaml.safe_dump(pod("two", units=60, containers=("a", "b"))))
    r = run(str(f), "--node", str(node_file), "-o", "json")
    a, b = json.loads(r.stdout)["containers"]
    assert r.returncode == 0, r.stdout
    assert len(set(a["devices"] + b["devices"])) == 2 and a["error"] is None and b["error"] is None
    f.write_text(yaml.safe_dump(pod("huge", units=100000)))
    r = run(str(f), "--node", str(node_file), "-o", "json")
    (c,) = json.loads(r.stdout)["containers"]
    assert r.returncode == 1 and c["error"]["key"] == "resources.limits[fracplugin.io/gpu-memory]", r.stdout


def test_claim_flag_explains_prepare(tmp_path, node_file):
    from tests.unit.test_dra import HEAD, claim_doc

    f = tmp_path / "claim.yaml"
    f.write_text(yaml.safe_dump(claim_doc("team-a", "infer", "uid-7", memory="20Gi", parameters=dict(HEAD))))
    r = run("--claim", str(f), "--node", str(node_file), "-o", "json")
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)["containers"]
    assert c["request_mib"] == 20480 and c["env"]["FRACPLUGIN_DRA_CLAIM"] == "uid-7"


def test_input3_prefix_typo_warns_with_the_key_meant(tmp_path, node_file):
    f = tmp_path / "pod.yaml"
    warning = ('warning: annotation nvidia.com/containers.app.gpu-memory.request="8Gi" is not a key fracplugin reads '
               "(did you mean nvidia.com/container.app.gpu-memory.request?); it has no effect")
    for units in (None, 8):  # the NRI door's planning, and the device plugin door's
        f.write_text(yaml.safe_dump(pod("typo", {"nvidia.com/containers.app.gpu-memory.request": "8Gi"}, units)))
        r = run(str(f), "--node", str(node_file))
        assert r.returncode == 0 and r.stderr == "", r.stderr  # said once, in the report, not in a door's log line
        assert r.stdout.count(warning) == 1, r.stdout


def test_pod_level_form_on_the_first_of_several_containers_says_which(tmp_path, node_file):
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod("side", {"gpu-fraction": "0.5"}, containers=("sidecar", "app"))))
    r = run(str(f), "--node", str(node_file))
    assert ('annotation gpu-fraction="0.5" applies to container sidecar, the first of the pod\'s 2 containers '
            "(sidecar, app); gpu-fraction-container-name names another") in r.stdout, r.stdout


def test_input4_a_list_of_three_pods_gets_three_answers_and_the_worst_exit_status(node_file):
    items = [pod("a", {"nvidia.com/container.app.gpu-memory.request": "8Gi"}),
             pod("b", {"nvidia.com/container.app.gpu-memory.request": "900Gi"}),  # no GPU has 900Gi: refused
             pod("c", units=4)]
    text = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items})
    r = run("-", "--node", str(node_file), "-o", "json", stdin=text)
    reports = json.loads(r.stdout)
    assert [x["pod"] for x in reports] == ["default/a", "default/b", "default/c"]
    assert [x["containers"][0]["error"] is None for x in reports] == [True, False, True]
    assert r.returncode == 1
    r = run("-", "--node", str(node_file), stdin=yaml.safe_dump({"kind": "List", "items": [items[0], items[2]]}))
    assert r.returncode == 0 and r.stdout.count("\npod default/") == 1 and r.stdout.startswith("pod default/a")


def test_input5_a_closed_pipe_ends_quietly(examples, node_file):
    items = [pod(f"p{i}", {"nvidia.com/container.app.gpu-memory.request": "1Gi"}) for i in range(400)]
    for args, stdin in (([str(examples / "pods/inference-sm-sharing-4gpu.bound.yaml")], None),
                        (["-"], yaml.safe_dump({"kind": "List", "items": items}))):
        p = subprocess.Popen(f"{sys.executable} -m fracplugin.cli explain {' '.join(args)} --node {node_file} "
                             "| head -n 1; exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(stdin, timeout=120)
        assert p.returncode == 0 and err == "" and out.startswith("pod default/"), (p.returncode, err)


def test_input6_missing_cdi_spec_dir_is_one_warning(tmp_path: Path, node_file):
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod("x", units=1)))
    r = run(str(f), "--node", str(node_file), "--cdi-spec-dirs", "/nonexistent")
    assert r.stdout.count("/nonexistent") == 1, r.stdout
    assert "warning: CDI spec directory /nonexistent: does not exist; no spec is read from it" in r.stdout


def test_every_door_in_explain_applies_the_same_node_rules(tmp_path, examples, node_file):
    """Review of 2026-12-07: explain's device plugin door placed units on a cordoned GPU (the daemon lists
    them Unhealthy, kubelet never allocates them), gave no ``holds``, and no door of explain applied the
    memory-limit gate (an r550 node under the default policy refuse planned a pod the daemon refuses)."""
    node = yaml.safe_load(node_file.read_text())
    cordoned = tmp_path / "cordoned.yaml"
    cordoned.write_text(yaml.safe_dump({**node, "annotations": {"fracplugin.io/cordoned-gpus": "0"}}))
    gpu0 = node["gpus"][0]["uuid"]
    ext = examples / "pods/default-scheduler.yaml"
    r = run(str(ext), "--node", str(cordoned), "-o", "json")
    assert r.returncode == 0, r.stdout
    (c,) = json.loads(r.stdout)["containers"]
    assert c["devices"] and gpu0 not in c["devices"] and not any(d.startswith(gpu0) for d in c["kubelet_devices"])
    assert c["holds"] == {u: "cgroup" for u in c["devices"]}
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({**node, "driver_version": "550.54.15"}))
    nri = examples / "pods/notebook-time-slicing-2gpu.yaml"
    for path in (ext, nri):  # every door: the same refusal, naming the driver
        r = run(str(path), "--node", str(old), "-o", "json")
        (c,) = json.loads(r.stdout)["containers"]
        assert r.returncode == 1 and "driver 550.54.15 is older than r615" in c["error"]["reason"], (path, c)
        r = run(str(path), "--node", str(old), "-o", "json", "--memory-limits-policy", "warn")
        (c,) = json.loads(r.stdout)["containers"]
        assert r.returncode == 0 and c["error"] is None, (path, c)
        assert "NVIDIA_GPU_MEMORY_REQUEST" not in c["env"] and set(c["holds"].values()) == {"per-process"}
