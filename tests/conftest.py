"""Shared test settings."""

from __future__ import annotations

from hypothesis import settings

# Tests run on a few shared CPU cores; a per-example deadline would only measure the
# machine's load, so hypothesis checks behaviour, never speed.
settings.register_profile("torchcontract", deadline=None)
settings.load_profile("torchcontract")
