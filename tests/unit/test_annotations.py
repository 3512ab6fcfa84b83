"""annotations.parse: every row of the contract table (docs/reference/design.md section 4)."""

from __future__ import annotations

import pytest

from fracplugin.annotations import parse, parse_quantity_mib
from fracplugin.model import ComputeMode, FractionError

P = "nvidia.com/container."


def a(container="app", **suffixes):
    return {f"{P}{container}.{k.replace('_', '-').replace('--', '.')}": v for k, v in suffixes.items()}


def req(request=None, limit=None, mode=None, portion=None, devices=None, c="app"):
    d = {}
    if request is not None:
        d[f"{P}{c}.gpu-memory.request"] = request
    if limit is not None:
        d[f"{P}{c}.gpu-memory.limit"] = limit
    if mode is not None:
        d[f"{P}{c}.gpu-compute.mode"] = mode
    if portion is not None:
        d[f"{P}{c}.gpu-compute.portion"] = portion
    if devices is not None:
        d[f"{P}{c}.gpus.devices"] = devices
    return d


@pytest.mark.parametrize("raw,mib", [
    ("40Gi", 40960), ("4096M", 3907), ("1.5G", 1431), ("500Mi", 500), ("4294967296", 4096),
    ("1e9", 954), ("1000M", 954), ("1G", 954), ("100M", 96), ("1024Ki", 1), ("1Mi", 1), ("1048577", 2),
])
def test_quantities_round_up_to_whole_mib(raw, mib):
    assert parse_quantity_mib("k", raw) == mib


@pytest.mark.parametrize("raw,fragment", [
    ("", "blank"), ("-1Gi", "negative"), ("0", "below 1Mi"), ("100Ki", "below 1Mi"), ("500m", "below 1Mi"),
    ("lots", "not a Kubernetes quantity"), (" 4Gi", "whitespace"), ("4Gi ", "whitespace"),
    ("1e400", "absurdly large"), ("2Pi", "absurdly large"), ("4 Gi", "not a Kubernetes quantity"),
])
def test_bad_quantities_are_refused_with_key_value_and_rule(raw, fragment):
    with pytest.raises(FractionError) as ei:
        parse(req(request=raw), "app")
    err = ei.value
    assert err.key == f"{P}app.gpu-memory.request"
    assert err.value == raw
    assert fragment in err.reason
    assert err.message.startswith(f'{P}app.gpu-memory.request="{raw}" ')


def test_limit_below_request_message_names_everything():
    with pytest.raises(FractionError) as ei:
        parse(req(request="40Gi", limit="20Gi"), "app")
    assert str(ei.value) == (
        'nvidia.com/container.app.gpu-memory.limit="20Gi" is below the request 40Gi (40960 MiB): '
        "the limit must be >= the request"
    )
    assert ei.value.code == "limit_below_request"


def test_request_and_limit_default_to_each_other():
    r = parse(req(request="8Gi"), "app")
    assert (r.request.mib, r.limit.mib) == (8192, 8192)
    r = parse(req(limit="8Gi"), "app")
    assert (r.request.mib, r.limit.mib) == (8192, 8192)


def test_not_fractional_without_memory_annotations():
    assert parse({}, "app") is None
    assert parse({"unrelated": "x"}, "app") is None


def test_exact_key_lookup_never_matches_a_prefix_container():
    ann = req(request="4Gi", c="trainer-2")
    assert parse(ann, "trainer") is None
    assert parse(ann, "trainer-2").request.mib == 4096


@pytest.mark.parametrize("mode", ["", " sm-sharing", "SM-SHARING", "mps", "time_slicing"])
def test_compute_mode_must_be_exact(mode):
    with pytest.raises(FractionError) as ei:
        parse(req(request="1Gi", mode=mode), "app")
    assert ei.value.key == f"{P}app.gpu-compute.mode"
    assert ei.value.value == mode


def test_mode_defaults_to_time_slicing():
    assert parse(req(request="1Gi"), "app").compute_mode is ComputeMode.TIME_SLICING
    assert parse(req(request="1Gi", mode="sm-sharing"), "app").compute_mode is ComputeMode.SM_SHARING


@pytest.mark.parametrize("portion", ["0", "-0", "1.5", "50%", "NaN", "inf", "", " 0.5", "50", "1.0000001", "500m", "1_0"])
def test_bad_portions_refused(portion):
    with pytest.raises(FractionError) as ei:
        parse(req(request="1Gi", mode="sm-sharing", portion=portion), "app")
    assert ei.value.key == f"{P}app.gpu-compute.portion"


@pytest.mark.parametrize("portion,atp", [("0.125", 12), ("0.336", 33), ("0.29", 28), ("0.005", 1), ("1", 100), ("0.5", 50)])
def test_active_thread_percentage_is_floor_at_least_one(portion, atp):
    r = parse(req(request="1Gi", mode="sm-sharing", portion=portion), "app")
    assert r.active_thread_percentage == atp


def test_portion_gives_no_cap_in_time_slicing():
    r = parse(req(request="1Gi", portion="0.5"), "app")
    assert r.portion == 0.5 and r.active_thread_percentage is None


def test_devices_list_parsed_in_order_and_counted():
    r = parse(req(request="1Gi", devices="GPU-b, GPU-a"), "app")
    assert r.devices == ("GPU-b", "GPU-a") and r.num_devices == 2
    assert parse(req(request="1Gi", devices="  "), "app").devices == ()


@pytest.mark.parametrize("devices", ["a,,b", "a,a", ","])
def test_bad_device_lists_refused(devices):
    with pytest.raises(FractionError):
        parse(req(request="1Gi", devices=devices), "app")


def test_kai_pod_level_fraction_forms():
    r = parse({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8", "gpu-fraction-num-devices": "2"}, "app")
    assert r.request.fraction == 0.5 and r.limit.fraction == 0.8 and r.num_devices == 2
    assert r.request.resolve_mib(81559) == 40779 and r.limit.resolve_mib(81559) == 65247
    assert r.request.resolve_mib(81559, reserve_mib=559) == 40500


def test_gpu_memory_mib_form_and_per_container_request_wins():
    assert parse({"gpu-memory": "2048"}, "app").request.mib == 2048
    r = parse({"gpu-memory": "2048", **req(request="4Gi")}, "app")
    assert r.request.mib == 4096


@pytest.mark.parametrize("ann,key", [
    ({"gpu-fraction": "0"}, "gpu-fraction"),
    ({"gpu-fraction": "1"}, "gpu-fraction"),
    ({"gpu-fraction": "1.2"}, "gpu-fraction"),
    ({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.5"}, "gpu-fraction.limit"),
    ({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.4"}, "gpu-fraction.limit"),
    ({"gpu-fraction": "0.5", "gpu-fraction.limit": "1.1"}, "gpu-fraction.limit"),
    ({"gpu-memory": "-5"}, "gpu-memory"),
    ({"gpu-memory": "4Gi"}, "gpu-memory"),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "0"}, "gpu-fraction-num-devices"),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "two"}, "gpu-fraction-num-devices"),
])
def test_kai_forms_refused(ann, key):
    with pytest.raises(FractionError) as ei:
        parse(ann, "app")
    assert ei.value.key == key


def test_container_name_selects_who_gets_pod_level_forms():
    ann = {"gpu-fraction": "0.25", "gpu-fraction-container-name": "worker"}
    assert parse(ann, "app", containers=["app", "worker"]) is None
    assert parse(ann, "worker", containers=["app", "worker"]).request.fraction == 0.25
    with pytest.raises(FractionError):
        parse({"gpu-fraction": "0.25", "gpu-fraction-container-name": "ghost"}, "app", containers=["app"])
    # without the name: the first container (KAI's rule) when the spec is known
    assert parse({"gpu-fraction": "0.25"}, "sidecar", containers=["app", "sidecar"]) is None


def test_form_targets_are_the_app_containers_then_the_native_sidecars():
    from fracplugin.annotations import form_targets, native_sidecars

    spec = {"initContainers": [{"name": "setup"}, {"name": "proxy", "restartPolicy": "Always"},
                               {"name": "odd", "restartPolicy": "OnFailure"}, "junk"],
            "containers": [{"name": "app"}, {"name": "worker"}]}
    assert native_sidecars(spec) == ["proxy"]
    assert form_targets(spec) == ["app", "worker", "proxy"]
    assert form_targets({"containers": "junk", "initContainers": None}) == [] == native_sidecars({})
    ann = {"gpu-fraction": "0.25", "gpu-fraction-container-name": "proxy"}
    # a named native sidecar gets the form; the app is untouched, not refused
    assert parse(ann, "proxy", containers=form_targets(spec)).request.fraction == 0.25
    assert parse(ann, "app", containers=form_targets(spec)) is None
    # a plain init container runs to completion before the app: not a target
    with pytest.raises(FractionError) as ei:
        parse({**ann, "gpu-fraction-container-name": "setup"}, "app", containers=form_targets(spec))
    assert ei.value.key == "gpu-fraction-container-name"
    # without a name the forms still go to the first app container
    assert parse({"gpu-fraction": "0.25"}, "proxy", containers=form_targets(spec)) is None
    assert parse({"gpu-fraction": "0.25"}, "app", containers=form_targets(spec)) is not None


def test_kai_portion_limit_for_one_container():
    ann = {**req(request="10Gi"), "kai.scheduler/container.app.gpu-memory.portion.limit": "0.5"}
    r = parse(ann, "app")
    assert r.limit.fraction == 0.5 and r.request.mib == 10240


def test_num_devices_must_match_device_list():
    ann = {**req(request="1Gi", devices="GPU-a,GPU-b"), "gpu-fraction-num-devices": "3"}
    with pytest.raises(FractionError) as ei:
        parse(ann, "app")
    assert ei.value.key == "gpu-fraction-num-devices"


def test_empty_prefix_is_allowed():
    assert parse({"app.gpu-memory.request": "1Gi"}, "app", prefix="").request.mib == 1024


@pytest.mark.parametrize("ann,key", [
    ({"gpu-memory": "9" * 4400}, "gpu-memory"),
    ({"gpu-memory": "1024", "gpu-fraction-num-devices": "9" * 5000}, "gpu-fraction-num-devices"),
    ({"gpu-memory": "²"}, "gpu-memory"),
    ({"gpu-memory": "١٠٢٤"}, "gpu-memory"),
])
def test_huge_and_non_ascii_numbers_are_refused_not_crashes(ann, key):
    with pytest.raises(FractionError) as ei:
        parse(ann, "app")
    assert ei.value.key == key
    assert len(ei.value.message) < 600  # long values are cut in messages


def test_long_values_are_cut_in_messages():
    with pytest.raises(FractionError) as ei:
        parse(req(request="x" * 1_000_000), "app")
    assert ei.value.value.endswith("... (1000000 characters)") and len(ei.value.message) < 600


def test_annotated_containers_names_the_per_container_memory_forms_only():
    from fracplugin.annotations import annotated_containers

    p = "nvidia.com/container."
    ann = {
        p + "app.gpu-memory.request": "1Gi",
        p + "side.car.gpu-memory.limit": "2Gi",  # a name may hold dots: the suffix decides
        p + "mode-only.gpu-compute.mode": "sm-sharing",  # not fractional on its own
        "kai.scheduler/container.kai.gpu-memory.portion.limit": "0.5",
        p + ".gpu-memory.request": "1Gi",  # names no container
        "kai.scheduler/container..gpu-memory.portion.limit": "0.5",
        "gpu-fraction": "0.5",  # pod-level: the pod's spec decides the container
        "other.io/app.gpu-memory.request": "1Gi",
    }
    assert annotated_containers(ann, p) == ["app", "kai", "side.car"]
    assert annotated_containers(ann, "") == ["kai"]
    assert annotated_containers({}, p) == []
