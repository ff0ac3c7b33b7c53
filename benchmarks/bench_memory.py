"""What applying an API costs in memory: bytes kept per module, measured with tracemalloc.

The API is applied to every module of a 64-block model (leaves included, root
last, as the FSDP pattern does with blocks). The bytes still traced after a full
collection, divided by the number of modules, go into ``extra_info``; the apply
itself is timed without tracemalloc, which would slow it several times over.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

import pytest
from pytest_benchmark.fixture import BenchmarkFixture
from torch import nn

from .harness import label, time_once_per_model
from .libraries import NAMES, Library, library_named
from .models import Model, build_model

# CPU time: on a shared machine a process waiting for a core does no work.
pytestmark = pytest.mark.benchmark(timer=time.process_time)


BLOCKS = 64


def _apply_to_every_module(library: Library, model: Model) -> None:
    modules = list(model.modules())
    for module in reversed(modules):
        library.apply(module)


def bytes_per_module(library: Library) -> float:
    """Bytes still allocated, per module, once the API is on every module of a fresh model."""
    model = build_model(BLOCKS)
    modules: list[nn.Module] = list(model.modules())
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _apply_to_every_module(library, model)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / len(modules)


@pytest.mark.parametrize("name", NAMES)
def test_bytes_per_module(benchmark: BenchmarkFixture, name: str) -> None:
    """Memory kept per module by one API on every module; the apply's time alongside."""
    library = library_named(name)
    model_size = sum(1 for _ in build_model(BLOCKS).modules())
    label(
        benchmark,
        workload="apply to every module",
        library=name,
        blocks=BLOCKS,
        modules=model_size,
        bytes_per_module=round(bytes_per_module(library), 1),
    )

    def prepare() -> tuple[Library, Model]:
        return library, build_model(BLOCKS)

    time_once_per_model(benchmark, _apply_to_every_module, prepare, rounds=11)
