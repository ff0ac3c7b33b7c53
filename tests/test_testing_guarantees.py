"""What torchcontract.testing promises beyond the happy path, each shown on a broken case.

``run_distributed`` stops the other ranks soon after one failed (a grace period, not
the whole timeout); ``check_api_invariants`` reports every difference it promises:
a gradient the API drops or adds, gradients changed while outputs are not.
"""

from __future__ import annotations

import time
from typing import Final

import pytest
import torch
from torch import Tensor, nn

from torchcontract import contract
from torchcontract.apis import _torch
from torchcontract.testing import ModelCase, check_api_invariants, run_distributed

# ----------------------------------------------------------------- run_distributed

#: Long enough that a run which waited for it could not pass the bound below.
TIMEOUT: Final = 120.0


def _fail_while_the_other_sleeps(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails at once")
    time.sleep(10 * TIMEOUT)  # neither in a collective nor reporting: only killing ends it


def test_other_ranks_are_stopped_within_a_grace_period_after_one_failed() -> None:
    """The bound is half the timeout: far above the grace period (seconds, even under
    load), far below what a run that waited for the timeout takes."""
    started = time.monotonic()
    with pytest.raises(ValueError, match="rank one fails at once"):
        run_distributed(_fail_while_the_other_sleeps, 2, timeout=TIMEOUT)
    assert time.monotonic() - started < TIMEOUT / 2


# ----------------------------------------------------------------- check_api_invariants


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 12)
        self.second = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.second(torch.relu(self.first(x)))
        return out


def _inputs() -> tuple[Tensor]:
    return (torch.randn(5, 6),)


def _frozen_bias() -> Net:
    net = Net()
    net.second.bias.requires_grad_(False)
    return net


def _drop_gradient(parameter: Tensor) -> None:
    parameter.grad = None


@contract()
def dropping(module: nn.Module) -> None:
    """Drops ``second.bias``'s gradient after each backward (outputs unchanged)."""
    _torch.register_post_accumulate_grad_hook(module.get_parameter("second.bias"), _drop_gradient)


@contract()
def unfreezing(module: nn.Module) -> None:
    """Gives ``second.bias`` a gradient the model without the API does not have."""
    module.get_parameter("second.bias").requires_grad_(True)


def _double_gradient(grad: Tensor) -> Tensor:
    return grad * 2


@contract()
def scaling(module: nn.Module) -> None:
    """Doubles the first layer's weight gradient; the forward is untouched."""
    _torch.register_tensor_hook(module.get_parameter("first.weight"), _double_gradient)


def test_an_api_that_drops_a_gradient_fails() -> None:
    with pytest.raises(
        AssertionError, match=r"differ in which parameters have one: \['second.bias'\]"
    ):
        check_api_invariants(dropping, ModelCase(Net, _inputs))


def test_an_api_that_adds_a_gradient_fails() -> None:
    with pytest.raises(
        AssertionError, match=r"differ in which parameters have one: \['second.bias'\]"
    ):
        check_api_invariants(unfreezing, ModelCase(_frozen_bias, _inputs))


def test_a_dropped_or_added_gradient_is_reported_when_numerics_may_change() -> None:
    dropped = check_api_invariants(dropping, ModelCase(Net, _inputs, same_numerics=False))
    added = check_api_invariants(unfreezing, ModelCase(_frozen_bias, _inputs, same_numerics=False))
    assert dropped.unmatched_gradients == added.unmatched_gradients == ("second.bias",)


def test_an_api_that_changes_only_gradients_fails() -> None:
    with pytest.raises(AssertionError, match="scaling changed the gradients by"):
        check_api_invariants(scaling, ModelCase(Net, _inputs))


def test_a_gradient_change_is_measured_when_numerics_may_change() -> None:
    report = check_api_invariants(scaling, ModelCase(Net, _inputs, same_numerics=False))
    assert report.output_difference == 0
    assert report.gradient_difference > 0
