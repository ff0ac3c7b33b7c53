"""The replicate rule: no reentrant checkpoint on the same or nested modules, in either order.

Runs in this process on a one-rank gloo group; tests/distributed checks the same
on two ranks.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed._composable.replicate import replicate as torch_replicate

from torchcontract import IncompatibleAPIError, registry
from torchcontract.apis import checkpoint, replicate

pytestmark = pytest.mark.usefixtures("one_rank_group")


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)


def test_reentrant_checkpoint_then_replicate_on_same_module_fails() -> None:
    model = Model()
    checkpoint(model, use_reentrant=True)
    with pytest.raises(IncompatibleAPIError) as caught:
        replicate(model)
    message = str(caught.value)
    assert "torchcontract.apis.replicate.replicate" in message
    assert "torchcontract.apis.checkpoint.checkpoint" in message
    assert "same module, Model" in message


def test_replicate_then_reentrant_checkpoint_on_same_module_fails() -> None:
    model = Model()
    replicate(model)
    with pytest.raises(IncompatibleAPIError) as caught:
        checkpoint(model, use_reentrant=True)
    message = str(caught.value)
    assert "checkpoint.checkpoint cannot be combined with torchcontract.apis.replicate" in message
    assert "same module, Model" in message


def test_reentrant_checkpoint_inside_then_replicate_around_fails() -> None:
    model = Model()
    checkpoint(model.encoder, use_reentrant=True)
    with pytest.raises(IncompatibleAPIError) as caught:
        replicate(model)
    message = str(caught.value)
    assert "replicate.replicate cannot be combined with torchcontract.apis.checkpoint" in message
    assert "already applied on Sequential 'encoder', inside Model" in message


def test_replicate_around_then_reentrant_checkpoint_inside_fails() -> None:
    model = Model()
    replicate(model)
    with pytest.raises(IncompatibleAPIError) as caught:
        checkpoint(model.encoder, use_reentrant=True)
    message = str(caught.value)
    assert "checkpoint.checkpoint cannot be combined with torchcontract.apis.replicate" in message
    assert "on Model, which contains Sequential 'encoder' of Model" in message


def test_rejected_apply_installs_nothing() -> None:
    model = Model()
    replicate(model)
    with pytest.raises(IncompatibleAPIError):
        checkpoint(model.encoder, use_reentrant=True)
    assert not checkpoint.is_applied(model.encoder)
    assert dict(registry(model.encoder)) == {}
    assert not model.encoder._forward_pre_hooks


def test_replicate_after_nonreentrant_checkpoint_is_allowed() -> None:
    model = Model()
    checkpoint(model.encoder, use_reentrant=False)
    replicate(model)
    assert list(registry(model)) == [replicate]
    assert list(registry(model.encoder)) == [checkpoint]


def test_nonreentrant_checkpoint_after_replicate_is_allowed() -> None:
    model = Model()
    replicate(model)
    checkpoint(model.encoder)
    checkpoint(model)
    assert list(registry(model)) == [replicate, checkpoint]


def test_reentrant_checkpoint_beside_replicate_in_another_subtree_is_allowed() -> None:
    model = Model()
    checkpoint(model.encoder, use_reentrant=True)
    replicate(model.head)
    assert replicate.is_applied(model.head)


def test_torch_replicate_inside_then_ours_around_fails() -> None:
    model = Model()
    torch_replicate(model.head)
    with pytest.raises(IncompatibleAPIError) as caught:
        replicate(model)
    message = str(caught.value)
    assert "replicate.replicate cannot be combined with torch's replicate" in message
    # torch's replicate swaps the class for a subclass named DDP<class>.
    assert "already applied on DDPLinear 'head', inside Model" in message
