"""The component tests' kubelet: ``tests/peers/kubelet.py`` (its own gRPC
servers and registration handling, nothing from ``fracplugin.kubelet`` or
``fracplugin_demo``), under the module name the tests import
(``from fake_kubelet import FakeKubelet, FakePodResources``)."""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:  # scripts that put only tests/component on sys.path (benchmarks)
    sys.path.insert(0, _REPO)

from tests.peers.kubelet import CHECKPOINT, FakeKubelet, FakePodResources, Registration  # noqa: E402

__all__ = ["CHECKPOINT", "FakeKubelet", "FakePodResources", "Registration"]
