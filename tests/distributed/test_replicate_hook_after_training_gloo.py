"""A communication hook registered after training began sees DDP's buckets, on 2 gloo ranks.

Both sides train one step without a hook (replicate rebuilds its buckets after it,
DDP only without unused parameters found), then register the recording hook and
train two more. With ``find_unused_parameters=True`` DDP keeps its first
assignment; with ``False`` it rebuilt them in rank 0's arrival order: the hook
sees the same buckets (index, size, shapes, last one) in the same order on
both sides, and the gradients are equal.
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

STEPS: Final = 3


def _train(
    model: nn.Module, raw: Net, rank: int, register: object, find_unused: bool
) -> list[list[Tensor]]:
    """Train ``STEPS`` steps, calling ``register()`` after the first."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    grads: list[list[Tensor]] = []
    for step in range(STEPS):
        if step == 1:
            assert callable(register)
            register()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + step))
        # Without unused parameters found, every rank uses the branch.
        model(x, not find_unused or rank == 0).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in raw.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad()
    return grads


def _run(find_unused: bool, rank: int) -> HookResult:
    mine = replicate(seeded_net(), bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused)
    assert isinstance(mine, ReplicateModule)
    ours_state = Recorder()
    ours = _train(
        mine,
        mine,
        rank,
        lambda: mine.register_comm_hook(ours_state, recording_hook),
        find_unused,
    )
    raw = seeded_net()
    ddp = DistributedDataParallel(raw, bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused)
    theirs_state = Recorder()
    theirs = _train(
        ddp,
        raw,
        rank,
        lambda: ddp.register_comm_hook(theirs_state, recording_hook),
        find_unused,
    )
    gap = 0.0
    for a, b in zip(ours, theirs, strict=True):
        assert len(a) == len(b)
        gap = max(gap, *(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)))
    return HookResult(gap, ours_state.seen, theirs_state.seen)


def _job(rank: int, world_size: int) -> dict[bool, HookResult]:
    return {find_unused: _run(find_unused, rank) for find_unused in (True, False)}


@pytest.fixture(scope="module")
def results() -> list[dict[bool, HookResult]]:
    return run_distributed(_job, 2, timeout=120)


@pytest.mark.parametrize("find_unused", [True, False])
def test_a_hook_registered_after_a_step_sees_ddps_buckets(
    results: list[dict[bool, HookResult]], find_unused: bool
) -> None:
    for by_find_unused in results:
        result = by_find_unused[find_unused]
        assert result.ours_seen == result.theirs_seen
        assert len(result.ours_seen) >= 2 * 3  # several buckets in each step with the hook
        assert result.gap == 0.0, f"gradients differ from DDP's by {result.gap}"
