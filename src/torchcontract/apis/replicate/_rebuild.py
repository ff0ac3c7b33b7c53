"""DDP's bucket caps, and the rebuild: the buckets made anew in the order gradients arrived.

The first assignment takes ``first_limits``; once rebuilt (after the first
synchronizing backward, or the second with ``static_graph``, and only where DDP
rebuilds), the buckets follow the order gradients arrived in, with ``limits``: the
first rank's buckets, which ``first_ranks_buckets`` sends to the others.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _torch
from ._buckets import FIRST_BUCKET_BYTES

__all__ = ["first_limits", "first_ranks_buckets", "limits"]


def first_limits(
    cap_list: tuple[int, ...], rebuilds: bool, default_cap: bool, cap_bytes: int
) -> tuple[int, ...]:
    """DDP's caps for the first assignment (``compute_bucket_size_limits``).

    The list given; else one bucket per kind where DDP rebuilds them later (it
    cannot know the order gradients arrive in); else the rebuild's caps.
    """
    if cap_list:
        return cap_list
    if rebuilds:
        return (sys.maxsize,)
    return limits(cap_list, default_cap, cap_bytes)


def limits(cap_list: tuple[int, ...], default_cap: bool, cap_bytes: int) -> tuple[int, ...]:
    """DDP's bucket caps: the list given, or 1 MiB then the cap (the default cap only)."""
    if cap_list:
        return cap_list
    if default_cap:
        return (FIRST_BUCKET_BYTES, cap_bytes)
    return (cap_bytes,)


def first_ranks_buckets(
    buckets: Sequence[Sequence[int]], group: dist.ProcessGroup, device: torch.device
) -> list[list[int]]:
    """The first rank's ``buckets`` (parameter indices), on every rank of ``group``.

    DDP's ``sync_bucket_indices``: two broadcasts of int32 on ``device``, the
    parameters' (an NCCL group broadcasts only there): every index, bucket by bucket,
    then the number of buckets; then each bucket's length. Nothing is sent on a group
    of one.
    """
    if group.size() == 1:
        return [list(bucket) for bucket in buckets]
    lengths = [len(bucket) for bucket in buckets]
    flat = [index for bucket in buckets for index in bucket]
    indices = _torch.host_values_on([*flat, len(buckets)], torch.int32, device)
    _torch.broadcast(indices, 0, group)
    *flat, count = _torch.to_ints(indices)
    # A rank with fewer buckets than the first fills the rest with its last length,
    # as DDP's: the first rank's lengths overwrite them.
    sizes = [lengths[min(position, len(lengths) - 1)] for position in range(count)]
    shared = _torch.host_values_on(sizes, torch.int32, device)
    _torch.broadcast(shared, 0, group)
    result: list[list[int]] = []
    start = 0
    for length in _torch.to_ints(shared):
        result.append(flat[start : start + length])
        start += length
    return result
