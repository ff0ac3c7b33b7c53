"""A gloo process group whose collectives finish a set delay after they start: exposure measured.

How much communication a training step hides behind its compute is what streams
buy on a GPU; on a CPU it can be shown with a slow network made on purpose.
``delayed_group(delay)`` gives a process group over gloo in which each collective
is ready no sooner than ``delay`` seconds after it was issued. The data moves on
gloo as usual (the results are gloo's); only the wait is held back. A collective
waited on as soon as it is issued blocks its caller for the whole delay; one issued
ahead (a prefetched all-gather) blocks only for what is left of the delay when it
is waited on. Each handle records, at its first wait, how long that wait blocked:
the step's exposed communication, collective by collective (``group.waits``).

``busy`` is compute that takes a known time whatever the machine's load: it sleeps,
in forward and in backward, so a test can put ``delay`` of work between a
collective's start and its use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from python_group import PythonGroup, register
from torch import Tensor
from torch._C._distributed_c10d import Store

__all__ = ["DelayedGroup", "Wait", "busy", "delayed_group"]


@attrs.frozen
class Wait:
    """One collective's first wait: its kind, and the seconds that wait blocked."""

    kind: str
    blocked: float


class _DelayedWork(dist.Work):
    """The handle of a delayed collective: ready ``delay`` seconds after it started."""

    def __init__(self, inner: dist.Work, kind: str, ready_at: float, waits: list[Wait]) -> None:
        super().__init__()
        self._inner, self._kind, self._ready_at, self._waits = inner, kind, ready_at, waits
        self._waited = False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        blocked = max(0.0, self._ready_at - time.monotonic())
        if blocked:
            time.sleep(blocked)
        if not self._waited:
            self._waited = True
            self._waits.append(Wait(self._kind, blocked))
        return self._inner.wait()

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        return self._inner.get_future()


def _delayed(kind: str, method: str) -> Callable[..., dist.Work]:
    """A collective of ``DelayedGroup``: gloo's ``method``, its handle held back by the delay."""

    def collective(self: DelayedGroup, *args: object) -> dist.Work:
        started = time.monotonic()
        work: dist.Work = getattr(self.gloo, method)(*args)
        return _DelayedWork(work, kind, started + self.delay, self.waits)

    return collective


class DelayedGroup(PythonGroup):
    """Gloo's collectives, each ready ``delay`` seconds after it started (0 until set)."""

    backend = "delayed_gloo"

    def __init__(self, gloo: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.gloo = gloo
        self.delay = 0.0
        self.waits: list[Wait] = []

    # The method names of torch 2.13 and, for the same collectives, of earlier releases.
    all_gather_single = _allgather_base = _delayed("all_gather", "_allgather_base")
    reduce_scatter_single = _reduce_scatter_base = _delayed(
        "reduce_scatter", "_reduce_scatter_base"
    )
    allreduce = _delayed("all_reduce", "allreduce")
    allgather = _delayed("all_gather_list", "allgather")
    broadcast = _delayed("broadcast", "broadcast")
    barrier = _delayed("barrier", "barrier")


def _create(store: Store, rank: int, size: int, timeout: timedelta) -> DelayedGroup:
    gloo = cast(dist.ProcessGroup, dist.ProcessGroupGloo(store, rank, size, timeout))
    return DelayedGroup(gloo, rank, size)


def delayed_group(delay: float) -> DelayedGroup:
    """A group of every rank of the default group, each collective ``delay`` seconds slow.

    Collective over the default group (every rank calls it, as ``new_group``).
    """
    register(DelayedGroup, _create, ["cpu"])
    group = dist.new_group(backend=DelayedGroup.backend)
    if not isinstance(group, DelayedGroup):
        raise TypeError(f"delayed_group: new_group returned {type(group).__qualname__}")
    group.delay = delay
    return group


class _Busy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad.clone(), None


def busy(x: Tensor, seconds: float) -> Tensor:
    """``x``, after ``seconds`` of stand-in compute; its backward takes as long."""
    apply = cast(Callable[[Tensor, float], Tensor], _Busy.apply)
    return apply(x, seconds)
