"""Structured logging for the daemon: one JSON object per line, or plain text.

``setup(format, level)`` configures the root logger once (idempotent: calling
it again replaces our handler, which is how SIGHUP changes the format/level).
Fields passed with ``extra={...}`` appear as top-level keys in JSON and as
``key=value`` pairs in text.

JSON line shape: ``{"ts": "2026-01-01T00:00:00.123Z", "level": "info",
"logger": "fracplugin.daemon", "msg": "...", <extra keys>..., "exc": "..."}``.

Concurrency: ``logging`` handlers lock internally; ``setup``/``set_level`` are
called from the main thread (start-up and the SIGHUP handler).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import re
from typing import Any, Callable, Mapping, TextIO

from .safetext import escape_controls

# Attributes every LogRecord has; anything else came in through ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None)).keys()) | {"message", "asctime", "taskName"}
_HANDLER_NAME = "fracplugin"
_NEEDS_QUOTES = re.compile('[\\s"=\x00-\x1f\x7f-\x9f\u2028\u2029]')


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _ts(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; non-JSON-able extras are rendered with ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": _ts(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _extras(record).items():
            doc.setdefault(k, v)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger>: <msg> key=value ...``, one line per record
    (plus the traceback of an exception). Control characters in the message
    and in string values are escaped (safetext.py): a pod's annotation with a
    newline must not forge a log line (issue 13 item 6). A string value with
    a space, a quote, ``=`` or a control character is written JSON-quoted."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"{_ts(record)} {record.levelname:<7} {record.name}: {escape_controls(record.getMessage())}"]
        for k, v in _extras(record).items():
            if isinstance(v, str) and v and not _NEEDS_QUOTES.search(v):
                parts.append(f"{escape_controls(str(k))}={v}")
            else:
                parts.append(f"{escape_controls(str(k))}={json.dumps(v, default=str)}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(fmt: str = "json", level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """Install our handler on the root logger (replacing an earlier one).

    Args:
        fmt: ``json`` or ``text``.
        level: ``debug``/``info``/``warning``/``error`` (case-insensitive).
        stream: where to write (default stderr).
    Raises:
        ValueError: unknown format or level.
    """
    if fmt not in ("json", "text"):
        raise ValueError(f"log format {fmt!r} must be json or text")
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == _HANDLER_NAME:
            root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    set_level(level)
    # grpc and kubernetes are chatty at debug; keep them at warning unless asked
    for noisy in ("kubernetes", "urllib3", "grpc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return handler


def set_level(level: str) -> None:
    """Set the root level. Raises ValueError for an unknown level name."""
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"log level {level!r} must be debug, info, warning or error")
    logging.getLogger().setLevel(value)


def guarded(logger: logging.Logger, what: str, fn: Callable[..., object], *args: Any,
            extra: Mapping[str, Any] | None = None) -> None:
    """Call ``fn(*args)``; an exception is logged on ``logger`` with its
    traceback (``<what> failed``, fields ``extra``) and swallowed: a callback,
    subscriber or hook never breaks, nor ends the thread of, its caller."""
    try:
        fn(*args)
    except Exception:
        logger.exception("%s failed", what, extra=extra)
