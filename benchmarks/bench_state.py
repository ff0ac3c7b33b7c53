"""Reading and updating API state: bare lookups, updates, and hooks in a training step.

A lookup or update is far quicker than the timer's resolution, so each round makes
one call per block of a 512-block model; ``calls`` in extra_info says how many.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from torch import nn

from .harness import label
from .libraries import NAMES, library_named
from .models import WIDTH, blocks_of, build_model, modules_in

# CPU time: on a shared machine a process waiting for a core does no work.
pytestmark = pytest.mark.benchmark(timer=time.process_time)


BLOCKS = 512
STEP_BLOCKS = 64
PLAIN = "plain attribute"


def _blocks_with_api(name: str, blocks: int) -> list[nn.Module]:
    library = library_named(name)
    blocks_list: list[nn.Module] = list(blocks_of(build_model(blocks)))
    for block in blocks_list:
        library.apply(block)
    return blocks_list


@pytest.mark.parametrize("name", NAMES)
def test_state_lookup(benchmark: BenchmarkFixture, name: str) -> None:
    """``api.state(block)`` for every block."""
    blocks = _blocks_with_api(name, BLOCKS)
    label(
        benchmark,
        workload="state() lookup",
        library=name,
        blocks=BLOCKS,
        modules=modules_in(BLOCKS),
        calls=len(blocks),
    )
    benchmark(library_named(name).state_each, blocks)


@pytest.mark.parametrize("name", NAMES)
def test_update(benchmark: BenchmarkFixture, name: str) -> None:
    """One counter increment in the record of every block: ``update`` or an in-place write."""
    blocks = _blocks_with_api(name, BLOCKS)
    label(
        benchmark,
        workload="update()",
        library=name,
        blocks=BLOCKS,
        modules=modules_in(BLOCKS),
        calls=len(blocks),
    )
    benchmark(library_named(name).update_each, blocks)


def _reads_plain_attribute(module: nn.Module, args: tuple[object, ...]) -> None:
    _ = module.hook_value  # set by Block.__init__, in the instance __dict__


@pytest.mark.benchmark(max_time=1.5, timer=time.process_time)  # replaces the module mark
@pytest.mark.parametrize("name", [*NAMES, PLAIN])
def test_forward_backward(benchmark: BenchmarkFixture, name: str) -> None:
    """One forward and backward where a forward pre-hook on every block reads its state.

    The plain-attribute variant reads a value set on the module instead: the cost
    of a hook that reads nothing from any contract.
    """
    torch.manual_seed(0)
    model = build_model(STEP_BLOCKS)
    hook: Callable[[nn.Module, tuple[object, ...]], None]
    if name == PLAIN:
        hook = _reads_plain_attribute
    else:
        library = library_named(name)
        hook = library.hook
        for block in model.blocks:
            library.apply(block)
    for block in model.blocks:
        block.register_forward_pre_hook(hook)
    inputs = torch.randn(4, 16, WIDTH)

    def step() -> None:
        model(inputs).sum().backward()

    label(
        benchmark,
        workload="forward+backward, hooks read state",
        library=name,
        blocks=STEP_BLOCKS,
        modules=modules_in(STEP_BLOCKS),
    )
    benchmark(step)
