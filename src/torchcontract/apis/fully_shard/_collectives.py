"""The two collectives of a parameter group: one all-gather, one reduce-scatter, flat.

Both move each parameter's padded shard (``chunk_rows`` rows), concatenated over
the group's parameters, so one collective serves the whole group; the layout
is PyTorch's ``foreach_all_gather`` / ``foreach_reduce``: rank ``r``'s slice of
the flat buffer holds every parameter's ``r``-th padded shard, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _torch
from ._sharding import ManagedParameter

__all__ = ["all_gather", "reduce_scatter"]


def all_gather(parameters: Sequence[ManagedParameter], group: dist.ProcessGroup) -> None:
    """All-gather ``parameters`` and register their unsharded forms: one collective per dtype."""
    for same_dtype in _by_dtype(parameters, [parameter.param_dtype for parameter in parameters]):
        _all_gather_one_dtype([parameters[index] for index in same_dtype], group)


def _by_dtype(items: Sequence[object], dtypes: Sequence[torch.dtype]) -> list[list[int]]:
    """Indices of ``items`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(index)
    return list(groups.values())


def _all_gather_one_dtype(parameters: Sequence[ManagedParameter], group: dist.ProcessGroup) -> None:
    world = group.size()
    flat = torch.cat([parameter.gather_input() for parameter in parameters])
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    if world > 1:
        _torch.all_gather_into(gathered, flat, group)
    else:
        gathered.copy_(flat)
    columns = gathered.view(world, -1)
    offset = 0
    for parameter in parameters:
        width = parameter.padded_shard_numel
        parameter.unshard_from(columns[:, offset : offset + width])
        offset += width


def reduce_scatter(
    parameters: Sequence[ManagedParameter],
    grads: Sequence[Tensor],
    group: dist.ProcessGroup,
    reduce_dtype: torch.dtype | None,
    *,
    hook: Callable[[Tensor], None] | None = None,
) -> None:
    """Average ``grads`` (unsharded, one per parameter) over ``group`` into the sharded ``.grad``.

    The reduction runs in ``reduce_dtype`` (the gradients' own dtype if None), one
    collective per dtype; each shard's gradient is cast back to its parameter's
    dtype and added to ``.grad`` (set if there was none).
    """
    dtypes = [reduce_dtype or grad.dtype for grad in grads]
    for same_dtype in _by_dtype(parameters, dtypes):
        _reduce_scatter_one_dtype(
            [parameters[index] for index in same_dtype],
            [grads[index] for index in same_dtype],
            group,
            dtypes[same_dtype[0]],
            hook,
        )


def _reduce_scatter_one_dtype(
    parameters: Sequence[ManagedParameter],
    grads: Sequence[Tensor],
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    hook: Callable[[Tensor], None] | None,
) -> None:
    world = group.size()
    columns = torch.cat(
        [
            parameter.scatter_input(grad, dtype)
            for parameter, grad in zip(parameters, grads, strict=True)
        ],
        dim=1,
    )
    reduced = torch.empty(columns.shape[1], dtype=dtype, device=columns.device)
    if world > 1:
        _torch.reduce_scatter_average(reduced, columns.reshape(-1), group)
    else:
        reduced.copy_(columns.reshape(-1))
    if hook is not None:
        hook(reduced)
    offset = 0
    for parameter in parameters:
        width = parameter.padded_shard_numel
        parameter.accumulate_shard_grad(reduced[offset : offset + width])
        offset += width
