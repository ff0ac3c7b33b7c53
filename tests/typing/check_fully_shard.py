"""Typing checks: fully_shard's signature, its record, and its helpers.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, assert_type

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)
from torch.distributed.tensor import Shard

from torchcontract import Contract
from torchcontract.apis import FullyShardState, fully_shard, no_sync, reshard, unshard

model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
mesh: DeviceMesh = DeviceMesh("cpu", [0])

# A call returns the module, or the list of modules, it was given, with its type.
linear = nn.Linear(2, 2)
assert_type(fully_shard(model), nn.Sequential)
assert_type(fully_shard(linear, mesh=mesh), nn.Linear)
assert_type(fully_shard([linear, nn.Linear(2, 2)], mesh=mesh), list[nn.Linear])
modules: list[nn.Module] = [linear, model]
assert_type(fully_shard(modules, mesh=mesh), list[nn.Module])
# reshard_after_forward takes FSDP2's bool, int (a world size) or None.
assert_type(fully_shard(nn.Linear(2, 2), reshard_after_forward=False), nn.Linear)
assert_type(fully_shard(nn.Linear(2, 2), reshard_after_forward=1), nn.Linear)
assert_type(
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=None,
        shard_placement_fn=lambda parameter: Shard(0),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(),
        ignored_params=set(linear.parameters()),
        dp_mesh_dims=None,
    ),
    nn.Sequential,
)
# It is the contract: rules, state access and testing helpers take it as one.
api: Contract[..., Any, FullyShardState] = fully_shard

# Options are keyword-only and typed.


def _dim(parameter: nn.Parameter) -> int:
    return 0


fully_shard(model, mesh)  # type: ignore[call-overload]
fully_shard(model, mesh="cpu")  # type: ignore[call-overload]
fully_shard(model, param_dtype=torch.bfloat16)  # type: ignore[call-overload]
fully_shard(model, mp_policy=torch.bfloat16)  # type: ignore[call-overload]
fully_shard(model, offload_policy=True)  # type: ignore[call-overload]
fully_shard(model, ignored_params=list(linear.parameters()))  # type: ignore[call-overload]
fully_shard(model, shard_placement_fn=_dim)  # type: ignore[arg-type]
fully_shard(model, reshard_after_forward="yes")  # type: ignore[call-overload]
fully_shard(model, process_group=None)  # type: ignore[call-overload]
fully_shard((model, model))  # type: ignore[call-overload]
fully_shard("model")  # type: ignore[call-overload]

# The record is typed field by field, and frozen.
record = fully_shard.state(model)
assert_type(record, FullyShardState)
assert_type(record.mesh, DeviceMesh | None)
assert_type(record.managed, tuple[str, ...])
assert_type(record.reshard_after_forward, bool | None)
assert_type(record.mp_policy, MixedPrecisionPolicy)
assert_type(record.offload_policy, OffloadPolicy)
assert_type(record.ignored, tuple[str, ...])
assert_type(record.reshard_after_backward, bool)
assert_type(record.gradient_divide_factor, float | None)
assert_type(record.forwards, int)
assert_type(record.backwards, int)
assert_type(record.sync_gradients, bool)
assert_type(fully_shard.get_state(model), FullyShardState | None)
record.forwards = 2  # type: ignore[misc]
FullyShardState(managed=["weight"])  # type: ignore[arg-type]

# The helpers take one module.
assert_type(unshard(model), None)
assert_type(unshard(model, async_op=False), None)
assert_type(unshard(model, async_op=True), UnshardHandle)  # as FSDPModule.unshard
flag: bool = bool(len(model))
assert_type(unshard(model, async_op=flag), UnshardHandle | None)
assert_type(reshard(model), None)
no_sync_context: AbstractContextManager[None] = no_sync(model)
unshard([model])  # type: ignore[call-overload]
