"""Small helpers shared by the test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import inspect
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Union

#: What a wait is for: a phrase, or a function that says it at timeout time
#: (e.g. one that reads the daemon's log then).
What = Union[str, Callable[[], str], None]


def _describe(pred: Callable[[], Any]) -> str:
    try:
        text = " ".join(inspect.getsource(pred).split())
    except (OSError, TypeError):
        text = repr(pred)
    return text if len(text) <= 200 else text[:200] + "..."


#: Every wait's bound is ``timeout_s * WAIT_SCALE``. A bound only ends a test
#: that would otherwise hang (a wait ends the moment its condition holds), so
#: it is sized for the slowest machine the suite must pass on: a 2-core one
#: with load 20 (other builds, ``yes > /dev/null`` hogs), where one Python
#: interpreter start (``python3 -c pass``, some 20 ms idle) was measured at
#: 1.7-2.2 s wall at load 13-20 (2026-12-02, 2 cores), about 100x. Set
#: ``FRACPLUGIN_TEST_WAIT_SCALE`` (a positive number) to change it.
WAIT_SCALE = float(os.environ.get("FRACPLUGIN_TEST_WAIT_SCALE") or 6.0)
if not WAIT_SCALE > 0:
    raise ValueError(f"FRACPLUGIN_TEST_WAIT_SCALE={WAIT_SCALE!r}: must be a positive number")

#: ``wait_until``'s bound when none is given: 15 s on an idle machine (90 s by default).
DEFAULT_WAIT_S = 15.0


def scaled(timeout_s: float) -> float:
    """``timeout_s`` (seconds, as on an idle machine) times ``WAIT_SCALE``: the bound a
    test gives anything it waits on (a peer, a subprocess, a socket read)."""
    return timeout_s * WAIT_SCALE


def wait_until(pred: Callable[[], Any], timeout_s: float = DEFAULT_WAIT_S, what: What = None,
               step_s: float = 0.01) -> Any:
    """Poll ``pred()`` every ``step_s`` seconds until it returns a truthy value,
    and return that value.

    Polls the real condition, never a fixed delay: the wait ends as soon as
    ``pred`` holds, and ``timeout_s`` (seconds, as on an idle machine; the
    bound is ``scaled(timeout_s)``, see ``WAIT_SCALE``) only bounds a test
    that would otherwise hang.

    Raises:
        AssertionError: ``pred`` still falsy after ``timeout_s`` seconds; the
            message names ``what`` (``pred``'s source when not given; a
            callable is called at that moment) and the last value ``pred``
            returned.
    """
    bound = scaled(timeout_s)
    deadline = time.monotonic() + bound
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {bound:g} s waiting for {said or _describe(pred)}; "
                                 f"last value: {value!r}")
        time.sleep(step_s)


wait_for = wait_until
"""The same helper under the name older tests import."""


def unix_socket_listening(path: str | os.PathLike[str]) -> bool:
    """True when a stream connect to the unix socket ``path`` succeeds now.

    A daemon's socket file exists from its ``bind()``, but a connect is
    refused until its ``listen()``: a test that waits for the file alone can
    talk to it in between (seen under CPU load with the fake MPS daemon)."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def kill_leftovers(work: Path) -> None:
    """SIGKILL every process whose command line names ``work`` (the fake MPS
    control daemons started under it outlive the MPS role by design, ADR 0009)."""
    needle = str(work).encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if needle in (p / "cmdline").read_bytes():
                os.kill(int(p.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def node_rules(node: Any, ledger: Any = None, config: Any = None, inventory: Any = None, *,
               mps_health: Any = None, limits: Any = None) -> Any:
    """The node's rules a door under test admits through (``noderules.NodeRules``):
    ``ledger`` (default a new in-memory one), ``config`` (default ``PlannerConfig()``),
    the node's health monitor over ``inventory`` (XIDs) and ``mps_health``,
    started (polling every 0.05 s) when either is given, as the daemon
    starts it; its owner stops it (``rules.health.stop()``)."""
    from fracplugin.gpu.health import HealthMonitor
    from fracplugin.ledger import Ledger
    from fracplugin.noderules import NodeRules
    from fracplugin.planner import PlannerConfig

    ledger = ledger if ledger is not None else Ledger(node)
    health = HealthMonitor(inventory, [g.uuid for g in node.gpus], mps_health=mps_health, mode_of=ledger.mode,
                           poll_s=0.05)
    if inventory is not None or mps_health is not None:
        health.start()
    return NodeRules(node, ledger, config if config is not None else PlannerConfig(), health=health, limits=limits)



def plan_container(annotations: Any, container: str, pod: Any, node: Any, ledger: Any, config: Any = None,
                   containers: Any = None) -> Any:
    """``annotations.parse`` then ``planner.plan``, as the doors run them: None
    when the container is not fractional. Raises FractionError like both."""
    from fracplugin.annotations import parse
    from fracplugin.planner import PlannerConfig, plan

    config = config if config is not None else PlannerConfig()
    request = parse(annotations, container, prefix=config.annotation_prefix, containers=containers)
    return None if request is None else plan(request, pod, node, ledger, config)

_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = __import__("threading").Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that this process has
    never handed out before (issue 34 input 10: binding port 0 and closing
    can give the same port twice in a row, and etcd's peer and metrics URLs
    once got the same one). The one way every harness picks a port."""
    import socket

    with _PORTS_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port
