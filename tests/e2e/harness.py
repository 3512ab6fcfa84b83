"""Real-containerd e2e harness: binaries, a private containerd, crictl, cleanup.

Everything a test starts lives under one temporary base directory
(``/tmp/fpe2e-XXXX``, short so unix socket paths stay < 100 chars) that holds
a marker file; ``cleanup_base`` (also run by ``run.sh``'s trap through
``python -m``-style ``harness.py cleanup``) stops the pods, containerd, the
shims and the container processes started from that directory, unmounts what
was mounted below it, and removes it.

Concurrency model: synchronous; each helper runs subprocesses and waits.  Not
thread-safe (one test process drives one containerd at a time).

Facts used (see shared reference docs/reference/nri-protocol.md 1.5, 1.6, 1.10):
containerd 2.x reads config version 3; NRI is the ``io.containerd.nri.v1.nri``
plugin with ``socket_path``; an external plugin must reconnect after a
containerd restart because containerd recreates the socket (1.9).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.helpers import free_port  # noqa: E402,F401  (the one port chooser, issue 34 input 10; h.free_port)
MARKER = ".fracplugin-e2e"
DEFAULT_CACHE = "/var/cache/fracplugin-e2e"
DEFAULT_CONTAINERD_VERSIONS = "v2.3.7 v2.1.9"
DEFAULT_CRICTL_VERSION = "v1.37.0"
IMAGE = "fracplugin.test/busybox:e2e"
SANDBOX_IMAGE = "registry.k8s.io/pause:3.10.2"


class HarnessError(RuntimeError):
    """A harness step failed (message says which step and includes tool output)."""


def cache_dir() -> Path:
    """The build cache (``$FRACPLUGIN_E2E_CACHE``, default /var/cache/fracplugin-e2e)."""
    return Path(os.environ.get("FRACPLUGIN_E2E_CACHE", DEFAULT_CACHE))


def containerd_versions() -> list[str]:
    """containerd versions to test (``$FRACPLUGIN_E2E_CONTAINERD_VERSIONS``, space separated)."""
    return os.environ.get("FRACPLUGIN_E2E_CONTAINERD_VERSIONS", DEFAULT_CONTAINERD_VERSIONS).split()



@dataclass(frozen=True)
class Binaries:
    """Paths of the external programs one containerd version needs."""

    containerd: Path
    ctr: Path
    shim: Path
    crictl: Path
    runc: Path
    busybox: Path
    nriprobe: Path | None

    @classmethod
    def find(cls, version: str) -> "Binaries":
        """Locate the binaries for containerd ``version`` in the cache.

        Raises HarnessError naming every missing file and how to build it.
        """
        c = cache_dir()
        cbin = c / f"containerd-{version}" / "bin"
        crictl_v = os.environ.get("CRICTL_VERSION", DEFAULT_CRICTL_VERSION)
        runc = shutil.which("runc") or "/usr/sbin/runc"
        probe = c / "nriprobe" / "bin" / "nriprobe"
        b = cls(containerd=cbin / "containerd", ctr=cbin / "ctr",
                shim=cbin / "containerd-shim-runc-v2",
                crictl=c / f"crictl-{crictl_v}" / "bin" / "crictl",
                runc=Path(runc), busybox=Path("/bin/busybox"),
                nriprobe=probe if probe.exists() else None)
        missing = [str(p) for p in (b.containerd, b.ctr, b.shim, b.crictl, b.runc, b.busybox)
                   if not (p.exists() and os.access(p, os.X_OK))]
        if missing:
            raise HarnessError(
                "e2e binaries missing: " + ", ".join(missing)
                + f"; build them with `CONTAINERD_VERSION={version} tests/e2e/build.sh` "
                "(or run `make e2e`, which builds then tests)")
        return b


def run(cmd: list[str], *, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing text output; raise HarnessError on failure when ``check``."""
    try:
        cp = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                            timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise HarnessError(f"timed out after {timeout}s: {' '.join(map(str, cmd))}") from e
    if check and cp.returncode != 0:
        raise HarnessError(f"exit {cp.returncode}: {' '.join(map(str, cmd))}\n"
                           f"stdout: {cp.stdout}\nstderr: {cp.stderr}")
    return cp


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    """Poll ``pred()`` until it returns a truthy value; return it.

    A HarnessError raised by ``pred`` ends the wait at once (re-raised); other
    exceptions are retried.  Raises HarnessError on timeout.
    """
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except HarnessError:
            raise  # a definite failure (a process exited, a command failed): stop waiting
        except Exception as e:  # noqa: BLE001 - other predicate failures are retried
            last_exc = e
        time.sleep(interval)
    raise HarnessError(f"timed out after {timeout}s waiting for {what}"
                       + (f" (last error: {last_exc})" if last_exc else ""))


def _version_tuple(v: str) -> tuple[int, ...]:
    """``"v2.3.7"`` -> ``(2, 3, 7)``; unparsable parts count as 0."""
    out = []
    for part in v.lstrip("v").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def new_base() -> Path:
    """Create and mark a fresh short base directory under /tmp."""
    base = Path(tempfile.mkdtemp(prefix="fpe2e-", dir="/tmp"))
    base.chmod(0o755)  # the MPS root below must be reachable by other users (issue 12)
    (base / MARKER).write_text(f"{os.getpid()}\n")
    return base


@dataclass
class Containerd:
    """One private containerd under ``base``: config, process, restart, logs."""

    bins: Binaries
    base: Path
    log_level: str = "info"
    proc: subprocess.Popen | None = field(default=None, repr=False)
    starts: int = 0

    @property
    def sock(self) -> Path:
        return self.base / "c.sock"

    @property
    def nri_sock(self) -> Path:
        return self.base / "nri" / "nri.sock"

    @property
    def log_path(self) -> Path:
        return self.base / "containerd.log"

    @property
    def state(self) -> Path:
        return self.base / "state"

    def render_config(self) -> Path:
        """Write config.toml from containerd-config.toml.tmpl; return its path."""
        tmpl = string.Template((HERE / "containerd-config.toml.tmpl").read_text())
        for d in ("root", "state", "tmp", "opt", "nri/plugins", "nri/conf.d", "cni/bin",
                  "cni/net.d", "certs.d", "logs", "cdi", "cdi-hook"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        for spec in (HERE / "cdi").glob("*.yaml"):  # CDI specs for the CDI-name test (ADR 0005)
            shutil.copyfile(spec, self.base / "cdi" / spec.name)
        write_hook_cdi_spec(self.base / "cdi-hook")
        text = tmpl.substitute(
            root=self.base / "root", state=self.state, tmp=self.base / "tmp", base=self.base,
            sock=self.sock, nri_sock=self.nri_sock, log_level=self.log_level,
            sandbox_image=SANDBOX_IMAGE, runc=self.bins.runc,
            shim_manager_section=self._shim_manager_section())
        path = self.base / "config.toml"
        path.write_text(text)
        return path

    def _shim_manager_section(self) -> str:
        """``socket_dir`` for the shim manager where this version has it (2.3: yes, 2.1: no).

        Without it the shims put their sockets in /run/containerd/s (removed
        when each shim exits; the directory itself stays).  Limit: 42 chars
        (containerd core/runtime/v2/socket_linux.go).
        """
        if _version_tuple(self.version) < (2, 3):
            return "  # (no shim socket_dir in this containerd: sockets go to /run/containerd/s)"
        return (f"  [plugins.'io.containerd.shim.v1.manager']\n"
                f"    socket_dir = \"{self.base / 's'}\"")

    @property
    def version(self) -> str:
        """The containerd version, from the cache directory name (``containerd-vX.Y.Z``)."""
        return self.bins.containerd.parent.parent.name.removeprefix("containerd-")

    def start(self, timeout: float = 60) -> None:
        """Start containerd and wait until it answers ``ctr version`` and CRI is ready.

        Raises HarnessError with the log tail if it exits or does not come up.
        """
        cfg = self.render_config()
        env = dict(os.environ)
        # The shim is found through PATH; put our build first.
        env["PATH"] = f"{self.bins.shim.parent}:{env.get('PATH', '/usr/bin:/bin')}"
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start #{self.starts + 1} {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([str(self.bins.containerd), "--config", str(cfg)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.starts += 1

        def ready():
            if self.proc.poll() is not None:
                raise HarnessError(f"containerd exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            return self.sock.exists() and self.ctr("version", check=False).returncode == 0
        try:
            wait_for(ready, timeout, "containerd to answer on " + str(self.sock))
            wait_for(lambda: self.nri_sock.exists(), timeout, "the NRI socket")
            wait_for(lambda: self.crictl("info", check=False).returncode == 0, timeout,
                     "CRI to answer crictl info")
        except HarnessError as e:
            raise HarnessError(f"{e}\n{self.log_tail()}") from e

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM containerd (shims and containers keep running) and wait for exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """Stop then start containerd on the same directories."""
        self.stop()
        self.start()

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of containerd's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no containerd log)"

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``ctr -a <sock> -n k8s.io <args>``."""
        return run([self.bins.ctr, "-a", self.sock, "-n", "k8s.io", *args], check=check,
                   timeout=timeout)

    def crictl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run crictl against this containerd (own empty config file, no /etc/crictl.yaml)."""
        cfg = self.base / "crictl.yaml"
        if not cfg.exists():
            cfg.write_text(f"runtime-endpoint: unix://{self.sock}\n"
                           f"image-endpoint: unix://{self.sock}\ntimeout: 30\n")
        return run([self.bins.crictl, "--config", cfg, "--runtime-endpoint", f"unix://{self.sock}",
                    "--image-endpoint", f"unix://{self.sock}", "--timeout", "30s", *args],
                   check=check, timeout=timeout)

    def import_image(self) -> None:
        """Build the busybox image archive and import it as IMAGE and SANDBOX_IMAGE."""
        tar = self.base / "image.tar"
        run([sys.executable, HERE / "mkimage.py", tar, IMAGE, SANDBOX_IMAGE,
             "--busybox", self.bins.busybox])
        self.ctr("images", "import", "--all-platforms", str(tar),
                 timeout=120)
        names = self.ctr("images", "ls", "-q").stdout.split()
        missing = {IMAGE, SANDBOX_IMAGE} - set(names)
        if missing:
            raise HarnessError(f"image import did not create {sorted(missing)}; have {names}")
        # CRI sees ctr-imported images in k8s.io through containerd's event stream.
        wait_for(lambda: IMAGE in self.crictl("images", "-o", "json").stdout, 30,
                 "CRI to list the imported image")


# ---------------------------------------------------------------- pods

def pod_config(base: Path, name: str, uid: str, annotations: dict[str, str],
               namespace: str = "default", cgroup_parent: str | None = None) -> Path:
    """Write a CRI PodSandboxConfig (host network, host-less log dir) and return its path.

    ``cgroup_parent``: the pod's cgroup parent (CRI ``linux.cgroup_parent``;
    with the cgroupfs driver the container's cgroups path is
    ``<cgroup_parent>/<container id>``); use ``cgroup_parent_of(base)`` so that
    ``cleanup_base`` removes it."""
    d = base / "pods" / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "attempt": 0},
        "log_directory": str(d / "logs"),
        "annotations": annotations,
        "labels": {"app.kubernetes.io/part-of": "fracplugin-e2e"},
        "linux": {"security_context": {"namespace_options": {"network": 2}}},
    }
    if cgroup_parent:
        cfg["linux"]["cgroup_parent"] = cgroup_parent
    p = d / "pod.json"
    p.write_text(json.dumps(cfg, indent=1))
    return p


def container_config(base: Path, pod: str, name: str, env: dict[str, str] | None = None,
                     command: list[str] | None = None, attempt: int = 0) -> Path:
    """Write a CRI ContainerConfig running busybox ``sleep 3600``; return its path.
    ``attempt``: the CRI metadata's attempt (kubelet's restart count; containerd
    reserves a container's name with it, so a pod may hold several containers of
    one name with different attempts, as it does after a restart)."""
    cfg = {
        "metadata": {"name": name, "attempt": attempt},
        "image": {"image": IMAGE},
        "command": command or ["/bin/sleep", "3600"],
        "envs": [{"key": k, "value": v} for k, v in (env or {}).items()],
        "log_path": f"{name}.log",
        "linux": {},
    }
    p = base / "pods" / pod / (f"{name}.json" if attempt == 0 else f"{name}.{attempt}.json")
    p.write_text(json.dumps(cfg, indent=1))
    return p


HOOK_GPUS = [f"GPU-8f3e2d51-6a0b-4c1e-9d7a-2b5c8e1f0a0{i}" for i in range(1, 5)]


def write_hook_cdi_spec(d: Path) -> Path:
    """Write a CDI spec of kind ``nvidia.com/gpu`` (the toolkit's kind) for
    the four GPUs of examples/nodes/gpu-node-1.yaml whose devices each carry a
    ``createRuntime`` hook named ``apply-cuda-memory-limits`` (the toolkit's
    memory-limit hook, tests/fixtures/cdi/with-hook's shape), into ``d``.

    The hook's path is ``d/nvidia-cdi-hook``, a shell script written here
    that appends its arguments to ``d/hook-calls.log`` (runc runs it, so the
    log shows the runtime applied the spec); each device also sets
    ``FP_CDI_HOOK_GPU<i>=<uuid>``. Returns the spec's path."""
    d.mkdir(parents=True, exist_ok=True)
    hook = d / "nvidia-cdi-hook"
    hook.write_text(f"#!/bin/sh\necho \"$*\" >> {d / 'hook-calls.log'}\n")
    hook.chmod(0o755)
    devices = [{"name": u, "containerEdits": {
        "env": [f"FP_CDI_HOOK_GPU{i}={u}"],
        "hooks": [{"hookName": "createRuntime", "path": str(hook),
                   "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits", f"--gpu-id={u}"]}]}}
               for i, u in enumerate(HOOK_GPUS)]
    spec = d / "nvidia.com-gpu.json"
    spec.write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": devices}, indent=1))
    return spec


def cgroup_parent_of(base: Path) -> str:
    """The cgroup parent pods of ``base`` may use: ``/<base dir name>``
    (runc creates it in every controller; ``cleanup_base`` removes it)."""
    return "/" + Path(base).name


def remove_cgroup_parent(base: Path, log=print) -> None:
    """Remove ``cgroup_parent_of(base)`` (and empty children) from every
    mounted cgroup hierarchy under /sys/fs/cgroup; never raises."""
    name = cgroup_parent_of(base).strip("/")
    for top in Path("/sys/fs/cgroup").glob(name):  # cgroup v2 (unified)
        _rmdir_tree(top, log)
    for top in Path("/sys/fs/cgroup").glob(f"*/{name}"):  # cgroup v1: one hierarchy per controller
        _rmdir_tree(top, log)


def _rmdir_tree(top: Path, log) -> None:
    dirs = sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True)
    for d in [*dirs, top]:
        try:
            d.rmdir()  # cgroupfs: rmdir of a cgroup with no tasks and no children
        except OSError as e:
            log(f"cleanup: cannot remove cgroup {d}: {e}")


def container_env(ctrd: Containerd, cid: str) -> dict[str, str]:
    """The environment of the container's process 1 as seen by ``crictl exec env``."""
    out = ctrd.crictl("exec", cid, "env").stdout
    env = {}
    for line in out.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            env[k] = v
    return env


def container_mountpoints(ctrd: Containerd, cid: str) -> list[str]:
    """Mount points (field 5 of /proc/self/mountinfo) inside the container."""
    out = ctrd.crictl("exec", cid, "cat", "/proc/self/mountinfo").stdout
    return [line.split()[4] for line in out.splitlines() if len(line.split()) > 4]


# ---------------------------------------------------------------- cleanup

def _pids_referencing(base: Path) -> list[int]:
    """PIDs (not ours) whose command line mentions ``base`` (shims, plugins, containerd)."""
    me = os.getpid()
    needle = str(base).encode()
    pids = []
    for ent in os.listdir("/proc"):
        if not ent.isdigit() or int(ent) == me:
            continue
        try:
            with open(f"/proc/{ent}/cmdline", "rb") as f:
                if needle in f.read():
                    pids.append(int(ent))
        except OSError:
            continue
    return pids


def _mounts_under(base: Path) -> list[str]:
    """Mount points at or below ``base``, deepest first."""
    out = []
    prefix = str(base).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp.startswith(prefix) or mp == str(base):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


def cleanup_base(base: Path, ctrd: Containerd | None = None, log=print) -> None:
    """Tear down everything started under ``base``; never raises.

    Order: remove all pods through CRI (if containerd still answers), stop
    containerd, kill leftover runc containers (``runc --root``) and processes
    whose command line names ``base`` (shims, plugins; by PID), lazily unmount
    everything mounted below ``base``, remove ``base``.  Only acts on a
    directory holding the MARKER file.
    """
    base = Path(base)
    if not (base / MARKER).exists():
        log(f"cleanup: {base} has no {MARKER}; not touching it")
        return
    try:
        if ctrd is not None and ctrd.proc is not None and ctrd.proc.poll() is None:
            ctrd.crictl("rmp", "-fa", check=False, timeout=60)
            ctrd.stop()
    except Exception as e:  # noqa: BLE001 - cleanup must go on
        log(f"cleanup: pod removal failed: {e}")
    runc = shutil.which("runc")
    runc_root = base / "state" / "runc-root"
    if runc and runc_root.exists():
        for ns_root in runc_root.iterdir():
            cp = run([runc, "--root", ns_root, "list", "-q"], check=False)
            for cid in cp.stdout.split():
                run([runc, "--root", ns_root, "kill", cid, "KILL"], check=False)
                run([runc, "--root", ns_root, "delete", "--force", cid], check=False)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_referencing(base)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(1.0)
    for mp in _mounts_under(base):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    remove_cgroup_parent(base, log)
    left = _mounts_under(base)
    if left:
        log(f"cleanup: still mounted: {left}")
    shutil.rmtree(base, ignore_errors=True)
    # containerd < 2.3 has no shim socket_dir setting: its shims use
    # /run/containerd/s (each removes its socket on exit). Remove the
    # directories only when empty, i.e. when no other containerd uses them.
    for d in ("/run/containerd/s", "/run/containerd"):
        try:
            os.rmdir(d)
        except OSError:
            break
    if base.exists():
        log(f"cleanup: could not fully remove {base}")


def _owner_alive(base: Path) -> bool:
    """True while the process that made ``base`` (the pid in its MARKER) runs:
    another e2e run beside this one, whose directories are not ours to clean."""
    try:
        os.kill(int((base / MARKER).read_text().split()[0]), 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def cleanup_all(log=print) -> None:
    """Clean every marked /tmp/fpe2e-* directory whose maker has exited (used by
    run.sh's trap, after its pytest ended); a concurrent run's are left alone."""
    for base in Path("/tmp").glob("fpe2e-*"):
        if (base / MARKER).exists() and not _owner_alive(base):
            log(f"cleanup: {base}")
            cleanup_base(base, log=log)


if __name__ == "__main__":
    if sys.argv[1:] == ["cleanup"]:
        cleanup_all()
    else:
        print("usage: harness.py cleanup", file=sys.stderr)
        sys.exit(2)
