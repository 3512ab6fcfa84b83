"""The demo's simulated container runtime and kubelet: NOT used by ``fracplugin run``.

``fracplugin demo`` (``fracplugin.demo``) starts the real daemon and then plays
the two peers it talks to on a real node:

* ``fracplugin.sim.nri_runtime``: the runtime side of NRI (what containerd
  embeds): listens on the NRI socket, answers RegisterPlugin, calls
  Configure / Synchronize / CreateContainer / ... on the daemon's plugin.
  It reuses the product's mux/ttrpc layers (``fracplugin.nri.transport``),
  so it is a player for the demo and the benchmarks, not evidence of
  interop: the Go interop suite (``make interop``) drives the product with
  containerd/nri's own code, and the component tests use peers with their
  own wire code (``tests/peers/``).
* ``fracplugin.sim.kubelet``: the kubelet side of the device plugin API
  (Registration server + device plugin client over gRPC).

Also used by ``tests/bench/bench_daemon.py`` and ``tests/gpu/gpu_check.py``.
Nothing under ``fracplugin`` outside ``fracplugin.demo`` imports this
package.
"""
