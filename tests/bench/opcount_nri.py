#!/usr/bin/env python3
"""Python bytecodes per CreateContainer + RemoveContainer through the NRI
stub's serving path, per module and function: a figure a busy machine does
not move (issue 33; wall and CPU times swing 2x with the load of the
2-core development machine, the count does not). Not a ``bench_*`` script:
``make bench`` does not run it, nothing is merged into build/bench.json.

How it counts: in one process, fracplugin's handler on a simulated
gpu-node-1 (ledger on tmpfs) behind the stub's own ``_Server`` and
``NriTransport`` (a socketpair: the answers are written and drained); the
64 bench pods of ``bench_nri`` (time-slicing, 1Gi/2Gi, pod i on GPU i % 4),
``--calls`` CreateContainers of a new container of one of them (as
``bench_nri``'s measured level: the pod's earlier container is replaced),
then their RemoveContainers, each request fed to ``NriTransport._feed`` as
the bytes the runtime sends. ``sys.settrace`` with opcode events counts
every bytecode executed per code object (C code such as protobuf's upb is
not counted: it is one call). The requests are encoded before counting.

Usage: python tests/bench/opcount_nri.py [--calls N] [--top K]
Prints JSON: {"opcodes_per_create_and_remove", "by_module", "top_functions"}.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))

from fracplugin._proto import nri_pb2  # noqa: E402
from fracplugin.gpu.simulated import load_node  # noqa: E402
from fracplugin.ledger import Ledger  # noqa: E402
from fracplugin.mps.layout import MpsLayout  # noqa: E402
from fracplugin.nri.dispatch import PLUGIN_SERVICE, Dispatcher  # noqa: E402
from fracplugin.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, encode_frames  # noqa: E402
from fracplugin.nri.plugin import FracNriPlugin  # noqa: E402
from fracplugin.nri.serving import _Server, _Session  # noqa: E402
from fracplugin.nri.stub import _subscription  # noqa: E402
from fracplugin.nri.transport import NriTransport  # noqa: E402
from fracplugin.nri.ttrpc import Role, TtrpcConnection  # noqa: E402
from fracplugin.planner import PlannerConfig  # noqa: E402
from tests.helpers import node_rules  # noqa: E402

PREFIX = "nvidia.com/container.app."


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=640)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    node = load_node(str(REPO / "examples" / "nodes" / "gpu-node-1.yaml"))
    gpus = [g.uuid for g in node.gpus]
    state = Path(tempfile.mkdtemp(prefix="fpp-opcount", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    config = PlannerConfig(layout=MpsLayout(str(state / "mps")))
    plugin = FracNriPlugin(node_rules(node, Ledger(node, state / "ledger.json",
                                                   max_clients_per_gpu=config.max_clients_per_gpu), config))
    pods = [nri_pb2.PodSandbox(id=f"sb-{i}", name=f"bench-{i}", uid=f"bench-uid-{i:03d}", namespace="bench",
                               annotations={PREFIX + "gpu-memory.request": "1Gi", PREFIX + "gpu-memory.limit": "2Gi",
                                            PREFIX + "gpu-compute.mode": "time-slicing",
                                            PREFIX + "gpus.devices": gpus[i % len(gpus)]}) for i in range(64)]
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    server = _Server(plugin, "fracplugin", on_bound=lambda _: None, on_synchronized=lambda: None)
    session = _Session(1, Dispatcher(plugin, _subscription(plugin, None), "fracplugin"))
    transport = NriTransport(ours, serve_conn=PLUGIN_SERVICE_CONN, call_conn=RUNTIME_SERVICE_CONN,
                             on_request=lambda ev: server.dispatch(session, ev))
    session.transport = transport
    runtime = TtrpcConnection(Role.CLIENT)
    seq = 0

    def requests(n: int) -> list[bytes]:
        nonlocal seq
        made = []
        for _ in range(n):
            seq += 1
            pod = pods[seq % len(pods)]
            ctr = nri_pb2.Container(id=f"ctr-{seq}", pod_sandbox_id=pod.id, name="app", args=["sleep", "infinity"],
                                    env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                                    annotations=dict(pod.annotations))
            made.append((pod, ctr))
        out = []
        for method, cls in (("CreateContainer", nri_pb2.CreateContainerRequest),
                            ("RemoveContainer", nri_pb2.RemoveContainerRequest)):
            for pod, ctr in made:
                runtime.send_request(PLUGIN_SERVICE, method, cls(pod=pod, container=ctr).SerializeToString())
                out.append(encode_frames(PLUGIN_SERVICE_CONN, runtime.data_to_send()))
        return out

    def drain() -> None:
        try:
            while peer.recv(1 << 20):
                pass
        except BlockingIOError:
            pass

    def feed(reqs: list[bytes]) -> None:
        for i, r in enumerate(reqs):
            transport._feed(r)
            if i % 16 == 15:
                drain()
        drain()

    feed(requests(200))  # warm-up: every pod admitted once, caches filled
    reqs = requests(a.calls)
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            co = frame.f_code
            counts[(co.co_filename.rpartition("src/")[2], co.co_name)] += 1
        return tracer

    sys.settrace(tracer)
    try:
        feed(reqs)
    finally:
        sys.settrace(None)
    server.stop()
    del counts[(__file__.rpartition("src/")[2], "feed")], counts[(__file__.rpartition("src/")[2], "drain")]
    by_module: collections.Counter[str] = collections.Counter()
    for (f, _), c in counts.items():
        by_module[f] += c
    per = float(a.calls)
    print(json.dumps({
        "opcodes_per_create_and_remove": round(sum(counts.values()) / per, 1),
        "by_module": {f: round(c / per, 1) for f, c in by_module.most_common()},
        "top_functions": [[f"{f}:{n}", round(c / per, 1)] for (f, n), c in counts.most_common(a.top)],
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
