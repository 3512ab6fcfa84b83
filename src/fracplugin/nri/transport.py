"""One NRI mux socket driven by a reader thread, usable from either side.

Concurrency model: threads. Each ``NriTransport`` owns one reader thread that
feeds the sans-I/O ``MuxDecoder`` and the two ``TtrpcConnection`` objects,
resolves client futures and hands incoming requests to ``on_request`` (called
*in the reader thread*: it must only enqueue work, never block). Any thread
may ``call``/``call_async`` and ``respond``; the reader thread answers with
``answer_nowait``, which never blocks. Two locks, always taken write -> state:
``_write_lock`` serialises socket writes (a ttrpc message split into several
mux frames is never interleaved with another, and client stream ids reach the
peer in increasing order); ``_state_lock`` guards the ttrpc state machines,
never held while writing, so the reader keeps reading while a writer blocks.
The plugin serves conn 1 and calls on conn 2; a runtime-side peer does the
opposite (docs/reference/nri-protocol.md section 1.1).

Failures (protocol errors, truncated streams, EOF, socket errors) close the
transport: pending calls fail with ``ConnectionClosed``, the socket is shut
down, ``on_closed(reason)`` runs once and ``closed`` is set. Nothing is
raised out of the reader thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
from concurrent.futures import Future
from typing import Callable

from .mux import MuxDecoder, MuxError, encode_frames
from .ttrpc import (
    Code,
    MessageIgnored,
    RequestReceived,
    RequestRejected,
    ResponseReceived,
    Role,
    TtrpcConnection,
    TtrpcError,
)
from ..logs import guarded

log = logging.getLogger(__name__)

_READ_SIZE = 65536

SENT = "sent"
"""``answer_nowait``: the whole answer is on the socket."""
SPILLED = "spilled"
"""``answer_nowait``: part of it is; ``finish`` writes the rest."""
BUSY = "busy"
"""``answer_nowait``: another thread is writing; nothing was done."""


class ConnectionClosed(ConnectionError):
    """The transport is closed (EOF, protocol error, socket error or close())."""


class NriTransport:
    """A mux socket with a ttrpc server on ``serve_conn`` and a ttrpc client on
    ``call_conn``.

    Args:
        sock: a connected stream socket (unix socket or fd 3 socketpair end);
            the transport owns it from now on and closes it.
        serve_conn: mux conn id we serve (plugin: 1, runtime: 2).
        call_conn: mux conn id we call on (plugin: 2, runtime: 1).
        on_request: ``f(RequestReceived)`` run in the reader thread for each
            valid request; must answer later with ``respond``.
        on_closed: ``f(reason: str)`` run once when the transport closes.
        label: free text for log lines.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        serve_conn: int,
        call_conn: int,
        on_request: Callable[[RequestReceived], None],
        on_closed: Callable[[str], None] | None = None,
        label: str = "nri",
    ) -> None:
        self._sock = sock
        self._sock.settimeout(None)
        self.serve_conn = serve_conn
        self.call_conn = call_conn
        self._on_request = on_request
        self._on_closed = on_closed
        self.label = label
        self._mux = MuxDecoder((serve_conn, call_conn))
        self._server = TtrpcConnection(Role.SERVER)
        self._client = TtrpcConnection(Role.CLIENT)
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pending: dict[int, Future[ResponseReceived]] = {}
        self.closed = threading.Event()
        """Set once the transport is closed."""
        self._close_lock = threading.Lock()
        self.close_reason: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name=f"{label}-reader", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "NriTransport":
        """Start the reader thread; returns self."""
        self._reader.start()
        return self

    def close(self, reason: str = "closed locally") -> None:
        """Close the transport (idempotent): fail pending calls, shut the
        socket down (which also unblocks a writer stuck in ``sendall``) and
        run ``on_closed``. Does not wait for the reader thread; see ``join``."""
        with self._close_lock:
            if self.closed.is_set():
                return
            self.close_reason = reason
            self.closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._state_lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionClosed(reason))
        if not self._reader.is_alive() or threading.current_thread() is self._reader:
            self._release_socket()
        if self._on_closed is not None:
            guarded(log, "on_closed callback", self._on_closed, reason, extra={"transport": self.label})

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the reader thread to end (after ``close`` or EOF)."""
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout_s)

    def _release_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    # -------------------------------------------------------------- writing

    def _write(self, frames: bytes) -> None:
        """Write ``frames`` (caller holds ``_write_lock``); a failed write
        closes the transport and raises ``ConnectionClosed``."""
        try:
            self._sock.sendall(frames)
        except OSError as exc:
            self.close(f"write failed: {exc}")
            raise ConnectionClosed(f"write failed: {exc}") from exc

    def call_async(self, service: str, method: str, payload: bytes, *,
                   timeout_nano: int = 0) -> "Future[ResponseReceived]":
        """Send a request on ``call_conn``; the future resolves with the
        ``ResponseReceived`` (any status) or fails with ``ConnectionClosed``."""
        fut: Future[ResponseReceived] = Future()
        with self._write_lock:
            if self.closed.is_set():
                raise ConnectionClosed(self.close_reason or "closed")
            with self._state_lock:
                self._pending[self._client.send_request(service, method, payload, timeout_nano=timeout_nano)] = fut
                data = self._client.data_to_send()
            self._write(encode_frames(self.call_conn, data))
        return fut

    def call(self, service: str, method: str, payload: bytes, timeout_s: float) -> bytes:
        """Blocking unary call: returns the response payload. Raises
        ``RpcError`` for an error status, ``TimeoutError`` after ``timeout_s``
        seconds, ``ConnectionClosed`` when the transport closes."""
        fut = self.call_async(service, method, payload, timeout_nano=int(timeout_s * 1e9))
        try:
            resp = fut.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{method}: no answer within {timeout_s} s") from None
        return resp.raise_for_status()

    def respond(self, stream_id: int, payload: bytes = b"", code: int | None = None, message: str = "") -> None:
        """Answer request ``stream_id``: OK with ``payload`` when ``code`` is
        None (a response over 4 MiB becomes RESOURCE_EXHAUSTED), else the
        error status ``code``/``message``. Raises ``ConnectionClosed``, and
        ValueError for a stream not awaiting an answer."""
        with self._write_lock:
            self._write(self._answer_frames(stream_id, payload, code, message))

    def _answer_frames(self, stream_id: int, payload: bytes, code: int | None, message: str) -> bytes:
        """Queue the answer (``respond``'s arguments) and return its mux
        frames; caller holds ``_write_lock``. Raises ``ConnectionClosed`` when
        the transport is closed, ValueError for a stream not awaiting one."""
        if self.closed.is_set():
            raise ConnectionClosed(self.close_reason or "closed")
        with self._state_lock:
            if code is None:
                self._server.send_response(stream_id, payload)
            else:
                self._server.send_error(stream_id, code, message)
            return encode_frames(self.serve_conn, self._server.data_to_send())

    def answer_nowait(self, stream_id: int, payload: bytes, code: int | None, message: str,
                      finish: Callable[[Callable[[], None]], None]) -> str:
        """Answer request ``stream_id`` without ever blocking (for the reader
        thread, which must keep reading): OK with ``payload`` when ``code`` is
        None, else the error status ``code``/``message``.

        Returns ``BUSY`` when another thread holds the write lock (nothing
        done: answer with ``respond`` from a thread that may block); ``SENT``
        when the socket took the whole answer; ``SPILLED``
        when it took only part (a peer that does not read fast enough): the
        write lock stays held and ``finish(write_rest)`` must run
        ``write_rest()`` on a thread that may block, which writes the rest and
        releases the lock. Raises ``ConnectionClosed`` (the transport is or
        gets closed; also when ``finish`` raises) and ValueError for a stream
        not awaiting an answer."""
        if not self._write_lock.acquire(blocking=False):
            return BUSY
        try:
            data = self._answer_frames(stream_id, payload, code, message)
            sent = self._send_nowait(data)
        except BaseException as exc:
            self._write_lock.release()
            if isinstance(exc, ConnectionClosed):
                self.close(str(exc))
            raise
        if sent == len(data):
            self._write_lock.release()
            return SENT
        try:
            finish(functools.partial(self._write_rest, memoryview(data)[sent:]))
        except Exception as exc:
            self._write_lock.release()
            self.close(f"answer left half written: {exc}")
            raise ConnectionClosed(self.close_reason or "closed") from exc
        return SPILLED

    def _send_nowait(self, data: bytes) -> int:
        """Write what the socket takes at once; returns the bytes written.
        Caller holds ``_write_lock``. Raises ConnectionClosed."""
        view = memoryview(data)
        sent = 0
        while sent < len(view):
            try:
                sent += self._sock.send(view[sent:], socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as exc:
                raise ConnectionClosed(f"write failed: {exc}") from exc
        return sent

    def _write_rest(self, rest: memoryview) -> None:
        """The end of an ``answer_nowait`` write, on a thread that may block;
        releases the write lock it inherited."""
        try:
            self._sock.sendall(rest)
        except OSError as exc:
            self.close(f"write failed: {exc}")
        finally:
            self._write_lock.release()

    # -------------------------------------------------------------- reading

    def _read_loop(self) -> None:
        reason = "EOF"
        try:
            while not self.closed.is_set():
                try:
                    data = self._sock.recv(_READ_SIZE)
                except OSError as exc:
                    reason = f"read failed: {exc}"
                    break
                if not data:
                    reason = "EOF from peer"
                    self._check_eof()
                    break
                self._feed(data)
        except (MuxError, TtrpcError) as exc:
            reason = f"protocol error: {exc}"
            log.warning(
                "nri transport protocol error, dropping the connection",
                extra={"transport": self.label, "reason": str(exc)},
            )
        except ConnectionClosed as exc:
            reason = str(exc)
        except Exception as exc:  # a bug: never let the reader die silently
            reason = f"internal error: {exc!r}"
            log.exception("nri transport reader failed", extra={"transport": self.label})
        finally:
            self.close(reason)
            self._release_socket()

    def _check_eof(self) -> None:
        problems = []
        for part in (self._mux, self._server, self._client):
            try:
                part.receive_eof()
            except (MuxError, TtrpcError) as exc:
                problems.append(str(exc))
        if problems:
            log.warning(
                "nri connection closed mid-message",
                extra={"transport": self.label, "reason": "; ".join(problems)},
            )

    def _feed(self, data: bytes) -> None:
        for conn_id, payload in self._mux.receive_data(data):
            if conn_id == self.serve_conn:
                with self._state_lock:
                    events = self._server.receive_data(payload)
                    auto = RequestRejected in map(type, events)
                if auto:
                    with self._write_lock:
                        with self._state_lock:
                            out = self._server.data_to_send()
                        self._write(encode_frames(self.serve_conn, out))
            else:
                with self._state_lock:
                    events = self._client.receive_data(payload)
            for ev in events:
                self._event(ev)

    def _event(self, ev: object) -> None:
        if isinstance(ev, RequestReceived):
            try:
                self._on_request(ev)
            except Exception as exc:
                log.exception(
                    "nri request dispatch failed",
                    extra={"transport": self.label, "method": ev.method, "stream_id": ev.stream_id},
                )
                with contextlib.suppress(ConnectionClosed, ValueError):
                    self.respond(ev.stream_id, code=Code.INTERNAL, message=f"dispatch failed: {exc!r}")
        elif isinstance(ev, ResponseReceived):
            with self._state_lock:
                fut = self._pending.pop(ev.stream_id, None)
            if fut is not None and not fut.done():
                fut.set_result(ev)
        elif isinstance(ev, RequestRejected):
            log.warning(
                "nri request rejected by the ttrpc layer",
                extra={"transport": self.label, "stream_id": ev.stream_id, "code": ev.code, "reason": ev.message},
            )
        elif isinstance(ev, MessageIgnored):
            log.info(
                "nri frame ignored",
                extra={"transport": self.label, "stream_id": ev.stream_id, "reason": ev.reason},
            )


