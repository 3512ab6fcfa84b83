"""What is done with a fractional container found running unfenced
(``nri.reconcile.Unfenced``, issue 35 item 1, ADR 0035): one restart per pod
per backoff window, the window doubling; the same pod asked once; report
once per container; no API access reports and says so. A clock of the
test's own, a recording restarter and event recorder."""

from __future__ import annotations

from typing import Any

from fracplugin._proto import nri_pb2
from fracplugin.model import PodRef
from fracplugin.nri.reconcile import Unfenced


class Rec:
    """Records restarts and Events."""

    def __init__(self) -> None:
        self.restarts: list[tuple[PodRef, str]] = []
        self.events: list[tuple[str, str, str]] = []  # (pod UID, action, message)

    def restart(self, pod: PodRef, container: str, why: str) -> bool:
        self.restarts.append((pod, container))
        return True

    def stats(self) -> dict[str, Any]:
        return {"requested": len(self.restarts)}

    def unfenced(self, pod: PodRef, container: str, message: str, action: str) -> None:
        self.events.append((pod.uid, action, message))


def _pod(uid: str, name: str = "nb") -> tuple[Any, Any]:
    pod = nri_pb2.PodSandbox(id=f"s-{uid}", name=name, namespace="research", uid=uid)
    return pod, nri_pb2.Container(id=f"c-{uid}", pod_sandbox_id=pod.id, name="app")


def test_one_restart_per_pod_per_window_and_the_window_doubles() -> None:
    now = [1000.0]
    rec = Rec()
    u = Unfenced("restart", rec, rec, clock=lambda: now[0])
    assert u.act(*_pod("a"), "why") == "restarted"
    assert u.act(*_pod("a"), "why") == "asked"  # the same pod again (still terminating): nothing new
    now[0] += 299
    assert u.act(*_pod("b"), "why") == "backed_off"  # it came back unfenced inside 300 s
    assert u.status()["backoff"] == [{"pod": "research/nb", "restarts": 1, "next_restart_in_s": 1.0}]
    now[0] += 1
    assert u.act(*_pod("c"), "why") == "restarted"  # the window is over: restart 2, window 600 s
    now[0] += 599
    assert u.act(*_pod("d"), "why") == "backed_off"
    now[0] += 1
    assert u.act(*_pod("e"), "why") == "restarted"
    assert [u.window(n) for n in range(6)] == [0, 300, 600, 1200, 2400, 3600]
    assert u.act(*_pod("x", name="other"), "why") == "restarted"  # per pod name
    assert [p.uid for p, _ in rec.restarts] == ["a", "c", "e", "x"]
    assert [(uid, a) for uid, a, _ in rec.events] == [("a", "Restart"), ("b", "Backoff"), ("c", "Restart"),
                                                      ("d", "Backoff"), ("e", "Restart"), ("x", "Restart")]
    assert "restarting it so that it comes back fenced: evicting pod research/nb (" in rec.events[0][2]
    assert "came back unfenced after 2 restart(s) for this, the last 599 s ago" in rec.events[3][2]
    st = u.status()
    assert (st["restarted"], st["backed_off"], st["reported"], st["restarts"]) == (4, 2, 0, {"requested": 4})
    now[0] += 2 * Unfenced.BACKOFF_MAX_S + 1  # quiet for two maximum windows: forgotten
    assert u.act(*_pod("f"), "why") == "restarted" and u.status()["backoff"][-1]["restarts"] == 1


def test_report_and_no_api_access_report_once_per_container() -> None:
    rec = Rec()
    for u, said in ((Unfenced("report", rec, rec), "--unfenced-containers report"),
                    (Unfenced("restart", None, rec), "no API access to evict its pod")):
        rec.events.clear()
        assert [u.act(*_pod("a"), "why"), u.act(*_pod("a"), "why")] == ["reported", "asked"]
        assert rec.events == [("a", "Report", f"why; not restarted: {said}")]
        assert u.status()["reported"] == 1
    assert rec.restarts == []
