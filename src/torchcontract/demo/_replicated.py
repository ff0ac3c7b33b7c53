"""The first phase: ``replicate`` on the model and ``checkpoint`` on each block, beside DDP."""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import cast

import attrs
import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from torchcontract import describe, registry
from torchcontract.apis import checkpoint, replicate
from torchcontract.apis._objects import all_gather_objects
from torchcontract.apis._torch import all_reduce_blocking, manual_seed

from ._loop import Settings, comparison_line, loss_of, same_randomness, train_loop
from ._model import GPT

__all__ = ["Outcome", "train"]


@attrs.frozen
class Outcome:
    """What one rank saw: the loss (averaged over ranks) first and last, and the DDP gap.

    The first loss is the first one trained in this run (the checkpoint's when it
    resumed at the end); the gap is NaN when the run resumed.
    """

    first_loss: float
    final_loss: float
    ddp_gradient_gap: float
    final_line: str
    #: The step this run resumed from; None when it started from scratch.
    resumed_from: int | None
    #: The digest of the final parameters: the same on every rank.
    digest: str


def _compare_with_ddp(
    model: GPT, reference: GPT, tokens: Tensor, targets: Tensor
) -> tuple[Tensor, float]:
    """Backward one batch through ``model`` and a DDP copy; the loss and largest grad gap.

    The copy takes ``find_unused_parameters=True`` as ``replicate`` does here, so both
    reduce the same buckets; every parameter is used, so DDP warns once per process that
    the setting was not needed (getting-started explains the warning to the demo's users).
    """
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)

    def backward(module: torch.nn.Module) -> Tensor:
        loss = loss_of(module, tokens, targets)
        torch.autograd.backward(loss)
        return loss.detach()

    loss, _ = same_randomness(partial(backward, model), partial(backward, ddp))
    worst = 0.0
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        if mine.grad is None or theirs.grad is None:
            worst = math.inf
            break
        worst = max(worst, float((mine.grad - theirs.grad).abs().max()))
    gap = torch.tensor([worst])
    all_reduce_blocking(gap, dist.ReduceOp.MAX)
    return loss, float(gap)


def _record_lines(rank: int, model: GPT) -> list[str]:
    state = replicate.state(model)
    sizes = " + ".join(str(len(bucket)) for bucket in state.buckets)
    group = state.process_group
    where = "no group" if group is None else f"{group.name()} rank {group.rank()} of {group.size()}"
    lines = [
        f"rank {rank}  replicate   on GPT: {where}, {len(state.buckets)} bucket(s) of {sizes} "
        f"parameters, step={state.step}, sync_gradients={state.sync_gradients}"
    ]
    for index, block in enumerate(model.blocks):
        record = checkpoint.state(block)
        lines.append(
            f"rank {rank}  checkpoint  on blocks.{index}: use_reentrant={record.use_reentrant}, "
            f"preserve_rng_state={record.preserve_rng_state}, enabled={record.enabled}"
        )
    return lines


def train(rank: int, world_size: int, settings: Settings) -> Outcome:
    """Train the demo GPT on this rank of the current process group.

    The first step also runs a ``DistributedDataParallel`` copy of the model on the
    same batch and compares gradients. Rank 0 prints the progress bar and the report.
    """
    manual_seed(0)
    model = GPT(settings.config)
    reference = copy.deepcopy(model)  # a copy carries no API state: the DDP baseline
    for block in model.blocks:
        checkpoint(block)
    # Buckets that are never rebuilt: a run resumed from a checkpoint then sums each
    # gradient in the same order as the uninterrupted one did, so both end on the same bits
    # on any number of ranks (a rebuild after the first backward would change the order).
    replicate(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
    run = train_loop(
        model,
        optimizer,
        settings,
        rank,
        world_size,
        phase="replicate",
        first_step=partial(_compare_with_ddp, model, reference),
    )
    lines = all_gather_objects(_record_lines(rank, model))
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        print(f"\ndescribe(model)  ({parameters:,} parameters, {world_size} ranks, gloo)")
        print(describe(model))
        print("\nregistry(model):", ", ".join(entry.api.name for entry in registry(model).values()))
        print("\nper-rank state")
        for rank_lines in lines:
            print("\n".join(f"  {line}" for line in _strings(rank_lines)))
        print(
            "\n"
            + comparison_line("gradients matched DistributedDataParallel's on the first step", run)
        )
    losses = run.losses or (run.final.loss,)
    return Outcome(losses[0], losses[-1], run.gap, run.final_line, run.resumed_from, run.digest)


def _strings(value: object) -> list[str]:
    if isinstance(value, list):
        return [str(item) for item in cast(list[object], value)]
    return [str(value)]
