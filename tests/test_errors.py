"""The exception hierarchy, and messages that stay short on large models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchcontract
from torchcontract import (
    AllGatherExtensionError,
    AlreadyAppliedError,
    AlreadyManagedError,
    ArgumentBindingError,
    ContractError,
    CyclicModuleTreeError,
    FQNChangedError,
    GraphChangedError,
    IncompatibleAPIError,
    InvalidMeshError,
    InvalidRecordError,
    InvalidResultError,
    InvalidShardDimError,
    InvalidStateClassError,
    InvalidTargetError,
    LateGradientError,
    NoProcessGroupError,
    NotAppliedError,
    ReplacedParameterError,
    RulePredicateError,
    ScalarParameterError,
    UnknownRuleScopeError,
    UnknownTorchAPIError,
    UnmaterializedParameterError,
    UnnamedMeshError,
    UnusedParameterError,
    contract,
)


@pytest.mark.parametrize(
    ("error", "bases"),
    [
        (ContractError, (RuntimeError,)),
        (AlreadyAppliedError, (ContractError,)),
        (AlreadyManagedError, (ContractError, ValueError)),
        (InvalidMeshError, (ContractError, ValueError)),
        (NotAppliedError, (ContractError, LookupError)),
        (FQNChangedError, (ContractError,)),
        (GraphChangedError, (ContractError,)),
        (LateGradientError, (ContractError,)),
        (CyclicModuleTreeError, (ContractError,)),
        (IncompatibleAPIError, (ContractError,)),
        (InvalidStateClassError, (TypeError,)),
        (InvalidRecordError, (TypeError,)),
        (InvalidResultError, (TypeError,)),
        (InvalidTargetError, (TypeError, ValueError)),
        (NoProcessGroupError, (ContractError, ValueError)),
        (ArgumentBindingError, (ContractError, TypeError)),
        (RulePredicateError, (ContractError,)),
        (UnknownTorchAPIError, (ValueError,)),
        (UnknownRuleScopeError, (ValueError,)),
        (UnmaterializedParameterError, (ContractError,)),
        (UnnamedMeshError, (InvalidMeshError, AssertionError)),
        (ScalarParameterError, (ContractError, ValueError)),
        (InvalidShardDimError, (ValueError, AssertionError)),
        (ReplacedParameterError, (ContractError, AttributeError)),
        (UnusedParameterError, (ContractError,)),
        (AllGatherExtensionError, (ContractError, AssertionError)),
    ],
)
def test_error_has_its_documented_bases(error: type[Exception], bases: tuple[type, ...]) -> None:
    assert error.__bases__ == bases


def test_every_error_is_exported() -> None:
    errors = [name for name in torchcontract.__all__ if name.endswith("Error")]
    assert sorted(errors) == sorted(
        [
            "AllGatherExtensionError",
            "AlreadyAppliedError",
            "AlreadyManagedError",
            "ArgumentBindingError",
            "ContractError",
            "CyclicModuleTreeError",
            "FQNChangedError",
            "GraphChangedError",
            "IncompatibleAPIError",
            "InvalidMeshError",
            "InvalidRecordError",
            "InvalidResultError",
            "InvalidShardDimError",
            "InvalidStateClassError",
            "InvalidTargetError",
            "LateGradientError",
            "NoProcessGroupError",
            "NotAppliedError",
            "ReplacedParameterError",
            "RulePredicateError",
            "ScalarParameterError",
            "UnfinishedBackwardError",
            "UnknownRuleScopeError",
            "UnknownTorchAPIError",
            "UnmaterializedParameterError",
            "UnnamedMeshError",
            "UnusedParameterError",
        ]
    )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


class Big(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(blocks)])


@contract()
def whole(module: nn.Module) -> None:
    pass


@contract()
def part(module: nn.Module) -> None:
    pass


def _message(action: Callable[[], object]) -> str:
    with pytest.raises(ContractError) as info:
        action()
    return str(info.value)


@pytest.fixture(scope="module")
def big() -> Big:
    model = Big(blocks=1000)
    whole(model)
    part(model.layers[999].get_submodule("fc"))
    return model


def test_already_applied_on_a_large_model_is_one_short_line_with_the_fqn(big: Big) -> None:
    message = _message(lambda: part(big.get_submodule("layers.999.fc")))
    assert message == (
        f"{part.name} is already applied to Linear 'layers.999.fc' of Big; "
        "an API applies once per module: read or update its state instead"
    )


def test_not_applied_on_a_large_model_is_one_short_line_with_the_fqn(big: Big) -> None:
    message = _message(lambda: part.state(big.get_submodule("layers.500")))
    assert message == (
        f"{part.name} is not applied to Block 'layers.500' of Big; "
        "apply it first, or use get_state() to get None instead"
    )


def test_fqn_change_on_a_large_model_lists_a_few_names_and_counts_the_rest() -> None:
    @contract()
    def grow(module: nn.Module) -> None:
        for index in range(20):
            module.register_parameter(f"extra{index}", nn.Parameter(torch.zeros(1)))

    model = Big(blocks=1000)
    message = _message(lambda: grow(model))
    shown = ", ".join(f"'extra{index}'" for index in range(8))
    assert f"only before: []; only after: [{shown}, ... and 12 more]" in message
    assert "\n" not in message
    assert len(message) < 400
