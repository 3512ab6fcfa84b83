"""The MPS role's API: a small, versioned JSON protocol on a root-only unix socket.

Two-role layout (ADR 0009, issue 12): ``fracplugin run --role mps`` owns the
MPS control daemons (``MpsSupervisor(detached=True)``) and serves this API;
``fracplugin run --role doors`` (NRI, device plugin, metrics, health) calls it
through ``RemoteMps``, which implements ``MpsApi``. Either side can restart
without the other losing anything: the MPS role adopts its daemons, the doors
role simply reconnects.

Wire format (API version ``API_VERSION`` = 1), one request per connection::

    request : {"v": 1, "op": "<op>", "args": {...}}\\n
    reply   : {"v": 1, "ok": true, "result": ...}\\n
            | {"v": 1, "ok": false, "error": {"kind": K, "message": "..."}}\\n

``kind`` is ``timeout`` (raise MpsTimeout; also a request not sent within
the whole-request deadline), ``mps`` (MpsError), ``value`` (ValueError: an
argument is wrong, the message names it), ``version`` (the other side speaks
another API version), ``denied`` (peer not root / not our uid),
``bad_request`` (not a request: not JSON, nested too deep, too large, an
unknown field), ``busy`` (MpsError: evicted at the connection limit, or too
many ops of this peer running; transient). Ops and their arguments:
``rpcwire.OPS`` (``hello``, ``status``, ``ensure_namespace``,
``release_namespace``, ``drain``, ``quit_daemons``); requests are checked by
``rpcwire.parse_request`` before anything runs.

Defences (issue 25 item 8, ADR 0022): ``MpsApiServer``.

Security: the socket is created mode 0600 (never mounted into a container:
containers get only their namespace leaf directories), and every
connection's peer is checked with ``SO_PEERCRED`` (uid 0 or the server's own
euid).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from ..logs import guarded
from ..model import ComputeMode
from .api import DrainResult, HealthCallback, MpsApi, MpsError, MpsTimeout
from .layout import namespace_name
from .rpcwire import API_VERSION, RequestError, parse_request

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
REQUEST_DEADLINE_S = 5.0
"""Whole-request deadline, seconds: a connection that has not sent its whole
request line this long after it was accepted is answered ``timeout`` and
closed, however it paces its bytes."""
REPLY_DEADLINE_S = 5.0
"""A reply the peer has not read this long after it was ready is dropped."""
MAX_CONNECTIONS = 64
"""Open connections at once. A connection beyond it evicts the oldest one that
is still sending its request (answered ``busy``); one whose op is running is
never evicted."""
MAX_RUNNING_PER_PEER = 16
"""Ops of one peer process (``SO_PEERCRED`` pid) running at once; more are answered ``busy``."""
POLL_INTERVAL_S = 0.5
"""Seconds between the doors role's ``status`` polls of the MPS role (``RemoteMps``)."""
INLINE_OPS = frozenset({"hello", "status"})
"""Ops answered on the serving thread itself (reads under the supervisor's
lock, microseconds): the doors' status poll never waits behind other ops."""


def _peer_cred(conn: socket.socket) -> tuple[int | None, int | None]:
    """``(pid, uid)`` of the peer (``SO_PEERCRED``); ``(None, None)`` when unknown."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return pid, uid
    except OSError:
        return None, None


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"v": API_VERSION, "ok": False, "error": {"kind": kind, "message": message}}


def _encode(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


@dataclass(eq=False)
class _Conn:
    """One accepted connection (touched only by the serving thread)."""

    sock: socket.socket
    pid: int | None
    uid: int | None
    accepted_at: float
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    state: str = "reading"  # reading -> running -> writing -> closed
    out: bytes = b""
    denied: str = ""  # set for a peer that may not use the API: its request is answered with this


class MpsApiServer:
    """Serves one ``MpsSupervisor`` (or any ``MpsApi``) on ``path``.

    Args:
        mps: the supervisor.
        path: socket path (default ``/run/fracplugin/mps/api.sock``); a missing
            directory is created 0700, the socket is created 0600 (umask 0177,
            then chmod); a stale socket is replaced.
        allowed_uids: peers allowed (default: root and our euid).

    Raises OSError from ``start()`` when the socket cannot be bound.

    Concurrency and defences (issue 25 item 8, ADR 0022): one serving thread
    accepts, reads and writes every connection without blocking (a selector),
    so an idle or slow client holds a file descriptor, never a thread.
    Requests are parsed and checked by ``rpcwire.parse_request`` on that
    thread (a malformed one is answered with an error naming the field);
    ``hello`` and ``status`` are answered there too; the ops that change
    something run on one short-lived thread each (at most
    ``MAX_RUNNING_PER_PEER`` per peer process), bounded by the ``timeout_s``
    they carry. Each request has a whole-request deadline
    (``REQUEST_DEADLINE_S``); at ``MAX_CONNECTIONS`` the oldest connection
    still sending its request is evicted, so idle connections can never keep
    the doors' calls out.
    """

    def __init__(self, mps: MpsApi, path: str, allowed_uids: tuple[int, ...] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mps = mps
        self.path = path
        self.allowed_uids = allowed_uids if allowed_uids is not None else tuple({0, os.geteuid()})
        self._clock = clock
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._sel: selectors.BaseSelector | None = None
        self._wake_r, self._wake_w = -1, -1
        self._conns: dict[int, _Conn] = {}  # fd -> connection
        self._running: dict[int | None, int] = {}  # peer pid -> ops running
        self._done: list[tuple[_Conn, bytes]] = []  # replies of finished ops (guarded by _done_lock)
        self._done_lock = threading.Lock()
        self.evicted = 0
        """Connections evicted so far (a count for tests and logs)."""

    def start(self) -> None:
        """Bind the socket and start the serving thread. Raises OSError."""
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)  # mode: only where it creates
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(128)
        s.setblocking(False)
        self._sock = s
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(s, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve_loop, name="fracplugin-mps-api", daemon=True)
        self._thread.start()
        log.info("MPS API serving", extra={"socket": self.path, "api_version": API_VERSION})

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop serving: close every connection and the socket (ops still
        running finish on their threads; their replies are dropped)."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        s, self._sock = self._sock, None
        if s is not None:
            s.close()
        fds = (self._wake_w, self._wake_r)
        self._wake_r = self._wake_w = -1  # before closing: an op finishing now must not write to a reused fd
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def connections(self) -> dict[str, int]:
        """Open connections by state (``reading``, ``running``, ``writing``): a
        snapshot for tests and ``status``; read without a lock (a dict copy)."""
        out = {"reading": 0, "running": 0, "writing": 0}
        for c in list(self._conns.values()):
            out[c.state] = out.get(c.state, 0) + 1
        return out

    # -- serving thread ---------------------------------------------------------
    def _wake(self) -> None:
        fd = self._wake_w
        if fd >= 0:
            with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
                os.write(fd, b"x")

    def _serve_loop(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while not self._stopping.is_set():
                for key, events in sel.select(self._next_timeout()):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                    else:
                        self._event(key.data, events)
                self._collect_done()
                self._expire()
        except Exception:  # keep the node's MPS role alive; the socket is gone, the doors see it
            log.exception("MPS API serving thread failed")
        finally:
            for c in list(self._conns.values()):
                self._close(c)
            sel.close()

    def _event(self, c: _Conn, events: int) -> None:
        """Read or write ``c``; a fault of ours there costs that connection
        only (logged with its traceback), never the serving thread."""
        try:
            if events & selectors.EVENT_READ:
                self._read(c)
            elif events & selectors.EVENT_WRITE:
                self._write(c)
        except Exception:
            log.exception("MPS API connection of peer pid %s failed", c.pid)
            self._close(c, _error("mps", "internal error of the MPS API (logged by the MPS role)"))

    def _next_timeout(self) -> float:
        now = self._clock()
        nxt = min((c.deadline for c in self._conns.values() if c.state != "running"), default=now + 1.0)
        return max(0.0, min(1.0, nxt - now))

    def _accept(self) -> None:
        s = self._sock
        while s is not None:
            try:
                sock, _ = s.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE & co: leave it in the backlog, try again on the next turn
                log.warning("MPS API accept failed: %s", e)
                return
            sock.setblocking(False)
            pid, uid = _peer_cred(sock)
            now = self._clock()
            c = _Conn(sock, pid, uid, now, now + REQUEST_DEADLINE_S)
            if len(self._conns) >= MAX_CONNECTIONS and not self._evict_one():
                self._drop(c, _error("busy", f"the MPS API has {MAX_CONNECTIONS} connections with ops running; "
                                             "try again"))
                continue
            self._conns[sock.fileno()] = c
            assert self._sel is not None
            self._sel.register(sock, selectors.EVENT_READ, c)
            if uid is None or uid not in self.allowed_uids:
                c.denied = f"peer uid {uid} may not use the MPS API (root only)"

    def _evict_one(self) -> bool:
        """Evict the oldest connection still sending its request (or, failing
        that, the oldest one whose reply is unread). False when every
        connection has an op running."""
        for state in ("reading", "writing"):
            cands = [c for c in self._conns.values() if c.state == state]
            if cands:
                victim = min(cands, key=lambda c: c.accepted_at)
                self.evicted += 1
                log.warning("MPS API at %d connections: evicting the oldest %s one (peer pid %s)",
                            MAX_CONNECTIONS, state, victim.pid)
                self._close(victim, _error("busy", f"evicted: the MPS API is at its limit of {MAX_CONNECTIONS} "
                                                   f"connections and this one had not sent its request"))
                return True
        return False

    def _read(self, c: _Conn) -> None:
        if c.state != "reading":
            return
        try:
            chunk = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(c)
            return
        c.buf += chunk
        nl = c.buf.find(b"\n")
        if nl < 0 and len(c.buf) <= MAX_REQUEST_BYTES:
            return
        if nl < 0 or nl > MAX_REQUEST_BYTES:
            self._reply(c, _error("bad_request", f"request larger than {MAX_REQUEST_BYTES} bytes"))
            return
        if c.denied:
            self._reply(c, _error("denied", c.denied))
            return
        self._start(c, bytes(c.buf[:nl]))

    def _start(self, c: _Conn, raw: bytes) -> None:
        """Parse, check and run (inline or on a thread) one request."""
        try:
            op, args = parse_request(raw)
        except RequestError as e:
            log.warning("MPS API request refused", extra={"peer_pid": c.pid, "peer_uid": c.uid, "reason": str(e)})
            self._reply(c, _error(e.kind, str(e)))
            return
        # every op leaves a line naming its peer (issue 34 item 6: quit_daemons, which stops every
        # tenant's server, left none); the doors' status polls at debug
        log.log(logging.DEBUG if op in INLINE_OPS else logging.INFO, "MPS API op %s", op,
                extra={"op": op, "peer_pid": c.pid, "peer_uid": c.uid, "op_args": args})
        if op in INLINE_OPS:
            self._reply(c, self._run_op(op, args))
            return
        if self._running.get(c.pid, 0) >= MAX_RUNNING_PER_PEER:
            self._reply(c, _error("busy", f"{op}: this peer (pid {c.pid}) already has {MAX_RUNNING_PER_PEER} "
                                          "MPS API ops running; try again"))
            return
        self._running[c.pid] = self._running.get(c.pid, 0) + 1
        c.state = "running"
        assert self._sel is not None
        self._sel.unregister(c.sock)  # not watched while it runs (a closed peer would read as ready forever)
        threading.Thread(target=self._op_thread, args=(c, op, args), name=f"mps-api-{op}", daemon=True).start()

    def _op_thread(self, c: _Conn, op: str, args: dict[str, Any]) -> None:
        out = _encode(self._run_op(op, args))
        with self._done_lock:
            self._done.append((c, out))
        self._wake()

    def _collect_done(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
        for c, out in done:
            n = self._running.get(c.pid, 1) - 1
            if n > 0:
                self._running[c.pid] = n
            else:
                self._running.pop(c.pid, None)
            if c.state == "running":
                self._send(c, out)

    def _reply(self, c: _Conn, doc: Mapping[str, Any]) -> None:
        self._send(c, _encode(doc))

    def _send(self, c: _Conn, out: bytes) -> None:
        c.state, c.out = "writing", out
        c.deadline = self._clock() + REPLY_DEADLINE_S
        self._write(c)
        if c.state == "writing":
            assert self._sel is not None
            try:
                self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
            except KeyError:  # unregistered while its op ran
                self._sel.register(c.sock, selectors.EVENT_WRITE, c)

    def _write(self, c: _Conn) -> None:
        if c.state != "writing":
            return
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        c.out = c.out[n:]
        if not c.out:
            self._close(c)

    def _expire(self) -> None:
        now = self._clock()
        for c in [c for c in self._conns.values() if c.state != "running" and now >= c.deadline]:
            if c.state == "reading":
                self._close(c, _error("timeout", f"request not complete within {REQUEST_DEADLINE_S:g}s of "
                                                 "connecting (whole-request deadline)"))
            else:
                self._close(c)

    def _drop(self, c: _Conn, doc: Mapping[str, Any]) -> None:
        """Answer (best effort, never blocking) and close a connection not registered."""
        with contextlib.suppress(OSError):
            c.sock.send(_encode(doc))
        c.sock.close()

    def _close(self, c: _Conn, doc: Mapping[str, Any] | None = None) -> None:
        """Unregister and close ``c``, after a best-effort, non-blocking ``doc``."""
        if c.state == "closed":
            return
        self._conns.pop(c.sock.fileno(), None)
        if self._sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(c.sock)
        c.state = "closed"
        if doc is not None:
            self._drop(c, doc)
        else:
            c.sock.close()

    # -- ops --------------------------------------------------------------------
    def _run_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        try:
            result = self._dispatch(op, args)
        except MpsTimeout as e:
            return _error("timeout", str(e))
        except MpsError as e:
            return _error("mps", str(e))
        except (ValueError, TypeError, KeyError) as e:
            return _error("value", f"{op}: {e}")
        except Exception as e:  # a fault of ours: keep serving, log it once with its traceback
            log.exception("MPS API op %s failed", op)
            return _error("mps", f"{op}: internal error: {e}")
        return {"v": API_VERSION, "ok": True, "result": result}

    def _dispatch(self, op: str, a: dict[str, Any]) -> Any:
        """Run a checked request (``rpcwire.parse_request``'s ``args``)."""
        m = self.mps
        if op == "hello":
            return {"api": API_VERSION, "protocol": m.protocol, "pid": os.getpid()}
        if op == "status":
            return m.status()
        if op == "ensure_namespace":
            return m.ensure_namespace(a["pod_uid"], a["container"], a["active_thread_percentage"], a["timeout_s"],
                                      mode=a["mode"], pinned_limit_mib=a["pinned_limit_mib"])
        if op == "release_namespace":
            return m.release_namespace(a["pod_uid"], a["container"], timeout_s=a["timeout_s"])
        if op == "drain":
            # its fields as JSON (tuples as lists, modes as their values): what RemoteMps.drain reads
            return asdict(m.drain(a["container_id"], a["timeout_s"], modes=a["modes"]))
        if op == "quit_daemons":
            m.quit_daemons(a["timeout_s"])
            return True
        raise ValueError(f"unknown op {op!r}")


class RemoteMps:
    """``MpsApi`` of the doors role: every call goes to the MPS role's socket.

    ``healthy``/``ready``/``status``/``unhealthy_reason`` answer from a cache
    refreshed every ``POLL_INTERVAL_S`` by a background thread (the runtime's
    hot path never waits on the socket for them); while the MPS role is
    unreachable or speaks another API version every mode is unhealthy, with
    the reason. Health-change callbacks (``subscribe``) run on that thread.

    Calls that change something (``ensure_namespace``, ``release_namespace``,
    ``drain``) are bounded by their ``timeout_s`` (connect + answer) and raise
    MpsTimeout / MpsError / ValueError like the supervisor does; an
    unreachable MPS role is an MpsError naming the socket.
    """

    def __init__(self, path: str, modes: tuple[ComputeMode, ...] = tuple(ComputeMode)) -> None:
        self.path = path
        self.modes = modes
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {"enabled": True, "remote": path, "reachable": False, "ready": False,
                                        "error": "not contacted yet", "daemons": []}
        self._health: dict[ComputeMode, bool] = {m: False for m in modes}
        self._subs: list[HealthCallback] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.protocol: int | None = None

    # -- transport --------------------------------------------------------------
    def call(self, op: str, args: Mapping[str, Any] | None, timeout_s: float) -> Any:
        """One request; returns ``result``. Raises MpsTimeout, MpsError, ValueError."""
        if timeout_s <= 0:
            raise MpsTimeout(f"no time left for MPS API {op}")
        deadline = time.monotonic() + timeout_s
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout_s)
            while True:
                try:
                    s.connect(self.path)
                    break
                except (FileNotFoundError, ConnectionRefusedError) as e:
                    raise MpsError(f"the MPS role is not reachable at {self.path}: {e.strerror or e}") from None
                except BlockingIOError:
                    # The listen backlog is full for now (a burst of other clients being
                    # accepted): retry within our deadline instead of failing the call.
                    if time.monotonic() >= deadline:
                        raise socket.timeout() from None
                    time.sleep(0.005)
            s.sendall(json.dumps({"v": API_VERSION, "op": op, "args": dict(args or {})}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout()
                s.settimeout(left)
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise MpsError(f"the MPS role at {self.path} closed the connection during {op}")
                buf += chunk
        except socket.timeout:
            raise MpsTimeout(f"MPS API {op} did not answer within {timeout_s:.3g}s") from None
        except OSError as e:
            raise MpsError(f"MPS API {op} at {self.path}: {e.strerror or e}") from None
        finally:
            s.close()
        try:
            doc = json.loads(buf)
        except ValueError:
            raise MpsError(f"MPS API {op}: reply is not JSON") from None
        if doc.get("ok"):
            return doc.get("result")
        err = doc.get("error") or {}
        kind, msg = err.get("kind"), str(err.get("message", "unknown error"))
        if kind == "timeout":
            raise MpsTimeout(msg)
        if kind == "value":
            raise ValueError(msg)
        raise MpsError(msg)

    # -- MpsApi ---------------------------------------------------------------
    def ensure_namespace(self, pod_uid: str, container: str, active_thread_percentage: int | None, timeout_s: float,
                         mode: ComputeMode = ComputeMode.SM_SHARING, pinned_limit_mib: int | None = None) -> str:
        """``MpsApi.ensure_namespace`` through the MPS role (its ``timeout_s`` less 50 ms for the reply)."""
        return str(self.call("ensure_namespace", {
            "pod_uid": pod_uid, "container": container, "active_thread_percentage": active_thread_percentage,
            "timeout_s": max(0.0, timeout_s - 0.05), "mode": ComputeMode(mode).value,
            "pinned_limit_mib": pinned_limit_mib}, timeout_s))

    def release_namespace(self, pod_uid: str, container: str, timeout_s: float | None = None) -> bool:
        """``MpsApi.release_namespace`` through the MPS role; False (logged) when it cannot answer."""
        t = 2.0 if timeout_s is None else float(timeout_s)
        try:
            return bool(self.call("release_namespace", {"pod_uid": pod_uid, "container": container,
                                                        "timeout_s": max(0.0, t - 0.05)}, t))
        except (MpsError, ValueError) as e:
            log.warning("MPS namespace %s not released: %s", namespace_name(pod_uid, container), e)
            return False

    def drain(self, container_id: str, timeout_s: float, modes: Any = None) -> DrainResult:
        """``MpsApi.drain`` through the MPS role; an unreachable role is a result with ``errors``."""
        t0 = time.monotonic()
        try:
            d = self.call("drain", {"container_id": container_id, "timeout_s": max(0.0, timeout_s - 0.05),
                                    "modes": None if modes is None else [ComputeMode(m).value for m in modes]},
                          timeout_s)
        except (MpsError, ValueError) as e:
            return DrainResult(container_id, wedged=isinstance(e, MpsTimeout), errors=(str(e),),
                               elapsed_s=time.monotonic() - t0)
        return DrainResult(container_id=d["container_id"], clients=tuple(d["clients"]),
                           terminated=tuple(d["terminated"]), wedged=bool(d["wedged"]),
                           restarted=tuple(ComputeMode(m) for m in d["restarted"]), skipped=bool(d["skipped"]),
                           errors=tuple(d["errors"]), elapsed_s=float(d["elapsed_s"]))

    def quit_daemons(self, timeout_s: float = 10.0) -> None:
        """Ask the MPS role to stop MPS on purpose (uninstall)."""
        self.call("quit_daemons", {"timeout_s": timeout_s}, timeout_s + 5.0)

    def healthy(self, mode: ComputeMode) -> bool:
        """From the polled status: the MPS role is reachable and the daemon of ``mode`` healthy."""
        with self._lock:
            return self._health.get(ComputeMode(mode), False)

    def ready(self) -> bool:
        """From the polled status: every mode healthy."""
        with self._lock:
            return bool(self._status.get("ready")) and all(self._health.values())

    def status(self) -> dict[str, Any]:
        """The last polled status (``reachable``, ``error`` added)."""
        with self._lock:
            return dict(self._status)

    def unhealthy_reason(self, mode: ComputeMode) -> str:
        """Why ``mode`` is down, from the polled status ("" when healthy)."""
        mode = ComputeMode(mode)
        with self._lock:
            if not self._status.get("reachable"):
                return f"MPS role unreachable: {self._status.get('error')}"
            for d in self._status.get("daemons") or []:
                if d.get("mode") == mode.value:
                    return "" if d.get("healthy") else str(d.get("reason") or d.get("state") or "unhealthy")
        return f"no {mode.value} MPS daemon in the MPS role"

    def subscribe(self, callback: HealthCallback) -> None:
        """``callback(mode, healthy)`` on health changes seen by the poller."""
        with self._lock:
            self._subs.append(callback)

    # -- poller -----------------------------------------------------------------
    def start(self) -> None:
        """Start the status poller (one refresh happens before this returns)."""
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="fracplugin-mps-remote", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop polling. Never stops MPS (that is ``quit_daemons``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            self.refresh()

    def refresh(self) -> None:
        """Fetch ``status`` once and fire callbacks for every health change."""
        try:
            if self.protocol is None:
                hello = self.call("hello", None, 2.0)
                if int(hello.get("api", -1)) != API_VERSION:
                    raise MpsError(f"the MPS role speaks API v{hello.get('api')}, this doors role v{API_VERSION}")
                self.protocol = hello.get("protocol")
            st = dict(self.call("status", None, 2.0))
            st["reachable"], st["remote"] = True, self.path
            health = {m: False for m in self.modes}
            for d in st.get("daemons") or []:
                try:
                    health[ComputeMode(d["mode"])] = bool(d.get("healthy"))
                except (KeyError, ValueError):
                    continue
        except (MpsError, ValueError, TypeError, AttributeError) as e:
            self.protocol = None
            with self._lock:
                prev = self._status
            st = {"enabled": True, "remote": self.path, "reachable": False, "ready": False, "error": str(e),
                  "protocol": prev.get("protocol"),
                  "daemons": [{**d, "healthy": False, "reason": f"MPS role unreachable: {e}"}
                              for d in prev.get("daemons") or []]}
            health = {m: False for m in self.modes}
        with self._lock:
            changed = [m for m in health if self._health.get(m) != health[m]]
            subs = list(self._subs)
        # callbacks before the new health is published: the NRI door queues its re-ensures of a mode
        # that came back before anyone can read the mode healthy (ADR 0034)
        for m in changed:
            for cb in subs:
                guarded(log, "MPS health callback", cb, m, health[m])
        with self._lock:
            self._status = st
            self._health = health
