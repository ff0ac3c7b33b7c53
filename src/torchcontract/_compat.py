"""The one place that knows which torch release has what.

Features are detected, not inferred from version numbers, wherever torch lets
us look: a backport or a private-API change then needs no edit here. The
oldest release tested is ``OLDEST_TESTED``; ``make compat`` runs the suite
against it and the newest one these machines hold.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any, Final, cast

import torch
from torch.utils import checkpoint as torch_checkpoint

__all__ = ["OLDEST_TESTED", "TORCH_VERSION", "checkpoint_generator"]

#: ``(major, minor)`` of the running torch.
TORCH_VERSION: Final = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
OLDEST_TESTED: Final = (2, 6)

_generator: Final = cast(
    Callable[..., Generator[None, None, None]],
    torch_checkpoint._checkpoint_without_reentrant_generator,
)
# torch 2.7 added ``early_stop`` between ``debug`` and the function's arguments.
_HAS_EARLY_STOP: Final = "early_stop" in inspect.signature(_generator).parameters


def checkpoint_generator(
    fn: Callable[..., object],
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
    determinism_check: str,
    *args: object,
    **kwargs: object,
) -> Generator[None, None, None]:
    """torch's non-reentrant checkpoint generator for ``fn(*args, **kwargs)``; yields once.

    Without debug output, stopping recomputation early where this torch can.
    """
    if _HAS_EARLY_STOP:
        return _generator(
            fn, preserve_rng_state, context_fn, determinism_check, False, True, *args, **kwargs
        )
    return _generator(fn, preserve_rng_state, context_fn, determinism_check, False, *args, **kwargs)
