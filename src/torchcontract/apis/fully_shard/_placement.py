"""``shard_placement_fn``'s answers, read as FSDP2 reads them: the dim each parameter is split on.

``None`` is dim 0; ``Shard(d)`` is dim ``d`` (a negative ``d`` counts from the
end). A dim other than 0 must divide evenly over the shard dim's ranks, as FSDP2
requires (it pads dim 0 only).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Shard

from torchcontract import module_label

from ._layout import local_tensor, placement_dim

__all__ = ["shard_dim"]


def shard_dim(
    target: nn.Module,
    fqn: str,
    parameter: nn.Parameter,
    placement_fn: Callable[[nn.Parameter], object] | None,
    world: int,
) -> int:
    """The dim ``parameter`` (named ``fqn``) is split on over ``world`` ranks.

    ``target`` is the module applied to, named in errors. Raises ``TypeError`` for an answer that
    is neither ``None`` nor a ``Shard``; ``ValueError`` for a dim out of the
    parameter's range; ``NotImplementedError`` for a dim other than 0 that
    ``world`` does not divide (as FSDP2).
    """
    placement = None if placement_fn is None else placement_fn(parameter)
    if placement is None:
        return 0
    where = f"fully_shard on {module_label(target)}: shard_placement_fn returned"
    if type(placement) is not Shard:
        shown = type(placement).__qualname__
        raise TypeError(
            f"{where} a {shown} for parameter {fqn!r}; return a Shard(dim) or None (a "
            "ShardPlacementResult with its own mesh is not supported)"
        )
    given = placement_dim(placement)
    ndim = parameter.dim()
    dim = given + ndim if given < 0 else given
    if not 0 <= dim < ndim:
        raise ValueError(
            f"{where} Shard({given}) for parameter {fqn!r} of {ndim} dims; return a "
            f"Shard(dim) with -{ndim} <= dim < {ndim}, or None"
        )
    size = local_tensor(parameter).shape[dim]
    if dim > 0 and size % world != 0:
        raise NotImplementedError(
            f"{where} Shard({given}) for parameter {fqn!r}, whose dim {dim} of size {size} "
            f"does not divide over {world} ranks; only dim 0 is split unevenly (padded), as "
            "in FSDP2: return Shard(0) or None"
        )
    return dim
