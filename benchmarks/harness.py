"""How a benchmark names itself, and how it times work that can only happen once per model.

Every benchmark calls ``label`` so that the report can pair the two libraries:
``group`` is what pytest-benchmark shows side by side, ``extra_info`` says which
workload, library and model size a result belongs to.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, Final

import torch
from pytest_benchmark.fixture import BenchmarkFixture

__all__ = ["evict_caches", "label", "time_once_per_model"]

#: Larger than any CPU cache this runs on: writing it evicts whatever was cached.
_EVICTION_BYTES: Final = 128 * 1024 * 1024
_eviction_buffer: list[torch.Tensor] = []


def evict_caches() -> None:
    """Write a buffer larger than the CPU caches, so the next timed code starts cold."""
    if not _eviction_buffer:
        _eviction_buffer.append(torch.empty(_EVICTION_BYTES // 4, dtype=torch.float32))
    _eviction_buffer[0].fill_(1.0)


def label(
    benchmark: BenchmarkFixture,
    *,
    workload: str,
    library: str,
    blocks: int | None = None,
    **extra: object,
) -> None:
    """Put ``benchmark`` in the group of ``workload`` (at ``blocks``) and record what it is."""
    benchmark.group = workload if blocks is None else f"{workload}, {blocks} blocks"
    benchmark.extra_info.update(workload=workload, library=library, blocks=blocks, **extra)


def time_once_per_model(
    benchmark: BenchmarkFixture,
    target: Callable[..., object],
    prepare: Callable[[], tuple[Any, ...]],
    *,
    rounds: int,
) -> None:
    """Time ``target(*prepare())`` for ``rounds`` rounds, each on freshly prepared arguments.

    ``prepare`` runs untimed before every round (an API applies only once per
    module, so each round needs a new model). The CPU caches are then evicted:
    a program builds its model long before it applies an API, and a model built
    just before timing would sit in cache when small and not when large, which
    would make growth with model size look worse than it is, for both libraries
    alike. Then every object alive is frozen
    out of the garbage collector's reach until the round ends: the round starts
    with empty young generations, as after a full collection, so no round pays
    for collecting the objects that building the model made, yet the collector
    still runs on whatever the timed code allocates. (A full collection per
    round would cost as much as building the model.)
    """

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        arguments = prepare()
        evict_caches()
        gc.freeze()
        return arguments, {}

    def teardown(*arguments: object) -> None:
        gc.unfreeze()

    benchmark.pedantic(
        target, setup=setup, teardown=teardown, rounds=rounds, iterations=1, warmup_rounds=0
    )
