"""Typing checks: registry entries, rules and stores.

Checked, never run: by mypy (warn_unused_ignores) and basedpyright (strict, and the
directive below), so a line marked as an error that stops being one fails the check.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=error

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, assert_type

from torch import nn

from torchcontract import (
    Contract,
    Incompatible,
    RegistryEntry,
    StateStore,
    TorchAPIName,
    contract,
    describe,
    registry,
    torch_registry,
)


@contract(store=StateStore())
def checkpointing(module: nn.Module, *, use_reentrant: bool = True) -> None:
    pass


def reentrant(entry: RegistryEntry) -> bool:
    return bool(entry.arguments["use_reentrant"])


@contract(incompatible_with=[Incompatible(checkpointing, when=reentrant)])
def sharding(module: nn.Module) -> None:
    pass


model = nn.Linear(2, 2)
entries = registry(model)

assert_type(entries, Mapping[Contract[..., Any, Any], RegistryEntry])
assert_type(entries[sharding].api, Contract[..., Any, Any])
assert_type(entries[sharding].args, tuple[Any, ...])
assert_type(entries[sharding].kwargs, Mapping[str, Any])
assert_type(entries[sharding].arguments, Mapping[str, Any])
assert_type(torch_registry(model), Mapping[str, object])
assert_type(describe(model), str)
assert_type(len(StateStore()), int)

entries[sharding] = entries[checkpointing]  # type: ignore[index]
Incompatible(checkpointing, scope="subtree")  # type: ignore[arg-type]
Incompatible(checkpointing, when=lambda entry: entry.missing)  # type: ignore[attr-defined]
Incompatible(model)  # type: ignore[arg-type]
# torch APIs are named by the names torch registers them under; a misspelt one is an error.
Incompatible("fully_shard")
Incompatible("checkpiont")  # type: ignore[arg-type]
name: TorchAPIName = "replicate"
Incompatible(name, scope="module")


def rule_for(unknown: str) -> Incompatible:
    return Incompatible(unknown)  # type: ignore[arg-type]


contract(store={})  # type: ignore[call-overload]
