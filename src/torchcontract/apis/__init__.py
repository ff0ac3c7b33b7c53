"""Composable APIs on the contract: data parallelism, sharding, activation checkpointing."""

from __future__ import annotations

from ._no_sync import no_sync
from .checkpoint import CheckpointState, checkpoint
from .fully_shard import (
    FullyShardAPI,
    FullyShardFunction,
    FullyShardState,
    fully_shard,
    reshard,
    unshard,
)
from .replicate import ModelMismatchError, ReplicateState, rank_local, replicate

__all__ = [
    "CheckpointState",
    "FullyShardAPI",
    "FullyShardFunction",
    "FullyShardState",
    "ModelMismatchError",
    "ReplicateState",
    "checkpoint",
    "fully_shard",
    "no_sync",
    "rank_local",
    "replicate",
    "reshard",
    "unshard",
]
