"""procfs: /proc/<pid>/cgroup -> container id and pod UID (docs/reference/mps-nvml.md section 4.6)."""

from __future__ import annotations

import os

import pytest

from fracplugin.procfs import ContainerRef, ProcFs, container_id_matches, parse_cgroup

CID = "3f2a9c1e" * 8
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
UID_ = UID.replace("-", "_")

CASES = [
    # cgroup v2, systemd driver, containerd, burstable
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     ContainerRef(CID, UID, "containerd", "")),
    # besteffort
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     ContainerRef(CID, UID, "containerd", "")),
    # guaranteed: pod slice directly under kubepods.slice
    (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     ContainerRef(CID, UID, "containerd", "")),
    # CRI-O, systemd driver
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{CID}.scope\n",
     ContainerRef(CID, UID, "cri-o", "")),
    # cgroupfs driver, v2
    (f"0::/kubepods/burstable/pod{UID}/{CID}\n", ContainerRef(CID, UID, "", "")),
    # cgroupfs driver, guaranteed
    (f"0::/kubepods/pod{UID}/{CID}\n", ContainerRef(CID, UID, "", "")),
    # private cgroup namespace: path relative with /../ prefixes
    (f"0::/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     ContainerRef(CID, UID, "containerd", "")),
    # cgroup v1, many hierarchies, cgroupfs driver
    ("12:memory:/kubepods/burstable/pod" + UID + "/" + CID + "\n"
     "11:cpu,cpuacct:/kubepods/burstable/pod" + UID + "/" + CID + "\n"
     "1:name=systemd:/kubepods/burstable/pod" + UID + "/" + CID + "\n",
     ContainerRef(CID, UID, "", "")),
    # cgroup v1 + systemd driver, only name=systemd names the container
    ("5:devices:/\n"
     f"1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope\n",
     ContainerRef(CID, UID, "docker", "")),
]


@pytest.mark.parametrize("text,want", CASES)
def test_parse_cgroup_shapes(text, want):
    got = parse_cgroup(text)
    assert got is not None
    assert (got.container_id, got.pod_uid, got.runtime) == (want.container_id, want.pod_uid, want.runtime)


@pytest.mark.parametrize("text", [
    "0::/init.scope\n",
    "0::/user.slice/user-0.slice/session-3.scope\n",
    "0::/\n",
    "",
    "garbage\n",
    f"0::/system.slice/{CID}\n",  # a bare 64-hex leaf outside kubepods is not a container
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice\n",  # pod-level cgroup
])
def test_non_container_paths(text):
    assert parse_cgroup(text) is None


def test_v2_line_preferred_over_v1():
    other = "9" * 64
    text = (f"1:name=systemd:/kubepods/pod{UID}/{other}\n"
            f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n")
    assert parse_cgroup(text).container_id == CID


def test_short_pod_uid_rejected_but_container_kept():
    ref = parse_cgroup(f"0::/kubepods.slice/kubepods-podabc.slice/cri-containerd-{CID}.scope\n")
    assert ref is not None and ref.container_id == CID and ref.pod_uid == ""


@pytest.mark.parametrize("a,b,want", [
    (CID, CID, True),
    (CID, CID[:12], True),
    (CID[:13], CID, True),
    (CID, CID[:11], False),
    (CID, "", False),
    (CID, "f" * 64, False),
])
def test_container_id_matches(a, b, want):
    assert container_id_matches(a, b) is want


def test_procfs_reads_an_injected_root(tmp_path):
    root = tmp_path / "proc"
    for pid, text in ((10, CASES[0][0]), (11, "0::/init.scope\n")):
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(text)
    (root / "12").mkdir()
    os.symlink("/usr/bin/nvidia-cuda-mps-server", root / "12" / "exe")
    (root / "12" / "stat").write_text("12 (nvidia-cuda-mps) S 7 12 12 0 -1\n")
    (root / "self").mkdir()
    fs = ProcFs(str(root))
    assert fs.pids() == [10, 11, 12]
    assert fs.container_of(10).container_id == CID
    assert fs.container_of(11) is None
    assert fs.container_of(99) is None  # exited: a normal race
    assert fs.exe_basename(12) == "nvidia-cuda-mps-server"
    assert fs.exe_basename(10) is None
    assert fs.ppid(12) == 7
    assert fs.pids_by_exe("nvidia-cuda-mps-server") == [12]


def test_procfs_real_proc_for_this_process():
    fs = ProcFs()
    assert fs.cgroup_text(os.getpid()) is not None
    assert fs.ppid(os.getpid()) == os.getppid()
    assert fs.exe_basename(os.getpid()) is not None


from hypothesis import given, strategies as st  # noqa: E402

_hex = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
_uid = st.uuids().map(str)


@given(cid=_hex, uid=_uid, qos=st.sampled_from(["", "burstable", "besteffort"]),
       rt=st.sampled_from(["cri-containerd", "crio", "docker"]), driver=st.sampled_from(["systemd", "cgroupfs"]),
       v1=st.booleans(), prefix=st.sampled_from(["", "/../..", "/.."]))
def test_generated_paths_round_trip(cid, uid, qos, rt, driver, v1, prefix):
    if driver == "systemd":
        u = uid.replace("-", "_")
        pod = f"kubepods-{qos}-pod{u}.slice" if qos else f"kubepods-pod{u}.slice"
        mid = f"/kubepods.slice/kubepods-{qos}.slice" if qos else "/kubepods.slice"
        path = f"{prefix}{mid}/{pod}/{rt}-{cid}.scope"
    else:
        path = f"{prefix}/kubepods{'/' + qos if qos else ''}/pod{uid}/{cid}"
    text = (f"12:memory:{path}\n1:name=systemd:{path}\n" if v1 else f"0::{path}\n")
    ref = parse_cgroup(text)
    assert ref is not None and ref.container_id == cid and ref.pod_uid == uid
