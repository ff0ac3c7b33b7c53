"""A rank that dies mid-step: its peers fail, they do not wait for ever in anything of ours.

The victim SIGKILLs itself while our collectives are in flight: a bucket's
all-reduce under ``replicate``, a prefetched all-gather in ``fully_shard``'s
forward, the reduce-scatters and all-gathers of its backward, HSDP's all-reduce
across replicas. Every survivor must fail within the group's (short) timeout, with
torch's error or ours: ``run_distributed`` waits that long for them (``grace``), so a
survivor that hung would be killed without a failure of its own in the notes. The
dead rank is the cause ``run_distributed`` raises.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable
from typing import Final, NoReturn, cast

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from torchcontract.apis import fully_shard, replicate
from torchcontract.demo import GPT, GPTConfig, synthetic_batch
from torchcontract.testing import RankFailedError, run_distributed

#: The group's timeout, and how long the survivors have to fail once the victim died.
TIMEOUT: Final = 30.0
CONFIG: Final = GPTConfig(width=32, layers=3, dropout=0.0)


def _die(*_: object) -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL is not caught")


def _on_gradient(tensor: Tensor, hook: Callable[[Tensor], None]) -> None:
    cast(Callable[[Callable[[Tensor], None]], object], tensor.register_hook)(hook)


def _die_in_backward(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    """Die when the gradient of ``module``'s output is computed: mid-backward."""
    _on_gradient(output, _die)


def _shard(model: GPT, world_size: int, hsdp: bool) -> None:
    shape = (world_size // 2, 2) if hsdp else (world_size,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    blocks = [block for block in model.blocks if isinstance(block, FSDPModule)]
    for this, following in itertools.pairwise(blocks):
        this.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([this])


def _train_until_a_rank_dies(rank: int, world_size: int, scenario: str) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    victim = rank == world_size - 1
    if scenario == "replicate":
        replicate(model, bucket_cap_mb=0.01)  # one bucket per few parameters
        if victim:  # the positions' gradient comes late: later buckets are in flight
            _on_gradient(model.positions.weight, _die)
    else:
        _shard(model, world_size, hsdp=scenario == "hsdp backward")
        mlp = model.blocks[1].mlp
        assert isinstance(mlp, nn.Module)
        if victim and scenario == "fully_shard forward":
            # blocks.1 runs with blocks.2's all-gather prefetched and pending
            mlp.register_forward_hook(_die)
        elif victim:
            mlp.register_forward_hook(_die_in_backward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        tokens, targets = synthetic_batch(CONFIG, 4, rank, step)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    ("scenario", "world_size"),
    [
        ("replicate", 2),
        ("fully_shard forward", 2),
        ("fully_shard backward", 2),
        ("hsdp backward", 4),
    ],
)
def test_survivors_fail_and_the_dead_rank_is_the_cause(scenario: str, world_size: int) -> None:
    victim = world_size - 1
    with pytest.raises(
        RankFailedError, match=rf"rank {victim} of {world_size} exited with code -9"
    ) as caught:
        run_distributed(
            _train_until_a_rank_dies, world_size, timeout=TIMEOUT, grace=TIMEOUT, args=(scenario,)
        )
    notes = "\n".join(caught.value.__notes__)
    for survivor in range(victim):
        assert f"then rank {survivor} failed" in notes, notes
