"""DDP's bucket caps, and the rebuild: the buckets made anew in the order gradients arrived.

The first assignment takes ``first_limits``; once rebuilt (after the first
synchronizing backward, or the second with ``static_graph``, and only where DDP
rebuilds), the buckets follow ``rebuild_order``, the first rank's arrival order, with
``limits``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _torch
from ._buckets import FIRST_BUCKET_BYTES

__all__ = ["first_limits", "limits", "rebuild_order"]


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


def rebuild_order(
    arrival: Sequence[int], count: int, group: dist.ProcessGroup, device: torch.device
) -> list[int]:
    """The first rank's arrival order, on every rank (a collective where the group has more).

    Parameters that did not arrive (a static graph's unused ones) come last, in the
    order they are defined, as DDP's reducer appends them. The broadcast runs on
    ``device``, the parameters' (DDP's ``sync_bucket_indices`` copies to it too).
    """
    arrived = set(arrival)
    order = [*arrival] + [i for i in range(count) if i not in arrived]
    shared = torch.tensor(order, dtype=torch.int64, device=device)  # the first rank's, everywhere
    if group.size() > 1:
        _torch.broadcast(shared, 0, group)
    return _torch.to_ints(shared)
