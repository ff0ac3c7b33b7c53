"""fully_shard(): sharded data parallelism on the contract, at parity with PyTorch's FSDP2."""

from __future__ import annotations

from ._api import FullyShardAPI, FullyShardFunction, fully_shard, reshard, unshard
from ._module import FullyShardModule
from ._prefetch import (
    set_implicit_prefetch,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
)
from ._state import FullyShardState

__all__ = [
    "FullyShardAPI",
    "FullyShardFunction",
    "FullyShardModule",
    "FullyShardState",
    "fully_shard",
    "reshard",
    "set_implicit_prefetch",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "unshard",
]
