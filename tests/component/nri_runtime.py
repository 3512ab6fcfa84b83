"""The component tests' NRI runtime: ``tests/peers/nri_runtime.py`` (its own
mux/ttrpc wire code, nothing from ``fracplugin.nri``), under the module name
the tests import (``from nri_runtime import FakeNriRuntime, ...``)."""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:  # scripts that put only tests/component on sys.path (benchmarks)
    sys.path.insert(0, _REPO)

from tests.peers.nri_runtime import (  # noqa: E402
    Code,
    ConnectionClosed,
    FakeNriRuntime,
    PluginInfo,
    RpcError,
    effective_env,
    make_container,
    make_pod,
    pod_from_manifest,
)

__all__ = [
    "Code",
    "ConnectionClosed",
    "FakeNriRuntime",
    "PluginInfo",
    "RpcError",
    "effective_env",
    "make_container",
    "make_pod",
    "pod_from_manifest",
]
