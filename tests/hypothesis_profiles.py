"""The hypothesis profiles of the test suite; importing this module loads the one in use.

``strategies.PROFILE`` names it (``make fuzz``, ``make mutate``); the default
profile otherwise.
"""

from __future__ import annotations

import os

from hypothesis import settings
from strategies import PROFILE

# Tests run on a few shared CPU cores; a per-example deadline would only measure the
# machine's load, so hypothesis checks behaviour, never speed. Under CI, start from
# hypothesis' own "ci" profile: derandomized, so a run is reproducible from its log.
settings.register_profile(
    "torchcontract",
    parent=settings.get_profile("ci") if os.environ.get("CI") else None,
    deadline=None,
)
# `make fuzz`: random seeds every run, ten times the examples (see strategies.examples)
# and longer stateful runs; failures are kept in the example database and replayed first.
settings.register_profile(
    "fuzz", deadline=None, derandomize=False, max_examples=1_000, stateful_step_count=100
)
# `make mutate`: every mutant sees the same few examples, so a kill is reproducible and a
# run of hundreds of mutants ends; no database, which forked mutant runs would share.
settings.register_profile(
    "mutate", deadline=None, derandomize=True, database=None, max_examples=10, print_blob=False
)
settings.load_profile(PROFILE or "torchcontract")
