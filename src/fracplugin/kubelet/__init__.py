"""The kubelet device plugin door (issue 4).

Public API (used by the daemon):

- ``DevicePluginServer`` (deviceplugin.py): ``start()``, ``stop(timeout_s)``,
  ``registered()``, ``status()``, ``clear_xid(uuid)``.
- ``InMemoryPodSource`` / ``KubernetesPodSource`` (podlookup.py): the watch
  cache Allocate finds pods in.
- ``PodResourcesClient`` / ``devices_for`` (podresources.py): which devices
  kubelet gave a container.
- ``DEFAULT_RESOURCE_NAME`` (``fracplugin.io/gpu-memory``), ``DEFAULT_UNIT_MIB`` (1024).

Submodules import grpc and the generated protos; importing this package does
too.
"""

from .devices import DEFAULT_RESOURCE_NAME, DEFAULT_UNIT_MIB, DeviceTable, preferred_allocation
from .deviceplugin import DEFAULT_SOCKET_NAME, DevicePluginServer
from .podlookup import InMemoryPodSource, KubernetesPodSource, PodSource
from .podresources import DEFAULT_PODRESOURCES_SOCKET, PodResourcesClient, devices_for
from .registration import DEFAULT_PLUGIN_DIR

__all__ = [
    "DEFAULT_PLUGIN_DIR",
    "DEFAULT_PODRESOURCES_SOCKET",
    "DEFAULT_RESOURCE_NAME",
    "DEFAULT_SOCKET_NAME",
    "DEFAULT_UNIT_MIB",
    "DevicePluginServer",
    "DeviceTable",
    "InMemoryPodSource",
    "KubernetesPodSource",
    "PodResourcesClient",
    "PodSource",
    "devices_for",
    "preferred_allocation",
]
