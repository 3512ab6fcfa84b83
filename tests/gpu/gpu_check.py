"""``make gpu-check``: what fracplugin says about the GPU, checked on a machine with a real NVIDIA GPU.

Run as root on the GPU machine, from the repo root, under any Python >= 3.11
(not the project's venv; e.g. the system ``python3``), with nothing
downloaded there: missing packages come from ``tests/gpu/wheels/`` (filled
here by ``make gpu-check-wheels``), unpacked into a temporary directory.
What it proves and how long it takes: ``docs/gpu-check.md``.

The steps (issue 17), each a step of the JSON report ``gpu-check.json``:

1. inventory through the real NVML path (``NvmlInventory``), printed: driver
   version, GPUs, the MPS protocol the daemon will choose;
2. the daemon with real NVML and the real ``nvidia-cuda-mps-control``
   (``--mps-root`` and ``--state-dir`` in a temporary directory; no compute
   mode change, no reset), ``/readyz`` awaited; the MPS control daemon is
   SIGKILLed once and must come back (restart, re-probe);
3. two containers planned through the NRI door on one GPU (time-slicing 2 GiB;
   sm-sharing 4 GiB, portion 0.25; one after the other, since a GPU takes one
   compute mode at a time); for each a CUDA client (``cuda_client.py``) runs
   with exactly the plan's env, container paths replaced by the host
   directories the mounts would bind; it allocates in 256 MiB steps until an
   allocation fails and reports what it got, the devices it sees, its SM
   count and whether it went through MPS;
4. one container with two client processes: what a container with several
   processes gets (the pinned limit is per client process, docs/reference/mps-nvml.md 2.8);
5. ``/metrics`` scraped while the clients hold memory: per-container used
   bytes against what they allocated (clients are put in a cgroup named like
   a containerd container so the daemon joins their PIDs to the container);
6. the sm-sharing client SIGKILLed; the next client of that container must
   still work (drain and wedge handling); the daemon stopped (SIGTERM); no MPS
   process or socket of ours may be left;
7. ``gpu-check.json`` written; exit 0 only when nothing failed, all within
   5 minutes (``DEADLINE_S``);
8. (issue 23 item 7; runs before the daemon stops, reported last) CUDA 13.4
   memory limits on a container's leaf cgroup: a container planned with
   request 1 GiB / limit 2 GiB; with the toolkit hook absent the daemon's
   ``--memory-limits`` (auto = apply) must have set them at StartContainer;
   with it present ``nvidia-cdi-hook apply-cuda-memory-limits`` is run on a
   second leaf as the runtime would; on each leaf ``nvmlDeviceGetMemoryLimits_v1``
   must read soft = request and hard = limit (bytes), ``nvidia-smi
   --query-gpu=memory.total`` and ``cuMemGetInfo`` run inside it must show the
   hard limit, an allocation past it must fail, and two processes in it
   together must stay under it. Needs driver r615+, cgroup v2 at the cgroup
   root, MIG off and NVML's memory-limit calls; else skipped with the reason.
9. (issue 35 item 6; after step 8, same needs) the field's cases, each
   figure a measurement recorded in the report: a worker that narrows
   ``CUDA_VISIBLE_DEVICES`` to one GPU of a two-GPU container (outside its
   cgroup: is the pinned limit lost? inside: the cgroup limit and
   ``cuMemGetInfo``; skipped on a node with fewer than 2 GPUs); the parents'
   soft-limit reservations (NVML on the parent, its ``dmem.min``) after a
   leaf is deleted before its Stop/Remove as containerd does, without the
   repair of ADR 0036 (then NVML set on the parent, the after-the-fact
   repair) and with it (the daemon's leaf watch); an allocation past a
   container's limit with its cgroup limit cleared (``--memory-limits off``
   for that container), and what the over-limit check
   (``GpuMemoryLimitExceeded``) reported in ``/metrics`` and the log.

A figure that cannot be measured on this driver (MPS v3 namespaces before
r615, say) is ``skipped`` with the reason, never ``pass``. Exit status: 0 all
passed or skipped, 1 a failure (or a setup problem: the line says which),
2 no NVIDIA GPU here (one line, nothing else done).

Concurrency: sequential on the main thread; the NRI runtime driver runs its
own I/O threads (``fracplugin_demo.nri_runtime``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WHEELS_DIR = HERE / "wheels"
CLIENT = HERE / "cuda_client.py"
MIB = 1 << 20
DEADLINE_S = 280.0  # the 5 minutes, less a margin for the report and cleanup
STEP_MIB = 256
TS_LIMIT_MIB = 2048
SM_LIMIT_MIB = 4096
SM_PORTION = "0.25"
SM_CHUNK = 8  # SMs per MPS chunk on Hopper and later (docs/reference/mps-nvml.md 1.5): ATP granularity slack
PIN_SLACK_MIB = 1024  # the pinned limit also counts the context's own allocations (docs/reference/mps-nvml.md 2.2)
METRIC_SLACK_MIB = 1024  # NVML's per-process figure includes the context
MPS_EXES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
MPS_SEARCH = ("/usr/bin", "/usr/local/nvidia/bin", "/usr/local/bin", "/usr/sbin")
PREFIX = "nvidia.com/container."
EXIT_OK, EXIT_FAIL, EXIT_NO_GPU = 0, 1, 2

STEPS: tuple[tuple[int, str], ...] = (
    (1, "inventory through real NVML"),
    (2, "daemon with real NVML and real MPS: ready, probed, restarted"),
    (3, "two planned containers: pinned limit, devices, MPS, active thread percentage"),
    (4, "one container, two processes"),
    (5, "per-container memory metrics"),
    (6, "SIGKILLed client, next client, clean stop"),
    (7, "report within 5 minutes"),
    (8, "CUDA memory limits on the container's cgroup, toolkit hook absent and present"),
    (9, "the field's cases: narrowed CUDA_VISIBLE_DEVICES, parents' reservations, over the limit"),
)
STATUSES = ("pass", "fail", "skipped")


# ---- the report ---------------------------------------------------------------------------
@dataclass
class Figure:
    """One measured figure: ``expected`` and ``observed`` are human-readable
    (observed also carries the raw value), ``status`` one of ``STATUSES``,
    ``reason`` why it failed or was skipped."""

    step: int
    name: str
    expected: str
    observed: Any
    status: str
    reason: str = ""


@dataclass
class Report:
    """The figures of one run, ordered by step (``STEPS``) whatever order they
    were measured in. ``step_status``: ``fail`` when any figure failed,
    ``pass`` when at least one passed and none failed, else ``skipped``."""

    started_at: float = field(default_factory=time.time)
    figures: list[Figure] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, step: int, name: str, expected: str, observed: Any, status: str, reason: str = "") -> Figure:
        """Record a figure. Raises ValueError for an unknown step or status."""
        if step not in dict(STEPS):
            raise ValueError(f"step {step!r} is not one of {[s for s, _ in STEPS]}")
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        f = Figure(step, name, expected, observed, status, reason)
        self.figures.append(f)
        mark = {"pass": "ok  ", "fail": "FAIL", "skipped": "skip"}[status]
        print(f"  [{mark}] step {step} {name}: observed {_short(observed)}; expected {expected}"
              + (f" ({reason})" if reason else ""), flush=True)
        return f

    def check(self, step: int, name: str, expected: str, observed: Any, ok: bool, reason_if_not: str = "") -> Figure:
        """``add`` with pass/fail decided by ``ok``."""
        return self.add(step, name, expected, observed, "pass" if ok else "fail", "" if ok else reason_if_not)

    def skip(self, step: int, name: str, expected: str, reason: str, observed: Any = None) -> Figure:
        """``add`` a ``skipped`` figure with the reason it could not be measured."""
        return self.add(step, name, expected, observed, "skipped", reason)

    def step_status(self, step: int) -> str:
        """``fail``, ``pass`` or ``skipped`` for one step (see the class docstring)."""
        st = [f.status for f in self.figures if f.step == step]
        if "fail" in st:
            return "fail"
        return "pass" if "pass" in st else "skipped"

    def failed(self) -> bool:
        """Whether any figure failed."""
        return any(f.status == "fail" for f in self.figures)

    def exit_code(self) -> int:
        """1 when any figure failed, else 0."""
        return EXIT_FAIL if self.failed() else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        """The ``gpu-check.json`` document: ``{"result", "started_at", "facts", "steps": [{"step", "title",
        "status", "figures": [Figure...]}]}``."""
        steps = []
        for n, title in STEPS:
            figs = [asdict(f) for f in self.figures if f.step == n]
            for f in figs:
                del f["step"]
            steps.append({"step": n, "title": title, "status": self.step_status(n), "figures": figs})
        return {"result": "fail" if self.failed() else "pass", "started_at": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at)), "facts": self.facts, "steps": steps}

    def write(self, path: Path) -> None:
        """Write the JSON document atomically (temp file, fsync, rename)."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _short(v: Any) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= 160 else s[:157] + "..."


# ---- bootstrap: carried wheels, GPU detection ----------------------------------------------
def wheel_fits(filename: str, version: tuple[int, int] = sys.version_info[:2], machine: str = "x86_64") -> bool:
    """Whether a wheel file can be unpacked and imported by this interpreter:
    pure (``py3-none-any``), or CPython ``cpXY`` / ``abi3`` (XY <= this
    version) for Linux on ``machine`` (PEP 425 tags from the file name)."""
    parts = filename[:-4].split("-") if filename.endswith(".whl") else []
    if len(parts) < 5:
        return False
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    if plat == "any":
        return any(t in ("py3", f"py{version[0]}{version[1]}") or t.startswith("py3") for t in py.split("."))
    if not any(p.endswith(machine) and p.startswith(("manylinux", "linux")) for p in plat.split(".")):
        return False
    this = f"cp{version[0]}{version[1]}"
    if abi == "abi3":
        return any(t.startswith("cp3") and int(t[3:] or 0) <= version[1] for t in py.split("."))
    return this in py.split(".") and abi in (this, "none")


def unpack_wheels(wheels: Path, dest: Path) -> list[str]:
    """Unpack every fitting wheel of ``wheels`` into ``dest`` (a site directory
    put first on the path): a wheel is a zip of its import tree (PEP 427), so
    no pip is needed on the GPU machine. Of several versions of one project the
    highest file name wins. Returns the wheels used (file names)."""
    if not wheels.is_dir():
        return []
    best: dict[str, Path] = {}
    for w in sorted(wheels.glob("*.whl")):
        if not wheel_fits(w.name):
            continue
        best[w.name.split("-")[0].lower()] = w  # sorted: the last (highest) version of a project wins
    dest.mkdir(parents=True, exist_ok=True)
    for w in best.values():
        with zipfile.ZipFile(w) as z:
            z.extractall(dest)
    return sorted(w.name for w in best.values())


def detect_gpu(lib: str = "libnvidia-ml.so.1") -> tuple[bool, str]:
    """Whether this machine has an NVIDIA GPU NVML can see, through ctypes
    (no package needed): ``(True, "<n> GPU(s)")`` or ``(False, reason)``."""
    try:
        nvml = ctypes.CDLL(lib)
    except OSError as exc:
        return False, f"{lib} cannot be loaded ({exc}): no NVIDIA driver"
    try:
        rc = nvml.nvmlInit_v2()
        if rc != 0:
            return False, f"nvmlInit_v2 returned {rc}: the NVIDIA driver is not usable"
        n = ctypes.c_uint()
        rc = nvml.nvmlDeviceGetCount_v2(ctypes.byref(n))
        nvml.nvmlShutdown()
    except AttributeError as exc:
        return False, f"{lib} lacks NVML entry points ({exc})"
    if rc != 0 or n.value == 0:
        return False, f"NVML sees no GPU (nvmlDeviceGetCount_v2 returned {rc}, count {n.value})"
    return True, f"{n.value} GPU(s)"


def find_mps_binary(explicit: str | None = None) -> str | None:
    """``nvidia-cuda-mps-control``: ``explicit``, else on PATH, else in the
    usual driver directories (``MPS_SEARCH``); None when not found."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which(MPS_EXES[0])
    if found:
        return found
    for d in MPS_SEARCH:
        p = os.path.join(d, MPS_EXES[0])
        if os.access(p, os.X_OK):
            return p
    return None


# ---- what the client gets: env from the plan ---------------------------------------------------
def host_path(path: str, mounts: Sequence[tuple[str, str]]) -> str | None:
    """The host path a container path resolves to through ``mounts``
    (``(source, destination)`` pairs; the deepest destination wins); None
    when no mount covers it."""
    best: tuple[int, str] | None = None
    for src, dst in mounts:
        d = dst.rstrip("/") or "/"
        if path == d or path.startswith(d + "/"):
            if best is None or len(d) > best[0]:
                best = (len(d), src.rstrip("/") + path[len(d):])
    return best[1] if best else None


def client_env(plan_env: Mapping[str, str], mounts: Sequence[tuple[str, str]], base: Mapping[str, str],
               gpu_count: int) -> tuple[dict[str, str], list[str]]:
    """The env of a CUDA client standing in for the planned container.

    ``base`` (the check's own env, less every ``CUDA_*``, ``NVIDIA_*`` and
    ``PYTHON*`` key) plus exactly ``plan_env``, where
    ``CUDA_MPS_PIPE_DIRECTORY`` (a container path) becomes the host directory
    its mount binds. When the plan has no ``CUDA_VISIBLE_DEVICES``, the
    client's is set from ``NVIDIA_VISIBLE_DEVICES``, standing in for the
    container toolkit, which shows a container only its GPUs (only when the
    node has more GPUs than the plan names). Returns ``(env, notes)``.
    Raises ValueError when the pipe directory has no mount (the plan would
    connect the container to no MPS daemon)."""
    env = {k: v for k, v in base.items() if not k.startswith(("CUDA_", "NVIDIA_", "PYTHON"))}
    env.update(plan_env)
    notes: list[str] = []
    pipe = plan_env.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe:
        hp = host_path(pipe, mounts)
        if hp is None:
            raise ValueError(f"CUDA_MPS_PIPE_DIRECTORY={pipe} is not under any mount of the plan {list(mounts)}")
        env["CUDA_MPS_PIPE_DIRECTORY"] = hp
        notes.append(f"CUDA_MPS_PIPE_DIRECTORY {pipe} -> host {hp} (the plan's bind mount)")
    visible = [d for d in plan_env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if d]
    if "CUDA_VISIBLE_DEVICES" not in plan_env and visible and len(visible) < gpu_count:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        notes.append("CUDA_VISIBLE_DEVICES set from NVIDIA_VISIBLE_DEVICES (the container toolkit's job)")
    return env, notes


# ---- judgements (pure) -----------------------------------------------------------------------
def judge_pinned(allocated_mib: int, limit_mib: int, stopped_by: str, step_mib: int = STEP_MIB) -> tuple[bool, str, str]:
    """A client under a pinned limit: it must stop on an allocation error
    with ``limit - PIN_SLACK_MIB < allocated <= limit`` (the context counts
    against the limit; 256 MiB steps). Returns ``(ok, expected, reason)``."""
    expected = f"allocation fails; {limit_mib - PIN_SLACK_MIB} < allocated MiB <= {limit_mib}"
    if stopped_by != "error":
        return False, expected, f"no allocation failed up to {allocated_mib} MiB: the limit is not enforced"
    if allocated_mib > limit_mib:
        return False, expected, f"allocated {allocated_mib} MiB, above the {limit_mib} MiB limit"
    if allocated_mib <= limit_mib - PIN_SLACK_MIB:
        return False, expected, f"only {allocated_mib} MiB before the first failure: far below the limit"
    return True, expected, ""


def judge_atp(sm_ctx: int | None, sm_total: int | None, atp: int | None) -> tuple[str, str, str]:
    """The SMs a context may use (``cuCtxGetExecAffinity``) against the
    active thread percentage: with ``atp``, ``0 < sm_ctx < sm_total`` and
    ``sm_ctx <= ceil(sm_total * atp / 100) + SM_CHUNK``; without, all SMs.
    Returns ``(status, expected, reason)``; skipped when unmeasured."""
    if sm_ctx is None or not sm_total:
        return "skipped", "SM count of the context", "cuCtxGetExecAffinity(SM_COUNT) not available on this driver"
    if atp is None:
        exp = f"all {sm_total} SMs (no active thread percentage)"
        return ("pass", exp, "") if sm_ctx == sm_total else ("fail", exp, f"context limited to {sm_ctx} SMs")
    hi = math.ceil(sm_total * atp / 100) + SM_CHUNK
    exp = f"0 < SMs < {sm_total} and SMs <= {hi} (ATP {atp}% of {sm_total}, one {SM_CHUNK}-SM chunk of slack)"
    if 0 < sm_ctx < sm_total and sm_ctx <= hi:
        return "pass", exp, ""
    return "fail", exp, f"context may use {sm_ctx} of {sm_total} SMs: the active thread percentage is not applied"


def judge_devices(seen: int, assigned: int, node_gpus: int, has_cvd: bool) -> tuple[str, str, str]:
    """The number of devices a client sees: exactly ``assigned``. Skipped when
    the node has more GPUs than assigned and nothing but a container could hide
    them (no ``CUDA_VISIBLE_DEVICES``)."""
    exp = f"{assigned} device(s)"
    if seen == assigned:
        return "pass", exp, ""
    if node_gpus > assigned and not has_cvd:
        return "skipped", exp, "outside a container only the toolkit hides GPUs; the plan has no CUDA_VISIBLE_DEVICES"
    return "fail", exp, f"the client sees {seen} device(s)"


def judge_through_mps(attr: int | None, pid: int | None, clients: list[int] | None) -> tuple[bool, str]:
    """Whether a client went through MPS: the driver says its contexts are
    shared via MPS (``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``, ``None`` = attribute
    unknown before CUDA 12.4: not counted) and the control daemon lists its PID
    (an unreadable list fails too: the drain path reads the same list).
    Returns ``(ok, reason)``."""
    if attr == 0:
        return False, "CUDA says this context is not shared via MPS: the pipe directory was not reached"
    if clients is None:
        return False, "the control daemon's client list could not be read"
    if pid not in clients:
        return False, f"PID {pid} is not among the control daemon's clients {clients}"
    return True, ""


def mps_namespace_skip(protocol: int) -> str:
    """Why per-container MPS namespaces cannot be checked (``""`` when they can):
    they exist only in MPS v3 (driver r615+, docs/reference/mps-nvml.md 1.6, 3)."""
    return "" if protocol >= 3 else (f"MPS protocol {protocol}: per-container namespaces need MPS v3 (driver r615+); "
                                     "sm-sharing containers share the daemon's pipe directory here")


def used_bytes(metrics_text: str, pod_uid: str, container: str) -> int | None:
    """Sum of ``fracplugin_container_gpu_memory_used_bytes`` for one
    container (all its GPUs) in a Prometheus text exposition; None when the
    container has no such series."""
    total, seen = 0.0, False
    pat = re.compile(r'^fracplugin_container_gpu_memory_used_bytes\{(?P<labels>[^}]*)\}\s+(?P<v>\S+)')
    for line in metrics_text.splitlines():
        m = pat.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group("labels")))
        if labels.get("pod_uid") == pod_uid and labels.get("container") == container:
            total += float(m.group("v"))
            seen = True
    return int(total) if seen else None


def judge_metric(used: int | None, allocated_mib: int) -> tuple[str, str, str]:
    """Per-container used bytes against what its processes allocated:
    ``allocated <= used <= allocated + METRIC_SLACK_MIB`` (contexts count)."""
    exp = f"{allocated_mib} MiB <= used <= {allocated_mib + METRIC_SLACK_MIB} MiB"
    if used is None:
        return "fail", exp, "no fracplugin_container_gpu_memory_used_bytes series for the container"
    mib = used / MIB
    if allocated_mib <= mib <= allocated_mib + METRIC_SLACK_MIB:
        return "pass", exp, ""
    return "fail", exp, f"used {mib:.0f} MiB"


def pod_manifest(name: str, mode: str, limit_mib: int, gpu_uuid: str, portion: str | None = None,
                 request_mib: int | None = None) -> dict[str, Any]:
    """A one-container pod (container ``app``) asking for ``limit_mib`` on
    ``gpu_uuid`` in ``mode`` (the annotation contract, README); the request is
    ``request_mib`` (default: the limit)."""
    ann = {f"{PREFIX}app.gpu-memory.limit": f"{limit_mib}Mi", f"{PREFIX}app.gpu-compute.mode": mode,
           f"{PREFIX}app.gpus.devices": gpu_uuid}
    if request_mib is not None:
        ann[f"{PREFIX}app.gpu-memory.request"] = f"{request_mib}Mi"
    if portion is not None:
        ann[f"{PREFIX}app.gpu-compute.portion"] = portion
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "fracplugin-gpu-check", "uid": str(uuid.uuid4()),
                         "annotations": ann},
            "spec": {"containers": [{"name": "app", "image": "gpu-check"}]}}


# ---- processes on this machine ----------------------------------------------------------------
def mps_pids(proc: str = "/proc") -> set[int]:
    """PIDs whose ``exe`` basename is an MPS binary (not ``comm``: truncated, docs/reference/mps-nvml.md 1.2)."""
    out = set()
    for p in Path(proc).iterdir():
        if p.name.isdigit():
            try:
                if os.path.basename(os.readlink(p / "exe")).split(" ")[0] in MPS_EXES:
                    out.add(int(p.name))
            except OSError:
                continue
    return out


def foreign_mps(pid: int, work: Path, proc: str = "/proc") -> bool:
    """True when MPS process ``pid`` belongs to another MPS root: its
    environment sets ``CUDA_MPS_PIPE_DIRECTORY`` to a directory outside
    ``work`` (another checkout's or node agent's fake or daemon, started while
    the check ran). A process without that variable, or whose environment
    cannot be read, is not known to be foreign (False): it is counted."""
    try:
        env = (Path(proc) / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    for kv in env:
        if kv.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
            pipe = kv.split(b"=", 1)[1].decode(errors="replace")
            return not (pipe == str(work) or pipe.startswith(str(work).rstrip("/") + "/"))
    return False


def new_mps_pids(before: set[int], work: Path, proc: str = "/proc") -> set[int]:
    """MPS processes (``mps_pids``) that were not there ``before`` and are not
    another MPS root's (``foreign_mps``): what this check's daemon may have left."""
    return {pid for pid in mps_pids(proc) - before if not foreign_mps(pid, work, proc)}


def own_leftovers(work: Path, proc: str = "/proc") -> list[str]:
    """Live processes whose command line or environment names ``work`` (the
    daemon and every MPS process it started get their paths there), as
    ``"<pid>: <command line>"``; zombies and this process are left out."""
    needle, me, left = str(work).encode(), os.getpid(), []
    for p in Path(proc).iterdir():
        if not p.name.isdigit() or int(p.name) == me:
            continue
        try:
            if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (p / "cmdline").read_bytes()
            env = (p / "environ").read_bytes()
        except (OSError, IndexError):
            continue
        if needle in cmd or needle in env:
            shown = cmd.replace(b"\0", b" ").decode(errors="replace")[:120]
            left.append(f"{p.name}: {shown}")
    return left


def compute_modes() -> dict[str, int] | None:
    """Every GPU's compute mode through NVML (``{uuid: mode}``; 0 DEFAULT,
    2 PROHIBITED, 3 EXCLUSIVE_PROCESS, docs/reference/mps-nvml.md 2.4); None when NVML fails.
    The check must leave them as it found them (no ``--exclusive-process``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            out = {}
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                u = pynvml.nvmlDeviceGetUUID(h)
                out[u.decode() if isinstance(u, bytes) else str(u)] = int(pynvml.nvmlDeviceGetComputeMode(h))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def _http(address: str, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def wait_until(pred: Callable[[], Any], timeout_s: float, step_s: float = 0.1) -> Any:
    """Poll ``pred()`` every ``step_s`` seconds until it is truthy or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(step_s)


class Daemon:
    """``fracplugin run`` as a child process (its own session), every path in ``work``.

    Real NVML unless ``simulate_node``; ``mps_binary`` the control binary.
    ``python`` and ``pythonpath`` say how to run it (the GPU machine's python,
    ``src`` + the unpacked wheels)."""

    def __init__(self, work: Path, python: str, pythonpath: Sequence[str], mps_binary: str,
                 simulate_node: str | None = None, cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.cgroup_root = cgroup_root
        self.work = work
        self.python = python
        self.pythonpath = list(pythonpath)
        self.mps_binary = mps_binary
        self.simulate_node = simulate_node
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoints: dict[str, str] = {}
        self.log_path = work / "daemon.log"
        self.nri_socket = work / "nri.sock"

    def command(self) -> list[str]:
        """The ``fracplugin run`` command line: NRI door on, device plugin off (no kubelet), ephemeral ports."""
        w = self.work
        cmd = [self.python, "-m", "fracplugin.cli", "run", "--state-dir", str(w / "state"),
               "--mps-root", str(w / "mps"), "--mps-control-binary", self.mps_binary,
               "--nri-socket", str(self.nri_socket), "--no-device-plugin",
               "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
               "--log-format", "json", "--shutdown-timeout", "20", "--cgroup-root", self.cgroup_root]
        if self.simulate_node:
            cmd += ["--simulate-node", self.simulate_node]
        return cmd

    def start(self, timeout_s: float) -> None:
        """Start it and wait for ``endpoints.json``. Raises RuntimeError when it exits or never writes it."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FRACPLUGIN_", "CUDA_MPS_"))}
        env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        from fracplugin_demo.subproc import die_with_parent

        with open(self.log_path, "wb") as log:  # no preexec_fn: see fracplugin_demo.subproc
            self.proc = subprocess.Popen(die_with_parent(self.command()), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        ep = self.work / "state" / "endpoints.json"
        if not wait_until(lambda: ep.exists() or self.proc.poll() is not None, timeout_s):  # type: ignore[union-attr]
            raise RuntimeError(f"the daemon wrote no {ep} within {timeout_s:.0f} s")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited at start with status {self.proc.returncode}: {self.log_tail(8)}")
        self.endpoints = wait_until(lambda: _read_json(ep), 5.0) or {}

    def get(self, path: str) -> tuple[int, Any]:
        """GET ``path`` on the health port: ``(status, JSON or text)``; status 0 when unreachable."""
        code, body = _http(self.endpoints.get("health", "127.0.0.1:1"), path)
        try:
            return code, json.loads(body)
        except ValueError:
            return code, body

    def metrics(self) -> str:
        """The ``/metrics`` exposition text (an error text when unreachable)."""
        return _http(self.endpoints.get("metrics", "127.0.0.1:1"), "/metrics")[1]

    def mps_daemons(self) -> dict[str, dict[str, Any]]:
        """``/status`` MPS daemons by mode (``{}`` when unreadable)."""
        code, doc = self.get("/status")
        if code != 200 or not isinstance(doc, dict):
            return {}
        return {d.get("mode"): d for d in (doc.get("mps") or {}).get("daemons") or []}

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait; SIGKILL the process group after ``timeout_s``. Returns the exit status (None: killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
            return None

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the daemon's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Planned:
    """One container planned through the NRI door: the NRI messages, the
    plan's env (effective, as the container would have it) and mounts
    (``(host source, container destination)``)."""

    manifest: dict[str, Any]
    pod: Any
    ctr: Any
    env: dict[str, str]
    mounts: list[tuple[str, str]]

    @property
    def pod_uid(self) -> str:
        return self.manifest["metadata"]["uid"]

    @property
    def container_id(self) -> str:
        return self.ctr.id


class Nri:
    """Acts as containerd towards the daemon's NRI plugin (``NriRuntimeServer``)."""

    def __init__(self, socket_path: Path, request_timeout_s: float = 10.0) -> None:
        from fracplugin_demo.nri_runtime import NriRuntimeServer

        self.server = NriRuntimeServer(str(socket_path), request_timeout_s=request_timeout_s,
                                       runtime_name="fracplugin-gpu-check").start()

    def create(self, manifest: dict[str, Any], container_id: str = "", cgroups_path: str = "") -> Planned:
        """RunPodSandbox, CreateContainer, StartContainer (the plugin holds
        StartContainer while an sm-sharing namespace is being made, within a
        budget; a namespace still being made comes after the start, ADR 0028,
        so its ``control`` socket in the pipe directory is awaited here, up to
        60 s, before a CUDA client may run: one started earlier would run
        without MPS). Raises
        RpcError when the plugin refuses. ``cgroups_path``: the container's
        ``linux.cgroups_path`` as the runtime sends it (cgroupfs form
        ``/<dir>/<leaf>``), so the daemon can find its leaf cgroup."""
        from fracplugin_demo.nri_runtime import container_msg, effective_env, pod_sandbox

        pod = pod_sandbox(manifest)
        ctr = container_msg(pod, manifest["spec"]["containers"][0], container_id=container_id or secrets.token_hex(32))
        if cgroups_path:
            ctr.linux.cgroups_path = cgroups_path
        self.server.run_pod_sandbox(pod)
        resp = self.server.create_container(pod, ctr)
        self.server.start_container(pod, ctr)
        env = effective_env(ctr, resp.adjust)
        mounts = [(m.source, m.destination) for m in resp.adjust.mounts]
        pipes = [src for src, dest in mounts if dest == "/tmp/nvidia-mps"]  # layout.CONTAINER_PIPE_DIR
        deadline = time.monotonic() + 60
        while pipes and not any(os.path.exists(os.path.join(p_, "control")) for p_ in pipes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the MPS namespace in {pipes} did not appear within 60 s of StartContainer")
            time.sleep(0.01)
        return Planned(manifest, pod, ctr, env, mounts)

    def remove(self, p: Planned) -> None:
        """StopContainer (the daemon drains the container's MPS clients), RemoveContainer, RemovePodSandbox."""
        self.server.stop_container(p.pod, p.ctr)
        self.server.remove_container(p.pod, p.ctr)
        self.server.remove_pod_sandbox(p.pod)

    def close(self) -> None:
        """Close the runtime side (the plugin connection and the socket)."""
        self.server.close()


class Cgroups:
    """Client cgroups named as containerd names a container's
    (``<base>/cri-containerd-<64 hex>.scope``), so the daemon's
    ``/proc/<pid>/cgroup`` join sees the client as that container.
    cgroup v2 at ``/sys/fs/cgroup``, else v1's ``name=systemd`` hierarchy;
    ``reason`` says why neither can be used."""

    def __init__(self, root: str = "/sys/fs/cgroup") -> None:
        self.base: Path | None = None
        self.reason = ""
        self.made: list[Path] = []
        cands = [Path(root)] if os.path.exists(os.path.join(root, "cgroup.controllers")) else []
        cands.append(Path(root) / "systemd")
        for c in cands:
            b = c / f"fracplugin-gpu-check-{os.getpid()}"
            try:
                b.mkdir()
            except OSError as exc:
                self.reason += f"{b}: {exc}; "
                continue
            self.base = b
            return
        self.reason = self.reason or "no writable cgroup hierarchy"

    def for_container(self, container_id: str) -> str:
        """A leaf for ``container_id`` (``""`` when cgroups are unusable)."""
        if self.base is None:
            return ""
        leaf = self.base / f"cri-containerd-{container_id}.scope"
        try:
            leaf.mkdir(exist_ok=True)
        except OSError as exc:
            self.reason = f"{leaf}: {exc}"
            return ""
        self.made.append(leaf)
        return str(leaf)

    def cleanup(self) -> None:
        """Remove the leaves, then the base (retrying while exiting processes leave them)."""
        for p in list(reversed(self.made)) + ([self.base] if self.base else []):
            for _ in range(20):
                try:
                    p.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # processes still leaving


class Client:
    """One ``cuda_client.py`` process with a given env; ``report`` its JSON line."""

    def __init__(self, python: str, env: Mapping[str, str], cap_mib: int, cgroup: str = "",
                 step_mib: int = STEP_MIB, lib: str = "libcuda.so.1") -> None:
        cmd = [python, str(CLIENT), "--step-mib", str(step_mib), "--cap-mib", str(cap_mib), "--lib", lib]
        if cgroup:
            cmd += ["--cgroup", cgroup]
        from fracplugin_demo.subproc import die_with_parent  # exec wrapper: the PID stays the client's

        self.proc = subprocess.Popen(die_with_parent(cmd), env=dict(env), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.report: dict[str, Any] | None = None

    def wait_report(self, timeout_s: float) -> dict[str, Any]:
        """The client's JSON line; on a timeout or a client that died the dict
        carries ``ok: False`` and the reason (the client is killed then)."""
        import selectors

        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(max(0.1, timeout_s))
        sel.close()
        line = self.proc.stdout.readline() if ready else b""
        try:
            self.report = json.loads(line) if line else None
        except ValueError:
            self.report = None
        if self.report is None:
            self.kill()
            err = self.proc.stderr.read().decode(errors="replace")[-400:] if self.proc.stderr else ""
            why = "no report within %.0f s (hung in CUDA init?)" % timeout_s if not ready else "no JSON line"
            self.report = {"ok": False, "error": f"{why}; exit {self.proc.returncode}; {err.strip()}",
                           "pid": self.proc.pid}
        return self.report

    def release(self, timeout_s: float = 30.0) -> int | None:
        """Tell it to free and exit; kill it after ``timeout_s``. Returns the exit status."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"release\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the client (if alive) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def mps_client_pids(binary: str, pipe_dir: str, protocol: int, timeout_s: float = 5.0) -> list[int] | None:
    """The client PIDs the control daemon at ``pipe_dir`` knows (v3 ``client
    list``; v2 ``get_server_list`` + ``get_client_list``); None when it cannot be asked."""
    from fracplugin.mps.api import MpsError
    from fracplugin.mps.control import MpsControl

    c = MpsControl(binary, pipe_dir, protocol)
    try:
        if protocol >= 3:
            return [r.pid for r in c.client_list(timeout_s)]
        return [p for s in c.get_server_list(timeout_s) for p in c.get_client_list(s, timeout_s)]
    except MpsError:
        return None


# ---- step 8: CUDA memory limits (issue 23 item 7) ----------------------------------------------
ML_REQUEST_MIB = 1024
ML_LIMIT_MIB = 2048
ML_SLACK_MIB = 1  # nvidia-smi and cuMemGetInfo report MiB (rounded)
ML_DRIVER = 615  # CUDA 13.4 memory partitioning: driver r615+ (docs/reference/mps-nvml.md, "MPS v3 Memory Partitioning")
NVML_DEVICE_MEMORY_LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # "no hard limit" (docs/reference/mps-nvml.md 4.4)
HOOK_BINARY = "nvidia-cdi-hook"
HOOK_SEARCH = ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/toolkit", "/usr/local/nvidia/bin")


def memory_limits_skip(driver_version: str, cgroup_root: str, mig_enabled: bool, nvml_has_limits: bool) -> str:
    """Why CUDA memory limits cannot be proven on this machine, or "" when
    they can: driver below r615, no cgroup v2 at ``cgroup_root`` (its
    ``cgroup.controllers``), a MIG GPU, or NVML without
    ``nvmlDeviceGetMemoryLimits_v1`` (docs/reference/enforcement-cdi-dra.md)."""
    try:
        major = int(driver_version.split(".")[0])
    except ValueError:
        return f"driver version {driver_version!r} cannot be read"
    if major < ML_DRIVER:
        return f"driver {driver_version} < r{ML_DRIVER}: no CUDA memory partitioning (CUDA 13.4)"
    if not os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")):
        return f"no cgroup v2 at {cgroup_root} (cgroup v1 or hybrid): memory limits need cgroup v2"
    if mig_enabled:
        return "the GPU is in MIG mode: NVML memory limits reject MIG handles"
    if not nvml_has_limits:
        return "NVML lacks nvmlDeviceGetMemoryLimits_v1 (driver library or nvidia-ml-py too old)"
    return ""


def judge_limits(read: tuple[int, int] | None, request_mib: int, limit_mib: int) -> tuple[bool, str, str]:
    """``(ok, expected, reason)`` for NVML's ``(softLimit, hardLimit)`` bytes
    on a leaf against the plan: soft = request, hard = limit (bytes)."""
    exp = f"soft {request_mib * MIB} B ({request_mib} MiB), hard {limit_mib * MIB} B ({limit_mib} MiB)"
    if read is None:
        return False, exp, "not read"
    soft, hard = read
    if (soft, hard) == (request_mib * MIB, limit_mib * MIB):
        return True, exp, ""
    if soft == 0 and hard == NVML_DEVICE_MEMORY_LIMIT_MAX:
        return False, exp, "no limit set on the cgroup"
    return False, exp, f"soft {soft} B, hard {hard} B"


def judge_total(total_mib: float | None, hard_mib: int, what: str) -> tuple[bool, str, str]:
    """``(ok, expected, reason)``: ``what`` (nvidia-smi memory.total, cuMemGetInfo total) inside the cgroup is the hard limit."""
    exp = f"{hard_mib} MiB (+-{ML_SLACK_MIB}): the hard limit, not the GPU's memory"
    if total_mib is None:
        return False, exp, f"{what} not read"
    if abs(total_mib - hard_mib) <= ML_SLACK_MIB:
        return True, exp, ""
    return False, exp, f"{what} shows {total_mib} MiB"


def judge_capped(allocated_mib: Sequence[int], stopped_by: Sequence[str], hard_mib: int) -> tuple[bool, str, str]:
    """``(ok, expected, reason)``: processes of one cgroup together stay at or
    under the hard limit and each one's next allocation failed (not the
    client's own cap)."""
    total = sum(allocated_mib)
    exp = f"together <= {hard_mib} MiB, the next allocation fails (CUDA_ERROR_OUT_OF_MEMORY)"
    if any(s != "error" for s in stopped_by):
        return False, exp, f"a process stopped at its own cap, not at an allocation failure: {list(stopped_by)}"
    if total > hard_mib:
        return False, exp, f"together {total} MiB, past the hard limit"
    return True, exp, ""


def find_hook_binary() -> str | None:
    """The toolkit's ``nvidia-cdi-hook`` (PATH, then ``HOOK_SEARCH``), or None."""
    found = shutil.which(HOOK_BINARY)
    if found:
        return found
    for d in HOOK_SEARCH:
        p = os.path.join(d, HOOK_BINARY)
        if os.access(p, os.X_OK):
            return p
    return None


class NvmlLimits:
    """``nvmlDeviceGet/SetMemoryLimits_v1`` on one GPU through nvidia-ml-py
    (structs ``c_nvmlGetMemoryLimits_v1_t`` / ``c_nvmlSetMemoryLimits_v1_t``,
    ``nameSpace`` = the cgroup directory as bytes; docs/reference/mps-nvml.md 4.4). Raises
    the library's NVMLError."""

    def __init__(self, uuid_: str) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid_.encode() if isinstance(uuid_, str) else uuid_)

    @staticmethod
    def available() -> bool:
        try:
            import pynvml

            return hasattr(pynvml, "nvmlDeviceGetMemoryLimits_v1") and hasattr(pynvml, "c_nvmlGetMemoryLimits_v1_t")
        except Exception:
            return False

    def get(self, cgroup: str) -> tuple[int, int]:
        """(softLimit, hardLimit) bytes on ``cgroup``."""
        st = self.nv.c_nvmlGetMemoryLimits_v1_t()
        st.nameSpace = cgroup.encode()
        self.nv.nvmlDeviceGetMemoryLimits_v1(self.handle, st)
        return int(st.softLimit), int(st.hardLimit)

    def set(self, cgroup: str, soft: int, hard: int) -> None:
        st = self.nv.c_nvmlSetMemoryLimits_v1_t()
        st.nameSpace = cgroup.encode()
        st.softLimit, st.hardLimit = soft, hard
        self.nv.nvmlDeviceSetMemoryLimits_v1(self.handle, st)

    def clear(self, cgroup: str) -> None:
        """Soft 0 first, then no hard limit (a deleted leaf keeps its
        ancestors' dmem.min otherwise; docs/reference/enforcement-cdi-dra.md)."""
        self.set(cgroup, 0, NVML_DEVICE_MEMORY_LIMIT_MAX)

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


def smi_total_in(cgroup: str, gpu_uuid: str, timeout_s: float = 30.0) -> tuple[float | None, str]:
    """``nvidia-smi --query-gpu=memory.total`` run inside ``cgroup`` (the shell
    moves itself there, then execs nvidia-smi): (MiB, "") or (None, why)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "nvidia-smi not found"
    script = f'echo $$ > "$1/cgroup.procs" && exec "$2" --query-gpu=memory.total --format=csv,noheader,nounits -i "$3"'
    try:
        out = subprocess.run(["sh", "-c", script, "sh", cgroup, smi, gpu_uuid], capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi did not answer within {timeout_s:.0f} s"
    if out.returncode != 0:
        return None, f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
    try:
        return float(out.stdout.strip().splitlines()[0]), ""
    except (ValueError, IndexError):
        return None, f"unreadable output {out.stdout.strip()[:100]!r}"


def run_limits_hook(binary: str, cgroup: str, gpu_uuid: str, env: Mapping[str, str], work: Path,
                    timeout_s: float = 30.0) -> tuple[int, str]:
    """Run ``nvidia-cdi-hook apply-cuda-memory-limits`` as the runtime runs a
    createRuntime hook for a container whose process sits in ``cgroup``: a
    holder process is put in the leaf, an OCI bundle whose ``config.json``
    carries ``env`` (``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT``) is written, and
    the OCI state (``pid``, ``bundle``) goes to the hook's stdin (inference
    from docs/reference/enforcement-cdi-dra.md: the hook reads the env from the spec and the
    cgroup from the container PID). Returns (exit status, output)."""
    bundle = work / f"bundle-{secrets.token_hex(4)}"
    bundle.mkdir()
    holder = subprocess.Popen(["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec sleep 60', "sh", cgroup],
                              start_new_session=True)
    try:
        wait_until(lambda: str(holder.pid) in Path(cgroup, "cgroup.procs").read_text().split(), 5.0, 0.05)
        (bundle / "config.json").write_text(json.dumps({
            "ociVersion": "1.2.0", "root": {"path": "/"},
            "process": {"args": ["sleep"], "cwd": "/", "env": [f"{k}={v}" for k, v in env.items()]},
            "linux": {"cgroupsPath": cgroup}}))
        state = json.dumps({"ociVersion": "1.2.0", "id": bundle.name, "status": "creating", "pid": holder.pid,
                            "bundle": str(bundle)})
        out = subprocess.run([binary, "apply-cuda-memory-limits", "--driver-root", "/", "--gpu-id", gpu_uuid],
                             input=state, capture_output=True, text=True, timeout=timeout_s)
        return out.returncode, (out.stdout + out.stderr).strip()[-400:]
    finally:
        holder.kill()
        holder.wait(10)
        shutil.rmtree(bundle, ignore_errors=True)


# ---- step 9: the field's cases (issue 35 item 6) ---------------------------------------------------
RES_SOFT_MIB = 64  # the soft limit left on purpose on a deleted leaf (a measurement; gone at the next driver load)
OVER_LIMIT_MIB = 1024
OVER_LIMIT_EVENT = "GpuMemoryLimitExceeded"  # issue 35 item 3's Event reason


def read_reservation(get_soft: Callable[[str], int], cgroup: str, region: str) -> dict[str, Any]:
    """What a parent cgroup shows of the soft limits below it: NVML's
    softLimit on it (or the error) and its ``dmem.min`` line for ``region``
    (None where the kernel has no dmem files: the driver's misc backend)."""
    out: dict[str, Any] = {"cgroup": cgroup, "dmem_min": None}
    try:
        out["nvml_soft"] = get_soft(cgroup)
    except Exception as exc:
        out["nvml_soft"], out["nvml_error"] = None, f"{type(exc).__name__}: {exc}"
    try:
        for line in Path(cgroup, "dmem.min").read_text().splitlines():
            if line.split()[:1] == [region]:
                out["dmem_min"] = line.split()[1]
    except (OSError, IndexError):
        pass
    return out


def leftover(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per parent: NVML soft after minus before (bytes; None when either is unread)."""
    b = {x["cgroup"]: x.get("nvml_soft") for x in before}
    return {x["cgroup"]: (None if x.get("nvml_soft") is None or b.get(x["cgroup"]) is None
                          else x["nvml_soft"] - b[x["cgroup"]]) for x in after}


def find_over_limit(metrics_text: str, log_text: str, pod: str) -> dict[str, list[str]]:
    """Where the over-limit check spoke of ``pod``: non-zero /metrics series
    whose name says over-limit/exceeded (``fracplugin_container_gpu_memory_over_limit``),
    and log lines naming the pod and ``OVER_LIMIT_EVENT`` or its limit exceeded."""
    series = [ln for ln in metrics_text.splitlines() if not ln.startswith("#") and f'pod="{pod}"' in ln
              and re.search(r"over_?limit|exceed", ln.split("{")[0], re.I) and not ln.endswith((" 0", " 0.0"))]
    said = re.compile(OVER_LIMIT_EVENT + r"|above its GPU memory limit|exceed", re.I)
    logs = [ln[:400] for ln in log_text.splitlines() if pod in ln and said.search(ln)]
    return {"metric_series": series[:8], "log_lines": logs[-4:]}


# ---- the check ----------------------------------------------------------------------------------
class GpuCheck:
    """One run of steps 1-7 (module docstring). ``run()`` returns the exit status."""

    def __init__(self, out_path: Path, python: str, pythonpath: Sequence[str], mps_binary: str | None,
                 gpu_index: int = 0, keep: bool = False, artifacts: str = "", *, simulate_node: str | None = None,
                 cuda_lib: str = "libcuda.so.1", cgroup_root: str = "/sys/fs/cgroup", metric_wait_s: float = 15.0) -> None:
        self.metric_wait_s = metric_wait_s
        self.simulate_node = simulate_node  # rehearsal without a GPU (tests): the simulated inventory
        self.cuda_lib = cuda_lib
        self.cgroup_root = cgroup_root
        self.out_path = out_path
        self.artifacts = artifacts
        self.python = python
        self.pythonpath = list(pythonpath)
        self.mps_binary = mps_binary
        self.gpu_index = gpu_index
        self.keep = keep
        self.report = Report()
        self.t0 = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="fpgc", dir="/tmp"))
        os.chmod(self.work, 0o755)
        self.daemon: Daemon | None = None
        self.nri: Nri | None = None
        self.cgroups: Cgroups | None = None
        self.clients: list[Client] = []
        self.node: Any = None
        self.gpu: Any = None
        self.protocol = 2
        self.mps_before: set[int] = set()
        self.modes_before: dict[str, int] | None = None

    def left(self) -> float:
        """Seconds left of ``DEADLINE_S`` (negative when past)."""
        return DEADLINE_S - (time.monotonic() - self.t0)

    def run(self) -> int:
        r = self.report
        try:
            if self.step1_inventory() and self.step2_daemon():
                self.step3_to_6()
                self.step8_memory_limits()
                self.step9_field_cases()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (main): clean up and still write the report
            r.add(7, "check ran to the end", "not interrupted", "interrupted (SIGINT/SIGTERM)", "fail")
        except Exception as exc:  # a driver error: report it as a failure, clean up, write the report
            import traceback

            traceback.print_exc()
            r.add(7, "check ran to the end", "no internal error", f"{type(exc).__name__}: {exc}", "fail")
        finally:
            self.shutdown()
        elapsed = time.monotonic() - self.t0
        r.check(7, "wall time", "<= 300 s", round(elapsed, 1), elapsed <= 300, "the check took too long")
        for n, _ in STEPS:
            if not any(f.step == n for f in r.figures):
                r.skip(n, "step", "measured", "an earlier step failed, so this one did not run")
        r.write(self.out_path)
        print(f"gpu-check: {'FAILED' if r.failed() else 'passed'} in {elapsed:.0f} s; report {self.out_path}")
        if self.daemon is not None and r.failed():
            print("daemon log (last lines):\n" + self.daemon.log_tail(30))
        if self.artifacts:
            self.save_artifacts(Path(self.artifacts))
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            print(f"kept {self.work}")
        return r.exit_code()

    def save_artifacts(self, dest: Path) -> None:
        """Copy the daemon's log and up to five MPS logs into ``dest`` (flat
        names: ``daemon.log``, ``mps-ts-control.log``, ...) for a post-mortem;
        six files at most, so a device-tool run brings them all back."""
        dest.mkdir(parents=True, exist_ok=True)
        files = [(self.work / "daemon.log", "daemon.log")]
        logs = self.work / "mps" / "log"
        if logs.is_dir():
            files += [(f, "mps-" + "-".join(f.relative_to(logs).parts)) for f in sorted(logs.rglob("*.log"))][:5]
        for src, name in files:
            try:
                shutil.copyfile(src, dest / name)
            except OSError:
                pass

    # -- 1 ---------------------------------------------------------------------------------
    def step1_inventory(self) -> bool:
        from fracplugin.gpu.inventory import InventoryError
        from fracplugin.gpu.nvml import NvmlInventory
        from fracplugin.mps.control import choose_protocol

        r = self.report
        print("== 1. inventory through NVML", flush=True)
        try:
            if self.simulate_node:
                from fracplugin.gpu.simulated import SimulatedInventory

                inv: Any = SimulatedInventory(self.simulate_node)
            else:
                inv = NvmlInventory()
        except InventoryError as exc:
            r.add(1, "NVML inventory", "readable", str(exc), "fail")
            return False
        self.node = inv.node()
        inv.close()
        n = self.node
        for g in n.gpus:
            print(f"  GPU {g.index} {g.uuid} {g.name} {g.memory_mib} MiB cc {g.compute_capability} "
                  f"MIG {'on' if g.mig_enabled else 'off'}")
        self.protocol = choose_protocol(n.driver_version)
        print(f"  driver {n.driver_version}, CUDA driver API {n.cuda_driver_version}, MPS protocol chosen "
              f"{self.protocol} ({'v3 namespaces' if self.protocol >= 3 else 'classic v2: no namespaces before r615'})")
        self.modes_before = None if self.simulate_node else compute_modes()
        r.facts["compute_modes_before"] = self.modes_before
        r.facts.update(driver_version=n.driver_version, cuda_driver_version=n.cuda_driver_version,
                       gpus=[{"index": g.index, "uuid": g.uuid, "name": g.name, "memory_mib": g.memory_mib,
                              "compute_capability": g.compute_capability} for g in n.gpus],
                       mps_protocol=self.protocol, python=sys.version.split()[0], host=os.uname().nodename)
        r.check(1, "GPUs", ">= 1", len(n.gpus), len(n.gpus) >= 1, "NVML lists no GPU")
        r.check(1, "driver version", "non-empty", n.driver_version, bool(n.driver_version))
        r.add(1, "MPS protocol chosen", "3 on r615+, else 2", self.protocol, "pass")
        gpus = [g for g in n.gpus if g.index == self.gpu_index]
        if not gpus:
            r.add(1, "GPU under test", f"index {self.gpu_index}", [g.index for g in n.gpus], "fail")
            return False
        self.gpu = gpus[0]
        if self.gpu.mig_enabled:
            r.add(1, "GPU under test", "MIG off", "MIG on", "fail", "MPS sharing is not checked on MIG GPUs")
            return False
        r.check(1, "GPU memory", f">= {SM_LIMIT_MIB + 2048} MiB", self.gpu.memory_mib,
                self.gpu.memory_mib >= SM_LIMIT_MIB + 2048, "too small for the 4 GiB container")
        r.check(1, "nvidia-cuda-mps-control", "found", self.mps_binary or "not found", bool(self.mps_binary),
                f"not on PATH nor in {', '.join(MPS_SEARCH)}")
        return bool(self.mps_binary) and not r.failed()

    # -- 2 ---------------------------------------------------------------------------------
    def step2_daemon(self) -> bool:
        r = self.report
        print("== 2. the daemon with real NVML and MPS", flush=True)
        self.mps_before = mps_pids()
        r.facts["mps_processes_before"] = sorted(self.mps_before)
        assert self.mps_binary is not None
        self.nri = Nri(self.work / "nri.sock")
        self.daemon = Daemon(self.work, self.python, self.pythonpath, self.mps_binary, self.simulate_node,
                             self.cgroup_root)
        t = time.monotonic()
        try:
            self.daemon.start(timeout_s=min(60.0, self.left()))
        except RuntimeError as exc:
            r.add(2, "daemon started", "endpoints.json written", str(exc), "fail")
            return False
        ready = wait_until(lambda: self.daemon.get("/readyz")[0] == 200, min(90.0, self.left()), 0.2)
        code, body = self.daemon.get("/readyz")
        r.check(2, "/readyz", "200 within 90 s", {"code": code, "after_s": round(time.monotonic() - t, 1),
                                                  "checks": body.get("checks") if isinstance(body, dict) else body},
                bool(ready), "not ready")
        if not ready:
            return False
        try:
            self.nri.server.wait_registered(10)
        except TimeoutError as exc:
            r.add(2, "NRI plugin registered", "registered", str(exc), "fail")
            return False
        code, st = self.daemon.get("/status")
        mps = (st.get("mps") or {}) if isinstance(st, dict) else {}
        r.check(2, "MPS protocol in use", f"{self.protocol} (chosen from driver {self.node.driver_version})",
                mps.get("protocol"), mps.get("protocol") == self.protocol, "the daemon chose another protocol")
        ds = self.daemon.mps_daemons()
        for mode in ("time-slicing", "sm-sharing"):
            d = ds.get(mode) or {}
            r.check(2, f"MPS {mode} daemon probed healthy", "healthy, last probe ok",
                    {k: d.get(k) for k in ("state", "healthy", "last_probe_ok", "last_probe_s", "pid")},
                    bool(d.get("healthy")) and d.get("last_probe_ok") is not False, d.get("last_error") or "unhealthy")
        return True

    def restart_check(self) -> None:
        """SIGKILL the time-slicing control daemon; the supervisor must restart it healthy (step 2)."""
        r = self.report
        assert self.daemon is not None
        d = self.daemon.mps_daemons().get("time-slicing") or {}
        pid, restarts = d.get("pid"), int(d.get("restarts") or 0)
        if not pid:
            r.skip(2, "MPS daemon restarted after SIGKILL", "restarted, healthy", "no pid in /status")
            return
        os.kill(int(pid), signal.SIGKILL)
        t = time.monotonic()

        def back() -> Any:
            n = self.daemon.mps_daemons().get("time-slicing") or {}  # type: ignore[union-attr]
            return n if n.get("healthy") and n.get("pid") not in (None, pid) and int(n.get("restarts") or 0) > restarts \
                else None
        n = wait_until(back, min(45.0, self.left()), 0.2)
        r.check(2, "MPS daemon restarted after SIGKILL", "new pid, healthy, restarts +1 within 45 s",
                {"old_pid": pid, "new": {k: (n or {}).get(k) for k in ("pid", "restarts", "healthy")},
                 "after_s": round(time.monotonic() - t, 1)}, bool(n), "not back in time")

    # -- 3..6 -------------------------------------------------------------------------------
    def _plan(self, step: int, manifest: dict[str, Any], limit_mib: int, atp: int | None,
              **create: str) -> Planned | None:
        from fracplugin.nri.ttrpc import RpcError

        r = self.report
        name = manifest["metadata"]["name"]
        assert self.nri is not None
        try:
            p = self.nri.create(manifest, **create)
        except (RpcError, TimeoutError, ConnectionError) as exc:
            r.add(step, f"{name}: planned through NRI", "placed", f"{type(exc).__name__}: {exc}", "fail")
            return None
        want = {"NVIDIA_VISIBLE_DEVICES": self.gpu.uuid, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{self.gpu.uuid}={limit_mib}M"}
        if atp is not None:
            want["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(atp)
        got = {k: p.env.get(k) for k in want}
        r.check(step, f"{name}: planned through NRI", json.dumps(want, sort_keys=True),
                {"env": {k: v for k, v in p.env.items() if k.startswith(("CUDA_", "NVIDIA_"))},
                 "mounts": p.mounts}, got == want and bool(p.env.get("CUDA_MPS_PIPE_DIRECTORY")),
                "the plan's env differs")
        return p

    def _client(self, p: Planned, cap_mib: int) -> Client:
        env, notes = client_env(p.env, p.mounts, os.environ, len(self.node.gpus))
        cg = self.cgroups.for_container(p.container_id) if self.cgroups else ""
        c = Client(self.python, env, cap_mib, cg, lib=self.cuda_lib)
        self.clients.append(c)
        return c

    def _judge_client(self, step: int, label: str, p: Planned, rep: dict[str, Any], limit_mib: int,
                      atp: int | None, pipe_dir: str) -> None:
        r = self.report
        if not rep.get("ok"):
            r.add(step, f"{label}: CUDA client ran", "cuInit, context, allocations", rep, "fail", rep.get("error", ""))
            return
        ok, exp, why = judge_pinned(int(rep["allocated_mib"]), limit_mib, rep.get("stopped_by", ""))
        r.check(step, f"{label}: pinned device memory limit", exp,
                {k: rep.get(k) for k in ("allocated_mib", "steps", "stopped_by", "alloc_error")}, ok, why)
        has_cvd = "CUDA_VISIBLE_DEVICES" in p.env
        st, exp, why = judge_devices(int(rep.get("devices") or 0), 1, len(self.node.gpus), has_cvd)
        r.add(step, f"{label}: devices seen", exp, {"devices": rep.get("devices"), "uuids": rep.get("uuids")}, st, why)
        if st == "pass":
            r.check(step, f"{label}: the GPU seen is the planned one", self.gpu.uuid, rep.get("uuids"),
                    rep.get("uuids") == [self.gpu.uuid], "another GPU")
        clients = mps_client_pids(self.mps_binary or "", pipe_dir, self.protocol)
        attr = rep.get("mps_enabled")
        ok, why = judge_through_mps(attr, rep.get("pid"), clients)
        r.check(step, f"{label}: went through MPS", "CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 1 (where the driver knows it) "
                "and the PID in the control daemon's client list", {"mps_enabled": attr, "pid": rep.get("pid"),
                                                                   "mps_clients": clients}, ok, why)
        st, exp, why = judge_atp(rep.get("sm_ctx"), rep.get("sm_total"), atp)
        r.add(step, f"{label}: active thread percentage", exp, {"sm_ctx": rep.get("sm_ctx"),
                                                                "sm_total": rep.get("sm_total")}, st, why)

    def _metric(self, label: str, p: Planned, allocated_mib: int, reps: Sequence[Mapping[str, Any]] = ()) -> None:
        r = self.report
        assert self.daemon is not None
        cg_errors = [x["cgroup_error"] for x in reps if x.get("cgroup_error")]
        if cg_errors:
            r.skip(5, f"{label}: used bytes", "per-container used bytes", "a client could not join its container "
                   f"cgroup: {cg_errors[0]}")
            return
        if self.cgroups is None or self.cgroups.base is None:
            r.skip(5, f"{label}: used bytes", "per-container used bytes", "clients cannot be put in a container "
                   f"cgroup here: {self.cgroups.reason if self.cgroups else 'no cgroups'}")
            return
        want_lo = allocated_mib * MIB

        def scraped() -> Any:
            u = used_bytes(self.daemon.metrics(), p.pod_uid, "app")  # type: ignore[union-attr]
            return u if u is not None and u >= want_lo else None
        used = wait_until(scraped, min(self.metric_wait_s, self.left()), 0.5)
        if used is None:
            used = used_bytes(self.daemon.metrics(), p.pod_uid, "app")
        st, exp, why = judge_metric(used, allocated_mib)
        r.add(5, f"{label}: used bytes", exp, {"used_mib": None if used is None else round(used / MIB, 1),
                                              "allocated_mib": allocated_mib}, st, why)

    def step3_to_6(self) -> None:
        r = self.report
        assert self.daemon is not None and self.nri is not None
        self.cgroups = Cgroups(self.cgroup_root)
        ds = self.daemon.mps_daemons()
        ts_pipe = (ds.get("time-slicing") or {}).get("pipe_dir", "")
        sm_pipe = (ds.get("sm-sharing") or {}).get("pipe_dir", "")
        timeout = lambda: max(1.0, min(90.0, self.left()))  # noqa: E731

        print("== 3. time-slicing container, 2 GiB", flush=True)
        ts = self._plan(3, pod_manifest("gpucheck-ts", "time-slicing", TS_LIMIT_MIB, self.gpu.uuid), TS_LIMIT_MIB, None)
        if ts is not None:
            c = self._client(ts, TS_LIMIT_MIB + 2048)
            rep = c.wait_report(timeout())
            self._judge_client(3, "time-slicing", ts, rep, TS_LIMIT_MIB, None, ts_pipe)
            if rep.get("ok"):
                print("== 5. metrics while the time-slicing client holds its memory", flush=True)
                self._metric("time-slicing", ts, int(rep["allocated_mib"]), [rep])
            c.release()

            print("== 4. one container, two processes", flush=True)
            cs = [self._client(ts, TS_LIMIT_MIB + 2048) for _ in range(2)]
            reps = [c.wait_report(timeout()) for c in cs]
            if all(x.get("ok") for x in reps):
                got = [int(x["allocated_mib"]) for x in reps]
                each_ok = all(judge_pinned(g, TS_LIMIT_MIB, x.get("stopped_by", ""))[0] for g, x in zip(got, reps))
                r.check(4, "each process capped", f"each <= {TS_LIMIT_MIB} MiB, allocation fails", got, each_ok,
                        "a process passed the limit")
                total = sum(got)
                r.check(4, "what the container got in all", f"<= {2 * TS_LIMIT_MIB} MiB (the pinned limit binds each "
                        "client process, not the container: docs/reference/mps-nvml.md 2.8)", {"total_mib": total,
                        "container_limit_mib": TS_LIMIT_MIB, "per_process": got}, total <= 2 * TS_LIMIT_MIB)
                r.facts["container_with_two_processes_mib"] = total
                self._metric("two processes", ts, total, reps)
            else:
                r.add(4, "two CUDA clients ran", "both report", reps, "fail")
            for c in cs:
                c.release()
            try:
                self.nri.remove(ts)
            except Exception as exc:
                r.add(3, "time-slicing: removed through NRI", "Stop/RemoveContainer answered", str(exc), "fail")
            self.restart_check()

        print(f"== 3. sm-sharing container, 4 GiB, portion {SM_PORTION}", flush=True)
        atp = int(float(SM_PORTION) * 100)
        sm = self._plan(3, pod_manifest("gpucheck-sm", "sm-sharing", SM_LIMIT_MIB, self.gpu.uuid, SM_PORTION),
                        SM_LIMIT_MIB, atp)
        if sm is None:
            r.skip(6, "next client after SIGKILL", "works", "the sm-sharing container was not planned")
            return
        skip = mps_namespace_skip(self.protocol)
        pipe_src = host_path(sm.env.get("CUDA_MPS_PIPE_DIRECTORY", ""), sm.mounts) or ""
        if skip:
            r.skip(3, "sm-sharing: own MPS namespace", "a namespace leaf pipe directory of its own", skip, pipe_src)
        else:
            names = [n.get("name") for n in ((self.daemon.mps_daemons().get("sm-sharing") or {}).get("namespaces") or [])]
            r.check(3, "sm-sharing: own MPS namespace", "mount source is a namespace leaf under <sm>/shared/ and the "
                    "namespace is listed", {"pipe_dir": pipe_src, "namespaces": names},
                    bool(pipe_src) and os.path.basename(pipe_src) in names and pipe_src != sm_pipe,
                    "no namespace of its own")
        c = self._client(sm, SM_LIMIT_MIB + 2048)
        rep = c.wait_report(timeout())
        self._judge_client(3, "sm-sharing", sm, rep, SM_LIMIT_MIB, atp, sm_pipe)
        if rep.get("ok"):
            print("== 5. metrics while the sm-sharing client holds its memory", flush=True)
            self._metric("sm-sharing", sm, int(rep["allocated_mib"]), [rep])

        print("== 6. SIGKILL the sm-sharing client, then the next one", flush=True)
        before = self.daemon.mps_daemons().get("sm-sharing") or {}
        c.kill()
        r.add(6, "sm-sharing client SIGKILLed", "killed while holding memory", {"pid": c.proc.pid,
              "returncode": c.proc.returncode}, "pass" if c.proc.returncode == -signal.SIGKILL else "fail")
        nxt = self._client(sm, SM_LIMIT_MIB + 2048)
        rep2 = nxt.wait_report(timeout())
        ok2, exp2, why2 = judge_pinned(int(rep2.get("allocated_mib") or 0), SM_LIMIT_MIB, rep2.get("stopped_by", ""))
        r.check(6, "next client of that container", "runs through MPS and is capped as before: " + exp2,
                {k: rep2.get(k) for k in ("ok", "error", "allocated_mib", "stopped_by", "mps_enabled")},
                bool(rep2.get("ok")) and ok2 and rep2.get("mps_enabled") in (1, None), rep2.get("error") or why2)
        nxt.release()
        after = self.daemon.mps_daemons().get("sm-sharing") or {}
        r.facts["sm_daemon_after_kill"] = {k: after.get(k) for k in ("restarts", "wedges", "healthy", "state")}
        r.check(6, "sm-sharing MPS daemon after the kill", "healthy (restarts/wedges reported)",
                {"before": {k: before.get(k) for k in ("restarts", "wedges")},
                 "after": {k: after.get(k) for k in ("restarts", "wedges", "healthy")}}, bool(after.get("healthy")),
                after.get("last_error") or "unhealthy")
        try:
            self.nri.remove(sm)
        except Exception as exc:
            r.add(6, "sm-sharing: removed through NRI", "Stop/RemoveContainer answered", str(exc), "fail")

    # -- 8 ---------------------------------------------------------------------------------
    def step8_memory_limits(self) -> None:
        """Issue 23 item 7 (module docstring, step 8). Every figure is skipped
        with the reason where the machine cannot show it."""
        r = self.report
        print("== 8. CUDA memory limits on the container's cgroup", flush=True)
        title = "CUDA memory limits"
        if self.simulate_node:
            r.skip(8, title, "enforced on the container's cgroup", "needs a real GPU (simulated node)")
            return
        why = memory_limits_skip(self.node.driver_version, self.cgroup_root, bool(self.gpu.mig_enabled),
                                 NvmlLimits.available())
        if why:
            r.skip(8, title, "enforced on the container's cgroup", why)
            return
        assert self.nri is not None
        if self.cgroups is None or self.cgroups.base is None:
            r.skip(8, title, "enforced on the container's cgroup", "no writable cgroup here: "
                   + (self.cgroups.reason if self.cgroups else "no cgroups"))
            return
        nvml = NvmlLimits(self.gpu.uuid)
        try:
            manifest = pod_manifest("gpucheck-memlimits", "time-slicing", ML_LIMIT_MIB, self.gpu.uuid,
                                    request_mib=ML_REQUEST_MIB)
            # the leaf exists before CreateContainer, as the runtime makes it; the request names it
            cid = secrets.token_hex(32)
            leaf = self.cgroups.for_container(cid)
            cg_path = "/" + os.path.relpath(leaf, self.cgroup_root)
            p = self._plan(8, manifest, ML_LIMIT_MIB, None, container_id=cid, cgroups_path=cg_path)
            if p is None:
                return
            want = (int(p.env.get("NVIDIA_GPU_MEMORY_REQUEST", 0)), int(p.env.get("NVIDIA_GPU_MEMORY_LIMIT", 0)))
            r.check(8, "planned request / limit", f"{ML_REQUEST_MIB} / {ML_LIMIT_MIB} MiB", want,
                    want == (ML_REQUEST_MIB, ML_LIMIT_MIB), "the plan's env differs")
            # hook absent: the daemon itself (--memory-limits auto = apply) set them at StartContainer
            self._limits_on_leaf("hook absent", nvml, leaf, set_by="the daemon (--memory-limits apply)",
                                 fallback=True)
            # hook present: the toolkit's createRuntime hook on a second leaf, as the runtime runs it
            hook = find_hook_binary()
            if hook is None:
                r.skip(8, "hook present: limits on the cgroup", "set by apply-cuda-memory-limits",
                       f"{HOOK_BINARY} not found (PATH, {', '.join(HOOK_SEARCH)}): toolkit v1.20.1+ not installed")
            else:
                leaf2 = self.cgroups.for_container(secrets.token_hex(32))
                rc, out = run_limits_hook(hook, leaf2, self.gpu.uuid, p.env, self.work)
                r.check(8, "hook present: nvidia-cdi-hook apply-cuda-memory-limits", "exit 0",
                        {"status": rc, "output": out}, rc == 0, "the hook failed")
                if rc == 0:
                    self._limits_on_leaf("hook present", nvml, leaf2, set_by="nvidia-cdi-hook", fallback=False)
            try:
                self.nri.remove(p)
            except Exception as exc:
                r.add(8, "memory-limits container removed through NRI", "answered", str(exc), "fail")
        finally:
            nvml.close()

    def _limits_on_leaf(self, label: str, nvml: NvmlLimits, leaf: str, set_by: str, fallback: bool) -> None:
        """The figures of one leaf: NVML read-back, then (limits in force)
        nvidia-smi and cuMemGetInfo inside it, one process past the hard
        limit, two processes together. ``fallback``: when the limits are not
        in force, the check sets them itself so the CUDA side is still
        measured (the read-back figure has failed already)."""
        r = self.report
        timeout = max(1.0, min(90.0, self.left()))
        try:
            read: tuple[int, int] | None = nvml.get(leaf)
            err = ""
        except Exception as exc:  # NVMLError: permission, not supported
            read, err = None, f"{type(exc).__name__}: {exc}"
        ok, exp, why = judge_limits(read, ML_REQUEST_MIB, ML_LIMIT_MIB)
        r.check(8, f"{label}: nvmlDeviceGetMemoryLimits_v1 on its cgroup", f"{exp}, set by {set_by}",
                {"cgroup": leaf, "soft": read[0] if read else None, "hard": read[1] if read else None,
                 "error": err}, ok, err or why)
        if not ok:
            if not fallback or read is None:
                return
            try:
                nvml.set(leaf, ML_REQUEST_MIB * MIB, ML_LIMIT_MIB * MIB)
            except Exception as exc:
                r.add(8, f"{label}: limits set by the check", "NVML set", f"{type(exc).__name__}: {exc}", "fail")
                return
        try:
            total, why = smi_total_in(leaf, self.gpu.uuid)
            ok, exp, why2 = judge_total(total, ML_LIMIT_MIB, "nvidia-smi memory.total")
            r.check(8, f"{label}: nvidia-smi memory.total in the cgroup", exp, total, ok, why or why2)
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_VISIBLE_DEVICES": self.gpu.uuid}
            # no MPS env: only the cgroup limit may stop these clients (the pinned limit is per process)
            one = Client(self.python, env, ML_LIMIT_MIB + 1024, leaf, lib=self.cuda_lib)
            self.clients.append(one)
            rep = one.wait_report(timeout)
            if not rep.get("ok"):
                r.add(8, f"{label}: CUDA client in the cgroup", "ran", rep, "fail", rep.get("error", ""))
                one.release()
                return
            ok, exp, why = judge_total(rep.get("mem_total_mib"), ML_LIMIT_MIB, "cuMemGetInfo total")
            r.check(8, f"{label}: cuMemGetInfo total in the cgroup", exp,
                    {k: rep.get(k) for k in ("mem_total_mib", "mem_free_mib")}, ok, why)
            ok, exp, why = judge_capped([int(rep["allocated_mib"])], [rep.get("stopped_by", "")], ML_LIMIT_MIB)
            r.check(8, f"{label}: an allocation past the hard limit fails", exp,
                    {k: rep.get(k) for k in ("allocated_mib", "stopped_by", "alloc_error")}, ok, why)
            one.release()
            two = [Client(self.python, env, ML_LIMIT_MIB + 1024, leaf, lib=self.cuda_lib) for _ in range(2)]
            self.clients.extend(two)
            reps = []
            for c in two:  # one after the other: the first holds its memory while the second allocates
                reps.append(c.wait_report(timeout))
            if all(x.get("ok") for x in reps):
                ok, exp, why = judge_capped([int(x["allocated_mib"]) for x in reps],
                                            [x.get("stopped_by", "") for x in reps], ML_LIMIT_MIB)
                r.check(8, f"{label}: two processes together capped", exp,
                        {"per_process_mib": [x.get("allocated_mib") for x in reps]}, ok, why)
            else:
                r.add(8, f"{label}: two CUDA clients in the cgroup", "both report", reps, "fail")
            for c in two:
                c.release()
        finally:
            try:
                nvml.clear(leaf)
            except Exception:
                pass

    # -- 9 ---------------------------------------------------------------------------------
    def step9_field_cases(self) -> None:
        """Issue 35 item 6 (module docstring, step 9)."""
        r = self.report
        print("== 9. the field's cases", flush=True)
        title = "the field's cases"
        why = "needs a real GPU (simulated node)" if self.simulate_node else memory_limits_skip(
            self.node.driver_version, self.cgroup_root, bool(self.gpu.mig_enabled), NvmlLimits.available())
        if not why and (self.cgroups is None or self.cgroups.base is None):
            why = "no writable cgroup here"
        if not why and self.left() < 60:
            why = f"{self.left():.0f} s left of the check's {DEADLINE_S:.0f} s"
        if why:
            r.skip(9, title, "measured", why)
            return
        for case in (self._narrowed, self._reservations, self._over_limit):
            try:
                case()
            except Exception as exc:
                r.add(9, case.__name__.strip("_"), "measured", f"{type(exc).__name__}: {exc}", "fail")

    def _leaf(self) -> tuple[str, str, str]:
        """(container id, leaf, cgroups path) of a new container leaf."""
        assert self.cgroups is not None
        cid = secrets.token_hex(32)
        leaf = self.cgroups.for_container(cid)
        return cid, leaf, "/" + os.path.relpath(leaf, self.cgroup_root)

    def _narrowed(self) -> None:
        r = self.report
        gpus = [g for g in self.node.gpus if not g.mig_enabled]
        name = "narrowed CUDA_VISIBLE_DEVICES in a two-GPU container"
        if len(gpus) < 2:
            r.skip(9, name, "measured", f"the node has {len(gpus)} non-MIG GPU(s); a two-GPU container needs 2")
            return
        cid, leaf, cg = self._leaf()
        manifest = pod_manifest("gpucheck-narrow", "time-slicing", ML_LIMIT_MIB, f"{gpus[0].uuid},{gpus[1].uuid}",
                                request_mib=ML_REQUEST_MIB)
        assert self.nri is not None
        p = self.nri.create(manifest, container_id=cid, cgroups_path=cg)
        env, _ = client_env(p.env, p.mounts, os.environ, len(self.node.gpus))
        env["CUDA_VISIBLE_DEVICES"] = gpus[0].uuid  # a tensor-parallel launcher's worker: one GPU of the two
        timeout = max(1.0, min(90.0, self.left()))
        reps = {}
        for where, cgroup in (("outside the container's cgroup", ""), ("in the container's cgroup", leaf)):
            c = Client(self.python, env, ML_LIMIT_MIB + 2048, cgroup, lib=self.cuda_lib)
            self.clients.append(c)
            reps[where] = c.wait_report(timeout)
            c.release()
        out = reps["outside the container's cgroup"]
        kept = bool(out.get("ok")) and int(out.get("allocated_mib") or 0) <= ML_LIMIT_MIB
        r.add(9, "narrowed worker, pinned limit alone", f"NVIDIA measured it dropped (allocates past {ML_LIMIT_MIB} "
              "MiB) when the list names a GPU the process cannot see", {
                  "pinned": p.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), "visible": gpus[0].uuid, "pinned_kept": kept,
                  **{k: out.get(k) for k in ("ok", "allocated_mib", "stopped_by", "mem_total_mib", "error")}},
              "pass" if out.get("ok") else "fail", "" if out.get("ok") else str(out.get("error", "")))
        inn = reps["in the container's cgroup"]
        if not inn.get("ok"):
            r.add(9, "narrowed worker in its cgroup", "ran", inn, "fail", str(inn.get("error", "")))
        else:
            ok, exp, why = judge_capped([int(inn["allocated_mib"])], [inn.get("stopped_by", "")], ML_LIMIT_MIB)
            r.check(9, "narrowed worker in its cgroup: the cgroup limit holds", exp,
                    {k: inn.get(k) for k in ("allocated_mib", "stopped_by", "alloc_error")}, ok, why)
            ok, exp, why = judge_total(inn.get("mem_total_mib"), ML_LIMIT_MIB, "cuMemGetInfo total")
            r.check(9, "narrowed worker in its cgroup: cuMemGetInfo total", exp, inn.get("mem_total_mib"), ok, why)
        self.nri.remove(p)

    def _reservations(self) -> None:
        from fracplugin.enforce.capability import gpu_region

        r = self.report
        assert self.cgroups is not None and self.cgroups.base is not None and self.nri is not None
        nvml = NvmlLimits(self.gpu.uuid)
        region = gpu_region(self.gpu)
        try:
            for repair in (False, True):
                label = "with the repair (the daemon zeroes at populated 0)" if repair else "without the repair"
                pod = self.cgroups.base / f"pod-{secrets.token_hex(4)}"
                pod.mkdir()
                self.cgroups.made.append(pod)
                parents = [str(self.cgroups.base), str(pod)]
                read = lambda: [read_reservation(lambda c: nvml.get(c)[0], x, region) for x in parents]  # noqa: E731
                before = read()
                cid = secrets.token_hex(32)
                leaf = pod / f"cri-containerd-{cid}.scope"
                leaf.mkdir()
                self.cgroups.made.append(leaf)
                facts: dict[str, Any] = {"before": before}
                if repair:  # containerd's order: the process ends, runc deletes the leaf, then Stop/Remove
                    holder = subprocess.Popen(["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec sleep 120', "sh",
                                               str(leaf)], start_new_session=True)
                    wait_until(lambda: str(holder.pid) in (leaf / "cgroup.procs").read_text().split(), 5.0, 0.05)
                    p = self.nri.create(pod_manifest("gpucheck-reserve", "time-slicing", ML_LIMIT_MIB, self.gpu.uuid,
                                                     request_mib=ML_REQUEST_MIB), container_id=cid,
                                        cgroups_path="/" + os.path.relpath(leaf, self.cgroup_root))
                    facts["during"] = read()
                    holder.kill()
                    holder.wait(10)
                    zeroed = wait_until(lambda: nvml.get(str(leaf))[0] == 0, 10.0, 0.01)
                    facts["leaf_soft_before_deletion"] = nvml.get(str(leaf))[0]
                    r.check(9, f"{label}: soft limit zeroed before the leaf went", "0 within 10 s of the last exit",
                            facts["leaf_soft_before_deletion"], bool(zeroed), "the daemon did not zero it")
                    leaf.rmdir()
                    self.nri.remove(p)
                    facts["daemon_soft_zeroing"] = (self.daemon.get("/status")[1].get("memory_limits") or {}).get(
                        "soft_zeroing") if self.daemon else None
                else:  # set as the toolkit hook sets it (nothing zeroes it), then deleted
                    nvml.set(str(leaf), RES_SOFT_MIB * MIB, ML_LIMIT_MIB * MIB)
                    facts["during"] = read()
                    leaf.rmdir()
                facts["after"] = read()
                facts["leftover_bytes"] = leftover(before, facts["after"])
                left = [v for v in facts["leftover_bytes"].values() if v]
                r.add(9, f"{label}: parents' reservation after the leaf's deletion",
                      "NVIDIA: a soft limit not zeroed stays reserved on the parents; with the repair nothing stays",
                      facts, "fail" if repair and left else "pass", "reservation left on the parents" if repair and left
                      else "")
                if not repair and left:  # the after-the-fact repair: set the parent (soft 0); does it go?
                    try:
                        nvml.set(str(pod), 0, NVML_DEVICE_MEMORY_LIMIT_MAX)
                        err = ""
                    except Exception as exc:
                        err = f"{type(exc).__name__}: {exc}"
                    r.add(9, "after the fact: NVML soft 0 on the parent", "measured (undocumented)",
                          {"error": err, "after": read(), "leftover_bytes": leftover(before, read())}, "pass")
        finally:
            nvml.close()

    def _over_limit(self) -> None:
        r = self.report
        assert self.nri is not None and self.daemon is not None
        cid, leaf, cg = self._leaf()
        p = self.nri.create(pod_manifest("gpucheck-overlimit", "time-slicing", OVER_LIMIT_MIB, self.gpu.uuid),
                            container_id=cid, cgroups_path=cg)
        nvml = NvmlLimits(self.gpu.uuid)
        try:
            nvml.clear(leaf)  # no cgroup limit for this container, as --memory-limits off leaves it
        finally:
            nvml.close()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_VISIBLE_DEVICES": self.gpu.uuid}
        c = Client(self.python, env, OVER_LIMIT_MIB + 512, leaf, lib=self.cuda_lib)  # no MPS env: no pinned limit
        self.clients.append(c)
        rep = c.wait_report(max(1.0, min(90.0, self.left())))
        past = bool(rep.get("ok")) and int(rep.get("allocated_mib") or 0) > OVER_LIMIT_MIB
        r.check(9, "allocation past the limit, no cgroup limit", f"> {OVER_LIMIT_MIB} MiB held",
                {k: rep.get(k) for k in ("allocated_mib", "stopped_by", "error")}, past, "it did not get past the limit")
        have = any(OVER_LIMIT_EVENT in f.read_text(errors="replace") for f in (REPO / "src" / "fracplugin").rglob("*.py"))
        pod = p.manifest["metadata"]["name"]
        found = wait_until(lambda: (lambda f: f if f["metric_series"] or f["log_lines"] else None)(
            find_over_limit(self.daemon.metrics(), self.daemon.log_tail(400), pod)),  # type: ignore[union-attr]
            min(60.0, max(1.0, self.left())), 0.5) if past and have else None
        exp = f"a {OVER_LIMIT_EVENT} metric series or log line for {pod} (an Event needs API access, none here)"
        if not have:
            r.skip(9, "noticed by the over-limit check", exp, f"this build has no over-limit check ({OVER_LIMIT_EVENT} "
                   "is nowhere in src/fracplugin)")
        elif not past:
            r.skip(9, "noticed by the over-limit check", exp, "the client did not get past the limit")
        else:
            r.check(9, "noticed by the over-limit check", exp, found or find_over_limit(
                self.daemon.metrics(), self.daemon.log_tail(400), pod), bool(found), "nothing found within 60 s")
        c.release()
        self.nri.remove(p)

    # -- shutdown (6) ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        r = self.report
        for c in self.clients:
            c.kill()
        if self.daemon is not None and self.daemon.proc is not None:
            t = time.monotonic()
            rc = self.daemon.stop(30.0)
            r.check(6, "daemon stopped by SIGTERM", "exit status 0 within 30 s",
                    {"status": rc, "after_s": round(time.monotonic() - t, 1)}, rc == 0, "did not stop cleanly")
            # a condition, bounded generously (a loaded host reaps slowly); other MPS roots' processes
            # (another checkout's fakes on a shared machine) are not this check's
            wait_until(lambda: not new_mps_pids(self.mps_before, self.work) and not own_leftovers(self.work),
                       60.0, 0.2)
            left = sorted(new_mps_pids(self.mps_before, self.work))
            ours = own_leftovers(self.work)
            r.check(6, "no MPS process left", "no nvidia-cuda-mps-* process that was not there before (other MPS "
                    "roots' left out), no process naming the work directory", {"mps": left, "work_dir": ours}, not left and not ours,
                    "processes left running")
            for pid in left + [int(x.split(":")[0]) for x in ours]:  # ours: started after the check began
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            socks = [str(p) for p in (self.work / "mps").rglob("*") if p.is_socket()] if (self.work / "mps").exists() else []
            r.check(6, "no MPS socket left", "none under the MPS root", socks, not socks, "sockets left")
            if self.modes_before is None:
                r.skip(6, "compute mode unchanged", "as before the check", "not read (simulated node or NVML error)")
            else:
                after = compute_modes()
                r.check(6, "compute mode unchanged", json.dumps(self.modes_before, sort_keys=True), after,
                        after == self.modes_before, "the GPU's compute mode changed")
        if self.nri is not None:
            self.nri.close()
        if self.cgroups is not None:
            self.cgroups.cleanup()


# ---- entry point ------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-check.json", help="report path (default ./gpu-check.json)")
    p.add_argument("--gpu", type=int, default=0, help="index of the GPU to plan on (default 0)")
    p.add_argument("--mps-control-binary", default=None, help="default: PATH, then " + ", ".join(MPS_SEARCH))
    p.add_argument("--wheels", default=str(WHEELS_DIR), help="carried wheels (default tests/gpu/wheels)")
    p.add_argument("--nvml-lib", default=os.environ.get("GPU_CHECK_NVML_LIB", "libnvidia-ml.so.1"))
    p.add_argument("--keep", action="store_true", help="keep the work directory (daemon log, ledger)")
    p.add_argument("--artifacts", default="", metavar="DIR",
                   help="copy the daemon log and the MPS control logs there at the end")
    a = p.parse_args(argv)

    has_gpu, why = detect_gpu(a.nvml_lib)
    if not has_gpu:
        print(f"gpu-check: no NVIDIA GPU on this machine ({why}); nothing checked")
        return EXIT_NO_GPU
    if sys.version_info < (3, 11):
        print(f"gpu-check: fracplugin needs Python >= 3.11, {sys.executable} is {sys.version.split()[0]} "
              "(make gpu-check GPU_PYTHON=python3.12)")
        return EXIT_FAIL
    if os.geteuid() != 0:
        print("gpu-check: must run as root (MPS control daemon, cgroups, /proc of the clients)")
        return EXIT_FAIL
    site = Path(tempfile.mkdtemp(prefix="fpgc-site"))
    used = unpack_wheels(Path(a.wheels), site)
    paths = [str(REPO / "src"), str(site)]
    sys.path[:0] = paths
    missing = [m for m in ("grpc", "google.protobuf", "kubernetes", "pynvml", "tenacity",
                           "prometheus_client", "yaml", "fracplugin._proto.nri_pb2", "fracplugin.daemon")
               if not _importable(m)]
    if missing:
        print(f"gpu-check: missing Python modules {', '.join(missing)} for {sys.executable} "
              f"{sys.version.split()[0]}; run `make gpu-check-wheels` where pip can download and carry "
              f"{WHEELS_DIR.relative_to(REPO)} (docs/gpu-check.md)")
        return EXIT_FAIL
    print(f"gpu-check: {why}; python {sys.version.split()[0]} ({sys.executable}); "
          f"{len(used)} carried wheel(s) unpacked", flush=True)
    check = GpuCheck(Path(a.out).resolve(), sys.executable, paths, find_mps_binary(a.mps_control_binary),
                     gpu_index=a.gpu, keep=a.keep, artifacts=a.artifacts)
    check.report.facts["wheels"] = used

    def on_sigterm(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # stop the daemon and the clients, write the report, as for Ctrl-C

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return check.run()
    finally:
        shutil.rmtree(site, ignore_errors=True)


def _importable(mod: str) -> bool:
    import importlib

    try:
        importlib.import_module(mod)
        return True
    except Exception as exc:  # a version mismatch (protobuf gencode vs runtime) shows here
        print(f"gpu-check: cannot import {mod}: {type(exc).__name__}: {exc}")
        return False


if __name__ == "__main__":
    sys.exit(main())
