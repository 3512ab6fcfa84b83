"""Generated protobuf / gRPC code for fracplugin. DO NOT EDIT.

Regenerate with ``make proto`` (``.venv/bin/python scripts/genproto.py``) from
the sources in ``proto/``; ``tests/unit/test_proto_current.py`` fails when
this package is stale.

Modules:

- ``ttrpc_pb2``: ttrpc envelope (``Request``, ``Response``, ``KeyValue``,
  ``StringList``, ``Status`` with the google.rpc.Status layout).
- ``nri_pb2``: NRI plugin API, protobuf package ``nri.pkg.api.v1alpha1``.
- ``deviceplugin_pb2`` / ``deviceplugin_pb2_grpc``: kubelet device plugin
  API ``v1beta1``.
- ``podresources_pb2`` / ``podresources_pb2_grpc``: kubelet PodResources
  API ``v1``.
- ``dra_v1_pb2`` / ``dra_v1_pb2_grpc`` and ``dra_v1beta1_pb2`` /
  ``dra_v1beta1_pb2_grpc``: kubelet DRA plugin API
  ``k8s.io.kubelet.pkg.apis.dra.v1`` and ``.v1beta1``.
- ``pluginregistration_pb2`` / ``pluginregistration_pb2_grpc``: kubelet
  plugin registration (``pluginregistration.Registration``).
"""
