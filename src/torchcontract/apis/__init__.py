"""Composable APIs built on the contract: data parallelism and activation checkpointing."""

from __future__ import annotations

from .checkpoint import CheckpointState, checkpoint
from .replicate import ReplicateState, no_sync, replicate

__all__ = ["CheckpointState", "ReplicateState", "checkpoint", "no_sync", "replicate"]
