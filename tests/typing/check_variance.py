"""Typing checks: the variance of the public generics, and the public names in signatures.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_type

import attrs
from torch import nn

from torchcontract import AnyContract, Application, Contract, RuleScope, contract


@attrs.frozen
class ScaleState:
    factor: float = 1.0


@attrs.frozen
class OtherState:
    name: str = ""


@contract(ScaleState)
def scale(module: nn.Module, *, factor: float) -> nn.Module:
    return module


@contract(ScaleState)
def tag(module: nn.Linear, label: str = "") -> None:
    pass


@contract(ScaleState)
def scale_all(modules: list[nn.Linear]) -> None:
    pass


@contract(OtherState)
def name(module: nn.Module) -> None:
    pass


model = nn.Linear(2, 2)


# The result type is covariant: a helper over every contract with records S takes them all,
# whatever they return.
def reset(api: Contract[..., object, ScaleState], module: nn.Module) -> None:
    api.set_state(module, ScaleState())


def reset_module(api: Contract[..., nn.Module, ScaleState], module: nn.Module) -> None:
    api.set_state(module, ScaleState())


reset(scale, model)
reset(tag, model)
reset(scale_all, model)
reset_module(scale, model)
reset_module(tag, model)
apis: Sequence[Contract[..., object, ScaleState]] = [scale, tag, scale_all]
returning_module: Contract[..., nn.Module, ScaleState] = tag

# ...but not one returning something else where a module is asked for.
reset_module(scale_all, model)  # type: ignore[arg-type]

# The record type is invariant: it goes in (set_state, update) as well as out (state). A
# contract with records ScaleState taken as one with records object could be given any
# object by set_state; one with OtherState records is no contract with ScaleState records.
reset(name, model)  # type: ignore[arg-type]
wider: Contract[..., object, object] = scale  # type: ignore[assignment]

# AnyContract takes every contract.
every: list[AnyContract] = [scale, tag, scale_all, name]


# Application only hands records out: covariant.
def read(handle: Application[object], module: nn.Module) -> object | None:
    return handle.record(module)


read(scale.application(model), model)
narrower: Application[OtherState] = scale.application(model)  # type: ignore[assignment]

# __wrapped__ is the API function, with its signature.
assert_type(scale.__wrapped__(model, factor=2.0), object)
scale.__wrapped__(model, factr=2.0)  # type: ignore[call-arg]
tag.__wrapped__(nn.Sequential())  # type: ignore[arg-type]

# The rule scope has a public name.
scope: RuleScope = "module"
bad_scope: RuleScope = "subtree"  # type: ignore[assignment]
