"""Registration helpers: socket identity, directory wake-ups, clear errors."""

from __future__ import annotations

import os
import threading

import pytest

from fracplugin._proto import deviceplugin_pb2 as pb
from fracplugin.kubelet.registration import DirWatch, RegistrationError, probe, register, socket_identity


def test_socket_identity_changes_when_the_file_is_recreated(tmp_path):
    p = tmp_path / "kubelet.sock"
    assert socket_identity(str(p)) is None
    p.write_text("a")
    first = socket_identity(str(p))
    p.unlink()
    p.write_text("b")
    assert socket_identity(str(p)) not in (None, first)


def test_dirwatch_wakes_on_a_new_file_and_on_kick(tmp_path):
    w = DirWatch(str(tmp_path))
    try:
        if not w.active:
            pytest.skip("inotify not available on this kernel")  # the poll fallback is covered by the registrar
        woke = threading.Event()

        def waiter() -> None:
            w.wait(30.0)
            woke.set()

        t = threading.Thread(target=waiter)
        t.start()
        (tmp_path / "kubelet.sock").write_text("x")
        assert woke.wait(10.0)
        t.join()
        woke.clear()
        t = threading.Thread(target=waiter)
        t.start()
        w.kick()
        assert woke.wait(10.0)
        t.join()
    finally:
        w.close()


def test_dirwatch_on_a_missing_directory_still_times_out_and_kicks(tmp_path):
    w = DirWatch(str(tmp_path / "absent"))
    try:
        assert not w.active
        w.kick()
        w.wait(10.0)  # returns at once: the kick is pending
    finally:
        w.close()


def test_register_without_kubelet_socket_names_the_path(tmp_path):
    with pytest.raises(RegistrationError, match="kubelet.sock does not exist"):
        register(str(tmp_path / "kubelet.sock"), "fracplugin.sock", "fracplugin.io/gpu-memory", pb.DevicePluginOptions())


def test_probe_of_a_silent_socket_is_a_registration_error(tmp_path):
    path = str(tmp_path / "x.sock")
    with pytest.raises(RegistrationError, match="does not answer"):
        probe(path, timeout_s=0.2)
    assert not os.path.exists(path)
