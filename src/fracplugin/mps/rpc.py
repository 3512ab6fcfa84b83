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

``kind`` is ``timeout`` (raise MpsTimeout), ``mps`` (MpsError), ``value``
(ValueError), ``version`` (the other side speaks another API version),
``denied`` (peer not root / not our uid), ``bad_request``. Ops: ``hello``,
``status``, ``ensure_namespace``, ``release_namespace``, ``drain``,
``quit_daemons``.

Security: the socket is created mode 0600 (never mounted into a container:
containers get only their namespace leaf directories), and every
connection's peer is checked with ``SO_PEERCRED`` (uid 0 or the server's own
euid); the path is never mounted into a container.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Mapping

from ..model import ComputeMode
from .api import DrainResult, HealthCallback, MpsApi, MpsError, MpsTimeout
from .layout import MpsLayout, namespace_name

__all__ = ["API_VERSION", "MpsApiServer", "RemoteMps", "MAX_REQUEST_BYTES"]

log = logging.getLogger(__name__)

API_VERSION = 1
MAX_REQUEST_BYTES = 64 * 1024
_READ_TIMEOUT_S = 5.0
_MAX_CONNECTIONS = 32


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid
    except OSError:
        return None


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"v": API_VERSION, "ok": False, "error": {"kind": kind, "message": message}}


class MpsApiServer:
    """Serves one ``MpsSupervisor`` (or any ``MpsApi`` with ``quit_daemons``) on ``path``.

    Args:
        mps: the supervisor.
        path: socket path (default ``/run/fracplugin/mps/api.sock``); a missing
            directory is created 0700, the socket is created 0600 (umask 0177,
            then chmod); a stale socket is replaced.
        allowed_uids: peers allowed (default: root and our euid).

    Raises OSError from ``start()`` when the socket cannot be bound.
    Concurrency: one accept thread; one short-lived thread per connection (at
    most 32 at once, further connections wait in the backlog); each request
    is bounded by the ``timeout_s`` it carries.
    """

    def __init__(self, mps: MpsApi, path: str, allowed_uids: tuple[int, ...] | None = None) -> None:
        self.mps = mps
        self.path = path
        self.allowed_uids = allowed_uids if allowed_uids is not None else tuple({0, os.geteuid()})
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)

    def start(self) -> None:
        d = os.path.dirname(self.path)
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o700, exist_ok=True)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(64)
        self._sock = s
        self._thread = threading.Thread(target=self._accept_loop, name="fracplugin-mps-api", daemon=True)
        self._thread.start()
        log.info("MPS API serving", extra={"socket": self.path, "api_version": API_VERSION})

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopping.set()
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            s = self._sock
            if s is None:
                return
            try:
                conn, _ = s.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.05)
                continue
            self._slots.acquire()
            threading.Thread(target=self._serve, args=(conn,), name="mps-api-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            uid = _peer_uid(conn)
            if uid is None or uid not in self.allowed_uids:
                self._send(conn, _error("denied", f"peer uid {uid} may not use the MPS API (root only)"))
                return
            conn.settimeout(_READ_TIMEOUT_S)
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
                if len(buf) > MAX_REQUEST_BYTES:
                    self._send(conn, _error("bad_request", f"request larger than {MAX_REQUEST_BYTES} bytes"))
                    return
            conn.settimeout(None)
            self._send(conn, self.handle(buf))
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass
            self._slots.release()

    @staticmethod
    def _send(conn: socket.socket, doc: Mapping[str, Any]) -> None:
        conn.sendall(json.dumps(doc, separators=(",", ":")).encode() + b"\n")

    def handle(self, raw: bytes) -> dict[str, Any]:
        """One request (bytes of a JSON object) -> the reply document. Never raises."""
        try:
            req = json.loads(raw)
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            return _error("bad_request", f"request is not JSON: {e}")
        if req.get("v") != API_VERSION:
            return _error("version", f"request speaks MPS API v{req.get('v')!r}; this MPS role speaks v{API_VERSION}")
        op = req.get("op")
        args = req.get("args") or {}
        if not isinstance(args, dict):
            return _error("bad_request", "args must be an object")
        try:
            result = self._dispatch(str(op), args)
        except MpsTimeout as e:
            return _error("timeout", str(e))
        except MpsError as e:
            return _error("mps", str(e))
        except (ValueError, TypeError, KeyError) as e:
            return _error("value", f"{op}: {e}")
        except Exception as e:  # keep serving whatever happens
            log.exception("MPS API op %s failed", op)
            return _error("mps", f"{op}: internal error: {e}")
        return {"v": API_VERSION, "ok": True, "result": result}

    def _dispatch(self, op: str, a: dict[str, Any]) -> Any:
        m = self.mps
        if op == "hello":
            return {"api": API_VERSION, "protocol": m.protocol, "pid": os.getpid()}
        if op == "status":
            return m.status()
        if op == "ensure_namespace":
            atp = a.get("active_thread_percentage")
            pinned = a.get("pinned_limit_mib")
            return m.ensure_namespace(str(a["pod_uid"]), str(a["container"]), None if atp is None else int(atp),
                                      float(a["timeout_s"]), mode=ComputeMode(a.get("mode", "sm-sharing")),
                                      pinned_limit_mib=None if pinned is None else int(pinned))
        if op == "release_namespace":
            t = a.get("timeout_s")
            return m.release_namespace(str(a["pod_uid"]), str(a["container"]),
                                       timeout_s=None if t is None else float(t))
        if op == "drain":
            modes = a.get("modes")
            res = m.drain(str(a["container_id"]), float(a["timeout_s"]),
                          modes=None if modes is None else [ComputeMode(x) for x in modes])
            return res.to_dict()
        if op == "quit_daemons":
            m.quit_daemons(float(a.get("timeout_s", 10.0)))
            return True
        raise ValueError(f"unknown op {op!r}")


class RemoteMps:
    """``MpsApi`` of the doors role: every call goes to the MPS role's socket.

    ``healthy``/``ready``/``status``/``unhealthy_reason`` answer from a cache
    refreshed every ``poll_interval_s`` by a background thread (the runtime's
    hot path never waits on the socket for them); while the MPS role is
    unreachable or speaks another API version every mode is unhealthy, with
    the reason. Health-change callbacks (``subscribe``) run on that thread.

    Calls that change something (``ensure_namespace``, ``release_namespace``,
    ``drain``) are bounded by their ``timeout_s`` (connect + answer) and raise
    MpsTimeout / MpsError / ValueError like the supervisor does; an
    unreachable MPS role is an MpsError naming the socket.
    """

    def __init__(self, path: str, layout: MpsLayout | None = None, poll_interval_s: float = 0.5,
                 modes: tuple[ComputeMode, ...] = tuple(ComputeMode)) -> None:
        self.path = path
        self.layout = layout or MpsLayout()
        self.poll_interval_s = float(poll_interval_s)
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
            try:
                s.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise MpsError(f"the MPS role is not reachable at {self.path}: {e.strerror or e}") from None
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
        return str(self.call("ensure_namespace", {
            "pod_uid": pod_uid, "container": container, "active_thread_percentage": active_thread_percentage,
            "timeout_s": max(0.0, timeout_s - 0.05), "mode": ComputeMode(mode).value,
            "pinned_limit_mib": pinned_limit_mib}, timeout_s))

    def release_namespace(self, pod_uid: str, container: str, timeout_s: float | None = None) -> bool:
        t = 2.0 if timeout_s is None else float(timeout_s)
        try:
            return bool(self.call("release_namespace", {"pod_uid": pod_uid, "container": container,
                                                        "timeout_s": max(0.0, t - 0.05)}, t))
        except (MpsError, ValueError) as e:
            log.warning("MPS namespace %s not released: %s", namespace_name(pod_uid, container), e)
            return False

    def drain(self, container_id: str, timeout_s: float, modes: Any = None) -> DrainResult:
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
        with self._lock:
            return self._health.get(ComputeMode(mode), False)

    def ready(self) -> bool:
        with self._lock:
            return bool(self._status.get("ready")) and all(self._health.values())

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)

    def unhealthy_reason(self, mode: ComputeMode) -> str:
        mode = ComputeMode(mode)
        with self._lock:
            if not self._status.get("reachable"):
                return f"MPS role unreachable: {self._status.get('error')}"
            for d in self._status.get("daemons") or []:
                if d.get("mode") == mode.value:
                    return "" if d.get("healthy") else str(d.get("reason") or d.get("state") or "unhealthy")
        return f"no {mode.value} MPS daemon in the MPS role"

    def subscribe(self, callback: HealthCallback) -> None:
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
        while not self._stop.wait(self.poll_interval_s):
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
            self._status = st
            self._health = health
            subs = list(self._subs)
        for m in changed:
            for cb in subs:
                try:
                    cb(m, health[m])
                except Exception:
                    log.exception("MPS health callback failed")


Callback = Callable[[ComputeMode, bool], None]
