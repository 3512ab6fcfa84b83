"""NRI door: ttrpc over NRI's multiplexed socket, written in Python: ``mux``
and ``ttrpc`` (sans-I/O framing and calls), ``transport`` (a socket and its
reader thread), ``stub`` (the generic plugin runtime, knows nothing about
GPUs) and ``plugin`` (fracplugin's handlers; docs/architecture.md section 1).
Importing this package has no side effects.
"""
