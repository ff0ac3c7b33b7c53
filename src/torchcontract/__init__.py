"""torchcontract: typed composable-API contracts with an explicit, immutable state store."""

from __future__ import annotations

from typing import Final

from ._api_types import AnyContract, Incompatible, RegistryEntry, RuleScope, TorchAPIName
from ._contract import Contract, ModuleContract, ModuleListContract, ModuleSequenceContract
from ._decorator import ContractDecorator, EmptyState, contract
from ._describe import describe
from ._errors import (
    AllGatherExtensionError,
    AlreadyAppliedError,
    AlreadyManagedError,
    ArgumentBindingError,
    ContractError,
    CyclicModuleTreeError,
    FQNChangedError,
    GraphChangedError,
    IncompatibleAPIError,
    InvalidMeshError,
    InvalidRecordError,
    InvalidResultError,
    InvalidShardDimError,
    InvalidStateClassError,
    InvalidTargetError,
    LateGradientError,
    NoProcessGroupError,
    NotAppliedError,
    ReplacedParameterError,
    RulePredicateError,
    ScalarParameterError,
    UnfinishedBackwardError,
    UnknownRuleScopeError,
    UnknownTorchAPIError,
    UnmaterializedParameterError,
    UnnamedMeshError,
    UnusedParameterError,
)
from ._export import exported_from
from ._fqn import FQNSnapshot, take_snapshot
from ._labels import module_label
from ._registry import registry, torch_registry
from ._state_access import Application
from ._store import StateStore
from ._transaction import on_rollback
from ._tree import named_tree, root_modules

#: The version, in one place: the packaging metadata reads it from here, and the
#: changelog's newest section names it (a ``.devN`` version while that section is unreleased).
__version__: Final = "0.2.0.dev0"

__all__ = [
    "AllGatherExtensionError",
    "AlreadyAppliedError",
    "AlreadyManagedError",
    "AnyContract",
    "Application",
    "ArgumentBindingError",
    "Contract",
    "ContractDecorator",
    "ContractError",
    "CyclicModuleTreeError",
    "EmptyState",
    "FQNChangedError",
    "FQNSnapshot",
    "GraphChangedError",
    "Incompatible",
    "IncompatibleAPIError",
    "InvalidMeshError",
    "InvalidRecordError",
    "InvalidResultError",
    "InvalidShardDimError",
    "InvalidStateClassError",
    "InvalidTargetError",
    "LateGradientError",
    "ModuleContract",
    "ModuleListContract",
    "ModuleSequenceContract",
    "NoProcessGroupError",
    "NotAppliedError",
    "RegistryEntry",
    "ReplacedParameterError",
    "RulePredicateError",
    "RuleScope",
    "ScalarParameterError",
    "StateStore",
    "TorchAPIName",
    "UnfinishedBackwardError",
    "UnknownRuleScopeError",
    "UnknownTorchAPIError",
    "UnmaterializedParameterError",
    "UnnamedMeshError",
    "UnusedParameterError",
    "contract",
    "describe",
    "exported_from",
    "module_label",
    "named_tree",
    "on_rollback",
    "registry",
    "root_modules",
    "take_snapshot",
    "torch_registry",
]
