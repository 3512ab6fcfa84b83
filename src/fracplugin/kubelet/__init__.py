"""The kubelet device plugin door (issue 4).

- ``deviceplugin.DevicePluginServer``: the door (``start()``, ``stop(timeout_s)``,
  ``registered()``, ``status()``).
- ``podlookup.InMemoryPodSource`` / ``KubernetesPodSource``: the watch cache
  Allocate finds pods in.
- ``podresources.PodResourcesClient`` / ``devices_for``: which devices kubelet
  gave a container.
- ``devices.DEFAULT_RESOURCE_NAME`` (``fracplugin.io/gpu-memory``), ``DEFAULT_UNIT_MIB`` (1024).

Importing this package, or a pure submodule such as ``devices`` (which config
validation and the NRI door use), does not import the door's gRPC library
(grpcio, ADR 0021) nor the generated protos, which a process without the device
plugin door (``--no-device-plugin``, ``--role mps``) never pays (ADR 0016). The
submodules that speak gRPC (deviceplugin, registration, podresources) import
grpcio themselves, with the options of ``grpcopts``.
"""
