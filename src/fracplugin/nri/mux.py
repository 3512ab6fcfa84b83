"""Sans-I/O NRI multiplexer framing (containerd/nri ``pkg/net/multiplex``).

Concurrency model: none (h11/h2 style). ``MuxDecoder`` holds the read-side
buffer of one socket and must be fed by one thread at a time;
``encode_frames`` is a pure function.

Wire format (docs/reference/nri-protocol.md section 1.2): an 8-byte header,
conn id and payload length (``uint32`` big-endian each), then the payload.
Conn id 0 is reserved, 1 the Plugin service, 2 the Runtime service; frames
of unknown conn ids are dropped silently, as the Go mux does. A payload over
10 + 4 MiB (the Go mux's limit) is a protocol error (the stream cannot be
trusted). Writes are chunked into frames of at most ``MAX_WRITE_FRAME`` (4096)
bytes *including* the header: a Go peer reads one frame per ``Read`` into a
4096-byte buffer and drops a plugin that sends bigger ones (section 1.2,
"Critical interop rule"). One ttrpc message may span many frames: each conn
is a byte stream.
"""

from __future__ import annotations

import struct
from typing import Iterable

HEADER_SIZE = 8
"""Bytes in a mux frame header (conn id u32 BE + length u32 BE)."""

MAX_PAYLOAD = 10 + (4 << 20)
"""Largest payload of one mux frame accepted by the Go mux since NRI v0.8.0
(ttrpc header + ttrpc max message), in bytes."""

MAX_WRITE_FRAME = 4096
"""Largest mux frame (header included) we ever write, in bytes."""

PLUGIN_SERVICE_CONN = 1
"""Conn id of the Plugin service: the runtime is the ttrpc client, we serve."""

RUNTIME_SERVICE_CONN = 2
"""Conn id of the Runtime service: we are the ttrpc client, the runtime serves."""

_HEADER = struct.Struct(">II")


class MuxError(Exception):
    """The byte stream is not a valid mux stream (oversized frame length,
    truncated frame at EOF). The connection must be dropped."""


def encode_frames(conn_id: int, data: bytes) -> bytes:
    """Wrap ``data`` for ``conn_id`` into mux frames of at most
    ``MAX_WRITE_FRAME`` bytes each (header included) and return them
    concatenated. Empty ``data`` yields no frames (b""): the mux has no
    zero-length messages worth sending. Raises ValueError for a conn id
    outside 1..2**32-1.
    """
    if not 0 < conn_id < 2**32:
        raise ValueError(f"mux conn id {conn_id} out of range 1..2**32-1")
    chunk = MAX_WRITE_FRAME - HEADER_SIZE
    if len(data) <= chunk:  # one frame (every answer fracplugin gives but a large Synchronize's)
        return _HEADER.pack(conn_id, len(data)) + data if data else b""
    view = memoryview(data)
    out = bytearray()
    for start in range(0, len(view), chunk):
        part = view[start : start + chunk]
        out += _HEADER.pack(conn_id, len(part))
        out += part
    return bytes(out)


class MuxDecoder:
    """Incremental decoder of the read side of one mux socket: feed any
    split of the byte stream to ``receive_data``, which returns the complete
    frames of the known ``conn_ids`` in stream order (others are dropped), and
    call ``receive_eof`` at EOF. Buffers at most one frame (<= ``MAX_PAYLOAD``
    + 8 bytes) plus the unconsumed tail of the last ``receive_data``.
    """

    def __init__(self, conn_ids: Iterable[int] = (PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN)) -> None:
        self._conn_ids = frozenset(conn_ids)
        self._buf = bytearray()
        self._closed = False

    def receive_data(self, data: bytes) -> list[tuple[int, bytes]]:
        """Consume ``data`` and return every frame it completes, as
        ``(conn id, payload)``.

        Raises ``MuxError`` when a header announces a payload above
        ``MAX_PAYLOAD``; after that, or after ``receive_eof``, the decoder is
        closed and any further call raises ``MuxError`` too.
        """
        if self._closed:
            raise MuxError("mux decoder is closed")
        self._buf += data
        frames: list[tuple[int, bytes]] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        while n - pos >= HEADER_SIZE:
            conn_id, length = _HEADER.unpack_from(buf, pos)
            if length > MAX_PAYLOAD:
                self._closed = True
                self._buf = bytearray()
                raise MuxError(
                    f"mux frame for conn {conn_id} announces {length} bytes, above the limit {MAX_PAYLOAD}"
                )
            end = pos + HEADER_SIZE + length
            if end > n:
                break
            if conn_id in self._conn_ids:
                frames.append((conn_id, bytes(buf[pos + HEADER_SIZE : end])))
            pos = end
        if pos:
            del buf[:pos]
        return frames

    def receive_eof(self) -> None:
        """Mark the end of the stream. Raises ``MuxError`` if a partial frame
        is pending (bytes that never became a frame)."""
        self._closed = True
        if self._buf:
            pending = len(self._buf)
            self._buf = bytearray()
            raise MuxError(f"connection closed inside a mux frame ({pending} bytes pending)")
