"""``shard_placement_fn``'s answers, read as FSDP2 reads them: the dim each parameter is split on.

``None`` is dim 0; ``Shard(d)`` is dim ``d`` (a negative ``d`` counts from the
end). A dim other than 0 must divide evenly over the shard dim's ranks, as FSDP2
requires (it pads dim 0 only).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Shard

from torchcontract import InvalidShardDimError, module_label

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

    ``target`` is the module applied to, named in errors. Raises ``NotImplementedError``
    for FSDP2's ``ShardPlacementResult`` (a mesh per parameter), ``TypeError`` for any
    other answer that is neither ``None`` nor a ``Shard``; ``InvalidShardDimError`` (a
    ``ValueError`` and, as FSDP2 raises, an ``AssertionError``) for a dim out of the
    parameter's range; ``NotImplementedError`` for a dim other than 0 that ``world``
    does not divide (as FSDP2).
    """
    placement = None if placement_fn is None else placement_fn(parameter)
    if placement is None:
        return 0
    where = f"fully_shard on {module_label(target)}: shard_placement_fn returned"
    if type(placement).__name__ == "ShardPlacementResult":
        # FSDP2 gives such parameters a group of their own, on their mesh, inside the
        # module's application; here one application is one group on one mesh.
        raise NotImplementedError(
            f"{where} a ShardPlacementResult for parameter {fqn!r}: a mesh per parameter is "
            "not implemented (one fully_shard application shards over one mesh); return "
            "Shard(dim) or None, and shard the submodule holding it with its own "
            "fully_shard(..., mesh=...) call first"
        )
    if type(placement) is not Shard:
        shown = type(placement).__qualname__
        raise TypeError(f"{where} a {shown} for parameter {fqn!r}; return a Shard(dim) or None")
    given = placement_dim(placement)
    ndim = parameter.dim()
    dim = given + ndim if given < 0 else given
    if not 0 <= dim < ndim:
        # FSDP2's AssertionError, from its own check or DTensor's for a dim still negative.
        theirs = (
            f"Shard dim {dim} in placements (Shard(dim={dim}),) must be normalized"
            if dim < 0
            else f"Shard dim {dim} is invalid for {ndim}D tensor: {parameter.shape}"
        )
        raise InvalidShardDimError(
            f"{where} Shard({given}) for parameter {fqn!r} of {ndim} dims (FSDP2: {theirs}); "
            f"return a Shard(dim) with -{ndim} <= dim < {ndim}, or None"
        )
    size = local_tensor(parameter).shape[dim]
    if dim > 0 and size % world != 0:
        shape = local_tensor(parameter).shape
        raise NotImplementedError(
            f"{where} Shard({given}) for parameter {fqn!r}, whose dim {dim} of size {size} "
            f"does not divide over {world} ranks; only dim 0 is split unevenly (padded), as "
            f"in FSDP2 (FSDP does not support uneven sharding on dim {dim}: {shape} (world "
            f"size: {world})): return Shard(0) or None"
        )
    return dim
