"""Typing checks: the reference APIs' signatures and records.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from typing import assert_type

import torch.distributed as dist
from torch import nn

from torchcontract import Application
from torchcontract.apis import (
    CheckpointState,
    ModelMismatchError,
    ReplicateState,
    checkpoint,
    no_sync,
    rank_local,
    replicate,
)

model = nn.Linear(2, 2)

# A call returns the module it was given, typed as the caller typed it.
assert_type(replicate(model, bucket_cap_mb=1.0, broadcast_buffers=False), nn.Linear)
assert_type(replicate.state(model), ReplicateState)
assert_type(replicate.state(model).buckets, tuple[tuple[str, ...], ...])
assert_type(replicate.state(model).process_group, dist.ProcessGroup | None)
assert_type(replicate.application(model), Application[ReplicateState])
assert_type(checkpoint(model, use_reentrant=True), nn.Linear)
assert_type(checkpoint.state(model), CheckpointState)

with no_sync(model):
    pass
with rank_local(model):
    pass
assert_type(replicate.state(model).rank_local, bool)
assert issubclass(ModelMismatchError, RuntimeError)

replicate(model, broadcast_buffer=False)  # type: ignore[call-arg]
replicate(model, bucket_cap_mb="25")  # type: ignore[arg-type]
replicate(model, dist.group.WORLD)  # type: ignore[arg-type]
replicate(model, [0], None, 0, True, dist.group.WORLD)  # type: ignore[call-arg, arg-type]
replicate(model, [0], 0, 0, None, init_sync=True)
checkpoint(model, reentrant=True)  # type: ignore[call-arg]
checkpoint(model, use_reentrant="False")  # type: ignore[arg-type]
rank_local([model])  # type: ignore[arg-type]
