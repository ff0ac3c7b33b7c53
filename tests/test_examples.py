"""The typed extension under examples/ runs as its docstrings say."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from typed_extension import (
    AdapterState,
    FreezeState,
    ScaleState,
    ShardState,
    adapted_output,
    adapter,
    freeze,
    frozen_names,
    offload,
    shard,
    share_scale,
)

from torchcontract import IncompatibleAPIError, NotAppliedError, registry


def test_freeze_turns_off_gradients_and_records_the_names() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[1].bias.requires_grad_(False)
    freeze(model)
    assert not any(parameter.requires_grad for parameter in model.parameters())
    assert freeze.state(model) == FreezeState(("0.weight", "0.bias", "1.weight"))
    assert frozen_names(freeze, model) == ("0.weight", "0.bias", "1.weight")
    assert frozen_names(freeze, model[0]) == ()


def test_adapter_adds_its_low_rank_output_and_keeps_the_fqns() -> None:
    layer = nn.Linear(4, 3)
    names = [name for name, _ in layer.named_parameters()]
    adapter(layer, rank=2, alpha=4.0)
    record = adapter.state(layer)
    assert (record.rank, record.scale) == (2, 2.0)
    assert [name for name, _ in layer.named_parameters()] == names
    inputs = torch.randn(5, 4)
    plain = torch.nn.functional.linear(inputs, layer.weight, layer.bias)
    torch.testing.assert_close(layer(inputs), plain)  # up starts at zero
    assert record.up is not None
    adapter.set_state(layer, AdapterState(2, 2.0, record.down, torch.ones_like(record.up)))
    expected = plain + adapted_output(adapter.state(layer), inputs)
    torch.testing.assert_close(layer(inputs), expected)
    assert not torch.equal(expected, plain)


def test_adapter_refuses_a_rank_below_one_and_installs_nothing() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="rank must be at least 1"):
        adapter(layer, rank=0)
    with pytest.raises(NotAppliedError):
        adapter.entry(layer)


def test_share_scale_gives_the_roots_one_record() -> None:
    blocks = [nn.Linear(2, 2) for _ in range(3)]
    share_scale(blocks[:2], factor=0.5)
    assert share_scale.state(blocks[1]) == ScaleState(0.5, 2)
    assert share_scale.get_state(blocks[2]) is None


def test_offload_is_refused_next_to_a_resharding_shard_only() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    shard(model[0], reshard=False)
    offload(model)
    assert shard.entry(model[0]).api.state(model[0]) == ShardState(reshard=False)
    with pytest.raises(IncompatibleAPIError, match="cannot be combined with"):
        shard(model[1])
    assert list(registry(model[1])) == []
