"""``fracplugin.mountflags``: the MPS root as a nosuid,nodev mount (issue 11,
D9). Kubelet's bind mount from Allocate inherits the flags of the mount its
source sits on (the device plugin API has no mount options), so this is what
makes the Allocate door's pipe directory nosuid,nodev like the NRI door's.

Needs root (CAP_SYS_ADMIN), as the CI and the daemon have.
"""

from __future__ import annotations

import os

from fracplugin import mountflags


def test_secure_adds_nosuid_nodev_and_release_removes_them(tmp_path):
    root = tmp_path / "mps"
    assert not {"nosuid", "nodev"} <= mountflags.flags(str(tmp_path))  # /tmp here lacks them
    assert mountflags.secure(str(root)) is True
    try:
        assert {"nosuid", "nodev"} <= mountflags.flags(str(root))
        # a bind mount of a directory below inherits them (what containerd does)
        (root / "ts").mkdir()
        assert {"nosuid", "nodev"} <= mountflags.flags(str(root / "ts"))
        assert mountflags.secure(str(root)) is False  # already there: nothing to do
    finally:
        mountflags.release(str(root))
    assert not {"nosuid", "nodev"} <= mountflags.flags(str(root))
    assert os.path.isdir(root / "ts")  # the same directory underneath


def test_secure_of_an_impossible_path_names_it(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    try:
        mountflags.secure(str(f / "below"))
    except OSError as e:
        assert str(f) in str(e)
    else:
        raise AssertionError("secure() below a regular file must fail")
