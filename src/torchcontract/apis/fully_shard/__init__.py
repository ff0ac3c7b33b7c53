"""fully_shard(): sharded data parallelism on the contract, at parity with PyTorch's FSDP2."""

from __future__ import annotations

from ._api import FullyShardAPI, FullyShardFunction, fully_shard, reshard, unshard
from ._comms import AllGatherComm, ReduceScatterComm
from ._module import FullyShardModule
from ._prefetch import (
    set_implicit_prefetch,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
)
from ._state import FullyShardState
from ._torch_state import UnsupportedTorchStateError

__all__ = [
    "AllGatherComm",
    "FullyShardAPI",
    "FullyShardFunction",
    "FullyShardModule",
    "FullyShardState",
    "ReduceScatterComm",
    "UnsupportedTorchStateError",
    "fully_shard",
    "reshard",
    "set_implicit_prefetch",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "unshard",
]
