"""Unused parameters: DDP's errors where one got no gradient, and which ones some rank used.

Without ``find_unused_parameters`` (or ``static_graph``) every parameter must get a
gradient in every synchronizing backward; ``unused_error`` is the error the next
forward raises where one did not, DDP's words first. With ``find_unused_parameters``,
a parameter counts as used if some rank accumulated into it since the last
synchronization: the map of those used on each rank is all-reduced once per
synchronizing backward (``used_on_some_rank``), as DDP's.
With ``static_graph``, the first synchronizing backward all-reduces that map once and
fixes it (``StaticGraph``): later ones send no map, and a parameter that
arrives where the first had none, or the other way round, is DDP's error
(``graph_changed_error``, ``static_unused_error``). A backward that raised midway
is DDP's error at the next forward too (``unfinished_backward_error``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from torchcontract import (
    GraphChangedError,
    LateGradientError,
    UnfinishedBackwardError,
    UnusedParameterError,
)

from .. import _torch
from .._let_go import Collective

__all__ = [
    "StaticGraph",
    "UsedMap",
    "graph_changed_error",
    "late_gradient_error",
    "start_used_map",
    "static_unused_error",
    "unfinished_backward_error",
    "unused_error",
    "used_on_some_rank",
]

#: How DDP's two errors for a changed static graph describe the change.
_CHANGED: Final = "training graph has changed in this iteration, e.g., one parameter is"
_STATIC: Final = " this is not compatible with static_graph set to True."
#: DDP's first sentence where a synchronizing backward left parameters without gradients.
_UNFINISHED: Final = (
    "Expected to have finished reduction in the prior iteration before starting a new one. "
)


@attrs.frozen
class StaticGraph:
    """What a static graph's first synchronizing backward fixed, by parameter, for the rest.

    ``firings``: how often its gradient was accumulated on this rank (nested backwards,
    a reentrant checkpoint's, included); each later synchronizing backward must
    accumulate it as often, as DDP counts its hooks. None on a rank that met that
    backward under ``Join``, having joined: its first own synchronizing backward
    tells. ``used``: whether some rank used it (its gradient is averaged, or else left
    alone), as DDP's map of used parameters after its first iteration.
    """

    firings: tuple[int, ...] | None
    used: tuple[bool, ...]


def graph_changed_error(name: str, first: int, where: Callable[[], str]) -> GraphChangedError:
    """DDP's error, raised in the backward, for a gradient the first backward gave ``first`` times.

    That is, not at all, or less often than this one.
    """
    got = (
        "a gradient in this synchronizing backward and none in the first"
        if first == 0
        else f"more gradients in this synchronizing backward than the {first} of the first"
    )
    return GraphChangedError(
        f"Your {_CHANGED} unused in first iteration, but "
        f"then got used in the second iteration.{_STATIC} {where()}: parameter {name!r} got "
        f"{got}; with "
        "static_graph=True every synchronizing backward uses the parameters the first one "
        "used: pass static_graph=False, and find_unused_parameters=True where some go unused"
    )


def late_gradient_error(name: str, where: Callable[[], str]) -> LateGradientError:
    """DDP's error, raised in the backward, for a gradient that came after its bucket went out."""
    return LateGradientError(
        "Expected to mark a variable ready only once. "
        f"{where()}: parameter {name!r} got a gradient again in this synchronizing backward, "
        "after its bucket was sent (a reentrant checkpoint that runs it again, or a parameter "
        "used outside the forward); pass static_graph=True if every step uses the same "
        "parameters, as DDP advises"
    )


def unfinished_backward_error(where: Callable[[], str]) -> UnfinishedBackwardError:
    """DDP's error, raised by the next forward, for a backward that raised midway."""
    return UnfinishedBackwardError(
        f"{_UNFINISHED}{where()}: the last synchronizing backward raised after gradients had "
        "begun to arrive; its buckets may have been sent on some ranks and not on others, so "
        "this rank's collectives may no longer pair with theirs, and no gradient of that "
        "backward was averaged. As with DDP, the module cannot train on: resume from a "
        "checkpoint in a new process; to skip a batch, decide on every rank before its backward"
    )


def static_unused_error(
    names: Sequence[str], short: Sequence[bool], where: Callable[[], str]
) -> UnusedParameterError | None:
    """DDP's error, raised by the next forward, for gradients the first backward gave, now none.

    ``short``: by parameter, whether it got fewer than in the first backward.
    """
    missing = [name for name, fell_short in zip(names, short, strict=True) if fell_short]
    if not missing:
        return None
    return UnusedParameterError(
        f"{_UNFINISHED}This error indicates that your {_CHANGED} used in first iteration, "
        f"but then got unused in the second iteration.{_STATIC} {where()} got no gradient for "
        f"{_listed(missing)} in the last synchronizing backward, which the first one gave one; "
        "with static_graph=True every synchronizing backward uses the parameters the first one "
        "used: pass static_graph=False, and find_unused_parameters=True where some go unused"
    )


def _listed(names: Sequence[str]) -> str:
    """The first five names quoted, and how many more."""
    shown = ", ".join(repr(name) for name in names[:5])
    return f"{shown} and {len(names) - 5} more" if len(names) > 5 else shown


def unused_error(
    names: Sequence[str], arrived: Sequence[bool], where: Callable[[], str]
) -> UnusedParameterError | None:
    """DDP's error if a parameter got no gradient in this synchronizing backward, else None.

    DDP's text first (code that matches it keeps matching), then the parameters
    by name and what to do; raised by the next forward with grad enabled. ``where()``
    names the application.
    """
    missing = [name for name, came in zip(names, arrived, strict=True) if not came]
    if not missing:
        return None
    ddp = (
        f"{_UNFINISHED}This error indicates that your module has parameters that were not "
        "used in producing loss: "
    )
    if len(missing) == len(names):
        # Not one gradient accumulated: the backward computed them without accumulating
        # (torch.autograd.grad, backward(inputs=...), a pipeline schedule that splits
        # the backward into its input and weight parts).
        return UnusedParameterError(
            f"{ddp}{where()} got no gradient at all in the last synchronizing "
            "backward through its outputs: gradients that torch.autograd.grad, "
            "backward(inputs=...) or a zero-bubble pipeline schedule compute are not "
            "accumulated, so replicate cannot average them; run such forwards under "
            "no_sync(module) or rank_local(module), or call loss.backward()"
        )
    return UnusedParameterError(
        f"{ddp}{where()} got no gradient for {_listed(missing)} in the last "
        "synchronizing backward; pass find_unused_parameters=True to replicate, or make "
        "every parameter take part in the loss"
    )


@attrs.frozen
class UsedMap:
    """The map of parameters used on this rank, all-reduced over the group (``start_used_map``)."""

    local: tuple[bool, ...]
    summed: Tensor
    pending: Collective | None

    def result(self) -> list[bool]:
        """By parameter, whether some rank used it.

        Waits for the all-reduce; reads it back only where this rank left a parameter
        unused, as DDP's ``finalize_bucket_dense``: a read waits for the device.
        """
        if self.pending is not None:
            self.pending.wait()
        if all(self.local):
            return [True] * len(self.local)
        return _torch.to_bools(self.summed > 0)


def start_used_map(used: Sequence[bool], group: dist.ProcessGroup, device: torch.device) -> UsedMap:
    """Start DDP's all-reduce of the map of used parameters: an int32 per parameter.

    On ``device``, the parameters' (DDP all-reduces its map on the device too); every
    rank all-reduces, on a group of more than one.
    """
    summed = _torch.host_values_on([1 if was else 0 for was in used], torch.int32, device)
    pending = _torch.all_reduce(summed, group) if group.size() > 1 else None
    return UsedMap(tuple(used), summed, pending)


def used_on_some_rank(
    used: Sequence[bool], group: dist.ProcessGroup, device: torch.device
) -> list[bool]:
    """By parameter, whether some rank of ``group`` used it: the map all-reduced and read."""
    return start_used_map(used, group, device).result()
