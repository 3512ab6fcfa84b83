"""What the kubelet device plugin door's parts share: the state
``DevicePluginServer`` sets up (``_DoorState``: attribute types for its
mixins) and ``_Served`` (one running grpcio server and its worker pool).

Split out of ``kubelet/deviceplugin.py`` (issue 26, ADR 0023), moved as it
was: the module docstring of ``kubelet/deviceplugin.py`` describes the door
and its concurrency model; ``DevicePluginServer`` is the one class to use.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from .. import planner as planner_mod
from .._proto import deviceplugin_pb2 as pb
from ..cdi import CdiRegistry
from ..gpu.health import HealthMonitor
from ..ledger import Ledger
from ..model import NodeInfo
from ..ports import HookMetrics
from . import podlookup
from .allocator import Allocator
from .allocbase import Counters
from .devices import DeviceTable
from .registration import Registrar


class _DoorState:
    """The attributes ``DevicePluginServer.__init__`` sets (see its
    docstring), declared once for the mixins that implement its parts."""

    node: NodeInfo
    ledger: Ledger
    planner_config: planner_mod.PlannerConfig
    pod_source: podlookup.PodSource | None
    resource_name: str
    unit_mib: int
    table: DeviceTable
    plugin_dir: str
    socket_name: str
    socket_path: str
    _name_gen: int
    _bound_path: str
    kubelet_socket: str
    allocate_deadline_s: float
    metrics: HookMetrics | None
    policy: str
    device_specs: bool
    cdi_kind: str | None
    cdi: CdiRegistry | None
    max_workers: int
    fail_open: bool
    health: HealthMonitor
    registrar: Registrar
    allocator: Allocator
    counters: Counters
    reregister_ms: list[float]
    startup_warnings: list[str]
    # ListAndWatch and the gRPC server (``_init_serving``)
    _cond: threading.Condition
    _version: int
    _response: pb.ListAndWatchResponse
    _stopping: bool
    _gen: int
    _streams: int
    _last_stream_end: float
    _server: _Served | None
    _socket_id: tuple[int, int] | None
    _server_lock: threading.Lock


class _Served:
    """One running grpcio server of the door and the worker pool it owns."""

    __slots__ = ("server", "pool")

    def __init__(self, server: grpc.Server, pool: futures.ThreadPoolExecutor) -> None:
        self.server = server
        self.pool = pool
