"""Requests of the MPS role's API (``rpc.py``), parsed and checked before
anything runs: every malformed request is refused with a ``RequestError``
naming the field, the value and the rule (issue 25 item 8).

A request is one line of JSON (API version ``API_VERSION``)::

    {"v": 1, "op": "<op>", "args": {...}}

``parse_request(raw)`` returns ``(op, args)`` with ``args`` converted to the
types the supervisor takes (``ComputeMode``, ``int``, finite ``float``), or
raises ``RequestError``. What it refuses:

* more than ``MAX_DEPTH`` levels of ``[``/``{`` nesting (checked on the bytes
  before ``json.loads``, so a 10,000-deep document costs one linear scan and
  never reaches the recursive parser);
* text that is not one JSON object, a field other than ``v``/``op``/``args``,
  an ``op`` that is not one of ``OPS``, an argument the op does not take;
* a missing required argument, or one of the wrong type or out of range:
  strings are non-empty and at most ``MAX_TEXT`` characters; ``timeout_s`` is
  a finite number of seconds in ``0..MAX_TIMEOUT_S`` (``Infinity``/``NaN``,
  which Python's ``json`` accepts, are refused here); the active thread
  percentage an integer 1..100 (docs/reference/mps-nvml.md 1.6: ``--active-thread-percentage``);
  the pinned device memory limit an integer number of MiB >= 1; a mode one of
  ``ComputeMode``'s values. Booleans are never taken for numbers.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from ..model import ComputeMode

API_VERSION = 1
MAX_DEPTH = 8
"""Most ``[``/``{`` levels a request may nest (the deepest valid one nests 3)."""
MAX_TEXT = 256
"""Most characters of a string argument (pod UID, container name, container ID)."""
MAX_TIMEOUT_S = 600.0
"""Largest ``timeout_s`` accepted, seconds (the doors ask for a few seconds)."""


class RequestError(ValueError):
    """A request the API refuses. ``kind`` is the reply's error kind
    (``bad_request``: not a request at all; ``version``; ``value``: an argument
    is wrong, raised as ValueError by ``RemoteMps``); the message names the
    field."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


def nesting_depth(raw: bytes, limit: int) -> int:
    """Deepest ``[``/``{`` nesting of the JSON text ``raw`` outside strings,
    scanning no further than the first level past ``limit`` (then returns
    ``limit + 1``). Linear in ``len(raw)``; never raises."""
    depth = deepest = 0
    in_str = esc = False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:  # quote
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif b in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def _text(op: str, key: str, v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_TEXT:
        raise RequestError("value", f"{op}: args.{key}={_show(v)}: must be a non-empty string of at most "
                                    f"{MAX_TEXT} characters")
    return v


def _seconds(op: str, key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not 0 <= v <= MAX_TIMEOUT_S:
        raise RequestError("value", f"{op}: args.{key}={_show(v)}: must be a finite number of seconds in "
                                    f"0..{MAX_TIMEOUT_S:g}")
    return float(v)


def _int_or_null(lo: int, hi: int, rule: str) -> Callable[[str, str, Any], int | None]:
    """A check taking None or an integer (never a bool) in ``lo..hi``; ``rule`` ends its error."""
    def check(op: str, key: str, v: Any) -> int | None:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise RequestError("value", f"{op}: args.{key}={_show(v)}: {rule} or null")
        return v
    return check


_percent = _int_or_null(1, 100, "active thread percentage must be an integer 1..100")
_mib = _int_or_null(1, (1 << 40) - 1, "pinned device memory limit must be an integer number of MiB >= 1")


def _mode(op: str, key: str, v: Any) -> ComputeMode:
    try:
        if isinstance(v, str):
            return ComputeMode(v)
    except ValueError:
        pass
    raise RequestError("value", f"{op}: args.{key}={_show(v)}: must be one of "
                                f"{', '.join(m.value for m in ComputeMode)}")


def _modes(op: str, key: str, v: Any) -> list[ComputeMode] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > len(ComputeMode):
        raise RequestError("value", f"{op}: args.{key}={_show(v)}: must be a list of at most "
                                    f"{len(ComputeMode)} compute modes or null")
    return [_mode(op, f"{key}[{i}]", x) for i, x in enumerate(v)]


_Check = Callable[[str, str, Any], Any]
_REQUIRED = object()

OPS: dict[str, dict[str, tuple[_Check, Any]]] = {
    "hello": {},
    "status": {},
    "ensure_namespace": {
        "pod_uid": (_text, _REQUIRED), "container": (_text, _REQUIRED), "timeout_s": (_seconds, _REQUIRED),
        "active_thread_percentage": (_percent, None), "mode": (_mode, ComputeMode.SM_SHARING.value),
        "pinned_limit_mib": (_mib, None)},
    "release_namespace": {"pod_uid": (_text, _REQUIRED), "container": (_text, _REQUIRED), "timeout_s": (_seconds, None)},
    "drain": {"container_id": (_text, _REQUIRED), "timeout_s": (_seconds, _REQUIRED), "modes": (_modes, None)},
    "quit_daemons": {"timeout_s": (_seconds, 10.0)},
}
"""Each op's arguments: ``name -> (check, default)`` (``_REQUIRED``: no default)."""


def _show(v: Any) -> str:
    """A value for an error message: JSON-ish, at most 40 characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_request(raw: bytes) -> tuple[str, dict[str, Any]]:
    """One request line (bytes, without or with its newline) -> ``(op, args)``,
    ``args`` holding every argument of the op (defaults filled in, None for an
    absent optional one). Raises RequestError (module docstring)."""
    depth = nesting_depth(raw, MAX_DEPTH)
    if depth > MAX_DEPTH:
        raise RequestError("bad_request", f"request nests JSON deeper than {MAX_DEPTH} levels")
    try:
        req = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RequestError("bad_request", f"request is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError("bad_request", f"request is not a JSON object but {type(req).__name__}")
    if req.get("v") != API_VERSION:
        raise RequestError("version", f"request speaks MPS API v{_show(req.get('v'))}; this MPS role speaks "
                                      f"v{API_VERSION}")
    extra = sorted(set(req) - {"v", "op", "args"})
    if extra:
        raise RequestError("bad_request", f"request field {_show(extra[0])} is not part of MPS API v{API_VERSION} "
                                          f"(fields: v, op, args)")
    op = req.get("op")
    if not isinstance(op, str):
        raise RequestError("bad_request", f"op={_show(op)}: must be a string")
    spec = OPS.get(op)
    if spec is None:
        raise RequestError("value", f"unknown op {op!r} (ops: {', '.join(OPS)})")
    args = req.get("args")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise RequestError("bad_request", f"{op}: args={_show(args)}: must be an object")
    unknown = sorted(set(args) - set(spec))
    if unknown:
        raise RequestError("value", f"{op}: args.{unknown[0]} is not an argument of {op} "
                                    f"(arguments: {', '.join(spec) or 'none'})")
    out: dict[str, Any] = {}
    for key, (check, default) in spec.items():
        if key not in args or (args[key] is None and default is None):
            if default is _REQUIRED:
                raise RequestError("value", f"{op}: args.{key} is required")
            out[key] = None if default is None else check(op, key, default)
        else:
            out[key] = check(op, key, args[key])
    return op, out
