"""The generic NRI stub (no GPUs) against the fake runtime over real sockets:
registration flow, fd mode, event routing (v0.12 dedicated RPCs and v0.8
StateChange), errors, large answers in small frames, reconnection, stop."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from tests.helpers import wait_for, wait_until

from fracplugin._proto import nri_pb2
from fracplugin.nri.interfaces import event_mask
from fracplugin.nri.stub import NriStub
from fracplugin.nri.ttrpc import Code, RpcError

from nri_runtime import FakeNriRuntime, make_container, make_pod
from nri_runtime import RpcError as PeerRpcError


class Recorder:
    """A toy plugin: records every event it sees."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.configured: list = []
        self.shutdowns = 0
        self.lock = threading.Lock()
        self.create_result = None
        self.raise_on_create: Exception | None = None

    def _rec(self, *item):
        with self.lock:
            self.seen.append(item)

    def configure(self, req, ctx):
        self.configured.append((req.runtime_name, req.request_timeout, ctx.request_timeout_s))

    def synchronize(self, pods, containers, ctx):
        self._rec("synchronize", sorted(p.name for p in pods), sorted(c.name for c in containers))
        return []

    def create_container(self, pod, container, ctx):
        self._rec("create", pod.name, container.name)
        if self.raise_on_create is not None:
            raise self.raise_on_create
        return self.create_result

    def stop_container(self, pod, container, ctx):
        self._rec("stop", pod.name, container.name)

    def remove_container(self, pod, container, ctx):
        self._rec("remove", pod.name, container.name)

    def start_container(self, pod, container, ctx):
        self._rec("start", pod.name, container.name)

    def run_pod_sandbox(self, pod, ctx):
        self._rec("run_pod", pod.name)

    def remove_pod_sandbox(self, pod, ctx):
        self._rec("remove_pod", pod.name)

    def shutdown(self, ctx):
        self.shutdowns += 1




def _stub(handler, path, cleanup, **kw):
    stub = NriStub(handler, socket_path=path, env={}, reconnect_initial_s=0.02, reconnect_max_s=0.2, **kw)
    cleanup(stub)
    return stub


def test_mask_defaults_to_the_handlers_methods_and_is_validated():
    rec = Recorder()
    stub = NriStub(rec, env={})
    expected = event_mask(nri_pb2.CREATE_CONTAINER, nri_pb2.STOP_CONTAINER, nri_pb2.REMOVE_CONTAINER,
                          nri_pb2.START_CONTAINER, nri_pb2.RUN_POD_SANDBOX, nri_pb2.REMOVE_POD_SANDBOX)
    assert stub.events == expected
    with pytest.raises(ValueError):
        NriStub(rec, env={}, events=0x3FFF)  # beyond what v0.8 runtimes accept
    with pytest.raises(ValueError):
        NriStub(rec, env={}, events=0)
    with pytest.raises(ValueError):
        NriStub(rec, env={}, plugin_idx="5")
    with pytest.raises(ValueError):
        NriStub(rec, env={}, plugin_name="bad name")
    with pytest.raises(ValueError):
        NriStub(rec, env={"NRI_PLUGIN_SOCKET": "three"})


@pytest.mark.parametrize("version", ["v0.12.2", "v0.8.0"])
def test_events_reach_the_handler_by_rpc_or_state_change(version, sockpath, cleanup):
    rt = FakeNriRuntime(sockpath, nri_version=version, runtime_name="containerd", request_timeout_ms=1500)
    cleanup(rt)
    rec = Recorder()
    stub = _stub(rec, sockpath, cleanup, plugin_name="toy", plugin_idx="07").start()
    info = rt.wait_registered()
    assert (info.name, info.idx, info.events) == ("toy", "07", stub.events)
    assert rec.configured == [("containerd", 1500, 1.5)]
    # The runtime may finish its side of the handshake before the plugin's
    # reader has seen the RegisterPlugin reply: wait for the plugin's view.
    wait_for(stub.connected, what="the plugin to see its registration answered")
    st = stub.status()
    assert (st["connected"], st["ready"], st["request_timeout_s"]) == (True, False, 1.5)
    assert st["runtime"].startswith("containerd ") and st["events"] == f"0x{stub.events:x}"
    pod = make_pod("p")
    ctr = make_container(pod, "c")
    rt.synchronize([pod], [ctr])
    assert rt.run_pod_sandbox(pod) is None
    assert rt.create_container(pod, ctr) == nri_pb2.ContainerAdjustment()
    assert rt.start_container(pod, ctr) is None
    assert rt.stop_container(pod, ctr) == []
    assert rt.remove_container(pod, ctr) is None
    assert rt.remove_pod_sandbox(pod) is None
    assert rec.seen == [
        ("synchronize", ["p"], ["c"]),
        ("run_pod", "p"),
        ("create", "p", "c"),
        ("start", "p", "c"),
        ("stop", "p", "c"),
        ("remove", "p", "c"),
        ("remove_pod", "p"),
    ]
    state_changes = [c for c in rt.calls if c.startswith("StateChange")]
    if version == "v0.8.0":
        assert state_changes == ["StateChange:RUN_POD_SANDBOX", "StateChange:START_CONTAINER",
                                 "StateChange:REMOVE_CONTAINER", "StateChange:REMOVE_POD_SANDBOX"]
    else:
        assert state_changes == []  # every dedicated RPC is implemented: no fallback


def test_configure_before_the_register_reply_does_not_deadlock(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath, configure_before_register_reply=True)
    cleanup(rt)
    stub = _stub(Recorder(), sockpath, cleanup).start()
    rt.wait_registered()
    wait_for(stub.connected, what="registration")
    rt.synchronize([], [])
    wait_for(stub.ever_synchronized, 5)


def test_handler_errors_become_statuses(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath)
    cleanup(rt)
    rec = Recorder()
    _stub(rec, sockpath, cleanup).start()
    rt.wait_registered()
    pod = make_pod("p")
    ctr = make_container(pod, "c")
    rec.raise_on_create = RpcError(Code.FAILED_PRECONDITION, "not today")
    err = rt.create_container(pod, ctr)
    assert (err.code, err.message) == (Code.FAILED_PRECONDITION, "not today")
    rec.raise_on_create = KeyError("bug")
    err = rt.create_container(pod, ctr)
    assert err.code == Code.INTERNAL and "KeyError" in err.message
    rec.raise_on_create = None
    rec.create_result = nri_pb2.StopContainerResponse()  # wrong type: a bug, reported
    assert rt.create_container(pod, ctr).code == Code.INTERNAL
    assert rt.transport is not None and not rt.transport.closed.is_set()


def test_large_answers_travel_in_frames_the_go_reader_accepts(sockpath, cleanup):
    # The fake runtime reads mux frames into 4096 bytes like a Go peer and
    # drops the plugin otherwise; a 20 KB adjustment must still arrive.
    rt = FakeNriRuntime(sockpath, max_read_frame=4096)
    cleanup(rt)
    rec = Recorder()
    adj = nri_pb2.ContainerAdjustment()
    for i in range(200):
        adj.env.add(key=f"K{i:03d}", value="v" * 90)
    rec.create_result = nri_pb2.CreateContainerResponse(adjust=adj)
    _stub(rec, sockpath, cleanup).start()
    rt.wait_registered()
    pod = make_pod("p", annotations={f"a{i}": "x" * 100 for i in range(300)})  # ~30 KB request
    got = rt.create_container(pod, make_container(pod, "c"))
    assert got == adj and adj.ByteSize() > 16000


def test_shutdown_is_answered(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath)
    cleanup(rt)
    rec = Recorder()
    stub = _stub(rec, sockpath, cleanup).start()
    rt.wait_registered()
    resp = rt.call_raw("nri.pkg.api.v1alpha1.Plugin", "Shutdown", b"")
    assert resp.ok and resp.payload == b"" and rec.shutdowns == 1
    assert stub.connected()


def test_waits_for_the_runtime_then_registers(sockpath, cleanup, caplog):
    caplog.set_level(logging.INFO, logger="fracplugin.nri.stub")
    stub = _stub(Recorder(), sockpath, cleanup).start()

    def failed_attempts() -> int:
        return sum(r.getMessage() == "nri runtime not reachable, retrying" for r in caplog.records)

    wait_until(lambda: failed_attempts() >= 2, what="a few failed connection attempts")
    assert not stub.connected() and not stub.ready()
    rt = FakeNriRuntime(sockpath)
    cleanup(rt)
    rt.wait_registered()
    wait_for(stub.connected, what="registration")


def test_stop_is_clean_and_final(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath)
    cleanup(rt)
    stub = _stub(Recorder(), sockpath, cleanup).start()
    rt.wait_registered()
    assert stub.stop(5) is True
    assert rt.wait_disconnected(5) is not None
    assert not stub.connected() and stub.exited
    # its threads end (the watchdog's a moment after stop() returns), so
    # nothing can reconnect later: one connection is final
    wait_until(lambda: not [t for t in threading.enumerate() if t.name in ("nri-stub", "nri-watchdog") and t.is_alive()],
               what="the stub's threads to end")
    assert rt.connections == 1  # no reconnection after stop()


def test_fd_mode_uses_the_inherited_socket_and_ends_with_it(cleanup):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    rt = FakeNriRuntime("/nonexistent/nri.sock", listen=False)
    cleanup(rt)
    env = {"NRI_PLUGIN_SOCKET": str(theirs.detach()), "NRI_PLUGIN_NAME": "frac", "NRI_PLUGIN_IDX": "10"}
    stub = NriStub(Recorder(), socket_path="/nonexistent/nri.sock", env=env)
    cleanup(stub)
    assert stub.fd_mode and (stub.plugin_name, stub.plugin_idx) == ("frac", "10")
    stub.start()
    rt.adopt(ours)
    info = rt.wait_registered()
    assert (info.name, info.idx) == ("frac", "10")
    rt.synchronize([], [])
    wait_for(stub.ever_synchronized, 5)
    rt.disconnect()  # the runtime closes its end: the launched plugin ends
    assert stub.wait_exit(10)
    assert not stub.connected()


def test_dispatcher_without_sockets():
    from fracplugin.nri.dispatch import Dispatcher, PLUGIN_SERVICE
    from fracplugin.nri.ttrpc import RequestReceived

    rec = Recorder()
    d = Dispatcher(rec, 0x608)

    def ev(method, msg, service=PLUGIN_SERVICE):
        return RequestReceived(1, service, method, msg.SerializeToString(), 0)

    pod = make_pod("p")
    ctr = make_container(pod, "c")
    # StateChange for an event with no state-change meaning (CreateContainer) is ignored.
    e = ev("StateChange", nri_pb2.StateChangeEvent(event=nri_pb2.CREATE_CONTAINER, pod=pod, container=ctr))
    assert d.routes[e.method].serve(d.decode(e), d.context(e, 0.5)) == nri_pb2.Empty()
    # Methods the handler lacks answer an empty response of the right type.
    e = ev("ValidateContainerAdjustment", nri_pb2.ValidateContainerAdjustmentRequest(pod=pod))
    assert d.routes[e.method].serve(d.decode(e), d.context(e, 0.5)) == nri_pb2.ValidateContainerAdjustmentResponse()
    e = ev("UpdateContainer", nri_pb2.UpdateContainerRequest(pod=pod, container=ctr))
    assert d.routes[e.method].serve(d.decode(e), d.context(e, 0.5)) == nri_pb2.UpdateContainerResponse()
    assert rec.seen == []
    # Budget: the smaller of the request timeout and the request's own deadline.
    e = RequestReceived(3, PLUGIN_SERVICE, "CreateContainer", b"", 800_000_000)
    assert d.context(e, 0.5, now=100.0).deadline == pytest.approx(100.4)
    assert d.check(ev("Nope", nri_pb2.Empty())).code == Code.UNIMPLEMENTED
    assert d.check(ev("Configure", nri_pb2.Empty(), service="x.Y")).message == "service x.Y"


class Inline(Recorder):
    """A Recorder whose calls never wait, except StopContainer: the stub serves
    the others on its reader thread. Records the thread of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[str, str] = {}
        self.gate: threading.Event | None = None
        self.abandoned_calls: list[tuple[str, str]] = []

    def may_block(self, method):
        return method == "StopContainer"

    def create_container(self, pod, container, ctx):
        self.threads["create"] = threading.current_thread().name
        if self.gate is not None:
            self.gate.wait(10)
        return super().create_container(pod, container, ctx)

    def stop_container(self, pod, container, ctx):
        self.threads["stop"] = threading.current_thread().name
        return super().stop_container(pod, container, ctx)

    def abandoned(self, method, request, response):
        self.abandoned_calls.append((method, type(response).__name__))


class Pooled(Inline):
    """The same without ``may_block``: the stub cannot know its calls never wait."""

    may_block = None  # type: ignore[assignment]


def test_calls_that_cannot_wait_are_served_on_the_reader_thread(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath)
    cleanup(rt)
    inline, pooled = Inline(), Pooled()
    stub = _stub(inline, sockpath, cleanup).start()
    rt.wait_registered()
    wait_for(stub.connected, what="registration")
    pod = make_pod("p")
    ctr = make_container(pod, "c")
    assert rt.create_container(pod, ctr) == nri_pb2.ContainerAdjustment()
    assert rt.stop_container(pod, ctr) == []
    assert inline.threads["create"].endswith("-reader")  # may_block("CreateContainer") is False
    assert inline.threads["stop"].startswith("nri-handler")  # may_block("StopContainer") is True
    stub.stop(5)
    # A handler without may_block: every call of its own runs on a handler thread.
    rt2 = FakeNriRuntime(sockpath + "2")
    cleanup(rt2)
    _stub(pooled, sockpath + "2", cleanup).start()
    rt2.wait_registered()
    assert rt2.create_container(pod, ctr) == nri_pb2.ContainerAdjustment()
    assert pooled.threads["create"].startswith("nri-handler")


def test_a_reader_thread_call_that_overruns_is_answered_by_the_watchdog_and_abandoned(sockpath, cleanup):
    rt = FakeNriRuntime(sockpath, request_timeout_ms=400)
    cleanup(rt)
    plugin = Inline()
    _stub(plugin, sockpath, cleanup).start()
    rt.wait_registered()
    pod = make_pod("p")
    plugin.gate = threading.Event()
    err = rt.create_container(pod, make_container(pod, "slow", container_id="c-slow"))
    # 0.75 x 0.4 s budget: the stub answers before the runtime gives up, while its reader still waits
    assert isinstance(err, PeerRpcError) and err.code == Code.UNAVAILABLE and "budget of 0.30 s" in err.message
    assert plugin.threads["create"].endswith("-reader")
    plugin.gate.set()
    wait_for(lambda: plugin.abandoned_calls, what="the late result dropped")
    assert plugin.abandoned_calls == [("CreateContainer", "CreateContainerResponse")]
    plugin.gate = None
    assert rt.create_container(pod, make_container(pod, "next")) == nri_pb2.ContainerAdjustment()
    assert rt.transport is not None and not rt.transport.closed.is_set()


def test_the_dispatch_table_and_the_mask_follow_the_implemented_interfaces():
    from fracplugin.nri.interfaces import EVENTS, CreateContainerInterface, handler_mask
    from fracplugin.nri.dispatch import Dispatcher

    rec = Recorder()
    d = Dispatcher(rec, handler_mask(rec))
    assert set(d.routes) == {s.method for s in EVENTS}
    runs = {m for m, r in d.routes.items() if r.runs_handler}
    assert runs == {"Configure", "Synchronize", "Shutdown", "StateChange", "RunPodSandbox", "RemovePodSandbox",
                    "CreateContainer", "StartContainer", "StopContainer", "RemoveContainer"}
    assert CreateContainerInterface.create_container.__name__ == "create_container"

    class OnlyCreate:
        def create_container(self, pod, container, ctx):
            return None

    only = OnlyCreate()
    assert handler_mask(only) == event_mask(nri_pb2.CREATE_CONTAINER)
    assert {m for m, r in Dispatcher(only, 0x8).routes.items() if r.runs_handler} == {"CreateContainer"}
    # As containerd/nri's stub: a configured mask may not subscribe to events the handler does not handle.
    with pytest.raises(ValueError, match="STOP_CONTAINER, REMOVE_CONTAINER"):
        NriStub(only, env={}, events=event_mask(nri_pb2.CREATE_CONTAINER, nri_pb2.STOP_CONTAINER,
                                                nri_pb2.REMOVE_CONTAINER))
    assert NriStub(only, env={}).events == 0x8
    with pytest.raises(ValueError, match="must be non-zero"):
        NriStub(object(), env={})  # implements nothing


class WrongShape:
    """Implements CreateContainer with the wrong arguments (a handler written
    against another shape: no ctx)."""

    def create_container(self, pod, container):
        return None


class TakesAnything:
    def create_container(self, *args, **kwargs):
        return None

    def remove_container(self, pod, container, ctx=None, extra=1):
        return None


class UpdatesPods:
    """Implements UpdatePodSandbox (NRI v0.10+), beyond the 0x7FF mask every runtime accepts."""

    def create_container(self, pod, container, ctx):
        return None

    def update_pod_sandbox(self, request, ctx):
        return None


def test_a_handler_method_with_the_wrong_signature_is_refused_when_the_stub_is_built():
    with pytest.raises(ValueError, match=r"WrongShape\.create_container\(pod, container\) cannot serve CreateContainer: "
                                         r"CreateContainerInterface is called as create_container\(pod, container, ctx\)"):
        NriStub(WrongShape(), env={})
    ok = NriStub(TakesAnything(), env={})  # defaults and *args fit
    assert ok.events == event_mask(nri_pb2.CREATE_CONTAINER, nri_pb2.REMOVE_CONTAINER)


def test_a_mask_that_cannot_be_sent_is_refused_naming_the_events():
    with pytest.raises(ValueError, match="implements UPDATE_POD_SANDBOX, beyond the events every runtime accepts"):
        NriStub(UpdatesPods(), env={})
    assert NriStub(UpdatesPods(), env={}, events=event_mask(nri_pb2.CREATE_CONTAINER)).events == 0x8
    with pytest.raises(ValueError, match="must be an integer bit mask"):
        NriStub(Recorder(), env={}, events="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an integer bit mask"):
        NriStub(Recorder(), env={}, events=True)  # type: ignore[arg-type]
