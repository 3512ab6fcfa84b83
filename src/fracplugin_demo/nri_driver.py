"""The calls the demo's simulated runtime makes on the plugin it drives
(CreateContainer, StopContainer, the pod and container events).

Split out of ``nri_runtime.py`` (issue 26, ADR 0023), moved as they
were; ``NriRuntimeServer`` there is the one class to use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from fracplugin._proto import nri_pb2


class _PluginDriver:
    """Driving the plugin (a mixin of ``NriRuntimeServer``, which sets
    ``initial_sync`` and implements the calls below)."""

    initial_sync: tuple[Sequence[Any], Sequence[Any]] | None

    if TYPE_CHECKING:  # NriRuntimeServer's own
        def _call(self, method: str, req: Any, resp_cls: Any) -> Any: ...

        def _event(self, method: str, pod: Any, container: Any) -> None: ...

    # ---- driving the plugin ------------------------------------------------------
    def set_sync_state(self, pods: Sequence[Any], containers: Sequence[Any]) -> None:
        """What the next Synchronize (after a (re)connection) carries."""
        self.initial_sync = (list(pods), list(containers))

    def create_container(self, pod: Any, container: Any) -> Any:
        """CreateContainer: returns the ``CreateContainerResponse``. Raises
        ``RpcError`` when the plugin refuses (e.g. INVALID_ARGUMENT),
        ``ConnectionError`` / ``TimeoutError``."""
        req = nri_pb2.CreateContainerRequest(pod=pod, container=container)
        return self._call("CreateContainer", req, nri_pb2.CreateContainerResponse)

    def update_container(self, pod: Any, container: Any) -> Any:
        """UpdateContainer: returns the ``UpdateContainerResponse``. Raises RpcError."""
        req = nri_pb2.UpdateContainerRequest(pod=pod, container=container)
        return self._call("UpdateContainer", req, nri_pb2.UpdateContainerResponse)

    def stop_container(self, pod: Any, container: Any) -> Any:
        """StopContainer: returns the ``StopContainerResponse``. Raises RpcError."""
        req = nri_pb2.StopContainerRequest(pod=pod, container=container)
        return self._call("StopContainer", req, nri_pb2.StopContainerResponse)

    def start_container(self, pod: Any, container: Any) -> None:
        """StartContainer (v0.12 RPC, StateChange fallback). Raises RpcError
        (e.g. UNAVAILABLE: the runtime fails the start, kubelet retries)."""
        self._event("StartContainer", pod, container)

    def remove_container(self, pod: Any, container: Any) -> None:
        """RemoveContainer (v0.12 RPC, StateChange fallback). Raises RpcError."""
        self._event("RemoveContainer", pod, container)

    def run_pod_sandbox(self, pod: Any) -> None:
        """RunPodSandbox (v0.12 RPC, StateChange fallback). Raises RpcError."""
        self._event("RunPodSandbox", pod, None)

    def stop_pod_sandbox(self, pod: Any) -> None:
        """StopPodSandbox (v0.12 RPC, StateChange fallback). Raises RpcError."""
        self._event("StopPodSandbox", pod, None)

    def remove_pod_sandbox(self, pod: Any) -> None:
        """RemovePodSandbox (v0.12 RPC, StateChange fallback). Raises RpcError."""
        self._event("RemovePodSandbox", pod, None)
