"""A gloo process group that records every collective issued through it: kind, elements, dtype.

DDP's reducer issues its collectives in C++ (the buckets, the map of used parameters,
the rebuilt buckets' broadcast), where no Python wrapper sees them; a process group
written in Python does: c10d calls its methods for every collective on it, whoever
issues it. ``recording_group()`` gives one over every rank of the default group;
``group.take()`` returns what was issued since the last take, in order. The data moves
on gloo as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import cast

import attrs
import torch.distributed as dist
from python_group import PythonGroup, register
from torch import Tensor
from torch._C._distributed_c10d import Store

__all__ = ["Message", "RecordingGroup", "recording_group"]


@attrs.frozen
class Message:
    """One collective: its kind, and per tensor given, its elements and dtype."""

    kind: str
    tensors: tuple[tuple[int, str], ...]


def _tensors(given: object) -> list[Tensor]:
    """The tensors of a collective's first argument: a tensor, or a (nested) list of them."""
    if isinstance(given, Tensor):
        return [given]
    if isinstance(given, (list, tuple)):
        return [tensor for item in given for tensor in _tensors(item)]
    return []


def _recorded(kind: str, method: str) -> Callable[..., dist.Work]:
    """A collective of ``RecordingGroup``: gloo's ``method``, recorded first."""

    def collective(self: RecordingGroup, *args: object) -> dist.Work:
        shapes = tuple((tensor.numel(), str(tensor.dtype)) for tensor in _tensors(args[0]))
        self.messages.append(Message(kind, shapes))
        work: dist.Work = getattr(self.gloo, method)(*args)
        return work

    return collective


class RecordingGroup(PythonGroup):
    """Gloo's collectives, each recorded in ``messages`` as it is issued."""

    backend = "recording_gloo"

    def __init__(self, gloo: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.gloo = gloo
        self.messages: list[Message] = []

    def take(self) -> list[Message]:
        """What was issued since the last take, in order."""
        taken, self.messages = self.messages, []
        return taken

    # The method names of torch 2.13 and, for the same collectives, of earlier releases.
    allreduce = _recorded("all_reduce", "allreduce")
    broadcast = _recorded("broadcast", "broadcast")
    allgather = _recorded("all_gather", "allgather")
    all_gather_single = _allgather_base = _recorded("all_gather", "_allgather_base")
    barrier = _recorded("barrier", "barrier")


def _create(store: Store, rank: int, size: int, timeout: timedelta) -> RecordingGroup:
    gloo = cast(dist.ProcessGroup, dist.ProcessGroupGloo(store, rank, size, timeout))
    return RecordingGroup(gloo, rank, size)


def recording_group() -> RecordingGroup:
    """A recording group of every rank of the default group (every rank calls it)."""
    register(RecordingGroup, _create, ["cpu"])
    group = dist.new_group(backend=RecordingGroup.backend)
    if not isinstance(group, RecordingGroup):
        raise TypeError(f"recording_group: new_group returned {type(group).__qualname__}")
    return group
