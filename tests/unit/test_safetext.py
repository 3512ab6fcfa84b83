"""safetext.escape_controls / quote and the text log format (issue 13 item 6)."""

from __future__ import annotations

import io
import logging

import pytest

from fracplugin import logs
from fracplugin.model import FractionError
from fracplugin.safetext import escape_controls, quote


@pytest.mark.parametrize(("raw", "want"), [
    ("plain", "plain"),
    ("a\nb", "a\\nb"),
    ("a\r\nb\tc", "a\\r\\nb\\tc"),
    ("\x1b[2J", "\\x1b[2J"),
    ("\x00\x7f\x85", "\\x00\\x7f\\x85"),
    ("line\u2028sep\u2029", "line\\u2028sep\\u2029"),
    ("café ünïcode 40Gi", "café ünïcode 40Gi"),
])
def test_escape_controls(raw: str, want: str) -> None:
    assert escape_controls(raw) == want


def test_quote_closes_where_the_value_ends() -> None:
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert quote(7) == '"7"'


def test_refusal_message_has_no_control_characters() -> None:
    err = FractionError("nvidia.com/container.app.gpu-memory.limit", "20Gi\nWarning  Started  forged", "is bad")
    assert err.message == 'nvidia.com/container.app.gpu-memory.limit="20Gi\\nWarning  Started  forged" is bad'
    assert str(err) == err.message
    assert err.to_dict()["value"] == "20Gi\nWarning  Started  forged"  # JSON output escapes it itself


def test_text_log_line_cannot_be_forged() -> None:
    buf = io.StringIO()
    handler = logs.setup("text", "info", buf)
    try:
        logging.getLogger("fracplugin.test").warning(
            "refused %s", "x\n2026-01-01T00:00:00.000Z INFO    forged",
            extra={"value": "a\nb", "plain": "ok", "eq": "k=v", "spaced": "a b"})
    finally:
        logging.getLogger().removeHandler(handler)
    out = buf.getvalue()
    assert out.count("\n") == 1, out
    assert "refused x\\n2026-01-01T00:00:00.000Z INFO    forged" in out
    assert 'value="a\\nb" plain=ok eq="k=v" spaced="a b"' in out
