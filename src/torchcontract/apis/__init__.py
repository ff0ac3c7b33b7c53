"""Composable APIs built on the contract: data parallelism and activation checkpointing."""

from __future__ import annotations

from .checkpoint import CheckpointState, checkpoint
from .fully_shard import FullyShardState, fully_shard, fully_shard_no_sync, reshard, unshard
from .replicate import ReplicateState, no_sync, replicate

__all__ = [
    "CheckpointState",
    "FullyShardState",
    "ReplicateState",
    "checkpoint",
    "fully_shard",
    "fully_shard_no_sync",
    "no_sync",
    "replicate",
    "reshard",
    "unshard",
]
