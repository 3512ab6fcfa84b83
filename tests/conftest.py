"""Fixtures shared by every test layer: where ../shared is, the seed inputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """``$FRACPLUGIN_SHARED`` or ``<repo>/../shared``; fails loudly when absent."""
    d = Path(os.environ.get("FRACPLUGIN_SHARED") or REPO.parent / "shared")
    if not (d / "examples").is_dir():
        raise RuntimeError(f"shared inputs not found at {d}: set FRACPLUGIN_SHARED")
    return d


@pytest.fixture(scope="session")
def shared() -> Path:
    return shared_dir()


@pytest.fixture(scope="session")
def node_file(shared: Path) -> Path:
    return shared / "examples" / "nodes" / "gpu-node-1.yaml"


@pytest.fixture(scope="session")
def seed_pods(shared: Path) -> dict[str, dict]:
    """Seed pods by file stem, e.g. ``inference-sm-sharing-4gpu.bound``."""
    out = {}
    for p in sorted((shared / "examples" / "pods").glob("*.yaml")):
        out[p.name[: -len(".yaml")]] = yaml.safe_load(p.read_text())
    return out
