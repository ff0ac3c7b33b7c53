"""The second phase: ``fully_shard`` on each block and the root (or HSDP), beside FSDP2."""

from __future__ import annotations

import copy
import math
from functools import partial

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract import describe
from torchcontract.apis import fully_shard
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.apis._objects import all_gather_objects
from torchcontract.apis._torch import all_reduce_blocking, manual_seed

from ._loop import Settings, comparison_line, loss_of, same_randomness, train_loop
from ._model import GPT

__all__ = ["ShardedOutcome", "local_parameter_bytes", "train_sharded"]


@attrs.frozen
class ShardedOutcome:
    """What one rank saw under ``fully_shard``: losses, the gap to PyTorch's, its bytes.

    As in ``Outcome``, the first loss is the first one trained in this run.
    """

    first_loss: float
    final_loss: float
    torch_loss_gap: float
    local_bytes: int
    full_bytes: int
    final_line: str
    #: The step this run resumed from; None when it started from scratch.
    resumed_from: int | None
    #: The digest of the final parameters: the same on every rank.
    digest: str


def local_parameter_bytes(model: nn.Module) -> int:
    """The parameter bytes this rank stores: its shards."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )


def _compare_first_losses(
    model: GPT, reference: GPT, tokens: Tensor, targets: Tensor
) -> tuple[Tensor, float]:
    """Backward one batch through ``model``; its loss and the largest gap to ``reference``'s."""

    def ours() -> Tensor:
        loss = loss_of(model, tokens, targets)
        torch.autograd.backward(loss)
        return loss.detach()

    loss, theirs = same_randomness(ours, lambda: loss_of(reference, tokens, targets).detach())
    difference = torch.tensor([float((loss - theirs).abs())])
    all_reduce_blocking(difference, dist.ReduceOp.MAX)
    return loss, float(difference)


def _first_step_alone(model: GPT, tokens: Tensor, targets: Tensor) -> tuple[Tensor, float]:
    """Backward one batch through ``model``, compared with nothing (NaN)."""
    loss = loss_of(model, tokens, targets)
    torch.autograd.backward(loss)
    return loss.detach(), math.nan


def train_sharded(rank: int, world_size: int, settings: Settings) -> ShardedOutcome:
    """Train the demo GPT with ``fully_shard`` on each block and the root, on this rank.

    The first step also runs PyTorch's ``fully_shard`` on a copy, on the same batch,
    and compares the losses. Rank 0 prints the progress bar and the report.
    """
    manual_seed(0)
    model = GPT(settings.config)
    reference = copy.deepcopy(model)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if settings.hsdp:  # FSDP2's HSDP: shard over the inner dim, replicate over the outer
        shape = (world_size // 2, 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        layout = f"HSDP, {shape[0]} replicas x {shape[1]} shards"
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        layout = f"{world_size} ranks"
    compare = REFERENCE_FULLY_SHARD_ON_CPU
    for block, twin in zip(model.blocks, reference.blocks, strict=True):
        fully_shard(block, mesh=mesh)
        if compare:
            torch_fully_shard(twin, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if compare:
        torch_fully_shard(reference, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
    first_step = (
        partial(_compare_first_losses, model, reference)
        if compare
        else partial(_first_step_alone, model)
    )
    phase = "hsdp" if settings.hsdp else "fully_shard"
    run = train_loop(
        model, optimizer, settings, rank, world_size, phase=phase, first_step=first_step
    )
    local = local_parameter_bytes(model)
    sizes = all_gather_objects(local)
    if rank == 0:
        print(f"\ndescribe(model)  (fully_shard on each block and the root, {layout})")
        print(describe(model))
        shares = ", ".join(f"rank {index}: {size:,}" for index, size in enumerate(sizes))
        print(f"\nparameter bytes per rank: {shares} of {full_bytes:,} for the whole model")
        if compare or run.resumed_from is not None:
            print(comparison_line("first-step losses matched PyTorch's fully_shard", run))
        else:
            print(
                f"first-step losses not compared: PyTorch's fully_shard does not run on CPU "
                f"with torch {torch.__version__}"
            )
    losses = run.losses or (run.final.loss,)
    return ShardedOutcome(
        losses[0],
        losses[-1],
        run.gap,
        local,
        full_bytes,
        run.final_line,
        run.resumed_from,
        run.digest,
    )
