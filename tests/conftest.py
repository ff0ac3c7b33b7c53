"""Shared test settings."""

from __future__ import annotations

import os
import platform

import torch
from hypothesis import settings

# Tests run on a few shared CPU cores; a per-example deadline would only measure the
# machine's load, so hypothesis checks behaviour, never speed. Under CI, start from
# hypothesis' own "ci" profile: derandomized, so a run is reproducible from its log.
settings.register_profile(
    "torchcontract",
    parent=settings.get_profile("ci") if os.environ.get("CI") else None,
    deadline=None,
)
settings.load_profile("torchcontract")


def pytest_report_header() -> str:
    """Name the torch this run tests against, first thing in every run's output."""
    return f"torch {torch.__version__} (Python {platform.python_version()})"
