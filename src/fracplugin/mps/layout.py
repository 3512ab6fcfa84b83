"""Where MPS pipe and log directories live, host side and container side.

One ``nvidia-cuda-mps-control`` per compute mode (docs/reference/design.md section 5):

    <root>/ts            pipe directory of the time-slicing daemon (its ``control`` socket)
    <root>/sm            pipe directory of the sm-sharing daemon (MPS v3, -m)
    <root>/ts/shared/<ns>  pipe directory of one time-slicing container's namespace (MPS v3)
    <root>/sm/shared/<ns>  pipe directory of one sm-sharing container's namespace
    <root>/log/ts, <root>/log/sm   log directories
    <root>/api.sock      the MPS role's API socket (0600, peer checked: root only)

Containers see their pipe directory at ``CONTAINER_PIPE_DIR``. Under MPS v3
every container, in every mode, gets only its own namespace leaf (mounted
read-only), never a daemon's pipe directory: the daemon's ``control`` socket
is reachable only from the host (issue 12; docs/reference/mps-nvml.md 2.3: "mount ONLY the
leaf namespace dir"). Under classic MPS v2 there are no namespaces and a
container gets the daemon's pipe directory itself (read-only): the daemon
reports that as an exposure at start and in readiness detail.

Paths are kept short: a socket path must fit ``sockaddr_un.sun_path`` (108
bytes incl. NUL, docs/reference/mps-nvml.md section 1.4); with the ``/control`` leaf that
leaves pipe directories at most ``MAX_PIPE_DIR_LEN`` characters (the reference
caps at 83).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..model import ComputeMode

CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_ROOT = "/run/fracplugin/mps"
SM_SERVER = "shared"
MAX_PIPE_DIR_LEN = 83
_MODE_DIR = {ComputeMode.TIME_SLICING: "ts", ComputeMode.SM_SHARING: "sm"}


@functools.lru_cache(maxsize=4096)  # on every CreateContainer (issue 14): sha256 + format, a pure function
def namespace_name(pod_uid: str, container: str) -> str:
    """MPS v3 namespace name of one sm-sharing container: ``fp_`` + 24 hex of
    sha256("<pod uid>/<container>"). Stable across container restarts (same pod
    and name -> same namespace, same pipe directory). Names allow only
    ``[a-z0-9_]``, at most 64 chars (docs/reference/mps-nvml.md section 1.6)."""
    digest = hashlib.sha256(f"{pod_uid}/{container}".encode()).hexdigest()
    return "fp_" + digest[:24]


@dataclass(frozen=True)
class MpsLayout:
    """Host paths under ``root`` (default ``/run/fracplugin/mps``).

    Raises ValueError at construction when the longest pipe directory would not
    fit the socket path limit.
    """

    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        if not self.root.startswith("/"):
            raise ValueError(f"mps root {self.root!r} must be an absolute path")
        longest = self.namespace_pipe_dir(namespace_name("x", "y"))
        if len(longest) > MAX_PIPE_DIR_LEN:
            raise ValueError(
                f"mps root {self.root!r} is too long: namespace pipe directories would be "
                f"{len(longest)} chars, the limit is {MAX_PIPE_DIR_LEN} (unix socket paths must fit 108 bytes)"
            )

    def pipe_dir(self, mode: ComputeMode) -> str:
        """The pipe directory of the daemon of ``mode``."""
        return str(PurePosixPath(self.root) / _MODE_DIR[mode])

    def log_dir(self, mode: ComputeMode) -> str:
        """The log directory of the daemon of ``mode``."""
        return str(PurePosixPath(self.root) / "log" / _MODE_DIR[mode])

    @functools.lru_cache(maxsize=4096)  # on every CreateContainer (issue 14): three pathlib objects; frozen self
    def namespace_pipe_dir(self, namespace: str, mode: ComputeMode = ComputeMode.SM_SHARING) -> str:
        """The pipe directory of a container's namespace on the daemon of
        ``mode`` (MPS v3 layout ``<pipe>/<server>/<namespace>``)."""
        return str(PurePosixPath(self.pipe_dir(mode)) / SM_SERVER / namespace)
