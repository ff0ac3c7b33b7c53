"""Optimizers applied in backward, stepped as DDP steps them: on the averaged gradients.

torch's ``_apply_optimizer_in_backward`` gives each parameter optimizers of its own
(``param._in_backward_optimizers``) and a hook on its gradient accumulator that steps
them on the gradient just accumulated: this rank's alone, so the replicas would drift
apart. As DDP does, ``replicate`` removes those hooks at apply (``TakenOver``) and steps
the optimizers once the gradients are averaged, at the end of each synchronizing
backward, then sets those parameters' ``.grad`` to None (``step``). Backwards that
only accumulate (``no_sync``) step nothing, as under DDP. A rolled-back apply gives the
hooks back.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.distributed.optim import apply_optimizer_in_backward
from torch.utils.hooks import RemovableHandle

__all__ = ["TakenOver", "step"]


def _handles() -> MutableMapping[Tensor, list[RemovableHandle]]:
    """torch's record of the in-backward hooks it registered, by parameter."""
    return cast(
        "MutableMapping[Tensor, list[RemovableHandle]]",
        apply_optimizer_in_backward.param_to_optim_hook_handle_map,
    )


def _optimizers(parameter: Tensor) -> list[torch.optim.Optimizer]:
    return cast("list[torch.optim.Optimizer]", getattr(parameter, "_in_backward_optimizers", []))


class TakenOver:
    """The in-backward optimizers of a replicated module's parameters, their hooks removed.

    ``positions``: those parameters' positions in the sequence given. Calling it gives
    the hooks back, as torch registered them (a rolled-back apply).
    """

    def __init__(self, parameters: Sequence[Tensor]) -> None:
        handles = _handles()
        self._parameters: list[Tensor] = []
        positions: list[int] = []
        for position, parameter in enumerate(parameters):
            if _optimizers(parameter):
                positions.append(position)
                self._parameters.append(parameter)
                for handle in handles.pop(parameter, []):
                    handle.remove()
        self.positions = tuple(positions)

    def __call__(self) -> None:
        handles = _handles()
        for parameter in self._parameters:
            accumulator = cast(Any, parameter.view_as(parameter).grad_fn).next_functions[0][0]
            handle = accumulator.register_hook(_OptimizerHook(parameter))
            handles.setdefault(parameter, []).append(cast(RemovableHandle, handle))


class _OptimizerHook:
    """torch's in-backward hook: step the parameter's optimizers, then clear its ``.grad``."""

    def __init__(self, parameter: Tensor) -> None:
        self._parameter = parameter

    def __call__(self, *unused: object) -> None:
        step([self._parameter])


def step(parameters: Sequence[Tensor]) -> None:
    """Step each parameter's in-backward optimizers on its (averaged) ``.grad``; then clear it.

    As DDP's: every parameter's optimizers step first, then every ``.grad`` is set to None.
    """
    for parameter in parameters:
        for optimizer in _optimizers(parameter):
            optimizer.step()
    for parameter in parameters:
        parameter.grad = None
