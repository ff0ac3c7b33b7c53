"""Typing checks: what contract() makes of an API function, and how calling the API is typed.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_type

import attrs
from torch import nn

from torchcontract import Contract, EmptyState, contract


@attrs.frozen
class ScaleState:
    factor: float = 1.0
    calls: int = 0


@contract(ScaleState)
def scale(module: nn.Module, *, factor: float) -> nn.Module:
    return module


@contract(ScaleState)
def tag(module: nn.Linear, label: str = "") -> None:
    pass


@contract(ScaleState)
def maybe_wrap(module: nn.Linear) -> nn.Sequential | None:
    return None


@contract()
def mark(module: nn.Module | Sequence[nn.Module]) -> None:
    pass


@contract()
def replace_all(modules: list[nn.Linear]) -> list[nn.Linear]:
    return modules


model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
linear = nn.Linear(2, 2)

# The decorator keeps the signature, the result type and the record class.
scale_api: Contract[..., nn.Module, ScaleState] = scale
tag_api: Contract[..., nn.Linear, ScaleState] = tag
mark_api: Contract[..., nn.Module | Sequence[nn.Module], EmptyState] = mark

# Calling the API returns what the function returns, or its input type when it returns None.
assert_type(scale(model, factor=2.0), nn.Module)
assert_type(tag(linear), nn.Linear)
assert_type(tag(linear, "x"), nn.Linear)
assert_type(maybe_wrap(linear), nn.Linear | nn.Sequential)
# A function returning None gives back what it was given, typed as the caller typed it.
assert_type(mark(linear), nn.Linear)
modules: list[nn.Module] = [linear, model]
assert_type(mark(modules), list[nn.Module])
assert_type(mark((linear, linear)), Sequence[nn.Linear])
assert_type(replace_all([linear]), list[nn.Linear])

# contract() without a state class keeps an EmptyState record.
assert_type(mark.state(model), EmptyState)

# The call is checked against the API function's own parameters.
scale(model, factr=2.0)  # type: ignore[call-arg]
scale(model)  # type: ignore[call-arg]
scale(model, factor="2")  # type: ignore[arg-type]
scale(model, 2.0)  # type: ignore[call-arg]
tag(model)  # type: ignore[arg-type]
tag(linear, label=3)  # type: ignore[arg-type]
replace_all(linear)  # type: ignore[arg-type]
# The module is passed by position, as at runtime: Concatenate makes it positional-only.
scale(module=model, factor=2.0)  # type: ignore[call-arg]


# The first parameter must take a module (or modules); the result must be one, or None.
@contract()  # type: ignore[arg-type]
def on_int(value: int) -> None:
    pass


@contract()  # type: ignore[arg-type]
def returns_int(module: nn.Module) -> int:
    return 0
