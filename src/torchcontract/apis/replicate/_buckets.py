"""Bucketing: which parameters are reduced together, and broadcasts in flat chunks.

As ``DistributedDataParallel``: buckets hold one device and dtype each. With
``find_unused_parameters=False`` (the default) or ``static_graph``, the buckets
until the rebuild are one per device and dtype, holding every parameter (DDP
cannot know the order gradients arrive in); the rebuild (``_rebuild``) then takes
the caps. With ``find_unused_parameters=True`` the caps hold from the start, and
under the default cap the bucket of the parameters defined first (launched last)
holds 1 MiB, the others ``bucket_cap_mb``. The reducer's buckets are DDP's
(``assign_buckets_as_ddp``: a bucket closes once it holds its cap). Broadcasts of
parameters and buffers go in DDP's chunks (``broadcast_chunks``): buckets by the
same rule, capped at DDP's ``broadcast_bucket_size``, in the order of their first
tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _compute_bucket_assignment_by_size

from .. import _torch

__all__ = [
    "BROADCAST_BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "assign_buckets_as_ddp",
    "broadcast_chunks",
    "broadcast_from",
    "broadcast_from_first_rank",
]

#: DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES``.
FIRST_BUCKET_BYTES: Final = 1024 * 1024


def assign_buckets_as_ddp(
    tensors: Sequence[Tensor], order: Iterable[int] | None, limits: Sequence[int]
) -> list[list[int]]:
    """DDP's ``_compute_bucket_assignment_by_size``, DDP's own function: indices in buckets.

    A bucket takes each tensor first and closes once it holds at least its cap (so
    it may exceed it by its last tensor). The caps of each kind's buckets are
    ``limits`` in turn, the last one repeated. Without ``order`` (DDP's first
    assignment), tensors are taken as given and the buckets sorted by their first
    index; with it (a rebuild), taken in that order, the buckets closed first, in the
    order they closed, then those left open in DDP's own order. Where a communication
    hook's result depends on the buckets, or on their order, they must be DDP's.
    """
    indices = [] if order is None else list(order)
    # As DDP's rebuild calls it: the tensors in the order taken, each beside its index.
    taken = list(tensors) if order is None else [tensors[index] for index in indices]
    buckets, _ = _compute_bucket_assignment_by_size(
        taken, list(limits), [False] * len(taken), indices
    )
    return [list(bucket) for bucket in buckets]


#: DDP's ``broadcast_bucket_size``, whatever ``bucket_cap_mb`` is: the largest chunk of
#: its broadcasts of parameters and buffers (at apply, before a forward, Join's last sync).
BROADCAST_BUCKET_BYTES: Final = 250 * 1024 * 1024


def broadcast_chunks(
    tensors: Sequence[Tensor], cap: int = BROADCAST_BUCKET_BYTES
) -> list[list[int]]:
    """The indices of ``tensors`` in the chunks DDP's ``_broadcast_coalesced`` sends.

    Its ``compute_bucket_assignment_by_size(tensors, {cap})``: per kind, a chunk
    closes once it holds at least ``cap`` bytes; chunks in the order of their first
    tensor.
    """
    return assign_buckets_as_ddp(tensors, None, (cap,))


def broadcast_from_first_rank(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` with the group's first rank's values, in flat chunks per kind."""
    broadcast_from(tensors, group, 0)


def broadcast_from(tensors: Sequence[Tensor], group: dist.ProcessGroup, source_rank: int) -> None:
    """Overwrite ``tensors`` with group rank ``source_rank``'s values, in flat chunks per kind.

    In ``broadcast_chunks``, as DDP's ``_broadcast_coalesced``.
    """
    if not tensors:
        return
    with torch.no_grad():
        for chunk in broadcast_chunks(tensors):
            members = [tensors[index] for index in chunk]
            flat = torch.cat([tensor.reshape(-1) for tensor in members])
            _torch.broadcast(flat, source_rank, group)
            values = torch.split(flat, [tensor.numel() for tensor in members])
            for tensor, value in zip(members, values, strict=True):
                tensor.copy_(value.view_as(tensor))
