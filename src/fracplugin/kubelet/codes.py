"""gRPC status codes as the kubelet door answers them, without a gRPC library.

``StatusCode`` carries the canonical numeric codes of gRPC
(``doc/statuscodes.md`` in grpc/grpc; the same numbers grpc-go's
``codes.Code`` and grpclib's ``const.Status`` use). ``allocator.Refusal``
names one of these; the transport (``grpcwire``) turns it into the
``grpc-status`` trailer. A pure module: importing it loads no gRPC library,
so the allocator's decisions and their tests stay transport-free (ADR 0018).
"""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """Canonical gRPC status codes (value = the ``grpc-status`` trailer number)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16
