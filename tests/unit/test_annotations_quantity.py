"""The quantity grammar of annotations.py, without the kubernetes client at
import time (issue 14), kept identical to ``kubernetes.utils.parse_quantity``."""

from __future__ import annotations

import subprocess
import sys
from decimal import ROUND_CEILING, Decimal

import pytest
from hypothesis import given, settings, strategies as st
from kubernetes.utils import parse_quantity

from fracplugin.annotations import _QUANTITY_RE, MAX_QUANTITY_BYTES, MIB, parse_quantity_mib, quantity_value
from fracplugin.model import FractionError

NUMBERS = st.from_regex(r"\A[+-]?(?:[0-9]{1,12}(?:\.[0-9]{0,6})?|\.[0-9]{1,6})\Z")
SUFFIXES = st.sampled_from(["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E",
                            "e3", "E-2", "e+9", "e0", "E12"])


def old_parse_quantity_mib(raw: str) -> int | str:
    """What parse_quantity_mib did before issue 14 (with the kubernetes
    client), as a value or the FractionError code."""
    try:
        if not _QUANTITY_RE.match(raw):
            raise ValueError(raw)
        value = Decimal(parse_quantity(raw))
    except (ValueError, ArithmeticError, TypeError):
        return "quantity"
    if not value.is_finite() or value < 0 or value > MAX_QUANTITY_BYTES or value < MIB:
        return "quantity"
    return int((value / MIB).to_integral_value(rounding=ROUND_CEILING))


def new(raw: str) -> int | str:
    try:
        return parse_quantity_mib("k", raw)
    except FractionError as e:
        return e.code


@settings(max_examples=600, deadline=None)
@given(NUMBERS, SUFFIXES)
def test_value_is_the_kubernetes_clients(number, suffix):
    raw = number + suffix
    assert _QUANTITY_RE.match(raw)
    assert quantity_value(raw) == parse_quantity(raw)
    assert new(raw) == old_parse_quantity_mib(raw)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="0123456789.+-eEiKkMGTPnumb x", max_size=12))
def test_any_string_gets_the_old_answer(raw):
    if raw != raw.strip() or not raw:
        return  # whitespace and blanks are refused before parsing, by their own rule
    assert new(raw) == old_parse_quantity_mib(raw)


@pytest.mark.parametrize("raw,mib", [("40Gi", 40960), ("4096M", 3907), ("1G", 954), ("1.5G", 1431),
                                     ("4294967296", 4096), ("1e9", 954), ("1Mi", 1), ("1048577", 2),
                                     ("0.5Gi", 512), ("1Pi", 1 << 30)])
def test_known_values(raw, mib):
    assert parse_quantity_mib("k", raw) == mib


@pytest.mark.parametrize("raw", ["1K", "1ki", "1mi", "Gi", "1.5.5G", "1Ki1", "-1Gi", "1023Ki", "2Pi", "1Ei", "0"])
def test_refused(raw):
    with pytest.raises(FractionError) as e:
        parse_quantity_mib("nvidia.com/container.app.gpu-memory.request", raw)
    assert e.value.code == "quantity" and raw in str(e.value)


def test_annotations_and_the_nri_door_do_not_import_the_kubernetes_client():
    code = ("import sys, fracplugin.annotations, fracplugin.planner, fracplugin.nri.plugin, fracplugin.ledger; "
            "print(sorted(m for m in sys.modules if m == 'kubernetes' or m.startswith('kubernetes.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
