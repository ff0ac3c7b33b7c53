"""A world of identical ranks in one process: collectives computed as if every rank were this one.

``mirror_world(device_type, size)`` makes this process rank 0 of ``size`` ranks that
all hold its tensors: an all-reduce sums ``size`` copies (the tensor times ``size``,
an average leaves it), an all-gather repeats the input, a broadcast keeps it. So a
data-parallel API trains here exactly as it would on one process, and its collectives
can be checked where only one device is at hand. Like NCCL, the group takes tensors
on ``device_type`` only: any other raises, as NCCL's group does for a CPU tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from python_group import PythonGroup, register
from torch import Tensor
from torch._C._distributed_c10d import Store
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["MirrorGroup", "mirror_world"]


class _Done(dist.Work):
    """A collective already done: its result is ready."""

    def __init__(self, tensors: list[Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        future: torch.futures.Future[list[Tensor]] = torch.futures.Future()
        future.set_result(self._tensors)
        return future


class MirrorGroup(PythonGroup):
    """Rank 0 of ``size`` ranks that mirror it, taking tensors on ``device_type`` only."""

    backend = "mirror"
    device_type = "cpu"  # set by mirror_world before the group is made

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.calls: list[str] = []

    def _take(self, kind: str, tensors: list[Tensor]) -> None:
        for tensor in tensors:
            if tensor.device.type != self.device_type:
                raise RuntimeError(
                    f"No backend type associated with device type {tensor.device.type} "
                    f"(a {kind} on the {self.device_type} group)"
                )
        self.calls.append(kind)

    # torch types these collectives with overloads no one override matches: each is
    # written below as a function and set here as a plain callable.
    allreduce: Callable[..., dist.Work]
    broadcast: Callable[..., dist.Work]
    all_gather_single: Callable[..., dist.Work]
    _allgather_base: Callable[..., dist.Work]
    allgather: Callable[..., dist.Work]
    barrier: Callable[..., dist.Work]


def _allreduce(self: MirrorGroup, tensors: list[Tensor], opts: Any = None) -> dist.Work:
    self._take("all_reduce", tensors)
    if opts is None or opts.reduceOp == dist.ReduceOp.SUM:
        for tensor in tensors:
            tensor.mul_(self.size())
    return _Done(tensors)


def _broadcast(self: MirrorGroup, tensors: list[Tensor], opts: Any = None) -> dist.Work:
    self._take("broadcast", tensors)
    return _Done(tensors)


def _gather_single(self: MirrorGroup, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
    self._take("all_gather", [output, input])
    output.view(self.size(), -1).copy_(input.reshape(1, -1))
    return _Done([output])


def _allgather(
    self: MirrorGroup, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
) -> dist.Work:
    self._take("all_gather_list", [*inputs, *(out for each in outputs for out in each)])
    for each, input in zip(outputs, inputs, strict=True):
        for output in each:
            output.copy_(input)
    return _Done(inputs)


def _barrier(self: MirrorGroup, opts: Any = None) -> dist.Work:
    self.calls.append("barrier")
    return _Done([])


MirrorGroup.allreduce = _allreduce
MirrorGroup.broadcast = _broadcast
# The method names of torch 2.13 and, for the same collective, of earlier releases.
MirrorGroup.all_gather_single = MirrorGroup._allgather_base = _gather_single
MirrorGroup.allgather = _allgather
MirrorGroup.barrier = _barrier


def _create(store: Store, rank: int, size: int, timeout: timedelta) -> MirrorGroup:
    return MirrorGroup(rank, size)


@contextmanager
def mirror_world(device_type: str, size: int = 2) -> Iterator[MirrorGroup]:
    """The default group, for the block: this process is rank 0 of ``size`` mirrors."""
    register(MirrorGroup, _create, ["cpu", "cuda"])
    MirrorGroup.device_type = device_type
    dist.init_process_group(MirrorGroup.backend, store=FakeStore(), rank=0, world_size=size)
    try:
        group = dist.group.WORLD
        if not isinstance(group, MirrorGroup):
            raise TypeError(f"mirror_world: the default group is a {type(group).__qualname__}")
        yield group
    finally:
        dist.destroy_process_group()
