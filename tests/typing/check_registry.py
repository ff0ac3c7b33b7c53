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
    AnyContract,
    Contract,
    EmptyState,
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

assert_type(entries, Mapping[AnyContract, RegistryEntry])
assert_type(entries[sharding].api, AnyContract)
assert_type(entries[sharding].args, tuple[Any, ...])
assert_type(entries[sharding].kwargs, Mapping[str, Any])
assert_type(entries[sharding].arguments, Mapping[str, object])
assert_type(torch_registry(model), Mapping[str, object])
assert_type(describe(model), str)
assert_type(len(StateStore()), int)

entries[sharding] = entries[checkpointing]  # type: ignore[index]
Incompatible(checkpointing, scope="subtree")  # type: ignore[call-overload]
Incompatible(checkpointing, when=lambda entry: entry.missing)  # type: ignore[attr-defined]
Incompatible(model)  # type: ignore[call-overload]
# torch APIs are named by the names torch registers them under; a misspelt one is an error.
Incompatible("fully_shard")
Incompatible("checkpiont")  # type: ignore[call-overload]
name: TorchAPIName = "replicate"
Incompatible(name, scope="module")
# torch records no arguments: a rule on a torch API takes no when=.
Incompatible("checkpoint", when=reentrant)  # type: ignore[call-overload]


def rule_for(unknown: str) -> None:
    Incompatible(unknown)  # type: ignore[call-overload]


# when= is checked against the other contract's entry: its api is that contract.
def reads_records(entry: RegistryEntry[Contract[..., object, EmptyState]]) -> bool:
    return entry.api.state(model) == EmptyState()


def reads_other_records(entry: RegistryEntry[Contract[..., object, int]]) -> bool:
    return entry.api.state(model) == 0


Incompatible(checkpointing, when=reads_records)
Incompatible(checkpointing, when=reads_other_records)  # type: ignore[arg-type]
Incompatible(checkpointing, when=lambda entry: entry.api.state(model) == EmptyState())
Incompatible(checkpointing, when=lambda entry: entry.api(model, use_reentrnt=True) is model)  # type: ignore[call-arg]
rules: list[Incompatible] = [
    Incompatible(checkpointing, when=reads_records),
    Incompatible("replicate"),
]


contract(store={})  # type: ignore[call-overload]
