"""Issue 25 "done when": ``fracplugin explain`` and the NRI door give the
same answer for every pod (hypothesis over the annotation contract, its
typos and its bad values), on the same node, in the default configuration
(both doors) and the KAI one (``--no-device-plugin``), and in the KAI one
with ``sidecar`` a native sidecar (an init container with restartPolicy
Always, issue 34 item 3).

Each example is one pod with containers ``app`` and ``sidecar`` (spec
order), written to the pods file (the API server) before containerd creates
its containers in spec order through the NRI socket; explain plans the same
pod file against the same empty node. Per container the answer is: refused
(and the key named), untouched, or fenced with the same GPUs, request and
limit. The lint warnings (keys not read, forms ignored) are the same words
at both. Every container is stopped afterwards, so each pod starts on an
empty node (stopped NRI-door holds hold nothing).

``EXAMPLES`` pods per configuration (3 x 60 = 180 pods in all).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_daemon import root  # noqa: F401 (fixture)
from test_one_allocation import P, UUIDS, Node, ctr, node, pod  # noqa: F401 (node: fixture)

from fracplugin.explain import explain
from fracplugin.planner import PlannerConfig

REPO = Path(__file__).resolve().parents[2]
NODE_FILE = str(REPO / "examples" / "nodes" / "gpu-node-1.yaml")
EXAMPLES = 60
CONTAINERS = ("app", "sidecar")

_MEM = ["8Gi", "20Gi", "70Gi", "1", "0.5", "", "abc", " 4Gi"]
_PER_CONTAINER = {
    ".gpu-memory.request": _MEM,
    ".gpu-memory.limit": _MEM,
    ".gpu-compute.mode": ["time-slicing", "sm-sharing", "bogus"],
    ".gpu-compute.portion": ["0.5", "1.5"],
    ".gpus.devices": [UUIDS[0], "1", "0,1", "GPU-nope"],
    ".gpu-memory.requests": ["20Gi"],  # a typo
}
_POD_LEVEL = {
    "gpu-fraction": ["0.5", "0.25", "1", "x"],
    "gpu-fraction.limit": ["0.75", "0.2"],
    "gpu-memory": ["8192", "0"],
    "gpu-fraction-num-devices": ["1", "2", "5"],
    "gpu-fraction-container-name": ["app", "sidecar", "worker"],
    "kai.scheduler/gpu-compute-sharing-mode": ["sm-sharing", "time-slicing"],
    "gpu-fractoin": ["0.5"],  # a typo
}


@st.composite
def annotations(draw: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for c in draw(st.lists(st.sampled_from(("app", "sidecar", "worker")), max_size=2, unique=True)):
        for suffix in draw(st.lists(st.sampled_from(sorted(_PER_CONTAINER)), min_size=1, max_size=3, unique=True)):
            out[f"{P}{c}{suffix}"] = draw(st.sampled_from(_PER_CONTAINER[suffix]))
    for k in draw(st.lists(st.sampled_from(sorted(_POD_LEVEL)), max_size=3, unique=True)):
        out[k] = draw(st.sampled_from(_POD_LEVEL[k]))
    return out


def explained(p: dict[str, Any]) -> tuple[dict[str, tuple[Any, ...]], set[str]]:
    rep = explain(p, NODE_FILE, config=PlannerConfig())
    out: dict[str, tuple[Any, ...]] = {}
    for c in rep["containers"]:
        if c["error"]:
            out[c["name"]] = ("refused", c["error"]["key"])
        elif not c["fractional"]:
            out[c["name"]] = ("untouched",)
        else:
            out[c["name"]] = ("fenced", ",".join(c["devices"]), c["request_mib"], c["limit_mib"])
    return out, {w for w in rep["warnings"] if "did you mean" in w or "is ignored for" in w}


def at_the_nri_door(n: Node, p: dict[str, Any],
                    order: tuple[str, ...] = CONTAINERS) -> tuple[dict[str, tuple[Any, ...]], set[str]]:
    out: dict[str, tuple[Any, ...]] = {}
    for c in order:
        adj, env = n.create(p, c)
        if getattr(adj, "code", None) is not None and not hasattr(adj, "env"):
            out[c] = ("refused", adj.message)
        elif not adj.env:
            out[c] = ("untouched",)
        else:
            out[c] = ("fenced", env["NVIDIA_VISIBLE_DEVICES"], int(env["NVIDIA_GPU_MEMORY_REQUEST"]),
                      int(env["NVIDIA_GPU_MEMORY_LIMIT"]))
    for c in CONTAINERS:
        n.stop(p, c)
    who = f"default/{p['metadata']['name']}"
    said = {str(w.get("reason")) for w in n.warnings() if w.get("pod") == who}
    return out, {w for w in said if "did you mean" in w or "is ignored for" in w}


def same(ex: tuple[Any, ...], nri: tuple[Any, ...]) -> bool:
    if ex[0] == "refused":
        return nri[0] == "refused" and ex[1] in nri[1]
    return ex == nri


@pytest.mark.parametrize("extra, native_sidecar", [((), False), (("--no-device-plugin",), False),
                                                   (("--no-device-plugin",), True)],
                         ids=["both-doors", "kai", "kai-native-sidecar"])
def test_explain_and_the_nri_door_agree_on_every_pod(node: Callable[..., Node], extra: tuple[str, ...],
                                                     native_sidecar: bool) -> None:
    """``native_sidecar``: ``sidecar`` is an init container with restartPolicy
    Always (issue 34 item 3), created first, as kubelet starts it."""
    n = node(*extra)
    order = ("sidecar", "app") if native_sidecar else CONTAINERS
    counter = itertools.count()
    ran: list[int] = []
    kinds: set[str] = set()
    warned: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(ann=annotations())
    def check(ann: dict[str, str]) -> None:
        name = f"fz{next(counter)}"
        if native_sidecar:
            p = pod(name, containers=[ctr("app")], init=[{**ctr("sidecar"), "restartPolicy": "Always"}],
                    annotations=ann)
        else:
            p = pod(name, containers=[ctr(c) for c in CONTAINERS], annotations=ann)
        n.put(p)
        ex, ex_warn = explained(p)
        assert [c for c in ex] == list(order)  # explain lists both, in the order they start
        nri, nri_warn = at_the_nri_door(n, p, order)
        ran.append(1)
        kinds.update(x[0] for x in nri.values())
        warned.extend(nri_warn)
        for c in CONTAINERS:
            assert same(ex[c], nri[c]), f"{c} of {ann}: explain {ex[c]} vs NRI {nri[c]}"
        assert ex_warn == nri_warn, f"{ann}: explain warns {ex_warn}, the NRI door {nri_warn}"
        assert n.tenants() == [], n.tenants()

    check()
    assert len(ran) >= EXAMPLES  # hypothesis may replay a failing example; every pod ran through both
    assert kinds == {"refused", "untouched", "fenced"}, kinds  # the pods exercised every answer
    assert any("did you mean" in w for w in warned) and any("is ignored for" in w for w in warned)
    print(f"{len(ran)} pods, answers {sorted(kinds)}, {len(warned)} lint warnings")
