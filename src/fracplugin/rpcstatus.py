"""The status codes both doors answer with, without an RPC library.

``StatusCode`` carries the canonical numeric codes of gRPC
(``doc/statuscodes.md`` in grpc/grpc, ``google.rpc.Code``; the same numbers
grpc-go's ``codes.Code``, grpcio's ``StatusCode`` and ttrpc's status use).
The kubelet door's ``allocator.Refusal`` names one and the door answers it as
grpcio's code of the same name (``kubelet.grpcopts.grpc_code``); the NRI door's ttrpc layer
(``nri.ttrpc.Code`` is this class) puts it in the response's ``status``. A
pure module: importing it loads no RPC library, so the decisions and their
tests stay transport-free (ADR 0018).
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
