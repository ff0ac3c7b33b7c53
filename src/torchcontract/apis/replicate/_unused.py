"""Unused parameters: DDP's error where one got no gradient, and which ones some rank used.

Without ``find_unused_parameters`` (or ``static_graph``) every parameter must get a
gradient in every synchronizing backward; ``unused_error`` is the error the next
forward raises where one did not, DDP's words first. With either, a parameter counts
as used if some rank accumulated into it since the last synchronization: the flags
travel at the end of each bucket (``used_from_flags``) or, with a communication hook,
are all-reduced once per backward (``used_on_some_rank``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from torchcontract import UnusedParameterError

from .. import _torch

__all__ = ["unused_error", "used_from_flags", "used_on_some_rank"]


def unused_error(
    names: Sequence[str], arrived: Sequence[bool], where: Callable[[], str]
) -> UnusedParameterError | None:
    """DDP's error if a parameter got no gradient in this synchronizing backward, else None.

    DDP's text first (code that matches it keeps matching), then the parameters
    by name and what to do; raised by the next forward with grad enabled. ``where()``
    names the application.
    """
    missing = [name for name, came in zip(names, arrived, strict=True) if not came]
    if not missing:
        return None
    ddp = (
        "Expected to have finished reduction in the prior iteration before starting a "
        "new one. This error indicates that your module has parameters that were not "
        "used in producing loss: "
    )
    if len(missing) == len(names):
        # Not one gradient accumulated: the backward computed them without accumulating
        # (torch.autograd.grad, backward(inputs=...), a pipeline schedule that splits
        # the backward into its input and weight parts).
        return UnusedParameterError(
            f"{ddp}{where()} got no gradient at all in the last synchronizing "
            "backward through its outputs: gradients that torch.autograd.grad, "
            "backward(inputs=...) or a zero-bubble pipeline schedule compute are not "
            "accumulated, so replicate cannot average them; run such forwards under "
            "no_sync(module) or rank_local(module), or call loss.backward()"
        )
    shown = ", ".join(repr(name) for name in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    return UnusedParameterError(
        f"{ddp}{where()} got no gradient for {shown}{more} in the last "
        "synchronizing backward; pass find_unused_parameters=True to replicate, or make "
        "every parameter take part in the loss"
    )


def used_from_flags(
    buckets: Sequence[Sequence[int]], results: Sequence[tuple[int, Tensor]], count: int
) -> list[bool]:
    """By parameter, the flags that travelled at the end of each reduced bucket."""
    used = [False] * count
    if not results:
        return used
    # Every bucket's flags in one read from the device: one wait, not one per bucket
    # (buckets of other dtypes or devices joined as booleans, on the first one's device).
    device = results[0][1].device
    tails = [
        (flat[flat.numel() - len(buckets[position]) :] > 0).to(device, non_blocking=True)
        for position, flat in results
    ]
    flags = iter(_torch.to_bools(torch.cat(tails)))
    for position, _ in results:
        for index in buckets[position]:
            used[index] = next(flags)
    return used


def used_flags(used: Sequence[bool], bucket: Sequence[int], like: Tensor) -> Tensor:
    """1.0 for each parameter of ``bucket`` in use, else 0.0: ``like``'s dtype and device.

    Copied without the host waiting for the device (``host_values_on``).
    """
    flags = [1.0 if used[index] else 0.0 for index in bucket]
    return _torch.host_values_on(flags, like.dtype, like.device)


def used_on_some_rank(
    used: Sequence[bool], group: dist.ProcessGroup, device: torch.device
) -> list[bool]:
    """By parameter, whether some rank of ``group`` used it: one all-reduce, as DDP's map.

    On ``device``, the parameters' (DDP all-reduces its map on the device too). Every
    rank all-reduces; one that used every parameter reads nothing back, as DDP's
    ``finalize_bucket_dense``: a read waits for the device.
    """
    local = _torch.host_values_on([1 if was else 0 for was in used], torch.int32, device)
    if group.size() > 1:
        _torch.all_reduce(local, group).wait()
    if all(used):
        return [True] * len(used)
    return _torch.to_bools(local > 0)
