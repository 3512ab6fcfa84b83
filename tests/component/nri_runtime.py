"""An in-process fake of the runtime side of NRI (what containerd embeds),
on a real unix socket: the product's ``fracplugin.nri.runtime_client.
NriRuntimeServer`` (which holds the connection handling, handshake and event
routing) plus the fault injection and recording tests need.

It is a test and demo double, not a proof of interop (the Go interop suite is):
it follows the runtime's behaviour described in nri-protocol.md sections
1.2-1.9 -- it serves ``Runtime`` on mux conn 2 and calls ``Plugin`` on conn 1,
answers RegisterPlugin then calls Configure, rejects event masks outside the
version's ``ValidEvents`` (0x7FF for v0.8, 0x3FFF for v0.12), reads mux frames
into a 4096-byte buffer like a Go peer (a bigger frame drops the plugin),
sends v0.12 dedicated event RPCs (falling back to StateChange for good after
one UNIMPLEMENTED) or, as ``nri_version="v0.8.0"``, StateChange, and treats
a call that outlives the request timeout as fatal (closes the plugin).

Concurrency model: threads. One accept thread, one reader thread per plugin
connection (``NriTransport``), and the caller's thread for each call. One
plugin connection at a time: a new one replaces the old.

Usage::

    rt = FakeNriRuntime("/tmp/fpXYZ/nri.sock")
    ... start the plugin against that path ...
    info = rt.wait_registered()            # PluginInfo(name, idx, events)
    rt.synchronize([pod], [container])     # -> list[ContainerUpdate]
    adj = rt.create_container(pod, ctr)    # -> ContainerAdjustment | RpcError
    rt.stop_container(pod, ctr); rt.remove_container(pod, ctr)
    rt.close()
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from fracplugin._proto import nri_pb2
from fracplugin.nri.runtime_client import NriRuntimeServer, PluginConn, PluginInfo, effective_env, sandbox_msg
from fracplugin.nri.ttrpc import RpcError

__all__ = [
    "FakeNriRuntime",
    "PluginInfo",
    "make_pod",
    "make_container",
    "pod_from_manifest",
    "effective_env",
]


class FakeNriRuntime(NriRuntimeServer):
    """The runtime end of NRI, listening on ``socket_path``: the product's
    ``NriRuntimeServer`` (connection handling, registration handshake, event
    routing) plus fault injection and recording for tests. Unlike the
    product's, calls return the plugin's ``RpcError`` instead of raising it.

    Args:
        socket_path: where to listen (a stale file is removed first).
        nri_version: "v0.12.2" (dedicated event RPCs, ValidEvents 0x3FFF) or
            "v0.8.0" (StateChange events, ValidEvents 0x7FF).
        request_timeout_ms / registration_timeout_ms: sent in ConfigureRequest;
            the request timeout also bounds every call made here.
        config: ConfigureRequest.config.
        initial_sync: ``(pods, containers)`` to Synchronize right after every
            Configure (what a real runtime does with its running containers);
            None leaves synchronizing to ``synchronize()``.
        max_read_frame: the mux frame size the runtime can read (bytes).
        configure_before_register_reply: call Configure and wait for its
            answer *before* answering RegisterPlugin (a plugin whose reader
            blocks on its own register reply deadlocks here).
        listen: False to skip the listener (use ``adopt`` with a socketpair,
            like a runtime that launched the plugin with fd 3).
    """

    label = "fake-runtime"

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        nri_version: str = "v0.12.2",
        runtime_name: str = "fake-nri-runtime",
        runtime_version: str = "v0.0.0-test",
        request_timeout_ms: int = 2000,
        registration_timeout_ms: int = 5000,
        config: str = "",
        initial_sync: tuple[Sequence[Any], Sequence[Any]] | None = None,
        max_read_frame: int = 4096,
        configure_before_register_reply: bool = False,
        listen: bool = True,
    ) -> None:
        super().__init__(
            str(socket_path),
            request_timeout_s=request_timeout_ms / 1000.0,
            registration_timeout_s=registration_timeout_ms / 1000.0,
            runtime_name=runtime_name,
            runtime_version=runtime_version,
            nri_version=nri_version,
            config=config,
            initial_sync=initial_sync,
            max_read_frame=max_read_frame,
            backlog=8,
        )
        self.configure_before_register_reply = configure_before_register_reply
        self.registrations: list[PluginInfo] = []
        """Every successful registration, in order."""
        self.unsolicited: list[Any] = []
        """UpdateContainersRequests the plugin sent, in order."""
        self.calls: list[str] = []
        """Plugin-service methods called, in order (StateChange as 'StateChange:<event>')."""
        if listen:
            self.start()

    # ---------------------------------------------------------------- public

    @property
    def request_timeout_ms(self) -> int:
        return int(round(self.request_timeout_s * 1000))

    @property
    def registration_timeout_ms(self) -> int:
        return int(round(self.registration_timeout_s * 1000))

    @property
    def timeout_s(self) -> float:
        return self.request_timeout_s

    def wait_disconnected(self, timeout_s: float = 10.0) -> str | None:
        """Wait until the current plugin connection is closed; returns its
        close reason (None when there was no connection). Raises TimeoutError."""
        t = self.transport
        if t is None:
            return None
        if not t.closed.wait(timeout_s):
            raise TimeoutError("plugin connection still open")
        return t.close_reason

    def create_container(self, pod: Any, container: Any) -> Any:
        """CreateContainer: the plugin's ContainerAdjustment (empty when it left
        the container alone), or the RpcError it answered. Raises
        ConnectionClosed / TimeoutError (the connection is closed then)."""
        out = _answer(super().create_container, pod, container)
        return out if isinstance(out, RpcError) else out.adjust

    def update_container(self, pod: Any, container: Any) -> Any:
        """UpdateContainer: the plugin's ContainerUpdates, or its RpcError."""
        out = _answer(super().update_container, pod, container)
        return out if isinstance(out, RpcError) else list(out.update)

    def stop_container(self, pod: Any, container: Any) -> Any:
        """StopContainer: the plugin's ContainerUpdates, or its RpcError."""
        out = _answer(super().stop_container, pod, container)
        return out if isinstance(out, RpcError) else list(out.update)

    def remove_container(self, pod: Any, container: Any) -> RpcError | None:
        """RemoveContainer (dedicated RPC on v0.12, StateChange on v0.8)."""
        return _answer(super().remove_container, pod, container)

    def start_container(self, pod: Any, container: Any) -> RpcError | None:
        return _answer(super().start_container, pod, container)

    def run_pod_sandbox(self, pod: Any) -> RpcError | None:
        return _answer(super().run_pod_sandbox, pod)

    def stop_pod_sandbox(self, pod: Any) -> RpcError | None:
        return _answer(super().stop_pod_sandbox, pod)

    def remove_pod_sandbox(self, pod: Any) -> RpcError | None:
        return _answer(super().remove_pod_sandbox, pod)

    def call_raw(self, service: str, method: str, payload: bytes, timeout_s: float | None = None) -> Any:
        """Any request on the Plugin conn; returns the ``ResponseReceived``."""
        t = self._current().transport
        fut = t.call_async(service, method, payload, timeout_nano=int(self.timeout_s * 1e9))
        return fut.result(timeout_s or self.timeout_s)

    def disconnect(self) -> None:
        """Close the current plugin connection (the listener stays)."""
        t = self.transport
        if t is not None:
            t.close("runtime closed the plugin connection")
            t.join(2.0)

    def __enter__(self) -> "FakeNriRuntime":
        return self

    # -------------------------------------------------------------- hooks

    def _on_register(self, conn: PluginConn, stream_id: int) -> None:
        if not self.configure_before_register_reply:
            super()._on_register(conn, stream_id)
            return
        threading.Thread(
            target=self._setup, args=(conn, stream_id), name="fake-nri-configure", daemon=True
        ).start()

    def _on_update_containers(self, req: Any) -> None:
        with self._cond:
            self.unsolicited.append(req)

    def _on_registered(self, info: PluginInfo) -> None:
        self.registrations.append(info)

    def _record_call(self, method: str, req: Any) -> None:
        label = method if method != "StateChange" else f"StateChange:{nri_pb2.Event.Name(req.event)}"
        with self._cond:
            self.calls.append(label)


def _answer(call: Any, *args: Any) -> Any:
    """``call(*args)``, with the plugin's RpcError returned instead of raised."""
    try:
        return call(*args)
    except RpcError as exc:
        return exc


# ------------------------------------------------------------------ builders


def make_pod(
    name: str,
    namespace: str = "default",
    uid: str = "",
    annotations: Mapping[str, str] | None = None,
    *,
    pod_id: str = "",
    labels: Mapping[str, str] | None = None,
) -> Any:
    """A ``PodSandbox`` as containerd sends it: the pod's annotations plus
    containerd's ``io.kubernetes.cri.*`` keys (nri-protocol.md section 1.11)."""
    uid = uid or f"uid-{namespace}-{name}"
    return sandbox_msg(name, namespace, uid, pod_id or f"sandbox-{uid}", annotations or {}, labels or {})


def make_container(
    pod: Any,
    name: str,
    *,
    container_id: str = "",
    env: Mapping[str, str] | Iterable[str] | None = None,
    state: int = 0,
) -> Any:
    """A ``Container`` of ``pod`` (state 0 as in CreateContainer, or e.g.
    ``nri_pb2.CONTAINER_RUNNING`` for Synchronize)."""
    container_id = container_id or f"ctr-{pod.uid}-{name}"
    if env is None:
        env_list = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    elif isinstance(env, Mapping):
        env_list = [f"{k}={v}" for k, v in env.items()]
    else:
        env_list = list(env)
    return nri_pb2.Container(
        id=container_id,
        pod_sandbox_id=pod.id,
        name=name,
        state=state,
        env=env_list,
        annotations={"io.kubernetes.cri.container-name": name, "io.kubernetes.cri.container-type": "container"},
    )


def pod_from_manifest(manifest: Mapping[str, Any] | str | os.PathLike[str], *, pod_id: str = "") -> tuple[Any, list[Any]]:
    """``(PodSandbox, [Container...])`` from a Pod manifest (a dict, or a YAML
    file path such as ``shared/examples/pods/*.yaml``). Container env comes
    from ``spec.containers[].env[].value``."""
    if not isinstance(manifest, Mapping):
        import yaml

        manifest = yaml.safe_load(Path(manifest).read_text())
    meta = manifest.get("metadata", {})
    pod = make_pod(
        meta.get("name", "pod"),
        meta.get("namespace", "default"),
        meta.get("uid", ""),
        {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
        pod_id=pod_id,
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
    )
    containers = []
    for c in manifest.get("spec", {}).get("containers", []):
        env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        env += [f"{e['name']}={e.get('value', '')}" for e in c.get("env") or [] if "name" in e]
        containers.append(make_container(pod, c["name"], env=env))
    return pod, containers
