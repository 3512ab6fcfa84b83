"""The kubelet device plugin door (issue 4): ``deviceplugin.DevicePluginServer``
and its parts (docs/architecture.md section 2).

Importing this package, or a pure submodule such as ``devices`` (which config
validation and the NRI door use), imports neither grpcio (ADR 0021) nor the
generated protos, which a process without the door never pays (ADR 0016); the
submodules that speak gRPC import grpcio themselves, with ``grpcopts``' options.
"""
