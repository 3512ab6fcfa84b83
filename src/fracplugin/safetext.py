"""Control characters out of anything a peer can put in a log line or a message.

A value from a pod (an annotation, a container name) or a runtime can carry a
newline, a carriage return or a terminal escape sequence. Written as-is into
a ``--log-format text`` line it forges a second log line; in a refusal
message it forges lines in ``kubectl describe pod`` (issue 13 item 6). Every
C0 and C1 control character, DEL and the Unicode line/paragraph separators are
written as escapes instead (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``),
the way Python's ``repr`` and Go's ``%q`` show them.

Pure functions; thread-safe.
"""

from __future__ import annotations

import re

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    ch = m.group(0)
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character replaced by its escape (see the
    module docstring); printable text, including non-ASCII letters, is kept.
    Returns ``text`` itself when there is nothing to escape."""
    return _CONTROL.sub(_escape, text) if _CONTROL.search(text) else text


def quote(value: object) -> str:
    """``"<value>"`` for a message: ``str(value)`` with control characters
    escaped and ``\\`` and ``"`` backslashed, so the quoted value always ends
    where its closing quote is."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escape_controls(text) + '"'
