"""An apply's work per module does not grow with the model: counted, not timed.

Work is what ``sys.setprofile`` and ``sys.settrace`` see: Python calls, calls into C
made from Python, and Python lines, in every function an apply runs. Counts are
deterministic (collections are off while counting), so each test can hold the
work per module of a small model to that of a model eight times as large: a walk
of the tree per module, a registry scan per apply, or a cache rebuilt per module
would make the larger model's marginal work per module grow, and fail here.

Every test runs twice: with the walk in C (what an install with a compiler runs; the
walk's own work is then one call, which the profiler sees as such) and with the Python
walk, so that the reference walk, line by line, is held to linear work too.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

import attrs
import pytest
from torch import nn

from torchcontract import EmptyState, Incompatible, ModuleContract, StateStore, _fqn, contract

#: The sizes compared: the marginal work per module from SMALL to 2 * SMALL blocks,
#: against that from LARGE / 2 to LARGE blocks.
SMALL: Final = 16
LARGE: Final = 128
#: What the marginal work per module may differ by between the two ends: an apply's
#: fixed work (the same at every size) cancels out of a marginal cost, so linear work
#: gives equal marginal costs; a fraction of a call per module absorbs the rare step of
#: a list growing past a size where it reallocates.
SLACK: Final = 0.25

API = ModuleContract[[], EmptyState]


@pytest.fixture(autouse=True, params=["C walk", "Python walk"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test with the snapshots' walk in C (where built), then in Python."""
    if request.param == "Python walk":
        monkeypatch.setattr(_fqn, "_native_walk", None)
        monkeypatch.setattr(_fqn, "_native_unchanged", None)


@attrs.frozen
class Work:
    """What one call ran: Python calls, calls into C from Python, and Python lines."""

    calls: int
    c_calls: int
    lines: int

    def __sub__(self, other: Work) -> Work:
        return Work(
            self.calls - other.calls, self.c_calls - other.c_calls, self.lines - other.lines
        )

    def per(self, modules: int) -> tuple[float, float, float]:
        return (self.calls / modules, self.c_calls / modules, self.lines / modules)


def work_of(call: Callable[[], object]) -> Work:
    """The ``Work`` of ``call()``, with collections off so no finalizer runs in the middle."""
    calls = c_calls = lines = 0

    def profile(frame: FrameType, event: str, argument: object) -> None:
        nonlocal calls, c_calls
        if event == "call":
            calls += 1
        elif event == "c_call":
            c_calls += 1

    def trace(frame: FrameType, event: str, argument: object) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return Work(calls, c_calls, lines)


class Block(nn.Module):
    """A transformer-style block: nested children, parameters, buffers and an empty slot."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.attention = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.batch_norm = nn.BatchNorm1d(4)  # three buffers
        self.register_module("adapter", None)  # a None child, skipped as named_modules does


class Model(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))


def modules_in(model: nn.Module) -> int:
    return len(list(model.modules()))


@pytest.fixture
def apis() -> tuple[API, API, API]:
    """Three no-op APIs in a store of their own: first, one timed next to it, and a ruled one."""
    store = StateStore()

    @contract(store=store)
    def first(module: nn.Module) -> None:
        pass

    @contract(store=store)
    def second(module: nn.Module) -> None:
        pass

    @contract(store=store)
    def other(module: nn.Module) -> None:
        pass

    @contract(store=store, incompatible_with=(Incompatible(other),))
    def ruled(module: nn.Module) -> None:
        pass

    # The registry builds a column for a key the first time a rule reads it: once per
    # key, not per apply, so it is done before anything is counted.
    ruled(nn.Linear(1, 1))
    return first, second, ruled


def marginal_per_module(work: Callable[[int], tuple[Work, int]]) -> list[tuple[float, ...]]:
    """The marginal work per module from SMALL to 2 * SMALL, and from LARGE / 2 to LARGE."""
    ends: list[tuple[float, ...]] = []
    for low, high in ((SMALL, 2 * SMALL), (LARGE // 2, LARGE)):
        (low_work, low_modules), (high_work, high_modules) = work(low), work(high)
        ends.append((high_work - low_work).per(high_modules - low_modules))
    return ends


def assert_linear(ends: list[tuple[float, ...]]) -> None:
    small, large = ends
    assert all(abs(a - b) <= SLACK for a, b in zip(small, large, strict=True)), (
        f"work per module (calls, C calls, lines) grows with the model: {small} at "
        f"{SMALL} blocks, {large} at {LARGE} blocks"
    )


def test_root_apply_work_per_module_does_not_grow_with_the_model(
    apis: tuple[API, API, API],
) -> None:
    first, second, _ = apis

    def work(blocks: int) -> tuple[Work, int]:
        model = Model(blocks)
        first(model)
        return work_of(lambda: second(model)), modules_in(model)

    assert_linear(marginal_per_module(work))


def test_fsdp_pattern_work_per_module_does_not_grow_with_the_model(
    apis: tuple[API, API, API],
) -> None:
    """Each block, then the root: no apply rereads what earlier ones installed."""
    _, second, _ = apis

    def work(blocks: int) -> tuple[Work, int]:
        model = Model(blocks)

        def pattern() -> None:
            for block in model.blocks:
                second(block)
            second(model)

        return work_of(pattern), modules_in(model)

    assert_linear(marginal_per_module(work))


def test_an_apply_to_one_block_costs_the_same_however_many_are_applied(
    apis: tuple[API, API, API],
) -> None:
    """The last block's apply, after every other block's: no registry scan per apply."""
    _, second, ruled = apis
    costs: list[Work] = []
    for blocks in (SMALL, LARGE):
        model = Model(blocks)
        for api in (second, ruled):
            for block in model.blocks[:-1]:
                api(block)
            last = model.blocks[-1]
            costs.append(work_of(functools.partial(api, last)))
    assert costs[:2] == costs[2:]


def test_a_ruled_root_apply_work_per_module_does_not_grow_with_the_model(
    apis: tuple[API, API, API],
) -> None:
    """A tree-wide rule looks once at each module inside, whatever other APIs hold."""
    _, second, ruled = apis

    def work(blocks: int) -> tuple[Work, int]:
        model = Model(blocks)
        for block in model.blocks:
            second(block)
        return work_of(lambda: ruled(model)), modules_in(model)

    assert_linear(marginal_per_module(work))


def test_list_apply_work_per_module_does_not_grow_with_the_model() -> None:
    @contract(store=StateStore())
    def group(modules: list[nn.Module]) -> None:
        pass

    def work(blocks: int) -> tuple[Work, int]:
        model = Model(blocks)
        return work_of(lambda: group(list(model.blocks))), modules_in(model)

    assert_linear(marginal_per_module(work))
