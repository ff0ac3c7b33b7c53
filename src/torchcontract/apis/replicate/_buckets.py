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

_Kind = tuple[torch.device, torch.dtype]


def assign_buckets_as_ddp(
    tensors: Sequence[Tensor], order: Iterable[int], limits: Sequence[int]
) -> list[list[int]]:
    """DDP's ``_compute_bucket_assignment_by_size``: the indices of ``tensors`` in buckets.

    A bucket takes each tensor first and closes once it holds at least its cap (so
    it may exceed it by its last tensor). The caps of
    each kind's buckets are ``limits`` in turn, the last one repeated. The buckets
    closed come first, in the order they closed, then those left open, in the
    order they opened. Where a communication hook's result depends on the
    buckets, they must be DDP's.
    """
    buckets: list[list[int]] = []
    # Per kind: the open bucket, its bytes so far, and the position of its cap in limits.
    open_buckets: dict[_Kind, tuple[list[int], int, int]] = {}
    opened: list[list[int]] = []
    for index in order:
        tensor = tensors[index]
        kind = (tensor.device, tensor.dtype)
        bucket, used, position = open_buckets.get(kind, ([], 0, 0))
        if not bucket:
            opened.append(bucket)
        bucket.append(index)
        used += tensor.numel() * tensor.element_size()
        if used >= limits[position]:
            buckets.append(bucket)
            opened = [other for other in opened if other is not bucket]
            open_buckets[kind] = ([], 0, min(position + 1, len(limits) - 1))
        else:
            open_buckets[kind] = (bucket, used, position)
    return buckets + opened


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
    return sorted(assign_buckets_as_ddp(tensors, range(len(tensors)), (cap,)), key=min)


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
