"""Shared test settings."""

from __future__ import annotations

import os

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
