"""How a benchmark names itself, and how it times work that can only happen once per model.

Every benchmark calls ``label`` so that the report can pair the two libraries:
``group`` is what pytest-benchmark shows side by side, ``extra_info`` says which
workload, library and model size a result belongs to.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import attrs
from pytest_benchmark.fixture import BenchmarkFixture

__all__ = ["Side", "evict_caches", "label", "time_interleaved", "time_once_per_model"]

#: Where Linux lists this CPU's caches, one ``index*/size`` per level ("48K", "491520K").
_CACHES: Final = Path("/sys/devices/system/cpu/cpu0/cache")
_eviction_buffer: list[bytearray] = []


def _largest_cache_bytes() -> int:
    """The size of this CPU's largest cache, or 128 MiB where Linux does not list them."""
    sizes = [
        int(text[:-1]) * 1024
        for entry in _CACHES.glob("index*/size")
        if (text := entry.read_text().strip()).endswith("K") and text[:-1].isdigit()
    ]
    return max(sizes, default=128 * 1024 * 1024)


def evict_caches() -> None:
    """Write a buffer twice the size of the CPU's largest cache, so the next timed code starts cold.

    One ``memset`` on this thread, not a torch op: a torch op this large runs on torch's
    thread pool, whose threads then spin for a while, and ``time.process_time`` would
    count their spinning in the round that follows (nearly doubling a root apply's time
    on 2 cores).
    """
    if not _eviction_buffer:
        _eviction_buffer.append(bytearray(2 * _largest_cache_bytes()))
    buffer = _eviction_buffer[0]
    ctypes.memset((ctypes.c_char * len(buffer)).from_buffer(buffer), 1, len(buffer))


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


@attrs.frozen
class Side:
    """One library's side of a workload timed once per model: what runs, on what it prepares."""

    target: Callable[..., object]
    prepare: Callable[[], tuple[Any, ...]]


def time_round(side: Side) -> float:
    """One round of ``side`` timed by hand (CPU time), by the rules ``time_once_per_model`` sets."""
    arguments = side.prepare()
    evict_caches()
    gc.freeze()
    try:
        started = time.process_time()
        side.target(*arguments)
        return time.process_time() - started
    finally:
        gc.unfreeze()


def time_interleaved(
    benchmark: BenchmarkFixture,
    ours: Side,
    torch_side: Side,
    *,
    rounds: int,
    paired: tuple[Side, Side] | None = None,
) -> None:
    """Time ``ours`` through pytest-benchmark and ``torch_side`` by hand between its rounds.

    Torch's round runs just before ours on even rounds and just after it on odd ones,
    so that both see the same load and neither always follows the other; its times go
    to ``extra_info["interleaved_torch_seconds"]``, which the report shows as torch's row.
    ``paired``: the two libraries' sides on a smaller model, both timed in every round
    too (their order alternating), into ``extra_info["paired_base_seconds"]``: the report
    divides each round by its paired one, so growth with the model is measured round by
    round, seconds apart, rather than across a run whose load changes over minutes.
    """
    theirs: list[float] = []
    base: dict[str, list[float]] = {"torchcontract": [], "torch": []}
    done = 0  # rounds of ours finished

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if paired is not None:
            order = list(zip(base, paired, strict=True))
            for name, side in order if done % 2 == 0 else order[::-1]:
                base[name].append(time_round(side))
        if done % 2 == 0:
            theirs.append(time_round(torch_side))
        arguments = ours.prepare()
        evict_caches()
        gc.freeze()
        return arguments, {}

    def teardown(*arguments: object) -> None:
        nonlocal done
        gc.unfreeze()
        if done % 2 == 1:
            theirs.append(time_round(torch_side))
        done += 1

    benchmark.pedantic(
        ours.target, setup=setup, teardown=teardown, rounds=rounds, iterations=1, warmup_rounds=0
    )
    benchmark.extra_info["interleaved_torch_seconds"] = theirs
    if paired is not None:
        benchmark.extra_info["paired_base_seconds"] = base
