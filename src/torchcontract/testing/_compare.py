"""What ``check_api_invariants`` compares: one forward and backward, and their differences."""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ._torch import fork_rng, manual_seed

__all__ = [
    "forward_backward",
    "gc_disabled",
    "gradient_difference",
    "max_difference",
    "sum_of_outputs",
]


def sum_of_outputs(output: object) -> Tensor:
    """The sum of every float tensor in ``output``: the default loss of a ``ModelCase``."""
    leaves, _ = pytree.tree_flatten(output)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    if not tensors:
        raise AssertionError("check_api_invariants: the model's output holds no float tensor")
    return torch.stack([tensor.float().sum() for tensor in tensors]).sum()


def forward_backward(
    model: nn.Module,
    make_inputs: Callable[[], tuple[Any, ...]],
    loss: Callable[[Any], Tensor],
    seed: int,
) -> tuple[Any, dict[str, Tensor]]:
    """One forward and backward under a fixed seed; the output and the gradients by FQN."""
    with fork_rng(devices=[]):
        manual_seed(seed + 1)
        inputs = make_inputs()
        manual_seed(seed + 2)
        output = model(*inputs)
        torch.autograd.backward(loss(output))
    gradients = {
        name: parameter.grad.detach().clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }
    return pytree.tree_map(_detached, output), gradients


def _detached(leaf: object) -> object:
    return leaf.detach() if isinstance(leaf, Tensor) else leaf


def max_difference(mine: object, theirs: object) -> float:
    my_leaves, my_spec = pytree.tree_flatten(mine)
    their_leaves, their_spec = pytree.tree_flatten(theirs)
    if my_spec != their_spec:
        raise AssertionError("check_api_invariants: the API changed the structure of the output")
    worst = 0.0
    for my_leaf, their_leaf in zip(my_leaves, their_leaves, strict=True):
        if isinstance(my_leaf, Tensor) and isinstance(their_leaf, Tensor):
            worst = max(worst, _tensor_difference(my_leaf, their_leaf))
        elif my_leaf != their_leaf:
            return math.inf
    return worst


def gradient_difference(
    mine: dict[str, Tensor], theirs: dict[str, Tensor]
) -> tuple[float, tuple[str, ...]]:
    """The largest difference of the gradients both have, and the FQNs only one has."""
    unmatched = tuple(sorted(mine.keys() ^ theirs.keys()))
    shared = [name for name in mine if name in theirs]
    worst = max((_tensor_difference(mine[name], theirs[name]) for name in shared), default=0.0)
    return worst, unmatched


def _tensor_difference(mine: Tensor, theirs: Tensor) -> float:
    if mine.shape != theirs.shape:
        return math.inf
    if mine.numel() == 0:
        return 0.0
    return float((mine.double() - theirs.double()).abs().max())


@contextlib.contextmanager
def gc_disabled() -> Generator[None]:
    """Within the block, only reference counting frees objects: the cycle collector is off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
