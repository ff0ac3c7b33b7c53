"""Typing checks: torchcontract.testing's helpers are generic in the module type.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from typing import assert_type

import attrs
import torch
from torch import Tensor, nn

from torchcontract import contract
from torchcontract.testing import InvariantReport, ModelCase, check_api_invariants


@attrs.frozen
class ScaleState:
    factor: float = 1.0


@contract(ScaleState)
def on_linear(module: nn.Linear, *, factor: float = 1.0) -> None:
    pass


@contract()
def on_module(module: nn.Module) -> None:
    pass


def make_linear() -> nn.Linear:
    return nn.Linear(2, 2)


def make_sequential() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2))


def inputs() -> tuple[Tensor]:
    return (torch.randn(1, 2),)


def first_linear(model: nn.Sequential) -> nn.Linear:
    layer = model[0]
    assert isinstance(layer, nn.Linear)
    return layer


# The target type defaults to the model type; ``target=`` picks another.
linear_case = ModelCase(make_linear, inputs)
assert_type(linear_case, ModelCase[nn.Linear, nn.Linear])
annotated: ModelCase[nn.Linear] = linear_case
sequential_case = ModelCase(make_sequential, inputs, target=first_linear)
assert_type(sequential_case, ModelCase[nn.Sequential, nn.Linear])

# An API on nn.Linear is checked on a case whose target is an nn.Linear, without a cast,
# with its own keyword arguments.
assert_type(check_api_invariants(on_linear, linear_case, factor=2.0), InvariantReport)
check_api_invariants(on_linear, sequential_case)
check_api_invariants(on_linear, linear_case, factr=2.0)  # type: ignore[call-arg]
check_api_invariants(on_linear, linear_case, factor="2")  # type: ignore[arg-type]
# An API on any module takes any case: the target type is covariant.
check_api_invariants(on_module, sequential_case)
as_module: ModelCase[nn.Sequential, nn.Module] = sequential_case
# ...but an API on nn.Linear cannot be checked on a Sequential target.
check_api_invariants(on_linear, ModelCase(make_sequential, inputs))  # type: ignore[arg-type]
ModelCase(make_sequential, inputs, target=first_linear, tolerance="0")  # type: ignore[call-overload]
