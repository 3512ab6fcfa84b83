"""Fixtures of the chart tests: the real helm and promtool (built from their
Go modules by scripts/chart-tools.sh; `make chart` exports $HELM and
$PROMTOOL). A missing tool fails the tests; it never skips them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chartutil import tool  # noqa: E402


@pytest.fixture(scope="session")
def helm() -> str:
    return tool("helm")


@pytest.fixture(scope="session")
def promtool() -> str:
    return tool("promtool")
