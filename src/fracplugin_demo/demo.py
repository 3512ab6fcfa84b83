"""``fracplugin demo``: the real daemon on a simulated node, driven through both doors.

What it does, in one command (issue 6 item 2):

1. starts ``fracplugin run`` as a subprocess (``sys.executable -m
   fracplugin.cli run``) on ``examples/nodes/gpu-node-1.yaml`` with
   the fake ``nvidia-cuda-mps-control`` (``tests/fakes/``), every socket,
   pipe directory and state file in one temporary directory;
2. acts as the container runtime (``fracplugin_demo.nri_runtime.NriRuntimeServer``:
   mux + ttrpc + NRI protobufs on a real unix socket) and as kubelet
   (``fracplugin_demo.kubelet.KubeletSim``: Registration server + device
   plugin client over gRPC), and gives the daemon a simulated API server
   (``--pods-file``) for the device plugin door;
3. plays the seed pods of ``examples/pods/``: the inference pod
   (sm-sharing on all four GPUs) is placed; the time-slicing notebook is then
   refused by the node-side guard (one compute mode per GPU; the reason names
   the GPU and the mode in use); the inference pod is removed; the notebook is
   created again and placed. Then a pod whose limit is below its request is
   refused, and a pod asking for the extended resource
   ``fracplugin.io/gpu-memory`` goes through the device plugin's Allocate;
4. prints, per container, what it received (devices, env, mounts) or why it
   was refused, the GPU tenancy table after each step (from the daemon's
   ``/status``) and a few metrics (``/metrics``); stops the daemon with
   SIGTERM and checks that no process or socket is left behind.

Exit status: 0 when every step behaved as described; 1 when one did not (the
daemon's log tail is printed); 2 for a usage problem (examples directory or
node file not found).

Concurrency: the demo itself is sequential (main thread); the NRI runtime and
kubelet drivers run their own I/O threads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml

from fracplugin_demo.subproc import die_with_parent

PKG_DIR = Path(__file__).resolve().parent
RESOURCE = "fracplugin.io/gpu-memory"
NODE_FILE = Path("nodes") / "gpu-node-1.yaml"
INFERENCE = "inference-sm-sharing-4gpu.bound.yaml"
NOTEBOOK = "notebook-time-slicing-2gpu.yaml"
NRI_REQUEST_TIMEOUT_S = 5.0
CREATE_ATTEMPTS = 3  # kubelet retries a container whose creation failed (with backoff)


class DemoError(Exception):
    """A usage problem (exit 2)."""


class StepFailed(Exception):
    """A step did not behave as the demo expects (exit 1)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--examples", metavar="DIR", default=None,
                   help="directory with nodes/ and pods/ (default: the repo's examples/)")
    p.add_argument("--mps-control-binary", metavar="PATH", default=None,
                   help="MPS control executable (default: the repo's fake, tests/fakes/nvidia-cuda-mps-control, "
                        "behind its compiled client when gcc is there)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, ledger) afterwards")
    p.add_argument("--ready-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the daemon to be ready")


# ---- locating inputs ------------------------------------------------------------------
def find_examples(explicit: str | None = None) -> Path:
    """The examples directory (holding ``nodes/`` and ``pods/``): ``--examples``,
    else the repo's ``examples/`` relative to the package source, else
    ``./examples``. Raises DemoError naming what was tried."""
    cands: list[Path] = []
    if explicit:
        cands.append(Path(explicit))
    else:
        repo = PKG_DIR.parents[1]  # src/fracplugin_demo -> repo
        cands += [repo / "examples", Path.cwd() / "examples"]
    for c in cands:
        if (c / NODE_FILE).is_file():
            return c.resolve()
    raise DemoError(f"cannot find {NODE_FILE} in: " + ", ".join(str(t) for t in cands)
                    + "; pass --examples DIR (the repo's examples/ directory)")


def find_fake_mps(explicit: str | None = None) -> Path | None:
    """The MPS control binary: ``--mps-control-binary``, else the repo's fake
    (``tests/fakes/nvidia-cuda-mps-control`` relative to the package source or
    the current directory; its compiled client in front when it can be built,
    ``_compiled_fake``); None when none is found."""
    if explicit:
        p = Path(explicit)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise DemoError(f"--mps-control-binary {explicit} is not an executable file")
        return p.resolve()
    for base in (PKG_DIR.parents[1], Path.cwd()):
        p = base / "tests" / "fakes" / "nvidia-cuda-mps-control"
        if p.is_file() and os.access(p, os.X_OK):
            return _compiled_fake(p) or p.resolve()
    return None


def _compiled_fake(py_fake: Path) -> Path | None:
    """The compiled front of the repo's fake (``tests/fakes/mps_client.py``
    builds it with gcc into ``build/fake-mps/``): its control commands start in
    about a millisecond, like the real binary's, where the Python fake's take
    seconds on a loaded machine and a probe could time out. None when it
    cannot be built (no C compiler): the Python fake is used then."""
    builder = py_fake.parent / "mps_client.py"
    if not builder.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location("fracplugin_demo_fake_mps_client", builder)
        if spec is None or spec.loader is None:
            return None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return Path(mod.build_mps_client()).resolve()
    except Exception:  # noqa: BLE001 - any failure to build: the Python fake still works
        return None


# ---- small helpers ----------------------------------------------------------------------
def _http(address: str, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait(pred: Callable[[], Any], timeout_s: float, step_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(step_s)


def _load_pod(path: Path) -> dict[str, Any]:
    for d in yaml.safe_load_all(path.read_text()):
        if isinstance(d, dict) and d.get("kind", "Pod") == "Pod":
            return d
    raise DemoError(f"{path} holds no Pod")


class Out:
    """Prints to stdout, flushing (the demo is read as it runs)."""

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)

    def block(self, text: str, indent: str = "  ") -> None:
        for line in text.splitlines():
            self(indent + line)


def _own_leftovers(workdir: str, daemon_pid: int | None) -> list[str]:
    """Live processes this demo started that are still there: the daemon, or
    any process whose command line or environment mentions the work directory
    (MPS daemons and servers get their pipe directory there)."""
    left = []
    me = os.getpid()
    needle = workdir.encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == me:
            continue
        try:
            stat = (p / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (p / "cmdline").read_bytes()
            env = (p / "environ").read_bytes()
        except (OSError, IndexError):
            continue
        if int(p.name) == daemon_pid or needle in cmd or needle in env:
            shown = cmd.replace(b"\0", b" ").decode(errors="replace")[:120]
            left.append(f"{p.name}: {shown}")
    return left


# ---- the demo ---------------------------------------------------------------------------
class Demo:
    """One demo run (see the module docstring). ``run()`` returns the exit status."""

    def __init__(self, examples: Path, mps_binary: Path | None, keep: bool = False, ready_timeout_s: float = 30.0) -> None:
        self.examples = examples
        self.node_file = examples / NODE_FILE
        self.pods_dir = examples / "pods"
        self.mps_binary = mps_binary
        self.keep = keep
        self.ready_timeout_s = ready_timeout_s
        self.out = Out()
        self.work = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoints: dict[str, Any] = {}
        self.runtime: Any = None
        self.kubelet: Any = None
        self.results: list[dict[str, Any]] = []
        self._log_file: Any = None

    # ---- set-up ------------------------------------------------------------------
    def _dp_pod(self) -> dict[str, Any]:
        """A pod for the device plugin door: 8 units (8 GiB) of the extended
        resource, bound to this node, pending (what kubelet admits)."""
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "embeddings", "namespace": "default", "uid": "5e2d9c1a-7b3f-4d6e-8a90-1c2b3d4e5f60",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"nodeName": "gpu-node-1", "schedulerName": "default-scheduler",
                     "containers": [{"name": "worker", "image": "nvcr.io/nvidia/cuda:13.0.2-base-ubuntu24.04",
                                     "resources": {"limits": {RESOURCE: "8"}}}]},
            "status": {"phase": "Pending"},
        }

    def _tight_pod(self) -> dict[str, Any]:
        """A pod whose limit is below its request (refused by the node-side guard)."""
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "tight", "namespace": "default", "uid": "9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
                         "annotations": {"nvidia.com/container.app.gpu-memory.request": "20Gi",
                                         "nvidia.com/container.app.gpu-memory.limit": "10Gi"}},
            "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "app", "image": "busybox"}]},
        }

    def start(self) -> None:
        from .kubelet import KubeletSim
        from .nri_runtime import NriRuntimeServer

        self.work = tempfile.mkdtemp(prefix="fpdemo", dir="/tmp")
        os.chmod(self.work, 0o755)  # the MPS root must be reachable by other users
        os.chmod(self.work, 0o755)  # MPS pipe dirs below must be reachable by containers' users
        w = Path(self.work)
        pods_file = w / "pods.yaml"
        # the simulated API server holds every pod the demo plays, bound to the
        # node (kubelet creates containers only of pods it got from the API): the
        # NRI door reads their spec for pod-level KAI forms (issue 25 item 1)
        seeds = [_load_pod(self.pods_dir / INFERENCE), _load_pod(self.pods_dir / NOTEBOOK), self._tight_pod()]
        for seed in seeds:
            seed.setdefault("spec", {})["nodeName"] = "gpu-node-1"
        pods_file.write_text(yaml.safe_dump_all([*seeds, self._dp_pod()]))
        # containerd's plugin_request_timeout (default 2 s): the fake MPS control
        # binary is a Python script, far slower to start than the real one, and
        # a sm-sharing CreateContainer runs two of its commands.
        self.runtime = NriRuntimeServer(str(w / "nri.sock"), request_timeout_s=NRI_REQUEST_TIMEOUT_S).start()
        self.kubelet = KubeletSim(str(w / "device-plugins")).start()
        cmd = [sys.executable, "-m", "fracplugin.cli", "run",
               "--simulate-node", str(self.node_file), "--state-dir", str(w / "state"),
               "--nri-socket", str(w / "nri.sock"), "--device-plugin-dir", str(w / "device-plugins"),
               "--pod-resources-socket", str(w / "pod-resources.sock"), "--pods-file", str(pods_file),
               "--mps-root", str(w / "mps"), "--health-address", "127.0.0.1:0",
               "--metrics-address", "127.0.0.1:0", "--log-format", "text", "--shutdown-timeout", "10"]
        if self.mps_binary is not None:
            cmd += ["--mps-control-binary", str(self.mps_binary)]
        else:
            cmd += ["--no-mps"]
        env = dict(os.environ)
        src = str(PKG_DIR.parent)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        for k in [k for k in env if k.startswith("FRACPLUGIN_")]:
            del env[k]  # the demo's flags, not the caller's environment, configure this daemon
        self._log_file = open(w / "daemon.log", "wb")
        t0 = time.monotonic()
        proc = subprocess.Popen(die_with_parent(cmd), stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        self.proc = proc
        ep = w / "state" / "endpoints.json"
        if not _wait(lambda: ep.exists() or proc.poll() is not None, self.ready_timeout_s):
            raise StepFailed(f"the daemon did not start within {self.ready_timeout_s} s")
        if proc.poll() is not None:
            raise StepFailed(f"the daemon exited at start with status {proc.returncode}")
        self.endpoints = json.loads(ep.read_text())
        ready = _wait(lambda: _http(self.endpoints["health"], "/readyz")[0] == 200, self.ready_timeout_s, 0.1)
        readiness = json.loads(_http(self.endpoints["health"], "/readyz")[1])
        o = self.out
        node = yaml.safe_load(self.node_file.read_text())
        gpus = node.get("gpus") or []
        o(f"fracplugin demo: node {node.get('node')} ({len(gpus)} x {gpus[0]['name'] if gpus else '?'}, "
          f"{gpus[0]['memory_mib'] if gpus else '?'} MiB each), simulated from {self.node_file}")
        o(f"  work directory {self.work} (every socket, MPS pipe directory and state file is in it)")
        o(f"  MPS control: {self.mps_binary or 'not supervised (no fake binary found: --no-mps)'}")
        o(f"  daemon pid {self.proc.pid}: {' '.join(cmd[1:4])} ...")
        for k in ("nri_socket", "device_plugin_socket", "kubelet_socket", "health", "metrics"):
            if k in self.endpoints:
                o(f"    {k:<21} {self.endpoints[k]}")
        if not ready:
            raise StepFailed(f"the daemon was not ready within {self.ready_timeout_s} s: {readiness}")
        o(f"  ready after {time.monotonic() - t0:.1f} s: " + "; ".join(
            f"{k} {v['detail']}" for k, v in readiness["checks"].items()))
        o(f"  the demo plays containerd over NRI on {self.runtime.socket_path} (request timeout "
          f"{NRI_REQUEST_TIMEOUT_S:g} s) and kubelet over gRPC on {self.kubelet.socket_path}")
        self.runtime.wait_registered(5)
        self.kubelet.wait_registered(5)

    # ---- printing ------------------------------------------------------------------
    def tenancy(self) -> dict[str, Any]:
        from fracplugin.status import render_gpus

        code, body = _http(self.endpoints["health"], "/status")
        doc: dict[str, Any] = json.loads(body)
        self.out("  GPU tenancy (from the daemon's /status):")
        self.out.block(render_gpus(doc), "    ")
        for d in (doc.get("mps") or {}).get("daemons") or []:
            ns = d.get("namespaces") or []
            if d.get("mode") == "sm-sharing":
                self.out(f"  MPS sm-sharing daemon ({'healthy' if d.get('healthy') else 'UNHEALTHY'}): "
                         + (", ".join(f"namespace {n['name']} for {n['container']} (ATP {n['active_thread_percentage']})"
                                      for n in ns) or "no namespaces"))
        return doc

    def _print_plan(self, devices: list[str], env: dict[str, str], mounts: list[str]) -> None:
        o = self.out
        o("    devices: " + (", ".join(devices) if devices else "(none)"))
        o("    env:")
        for k in sorted(env):
            o(f"      {k}={env[k]}")
        o("    mounts:" + ("" if mounts else " (none)"))
        for m in mounts:
            o(f"      {m}")

    def step(self, title: str) -> None:
        self.out()
        self.out(f"== {title}")

    # ---- the NRI door ------------------------------------------------------------------
    def nri_create(self, manifest: dict[str, Any], expect: str, source: str) -> dict[str, Any]:
        """CreateContainer for every container of ``manifest``; ``expect`` is
        ``placed`` or ``refused``. Returns the result record of the (last) container."""
        from .nri_runtime import container_msg, effective_env, pod_sandbox
        from fracplugin.nri.ttrpc import Code, RpcError

        pod = pod_sandbox(manifest)
        md = manifest["metadata"]
        rec: dict[str, Any] = {}
        self.step(f"NRI CreateContainer {md.get('namespace', 'default')}/{md['name']} ({source})")
        self._sandboxes = getattr(self, "_sandboxes", {})
        for spec in manifest["spec"]["containers"]:
            ctr = container_msg(pod, spec)
            name = f"{md.get('namespace', 'default')}/{md['name']}/{spec['name']}"
            try:
                resp = self._create_with_retries(pod, ctr, name)
            except RpcError as exc:
                code = Code(exc.code).name if exc.code in Code._value2member_map_ else str(exc.code)
                self.out(f"  container {name}: REFUSED ({code})")
                self.out(f"    reason: {exc.message}")
                rec = {"door": "nri", "container": name, "outcome": "refused", "code": code, "reason": exc.message}
            else:
                adj = resp.adjust
                env = {k: v for k, v in effective_env(ctr, adj).items()}
                mounts = [f"{m.source} -> {m.destination} ({','.join(m.options)})" for m in adj.mounts]
                devices = [d for d in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if d]
                if not adj.env and not adj.mounts:
                    kept = ", ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(("NVIDIA_", "CUDA_")))
                    self.out(f"  container {name}: no fraction annotations: left untouched"
                             + (f" (keeps {kept})" if kept else ""))
                    rec = {"door": "nri", "container": name, "outcome": "untouched"}
                else:
                    self.out(f"  container {name}: PLACED (container id {ctr.id[:12]})")
                    self._print_plan(devices, env, mounts)
                    self._start_with_retries(pod, ctr, name, [m.source for m in adj.mounts])
                    rec = {"door": "nri", "container": name, "outcome": "placed", "devices": devices, "env": env,
                           "mounts": mounts}
                self._sandboxes[md["name"]] = (pod, ctr)
            self.results.append(rec)
            if rec["outcome"] != expect:
                raise StepFailed(f"{name}: expected {expect}, got {rec['outcome']}: {rec.get('reason', '')}")
        self.tenancy()
        return rec

    def _create_with_retries(self, pod: Any, ctr: Any, name: str) -> Any:
        """CreateContainer; an UNAVAILABLE answer (transient: e.g. the MPS
        namespace not ready in time) is retried as kubelet retries a failed
        container creation. Raises the last RpcError."""
        from fracplugin.nri.ttrpc import Code, RpcError

        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                return self.runtime.create_container(pod, ctr)
            except RpcError as exc:
                if exc.code != Code.UNAVAILABLE or attempt == CREATE_ATTEMPTS:
                    raise
                self.out(f"  container {name}: UNAVAILABLE (transient), retrying as kubelet would: {exc.message}")
                time.sleep(0.5 * attempt)
        raise AssertionError("unreachable")

    def _start_with_retries(self, pod: Any, ctr: Any, name: str, sources: list[str] | None = None) -> None:
        """StartContainer (the plugin waits there for an sm-sharing container's
        MPS namespace, within a budget: a namespace still being made then
        comes after the start, ADR 0028); UNAVAILABLE is retried as kubelet
        retries a failed start. With MPS supervised, an sm-sharing
        container's namespace ``control`` socket (in its pipe directory, one
        of ``sources``) is awaited before the demo goes on. Raises
        StepFailed when it never starts."""
        from fracplugin.nri.ttrpc import Code, RpcError

        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                self.runtime.start_container(pod, ctr)
                self.out("    StartContainer: started" + self._namespace_note(pod, ctr, sources or []))
                return
            except RpcError as exc:
                if exc.code != Code.UNAVAILABLE or attempt == CREATE_ATTEMPTS:
                    raise StepFailed(f"{name}: StartContainer failed: {exc.message}") from None
                self.out(f"    StartContainer: UNAVAILABLE (transient), retrying as kubelet would: {exc.message}")
                time.sleep(0.5 * attempt)

    def _namespace_note(self, pod: Any, ctr: Any, sources: list[str]) -> str:
        """Wait (up to 30 s) for an sm-sharing container's namespace
        ``control`` socket when MPS is supervised; say when it came."""
        if not self._is_sm(pod, ctr) or self.mps_binary is None:
            return ""
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            if any(os.path.exists(os.path.join(s, "control")) for s in sources):
                late = time.monotonic() - t0
                return (" (its MPS namespace is in place)" if late < 0.001
                        else f" (its MPS namespace followed {late * 1000:.0f} ms later, ADR 0028)")
            time.sleep(0.01)
        return " (its MPS namespace did not appear within 30 s)"

    @staticmethod
    def _is_sm(pod: Any, ctr: Any) -> bool:
        key = f"nvidia.com/container.{ctr.name}.gpu-compute.mode"
        mode: str | None = pod.annotations.get(key)
        return mode == "sm-sharing"

    def nri_remove(self, manifest: dict[str, Any]) -> None:
        md = manifest["metadata"]
        pod, ctr = self._sandboxes.pop(md["name"])
        self.step(f"NRI StopContainer + RemoveContainer + RemovePodSandbox {md.get('namespace', 'default')}/{md['name']}")
        self.runtime.stop_container(pod, ctr)
        self.runtime.remove_container(pod, ctr)
        self.runtime.remove_pod_sandbox(pod)
        self.out(f"  container {md.get('namespace', 'default')}/{md['name']}/{ctr.name} removed; "
                 "its tenancies are released")
        self._wait_namespaces_released(md.get("uid"))
        doc = self.tenancy()
        uid = md.get("uid")
        if any(t["pod_uid"] == uid for g in doc["gpus"] for t in g["tenants"]):
            raise StepFailed(f"{md['name']} still holds GPUs after RemoveContainer")

    def _wait_namespaces_released(self, uid: Any, timeout_s: float = 10.0) -> None:
        """The MPS namespace delete runs off the runtime's critical path (issue
        12): wait, bounded, until the daemon no longer lists the pod's namespace."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            _code, body = _http(self.endpoints["health"], "/status")
            daemons = (json.loads(body).get("mps") or {}).get("daemons") or []
            if not any(n.get("pod_uid") == uid for d in daemons for n in d.get("namespaces") or []):
                return
            time.sleep(0.05)

    # ---- the device plugin door ------------------------------------------------------------
    def allocate(self, manifest: dict[str, Any]) -> dict[str, str]:
        import grpc

        md = manifest["metadata"]
        spec = manifest["spec"]["containers"][0]
        n = int(spec["resources"]["limits"][RESOURCE])
        name = f"{md['namespace']}/{md['name']}/{spec['name']}"
        self.step(f"device plugin Allocate for {name}: {RESOURCE}: {n} (pod found through the simulated API)")
        ids = self.kubelet.pick(n)
        gpus = sorted({i.split('::')[0] for i in ids})
        self.out(f"  kubelet picked {n} device IDs on {', '.join(gpus)} ({ids[0]} ...)")
        try:
            r = self.kubelet.allocate(ids)
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
            reason = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
            self.out(f"  container {name}: REFUSED ({code})")
            self.out(f"    reason: {reason}")
            self.results.append({"door": "device-plugin", "container": name, "outcome": "refused",
                                 "reason": reason})
            raise StepFailed(f"Allocate for {name} was refused: {reason}") from None
        env = dict(r.envs)
        mounts = [f"{m.host_path} -> {m.container_path} ({'ro' if m.read_only else 'rw'})" for m in r.mounts]
        devices = [d for d in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if d]
        self.out(f"  container {name}: ALLOCATED")
        self._print_plan(devices, env, mounts)
        if r.annotations:
            self.out("    annotations: " + ", ".join(f"{k}={v}" for k, v in sorted(r.annotations.items())))
        self.results.append({"door": "device-plugin", "container": name, "outcome": "placed", "devices": devices,
                             "env": env, "mounts": mounts})
        self.tenancy()
        return env

    def metrics(self) -> None:
        self.step("a few metrics (GET /metrics)")
        if "metrics" not in self.endpoints:
            self.out("  (metrics endpoint not available in this build)")
            return
        code, text = _http(self.endpoints["metrics"], "/metrics")
        wanted = ("fracplugin_refusals_total", "fracplugin_hook_duration_seconds_count",
                  "fracplugin_gpu_tenants", "fracplugin_gpu_memory_held_bytes", "fracplugin_mps_daemon_up",
                  "fracplugin_ledger_entries")
        lines = [ln for ln in text.splitlines() if ln.startswith("fracplugin_") and "_bucket{" not in ln
                 and not (ln.startswith("fracplugin_hook_duration_seconds_count") and ln.endswith(" 0.0"))]
        shown: list[str] = []
        for prefix in wanted:
            for ln in lines:
                if ln.startswith(prefix) and ln not in shown and len(shown) < 24:
                    shown.append(ln)
        self.out.block("\n".join(shown) if shown else f"(HTTP {code}; no fracplugin_ samples)", "  ")

    # ---- shutdown ------------------------------------------------------------------------
    def stop(self) -> list[str]:
        """SIGTERM the daemon, close the drivers, check for leftovers, remove the
        work directory (unless --keep). Returns the leftover problems."""
        problems: list[str] = []
        rc = None
        if self.proc is not None and self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(20)
                self.out(f"  daemon stopped with status {rc} in {time.monotonic() - t0:.1f} s (SIGTERM)")
            except subprocess.TimeoutExpired:
                problems.append("the daemon did not stop within 20 s of SIGTERM; killed")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            if rc not in (0, None):
                problems.append(f"the daemon exited with status {rc}")
        if self.runtime is not None:
            self.runtime.close()
        if self.kubelet is not None:
            self.kubelet.stop()
        if self._log_file is not None:
            self._log_file.close()
        if self.work:
            left = _wait(lambda: not _own_leftovers(self.work, self.proc.pid if self.proc else None), 5.0) or \
                _own_leftovers(self.work, self.proc.pid if self.proc else None)
            if left is not True and left:
                problems += [f"process left behind: {p}" for p in left]
                if self.proc is not None:
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            socks = [str(p) for p in Path(self.work).rglob("*") if p.is_socket()]
            if socks:
                problems.append("sockets left behind: " + ", ".join(socks))
        return problems

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((Path(self.work) / "daemon.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def run(self) -> int:
        t0 = time.monotonic()
        status = 0
        try:
            self.start()
            inference = _load_pod(self.pods_dir / INFERENCE)
            notebook = _load_pod(self.pods_dir / NOTEBOOK)
            self.nri_create(inference, "placed", f"{INFERENCE}, sm-sharing, 40Gi/60Gi on four GPUs")
            refused = self.nri_create(notebook, "refused", f"{NOTEBOOK}, time-slicing, half of two GPUs")
            if "mode" not in refused["reason"] or "GPU" not in refused["reason"]:
                raise StepFailed(f"the notebook's refusal does not name the GPU and mode: {refused['reason']}")
            self.nri_remove(inference)
            self.nri_create(notebook, "placed", f"{NOTEBOOK} again, now that the GPUs are free")
            self.nri_create(self._tight_pod(), "refused", "a pod whose limit (10Gi) is below its request (20Gi)")
            envs = self.allocate(self._dp_pod())
            admitted = self._dp_pod()  # what the runtime gets: kubelet put the Allocate env in the spec
            admitted["spec"]["containers"][0]["env"] = [{"name": k, "value": v} for k, v in sorted(envs.items())]
            self.nri_create(admitted, "placed",
                            "the container kubelet just admitted: the NRI door binds kubelet's reservation to "
                            "it, same GPU and request (ADR 0007)")
            self.metrics()
        except StepFailed as exc:
            self.out()
            self.out(f"DEMO FAILED: {exc}")
            self.out("daemon log (last lines):")
            self.out.block(self.log_tail(), "  | ")
            status = 1
        except Exception as exc:  # a driver error: report, clean up, fail
            self.out()
            self.out(f"DEMO FAILED: {type(exc).__name__}: {exc}")
            self.out.block(self.log_tail(), "  | ")
            status = 1
        finally:
            self.step("shutdown")
            problems = self.stop()
            for p in problems:
                self.out(f"  PROBLEM: {p}")
            if problems:
                status = 1
            else:
                self.out("  no process or socket left behind")
            if self.work and not self.keep:
                shutil.rmtree(self.work, ignore_errors=True)
            elif self.work:
                self.out(f"  kept {self.work} (daemon.log, state/ledger.json)")
        self.out()
        self.out(f"demo {'finished' if status == 0 else 'FAILED'} in {time.monotonic() - t0:.1f} s")
        return status


def main(args: argparse.Namespace) -> int:
    try:
        examples = find_examples(args.examples)
        mps = find_fake_mps(args.mps_control_binary)
    except DemoError as exc:
        print(f"fracplugin demo: {exc}", file=sys.stderr)
        return 2
    demo = Demo(examples, mps, keep=args.keep, ready_timeout_s=args.ready_timeout)
    def on_sigterm(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # clean up (stop the daemon, remove the work dir) as for Ctrl-C

    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return demo.run()
    except KeyboardInterrupt:
        demo.stop()
        if demo.work and not demo.keep:
            shutil.rmtree(demo.work, ignore_errors=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
