"""A strictly typed extension package written on torchcontract's public API alone.

No casts and no ``type: ignore``; ``make test`` checks it with mypy ``--strict``
(also with ``--disallow-any-expr``) and basedpyright strict, and runs it
(``tests/test_examples.py``):

- ``freeze``: turns off the gradients of a module's parameters, recording their FQNs;
- ``adapter``: a LoRA-style low-rank adapter on an ``nn.Linear``, its weights in a
  frozen record (so the module's FQNs stay as they were);
- ``share_scale``: a list API whose roots share one record;
- ``shard`` and ``offload``: ``offload`` declares a rule reading ``shard``'s recorded
  ``reshard`` argument.
"""

from __future__ import annotations

from ._adapter import AdapterState, adapted_output, adapter
from ._freeze import FreezeState, freeze, frozen_names
from ._lists import ScaleState, share_scale
from ._rules import OffloadState, ShardState, offload, shard

__all__ = [
    "AdapterState",
    "FreezeState",
    "OffloadState",
    "ScaleState",
    "ShardState",
    "adapted_output",
    "adapter",
    "freeze",
    "frozen_names",
    "offload",
    "shard",
    "share_scale",
]
