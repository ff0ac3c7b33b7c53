"""Typing checks: ``api.entry(module)`` is typed by the contract it records.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, assert_type

import attrs
from torch import nn

from torchcontract import AnyContract, Contract, RegistryEntry, contract


@attrs.frozen
class ScaleState:
    factor: float = 1.0


@contract(ScaleState)
def scale(module: nn.Module, *, factor: float) -> nn.Module:
    return module


@contract()
def tag(module: nn.Linear, label: str = "") -> None:
    pass


model = nn.Linear(2, 2)
entry = scale.entry(model)

# The entry's api is the contract itself: its records, its call signature, its result.
assert_type(entry.api.state(model), ScaleState)
assert_type(entry.api(nn.Linear(2, 2), factor=2.0), nn.Module)
entry.api(nn.Linear(2, 2), factr=2.0)  # type: ignore[call-arg]
assert_type(tag.entry(model).api(nn.Linear(2, 2), "x"), nn.Linear)
tag.entry(model).api(nn.Sequential())  # type: ignore[arg-type]

# The recorded arguments stay a mapping; bound values are objects, to narrow before use.
assert_type(entry.args, tuple[Any, ...])
assert_type(entry.kwargs, Mapping[str, Any])
assert_type(entry.arguments, Mapping[str, object])
factor = entry.arguments["factor"]
factor + 1.0  # type: ignore[operator]
if isinstance(factor, float):
    assert_type(factor + 1.0, float)

# Entries are covariant in the contract: one typed by its contract is an entry of any
# contract with the same records, and a plain RegistryEntry.
as_module_api: RegistryEntry[Contract[..., nn.Module, ScaleState]] = entry
as_any: RegistryEntry = entry
as_any_contract: RegistryEntry[AnyContract] = tag.entry(model)
other_records: RegistryEntry[Contract[..., object, int]] = entry  # type: ignore[assignment]
