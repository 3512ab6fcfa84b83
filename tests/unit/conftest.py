"""Fixtures for the unit tests: each test ends with no child process left behind."""

from __future__ import annotations

from tests.leakguard import no_child_process_left_behind  # noqa: F401  (autouse: every test here)
