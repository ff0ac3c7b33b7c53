"""A model with a branch and a communication hook that records the buckets it is given.

Shared by the replicate gloo tests that compare the buckets a hook sees with
DistributedDataParallel's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket

#: A few KiB: the model's parameters fall into several buckets.
CAP_MB: Final = 4200 / (1024 * 1024)

__all__ = [
    "CAP_MB",
    "HookResult",
    "Net",
    "Recorder",
    "Seen",
    "all_reduce_mean",
    "annotate_for_ddp",
    "recording_hook",
    "seeded_net",
]


class Net(nn.Module):
    """Three layers and a branch ``side`` that only rank 0 uses."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 32)
        self.side = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor, use_side: bool) -> Tensor:
        h = torch.relu(self.second(torch.relu(self.first(x))))
        if use_side:
            h = h + self.side(h)
        out: Tensor = self.head(h)
        return out


#: What a hook saw of one bucket: index, last, buffer size, gradient and parameter shapes.
Seen = tuple[int, bool, int, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


@attrs.define
class Recorder:
    """State of ``recording_hook``: every bucket it was given."""

    seen: list[Seen] = attrs.field(factory=list)


def recording_hook(state: Recorder, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """Record the bucket, give it a buffer of its own, all-reduce it and divide."""
    state.seen.append(
        (
            bucket.index(),
            bucket.is_last(),
            bucket.buffer().numel(),
            tuple(tuple(g.shape) for g in bucket.gradients()),
            tuple(tuple(p.shape) for p in bucket.parameters()),
        )
    )
    bucket.set_buffer(bucket.buffer().clone())
    return all_reduce_mean(bucket.buffer())


def all_reduce_mean(buffer: Tensor) -> torch.futures.Future[Tensor]:
    """Divide ``buffer`` by the world size and all-reduce it in place, as DDP's default hook."""
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    reduced: torch.futures.Future[list[Tensor]] = work.get_future()
    return reduced.then(lambda future: future.value()[0])


def annotate_for_ddp(hook: Callable[..., object], state: type) -> None:
    """Give ``hook`` its annotations as objects: DDP compares them as written, and a module
    with postponed annotations has them as strings."""
    hook.__annotations__ = {
        "state": state,
        "bucket": GradBucket,
        "return": torch.futures.Future[Tensor],
    }


annotate_for_ddp(recording_hook, Recorder)


def seeded_net() -> Net:
    """The model, with the same parameters on every rank and side."""
    torch.manual_seed(0)
    return Net()


@attrs.frozen
class HookResult:
    """One rank's comparison: the largest gap to DDP's numbers and what each hook saw."""

    gap: float
    ours_seen: list[Seen]
    theirs_seen: list[Seen]
