"""Custom collectives (``set_custom_all_gather``, ``set_custom_reduce_scatter``) for both APIs.

FSDP2's ``AllGather`` and ``ReduceScatter`` protocols: ``allocate`` gives each buffer,
``__call__`` runs the collective. ``PlainAllGather`` and ``PlainReduceScatter`` do what
the default ones do, through ``torch.distributed``; tests subclass them to count or to
spin the GPU first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torchcontract.apis import _compat

__all__ = ["Comm", "PlainAllGather", "PlainReduceScatter"]


class Comm:
    """Buffers from ``torch.empty``, as the default comms'."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class PlainAllGather(Comm):
    """``output_tensor`` gets every rank's ``input_tensor``, by rank."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> Any:
        return _compat.all_gather_single(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class PlainReduceScatter(Comm):
    """``output_tensor`` gets this rank's slice of ``input_tensor`` reduced with ``op``."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        return _compat.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
