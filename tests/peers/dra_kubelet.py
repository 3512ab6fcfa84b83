"""kubelet's side of the DRA door for the tests: plugin registration and the
DRA service client, on grpcio with the generated schemas only (ADR 0012:
nothing from ``fracplugin.dra`` or ``fracplugin.kubelet``).

What it copies from kubelet (docs/reference/kubelet-dra.md §1, §2):

* the plugin watcher: a socket appears in the ``plugins_registry``
  directory; kubelet dials it, calls ``Registration.GetInfo``, checks the
  answer (type ``DRAPlugin``, a driver name, an absolute endpoint, a
  supported version it speaks: ``v1.DRAPlugin`` or ``v1beta1.DRAPlugin``),
  dials the endpoint and tells the plugin the verdict with
  ``NotifyRegistrationStatus`` (``plugin_registered`` false and an error when
  a check fails);
* the DRA client: ``NodePrepareResources`` / ``NodeUnprepareResources`` with
  claim references (namespace, UID, name) only, on the version negotiated
  (v1 preferred).

Concurrency: calls run on the caller's thread; one channel per socket.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from typing import Any

import grpc

from fracplugin._proto import dra_v1_pb2 as v1
from fracplugin._proto import dra_v1_pb2_grpc as v1_grpc
from fracplugin._proto import dra_v1beta1_pb2 as v1beta1
from fracplugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from fracplugin._proto import pluginregistration_pb2 as reg
from fracplugin._proto import pluginregistration_pb2_grpc as reg_grpc
from tests.helpers import scaled

__all__ = ["DraKubelet", "Registered"]

_OPTIONS = [("grpc.default_authority", "localhost"), ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Registered:
    """What the plugin said in GetInfo, and the version chosen."""

    type: str
    name: str
    endpoint: str
    versions: list[str]
    version: str


class DraKubelet:
    """The test kubelet (module docstring). ``registry_dir``: the
    ``plugins_registry`` directory it watches."""

    def __init__(self, registry_dir: str, *, timeout_s: float = 10.0) -> None:
        self.registry_dir = registry_dir
        self.timeout_s = timeout_s
        self.registered: Registered | None = None
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._pb: Any = None

    def _registration_socket(self, deadline: float) -> str:
        while True:
            found = [p for p in glob.glob(os.path.join(self.registry_dir, "*.sock"))
                     if not os.path.basename(p).startswith(".")]
            if found:
                return sorted(found)[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no registration socket appeared in {self.registry_dir}")
            time.sleep(0.05)

    def register(self, *, speak: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> Registered:
        """The watcher's handshake. Returns what was registered; raises
        AssertionError (after telling the plugin) when a check fails."""
        path = self._registration_socket(time.monotonic() + scaled(self.timeout_s))  # a test wait
        with grpc.insecure_channel("unix:" + path, options=_OPTIONS) as ch:
            stub = reg_grpc.RegistrationStub(ch)
            info = stub.GetInfo(reg.InfoRequest(), timeout=self.timeout_s)
            why = ""
            version = next((v for v in speak if v in info.supported_versions), "")
            if info.type != "DRAPlugin":
                why = f"plugin type {info.type!r} is not DRAPlugin"
            elif not info.name:
                why = "empty driver name"
            elif not os.path.isabs(info.endpoint) or not os.path.exists(info.endpoint):
                why = f"endpoint {info.endpoint!r} is not an existing absolute path"
            elif not version:
                why = f"none of the supported versions {list(info.supported_versions)} is one of {list(speak)}"
            stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=not why, error=why),
                                          timeout=self.timeout_s)
        assert not why, why
        self.registered = Registered(info.type, info.name, info.endpoint, list(info.supported_versions), version)
        self._channel = grpc.insecure_channel("unix:" + info.endpoint, options=_OPTIONS)
        if version == "v1.DRAPlugin":
            self._stub, self._pb = v1_grpc.DRAPluginStub(self._channel), v1
        else:
            self._stub, self._pb = v1beta1_grpc.DRAPluginStub(self._channel), v1beta1
        return self.registered

    def _claims(self, claims: list[tuple[str, str, str]]) -> list[Any]:
        return [self._pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]

    def prepare(self, *claims: tuple[str, str, str]) -> Any:
        """``NodePrepareResources`` for claims given as (namespace, uid, name)."""
        assert self._stub is not None, "register first"
        return self._stub.NodePrepareResources(
            self._pb.NodePrepareResourcesRequest(claims=self._claims(list(claims))), timeout=self.timeout_s)

    def unprepare(self, *claims: tuple[str, str, str]) -> Any:
        """``NodeUnprepareResources`` for claims given as (namespace, uid, name)."""
        assert self._stub is not None, "register first"
        return self._stub.NodeUnprepareResources(
            self._pb.NodeUnprepareResourcesRequest(claims=self._claims(list(claims))), timeout=self.timeout_s)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
