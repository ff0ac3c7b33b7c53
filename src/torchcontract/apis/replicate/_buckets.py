"""Bucketing: which parameters are reduced together, and broadcasts in flat chunks.

As ``DistributedDataParallel``: buckets hold one device and dtype each and up to
``bucket_cap_mb``; under the default cap, the bucket launched last (the
parameters defined first, whose gradients arrive last) holds at most 1 MiB, so
that little is left to reduce once the backward ends; a parameter larger than a
cap gets a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _torch

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "FIRST_BUCKET_BYTES",
    "assign_buckets",
    "broadcast_from_first_rank",
    "launch_buckets",
]

#: DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket's cap under the default cap.
FIRST_BUCKET_BYTES: Final = 1024 * 1024
#: DDP's cap when ``bucket_cap_mb`` is None.
DEFAULT_BUCKET_CAP_MB: Final = 25

_Kind = tuple[torch.device, torch.dtype]


def assign_buckets(
    tensors: Sequence[Tensor], order: Iterable[int], first_cap: int, cap: int
) -> list[list[int]]:
    """Split the indices of ``tensors``, taken in ``order``, into buckets, in that order.

    The first bucket of each device and dtype is capped at ``first_cap``, the others at ``cap``.
    """
    buckets: list[list[int]] = []
    # Per kind: the open bucket, its bytes so far, and its cap (first_cap for the first).
    open_buckets: dict[_Kind, tuple[list[int], int, int]] = {}
    for index in order:
        tensor = tensors[index]
        kind = (tensor.device, tensor.dtype)
        size = tensor.numel() * tensor.element_size()
        bucket, used, limit = open_buckets.get(kind, ([], 0, first_cap))
        if bucket and used + size > limit:
            bucket, used, limit = [], 0, cap
        if not bucket:
            buckets.append(bucket)
        bucket.append(index)
        open_buckets[kind] = (bucket, used + size, limit)
    return buckets


def launch_buckets(
    tensors: Sequence[Tensor], launch_order: Sequence[int], last_cap: int, cap: int
) -> list[list[int]]:
    """DDP's buckets for gradients arriving in ``launch_order``, in that order.

    DDP's own assignment (``_torch.bucket_assignment``) over the reverse of the
    launch order (the definition order, before a rebuild), reversed back: a bucket
    closes once it reaches its cap, and the one capped at ``last_cap`` is launched last.
    """
    order = list(reversed(launch_order))
    limits = [last_cap, cap] if last_cap < cap else [cap]
    filled = _torch.bucket_assignment([tensors[index] for index in order], limits)
    return [[order[position] for position in reversed(bucket)] for bucket in reversed(filled)]


def broadcast_from_first_rank(
    tensors: Sequence[Tensor], group: dist.ProcessGroup, cap_bytes: int
) -> None:
    """Overwrite ``tensors`` with the group's first rank's values, in flat chunks per kind."""
    if not tensors:
        return
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for chunk in assign_buckets(tensors, range(len(tensors)), cap_bytes, cap_bytes):
            members = [tensors[index] for index in chunk]
            flat = torch.cat([tensor.reshape(-1) for tensor in members])
            _torch.broadcast(flat, source, group)
            values = torch.split(flat, [tensor.numel() for tensor in members])
            for tensor, value in zip(members, values, strict=True):
                tensor.copy_(value.view_as(tensor))
