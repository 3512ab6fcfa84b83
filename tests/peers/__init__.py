"""Test peers that share no code with the product's transport and registration.

The component tests talk to the daemon's two doors through peers written for
the tests, from the protocol references, not from the product's code:

* ``ttrpc_wire``: the NRI multiplexer and ttrpc framing and the ttrpc
  ``Request``/``Response`` envelopes (a hand-written protobuf encoder),
  checked byte for byte against the Go transcripts in ``tests/fixtures/nri/``;
* ``nri_runtime``: ``FakeNriRuntime``, the runtime side of NRI (what
  containerd embeds) on ``ttrpc_wire``;
* ``kubelet``: ``FakeKubelet`` (Registration server, device plugin client,
  kubelet restarts) and ``FakePodResources`` on grpcio.

They may use the generated protobuf messages (``fracplugin._proto.nri_pb2``,
``deviceplugin_pb2``, ``podresources_pb2``): that is the schema, not the
transport. ``tests/unit/test_peers_independent.py`` checks that nothing here
imports ``fracplugin.nri.{mux,ttrpc,transport,stub,plugin}``,
``fracplugin.kubelet.*`` or ``fracplugin_demo``, so a framing or registration
bug in the product cannot hide on both sides of a test.
"""
