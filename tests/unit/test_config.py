"""Configuration layers of ``fracplugin run``: defaults < file < env < flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from fracplugin import config as c
from fracplugin.config import DEFAULTS, Config, ConfigError

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    c.add_arguments(p)
    return p.parse_args(argv)


def load(argv: list[str] = (), env: dict[str, str] | None = None) -> tuple[Config, dict[str, str]]:
    return c.load(parse(list(argv)), env or {})


def test_defaults_are_the_daemonset_host_paths() -> None:
    cfg, sources = load()
    assert cfg == DEFAULTS and sources == {}
    assert cfg.device_plugin_dir == "/var/lib/kubelet/device-plugins"
    assert cfg.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert cfg.nri_socket == "/var/run/nri/nri.sock"
    assert cfg.mps_root == "/run/fracplugin/mps"
    assert cfg.state_dir == "/run/fracplugin/state"
    assert cfg.effective_kubelet_socket == "/var/lib/kubelet/device-plugins/kubelet.sock"
    assert (cfg.metrics_address, cfg.health_address) == (":2112", ":8080")
    assert cfg.ledger_path == "/run/fracplugin/state/ledger.json"


def test_precedence_file_env_flag(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"reserve_mib": 100, "log-level": "debug", "state_dir": "/srv/a", "fail_open": True}))
    cfg, sources = load(["--config", str(f)])
    assert (cfg.reserve_mib, cfg.log_level, cfg.state_dir, cfg.fail_open) == (100, "debug", "/srv/a", True)
    assert sources["reserve_mib"] == f"file {f}"

    env = {"FRACPLUGIN_RESERVE_MIB": "200", "FRACPLUGIN_STATE_DIR": "/srv/b", "FRACPLUGIN_FAIL_OPEN": "false"}
    cfg, sources = load(["--config", str(f)], env)
    assert (cfg.reserve_mib, cfg.state_dir, cfg.fail_open, cfg.log_level) == (200, "/srv/b", False, "debug")
    assert sources["reserve_mib"] == "env FRACPLUGIN_RESERVE_MIB"

    cfg, sources = load(["--config", str(f), "--reserve-mib", "300", "--fail-open"], env)
    assert (cfg.reserve_mib, cfg.state_dir, cfg.fail_open) == (300, "/srv/b", True)
    assert sources["reserve_mib"] == "flag" and sources["fail_open"] == "flag"


def test_config_file_from_env(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("no_nri: true\nnri_plugin_idx: '10'\n")
    cfg, _ = load([], {"FRACPLUGIN_CONFIG": str(f)})
    assert cfg.no_nri is True and cfg.nri_plugin_idx == "10"


def test_env_names_are_upper_snake_of_the_flag() -> None:
    assert c.env_name("mps_root") == "FRACPLUGIN_MPS_ROOT"
    assert c.env_name("shutdown_timeout_s") == "FRACPLUGIN_SHUTDOWN_TIMEOUT"
    cfg, _ = load([], {"FRACPLUGIN_SHUTDOWN_TIMEOUT": "3.5", "FRACPLUGIN_NO_DEVICE_PLUGIN": "1",
                       "FRACPLUGIN_MPS_MODES": "sm-sharing"})
    assert cfg.shutdown_timeout_s == 3.5 and cfg.no_device_plugin is True and cfg.mps_modes == ("sm-sharing",)


def test_node_name_from_downward_api_env() -> None:
    assert load([], {"NODE_NAME": "n1"})[0].node_name == "n1"
    assert load([], {"NODE_NAME": "n1", "FRACPLUGIN_NODE_NAME": "n2"})[0].node_name == "n2"
    assert load(["--node-name", "n3"], {"NODE_NAME": "n1"})[0].node_name == "n3"


@pytest.mark.parametrize("argv,env,setting,needle", [
    (["--mps-protocol", "4"], {}, "--mps-protocol", "auto, 2, 3"),
    (["--log-format", "xml"], {}, "--log-format", "json, text"),
    (["--log-level", "loud"], {}, "--log-level", "debug"),
    (["--health-address", "8080"], {}, "--health-address", "HOST:PORT"),
    (["--metrics-address", ":99999"], {}, "--metrics-address", "0..65535"),
    (["--device-unit-mib", "0"], {}, "--device-unit-mib", "positive"),
    (["--device-unit-mib", "1G"], {}, "--device-unit-mib", "not an integer"),
    (["--reserve-mib", "-1"], {}, "--reserve-mib", "0 or more"),
    (["--nri-plugin-idx", "5"], {}, "--nri-plugin-idx", "two digits"),
    (["--nri-plugin-name", "frac plugin"], {}, "--nri-plugin-name", "[a-zA-Z0-9_.+-]+"),
    (["--resource-name", "kubernetes.io/gpu"], {}, "--resource-name", "reserved"),
    (["--state-dir", "relative/dir"], {}, "--state-dir", "absolute"),
    (["--mps-root", "/" + "x" * 80], {}, "--mps-root", "too long"),
    (["--shutdown-timeout", "0"], {}, "--shutdown-timeout", "positive"),
    (["--mps-modes", "time-slicing,mig"], {}, "--mps-modes", "unknown mode 'mig'"),
    (["--mps-modes", ""], {}, "--mps-modes", "is empty"),
    ([], {"FRACPLUGIN_FAIL_OPEN": "maybe"}, "--fail-open", "FRACPLUGIN_FAIL_OPEN"),
    ([], {"FRACPLUGIN_MAX_CLIENTS_PER_GPU": "49"}, "--max-clients-per-gpu", "1..48"),
    (["--allocation-policy", "random"], {}, "--allocation-policy", "pack or spread"),
    (["--ignored-xids", "13,x"], {}, "--ignored-xids", "integers"),
    (["--cdi-kind", "nvidia.com/gpu=0"], {}, "--cdi-kind", "<vendor>/<class>"),
    (["--cdi-spec-dirs", "/etc/cdi,var/run/cdi"], {}, "--cdi-spec-dirs", "'var/run/cdi', which is not an absolute path"),
    (["--role", "both"], {}, "--role", "all, doors, mps"),
    (["--mps-api-socket", "api.sock"], {}, "--mps-api-socket", "absolute"),
])
def test_bad_values_name_setting_and_value(argv: list[str], env: dict[str, str], setting: str, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(argv, env)
    msg = str(ei.value)
    assert ei.value.setting == setting and setting in msg and needle in msg
    given = argv[1] if argv else next(iter(env.values()))
    assert repr(given) in msg or given in msg


@pytest.mark.parametrize("argv,setting,needle", [
    (["--mps-control-binary", "/nonexistent/nvidia-cuda-mps-control"], "--mps-control-binary", "not an executable"),
    (["--no-mps", "--simulate-node", "/nonexistent/node.yaml"], "--simulate-node", "not a readable file"),
])
def test_paths_that_must_exist(argv: list[str], setting: str, needle: str) -> None:
    cfg, sources = load(argv)  # values are fine ...
    with pytest.raises(ConfigError) as ei:  # ... but the files are not there
        c.check_paths(cfg, sources)
    assert ei.value.setting == setting and needle in str(ei.value)
    ok, _ = load(["--no-mps", "--simulate-node", __file__])
    c.check_paths(ok)


def test_the_doors_role_does_not_need_the_mps_binary() -> None:
    """``--role doors`` talks to the MPS role's API socket and never runs
    ``nvidia-cuda-mps-control`` (ADR 0009): its absence is no start error there,
    while ``--role all`` and ``--role mps`` still need it."""
    missing = ["--mps-control-binary", "/nonexistent/nvidia-cuda-mps-control"]
    doors, sources = load(["--role", "doors", *missing])
    c.check_paths(doors, sources)
    for role in ("all", "mps"):
        cfg, sources = load(["--role", role, *missing])
        with pytest.raises(ConfigError, match="not an executable"):
            c.check_paths(cfg, sources)


def test_exclusive_process_is_opt_in() -> None:
    assert load()[0].exclusive_process is False
    assert load(["--exclusive-process"])[0].exclusive_process is True
    assert load([], {"FRACPLUGIN_EXCLUSIVE_PROCESS": "true"})[0].exclusive_process is True


def test_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("reserv_mib: 3\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'reserv_mib' \(from file .*\): is not a setting \(known keys: .*reserve_mib"):
        load(["--config", str(f)])
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load(["--config", str(f)])
    f.write_text("a: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(["--config", str(f)])
    with pytest.raises(ConfigError, match="cannot be read"):
        load(["--config", str(tmp_path / "missing.yaml")])
    f.write_text("reserve_mib: lots\n")
    with pytest.raises(ConfigError, match=r"--reserve-mib \(from file .*'lots' is not an integer"):
        load(["--config", str(f)])


def test_shipped_configmap_loads_to_the_defaults() -> None:
    """daemonset/configmap.yaml's config.yaml is valid for `run --config` and
    documents the defaults (apart from the bind-all addresses)."""
    cm = yaml.safe_load((REPO / "daemonset" / "configmap.yaml").read_text())
    path = Path("/tmp") / f"fp-cm-{id(cm)}.yaml"
    path.write_text(cm["data"]["config.yaml"])
    try:
        cfg, sources = load(["--config", str(path)])
    finally:
        path.unlink()
    assert cfg.device_unit_mib == 1024
    differs = {k for k in Config.__dataclass_fields__ if getattr(cfg, k) != getattr(DEFAULTS, k)}
    assert differs <= {"metrics_address", "health_address"}


@pytest.mark.parametrize("value,mib", [("GiB", 1024), ("MiB", 1), ("512Mi", 512), ("2Gi", 2048)])
def test_device_unit_in_file(tmp_path: Path, value: str, mib: int) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(f"device_unit: {value}\n")
    assert load(["--config", str(f)])[0].device_unit_mib == mib


def test_parse_address() -> None:
    assert c.parse_address(":2112") == ("", 2112)
    assert c.parse_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert c.parse_address("[::1]:80") == ("::1", 80)
    for bad in ("8080", "host:", "a:b", "[::1]80"):
        with pytest.raises(ValueError):
            c.parse_address(bad)


def test_reloadable_changes() -> None:
    old = DEFAULTS
    new = Config(log_level="debug", fail_open=True, state_dir="/elsewhere")
    applied, ignored = c.reloadable_changes(old, new)
    assert applied == {"log_level": ("info", "debug"), "fail_open": (False, True)}
    assert ignored == ["state_dir"]


def test_ignored_xids_default_matches_the_health_monitor() -> None:
    from fracplugin.gpu.health import DEFAULT_IGNORED_XIDS

    assert {int(x) for x in DEFAULTS.ignored_xids.split(",")} == set(DEFAULT_IGNORED_XIDS)


def test_every_setting_has_a_flag() -> None:
    p = argparse.ArgumentParser()
    c.add_arguments(p)
    flags = {a.dest for a in p._actions}
    assert set(Config.__dataclass_fields__) <= flags


def test_no_fail_open_flag_overrides_env() -> None:
    cfg, sources = load(["--no-fail-open"], {"FRACPLUGIN_FAIL_OPEN": "true"})
    assert cfg.fail_open is False and sources["fail_open"] == "flag"


def test_role_defaults_and_api_socket() -> None:
    cfg, _ = load([], {})
    assert cfg.role == "all" and cfg.effective_mps_api_socket == "/run/fracplugin/mps/api.sock"
    cfg, _ = load(["--role", "mps", "--mps-root", "/tmp/x/mps"], {})
    assert cfg.effective_mps_api_socket == "/tmp/x/mps/api.sock" and cfg.endpoints_path.endswith("endpoints-mps.json")
    with pytest.raises(ConfigError, match="--no-mps only goes with --role all"):
        load(["--role", "doors", "--no-mps"], {})


def test_unknown_fracplugin_env_is_reported_with_the_closest_setting() -> None:
    env = {
        "FRACPLUGIN_FAILOPEN": "true",  # typo of FRACPLUGIN_FAIL_OPEN
        "FRACPLUGIN_MPS_ROOT": "/run/x",  # a setting
        "FRACPLUGIN_CONFIG": "/etc/fracplugin/config.yaml",  # the file's own variable
        "FRACPLUGIN_MPS_ROLE_CHILD": "1",  # the keeper's marker
        "FRACPLUGIN_METRICS_SERVICE_HOST": "10.0.0.1",  # service links of a Service "fracplugin-metrics"
        "FRACPLUGIN_METRICS_SERVICE_PORT_METRICS": "9400",
        "FRACPLUGIN_PORT": "tcp://10.0.0.1:9400",
        "FRACPLUGIN_PORT_9400_TCP_ADDR": "10.0.0.1",
        "FRACPLUGIN_WHATEVER": "1",
        "HOME": "/root",
    }
    assert c.unknown_env(env) == [("FRACPLUGIN_FAILOPEN", "FRACPLUGIN_FAIL_OPEN"), ("FRACPLUGIN_WHATEVER", None)]


def test_lower_case_setting_variables_are_reported_with_the_upper_case_name() -> None:
    # the environment is case-sensitive on Linux: fracplugin_mps_root sets nothing
    env = {"fracplugin_mps_root": "/run/x", "Fracplugin_Fail_Open": "true", "fracplugin_nonsense_here": "1",
           "fracpluginx": "1", "path": "/bin"}
    assert c.unknown_env(env) == [("Fracplugin_Fail_Open", "FRACPLUGIN_FAIL_OPEN"),
                                  ("fracplugin_mps_root", "FRACPLUGIN_MPS_ROOT"),
                                  ("fracplugin_nonsense_here", None)]


def test_every_setting_variable_is_known() -> None:
    env = {c.env_name(f.name): "x" for f in c.fields(Config)}
    assert c.unknown_env(env) == []


def test_a_removed_setting_is_an_unknown_key(tmp_path: Path) -> None:
    """secure_pipe_mount went in issue 33 (nothing shipped could use it): a
    file still naming it fails as any unknown key does."""
    old = tmp_path / "old.yaml"
    old.write_text("secure_pipe_mount: true\n")
    with pytest.raises(ConfigError, match=rf"unknown setting 'secure_pipe_mount' \(from file {old} line 1\)"):
        c.load(None, {"FRACPLUGIN_CONFIG": str(old)})


def test_config_file_errors_name_the_line(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("reserve_mib: 1024\nfail_open: [true\nlog_level: info\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML at line 3, column \d+: "):
        c.read_file(str(bad_yaml))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("# settings\nreserve_mib: 1024\nreserv_mib: 10\n")
    with pytest.raises(ConfigError, match=rf"unknown setting 'reserv_mib' \(from file {unknown} line 3\)"):
        c.load(None, {"FRACPLUGIN_CONFIG": str(unknown)})
    bad_value = tmp_path / "value.yaml"
    bad_value.write_text("log_level: info\n\nreserve-mib: lots\n")
    with pytest.raises(ConfigError, match=rf"invalid --reserve-mib \(from file {bad_value} line 3\): 'lots'"):
        c.load(None, {"FRACPLUGIN_CONFIG": str(bad_value)})


def test_a_config_file_named_by_env_is_blamed_on_the_env(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=r"invalid --config \(from env FRACPLUGIN_CONFIG\)"):
        c.load(None, {"FRACPLUGIN_CONFIG": str(missing)})


@pytest.mark.parametrize("text, setting, line", [
    ("log_level: info\nmax_clients_per_gpu: 99\n", "--max-clients-per-gpu", 2),  # a rule of validate()
    ("fail_open: false\n\nshutdown-timeout: .nan\n", "--shutdown-timeout", 3),  # the flag's spelling
    ("log_level: [debug]\n", "--log-level", 1),
])
def test_a_value_the_rules_refuse_names_its_line_in_the_file(tmp_path: Path, text: str, setting: str,
                                                               line: int) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load(["--config", str(f)])
    assert ei.value.setting == setting
    assert ei.value.source == f"file {f} line {line}", str(ei.value)


def test_a_key_given_twice_in_the_file_is_refused_naming_both_lines(tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("reserve_mib: 1024\nlog_level: info\nreserve_mib: 2048\n")
    with pytest.raises(ConfigError, match=r"invalid --config \(from flag\): '.*dup.yaml' gives the key 'reserve_mib' twice \(lines 1 and 3\)"):
        c.read_file(str(f))


def test_cdi_spec_dirs_default_flag_and_empty() -> None:
    """``--cdi-spec-dirs DIR[,DIR]`` (issue 23 item 1): default /etc/cdi,/var/run/cdi; empty = none."""
    def load(argv: list[str]) -> tuple[str, ...]:
        p = argparse.ArgumentParser()
        c.add_arguments(p)
        return c.load(p.parse_args(argv), {})[0].cdi_spec_dirs

    assert load([]) == ("/etc/cdi", "/var/run/cdi")
    assert load(["--cdi-spec-dirs", "/a/cdi, /b/cdi"]) == ("/a/cdi", "/b/cdi")
    assert load(["--cdi-spec-dirs", ""]) == ()
