"""replicate's forward work runs before the module's own forward pre-hooks, as DDP's does.

DDP's forward first does its own work (here: broadcasting rank 0's buffers) and only
then calls the module, whose pre-hooks therefore see the synchronized buffers. A
pre-hook registered on the module before ``replicate`` must see the same. On 2 gloo
ranks, rank 1 changes its buffer after wrapping; the hook records what it sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.testing import run_distributed


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.linear(x) * self.scale
        return out


def _seen(rank: int, wrap: Callable[..., Any]) -> float:
    module = WithBuffer()
    seen: list[float] = []
    module.register_forward_pre_hook(lambda hooked, args: seen.append(float(hooked.scale)))
    model = wrap(module)
    if rank == 1:
        module.get_buffer("scale").fill_(5.0)  # rank 0 keeps 1.0: the forward broadcasts it
    model(torch.ones(1, 2))
    return seen[0]


def _job(rank: int, world_size: int) -> tuple[float, float]:
    return _seen(rank, replicate), _seen(rank, DistributedDataParallel)


def test_a_pre_hook_registered_before_replicate_sees_the_synchronized_buffers() -> None:
    for ours, theirs in run_distributed(_job, 2, timeout=60):
        assert ours == theirs == 1.0
