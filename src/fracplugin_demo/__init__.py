"""``fracplugin demo`` and the peers it plays: tools, not doors. NOT used by ``fracplugin run``.

A sibling of the product package ``fracplugin``, shipped in the same wheel:
``fracplugin.cli`` imports it only for the ``demo`` subcommand, and no module
of ``fracplugin`` imports it.

``fracplugin_demo.demo`` starts the real daemon (``fracplugin run`` on a
simulated node) and then plays the two peers it talks to on a real node:

* ``fracplugin_demo.nri_runtime``: the runtime side of NRI (what containerd
  embeds): listens on the NRI socket, answers RegisterPlugin, calls
  Configure / Synchronize / CreateContainer / ... on the daemon's plugin
  (``fracplugin_demo.nri_driver``). It reuses the product's mux/ttrpc layers
  (``fracplugin.nri.transport``), so it is a player for the demo and the
  benchmarks, not evidence of interop: the Go interop suite (``make
  interop``) drives the product with containerd/nri's own code, and the
  component tests use peers with their own wire code (``tests/peers/``).
* ``fracplugin_demo.kubelet``: the kubelet side of the device plugin API
  (Registration server + device plugin client over gRPC).

Also used by ``tests/bench/`` and ``tests/gpu/gpu_check.py``. The package
also holds two tools that are not the daemon either: ``admission`` (the
chart's ValidatingAdmissionPolicy generated from the annotation contract,
ADR 0026; ``scripts/render_admission_policy.py``) and ``subproc`` (children
that die with their parent, for the demo and the tests).
"""
