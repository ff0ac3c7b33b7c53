"""The two libraries under test, behind one interface, so every workload runs the same calls.

Each side has three APIs that do nothing but return their module, so a benchmark
measures the contract itself: ``first`` (applied beforehand where a workload needs
a model that already has an API), ``second`` (the one timed) and ``group`` (for
list applies). The record of ``second`` counts calls: torchcontract replaces it
through ``update`` with ``attrs.evolve``, torch mutates its state object in place.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from torch import nn
from torch.distributed._composable.contract import contract as torch_contract
from torch.distributed._composable_state import _State

from torchcontract import contract

__all__ = ["LIBRARIES", "Library", "library_named"]


@attrs.frozen
class Counter:
    """The record of a torchcontract API in the benchmarks."""

    calls: int = 0


class TorchCounter(_State):
    """The state of a torch API in the benchmarks."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0


@contract(Counter)
def ours_first(module: nn.Module) -> nn.Module:
    return module


@contract(Counter)
def ours_second(module: nn.Module) -> nn.Module:
    return module


@contract(Counter)
def ours_group(modules: list[nn.Module]) -> list[nn.Module]:
    return modules


@torch_contract(TorchCounter)
def torch_first(module: nn.Module) -> nn.Module:
    return module


@torch_contract(TorchCounter)
def torch_second(module: nn.Module) -> nn.Module:
    return module


@torch_contract(TorchCounter)
def torch_group(modules: list[nn.Module]) -> list[nn.Module]:
    return modules


def _count(record: Counter) -> Counter:
    return attrs.evolve(record, calls=record.calls + 1)


def _ours_update(module: nn.Module) -> object:
    return ours_second.update(module, _count)


def _torch_update(module: nn.Module) -> object:
    state = torch_second.state(module)
    state.calls += 1
    return state


@attrs.frozen
class Library:
    """One library's side of every workload."""

    name: str
    apply_first: Callable[[nn.Module], object]
    apply: Callable[[nn.Module], object]
    apply_list: Callable[[list[nn.Module]], object]
    state: Callable[[nn.Module], object]
    update: Callable[[nn.Module], object]


LIBRARIES: tuple[Library, ...] = (
    Library("torchcontract", ours_first, ours_second, ours_group, ours_second.state, _ours_update),
    Library("torch", torch_first, torch_second, torch_group, torch_second.state, _torch_update),
)
NAMES: tuple[str, ...] = tuple(library.name for library in LIBRARIES)


def library_named(name: str) -> Library:
    """The library called ``name`` ("torchcontract" or "torch")."""
    return next(library for library in LIBRARIES if library.name == name)
