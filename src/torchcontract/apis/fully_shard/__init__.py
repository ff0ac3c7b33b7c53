"""fully_shard(): sharded data parallelism on the contract, at parity with PyTorch's FSDP2."""

from __future__ import annotations

from ._api import fully_shard, fully_shard_no_sync, reshard, unshard
from ._state import FullyShardState

__all__ = ["FullyShardState", "fully_shard", "fully_shard_no_sync", "reshard", "unshard"]
