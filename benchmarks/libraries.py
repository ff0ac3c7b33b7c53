"""The two libraries under test, behind one interface, so every workload runs the same calls.

Each side has three APIs that do nothing but return their module, so a benchmark
measures the contract itself: ``first`` (applied beforehand where a workload needs
a model that already has an API), ``second`` (the one timed) and ``group`` (for
list applies). The record of ``second`` counts calls: torchcontract replaces it
through ``update`` with ``attrs.evolve``, torch mutates its state object in place.
State is read as users write it, ``api.state(module)`` with the API a global.
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


# What a user writes, spelled the same way for both libraries: the API is a global
# and its state is reached through it on every call.


def _ours_state_each(modules: list[nn.Module]) -> None:
    for module in modules:
        ours_second.state(module)


def _torch_state_each(modules: list[nn.Module]) -> None:
    for module in modules:
        torch_second.state(module)


def _ours_update_each(modules: list[nn.Module]) -> None:
    for module in modules:
        ours_second.update(module, _count)


def _torch_update_each(modules: list[nn.Module]) -> None:
    for module in modules:
        torch_second.state(module).calls += 1


def _ours_hook(module: nn.Module, args: tuple[object, ...]) -> None:
    ours_second.state(module)


def _torch_hook(module: nn.Module, args: tuple[object, ...]) -> None:
    torch_second.state(module)


@attrs.frozen
class Library:
    """One library's side of every workload."""

    name: str
    apply_first: Callable[[nn.Module], object]
    apply: Callable[[nn.Module], object]
    apply_list: Callable[[list[nn.Module]], object]
    state_each: Callable[[list[nn.Module]], None]
    update_each: Callable[[list[nn.Module]], None]
    hook: Callable[[nn.Module, tuple[object, ...]], None]  # a forward pre-hook reading state


LIBRARIES: tuple[Library, ...] = (
    Library(
        "torchcontract",
        ours_first,
        ours_second,
        ours_group,
        _ours_state_each,
        _ours_update_each,
        _ours_hook,
    ),
    Library(
        "torch",
        torch_first,
        torch_second,
        torch_group,
        _torch_state_each,
        _torch_update_each,
        _torch_hook,
    ),
)
NAMES: tuple[str, ...] = tuple(library.name for library in LIBRARIES)


def library_named(name: str) -> Library:
    """The library called ``name`` ("torchcontract" or "torch")."""
    return next(library for library in LIBRARIES if library.name == name)
