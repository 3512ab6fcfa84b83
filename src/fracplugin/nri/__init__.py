"""NRI door: ttrpc over NRI's multiplexed socket, written in Python.

- ``mux``: sans-I/O NRI multiplexer framing.
- ``ttrpc``: sans-I/O ttrpc (unary) connection state machine.
- ``transport``: a socket driven by a reader thread, for either side.
- ``stub``: generic NRI plugin runtime (register, configure, synchronize,
  events, reconnect); knows nothing about GPUs.
- ``plugin``: fracplugin's handlers (planner + ledger + MPS).

Submodules are imported lazily by their users; importing this package has no
side effects.
"""
