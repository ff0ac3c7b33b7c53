"""torchcontract: typed composable-API contracts with an explicit, immutable state store."""

from __future__ import annotations

from ._contract import Application, Contract, EmptyState, contract
from ._describe import describe
from ._errors import (
    AlreadyAppliedError,
    AlreadyManagedError,
    ContractError,
    CyclicModuleTreeError,
    FQNChangedError,
    IncompatibleAPIError,
    InvalidMeshError,
    InvalidRecordError,
    InvalidResultError,
    InvalidStateClassError,
    InvalidTargetError,
    NotAppliedError,
)
from ._fqn import FQNSnapshot, take_snapshot
from ._registry import Incompatible, RegistryEntry, registry, torch_registry
from ._store import StateStore

__all__ = [
    "AlreadyAppliedError",
    "AlreadyManagedError",
    "Application",
    "Contract",
    "ContractError",
    "CyclicModuleTreeError",
    "EmptyState",
    "FQNChangedError",
    "FQNSnapshot",
    "Incompatible",
    "IncompatibleAPIError",
    "InvalidMeshError",
    "InvalidRecordError",
    "InvalidResultError",
    "InvalidStateClassError",
    "InvalidTargetError",
    "NotAppliedError",
    "RegistryEntry",
    "StateStore",
    "contract",
    "describe",
    "registry",
    "take_snapshot",
    "torch_registry",
]
