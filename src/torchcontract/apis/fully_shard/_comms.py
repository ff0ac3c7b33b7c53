"""Custom collectives (FSDP2's ``AllGather`` / ``ReduceScatter``): their shape, how each is called.

``FullyShardModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take
an object that allocates the collective's buffer and runs the collective, as
FSDP2's ``Comm`` interface (``allocate(size, *, dtype, device)`` and a call with
keyword arguments): a subclass of torch's ``AllGather`` / ``ReduceScatter`` where
this torch has them, or any object of that shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _torch
from .._let_go import Waitable

__all__ = ["AllGatherComm", "ReduceScatterComm", "all_gather", "allocate"]


class _Comm(Protocol):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The buffer the collective reads or writes."""
        ...


class AllGatherComm(Protocol):
    """What ``FullyShardModule.set_custom_all_gather`` takes: FSDP2's ``AllGather``'s shape.

    A subclass of torch's ``AllGather`` (``torch.distributed.fsdp._fully_shard._fsdp_api``,
    in the releases that have it) fits, as does any object with these two methods:
    ``fully_shard`` calls them as FSDP2 does.
    """

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The buffer an all-gather writes: a tensor of ``size``, ``dtype`` and ``device``.

        Args:
            size: The buffer's shape (one dimension: the flat buffer's length).
            dtype: The buffer's dtype.
            device: The device to put the buffer on.

        Returns:
            A new tensor, or one the object keeps (a persistent buffer).
        """
        ...

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather every rank's ``input_tensor`` into ``output_tensor``, by rank.

        Called with keyword arguments; ``async_op=True`` for a prefetch, whose returned
        ``Work`` (if any) ``fully_shard`` waits on before the gathered parameters are used.
        """
        ...


class ReduceScatterComm(Protocol):
    """What ``FullyShardModule.set_custom_reduce_scatter`` takes: FSDP2's ``ReduceScatter``'s shape.

    A subclass of torch's ``ReduceScatter`` (``torch.distributed.fsdp._fully_shard._fsdp_api``,
    in the releases that have it) fits, as does any object with these two methods:
    ``fully_shard`` calls them as FSDP2 does.
    """

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer a reduce-scatter reads or writes: a tensor of ``size``, ``dtype``, ``device``.

        Args:
            size: The buffer's shape (one dimension: the flat buffer's length).
            dtype: The buffer's dtype.
            device: The device to put the buffer on.

        Returns:
            A new tensor, or one the object keeps (a persistent buffer).
        """
        ...

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce ``input_tensor`` over the ranks with ``op`` into this rank's ``output_tensor``.

        Called with keyword arguments, with FSDP2's op: ``AVG``, or ``SUM`` with the
        gradient divide factor applied before.
        """
        ...


def allocate(comm: _Comm | None, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat buffer of ``numel``: from ``comm``'s allocator if given, else ``torch.empty``."""
    if comm is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return comm.allocate((numel,), dtype=dtype, device=device)


def all_gather(
    comm: AllGatherComm | None,
    output: Tensor,
    input: Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool,
) -> Waitable | None:
    """``output`` gets every rank's ``input``: through ``comm`` if given, as FSDP2's.

    Without ``comm``, one rank copies; else ``torch.distributed``'s all-gather. With
    ``async_op``, the handle to wait on, if the collective gave one.
    """
    if comm is not None:
        return comm(output_tensor=output, input_tensor=input, group=group, async_op=async_op)
    if group.size() == 1:
        output.copy_(input)
        return None
    if async_op:
        return _torch.all_gather_into_async(output, input, group)
    _torch.all_gather_into(output, input, group)
    return None
