"""Applying APIs: to one Linear, to the root of a model that has one already, FSDP-style, to a list.

Every round builds a fresh model (untimed), since an API applies once per module.
The one-Linear apply, the root apply and the FSDP pattern, whose ratios and growth
carry targets, time torch's contract in rounds interleaved with ours
(``harness.time_interleaved``), and at 512 blocks both libraries at 64 blocks in
every round too: the report's growth is the median of those paired rounds' ratios.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from pytest_benchmark.fixture import BenchmarkFixture
from torch import nn

from .harness import Side, label, time_interleaved, time_once_per_model
from .libraries import NAMES, Library, library_named
from .models import Model, build_model, modules_in
from .report import GROWTH_FROM, GROWTH_TO, OURS

# CPU time: on a shared machine a process waiting for a core does no work.
pytestmark = pytest.mark.benchmark(timer=time.process_time)


# The required sizes are 8, 64 and 512 blocks; the others fill in the scaling plot, the
# smallest ones showing the fixed cost of an apply.
ROOT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SIZES = (8, 64, 512)


#: Root apply carries the growth target, whose two medians come from different
#: moments of the run: more rounds there make them steadier on a shared machine.
ROOT_ROUNDS = 21


def rounds_for(blocks: int) -> int:
    """Enough rounds for a steady median, few enough that building the models stays cheap."""
    return 21 if blocks <= 64 else 13


#: Fresh Linears applied to in one round; the table shows the time per apply.
LINEARS = 200


def _linears(library: Library, blocks: int) -> Side:
    """``library``'s API applied to each of ``LINEARS`` fresh ``nn.Linear`` (``blocks`` unused)."""

    def apply_each(modules: list[nn.Module]) -> None:
        for module in modules:
            library.apply(module)

    return Side(apply_each, lambda: ([nn.Linear(16, 16) for _ in range(LINEARS)],))


def test_apply_to_one_linear(benchmark: BenchmarkFixture) -> None:
    """One API applied to each of many fresh ``nn.Linear``: the fixed cost of an apply."""
    label(benchmark, workload="apply to one nn.Linear", library=OURS, modules=1, calls=LINEARS)
    ours, theirs = _both(_linears, 0)
    time_interleaved(benchmark, ours, theirs, rounds=ROOT_ROUNDS)


def _root_apply(library: Library, blocks: int) -> Side:
    """``library``'s API applied to the root of a model that has another API on its root."""

    def prepare() -> tuple[Model]:
        model = build_model(blocks)
        library.apply_first(model)
        return (model,)

    return Side(library.apply, prepare)


def _both(workload: Callable[[Library, int], Side], blocks: int) -> tuple[Side, Side]:
    """``workload`` at ``blocks`` for torchcontract and for torch, in that order."""
    ours, theirs = (library_named(name) for name in NAMES)
    return workload(ours, blocks), workload(theirs, blocks)


def _time_both(
    benchmark: BenchmarkFixture,
    workload: Callable[[Library, int], Side],
    name: str,
    blocks: int,
    rounds: int,
) -> None:
    """Time ``workload`` at ``blocks``, torch's rounds interleaved with ours.

    At the large end of the growth, both libraries' rounds at the small end run in
    every round too, so that growth is measured round by round under the same load.
    """
    label(benchmark, workload=name, library=OURS, blocks=blocks, modules=modules_in(blocks))
    ours, theirs = _both(workload, blocks)
    paired = _both(workload, GROWTH_FROM) if blocks == GROWTH_TO else None
    time_interleaved(benchmark, ours, theirs, rounds=rounds, paired=paired)


@pytest.mark.parametrize("blocks", ROOT_SIZES)
def test_root_apply(benchmark: BenchmarkFixture, blocks: int) -> None:
    """One API applied to the root of a model that already has another API on its root."""
    _time_both(benchmark, _root_apply, "root apply", blocks, ROOT_ROUNDS)


def _fsdp_pattern(library: Library, blocks: int) -> Side:
    """One API on every block, then on the root, as fully_shard is used."""

    def apply_each(model: Model) -> None:
        for block in model.blocks:
            library.apply(block)
        library.apply(model)

    return Side(apply_each, lambda: (build_model(blocks),))


@pytest.mark.parametrize("blocks", SIZES)
def test_fsdp_pattern(benchmark: BenchmarkFixture, blocks: int) -> None:
    """One API on every block, then on the root, as fully_shard is used."""
    _time_both(benchmark, _fsdp_pattern, "FSDP pattern", blocks, rounds_for(blocks))


def _list_apply(library: Library, model: Model) -> None:
    library.apply_list(list(model.blocks))


@pytest.mark.parametrize("blocks", SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_list_apply(benchmark: BenchmarkFixture, name: str, blocks: int) -> None:
    """One API applied in one call to the list of every block (one state shared by all)."""
    library = library_named(name)

    def prepare() -> tuple[Library, Model]:
        return library, build_model(blocks)

    label(
        benchmark,
        workload="list apply",
        library=name,
        blocks=blocks,
        modules=modules_in(blocks),
    )
    time_once_per_model(benchmark, _list_apply, prepare, rounds=rounds_for(blocks))
