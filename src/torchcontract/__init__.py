"""torchcontract: typed composable-API contracts with an explicit, immutable state store."""

from __future__ import annotations

from ._contract import AnyContract, Application, Contract, EmptyState, contract
from ._describe import describe
from ._errors import (
    AlreadyAppliedError,
    AlreadyManagedError,
    ArgumentBindingError,
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
    RulePredicateError,
    UnknownTorchAPIError,
    UnmaterializedParameterError,
)
from ._fqn import FQNSnapshot, take_snapshot
from ._registry import (
    Incompatible,
    RegistryEntry,
    RuleScope,
    TorchAPIName,
    registry,
    torch_registry,
)
from ._store import StateStore

__all__ = [
    "AlreadyAppliedError",
    "AlreadyManagedError",
    "AnyContract",
    "Application",
    "ArgumentBindingError",
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
    "RulePredicateError",
    "RuleScope",
    "StateStore",
    "TorchAPIName",
    "UnknownTorchAPIError",
    "UnmaterializedParameterError",
    "contract",
    "describe",
    "registry",
    "take_snapshot",
    "torch_registry",
]
