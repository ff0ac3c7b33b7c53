"""shard() and offload(): a rule that reads another API's recorded arguments.

``offload`` cannot sit on, inside or around a module sharded with ``reshard=True``;
a ``reshard=False`` shard is fine. The rule holds in both application orders.
"""

from __future__ import annotations

import attrs
from torch import nn
from typing_extensions import ParamSpec

from torchcontract import Contract, Incompatible, RegistryEntry, contract

_P = ParamSpec("_P")


@attrs.frozen()
class ShardState:
    reshard: bool = True


@attrs.frozen()
class OffloadState:
    offloaded: bool = False


@contract(ShardState)
def shard(module: nn.Module, *, reshard: bool = True) -> None:
    """Record how ``module`` is sharded (a stand-in for real sharding)."""
    shard.set_state(module, ShardState(reshard))


def _reshards(entry: RegistryEntry[Contract[_P, object, ShardState]]) -> bool:
    # A def, not a lambda: under --disallow-any-expr mypy types a lambda passed to
    # Incompatible's overloaded constructor as Any. Generic in _P rather than ``...``,
    # which is Any there too. Recorded arguments are objects: compare, do not trust
    # their type.
    return entry.arguments["reshard"] is True


@contract(OffloadState, incompatible_with=[Incompatible(shard, when=_reshards)])
def offload(module: nn.Module) -> None:
    """Mark ``module`` offloaded; refused next to a resharding ``shard``."""
    offload.set_state(module, OffloadState(offloaded=True))
