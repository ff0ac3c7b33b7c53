"""Optimizers applied in backward, stepped as DDP steps them: on the averaged gradients.

torch's ``_apply_optimizer_in_backward`` gives each parameter optimizers of its own
(``param._in_backward_optimizers``) and a hook on its gradient accumulator that steps
them on the gradient just accumulated: this rank's alone, so the replicas would drift
apart. As DDP does at its first forward, ``replicate`` removes those hooks
(``take_over``) and steps the optimizers once the gradients are averaged, at the end of
each synchronizing backward, then sets those parameters' ``.grad`` to None (``step``).
Backwards that only accumulate (``no_sync``) step nothing, as under DDP.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import cast

import torch
from torch import Tensor
from torch.distributed.optim import apply_optimizer_in_backward
from torch.utils.hooks import RemovableHandle

__all__ = ["step", "take_over"]


def _handles() -> MutableMapping[Tensor, list[RemovableHandle]]:
    """torch's record of the in-backward hooks it registered, by parameter."""
    return cast(
        "MutableMapping[Tensor, list[RemovableHandle]]",
        apply_optimizer_in_backward.param_to_optim_hook_handle_map,
    )


def _optimizers(parameter: Tensor) -> list[torch.optim.Optimizer]:
    return cast("list[torch.optim.Optimizer]", getattr(parameter, "_in_backward_optimizers", []))


def take_over(parameters: Sequence[Tensor]) -> tuple[int, ...]:
    """Remove torch's in-backward hooks of ``parameters``: the positions of those with any."""
    handles = _handles()
    positions: list[int] = []
    for position, parameter in enumerate(parameters):
        if _optimizers(parameter):
            positions.append(position)
            for handle in handles.pop(parameter, []):
                handle.remove()
    return tuple(positions)


def step(parameters: Sequence[Tensor]) -> None:
    """Step each parameter's in-backward optimizers on its (averaged) ``.grad``; then clear it.

    As DDP's: every parameter's optimizers step first, then every ``.grad`` is set to None.
    """
    for parameter in parameters:
        for optimizer in _optimizers(parameter):
            optimizer.step()
    for parameter in parameters:
        parameter.grad = None
