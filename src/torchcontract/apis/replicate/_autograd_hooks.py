"""The two autograd hooks of a replicated module: on a synchronizing forward's outputs, and
on each parameter once its gradient was accumulated.

Each holds its reducer and tells it one thing: a backward that synchronizes began
(``Armed``), or a parameter's gradient is ready (``ParameterHook``, on its gradient
accumulator, as DDP's: after the tensor's own post-accumulate-grad hooks, so a hook that
edits ``.grad`` in place edits what is averaged).
"""

from __future__ import annotations

import weakref
from typing import Protocol

from torch import Tensor

__all__ = ["Armed", "ParameterHook"]


class _Begins(Protocol):
    def begin(self, forward: int | None = None) -> None: ...


class _Readies(Protocol):
    def ready(self, index: int) -> None: ...


class Armed:
    """Hook on the outputs of one synchronizing forward (its number ``forward``): the first
    backward through them syncs, unless one already did for that forward."""

    __slots__ = ("_forward", "_reducer", "_used")

    def __init__(self, reducer: _Begins, forward: int) -> None:
        self._reducer = reducer
        self._forward = forward
        self._used = False

    def __call__(self, grad: Tensor) -> None:
        if not self._used:
            self._used = True
            self._reducer.begin(self._forward)


class ParameterHook:
    """The hook on one parameter's gradient accumulator: tells the reducer it is ready.

    It holds the reducer weakly: the reducer keeps the accumulator, so a strong
    reference back would be a cycle through autograd's nodes.
    """

    __slots__ = ("_index", "_reducer")

    def __init__(self, reducer: _Readies, index: int) -> None:
        self._reducer = weakref.ref(reducer)
        self._index = index

    def __call__(self, *unused: object) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.ready(self._index)
