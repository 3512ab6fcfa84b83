"""The kubelet device plugin door (issue 4).

Public API (used by the daemon):

- ``DevicePluginServer`` (deviceplugin.py): ``start()``, ``stop(timeout_s)``,
  ``registered()``, ``status()``, ``clear_xid(uuid)``.
- ``InMemoryPodSource`` / ``KubernetesPodSource`` (podlookup.py): the watch
  cache Allocate finds pods in.
- ``PodResourcesClient`` / ``devices_for`` (podresources.py): which devices
  kubelet gave a container.
- ``DEFAULT_RESOURCE_NAME`` (``fracplugin.io/gpu-memory``), ``DEFAULT_UNIT_MIB`` (1024).

The names above are loaded on first use (PEP 562 module ``__getattr__``):
importing this package, or a pure submodule such as ``devices`` (which
config validation and the NRI door use), does not import
the door's gRPC library (grpcio, ADR 0021) nor the generated protos, which a
process without the device plugin door (``--no-device-plugin``, ``--role
mps``) never pays (ADR 0016). The submodules that speak gRPC (deviceplugin,
registration, podresources) import grpcio themselves, with the options of
``grpcopts``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .deviceplugin import DEFAULT_SOCKET_NAME, DevicePluginServer
    from .devices import DEFAULT_RESOURCE_NAME, DEFAULT_UNIT_MIB, DeviceTable, preferred_allocation
    from .podlookup import InMemoryPodSource, KubernetesPodSource, PodSource
    from .podresources import DEFAULT_PODRESOURCES_SOCKET, PodResourcesClient, devices_for
    from .registration import DEFAULT_PLUGIN_DIR

_EXPORTS = {
    "DEFAULT_PLUGIN_DIR": "registration",
    "DEFAULT_PODRESOURCES_SOCKET": "podresources",
    "DEFAULT_RESOURCE_NAME": "devices",
    "DEFAULT_SOCKET_NAME": "deviceplugin",
    "DEFAULT_UNIT_MIB": "devices",
    "DevicePluginServer": "deviceplugin",
    "DeviceTable": "devices",
    "InMemoryPodSource": "podlookup",
    "KubernetesPodSource": "podlookup",
    "PodResourcesClient": "podresources",
    "PodSource": "podlookup",
    "devices_for": "podresources",
    "preferred_allocation": "devices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Load an exported name from its submodule on first use (PEP 562).

    Raises AttributeError for a name this package does not export."""
    sub = _EXPORTS.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
