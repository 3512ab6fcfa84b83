"""What the NRI plugin, the device plugin and the daemon need from MPS.

``MpsApi`` is the one MPS interface (the NRI door's namespaces and drains,
the device plugin door's health, the daemon's lifecycle and status);
``MpsSupervisor`` (supervisor.py) is the real implementation, ``RemoteMps``
(rpc.py) the doors role's client of the MPS role, and ``NullMps`` the one
null object, used where MPS is disabled (and in tests of other components).

Concurrency: implementations must be callable from any thread; no call blocks
longer than the ``timeout_s`` it is given.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from ..model import ComputeMode
from .layout import MpsLayout, namespace_name

class MpsError(RuntimeError):
    """An MPS control operation failed (daemon down, command refused, bad reply).

    ``command`` is the command line (argv joined, or the v2 stdin command),
    ``output`` what the control binary printed (stdout+stderr, stripped).
    """

    def __init__(self, message: str, command: str = "", output: str = "") -> None:
        self.command = command
        self.output = output
        super().__init__(message)


class MpsResourceError(MpsError):
    """The control binary could not even be run because this process lacks a
    resource (``EMFILE``/``ENFILE`` open files, ``ENOMEM``, ``EAGAIN``
    processes): a fault of ours, not of the MPS daemon, so the supervisor
    retries without counting a probe failure or spending the restart budget
    (issue 13 item 1)."""


RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOBUFS})
"""errnos of fork/exec/open that mean "this process is out of a resource"."""


class MpsTimeout(MpsError):
    """An MPS control operation did not finish within its time budget."""


@dataclass(frozen=True)
class DrainResult:
    """Outcome of ``drain(container_id, timeout_s)``.

    Attributes:
        container_id: the container drained.
        clients: host PIDs of the container's MPS clients found (all daemons).
        terminated: PIDs whose ``client terminate`` / ``terminate_client`` answered in time.
        wedged: True when a terminate (or the client listing) ran out of time or
            failed (a client killed mid-kernel wedges the server: gpu-fractioning
            ``drain.go``, docs/reference/mps-nvml.md section 2.7); the daemon is
            marked slow and probed at once (``drain.Drainer.drain``).
        restarted: always empty (the probe decides about a restart, issue 12);
            kept on the MPS role's wire, which older doors read.
        skipped: True when nothing was attempted (no daemon running, or a drain
            of the same container was already in flight).
        errors: human-readable notes (one per failed step).
        elapsed_s: wall time spent, seconds.
    """

    container_id: str
    clients: tuple[int, ...] = ()
    terminated: tuple[int, ...] = ()
    wedged: bool = False
    restarted: tuple[ComputeMode, ...] = ()
    skipped: bool = False
    errors: tuple[str, ...] = ()
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every client found was terminated in time and nothing wedged."""
        return not self.wedged and set(self.terminated) >= set(self.clients)


HealthCallback = Callable[[ComputeMode, bool], None]
"""``callback(mode, healthy)``: called from the supervisor thread whenever the
daemon of ``mode`` changes between healthy and not healthy. Must not block."""


@runtime_checkable
class MpsApi(Protocol):
    """The MPS operations other components call (the one MPS port: the NRI
    door, the device plugin door's health monitor, the MPS role's API server
    and the daemon all take this type)."""

    @property
    def protocol(self) -> int | None:
        """The MPS control protocol in use (2 or 3; None when not known yet)."""
        ...

    def start(self) -> None:
        """Start supervising (or polling the MPS role). Raises MpsError / OSError."""
        ...

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop within ``timeout_s`` seconds (the supervisor of role ``all``
        quits its daemons; role ``mps`` leaves them running, ADR 0009)."""
        ...

    def quit_daemons(self, timeout_s: float = 10.0) -> None:
        """Quit every MPS control daemon now (the MPS role's API ``quit_daemons``)."""
        ...

    def unhealthy_reason(self, mode: ComputeMode) -> str:
        """Why the daemon of ``mode`` is not healthy ("" when it is)."""
        ...

    def ensure_namespace(
        self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float,
        mode: ComputeMode = ComputeMode.SM_SHARING, pinned_limit_mib: int | None = None,
    ) -> str:
        """Create (idempotently) and cap the MPS v3 namespace of a container on
        the daemon of ``mode`` (active thread percentage, pinned memory limit in
        MiB per GPU); return its host pipe directory. Raises MpsError / MpsTimeout."""
        ...

    def release_namespace(self, pod_uid: str, container: str, timeout_s: float | None = None) -> bool:
        """Forget (and delete, when possible) the namespace; True if it is gone now."""
        ...

    def drain(self, container_id: str, timeout_s: float, modes: Any = None) -> DrainResult:
        """Terminate the container's MPS clients on the daemons of ``modes``
        (None: all); never blocks past ``timeout_s``."""
        ...

    def healthy(self, mode: ComputeMode) -> bool:
        """Whether the daemon serving ``mode`` answers its probe."""
        ...

    def ready(self) -> bool:
        """Every configured daemon is healthy."""
        ...

    def status(self) -> dict[str, Any]:
        """JSON-able state (see ``MpsSupervisor.status``)."""
        ...

    def subscribe(self, callback: HealthCallback) -> None:
        """Register a health-change callback."""
        ...


@dataclass
class NullMps:
    """The no-op MPS: nothing is supervised, every operation succeeds at once.

    ``ensure_namespace`` returns the layout's namespace pipe directory without
    creating anything; ``drain`` finds no clients; ``healthy``/``ready`` are
    True (there is nothing to be unhealthy). Use it when MPS is disabled.
    """

    layout: MpsLayout = field(default_factory=MpsLayout)
    protocol: int | None = None

    def ensure_namespace(
        self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float,
        mode: ComputeMode = ComputeMode.SM_SHARING, pinned_limit_mib: int | None = None,
    ) -> str:
        return self.layout.namespace_pipe_dir(namespace_name(pod_uid, container), ComputeMode(mode))

    def release_namespace(self, pod_uid: str, container: str, timeout_s: float | None = None) -> bool:
        return True

    def drain(self, container_id: str, timeout_s: float, modes: Any = None) -> DrainResult:
        return DrainResult(container_id=container_id, skipped=True)

    def healthy(self, mode: ComputeMode) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return {"enabled": False, "protocol": None, "ready": True, "daemons": []}

    def subscribe(self, callback: HealthCallback) -> None:
        return None

    def start(self) -> None:
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        return None

    def quit_daemons(self, timeout_s: float = 10.0) -> None:
        return None

    def unhealthy_reason(self, mode: ComputeMode) -> str:
        return ""
