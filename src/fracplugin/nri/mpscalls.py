"""The MPS layer as the NRI door calls it (``MpsCalls``): whether the daemon
of a compute mode is up, the wait for a (re)starting one within a call's
budget, CreateContainer's refusal while it is down, and the ensure, drain
and release calls with their logs. No state of its own: the namespace table
(``nri/namespaces.py``) decides when to call, this object how.

The module docstring of ``nri/plugin.py`` describes the behaviour and the
concurrency model; ``FracNriPlugin`` is the one class to use.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

from ..model import ComputeMode, ContainerPlan
from ..mps.api import MpsApi
from ..ports import HookMetrics
from .interfaces import CallContext
from .ttrpc import Code, RpcError
from .pluginbase import _MODES, DoorSettings, Owner, _FailOpen, mps_timeout

log = logging.getLogger("fracplugin.nri.plugin")  # the NRI door's log


class MpsCalls:
    """The NRI door's calls to the MPS layer (module docstring)."""

    def __init__(self, mps: MpsApi, metrics: HookMetrics, settings: DoorSettings) -> None:
        self.mps = mps
        self.metrics = metrics
        self.settings = settings

    def up(self, mode: ComputeMode) -> bool:
        """The daemon of ``mode`` answers its probe now."""
        return bool(self.mps.healthy(mode))

    def all_up(self) -> bool:
        """Every MPS daemon answers its probe."""
        return all(map(self.mps.healthy, _MODES))

    def why_down(self, mode: ComputeMode) -> str:
        """The MPS layer's reason why the daemon of ``mode`` is not healthy."""
        return str(self.mps.unhealthy_reason(mode)) or "not healthy"

    def wait_healthy(self, deadline: float, mode: ComputeMode = ComputeMode.SM_SHARING) -> bool:
        """Absorb a short window where the daemon of ``mode`` is (re)starting:
        poll ``healthy(mode)`` until ``deadline`` (the MPS time share of this
        call). Returns the last answer; the namespace call reports whatever is
        still wrong."""
        pause = 0.01
        while not (ok := bool(self.mps.healthy(mode))) and time.monotonic() + pause < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        return ok

    def require_up(self, p: ContainerPlan, ctx: CallContext | None, fields: Mapping[str, Any]) -> None:
        """Refuse (UNAVAILABLE: the runtime retries) a container whose mode's MPS
        daemon is down or crash-looping, after waiting up to half the budget for
        it to come back: without its daemon CUDA runs without MPS and without a
        limit (issue 12). Not with ``fail_open`` (the container runs, warned)."""
        if self.up(p.compute_mode) or self.wait_healthy(time.monotonic() + mps_timeout(ctx, share=0.5), p.compute_mode):
            return
        why = self.why_down(p.compute_mode)
        self.metrics.refusal("mps_unavailable")
        log.warning("nri MPS daemon of the container's mode is down", extra={**fields, "mode": p.compute_mode.value,
                                                                           "reason": why})
        if self.settings.fail_open:
            log.warning("nri fail-open: container runs without MPS", extra=dict(fields))
            raise _FailOpen()
        raise RpcError(Code.UNAVAILABLE,
                       f"fracplugin: the {p.compute_mode.value} MPS daemon is down ({why}); "
                       f"{p.pod}/{p.container} is refused until it is back")

    def failed(self, exc: Exception, fields: Mapping[str, Any], who: str) -> None:
        """A container's namespace is not there at StartContainer: UNAVAILABLE,
        or (``fail_open``) a warning and the container starts."""
        self.metrics.refusal("mps_unavailable")
        if self.settings.fail_open:
            log.warning("nri fail-open: container runs without its MPS namespace", extra={**fields, "reason": str(exc)})
            return None
        raise RpcError(Code.UNAVAILABLE, f"fracplugin: MPS namespace for {who} is not ready: {exc}")

    def ensure(self, owner: Owner, atp: int | None, fields: Mapping[str, Any],
               mode: ComputeMode = ComputeMode.SM_SHARING, limit_mib: int | None = None) -> str:
        """Make ``owner``'s namespace within ``namespace_timeout_s`` (waiting
        for its daemon first); a failure is logged and raised."""
        deadline = time.monotonic() + self.settings.namespace_timeout_s
        try:
            self.wait_healthy(deadline, mode)
            return self.mps.ensure_namespace(owner[0], owner[1], atp, max(0.01, deadline - time.monotonic()),
                                             mode=mode, pinned_limit_mib=limit_mib)
        except Exception as exc:
            log.warning("nri MPS namespace creation failed", extra={**fields, "reason": str(exc)})
            raise

    def drain(self, container_id: str, modes: Sequence[ComputeMode] | None, fields: Mapping[str, Any]) -> Any:
        """Drain ``container_id``'s MPS clients within ``drain_timeout_s``; a
        failure is logged and raised."""
        try:
            result = self.mps.drain(container_id, self.settings.drain_timeout_s, modes=modes)
        except Exception as exc:
            log.warning("nri MPS drain failed", extra={**fields, "reason": str(exc)})
            raise
        if result is not None:
            log.info("nri container drained",
                     extra={**fields, "drain": getattr(result, "to_dict", lambda: str(result))()})
        return result

    def release(self, owner: Owner) -> None:
        """Release ``owner``'s namespace (MPS errors are logged, never raised)."""
        try:
            self.mps.release_namespace(*owner)
        except Exception as exc:
            log.warning("nri MPS namespace release failed", extra={"pod_uid": owner[0], "container": owner[1], "reason": str(exc)})
