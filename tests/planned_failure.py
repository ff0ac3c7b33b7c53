"""A point in a model where the next backward fails, once: tests of a backward that raises.

``failure_point(x)`` is ``x`` in the forward; once ``arm()`` was called, the next backward
through it raises ``ValueError(MESSAGE)`` there, and later ones pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

import torch
from torch import Tensor

__all__ = ["MESSAGE", "arm", "failure_point"]

MESSAGE: Final = "planned failure"


class _FailOnce(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise ValueError(MESSAGE)
        return grad


failure_point: Final = cast(Callable[[Tensor], Tensor], _FailOnce.apply)


def arm() -> None:
    """Make the next backward through a ``failure_point`` raise there."""
    _FailOnce.armed = True
