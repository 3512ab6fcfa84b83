"""Configuration of ``fracplugin run``: one dataclass, four layers.

Precedence (lowest to highest): the defaults below (``DEFAULTS``), an optional
YAML file (``--config FILE`` or ``FRACPLUGIN_CONFIG``), environment variables
``FRACPLUGIN_<NAME>`` (the upper snake case of the flag: ``--mps-root`` ->
``FRACPLUGIN_MPS_ROOT``; ``--node-name`` also reads ``NODE_NAME``, the
downward-API convention), then command-line flags. Flags win.

The YAML file is a mapping whose keys are the setting names in snake case or
in flag form (``mps_root`` or ``mps-root``). An unknown key is an error, not
ignored: a typo in a ConfigMap must not silently fall back to a default.

Every bad value raises ``ConfigError`` naming the setting, where it came from
(flag, env variable or file) and the rule; ``fracplugin run`` prints it and
exits 2.

Concurrency: pure functions over immutable inputs; ``Config`` is frozen (a
SIGHUP reload builds a new one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

ENV_PREFIX = "FRACPLUGIN_"
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error")
MPS_PROTOCOLS = ("auto", "2", "3")
MEMORY_LIMIT_MODES = ("auto", "apply", "verify", "off")
MEMORY_LIMIT_POLICIES = ("warn", "refuse")
OVER_LIMIT_MODES = ("report", "restart")
ROLES = ("all", "doors", "mps")
MPS_MODES = ("time-slicing", "sm-sharing")
_NRI_NAME = re.compile(r"^[a-zA-Z0-9_.+-]+$")  # docs/reference/nri-protocol.md 1.5 (v0.12+ rule)
_NRI_IDX = re.compile(r"^[0-9]{2}$")  # docs/reference/nri-protocol.md 1.5: exactly two digits
# A qualified name as Kubernetes writes condition types: optional DNS subdomain
# prefix, then a name of [A-Za-z0-9] with -_. inside, at most 63 characters.
_CONDITION_TYPE = re.compile(r"^(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

#: Settings a SIGHUP can change without a restart (see ``reloadable_changes``).
RELOADABLE = ("log_level", "log_format", "fail_open")


class ConfigError(ValueError):
    """A setting has a bad value.

    Attributes:
        setting: the setting name in flag form (``--mps-protocol``).
        value: the offending value as given.
        reason: the rule broken.
        source: where the value came from (``flag``, ``env FRACPLUGIN_X``,
            ``file <path>``, ``default``).
    """

    def __init__(self, setting: str, value: Any, reason: str, source: str = "") -> None:
        self.setting = setting
        self.value = value
        self.reason = reason
        self.source = source
        super().__init__(setting, value, reason)

    def __str__(self) -> str:
        """One line from the attributes (``source`` may be set after raising)."""
        where = f" (from {self.source})" if self.source else ""
        if self.setting.startswith("-") or self.setting == "--config":
            return f"invalid {self.setting}{where}: {self.value!r} {self.reason}"
        return f"unknown setting {self.setting!r}{where}: {self.reason}"  # a file key that names no setting


@dataclass(frozen=True)
class Config:
    """Every setting of the daemon. Units are in the names (``_mib``, ``_s``).

    Host paths (defaults) are the ones the DaemonSet mounts:
    ``/var/lib/kubelet/device-plugins``, ``/var/lib/kubelet/pod-resources``,
    ``/var/run/nri/nri.sock``, ``/run/fracplugin/mps`` and ``/run/fracplugin/state``
    (tmpfs: the ledger must outlive a daemon restart, not a reboot; ADR 0003).
    """

    # process role (ADR 0009): all | doors | mps
    role: str = "all"
    mps_api_socket: str = ""  # "" = <mps_root>/api.sock (/run/fracplugin/mps/api.sock)
    # inventory
    simulate_node: str | None = None
    # MPS (docs/reference/mps-nvml.md section 1)
    no_mps: bool = False
    mps_control_binary: str = "nvidia-cuda-mps-control"
    mps_root: str = "/run/fracplugin/mps"
    mps_protocol: str = "auto"
    mps_modes: tuple[str, ...] = MPS_MODES
    exclusive_process: bool = False
    # MPS daemon probes (mps/probing.py): a live daemon on a starved host answers late
    mps_probe_timeout_s: float = 2.0
    mps_probe_failure_threshold: int = 2
    # state
    state_dir: str = "/run/fracplugin/state"
    # NRI door (docs/reference/nri-protocol.md 1.5)
    no_nri: bool = False
    nri_socket: str = "/var/run/nri/nri.sock"
    nri_plugin_name: str = "fracplugin"
    nri_plugin_idx: str = "50"
    # StartContainer's wait for a container's MPS namespace (ADR 0028): at most this, and at most
    # the handler's budget (0.75 x the runtime's request timeout, 2 s default) minus a margin
    nri_start_wait_s: float = 1.0
    # device plugin door (docs/reference/kubelet-device-plugin.md A.1)
    no_device_plugin: bool = False
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    resource_name: str = "fracplugin.io/gpu-memory"
    device_unit_mib: int = 1024
    kubelet_socket: str = ""  # "" = <device_plugin_dir>/kubelet.sock
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    allocate_deadline_s: float = 5.0
    pod_resources_interval_s: float = 10.0
    allocation_policy: str = "pack"
    ignored_xids: str = "13,31,43,45,68,94"
    device_specs: bool = False
    cdi_kind: str | None = None
    # CDI specs read for GPU injection (issue 23, ADR 0025b): lowest priority first
    cdi_spec_dirs: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")
    # DRA door (issue 29, ADR 0031; docs/reference/kubelet-dra.md): off until proven on a cluster
    dra: bool = False
    dra_plugins_dir: str = "/var/lib/kubelet/plugins"
    dra_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    dra_cdi_dir: str = "/var/run/cdi"
    no_dra_slices: bool = False
    dra_delete_slices_on_stop: bool = False
    # Kubernetes API
    kubeconfig: str | None = None
    node_name: str = ""
    pods_file: str | None = None
    # endpoints
    metrics_address: str = ":2112"
    health_address: str = ":8080"
    # planner
    annotation_prefix: str = "nvidia.com/container."
    reserve_mib: int = 1024  # KAI's binder reserve per GPU (planner.DEFAULT_RESERVE_MIB)
    no_cdi_devices: bool = False
    # KAI readiness gate (ADR 0005, issue 23 item 5): node condition types published from
    # readiness; both names by default (the renamed node stack / KAI's api module, older builds)
    node_condition_types: tuple[str, ...] = ("gpu-fractioning.nvidia.com/Ready", "gpu-sharing.nvidia.com/Ready")
    node_poll_interval_s: float = 10.0  # reads of this node's cordon annotation (cordon.py, issue 36 item 6)
    max_clients_per_gpu: int = 48
    fail_open: bool = False
    # CUDA 13.4 memory limits per container (issue 23, ADR 0025)
    memory_limits: str = "auto"  # auto on a simulated node without NVML: off (builders._build_memory_limits)
    memory_limits_policy: str = "refuse"
    cgroup_root: str = "/sys/fs/cgroup"
    # usage poll: each container's GPU memory against its limit (issue 35 item 3, ADR 0035)
    usage_poll_interval_s: float = 5.0
    over_limit: str = "report"
    unfenced_containers: str = "restart"  # a fractional container found running unadjusted (issue 35 item 1)
    proc_root: str = "/proc"  # the host's (hostPID): where NVML's PIDs are joined to containers
    # process
    log_format: str = "json"
    log_level: str = "info"
    shutdown_timeout_s: float = 10.0

    # ---- derived ------------------------------------------------------------
    @property
    def effective_kubelet_socket(self) -> str:
        """``kubelet_socket`` or ``<device_plugin_dir>/kubelet.sock``."""
        return self.kubelet_socket or str(Path(self.device_plugin_dir) / "kubelet.sock")

    @property
    def ledger_path(self) -> str:
        return str(Path(self.state_dir) / "ledger.json")

    @property
    def effective_mps_api_socket(self) -> str:
        """``--mps-api-socket`` or ``<mps_root>/api.sock``."""
        return self.mps_api_socket or os.path.join(self.mps_root, "api.sock")

    @property
    def endpoints_path(self) -> str:
        # the MPS role may share the state directory with the doors role
        return str(Path(self.state_dir) / ("endpoints-mps.json" if self.role == "mps" else "endpoints.json"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every setting (logged at start, served in /status)."""
        d = dataclasses.asdict(self)
        d["mps_modes"] = list(self.mps_modes)
        d["kubelet_socket"] = self.effective_kubelet_socket
        return d


DEFAULTS = Config()
"""The default configuration (also read by the manifest tests: every default
host path must be mounted by the DaemonSet)."""

#: setting -> flag name. ``shutdown_timeout_s`` is ``--shutdown-timeout`` (seconds).
_FLAG_OVERRIDES = {"shutdown_timeout_s": "shutdown-timeout", "allocate_deadline_s": "allocate-deadline",
                   "pod_resources_interval_s": "pod-resources-interval", "mps_probe_timeout_s": "mps-probe-timeout",
                   "usage_poll_interval_s": "usage-poll-interval", "node_poll_interval_s": "node-poll-interval"}


def flag_name(setting: str) -> str:
    """``mps_root`` -> ``mps-root`` (without the dashes in front)."""
    return _FLAG_OVERRIDES.get(setting, setting.replace("_", "-"))


def env_name(setting: str) -> str:
    """``mps_root`` -> ``FRACPLUGIN_MPS_ROOT`` (upper snake of the flag)."""
    return ENV_PREFIX + flag_name(setting).replace("-", "_").upper()


_FIELDS = {f.name: f for f in fields(Config)}
_BY_FLAG = {flag_name(n): n for n in _FIELDS}

_HELP = {
    "simulate_node": "use a simulated node described by this YAML file instead of NVML",
    "role": "what this process runs: all (one process), doors (NRI, device plugin, metrics, health; MPS through "
            "--mps-api-socket) or mps (only the MPS supervisor and its API; daemons outlive the process)",
    "mps_api_socket": "root-only unix socket of the MPS role's API (role mps serves it, role doors calls it); "
                      "default <mps-root>/api.sock = /run/fracplugin/mps/api.sock",
    "no_mps": "do not supervise nvidia-cuda-mps-control (plans still carry MPS env and mounts)",
    "mps_control_binary": "the nvidia-cuda-mps-control executable",
    "mps_root": "host directory holding the MPS pipe and log directories; put it on a nosuid,nodev filesystem "
                "(a tmpfs such as /run on systemd hosts): a pipe directory kubelet bind-mounts from an Allocate "
                "answer keeps the source filesystem's mount flags (the device plugin API has no mount options; the "
                "NRI and DRA doors set nosuid,nodev themselves), and the device plugin door warns at start when "
                "they are missing",
    "mps_protocol": "MPS control protocol: auto (from the driver version), 2 or 3",
    "mps_modes": "comma list of compute modes whose MPS daemon is supervised",
    "mps_probe_timeout_s": "seconds one MPS daemon probe may take; each timed-out probe doubles the next one's, "
                           "up to 8x",
    "mps_probe_failure_threshold": "consecutive failed MPS daemon probes that confirm a hang (a timed-out probe "
                                   "reports the daemon unhealthy only then, and it is restarted)",
    "exclusive_process": "put every GPU of the node in EXCLUSIVE_PROCESS compute mode through NVML (only the MPS "
                         "server then opens contexts; off by default because it also constrains whole-GPU pods)",
    "state_dir": "directory of ledger.json and endpoints.json",
    "no_nri": "disable the NRI plugin door. With MPS namespaces (protocol 3) this door makes each device plugin "
              "door container's MPS namespace (its pinned memory limit and active thread percentage) and mounts "
              "its pipe directory, which Allocate does not: without it those containers get the env but no MPS "
              "pipe directory, so no MPS caps (the DRA door makes its claims' namespaces itself; with protocol 2 "
              "Allocate mounts the mode's shared pipe directory). Annotation-only (KAI) pods need this door",
    "nri_socket": "NRI socket of the container runtime",
    "nri_plugin_name": "NRI plugin name ([a-zA-Z0-9_.+-]+)",
    "nri_plugin_idx": "NRI plugin index (two digits; plugins run in index order)",
    "nri_start_wait_s": "seconds StartContainer waits for the container's MPS namespace (never past its handler "
                        "budget, which keeps the runtime's request timeout, 2 s by default); when spent while the "
                        "namespace is still being made the container starts and the log says so; a namespace whose "
                        "creation failed still fails the start",
    "no_device_plugin": "disable the kubelet device plugin door",
    "device_plugin_dir": "kubelet device plugin directory (our socket goes here)",
    "resource_name": "extended resource advertised by the device plugin",
    "device_unit_mib": "MiB of GPU memory per advertised device",
    "kubelet_socket": "kubelet registration socket (default <device-plugin-dir>/kubelet.sock)",
    "pod_resources_socket": "kubelet PodResources socket",
    "allocate_deadline_s": "seconds an Allocate may spend finding its pod",
    "pod_resources_interval_s": "seconds between reconciliations of the ledger with kubelet's PodResources List",
    "allocation_policy": "GetPreferredAllocation policy: pack (fill used GPUs first) or spread",
    "ignored_xids": "comma list of XIDs that do not make a GPU Unhealthy (application errors)",
    "device_specs": "also answer Allocate with DeviceSpecs for /dev/nvidia<minor>, /dev/nvidiactl, /dev/nvidia-uvm",
    "cdi_kind": "an operator-named CDI kind (e.g. nvidia.com/gpu), looked up first in the CDI specs; Allocate "
                "answers <kind>=<GPU-UUID> for a GPU no spec lists",
    "cdi_spec_dirs": "comma list of CDI spec directories read to request each planned GPU's CDI device (kinds "
                     "k8s.device-plugin.nvidia.com/gpu, nvidia.com/gpu, --cdi-kind) in the NRI adjustment and "
                     "Allocate; re-read when they change; empty = none",
    "dra": "enable the DRA door (driver gpu-memory.fracplugin.io): serve kubelet's DRA plugin API under "
           "--dra-plugins-dir, register in --dra-registry-dir, publish a ResourceSlice of this node's GPUs "
           "(needs API access, and Kubernetes 1.36+ or the DRAConsumableCapacity feature gate turned on in 1.34/1.35; "
           "off by default; docs/user-guide.md \"DRA claims\")",
    "dra_plugins_dir": "kubelet's plugins directory; the DRA socket is <dir>/gpu-memory.fracplugin.io/dra.sock",
    "dra_registry_dir": "kubelet's plugin registration directory (plugins_registry)",
    "dra_cdi_dir": "directory where the DRA door writes one CDI spec per prepared claim (read by the runtime)",
    "no_dra_slices": "with --dra, do not publish this node's ResourceSlice (another component publishes it, or "
                     "a test drives Prepare without the API's scheduler)",
    "dra_delete_slices_on_stop": "delete this node's ResourceSlice when the daemon stops (uninstall; a restart "
                                 "keeps it so that allocated claims keep their device)",
    "kubeconfig": "kubeconfig for API access (in-cluster config is used when running in a pod)",
    "node_name": "this node's name (env NODE_NAME)",
    "pods_file": "simulated API access: a YAML file of Pod documents (re-read when it changes)",
    "metrics_address": "HOST:PORT of the Prometheus /metrics endpoint (port 0 = any free port)",
    "health_address": "HOST:PORT of /healthz, /readyz and /status (port 0 = any free port)",
    "annotation_prefix": "prefix of the per-container annotation keys",
    "reserve_mib": "MiB per GPU kept out of fraction resolution (1024 = what KAI's NvFractions binder holds back)",
    "no_cdi_devices": "do not pass CDI device names from .gpus.devices on as NRI CDI devices (runtimes older than "
                      "containerd 2.1 / CRI-O 1.34); the env still names the GPUs",
    "node_condition_types": "comma list of node condition types published from readiness for KAI's NvFractions gate, "
                            "Unknown when the daemon stops (KAI's api module and the renamed node stack read "
                            "gpu-fractioning.nvidia.com/Ready, older builds gpu-sharing.nvidia.com/Ready; empty = "
                            "publish none; needs API access)",
    "node_poll_interval_s": "seconds between reads of this node's fracplugin.io/cordoned-gpus annotation (GPUs that "
                            "take no new fraction; needs API access)",
    "max_clients_per_gpu": "tenants allowed per GPU (MPS client limit)",
    "fail_open": "leave a container unadjusted (unfenced, with a warning and a counted refusal) instead of "
                 "failing it when its fraction is refused or MPS fails; --no-fail-open overrides file/env",
    "memory_limits": "CUDA 13.4 per-container memory limits (soft = request, hard = limit) on each container's leaf "
                     "cgroup via NVML at StartContainer: auto (apply where the GPU's CDI spec lacks the toolkit's "
                     "apply-cuda-memory-limits hook, verify where it has it), apply, verify, or off",
    "memory_limits_policy": "when a container's memory limit cannot be enforced: warn (start it, Warning Event "
                            "MemoryLimitNotEnforced) or refuse (fail its start; refuse fractional containers while "
                            "the node cannot enforce)",
    "cgroup_root": "the cgroup v2 mount where container leaf cgroups and dmem.capacity are read",
    "usage_poll_interval_s": "seconds between usage polls: NVML's per-process memory (or dmem.current) per "
                             "container and GPU, compared with its limit and served on /metrics",
    "over_limit": "a container above its GPU memory limit at a usage poll: report (Warning Event "
                  "GpuMemoryLimitExceeded once per episode, metric, alert) or restart (the same, then its pod is "
                  "evicted through the Kubernetes Eviction API)",
    "unfenced_containers": "a fractional container found running without fracplugin's adjustment: restart (evict "
                           "its pod, with backoff) or report; Event ContainerRestartedUnfenced either way",
    "proc_root": "the proc filesystem where the PIDs NVML reports are joined to containers (the host's: hostPID)",
    "log_format": "log format: json or text",
    "log_level": "log level: debug, info, warning or error",
    "shutdown_timeout_s": "seconds allowed for an orderly shutdown",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per setting to ``p``.

    Every flag defaults to None (``argparse.SUPPRESS`` would lose the
    information too), so ``load`` can tell a given flag from an absent one.
    Booleans are ``store_true`` switches (``--no-nri``, ``--fail-open``).
    """
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML file of settings (env FRACPLUGIN_CONFIG); flags and env override it")
    for name, f in _FIELDS.items():
        flag = "--" + flag_name(name)
        help_text = _HELP.get(name, "") + f" [env {env_name(name)}]"
        default = DEFAULTS.__getattribute__(name)
        if f.type == "bool" and name == "fail_open":
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.type == "bool":
            p.add_argument(flag, dest=name, action="store_const", const=True, default=None, help=help_text)
        else:
            shown = ",".join(default) if isinstance(default, tuple) else default
            p.add_argument(flag, dest=name, default=None, metavar=_metavar(name),
                           help=f"{help_text} (default: {shown!s})" if shown not in (None, "") else help_text)


_METAVARS = {"allocation_policy": "pack|spread", "ignored_xids": "XIDS", "cdi_kind": "KIND", "log_level": "LEVEL",
             "mps_modes": "MODES", "nri_plugin_name": "NAME", "nri_plugin_idx": "NN", "resource_name": "NAME",
             "node_name": "NAME", "annotation_prefix": "PREFIX", "max_clients_per_gpu": "N",
             "node_condition_types": "TYPES", "cdi_spec_dirs": "DIR[,DIR]", "unfenced_containers": "restart|report"}


def _metavar(name: str) -> str:
    if name in _METAVARS:
        return _METAVARS[name]
    if name in _CHOICES:
        return "|".join(_CHOICES[name])
    if name.endswith(("_dir", "_root")):
        return "DIR"
    if name.endswith("_address"):
        return "HOST:PORT"
    if name.endswith(("_socket", "_binary")) or name in ("kubeconfig", "simulate_node", "pods_file"):
        return "PATH"
    if name.endswith("_mib"):
        return "MIB"
    if name.endswith("_s"):
        return "SECONDS"
    return name.upper()


# ---- value conversion -------------------------------------------------------
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _convert(name: str, raw: Any, source: str) -> Any:
    """Convert ``raw`` (a string from env/flags, or a YAML scalar) to the type
    of setting ``name``. Raises ConfigError."""
    setting = "--" + flag_name(name)
    typ = _FIELDS[name].type
    if typ == "bool":
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise ConfigError(setting, raw, "is not a boolean (true/false, 1/0, yes/no)", source)
    if typ in ("int", "float"):
        try:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return (int if typ == "int" else float)(str(raw).strip())
        except ValueError:
            rule = "is not an integer" if typ == "int" else "is not a number of seconds"
            raise ConfigError(setting, raw, rule, source) from None
    if typ == "tuple[str, ...]":
        items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
        return tuple(str(i).strip() for i in items if str(i).strip())
    if typ == "str | None":
        return None if raw is None or str(raw) == "" else str(raw)
    if raw is None:
        raise ConfigError(setting, raw, "must not be empty", source)
    return str(raw)


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``:PORT`` / ``[v6]:PORT`` -> (host, port). An empty host
    means every interface (``""``). Raises ValueError naming the rule."""
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep:
            raise ValueError("is not HOST:PORT ([v6addr]:PORT for IPv6)")
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            raise ValueError("is not HOST:PORT (e.g. :8080 or 127.0.0.1:0)")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"has port {port!r}, which is not 0..65535")
    return host, int(port)


def validate(cfg: Config, sources: Mapping[str, str] | None = None) -> Config:
    """Check every value; return ``cfg`` or raise ConfigError for the first bad one.

    Rules: enumerations (log format/level, MPS protocol and modes), HOST:PORT
    addresses, positive sizes and timeouts, NRI name/index syntax
    (docs/reference/nri-protocol.md 1.5), the resource name (kubelet ``IsExtendedResourceName``,
    docs/reference/kubelet-device-plugin.md A.3), absolute paths, the MPS root length
    (socket paths must fit 108 bytes, docs/reference/mps-nvml.md 1.4).
    """
    bad = _bad_of(cfg, sources)
    _validate_role_and_mps(cfg, bad)
    _validate_numbers(cfg, bad)
    _validate_names_and_paths(cfg, bad)
    return cfg


_Bad = Callable[[str, str], ConfigError]
"""``bad(setting, reason)``: the ConfigError naming the setting, its value and where it came from."""


def _bad_of(cfg: Config, sources: Mapping[str, str] | None) -> _Bad:
    """The ``_Bad`` of ``cfg`` whose settings came from ``sources`` (setting -> where; absent: default)."""

    def bad(name: str, reason: str) -> ConfigError:
        value = getattr(cfg, name)
        value = ",".join(value) if isinstance(value, tuple) else value
        return ConfigError("--" + flag_name(name), value, reason, (sources or {}).get(name, "default"))

    return bad

_CHOICES = {"log_format": LOG_FORMATS, "role": ROLES, "mps_protocol": MPS_PROTOCOLS,
            "memory_limits": MEMORY_LIMIT_MODES, "memory_limits_policy": MEMORY_LIMIT_POLICIES,
            "over_limit": OVER_LIMIT_MODES, "unfenced_containers": OVER_LIMIT_MODES}
"""Settings that take one of a few words (``must be one of ...``)."""

_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mps_probe_timeout_s": (lambda v: 0 < v <= 600, "must be a positive number of seconds, at most 600"),
    "mps_probe_failure_threshold": (lambda v: 1 <= v <= 100, "must be 1..100"),
    "device_unit_mib": (lambda v: v > 0, "must be a positive number of MiB"),
    "reserve_mib": (lambda v: v >= 0, "must be 0 or more MiB"),
    "max_clients_per_gpu": (lambda v: 1 <= v <= 48,
                            "must be 1..48 (MPS accepts at most 48 clients per GPU on Volta and later)"),
    # inf/NaN would break every bounded wait of the stop
    "shutdown_timeout_s": (lambda v: 0 < v <= 3600, "must be a positive number of seconds, at most 3600"),
    "allocate_deadline_s": (lambda v: 0 < v <= 3600, "must be a positive number of seconds, at most 3600"),
    "pod_resources_interval_s": (lambda v: 0 < v <= 86400, "must be a positive number of seconds, at most 86400"),
    "usage_poll_interval_s": (lambda v: 0 < v <= 86400, "must be a positive number of seconds, at most 86400"),
    "node_poll_interval_s": (lambda v: 0 < v <= 86400, "must be a positive number of seconds, at most 86400"),
    # the handler budget bounds it anyway (ADR 0028)
    "nri_start_wait_s": (lambda v: 0 <= v <= 60,
                         "must be 0 to 60 seconds (the wait never exceeds StartContainer's budget)"),
}
"""Numeric settings: the test a value must pass and the rule it names (NaN passes none)."""

_ABSOLUTE = ("state_dir", "mps_root", "device_plugin_dir", "nri_socket", "pod_resources_socket", "dra_plugins_dir",
             "dra_registry_dir", "dra_cdi_dir", "cgroup_root", "proc_root")
_ABSOLUTE_OR_EMPTY = ("mps_api_socket", "kubelet_socket")  # "" = derived from another setting


def _validate_role_and_mps(cfg: Config, bad: _Bad) -> None:
    """``validate``: the word settings (``_CHOICES``), log level, role, MPS modes. Raises ConfigError."""
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise bad(name, f"must be one of {', '.join(choices)}")
    if cfg.log_level.lower() not in LOG_LEVELS:
        raise bad("log_level", f"must be one of {', '.join(LOG_LEVELS)}")
    if cfg.role != "all" and cfg.no_mps:
        raise bad("role", "needs MPS: --no-mps only goes with --role all")
    for m in cfg.mps_modes:
        if m not in MPS_MODES:
            raise bad("mps_modes", f"has the unknown mode {m!r}; modes are {', '.join(MPS_MODES)}")
    if not cfg.no_mps and not cfg.mps_modes:
        raise bad("mps_modes", f"is empty: name at least one of {', '.join(MPS_MODES)}, or give --no-mps")


def _validate_numbers(cfg: Config, bad: _Bad) -> None:
    """``validate``: addresses, sizes, counts and timeouts (``_RANGES``), condition types. Raises ConfigError."""
    for name in ("metrics_address", "health_address"):
        try:
            parse_address(getattr(cfg, name))
        except ValueError as exc:
            raise bad(name, str(exc)) from None
    for name, (ok, rule) in _RANGES.items():
        if not ok(getattr(cfg, name)):
            raise bad(name, rule)
    for t in cfg.node_condition_types:
        if not _CONDITION_TYPE.match(t):
            raise bad("node_condition_types", f"has {t!r}, which is not a condition type "
                      "([<dns-subdomain>/]<name>, e.g. gpu-sharing.nvidia.com/Ready)")


def _validate_names_and_paths(cfg: Config, bad: _Bad) -> None:
    """``validate``: NRI name/index, policy, XID list, CDI kind, absolute
    paths, the MPS root length, the resource name. Raises ConfigError."""
    if not _NRI_NAME.match(cfg.nri_plugin_name):
        raise bad("nri_plugin_name", "must match [a-zA-Z0-9_.+-]+ (NRI plugin name rule)")
    if not _NRI_IDX.match(cfg.nri_plugin_idx):
        raise bad("nri_plugin_idx", "must be exactly two digits (NRI plugin index rule)")
    if cfg.allocation_policy not in ("pack", "spread"):
        raise bad("allocation_policy", "must be pack or spread")
    try:
        [int(x) for x in cfg.ignored_xids.split(",") if x.strip()]
    except ValueError:
        raise bad("ignored_xids", "must be a comma list of integers") from None
    if cfg.cdi_kind is not None and (cfg.cdi_kind.count("/") != 1 or "=" in cfg.cdi_kind):
        raise bad("cdi_kind", "must be a CDI kind <vendor>/<class> (e.g. nvidia.com/gpu)")
    for d in cfg.cdi_spec_dirs:
        if not d.startswith("/"):
            raise bad("cdi_spec_dirs", f"has {d!r}, which is not an absolute path")
    for name in _ABSOLUTE + _ABSOLUTE_OR_EMPTY:
        value = str(getattr(cfg, name))
        if not value.startswith("/") and (value or name in _ABSOLUTE):
            raise bad(name, "must be an absolute path")
    try:
        from .mps.layout import MpsLayout

        MpsLayout(cfg.mps_root)
    except ValueError as exc:
        raise bad("mps_root", str(exc).split(f"{cfg.mps_root!r} ", 1)[-1]) from None
    try:
        from .kubelet.devices import validate_resource_name

        validate_resource_name(cfg.resource_name)
    except ValueError as exc:
        raise bad("resource_name", str(exc)) from None


def check_paths(cfg: Config, sources: Mapping[str, str] | None = None) -> None:
    """The settings that name files which must exist on this host when the
    daemon starts (``validate`` checks values only and touches no file).

    Raises ConfigError: ``--mps-control-binary`` not executable (unless
    ``--no-mps``, or ``--role doors``: the doors reach MPS through the MPS
    role's API socket and never run the binary, ADR 0009), ``--simulate-node``
    not a readable file.
    """
    bad = _bad_of(cfg, sources)
    if cfg.simulate_node is not None and not os.access(cfg.simulate_node, os.R_OK):
        raise bad("simulate_node", "is not a readable file")
    if not cfg.no_mps and cfg.role != "doors" and shutil.which(cfg.mps_control_binary) is None:
        raise bad("mps_control_binary", "is not an executable file (nor found on PATH); install the NVIDIA driver's "
                  "nvidia-cuda-mps-control, point this setting at it, or give --no-mps")


# ---- loading ----------------------------------------------------------------
def read_file(path: str) -> dict[str, Any]:
    """The YAML config file as {setting: raw value}. Raises ConfigError (also
    for a file that is not UTF-8, nested too deeply or otherwise unparsable:
    one line naming the file, never a traceback; issue 13 item 4)."""
    try:
        doc = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except OSError as exc:
        raise ConfigError("--config", path, f"cannot be read: {exc.strerror or exc}", "flag") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("--config", path, f"is not UTF-8 text (byte {exc.start})", "flag") from None
    except RecursionError:
        raise ConfigError("--config", path, "is nested too deeply to parse", "flag") from None
    except _DuplicateKey as exc:  # YAML 1.2 requires unique keys; PyYAML would keep the last one silently
        raise ConfigError("--config", path, f"gives the key {exc.key!r} twice (lines {exc.first} and {exc.second}): "
                          "keep one", "flag") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("--config", path, f"is not valid YAML{where}: {what}", "flag") from None
    except Exception as exc:  # the parser is not ours: any failure is the file's
        raise ConfigError("--config", path, f"cannot be parsed: {type(exc).__name__}", "flag") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError("--config", path, "must hold a mapping of setting: value", "flag")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        k = str(key)
        if k.replace("-", "_") == "device_unit":  # the ConfigMap's form: "GiB", "512Mi", ...
            out["device_unit_mib"] = _unit_mib(value, path)
            continue
        name = _BY_FLAG.get(k) or _BY_FLAG.get(k.replace("_", "-")) or (k if k in _FIELDS else None)
        if name is None:
            known = ", ".join(sorted(_FIELDS))
            raise ConfigError(k, value, f"is not a setting (known keys: {known})", f"file {path}{_key_line(path, k)}")
        out[name] = value
    return out


class _DuplicateKey(yaml.YAMLError):
    """A mapping of the config file gives ``key`` twice (1-based lines)."""

    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping
    (PyYAML keeps the last one; YAML 1.2 section 3.2.1.1 requires unique keys)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for k, _v in node.value:
            if isinstance(k, yaml.ScalarNode):
                line = k.start_mark.line + 1
                if k.value in seen:
                    raise _DuplicateKey(k.value, seen[k.value], line)
                seen[k.value] = line
        return super().construct_mapping(node, deep=deep)


def _key_line(path: str, key: str) -> str:
    """`` line N`` where ``key`` stands at the top level of the YAML file at
    ``path`` (1-based, from the parser's marks), or "" when it cannot be told.
    Only called on the error path: the file is parsed once more."""
    try:
        node = yaml.compose(Path(path).read_text())
    except Exception:
        return ""
    if isinstance(node, yaml.MappingNode):
        for k, _v in node.value:
            if str(k.value) == key:
                return f" line {k.start_mark.line + 1}"
    return ""


_UNIT_RE = re.compile(r"^\s*([0-9]*)\s*(Mi|Gi|MiB|GiB)\s*$")


def _unit_mib(value: Any, path: str) -> int:
    """``device_unit`` in a config file: ``MiB``, ``GiB``, ``<n>Mi``, ``<n>Gi``
    (``<n>MiB``/``<n>GiB`` too) -> MiB. Raises ConfigError."""
    m = _UNIT_RE.match(str(value))
    if not m:
        raise ConfigError("device_unit", value, "must be MiB, GiB, <n>Mi or <n>Gi", f"file {path}")
    n = int(m.group(1) or 1)
    return n * (1024 if m.group(2).startswith("G") else 1)


def load(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> tuple[Config, dict[str, str]]:
    """Build the effective Config: defaults < file < env < flags.

    Args:
        args: parsed flags (from a parser built with ``add_arguments``); None = no flags.
        env: the environment (default ``os.environ``).

    Returns:
        (config, sources): ``sources`` maps each setting that is not at its
        default to where it came from (``file <path>``, ``env NAME``, ``flag``).

    Raises:
        ConfigError: a bad value, an unknown file key, an unreadable file.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    config_path = getattr(args, "config", None) if args is not None else None
    config_src = "flag"
    if not config_path and env.get(ENV_PREFIX + "CONFIG"):
        config_path, config_src = env[ENV_PREFIX + "CONFIG"], f"env {ENV_PREFIX}CONFIG"
    if config_path:
        try:
            file_values = read_file(config_path)
        except ConfigError as exc:
            if exc.setting == "--config":  # the file itself: blame where its name came from
                exc.source = config_src
            raise
        for name, raw in file_values.items():
            try:
                values[name] = _convert(name, raw, f"file {config_path}")
            except ConfigError as exc:
                exc.source = f"file {config_path}{_key_line(config_path, name) or _key_line(config_path, flag_name(name))}"
                raise
            sources[name] = f"file {config_path}"
    for name in _FIELDS:
        keys = [env_name(name)] + (["NODE_NAME"] if name == "node_name" else [])
        for key in keys:
            if key in env and (env[key] != "" or _FIELDS[name].type == "bool"):
                values[name] = _convert(name, env[key], f"env {key}")
                sources[name] = f"env {key}"
                break
    if args is not None:
        for name in _FIELDS:
            raw = getattr(args, name, None)
            if raw is not None:
                values[name] = _convert(name, raw, "flag")
                sources[name] = "flag"
    cfg = Config(**values)
    if cfg.log_level != cfg.log_level.lower():
        cfg = dataclasses.replace(cfg, log_level=cfg.log_level.lower())
    try:
        return validate(cfg, sources), sources
    except ConfigError as exc:
        bad_key = _BY_FLAG.get(exc.setting.removeprefix("--"))
        if config_path and bad_key is not None and exc.source == f"file {config_path}":  # name the key's line
            exc.source += _key_line(config_path, bad_key) or _key_line(config_path, flag_name(bad_key))
        raise


# Names under the prefix that are not settings: the config file's own
# variable and the MPS role's keeper marker (daemon.py).
_NOT_SETTINGS = frozenset({ENV_PREFIX + "CONFIG", ENV_PREFIX + "MPS_ROLE_CHILD"})
# Kubernetes service links: a Service named fracplugin[-x] in the pod's
# namespace gives every container FRACPLUGIN[_X]_SERVICE_HOST, _SERVICE_PORT[_NAME],
# _PORT, _PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR] (kubelet's envvars for services).
_SERVICE_LINK = re.compile(
    r"^FRACPLUGIN(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)


def unknown_env(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``FRACPLUGIN_*`` variables in ``env`` that name no setting (a typo
    such as ``FRACPLUGIN_FAILOPEN`` is otherwise silently ignored).

    Returns sorted ``(name, closest)`` pairs: ``closest`` is the setting's
    variable the name most resembles (``difflib``, cutoff 0.8), or None.
    Names are matched case-sensitively, as the environment is on Linux: a
    lower- or mixed-case ``fracplugin_mps_root`` is reported too, with the
    upper-case setting it was meant to be. Kubernetes service-link variables
    and the names in ``_NOT_SETTINGS`` are not reported.
    """
    known = {env_name(n) for n in _FIELDS}
    out = []
    for key in sorted(env):
        if not key.upper().startswith(ENV_PREFIX) or key in known or key in _NOT_SETTINGS \
                or _SERVICE_LINK.match(key):
            continue
        import difflib

        close = difflib.get_close_matches(key.upper(), sorted(known), n=1, cutoff=0.8)
        out.append((key, close[0] if close else None))
    return out


def reloadable_changes(old: Config, new: Config) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """Compare two configs for a SIGHUP reload.

    Returns (applied, ignored): ``applied`` maps each changed reloadable
    setting (``RELOADABLE``) to (old, new); ``ignored`` lists the changed
    settings that need a restart.
    """
    changed = [name for name in _FIELDS if getattr(old, name) != getattr(new, name)]
    return ({n: (getattr(old, n), getattr(new, n)) for n in changed if n in RELOADABLE},
            [n for n in changed if n not in RELOADABLE])
