"""no_sync(): one gradient-sync switch for models under ``replicate`` or ``fully_shard``."""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from torch import nn

from torchcontract import NotAppliedError, module_label

from .fully_shard import fully_shard
from .fully_shard._api import fully_shard_no_sync
from .replicate import replicate
from .replicate._api import replicate_no_sync

__all__ = ["no_sync"]


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Generator[None]:
    """Within the block, gradients only accumulate locally; the next synchronized backward reduces.

    Each API keeps the semantics of the PyTorch implementation it matches. For
    ``replicate``, as ``DistributedDataParallel.no_sync()``: forwards run inside
    the block build graphs whose backward stays local. For ``fully_shard`` (the
    application on ``module`` and every one inside it), as FSDP2's
    ``set_requires_gradient_sync(False)``: backwards run inside the block keep
    unsharded gradients instead of reduce-scattering them. Restores the previous
    settings on exit, so blocks nest.

    Args:
        module: The module ``replicate`` or ``fully_shard`` is applied to itself: the
            root of what it synchronizes (with ``fully_shard``, the applications on
            modules inside it follow it). For a model whose blocks alone are sharded,
            apply ``fully_shard`` to the model as well, or enter ``no_sync(block)`` for each.

    Yields:
        Nothing; gradients of the backwards the block covers stay local.

    Raises:
        NotAppliedError: Neither API is applied to ``module`` itself (one applied only
            to modules inside it does not count).
    """
    if replicate.is_applied(module):
        with replicate_no_sync(module):
            yield
    elif fully_shard.is_applied(module):
        with fully_shard_no_sync(module):
            yield
    else:
        raise NotAppliedError(
            f"no_sync: neither replicate nor fully_shard is applied to {module_label(module)}; "
            "apply one of them to this module (the root of what it synchronizes) first"
        )
