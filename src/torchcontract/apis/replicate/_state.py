"""ReplicateState: the frozen record of ``replicate`` on a module."""

from __future__ import annotations

import attrs
import torch.distributed as dist

__all__ = ["ReplicateState"]


def _group_repr(group: dist.ProcessGroup | None) -> str:
    if group is None:
        return "None"
    return f"<ProcessGroup {group.name()} rank {group.rank()} of {group.size()}>"


@attrs.frozen
class ReplicateState:
    """The record of ``replicate`` on a module.

    The runtime bookkeeping (bucket buffers, used parameters, pending collectives)
    lives in a reducer that only the hooks hold, not here.

    Attributes:
        process_group: The group gradients are averaged over.
        buckets: The FQNs of the parameters reduced together, in launch order: DDP's
            (rebuilt once in the order gradients arrived, with
            ``find_unused_parameters=False`` or ``static_graph``).
        broadcast_buffers: Whether rank 0's buffers are copied to every rank before
            each forward that follows a synchronized one, as
            ``DistributedDataParallel`` does.
        step: The number of synchronized backward passes.
        sync_gradients: False while forwards build graphs whose backward only
            accumulates locally (see ``no_sync``).
        rank_local: True while forwards run on this rank alone, with no collective
            (see ``rank_local``).
    """

    process_group: dist.ProcessGroup | None = attrs.field(default=None, repr=_group_repr)
    buckets: tuple[tuple[str, ...], ...] = ()
    broadcast_buffers: bool = True
    step: int = 0
    sync_gradients: bool = True
    rank_local: bool = False
