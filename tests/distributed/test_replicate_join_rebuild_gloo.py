"""Under Join, buckets rebuilt while the first rank has joined, against DDP's on 2 gloo ranks.

With a communication hook and ``find_unused_parameters=False`` the buckets are
rebuilt after the first synchronizing backward in the first rank's arrival
order. Here rank 0 has no batch at all and rank 1 has three: rank 0 joins at
once, and, as DDP's joined rank, counts every parameter as arrived in definition
order, which the rebuild takes. The recording hook sees the same buckets on
both sides, on both ranks (the joined one reduces zeros through it), and the
gradients and final parameters equal DDP's.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch
from replicate_hook_recorder import CAP_MB, HookResult, Net, Recorder, recording_hook, seeded_net
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.apis.replicate import ReplicateModule
from torchcontract.testing import run_distributed

BATCHES: Final = (0, 3)


def _train(model: nn.Module, raw: Net, rank: int) -> list[Tensor]:
    """The gradients after each of this rank's steps, then the final parameters."""
    assert isinstance(model, (ReplicateModule, DistributedDataParallel))
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    seen: list[Tensor] = []
    with model.join():
        for index in range(BATCHES[rank]):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(index))
            torch.autograd.backward(_output(model, x).pow(2).mean())
            seen.extend(p.grad.clone() for p in raw.parameters() if p.grad is not None)
            optimizer.step()
            optimizer.zero_grad()
    seen.extend(p.detach().clone() for p in raw.parameters())
    return seen


def _output(model: nn.Module, x: Tensor) -> Tensor:
    out: Tensor = model(x, True)
    return out


def _job(rank: int, world_size: int) -> HookResult:
    mine = replicate(seeded_net(), bucket_cap_mb=CAP_MB, find_unused_parameters=False)
    assert isinstance(mine, ReplicateModule)
    ours_state = Recorder()
    mine.register_comm_hook(ours_state, recording_hook)
    ours = _train(mine, mine, rank)
    raw = seeded_net()
    ddp = DistributedDataParallel(raw, bucket_cap_mb=CAP_MB, find_unused_parameters=False)
    theirs_state = Recorder()
    ddp.register_comm_hook(theirs_state, recording_hook)
    theirs = _train(ddp, raw, rank)
    assert len(ours) == len(theirs)
    gap = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    return HookResult(gap, ours_state.seen, theirs_state.seen)


@pytest.fixture(scope="module")
def results() -> list[HookResult]:
    return run_distributed(_job, 2, timeout=120)


def test_buckets_rebuilt_while_the_first_rank_has_joined_are_ddps(
    results: list[HookResult],
) -> None:
    for result in results:
        assert result.ours_seen == result.theirs_seen
        assert len(result.ours_seen) >= 3 * 2  # several buckets after the rebuild


def test_numbers_equal_ddps(results: list[HookResult]) -> None:
    for result in results:
        assert result.gap == 0.0, f"differs from DDP's by {result.gap}"
