"""freeze(): turn off gradients of a module's parameters and record which ones."""

from __future__ import annotations

import attrs
from torch import nn
from typing_extensions import ParamSpec

from torchcontract import Contract, contract

_P = ParamSpec("_P")


@attrs.frozen()
class FreezeState:
    """The FQNs (relative to the module) of the parameters ``freeze`` turned off."""

    names: tuple[str, ...] = ()


@contract(FreezeState)
def freeze(module: nn.Module) -> None:
    """Set ``requires_grad=False`` on every parameter of ``module`` that had it."""
    names = tuple(name for name, parameter in module.named_parameters() if parameter.requires_grad)
    for name in names:
        module.get_parameter(name).requires_grad_(False)
    freeze.set_state(module, FreezeState(names))


def frozen_names(api: Contract[_P, object, FreezeState], module: nn.Module) -> tuple[str, ...]:
    """The names recorded by ``api``, any contract keeping ``FreezeState`` records.

    Takes ``Contract[_P, object, FreezeState]``: the result type is covariant, so every
    contract with these records fits, whatever it returns. (``Contract[..., object,
    FreezeState]`` says the same, but ``...`` counts as ``Any`` under mypy's
    ``--disallow-any-expr``.)
    """
    record = api.get_state(module)
    return () if record is None else record.names
