"""fully_shard(): sharded data parallelism on the contract, at parity with PyTorch's FSDP2."""

from __future__ import annotations

from ._api import fully_shard, reshard, unshard
from ._state import FullyShardState

__all__ = ["FullyShardState", "fully_shard", "reshard", "unshard"]
