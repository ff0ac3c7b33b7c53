"""The batched copies around a group's collectives: a few ops per group, none per parameter.

FSDP2's copies (``all_gather_copy_in``, ``split_with_sizes_copy``, ``chunk_cat``),
on the parameters sharded on dim 0: every shard goes into the flat all-gather
input in one ``_foreach_copy_`` (casting to the parameter dtype on the way), the
gathered rows go into every unsharded parameter in one ``split_with_sizes_copy``,
the gradients into the reduce-scatter input in one ``_chunk_cat`` (padding and
casting to the reduction dtype), and each reduced shard is a view of the flat
output, cast once. A world of one copies the shards straight into the unsharded
parameters, with no collective and no flat buffer.

The flat all-gather input's padding (the rows a rank lacks under an uneven split)
is left unwritten: no unsharded parameter reads it, as each takes its first
``rows`` rows of the gathered ``(world, padded)`` rows.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from .. import _torch
from . import _comms
from ._comms import AllGatherComm, ReduceScatterComm
from ._sharding import ManagedParameter

__all__ = ["batched", "copy_in", "copy_out", "copy_shards", "gradient_input", "shard_gradients"]


def batched(parameters: Sequence[ManagedParameter]) -> bool:
    """Whether the batched copies serve ``parameters``: all sharded on dim 0."""
    return all(parameter.dim == 0 for parameter in parameters)


@contextmanager
def _preserving_versions(tensors: Sequence[Tensor]) -> Generator[None]:
    """Writes to ``tensors`` leave their version counters (autograd saved their views)."""
    with torch.no_grad(), ExitStack() as stack:
        for tensor in tensors:
            stack.enter_context(_unsafe_preserve_version_counter(tensor))
        yield


def copy_shards(parameters: Sequence[ManagedParameter], dtype: torch.dtype) -> None:
    """A world of one: every shard into its unsharded parameter, in ``dtype``, in one op."""
    device = parameters[0].shard_data().device
    storages = [parameter.prepare_gathered(dtype, device) for parameter in parameters]
    with _preserving_versions(storages):
        _torch.copy_each(
            [parameter.gathered_data() for parameter in parameters],
            [parameter.shard_data() for parameter in parameters],
        )


def copy_in(
    parameters: Sequence[ManagedParameter],
    dtype: torch.dtype,
    world: int,
    rank: int,
    comm: AllGatherComm | None = None,
) -> tuple[Tensor, Tensor]:
    """The all-gather's flat input, filled with the shards in ``dtype``, and its output buffer.

    The input is this rank's slice of the output, as FSDP2's ``all_gather_copy_in``;
    the output comes from ``comm``'s allocator if given (``set_custom_all_gather``).
    """
    sizes: list[int] = []
    sources: list[Tensor] = []
    data: list[int] = []  # which of the split pieces hold a shard (the rest: padding)
    total = 0
    for parameter in parameters:
        source = parameter.flat_shard()
        data.append(len(sizes))
        sizes.append(source.numel())
        sources.append(source)
        padding = parameter.padded_shard_numel - source.numel()
        if padding:
            sizes.append(padding)
        total += parameter.padded_shard_numel
    gathered = _comms.allocate(comm, world * total, dtype, sources[0].device)
    flat = gathered.narrow(0, rank * total, total) if world > 1 else gathered
    pieces = flat.split_with_sizes(sizes)
    with torch.no_grad():
        _torch.copy_each([pieces[index] for index in data], sources)
    return flat, gathered


def copy_out(parameters: Sequence[ManagedParameter], gathered: Tensor, world: int) -> None:
    """The gathered ``(world, padded)`` rows into every unsharded parameter, in one op."""
    storages = [
        parameter.prepare_gathered(gathered.dtype, gathered.device) for parameter in parameters
    ]
    with _preserving_versions(storages):
        torch.split_with_sizes_copy(
            gathered.view(world, -1),
            [parameter.padded_shard_numel for parameter in parameters],
            dim=1,
            out=[parameter.gathered_rows() for parameter in parameters],
        )


def gradient_input(
    grads: Sequence[Tensor],
    dtype: torch.dtype,
    world: int,
    numel: int,
    comm: ReduceScatterComm | None = None,
) -> Tensor:
    """The reduce-scatter's flat input: each rank's padded rows of every gradient, in ``dtype``.

    ``numel``: the padded rows' elements of one rank, over all gradients. From
    ``comm``'s allocator if given (``set_custom_reduce_scatter``), as FSDP2's.
    """
    flat = _comms.allocate(comm, world * numel, dtype, grads[0].device)
    _torch.chunk_cat(grads, world, out=flat.view(world, numel))
    return flat


def shard_gradients(parameters: Sequence[ManagedParameter], reduced: Tensor) -> None:
    """Add each parameter's rows of the flat ``reduced`` shards to its sharded ``.grad``.

    The flat buffer is cast once to the parameters' dtype; each gradient is a view
    of it (FSDP2's), and accumulates into a ``.grad`` already there.
    """
    dtypes = {parameter.orig_dtype for parameter in parameters}
    if len(dtypes) > 1:  # parameters of several dtypes under one reduction dtype: one by one
        offset = 0
        for parameter in parameters:
            parameter.accumulate_shard_grad(reduced[offset : offset + parameter.padded_shard_numel])
            offset += parameter.padded_shard_numel
        return
    (dtype,) = dtypes
    cast = reduced if reduced.dtype == dtype else reduced.to(dtype)
    offset = int(cast.storage_offset())
    for parameter in parameters:
        parameter.add_shard_grad(
            torch.as_strided(cast, parameter.shard_shape, parameter.shard_stride, offset)
        )
        offset += parameter.padded_shard_numel
