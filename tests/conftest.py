"""Shared test settings."""

from __future__ import annotations

import gc
import importlib.util
import platform
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchcontract.testing import free_port

# The hypothesis profiles, where hypothesis is installed: `make test-gpu` runs on a
# machine with torch, attrs, typing-extensions and pytest only, and its tests use none.
if importlib.util.find_spec("hypothesis") is not None:
    import hypothesis_profiles  # noqa: F401 (registers and loads the profile)


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


@pytest.fixture
def default_group(request: pytest.FixtureRequest) -> Iterator[dist.ProcessGroup]:
    """The default group over the backend(s) ``request.param`` names: parametrize indirectly.

    One rank (this process); the fake group, which moves nothing, has two.
    """
    backend: str = request.param
    if backend == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        address = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(backend, init_method=address, rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
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
