"""Talk to ``nvidia-cuda-mps-control``: one command = one subprocess with a timeout.

Concurrency: ``MpsControl`` holds no mutable state; every method spawns its own
short-lived ``nvidia-cuda-mps-control`` client process, bounded by the
``timeout_s`` it is given (the child is killed and reaped on timeout). Safe from
any thread.

Two protocol generations (docs/reference/mps-nvml.md sections 1.2, 1.5, 1.6, 1.8):

* v2: commands on the client's stdin, one per line (``echo get_server_list |
  nvidia-cuda-mps-control``); exit status 0 iff the daemon was reached.
* v3 (driver r615+): commands as argv ``<module> <verb> [args] [--key=value]``;
  list output always as ``--format=csv,noheader`` (the table format truncates
  7-digit PIDs, gpu-fractioning ``mpsctl/control.go``).

A new client invocation follows the protocol of the running daemon regardless
of its own flags, so the client carries only ``CUDA_MPS_PIPE_DIRECTORY``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .api import RESOURCE_ERRNOS, MpsError, MpsResourceError, MpsTimeout

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[a-z0-9_]{1,64}$")
"""MPS v3 server/namespace names: ``[a-z0-9_]``, at most 64 chars (docs/reference/mps-nvml.md 1.6)."""


@dataclass(frozen=True)
class ServerRow:
    """One line of v3 ``server list --format=csv,noheader``:
    name,uid,pid,status,pipe-directory,allowed-devices,context-ids."""

    name: str
    uid: str
    pid: int | None
    status: str
    pipe_directory: str
    allowed_devices: str = ""


@dataclass(frozen=True)
class NamespaceRow:
    """One line of v3 ``namespace list --format=csv,noheader``:
    name,server,server-status,pinned-memory-limit,active-thread-percentage,client-priority,pipe-directory.
    ``active_thread_percentage`` is None when the daemon prints no number."""

    name: str
    server: str
    server_status: str
    pinned_memory_limit: str
    active_thread_percentage: int | None
    client_priority: str
    pipe_directory: str


@dataclass(frozen=True)
class ClientRow:
    """One line of v3 ``client list --format=csv,noheader``: pid,server,device,namespace,cmd.
    ``pid`` is a host PID (the daemon runs in the host PID namespace)."""

    pid: int
    server: str
    device: str
    namespace: str
    cmd: str


def _int_or_none(s: str) -> int | None:
    s = s.strip()
    try:
        return int(float(s))
    except ValueError:
        return None


def _csv_rows(text: str, min_fields: int) -> list[list[str]]:
    rows = []
    for row in csv.reader(io.StringIO(text)):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) < min_fields:
            raise MpsError(f"unexpected control output line {row!r} (want {min_fields}+ fields)", output=text)
        rows.append([c.strip() for c in row])
    return rows


def choose_protocol(driver_version: str, override: int | None = None) -> int:
    """MPS protocol for a driver: ``override`` when given, else 3 for driver
    major >= 615 (MPS v3 / CUDA 13.4, docs/reference/mps-nvml.md section 3), else 2.
    Raises ValueError for an override other than 2/3. An unparseable version -> 2."""
    if override is not None:
        if override not in (2, 3):
            raise ValueError(f"MPS protocol must be 2 or 3, got {override!r}")
        return override
    m = re.match(r"\s*(\d+)", driver_version or "")
    if m and int(m.group(1)) >= 615:
        return 3
    return 2


def render_config_toml(sm_sharing: bool, servers: Iterable[str] = ("shared",), audit_log: bool = False) -> str:
    """The ``-a <file>`` TOML for an MPS v3 daemon (docs/reference/mps-nvml.md 1.7,
    docs/reference/gpu-fractioning-reference.md section 4): memory accounting on;
    context-share on for the sm-sharing daemon, off for the time-slicing one;
    one parameterless ``[servers.<name>]`` per name (``shared``) on both, so that
    every container gets a namespace of that server (its own leaf pipe
    directory) and no container ever needs the daemon's ``<pipe>/control``
    (issue 12). Raises ValueError for a bad server name."""
    lines = [
        'schema_version = "1.0"',
        "",
        "[features.memacct]",
        "enabled = true",
        f"audit_log = {'true' if audit_log else 'false'}",
        "",
        '[features."context-share"]',
        f"enabled = {'true' if sm_sharing else 'false'}",
    ]
    for name in servers:
        _check_name(name)
        lines += ["", f"[servers.{name}]"]
    return "\n".join(lines) + "\n"


class MpsControl:
    """Client side of one control daemon (identified by its pipe directory).

    Args:
        binary: path of ``nvidia-cuda-mps-control`` (or the fake).
        pipe_dir: the daemon's ``CUDA_MPS_PIPE_DIRECTORY``.
        protocol: 2 or 3 (selects which command forms the helpers use).
        log_dir: ``CUDA_MPS_LOG_DIRECTORY`` passed along (optional).
        env: extra environment for the client processes (tests); ``self.env`` is
            theirs, and the daemon's (``lifecycle`` starts it with it).

    Every method raises ``MpsTimeout`` when the command outlives ``timeout_s``
    (the client is killed and reaped) and ``MpsError`` for a non-zero exit or a
    missing binary.
    """

    def __init__(
        self,
        binary: str,
        pipe_dir: str,
        protocol: int,
        log_dir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.binary = binary
        self.pipe_dir = pipe_dir
        self.protocol = protocol
        self.log_dir = log_dir
        self.env = dict(os.environ)
        self.env.pop("CUDA_MPS_PROTOCOL_VERSION", None)  # env would override -p (docs/reference/mps-nvml.md 1.2)
        if env:
            self.env.update(env)
        self.env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_dir
        if log_dir:
            self.env["CUDA_MPS_LOG_DIRECTORY"] = log_dir

    # -- transport --------------------------------------------------------------

    def run(self, args: Sequence[str], timeout_s: float, stdin: str | None = None) -> str:
        """Run ``binary *args`` (feeding ``stdin``), return stdout (str).

        Raises MpsTimeout / MpsError as described on the class."""
        cmd = [self.binary, *args]
        label = " ".join(args) if args else (stdin or "").strip()
        if timeout_s <= 0:
            raise MpsTimeout(f"no time left for {label!r}", command=label)
        try:
            proc = subprocess.run(
                cmd,
                input=stdin if stdin is not None else "",
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=self.env,
                close_fds=True,
            )
        except subprocess.TimeoutExpired as e:
            out = _text(e.stdout) + _text(e.stderr)
            raise MpsTimeout(f"{label!r} timed out after {timeout_s:.3g}s", command=label, output=out.strip()) from None
        except OSError as e:
            if e.errno in RESOURCE_ERRNOS:  # our process is out of descriptors/memory: not the daemon's fault
                raise MpsResourceError(f"cannot run {self.binary}: {e}", command=label) from None
            raise MpsError(f"cannot run {self.binary}: {e}", command=label) from None
        if proc.returncode != 0:
            out = (proc.stdout + proc.stderr).strip()
            raise MpsError(f"{label!r} failed (exit {proc.returncode}): {out}", command=label, output=out)
        return proc.stdout

    def v2(self, command: str, timeout_s: float) -> str:
        """One v2 stdin command (e.g. ``get_server_list``); returns stdout."""
        return self.run([], timeout_s, stdin=command.rstrip("\n") + "\n")

    # -- probes -------------------------------------------------------------------

    def probe(self, timeout_s: float) -> float:
        """A real control command that exercises the daemon (docs/reference/mps-nvml.md 1.8):
        v3 ``server list --format=csv,noheader``; v2 ``get_default_active_thread_percentage``
        (NVIDIA's device plugin health probe). Returns the duration in seconds."""
        t0 = time.monotonic()
        if self.protocol >= 3:
            self.run(["server", "list", "--format=csv,noheader"], timeout_s)
        else:
            self.v2("get_default_active_thread_percentage", timeout_s)
        return time.monotonic() - t0

    # -- v3 ---------------------------------------------------------------------------

    def server_list(self, timeout_s: float) -> list[ServerRow]:
        out = self.run(["server", "list", "--format=csv,noheader"], timeout_s)
        return [
            ServerRow(r[0], r[1], _int_or_none(r[2]), r[3], r[4], r[5] if len(r) > 5 else "")
            for r in _csv_rows(out, 5)
        ]

    def namespace_list(self, server: str | None, timeout_s: float) -> list[NamespaceRow]:
        args = ["namespace", "list"]
        if server:
            args.append(f"--server={server}")
        args.append("--format=csv,noheader")
        out = self.run(args, timeout_s)
        return [NamespaceRow(r[0], r[1], r[2], r[3], _int_or_none(r[4]), r[5], r[6]) for r in _csv_rows(out, 7)]

    def namespace_create(self, name: str, server: str, timeout_s: float) -> None:
        _check_name(name)
        self.run(["namespace", "create", name, f"--server={server}"], timeout_s)

    def namespace_set_caps(self, name: str, server: str, percentage: int | None, pinned_mib: int | None,
                           timeout_s: float) -> None:
        """One ``namespace set <name> --server=<s> [--active-thread-percentage=<1..100>]
        [--pinned-memory-limit=<MiB>M]`` (docs/reference/mps-nvml.md 1.6: several keys per set).
        Nothing to set -> no command. Fails while a client is attached."""
        args = ["namespace", "set", name, f"--server={server}"]
        if percentage is not None:
            if not 1 <= int(percentage) <= 100:
                raise ValueError(f"active thread percentage must be 1..100, got {percentage!r}")
            args.append(f"--active-thread-percentage={int(percentage)}")
        if pinned_mib is not None:
            if int(pinned_mib) < 1:
                raise ValueError(f"pinned memory limit must be >= 1 MiB, got {pinned_mib!r}")
            args.append(f"--pinned-memory-limit={int(pinned_mib)}M")
        if len(args) > 4:
            self.run(args, timeout_s)

    def quit(self, timeout_s: float) -> None:
        """Stop the daemon on purpose (and its servers): v3 ``-q``, v2 ``quit`` on
        stdin (docs/reference/mps-nvml.md 1.2)."""
        if self.protocol >= 3:
            self.run(["-q"], timeout_s)
        else:
            self.v2("quit", timeout_s)

    def namespace_delete(self, name: str, server: str, timeout_s: float, force: bool = False) -> None:
        args = ["namespace", "delete", name, f"--server={server}"]
        if force:
            args.append("--force")
        self.run(args, timeout_s)

    def client_list(self, timeout_s: float) -> list[ClientRow]:
        # Same form as gpu-fractioning's mpsctl, measured on r615 (no --all).
        out = self.run(["client", "list", "--format=csv,noheader"], timeout_s)
        rows = []
        for r in _csv_rows(out, 4):
            pid = _int_or_none(r[0])
            if pid is None:
                continue
            rows.append(ClientRow(pid, r[1], r[2], r[3], ",".join(r[4:])))
        return rows

    def client_terminate(self, pid: int, timeout_s: float) -> None:
        """``client terminate <pid>``: blocks until the client's outstanding GPU work is gone."""
        self.run(["client", "terminate", str(int(pid))], timeout_s)

    # -- v2 ---------------------------------------------------------------------------

    def get_server_list(self, timeout_s: float) -> list[int]:
        return [int(x) for x in self.v2("get_server_list", timeout_s).split() if x.isdigit()]

    def get_client_list(self, server_pid: int, timeout_s: float) -> list[int]:
        return [int(x) for x in self.v2(f"get_client_list {int(server_pid)}", timeout_s).split() if x.isdigit()]

    def terminate_client(self, server_pid: int, client_pid: int, timeout_s: float) -> None:
        """v2 ``terminate_client <server> <client>``; the reply is ``0`` on success
        (CUDA_SUCCESS) or a CUDA error (docs/reference/mps-nvml.md 1.5)."""
        out = self.v2(f"terminate_client {int(server_pid)} {int(client_pid)}", timeout_s).strip()
        if out and out.split()[-1] != "0":
            raise MpsError(f"terminate_client {server_pid} {client_pid}: {out}", output=out)


def _check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise ValueError(f"MPS name {name!r} must match [a-z0-9_]{{1,64}}")


def _text(b: bytes | str | None) -> str:
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else b or ""


def set_exclusive_process(gpu_uuids: Iterable[str]) -> dict[str, str]:
    """Put each GPU in EXCLUSIVE_PROCESS compute mode through NVML, where permitted
    (docs/reference/mps-nvml.md section 2.4: the MPS server becomes the single arbiter).

    Returns ``{uuid: "ok" | "<error>"}``; never raises (no NVML, no permission
    and unsupported GPUs are reported, not fatal)."""
    result: dict[str, str] = {}
    uuids = list(gpu_uuids)
    try:
        import pynvml  # noqa: PLC0415

        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound etc.
        return {u: f"nvml unavailable: {e}" for u in uuids}
    try:
        for uuid in uuids:
            try:
                h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                if pynvml.nvmlDeviceGetComputeMode(h) != pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                    pynvml.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
                result[uuid] = "ok"
            except Exception as e:
                log.warning("cannot set EXCLUSIVE_PROCESS on %s: %s", uuid, e)
                result[uuid] = str(e) or type(e).__name__
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return result

