"""Helpers for the interop tests: build the Go harness binaries, run them,
start fracplugin's daemon (fixtures are in conftest.py).

Layout (tests/interop/):
  nri-v012/, nri-v08/  Go modules on github.com/containerd/nri v0.12.5 / v0.8.0:
                       cmd/nri-runtime (the runtime side, pkg/adaptation) and
                       cmd/template-plugin (stub-based stand-in for the stock
                       template sample); both share their main.go with
                       common/nri/ through symlinks
  kubelet/             Go module on k8s.io/kubelet v0.37.2: cmd/kubelet-sim
                       (kubelet's device manager side) and cmd/fake-deviceplugin
                       (self-test only)
  bin/                 build output (gitignored), one folder per module

A missing Go toolchain is a test failure, not a skip (issue 3 item 4).

Concurrency: pytest runs tests serially; each helper process gets a reader
thread that collects its stdout lines (JSON) into a list under a lock.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

from fracplugin_demo.subproc import die_with_parent

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BIN = HERE / "bin"
NODE_YAML = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
PODS_DIR = REPO / "examples" / "pods"
FRACPLUGIN = REPO / ".venv" / "bin" / "fracplugin"
FAKE_MPS = REPO / "tests" / "fakes" / "nvidia-cuda-mps-control"
"""The Python fake MPS control binary (daemon and client)."""

# NRI line -> Go module directory
NRI_LINES = {"v012": "nri-v012", "v08": "nri-v08"}
MODULES = ("nri-v012", "nri-v08", "kubelet")

_built: dict[str, Path] = {}
_build_lock = threading.Lock()


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GOTOOLCHAIN"] = "local"
    env.setdefault("GOFLAGS", "-mod=mod")
    if "-mod=" not in env["GOFLAGS"]:
        env["GOFLAGS"] += " -mod=mod"
    return env


def build_module(module: str) -> Path:
    """Build every command of one Go module into tests/interop/bin/<module>/.

    Relies on Go's build cache (a no-op rebuild takes about a second).
    Returns the output directory. Fails the test when Go is missing or the
    build fails.
    """
    with _build_lock:
        if module in _built:
            return _built[module]
        go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
        if go is None:
            pytest.fail("Go toolchain not found: interop tests need `go` (>= 1.24) on PATH")
        out = BIN / module
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        proc = subprocess.run(
            [go, "build", "-o", str(out) + "/", "./cmd/..."],
            cwd=HERE / module, env=go_env(), capture_output=True, text=True, timeout=900,
        )
        if proc.returncode != 0:
            pytest.fail(f"go build in {module} failed:\n{proc.stdout}\n{proc.stderr}")
        print(f"built {module} in {time.monotonic() - t0:.1f}s")
        _built[module] = out
        return out


def short_dir(prefix: str = "fp") -> str:
    """A short directory under /tmp (unix socket paths must stay < 108 bytes)."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(d, 0o755)  # the MPS root must be reachable by other users (issue 12)
    return d


class Proc:
    """A child process whose stdout is JSON lines, collected by a thread.

    ``events`` holds every parsed object in order; non-JSON lines are kept
    as {"event": "raw", "line": ...}.
    """

    def __init__(self, argv: list[str], *, stdin: bool = False, env: dict[str, str] | None = None,
                 stderr_path: Path | None = None, cwd: Path | None = None) -> None:
        self.argv = argv
        self.stderr_path = stderr_path
        self._err = open(stderr_path, "ab") if stderr_path else subprocess.DEVNULL
        self.p = subprocess.Popen(
            die_with_parent(argv), stdout=subprocess.PIPE, stderr=self._err,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"event": "raw", "line": line}
            with self._cv:
                self.events.append(ev)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30.0,
                   nth: int = 1) -> dict[str, Any]:
        """Return the nth event matching pred; fail after timeout or when the process ended without it."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                hits = [ev for ev in self.events if pred(ev)]
                if len(hits) >= nth:
                    return hits[nth - 1]
                if self.p.poll() is not None and not self._t.is_alive():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.2))
        pytest.fail(f"{Path(self.argv[0]).name}: expected event not seen; events so far:\n"
                    + "\n".join(json.dumps(e) for e in self.events[-30:]) + self.stderr_tail())

    def send_line(self, text: str = "") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((text + "\n").encode())
        self.p.stdin.flush()

    def finish(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait for exit (close stdin first); return the events. Fails on timeout."""
        if self.p.stdin:
            try:
                self.p.stdin.close()
            except OSError:
                pass
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{Path(self.argv[0]).name} did not finish in {timeout}s; events:\n"
                        + "\n".join(json.dumps(e) for e in self.events[-30:]) + self.stderr_tail())
        self._t.join(5)
        return list(self.events)

    def stderr_tail(self, n: int = 4000) -> str:
        if self.stderr_path and self.stderr_path.exists():
            return "\n--- stderr tail ---\n" + self.stderr_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        """Terminate this process (and its process group: we started it in a new session)."""
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(5)
        self._t.join(5)  # the reader sees EOF once the process group is gone
        for pipe in (self.p.stdin, self.p.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        if self._err is not subprocess.DEVNULL:
            self._err.close()


def fake_mps_client() -> Path:
    """The compiled fake MPS client (tests/fakes/mps_client.c, built with gcc
    into build/fake-mps/ on first use, cached by source hash): answers client
    commands itself (about 1 ms of CPU each, as the real binary; the Python
    fake costs 25-100 ms) and execs FAKE_MPS for everything else (daemon,
    faults). Raises tests.fakes.mps_client.BuildError without a C compiler."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_mps_client_build", REPO / "tests" / "fakes" / "mps_client.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.build_mps_client())


def fracplugin_argv(workdir: Path, *, nri_socket: Path | None, extra: list[str] | None = None,
                    mps: bool = True, mps_binary: Path | None = None) -> list[str]:
    """The daemon command line the interop tests use (external NRI plugin mode
    when nri_socket is given), with the fake nvidia-cuda-mps-control
    (``mps_binary``: another one, e.g. ``fake_mps_client()``; default FAKE_MPS).

    FRACPLUGIN_INTEROP_NO_MPS=1 (a debugging knob, off by default and in CI)
    runs the daemon with --no-mps instead."""
    if os.environ.get("FRACPLUGIN_INTEROP_NO_MPS") == "1":
        mps = False
    state = workdir / "state"
    mps_root = workdir / "mps"
    state.mkdir(exist_ok=True)
    mps_root.mkdir(exist_ok=True)
    argv = [str(FRACPLUGIN), "run", "--simulate-node", str(NODE_YAML), "--state-dir", str(state)]
    if mps:
        argv += ["--mps-control-binary", str(mps_binary or FAKE_MPS), "--mps-root", str(mps_root)]
    else:
        argv += ["--no-mps", "--mps-root", str(mps_root)]
    argv += ["--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0", "--log-format", "text"]
    if nri_socket is not None:
        argv += ["--no-device-plugin", "--nri-socket", str(nri_socket)]
    return argv + list(extra or [])


def start_fracplugin(procs: list[Proc], workdir: Path, **kw: Any) -> Proc:
    if not FRACPLUGIN.exists():
        pytest.fail(f"{FRACPLUGIN} not found (run `make setup`)")
    p = Proc(fracplugin_argv(workdir, **kw), stderr_path=workdir / "fracplugin.log")
    procs.append(p)
    return p


def load_yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------- NRI helpers

def scenario_pod(doc: dict[str, Any], *, containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A harness scenario pod from a Pod document (its annotations become the
    pod annotations containerd passes in PodSandbox)."""
    md = doc.get("metadata") or {}
    ctrs = containers
    if ctrs is None:
        ctrs = [{"name": c["name"]} for c in (doc.get("spec") or {}).get("containers") or []]
    return {
        "name": md["name"], "namespace": md.get("namespace", "default"), "uid": md.get("uid", md["name"] + "-uid"),
        "labels": dict(md.get("labels") or {}), "annotations": dict(md.get("annotations") or {}),
        "containers": ctrs,
    }


def seed_pod(filename: str, **kw: Any) -> dict[str, Any]:
    """scenario_pod of examples/pods/<filename>."""
    return scenario_pod(load_yaml(PODS_DIR / filename), **kw)


def template_bin(line: str) -> Path:
    return build_module(NRI_LINES[line]) / "template-plugin"


def runtime_bin(line: str) -> Path:
    return build_module(NRI_LINES[line]) / "nri-runtime"


RETRIES = 5
"""Extra tries the runtime harness gives a CreateContainer/StartContainer
that a plugin answered UNAVAILABLE (6 tries in all), RETRY_INTERVAL apart:
kubelet retries a failed container start too (with back-off)."""
RETRY_INTERVAL = "1s"


def endpoints_file(workdir: Path) -> Path:
    """Where the daemon started by ``start_fracplugin(procs, workdir)`` writes
    its endpoints (``<state-dir>/endpoints.json``; ``health`` = HOST:PORT)."""
    return workdir / "state" / "endpoints.json"


def start_runtime(procs: list[Proc], line: str, workdir: Path, scenario: dict[str, Any], *,
                  socket: Path | None = None, plugin_dir: Path | None = None, config_dir: Path | None = None,
                  wait_plugins: int = 1, extra: list[str] | None = None, stdin: bool = False,
                  ready_endpoints: Path | None = None, retries: int = RETRIES,
                  retry_interval: str = RETRY_INTERVAL) -> Proc:
    """Start the Go runtime harness of one NRI line and wait for its "ready" event.

    The harness waits for `wait_plugins` external plugins before it runs the
    scenario; start them after this returns. With ``ready_endpoints`` (a
    daemon's endpoints.json) it then also waits until the daemon's
    ``GET /readyz`` answers 200 (event ``daemon_ready``; ``fatal`` after 60 s),
    the way a rollout waits for the readiness probe, again after a
    ``-reconnect``. ``retries``/``retry_interval``: kubelet-style retries of
    CreateContainer/StartContainer answered UNAVAILABLE (``retry`` events;
    ``report_retries`` turns them into warnings).
    """
    binary = runtime_bin(line)
    scen = workdir / f"scenario-{line}.json"
    scen.write_text(json.dumps(scenario))
    argv = [str(binary), "-scenario", str(scen), "-wait-plugins", str(wait_plugins),
            "-wait-timeout", "60s", "-registration-timeout", "20s",
            "-retries", str(retries), "-retry-interval", retry_interval]
    if ready_endpoints is not None:
        argv += ["-ready-endpoints", str(ready_endpoints), "-ready-timeout", "60s"]
    if socket is not None:
        argv += ["-socket", str(socket)]
    if plugin_dir is not None:
        argv += ["-plugin-dir", str(plugin_dir)]
    if config_dir is not None:
        argv += ["-plugin-config-dir", str(config_dir)]
    argv += list(extra or [])
    p = Proc(argv, stdin=stdin, stderr_path=workdir / f"runtime-{line}.log")
    procs.append(p)
    p.wait_event(lambda e: e.get("event") in ("ready", "fatal"), timeout=60)
    return p


class InteropRetryWarning(UserWarning):
    """A harness had to retry a call (the plugin answered UNAVAILABLE): the
    case passed, but only after a retry, which pytest's summary shows."""


def report_retries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn every ``retry`` event of a runtime harness into an
    InteropRetryWarning (shown in pytest's warnings summary); returns them."""
    retries = [e for e in events if e.get("event") == "retry"]
    for e in retries:
        warnings.warn(InteropRetryWarning(
            f"{e.get('op')} of {e.get('pod')}/{e.get('container')} retried after attempt {e.get('attempt')} "
            f"({e.get('ms')} ms): {e.get('error')}"), stacklevel=2)
    return retries


def check_no_fatal(events: list[dict[str, Any]], *procs_: Proc) -> None:
    """Fail on a harness ``fatal`` event; also report its retries as warnings
    (``report_retries``)."""
    report_retries(events)
    fatal = [e for e in events if e.get("event") == "fatal"]
    if fatal:
        pytest.fail(f"harness fatal: {fatal[0]['error']}" + "".join(p.stderr_tail() for p in procs_))


def creates(events: list[dict[str, Any]], round_: int | None = None) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "create" and (round_ is None or e.get("round") == round_)]


def env_of(create_event: dict[str, Any]) -> dict[str, str]:
    """The merged adjustment's env as a dict (the harness also lists them in order)."""
    return dict(create_event.get("env") or {})


def mounts_of(create_event: dict[str, Any]) -> list[dict[str, Any]]:
    return list(((create_event.get("adjust") or {}).get("mounts")) or [])


def adjustment_is_empty(adjust: dict[str, Any] | None) -> bool:
    """True when the merged adjustment changes nothing: the runtime
    pre-populates empty hooks and linux.resources.memory/cpu (reference
    docs/reference/nri-protocol.md 1.8), which are tolerated."""
    a = json.loads(json.dumps(adjust or {}))
    hooks = a.pop("hooks", None) or {}
    linux = a.pop("linux", None) or {}
    res = {k: v for k, v in (linux.pop("resources", None) or {}).items() if v}
    return not a and not any(hooks.values()) and not linux and not res


def wrapper_script(path: Path, argv: list[str], log: Path) -> None:
    """A pre-installed plugin file NN-name: the runtime starts it with an empty
    environment (no PATH) and the socket on fd 3, so it execs by absolute path."""
    import shlex

    path.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in argv) + " >>" + shlex.quote(str(log)) + " 2>&1\n")
    path.chmod(0o755)
