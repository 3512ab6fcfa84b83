"""Registering the device plugin with kubelet, and staying registered.

Rules (docs/reference/kubelet-device-plugin.md A.5, A.8, D.7-D.9):

* serve first, check our own socket answers (``GetDevicePluginOptions`` on it),
  then call ``Registration.Register`` on ``kubelet.sock``: kubelet dials back
  and calls GetDevicePluginOptions + ListAndWatch before Register returns, so
  Register fails when we are not serving;
* dial kubelet.sock with ``grpcopts.client_options`` (ADR 0021);
* retry with exponential backoff (tenacity; 50 ms doubling to 1 s) for as long
  as the plugin runs;
* re-register without restarting the process when kubelet restarts. Triggers,
  checked on every inotify event in kubelet's directory (``DirWatch``; a
  restart is seen at once) and at least every ``POLL_S`` (0.1 s, the
  fallback where inotify is unavailable):
  ``kubelet.sock`` re-created (its (inode, ctime) changed), our own socket
  deleted (kubelet wipes every socket of the directory on start: we serve on a
  new socket first), or no ListAndWatch stream open for ``stream_grace_s``
  after one ended (``register_grace_s`` after a Register).

Rules learnt from a real kubelet (kubelet 1.37's "device plugin already
connected"): ADR 0011 decisions 1-5 (no Register while our ListAndWatch is
open, a new socket name ``fracplugin-<n>.sock`` for the same kubelet, at most
``READY_TIMEOUT_S`` waiting for ``ready()`` before the first Register, how
``last_registration_ms`` counts, one WARNING per ``warn_every_s`` while kubelet is down).

Concurrency model: one daemon thread (``Registrar``) owns the whole cycle; the
device plugin server is driven through the narrow ``RegistrationTarget``
callbacks, which must be thread-safe. The gRPC calls (probe, Register) run on
the registrar thread, each on a channel of its own with a deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import grpc
import tenacity

from .._proto import deviceplugin_pb2 as pb
from .._proto import deviceplugin_pb2_grpc as pb_grpc
from . import grpcopts
from ..logs import guarded

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET_NAME = "kubelet.sock"
_ABORT_POLL_S = 0.05  # how often a Register in flight checks ``abort_if``
POLL_S = 0.1  # the registrar's watch period, seconds (the fallback where inotify is unavailable)
READY_TIMEOUT_S = 30.0  # longest wait for ``target.ready()`` before the first Register; then it registers anyway


class RegistrationError(RuntimeError):
    """Register could not complete (kubelet absent, refused, or our socket silent)."""


def socket_identity(path: str) -> tuple[int, int] | None:
    """(inode, ctime ns) of a path, or None when it does not exist. A re-created
    file changes at least the ctime even when the inode number is reused."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns)


def probe(socket_path: str, timeout_s: float = 1.0) -> pb.DevicePluginOptions:
    """Call GetDevicePluginOptions on a device plugin socket, the way kubelet
    does (``wait_for_ready``: a connection that cannot be made yet is retried
    until ``timeout_s`` seconds). Raises RegistrationError."""
    with grpcopts.unix_channel(socket_path) as ch:
        try:
            options: pb.DevicePluginOptions = pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(
                pb.Empty(), timeout=timeout_s, wait_for_ready=True)
            return options
        except grpc.RpcError as e:
            raise RegistrationError(f"own socket {socket_path} does not answer: {_why(e)}") from None


def _why(e: grpc.RpcError) -> str:
    """``CODE: details`` of a failed grpcio call."""
    code, details = grpcopts.failure(e)
    return f"{code.name}: {details}"


def register(
    kubelet_socket: str,
    endpoint: str,
    resource_name: str,
    options: pb.DevicePluginOptions,
    timeout_s: float = 10.0,
    abort_if: Callable[[], str | bool | None] | None = None,
) -> None:
    """One ``Registration.Register`` call. ``endpoint`` is our socket's *file
    name* (kubelet joins it with its plugin dir, reference A.3). ``abort_if``
    is checked every 50 ms while kubelet works on the call: when it turns true
    (our socket was deleted meanwhile: kubelet would dial the missing file
    until its own 10 s timeout; the plugin stops) the call is cancelled; a
    string it returns is the reason in the error. Raises RegistrationError
    (kubelet.sock missing, kubelet refused, timeout, aborted)."""
    if not os.path.exists(kubelet_socket):
        raise RegistrationError(f"{kubelet_socket} does not exist (kubelet not running yet?)")
    req = pb.RegisterRequest(version=API_VERSION, endpoint=endpoint, resource_name=resource_name, options=options)
    with grpcopts.unix_channel(kubelet_socket) as ch:
        call = pb_grpc.RegistrationStub(ch).Register.future(req, timeout=timeout_s)
        try:
            while abort_if is not None and not call.done():
                try:
                    call.result(timeout=_ABORT_POLL_S)
                except grpc.FutureTimeoutError:
                    why = abort_if()
                    if why:
                        if not isinstance(why, str):
                            why = f"our socket {endpoint} was deleted while kubelet was dialing it"
                        raise RegistrationError(f"Register {resource_name} at {kubelet_socket} abandoned: {why}")
            call.result()
        except grpc.RpcError as e:
            raise RegistrationError(f"Register {resource_name} at {kubelet_socket} failed: {_why(e)}") from None
        finally:
            if not call.done():
                call.cancel()


class DirWatch:
    """Wake-ups for changes in one directory: Linux inotify through ctypes
    (``IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM | IN_ATTRIB``), so a
    re-created kubelet.sock is noticed at once; falls back to plain sleeping
    (the caller still polls) where inotify is unavailable. ``kick()`` wakes a
    waiter from another thread (a self-pipe). Events only wake: the caller
    re-checks what it cares about with ``stat``.
    """

    _MASK = 0x100 | 0x200 | 0x80 | 0x40 | 0x4  # CREATE, DELETE, MOVED_TO, MOVED_FROM, ATTRIB

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fd = -1
        self._wd = -1
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        try:
            import ctypes

            self._libc = ctypes.CDLL(None, use_errno=True)
            fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            self._fd = fd if fd >= 0 else -1
        except (OSError, AttributeError):
            self._fd = -1
        self._add()

    @property
    def active(self) -> bool:
        """True when inotify watches the directory."""
        return self._fd >= 0 and self._wd >= 0

    def _add(self) -> None:
        if self._fd < 0:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(self.directory), self._MASK)
        self._wd = wd if wd >= 0 else -1

    def wait(self, timeout_s: float) -> None:
        """Return after a change in the directory, a kick, or ``timeout_s``."""
        import select

        if self._fd >= 0 and self._wd < 0:
            self._add()  # the directory may exist now
        fds = [self._r] + ([self._fd] if self.active else [])
        try:
            ready, _, _ = select.select(fds, [], [], max(timeout_s, 0.0))
        except (OSError, ValueError):
            return
        for fd in ready:
            try:
                while os.read(fd, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def kick(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"k")

    def close(self) -> None:
        for fd in (self._fd, self._r, self._w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._r = self._w = -1


class RegistrationTarget(Protocol):
    """What the registrar needs from the device plugin server."""

    socket_path: str

    def socket_identity(self) -> tuple[int, int] | None:
        """(inode, ctime) of the socket we listen on, as of when we bound it."""
        ...

    def rebind(self, new_name: bool) -> None:
        """Serve again on a fresh socket: under a new file name when
        ``new_name``, else under the configured one."""
        ...

    def active_streams(self) -> int:
        """Open ListAndWatch streams of the current server."""
        ...

    def last_stream_end(self) -> float:
        """time.monotonic() when the last ListAndWatch stream ended (0.0 never)."""
        ...

    def options(self) -> pb.DevicePluginOptions:
        ...

    def ready(self) -> bool:
        """Devices can be served Healthy now."""
        ...


@dataclass
class RegistrationStats:
    """Counters for status/metrics: registrations done, last duration (s),
    last trigger, last error."""

    count: int = 0
    last_s: float = 0.0
    last_trigger: str = ""
    last_error: str = ""
    registered_at: float = 0.0
    failures: int = 0
    """Failed attempts since the last successful registration."""


class Registrar:
    """The registration thread.

    Args:
        target: the device plugin server.
        kubelet_socket: path of kubelet.sock.
        resource_name: the extended resource.
        on_registered: called with the seconds from trigger to completed
            registration (bench/metrics).
    """

    def __init__(
        self,
        target: RegistrationTarget,
        kubelet_socket: str,
        resource_name: str,
        on_registered: Callable[[float], None],
    ) -> None:
        self.target = target
        self.kubelet_socket = kubelet_socket
        self.resource_name = resource_name
        self.register_timeout_s = 10.0  # deadline of one Register call, seconds
        self.stream_grace_s = 0.5  # seconds with no open ListAndWatch (after one ended) before re-registering
        self.register_grace_s = 5.0  # seconds after a Register for kubelet to open ListAndWatch
        self.warn_every_s = 60.0  # at most one WARNING per this many seconds while registration keeps failing
        self.on_registered = on_registered
        self.stats = RegistrationStats()
        self._ever_registered = False
        self._rotate_next = False
        self._registered_with: tuple[int, int] | None = None  # kubelet.sock identity of our last Register
        self._seen_ks: tuple[int, int] | None = None
        self._seen_at = 0.0
        self._last_warn = 0.0
        self._registered = False
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._watch: DirWatch | None = None
        self._thread: threading.Thread | None = None

    def registered(self) -> bool:
        """True after a successful Register until a trigger says kubelet lost us."""
        return self._registered

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._watch = DirWatch(os.path.dirname(self.kubelet_socket) or ".")
        self._thread = threading.Thread(target=self._run, name="fracplugin-registrar", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        """Ask the thread to stop (no wait): no new registration starts."""
        self._stop.set()
        self.kick()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and wait up to ``timeout_s`` (a Register call in
        flight ends at its own deadline; the thread is a daemon)."""
        self.signal_stop()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout_s)
        if self._watch is not None and (t is None or not t.is_alive()):
            self._watch.close()
            self._watch = None
        self._registered = False

    def kick(self) -> None:
        """Ask for a re-registration now (e.g. from a health change or tests)."""
        self._kick.set()
        if self._watch is not None:
            self._watch.kick()

    # -- the loop ------------------------------------------------------------
    def _wait(self, seconds: float) -> None:
        """Sleep: wakes early on stop, kick, or a change in kubelet's directory."""
        if self._stop.is_set():
            return
        if self._watch is not None:
            self._watch.wait(seconds)
        else:
            self._kick.wait(seconds)

    def _note_kubelet(self) -> tuple[int, int] | None:
        """kubelet.sock's identity now; remembers when a new one appeared."""
        ks = socket_identity(self.kubelet_socket)
        if ks != self._seen_ks:
            self._seen_ks = ks
            self._seen_at = time.monotonic()
        return ks

    def _rebind(self, why: str) -> None:
        """Serve again. A new file name when the kubelet we registered with is
        still the one running (it may hold, or be stuck on, the old path: 1.37)
        or after an "already connected" refusal; the configured name otherwise."""
        same_kubelet = self._registered_with is not None and self._registered_with == self._seen_ks
        self.target.rebind(self._rotate_next or same_kubelet)
        self._rotate_next = False
        log.info("%s; serving on %s", why, self.target.socket_path)

    def _register_once(self) -> None:
        self._note_kubelet()
        if self._rotate_next:
            self._rebind("kubelet refused our socket path as already connected")
        elif self._own_gone():
            self._rebind(f"own socket {self.target.socket_path} is gone")
        probe(self.target.socket_path, timeout_s=1.0)
        before = time.monotonic()
        ks = self._note_kubelet()
        try:
            register(
                self.kubelet_socket,
                os.path.basename(self.target.socket_path),
                self.resource_name,
                self.target.options(),
                timeout_s=self.register_timeout_s,
                abort_if=self._abort_register,
            )
        except RegistrationError as e:
            if "already connected" in str(e):
                self._rotate_next = True
            raise
        after = socket_identity(self.kubelet_socket)
        if after != ks:  # kubelet.sock was re-created during the call: it appeared after ``before``
            self._seen_ks, self._seen_at = after, before
        self._registered_with = after

    def _own_gone(self) -> bool:
        """True when our socket file is missing or is not the one we bound (a
        missing file counts even when we never captured an identity)."""
        current = socket_identity(self.target.socket_path)
        return current is None or current != self.target.socket_identity()

    def _abort_register(self) -> str | bool:
        """Why a Register in flight is abandoned now, or False: the plugin
        stops (a kubelet that accepts and never answers would otherwise hold
        the shutdown for the call's whole deadline), or our socket was deleted."""
        if self._stop.is_set():
            return "the device plugin is stopping"
        return self._own_gone()

    def _register_until_done(self, trigger: str, t0: float) -> bool:
        """Register with backoff until it works, the stop flag is set, or the
        kubelet socket changes (then the caller starts over without delay).
        A ListAndWatch stream opened on our current socket while retrying
        (a Register that timed out on our side but went through on kubelet's)
        counts as registered: registering again would hit a live connection."""
        ks0 = socket_identity(self.kubelet_socket)
        streams0 = self.target.active_streams()

        def give_up(_state: tenacity.RetryCallState) -> bool:
            return self._stop.is_set() or socket_identity(self.kubelet_socket) != ks0

        def before_sleep(state: tenacity.RetryCallState) -> None:
            err = state.outcome.exception() if state.outcome else None
            self.stats.last_error = str(err)
            self.stats.failures += 1
            now = time.monotonic()
            if self.stats.failures == 1 or now - self._last_warn >= self.warn_every_s:
                self._last_warn = now
                log.warning("registration attempt %d failed (%d failures so far; next WARNING in %.0f s at the "
                            "earliest): %s", state.attempt_number, self.stats.failures, self.warn_every_s, err)
            else:
                log.debug("registration attempt %d failed: %s", state.attempt_number, err)

        def attempt() -> None:
            if streams0 == 0 and self.target.active_streams() > 0 and not self._own_gone():
                self._registered_with = socket_identity(self.kubelet_socket)
                return
            self._register_once()

        retry = tenacity.Retrying(
            wait=tenacity.wait_exponential(multiplier=0.05, min=0.05, max=1.0),
            stop=give_up,
            retry=tenacity.retry_if_exception_type(Exception),
            sleep=self._wait,
            before_sleep=before_sleep,
            reraise=False,
        )
        try:
            retry(attempt)
        except tenacity.RetryError:
            return False
        done = time.monotonic()
        # Not the time kubelet was down: from the trigger or from when the
        # kubelet.sock we registered on appeared, whichever is later.
        took = done - max(t0, self._seen_at if self._seen_ks is not None else t0)
        self._registered = True
        self._ever_registered = True
        # a new record: no error, no failures since this registration
        self.stats = RegistrationStats(self.stats.count + 1, took, trigger, registered_at=done)
        log.info("registered %s with kubelet (%s) in %.0f ms on %s", self.resource_name, trigger, took * 1000,
                 os.path.basename(self.target.socket_path))
        guarded(log, "on_registered callback", self.on_registered, took)
        return True

    def _wait_ready(self) -> None:
        """Before the first Register: wait (at most ``READY_TIMEOUT_S``) until
        the target says its devices can be served Healthy."""
        if self._ever_registered:
            return
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._stop.is_set() and not self.target.ready():
            if time.monotonic() >= deadline:
                log.warning("devices not all Healthy after %.0f s; registering anyway (kubelet sees them as they are)",
                            READY_TIMEOUT_S)
                return
            self._stop.wait(POLL_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._loop()
            except Exception:  # never let the registrar die: log, pause, go on
                log.exception("registrar loop failed; restarting it")
                self._stop.wait(1.0)

    def _loop(self) -> None:
        need: str | None = "start"
        t0 = time.monotonic()
        kubelet_id = self._note_kubelet()
        while not self._stop.is_set():
            now = time.monotonic()
            ks = self._note_kubelet()
            if ks != kubelet_id:
                kubelet_id = ks
                if ks is None:
                    if self._registered:
                        log.warning("%s disappeared: kubelet stopped", self.kubelet_socket)
                    self._registered = False
                need, t0 = "kubelet.sock re-created", now
            elif self._own_gone():
                self._registered = False
                need, t0 = need or "own socket deleted", now if need is None else t0
            elif self._registered and self.target.active_streams() == 0:
                since = now - max(self.target.last_stream_end(), self.stats.registered_at)
                grace = (
                    self.register_grace_s
                    if self.target.last_stream_end() < self.stats.registered_at
                    else self.stream_grace_s
                )
                if since >= grace:
                    log.warning("no ListAndWatch stream open for %.1f s; re-registering", since)
                    self._registered = False
                    need, t0 = "ListAndWatch closed", now
            if self._kick.is_set():
                self._kick.clear()
                if not self._stop.is_set() and need is None:
                    if self._registered and self.target.active_streams() > 0:
                        # kubelet holds a live connection: a second Register
                        # would be refused by 1.37 (and poison the path).
                        log.info("re-registration asked for, but kubelet holds a live ListAndWatch; not registering")
                    else:
                        need, t0 = "kick", now
            if need is not None and ks is None:
                self.stats.last_error = f"{self.kubelet_socket} does not exist (kubelet not running yet?)"
            if need is not None and ks is not None:
                self._wait_ready()
                if self._stop.is_set():
                    return
                if self._register_until_done(need, t0):
                    need = None
                kubelet_id = socket_identity(self.kubelet_socket) if need is None else kubelet_id
                continue
            self._wait(POLL_S)
