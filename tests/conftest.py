"""Fixtures shared by every test layer: the repo's examples and recorded fixtures.

Everything the tests read lives in this repository (``examples/`` for nodes
and pods, ``tests/fixtures/`` for wire transcripts); nothing reads
``../shared``, so a bare clone runs the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
FIXTURES = REPO / "tests" / "fixtures"
NODE_FILE = EXAMPLES / "nodes" / "gpu-node-1.yaml"


@pytest.fixture(scope="session")
def examples() -> Path:
    """The repo's ``examples/`` directory (``nodes/``, ``pods/``)."""
    return EXAMPLES


@pytest.fixture(scope="session")
def node_file() -> Path:
    return NODE_FILE


@pytest.fixture(scope="session")
def seed_pods() -> dict[str, dict]:
    """Seed pods by file stem, e.g. ``inference-sm-sharing-4gpu.bound``."""
    out = {}
    for p in sorted((EXAMPLES / "pods").glob("*.yaml")):
        out[p.name[: -len(".yaml")]] = yaml.safe_load(p.read_text())
    return out
