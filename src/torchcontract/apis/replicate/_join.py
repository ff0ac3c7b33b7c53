"""The Join hook of a replicated module: DDP's ``_DDPJoinHook``, on our reducer.

Under ``torch.distributed.algorithms.Join``, a rank whose inputs ran out calls
``main_hook`` once per iteration the others still run, which meets their
collectives with zeros (``Reducer.shadow``); at the end every rank calls
``post_hook``, and all take the model of the last rank to join.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms.join import JoinHook

from ._reducer import Reducer

__all__ = ["ReplicateJoinHook"]


class ReplicateJoinHook(JoinHook):
    """Shadows the forward and backward collectives of the ranks not joined; then syncs the model.

    ``divide_by_initial_world_size``: as DDP's, averages divide by the group's
    size (True, the default: joined ranks count, with zeros) or by the number of
    ranks not joined (False).
    """

    def __init__(
        self, reducer: Reducer, module: nn.Module, *, divide_by_initial_world_size: bool
    ) -> None:
        self._reducer = reducer
        self._module = module
        reducer.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Meet one forward and backward of the ranks not joined."""
        self._reducer.shadow(self._module)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Take the parameters (and buffers) of the last rank to join."""
        self._reducer.sync_final_model(self._module, is_last_joiner)
