"""Shared test settings."""

from __future__ import annotations

import gc
import os
import platform
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings
from strategies import PROFILE

from torchcontract.testing import free_port

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


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A gloo group of one rank (this process) for a module's tests: ``usefixtures`` it."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_report_header() -> str:
    """Name the torch this run tests against, first thing in every run's output."""
    return f"torch {torch.__version__} (Python {platform.python_version()})"


def pytest_collection_finish() -> None:
    """Move everything the imports made out of the collector's reach, once.

    ``strategies.contents`` collects garbage before each snapshot; with the tens of
    thousands of objects torch and hypothesis build at import frozen, that
    collection looks only at what the tests themselves made, and costs milliseconds.
    """
    gc.collect()
    gc.freeze()
