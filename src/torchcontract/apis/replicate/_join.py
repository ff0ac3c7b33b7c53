"""The Join hook of a replicated module: DDP's ``_DDPJoinHook``, on our reducer.

Under ``torch.distributed.algorithms.Join``, a rank whose inputs ran out calls
``main_hook`` once per iteration the others still run, which meets their
collectives: the rebuilt buckets' broadcasts, the buffer broadcast (from the last
rank not joined), whether a synchronizing backward follows, and then its all-reduces
with zeros (``Reducer.shadow_backward``). At the end every rank calls ``post_hook``,
and all take the model of the last rank to join.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.join import JoinHook

from .. import _torch
from ._buckets import broadcast_from
from ._forward import broadcast_buffers, common_rank, will_broadcast_buffers
from ._ignored import kept_buffers, kept_parameters
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
        reducer, module = self._reducer, self._module
        record = reducer.record(module)
        if record is None:
            return
        reducer.rebuild_if_due(module)  # where the others rebuild at their forward
        if will_broadcast_buffers(reducer, record):
            broadcast_buffers(reducer, module, common_rank(reducer, False))
        flags = torch.zeros(2, device=reducer.device)
        _torch.all_reduce(flags, reducer.group).wait()
        broadcasts, synchronizes = _torch.to_bools(flags > 0)  # one read
        reducer.sync_buffers_next_forward = broadcasts
        if not synchronizes:
            return
        reducer.shadow_backward(module)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Take the parameters (and buffers) of the last rank to join."""
        reducer, module = self._reducer, self._module
        record = reducer.record(module)
        if record is None:
            return
        source = common_rank(reducer, is_last_joiner)
        tensors: list[Tensor] = [p for _, p in kept_parameters(module, reducer.ignored)]
        if record.broadcast_buffers:
            tensors.extend(kept_buffers(module, reducer.ignored))
        broadcast_from(tensors, reducer.group, source)
