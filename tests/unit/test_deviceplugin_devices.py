"""Device naming and GetPreferredAllocation (pure): fracplugin.kubelet.devices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fracplugin.gpu.simulated import load_node
from fracplugin.kubelet.devices import (
    DEFAULT_RESOURCE_NAME,
    MAX_DEVICE_ID_LEN,
    MAX_LIST_AND_WATCH_BYTES,
    DeviceIdError,
    DeviceTable,
    DeviceTableTooLarge,
    device_id,
    list_and_watch_bytes,
    parse_device_id,
    preferred_allocation,
    smallest_fitting_unit,
    validate_resource_name,
)
from fracplugin.model import ComputeMode, GpuInfo, NodeInfo


@pytest.fixture(scope="module")
def node(node_file) -> NodeInfo:
    return load_node(node_file)


@pytest.fixture(scope="module")
def table(node) -> DeviceTable:
    return DeviceTable.build(node, 1024)


def uuids(node: NodeInfo) -> list[str]:
    return [g.uuid for g in node.gpus]


def test_gpu_node_1_has_79_devices_per_gpu(node, table):
    # 81559 MiB // 1024 = 79 whole GiB per H100 80GB.
    assert dict(table.per_gpu) == {u: 79 for u in uuids(node)}
    assert len(table) == 316
    ids = list(table.lookup)
    assert len(ids) == len(set(ids)) == 316
    assert ids[0] == f"{node.gpus[0].uuid}::0"
    assert ids[-1] == f"{node.gpus[3].uuid}::78"
    assert max(len(i) for i in ids) <= MAX_DEVICE_ID_LEN


def test_unit_is_configurable(node):
    t = DeviceTable.build(node, 512)
    assert t.per_gpu[node.gpus[0].uuid] == 81559 // 512
    with pytest.raises(ValueError, match=">= 1"):
        DeviceTable.build(node, 0)


def test_device_id_over_63_chars_is_refused():
    long_uuid = "GPU-" + "a" * 60
    node = NodeInfo("n", "1", 1, (GpuInfo(0, long_uuid, "x", 4096, 0),))
    with pytest.raises(ValueError, match="63"):
        DeviceTable.build(node, 1024)


def test_mig_gpu_gets_no_devices():
    node = NodeInfo("n", "1", 1, (GpuInfo(0, "GPU-a", "x", 4096, 0, mig_enabled=True),))
    assert DeviceTable.build(node, 1024).per_gpu == {"GPU-a": 0}


def test_parse_round_trip_and_errors(node, table):
    u = node.gpus[2].uuid
    assert parse_device_id(device_id(u, 17)) == (u, 17)
    for bad in ("", "GPU-x", "GPU-x::", "::3", "GPU-x::a"):
        with pytest.raises(DeviceIdError):
            parse_device_id(bad)
    with pytest.raises(DeviceIdError, match="not on node"):
        table.gpu_of("GPU-nope::1")
    with pytest.raises(DeviceIdError, match="0..78"):
        table.gpu_of(f"{u}::79")
    assert table.gpu_of(f"{u}::78").index == 2


@pytest.mark.parametrize("suffix", ["\u00b2", "\u0661", "\uff10", "01", "+1", "-1", " 1", "1 ", "1_0", "9" * 5000])
def test_only_canonical_ascii_ids_are_devices(node, table, suffix):
    # Unicode digits used to reach int() (INTERNAL); "01"/"\u0661" aliased device 1
    # and slipped past the duplicate check.
    u = node.gpus[0].uuid
    with pytest.raises(DeviceIdError) as exc:
        table.gpu_of(f"{u}::{suffix}")
    assert len(str(exc.value)) < 400  # named, but cut: gRPC details travel in 8 KiB metadata
    with pytest.raises(DeviceIdError):
        table.group([f"{u}::1", f"{u}::{suffix}"])


def test_aliases_of_one_device_are_not_two_devices(node, table):
    u = node.gpus[0].uuid
    with pytest.raises(DeviceIdError, match="leading zero"):
        table.group([f"{u}::1", f"{u}::01", f"{u}::\u0661"])


def test_list_and_watch_size_matches_the_encoded_message(node):
    from fracplugin._proto import deviceplugin_pb2 as pb

    nodes = [node, NodeInfo("n", "1", 1, (GpuInfo(0, "GPU-a", "x", 5000, 0, numa_node=300),
                                          GpuInfo(1, "GPU-b", "x", 3000, 1),
                                          GpuInfo(2, "GPU-c", "x", 3000, 2, mig_enabled=True)))]
    for n in nodes:
        for unit in ((7, 1024) if n is node else (1, 7, 1024)):
            devs = []
            for g in n.gpus:
                for dev in (device_id(g.uuid, i) for i in range(0 if g.mig_enabled else g.memory_mib // unit)):
                    d = pb.Device(ID=dev, health="Unhealthy")
                    if g.numa_node is not None:
                        d.topology.CopyFrom(pb.TopologyInfo(nodes=[pb.NUMANode(ID=g.numa_node)]))
                    devs.append(d)
            assert list_and_watch_bytes(n, unit) == pb.ListAndWatchResponse(devices=devs).ByteSize()


def test_table_whose_list_would_exceed_kubelets_receive_limit_is_refused(node):
    # 4 x 81559 MiB in 1 MiB devices: 326,236 devices, ~20 MB of ListAndWatch;
    # kubelet (4 MiB gRPC receive limit) would never get a list.
    with pytest.raises(DeviceTableTooLarge) as exc:
        DeviceTable.build(node, 1)
    e = exc.value
    assert isinstance(e, ValueError)
    smallest = smallest_fitting_unit(node)
    assert smallest is not None and smallest > 1
    size = list_and_watch_bytes(node, 1)
    assert size > 4 * 1024 * 1024 and f"would be {size} bytes" in str(e)
    assert "1 MiB" in str(e) and "326236 devices" in str(e) and f"at least {smallest} MiB" in str(e)
    assert list_and_watch_bytes(node, smallest) <= MAX_LIST_AND_WATCH_BYTES < list_and_watch_bytes(node, smallest - 1)
    assert len(DeviceTable.build(node, smallest)) > 0
    with pytest.raises(DeviceTableTooLarge):
        DeviceTable.build(node, smallest - 1)


def test_group_refuses_duplicates_and_orders_by_gpu_index(node, table):
    a, b = node.gpus[0].uuid, node.gpus[3].uuid
    grouped = table.group([f"{b}::1", f"{a}::5", f"{b}::0"])
    assert list(grouped) == [a, b]
    assert grouped[b] == [f"{b}::1", f"{b}::0"]
    with pytest.raises(DeviceIdError, match="twice"):
        table.group([f"{a}::1", f"{a}::1"])


@pytest.mark.parametrize(
    "name",
    [DEFAULT_RESOURCE_NAME, "example.com/gpu-fraction", "a.b.c/x_y.z"],
)
def test_resource_names_kubelet_accepts(name):
    assert validate_resource_name(name) == name


@pytest.mark.parametrize(
    "name,rule",
    [
        ("gpu-memory", "<domain>/<name>"),
        ("kubernetes.io/gpu", "reserved"),
        ("foo.kubernetes.io/gpu", "reserved"),
        ("Example.com/gpu", "DNS subdomain"),
        ("example.com/", "qualified name"),
        ("example.com/" + "x" * 64, "qualified name"),
        ("a/b/c", "<domain>/<name>"),
    ],
)
def test_resource_names_kubelet_rejects(name, rule):
    with pytest.raises(ValueError, match=rule):
        validate_resource_name(name)


# ---- GetPreferredAllocation -------------------------------------------------


def test_request_that_fits_one_gpu_lands_on_one_gpu(table, node):
    got = preferred_allocation(table, list(table.lookup), [], 20)
    assert len(got) == 20
    assert {parse_device_id(d)[0] for d in got} == {node.gpus[0].uuid}


def test_pack_prefers_the_fuller_gpu_spread_the_emptier(table, node):
    g0, g1 = node.gpus[0].uuid, node.gpus[1].uuid
    # GPU 1 already has 60 of 79 devices taken: 19 available; others all free.
    avail = [d for d in list(table.lookup) if not (d.startswith(g1) and parse_device_id(d)[1] < 60)]
    packed = preferred_allocation(table, avail, [], 10, policy="pack")
    assert {parse_device_id(d)[0] for d in packed} == {g1}
    spread = preferred_allocation(table, avail, [], 10, policy="spread")
    assert {parse_device_id(d)[0] for d in spread} == {g0}
    # 25 does not fit GPU 1's 19: lands whole on one free GPU.
    big = preferred_allocation(table, avail, [], 25, policy="pack")
    assert len({parse_device_id(d)[0] for d in big}) == 1
    assert parse_device_id(big[0])[0] != g1


def test_mode_of_tenants_steers_the_choice(table, node):
    g2 = node.gpus[2].uuid
    modes = {node.gpus[0].uuid: ComputeMode.TIME_SLICING, g2: ComputeMode.SM_SHARING}
    got = preferred_allocation(
        table, list(table.lookup), [], 8, mode_of=modes.get, pod_mode=ComputeMode.SM_SHARING
    )
    assert {parse_device_id(d)[0] for d in got} == {g2}
    # A time-slicing pod avoids the sm-sharing GPU and joins the time-slicing one.
    got = preferred_allocation(
        table, list(table.lookup), [], 8, mode_of=modes.get, pod_mode=ComputeMode.TIME_SLICING
    )
    assert {parse_device_id(d)[0] for d in got} == {node.gpus[0].uuid}


def test_must_include_is_honoured_and_completed_on_its_gpu(table, node):
    g3 = node.gpus[3].uuid
    must = [f"{g3}::40", f"{g3}::41"]
    got = preferred_allocation(table, list(table.lookup), must, 6)
    assert got[:2] == must
    assert len(got) == len(set(got)) == 6
    assert {parse_device_id(d)[0] for d in got} == {g3}


def test_request_larger_than_a_gpu_splits_evenly(table, node):
    got = preferred_allocation(table, list(table.lookup), [], 160)
    per = {}
    for d in got:
        per[parse_device_id(d)[0]] = per.get(parse_device_id(d)[0], 0) + 1
    assert per == {u: 40 for u in uuids(node)}  # 160 = 4 x 40 (2 x 80 does not fit 79)
    got = preferred_allocation(table, list(table.lookup), [], 100)
    per = {}
    for d in got:
        per[parse_device_id(d)[0]] = per.get(parse_device_id(d)[0], 0) + 1
    assert sorted(per.values()) == [50, 50]


def test_unknown_ids_are_never_returned(table):
    avail = ["GPU-nope::1", "junk"] + list(table.lookup)[:3]
    got = preferred_allocation(table, avail, ["GPU-nope::2"], 3)
    assert got == list(table.lookup)[:3]


def test_bad_policy_is_refused(table):
    with pytest.raises(ValueError, match="pack, spread"):
        preferred_allocation(table, list(table.lookup), [], 1, policy="random")


@settings(max_examples=60, deadline=None)
@given(
    st.data(),
    st.integers(min_value=0, max_value=200),
    st.sampled_from(["pack", "spread"]),
)
def test_preferred_allocation_properties(data, size, policy):
    node = NodeInfo(
        "n",
        "1",
        1,
        tuple(GpuInfo(i, f"GPU-{i}", "x", 16 * 1024, i) for i in range(4)),
    )
    table = DeviceTable.build(node, 1024)
    all_ids = list(table.lookup)
    avail = data.draw(st.lists(st.sampled_from(all_ids), unique=True, max_size=64))
    must = data.draw(st.lists(st.sampled_from(avail), unique=True, max_size=4)) if avail else []
    got = preferred_allocation(table, avail, must, size, policy=policy)
    assert len(got) == len(set(got)), "no duplicate IDs"
    assert set(got) <= set(avail)
    if size >= len(must):
        assert set(must) <= set(got)
    if got == must[:size]:
        pass  # kubelet's must_include as given (it may itself be uneven): never topped up unevenly
    elif len(got) == size and size:
        per: dict[str, int] = {}
        for d in got:
            per[parse_device_id(d)[0]] = per.get(parse_device_id(d)[0], 0) + 1
        assert len(set(per.values())) == 1, f"an uneven split Allocate would refuse: {per}"
    else:  # no even split exists: only what kubelet must include, never an uneven proposal
        assert got == must[:size]


def test_gpu_without_free_memory_by_the_ledger_is_avoided(table, node):
    # GPU 0 looks empty to kubelet, but NRI-door tenants hold 78 GiB of it.
    room = {node.gpus[0].uuid: 81559 - 78 * 1024}
    got = preferred_allocation(table, list(table.lookup), [], 4, free_mib_of=room.get)
    assert {parse_device_id(d)[0] for d in got} == {node.gpus[1].uuid}
    # When every GPU is short, the answer still has the requested size.
    short = {g.uuid: 0 for g in node.gpus}
    assert len(preferred_allocation(table, list(table.lookup), [], 4, free_mib_of=short.get)) == 4
