"""No MPS namespace without caps (issue 35 item 4 input 4, ADR 0034), through the daemon's real sockets:
single layout, compiled fake MPS client, every MPS command answered 1.5 s late. The namespace creates
and sets the NRI door's ensures time out on are still carried out by the daemon; each one is kept and
finished (or deleted) by the MPS supervisor's probe thread once the delay is gone, and never listed as
owned by nobody. (Input 5, the split layout's new MPS role: tests/component/test_mps_roles.py.)
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

from test_daemon import FAKE_MPS, DaemonProc, daemon, root  # noqa: F401 (fixtures)
from test_mps_roles import caps, start

from fracplugin.mps.layout import namespace_name
from tests.helpers import wait_for

P = "nvidia.com/container."


def _sm_daemon(d: Any) -> dict[str, Any]:
    return next(x for x in d.get("/status")[1]["mps"]["daemons"] if x["mode"] == "sm-sharing")


def test_timed_out_namespace_creates_are_finished_never_owned_by_nobody(
        daemon: Callable[..., DaemonProc], root: Path) -> None:  # noqa: F811
    import nri_runtime as nr

    rt = nr.FakeNriRuntime(root / "nri.sock", initial_sync=([], []))
    try:
        d = daemon("--mps-control-binary", str(FAKE_MPS), "--nri-socket", str(root / "nri.sock"),
                   "--no-device-plugin")
        rt.wait_registered(15)
        wait_for(d.ready, what=lambda: f"ready: {d.get('/readyz')}")
        seen: list[Any] = []  # every orphan /status ever listed, from the first slow command on
        done = threading.Event()

        def watch() -> None:
            try:
                while not done.wait(0.05):  # a poll interval, not a time budget: the daemon keeps its CPU
                    seen.extend(_sm_daemon(d)["orphans"])
            except Exception as exc:  # the check must not end unseen
                seen.append(exc)

        (root / "mps" / "sm" / "fake-control.json").write_text(json.dumps({"slow_s": 1.5}))
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        owners = []
        for name in ("slow1", "slow2", "slow3"):
            pod = nr.make_pod(name, uid=f"uid-{name}", annotations={
                P + "app.gpu-memory.request": "10Gi", P + "app.gpu-memory.limit": "12Gi",
                P + "app.gpu-compute.mode": "sm-sharing", P + "app.gpu-compute.portion": "0.3",
                P + "app.gpus.devices": "0"})
            ctr = nr.make_container(pod, "app")
            assert not isinstance(rt.create_container(pod, ctr), nr.RpcError)
            start(rt, pod, ctr)  # a namespace that failed in time is UNAVAILABLE: retried as kubelet does
            owners.append(f"shared/{namespace_name(pod.uid, 'app')}")
        # the ensures queue behind each other on the daemon's namespace lock: a later one times out on our
        # side while the daemon still carries its create out; only then is the delay removed
        wait_for(lambda: "timed out" in d.logs(), what="a namespace command timed out on our side")
        (root / "mps" / "sm" / "fake-control.json").write_text("{}")

        def finished() -> bool:
            st = _sm_daemon(d)
            ns = caps(root)["sm"]
            return (st["repairing"] == [] and set(ns) == set(owners)
                    and all((v["active_thread_percentage"], v["pinned_memory_limit"]) == (30, "12288M")
                            for v in ns.values()))

        wait_for(finished, what=lambda: f"every namespace capped as planned or gone: {caps(root)['sm']} "
                                        f"{_sm_daemon(d)}")
        done.set()
        watcher.join()
        assert seen == [] and _sm_daemon(d)["orphans"] == []
        wait_for(d.ready, what=lambda: f"ready again: {d.get('/readyz')}")
        assert d.terminate() == 0
    finally:
        rt.close()
