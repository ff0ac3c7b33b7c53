"""Typing checks: a contract keeps the caller's class, as the reference APIs do.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from typing import TypeVar, assert_type

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchcontract import EmptyState, ModuleContract, ModuleListContract, contract
from torchcontract.apis import (
    CheckpointState,
    FullyShardAPI,
    FullyShardFunction,
    ReplicateState,
    checkpoint,
    fully_shard,
    replicate,
)

M = TypeVar("M", bound=nn.Module)


class TinyNet(nn.Module):
    pass


@contract()
def returns_none(module: nn.Module, *, depth: int = 0) -> None:
    pass


@contract()
def returns_it(module: M, *, depth: int = 0) -> M:
    return module


@contract()
def takes_lists(module: nn.Module | list[nn.Module], *, depth: int = 0) -> None:
    pass


net = TinyNet()
linear = nn.Linear(2, 2)

assert_type(returns_none(net), TinyNet)
assert_type(returns_none(linear, depth=2), nn.Linear)
assert_type(returns_it(net), TinyNet)
assert_type(returns_it(net, depth=1), TinyNet)
assert_type(takes_lists(net), TinyNet)
assert_type(takes_lists([linear, nn.Linear(3, 3)]), list[nn.Linear])

kept: TinyNet = returns_none(TinyNet())
none_api: ModuleContract[..., EmptyState] = returns_none
list_api: ModuleListContract[..., EmptyState] = takes_lists

returns_none([net])  # type: ignore[type-var]
returns_none(net, depth="2")  # type: ignore[arg-type]
returns_it(net, 1)  # type: ignore[call-arg]
takes_lists(net, depth=None)  # type: ignore[call-overload]
takes_lists((net,))  # type: ignore[call-overload]


@contract()
def takes_linear_lists(module: nn.Module | list[nn.Linear]) -> None:
    pass


assert_type(takes_linear_lists([linear]), list[nn.Linear])

# The reference APIs keep the caller's class too.
assert_type(replicate(net), TinyNet)
assert_type(checkpoint(net, use_reentrant=False), TinyNet)
assert_type(fully_shard(net), TinyNet)
assert_type(fully_shard([linear]), list[nn.Linear])
replicate([net])  # type: ignore[type-var]
checkpoint([net])  # type: ignore[type-var]

# Their static types are public names, for annotating variables and parameters.
sharding: FullyShardAPI = fully_shard
replicating: ModuleContract[..., ReplicateState] = replicate
checkpointing: ModuleContract[..., CheckpointState] = checkpoint

# __wrapped__ is the API function, typed with its options.
assert_type(fully_shard.__wrapped__, FullyShardFunction)
fully_shard.__wrapped__(net, reshard_after_forward=False)
fully_shard.__wrapped__(net, reshard_after_forward=None, mp_policy=MixedPrecisionPolicy())
fully_shard.__wrapped__(net, reshard_after_forward="yes")  # type: ignore[arg-type]
fully_shard.__wrapped__(net, param_dtype=torch.bfloat16)  # type: ignore[call-arg]
replicate.__wrapped__(net, bucket_cap_mb=1.0)
replicate.__wrapped__(net, bucket_cap_mb="1")  # type: ignore[arg-type]
checkpoint.__wrapped__(net, use_reentrant=True)
checkpoint.__wrapped__(net, use_reentrant=1.0)  # type: ignore[arg-type]
fully_shard.__wrapped__ = fully_shard.__wrapped__  # type: ignore[misc]
