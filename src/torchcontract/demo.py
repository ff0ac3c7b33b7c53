"""The demo: train a small GPT on N local gloo processes, replicated, then sharded.

    python -m torchcontract.demo [--nproc N] [--steps S]

First ``replicate`` on the whole model and ``checkpoint`` on each transformer
block; the first step also runs a ``DistributedDataParallel`` copy of the
model on the same batch and compares gradients. Then ``fully_shard`` on each
block and on the root, side by side with PyTorch's own ``fully_shard`` on a
copy for the first step. For each, rank 0 draws a progress bar with the loss
averaged over ranks, then prints ``describe(model)``; each rank's API records
and the comparison with DDP follow the first, the per-rank parameter bytes and
the comparison of first-step losses with PyTorch's ``fully_shard`` the second.

Launched by ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set), each process joins the
``env://`` group torchrun describes and ``--nproc`` is ignored; otherwise the demo
starts ``--nproc`` ranks on this machine itself.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import cast

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from torchcontract import describe, registry
from torchcontract.apis import checkpoint, fully_shard, replicate
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.apis._torch import (
    all_gather_objects,
    all_reduce_blocking,
    barrier,
    manual_seed,
    optimizer_step,
)
from torchcontract.testing import run_distributed

__all__ = [
    "GPT",
    "GPTConfig",
    "Outcome",
    "Settings",
    "ShardedOutcome",
    "local_parameter_bytes",
    "main",
    "train",
    "train_sharded",
]


@attrs.frozen
class GPTConfig:
    """The shape of the demo model."""

    vocabulary: int = 64
    context: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 4
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a token sees only the tokens before it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.out = nn.Linear(config.width, config.width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = (
            part.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        y = functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        output: Tensor = self.out(y.transpose(1, 2).reshape(batch, length, width))
        return output


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a two-layer MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        output: Tensor = x + self.mlp(self.norm2(x))
        return output


class GPT(nn.Module):
    """A small GPT: token and position embeddings, blocks, and a head tied to the embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocabulary, config.width)
        self.positions = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocabulary, bias=False)
        self.head.weight = self.tokens.weight
        for name, parameter in self.named_parameters():
            if parameter.dim() > 1:  # embeddings and linear weights, as GPT-2 initializes them
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.norm(x))
        return logits


@attrs.frozen
class Settings:
    """What one demo run does."""

    steps: int = 40
    batch: int = 16
    learning_rate: float = 3e-3
    config: GPTConfig = GPTConfig()
    #: Train only the fully_shard phase, as HSDP: a (replicas, 2) mesh, sharded over 2.
    hsdp: bool = False


def synthetic_batch(config: GPTConfig, batch: int, rank: int, step: int) -> tuple[Tensor, Tensor]:
    """Sequences that count up mod the vocabulary from a random start, by a random stride.

    Predicting the next token means finding the stride in the context, so the loss
    falls well below ln(vocabulary) within a few dozen steps. Each rank and step
    draws its own batch.
    """
    generator = torch.Generator().manual_seed(1_000 * step + rank)
    start = torch.randint(0, config.vocabulary, (batch, 1), generator=generator)
    stride = torch.randint(1, 6, (batch, 1), generator=generator)
    sequence = (start + stride * torch.arange(config.context + 1)) % config.vocabulary
    return sequence[:, :-1], sequence[:, 1:]


def _loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits: Tensor = model(tokens)
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _compare_with_ddp(
    model: GPT, reference: GPT, tokens: Tensor, targets: Tensor, seed: int
) -> tuple[Tensor, float]:
    """Backward one batch through ``model`` and a DDP copy; the loss and largest grad gap."""
    ddp = DistributedDataParallel(reference)
    manual_seed(seed)
    loss = _loss(model, tokens, targets)
    torch.autograd.backward(loss)
    manual_seed(seed)
    torch.autograd.backward(_loss(ddp, tokens, targets))
    worst = 0.0
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        if mine.grad is None or theirs.grad is None:
            worst = math.inf
            break
        worst = max(worst, float((mine.grad - theirs.grad).abs().max()))
    gap = torch.tensor([worst])
    all_reduce_blocking(gap, dist.ReduceOp.MAX)
    return loss.detach(), float(gap)


class _ProgressBar:
    """A one-line bar with the loss, redrawn in place on a terminal, every tenth step otherwise."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total = total
        self.width = width
        self.started = time.perf_counter()
        self.interactive = sys.stdout.isatty()

    def show(self, done: int, loss: float) -> None:
        if not self.interactive and done % max(1, self.total // 10) and done != self.total:
            return
        filled = self.width * done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.started
        count = f"{done:>{len(str(self.total))}}/{self.total}"
        line = f"[{bar}] {count}  loss {loss:6.3f}  {elapsed:5.1f} s"
        end = "\n" if done == self.total or not self.interactive else ""
        print(("\r" if self.interactive else "") + line, end=end, flush=True)


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


def _train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: Settings,
    rank: int,
    world_size: int,
    *,
    first_loss: Tensor,
) -> list[float]:
    """Train ``settings.steps`` steps, the first one's backward already done; the mean losses.

    Rank 0 draws the progress bar.
    """
    bar = _ProgressBar(settings.steps) if rank == 0 else None
    losses: list[float] = []
    loss = first_loss
    for step in range(settings.steps):
        if step > 0:
            tokens, targets = synthetic_batch(settings.config, settings.batch, rank, step)
            manual_seed(1_000_000 * rank + step)
            loss = _loss(model, tokens, targets)
            torch.autograd.backward(loss)
        optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        all_reduce_blocking(mean)
        losses.append(float(mean) / world_size)
        if bar is not None:
            bar.show(step + 1, losses[-1])
    return losses


@attrs.frozen
class Outcome:
    """What one rank saw: the loss (averaged over ranks) first and last, and the DDP gap."""

    first_loss: float
    final_loss: float
    ddp_gradient_gap: float


def train(rank: int, world_size: int, settings: Settings) -> Outcome:
    """Train the demo GPT on this rank of the current process group.

    Rank 0 prints the progress bar and the report.
    """
    config = settings.config
    manual_seed(0)
    model = GPT(config)
    reference = copy.deepcopy(model)  # a copy carries no API state: the DDP baseline
    for block in model.blocks:
        checkpoint(block)
    replicate(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)

    tokens, targets = synthetic_batch(config, settings.batch, rank, 0)
    loss, gap = _compare_with_ddp(model, reference, tokens, targets, seed=rank)
    del reference
    losses = _train_steps(model, optimizer, settings, rank, world_size, first_loss=loss)

    lines = all_gather_objects(_record_lines(rank, model))
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        print(f"\ndescribe(model)  ({parameters:,} parameters, {world_size} ranks, gloo)")
        print(describe(model))
        print("\nregistry(model):", ", ".join(entry.api.name for entry in registry(model).values()))
        print("\nper-rank state")
        for rank_lines in lines:
            print("\n".join(f"  {line}" for line in _strings(rank_lines)))
        verdict = "yes" if gap <= 1e-6 else "NO"
        print(
            f"\ngradients matched DistributedDataParallel's on the first step: {verdict} "
            f"(largest difference {gap:.1e} over all ranks, tolerance 1e-6)"
        )
    return Outcome(losses[0], losses[-1], gap)


@attrs.frozen
class ShardedOutcome:
    """What one rank saw under ``fully_shard``: losses, the gap to PyTorch's, its bytes."""

    first_loss: float
    final_loss: float
    torch_loss_gap: float
    local_bytes: int
    full_bytes: int


def local_parameter_bytes(model: nn.Module) -> int:
    """The parameter bytes this rank stores: its shards."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )


def _compare_first_losses(
    model: GPT, reference: GPT, tokens: Tensor, targets: Tensor, seed: int
) -> tuple[Tensor, float]:
    """Backward one batch through ``model``; its loss and the largest gap to ``reference``'s."""
    manual_seed(seed)
    loss = _loss(model, tokens, targets)
    torch.autograd.backward(loss)
    manual_seed(seed)
    theirs = _loss(reference, tokens, targets).detach()
    difference = torch.tensor([float((loss.detach() - theirs).abs())])
    all_reduce_blocking(difference, dist.ReduceOp.MAX)
    return loss.detach(), float(difference)


def train_sharded(rank: int, world_size: int, settings: Settings) -> ShardedOutcome:
    """Train the demo GPT with ``fully_shard`` on each block and the root, on this rank.

    The first step also runs PyTorch's ``fully_shard`` on a copy, on the same batch,
    and compares the losses. Rank 0 prints the progress bar and the report.
    """
    config = settings.config
    manual_seed(0)
    model = GPT(config)
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

    tokens, targets = synthetic_batch(config, settings.batch, rank, 0)
    if compare:
        loss, gap = _compare_first_losses(model, reference, tokens, targets, seed=rank)
    else:
        manual_seed(rank)
        loss = _loss(model, tokens, targets)
        torch.autograd.backward(loss)
        gap = math.nan
    del reference
    losses = _train_steps(model, optimizer, settings, rank, world_size, first_loss=loss)
    local = local_parameter_bytes(model)
    sizes = all_gather_objects(local)
    if rank == 0:
        print(f"\ndescribe(model)  (fully_shard on each block and the root, {layout})")
        print(describe(model))
        shares = ", ".join(f"rank {index}: {size:,}" for index, size in enumerate(sizes))
        print(f"\nparameter bytes per rank: {shares} of {full_bytes:,} for the whole model")
        if math.isnan(gap):
            print(
                f"first-step losses not compared: PyTorch's fully_shard does not run on CPU "
                f"with torch {torch.__version__}"
            )
        else:
            verdict = "yes" if gap <= 1e-6 else "NO"
            print(
                f"first-step losses matched PyTorch's fully_shard: {verdict} "
                f"(largest difference {gap:.1e} over all ranks, tolerance 1e-6)"
            )
    return ShardedOutcome(losses[0], losses[-1], gap, local, full_bytes)


def _run_both(rank: int, world_size: int, settings: Settings) -> tuple[Outcome, ShardedOutcome]:
    """Both phases on this rank: replicated, then sharded."""
    replicated = train(rank, world_size, settings)
    if rank == 0:
        print(
            f"\nnow fully_shard on each block and the root, for {settings.steps} steps",
            flush=True,
        )
    return replicated, train_sharded(rank, world_size, settings)


def _strings(value: object) -> list[str]:
    if isinstance(value, list):
        return [str(item) for item in cast(list[object], value)]
    return [str(value)]


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torchcontract.demo",
        description="Train a small GPT with replicate and checkpoint, then with fully_shard, "
        "on local gloo processes.",
    )
    parser.add_argument(
        "--nproc", type=int, default=None, help="processes to start (default 2; 4 with --hsdp)"
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument(
        "--hsdp",
        action="store_true",
        help="train only with fully_shard, as HSDP: 2-way sharding, replicated over the "
        "processes' pairs (an even --nproc; default 4)",
    )
    arguments = parser.parse_args(argv)
    if arguments.nproc is None:
        arguments.nproc = 4 if arguments.hsdp else 2
    return arguments


def _run(rank: int, world_size: int, settings: Settings) -> object:
    """This rank's demo: both phases, or with ``hsdp`` the sharded one alone."""
    if settings.hsdp:
        return train_sharded(rank, world_size, settings)
    return _run_both(rank, world_size, settings)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the demo: under torchrun as one of its ranks, otherwise by starting ``--nproc``."""
    arguments = _arguments(argv)
    if arguments.nproc < 1 or arguments.steps < 1:
        raise SystemExit("--nproc and --steps must be at least 1")
    hsdp: bool = arguments.hsdp
    nproc: int = arguments.nproc
    world_size = int(os.environ.get("WORLD_SIZE") or nproc)
    if hsdp and world_size % 2:
        raise SystemExit(
            f"--hsdp shards over pairs of processes: needs an even count, got {world_size}"
        )
    settings = Settings(steps=arguments.steps, hsdp=hsdp)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")  # env://, as torchrun sets it up
        try:
            _run(dist.get_rank(), dist.get_world_size(), settings)
            # Tear the group down together: a rank destroying its group while another
            # still talks to it can abort in gloo's teardown.
            barrier()
        finally:
            dist.destroy_process_group()
        # Done, and the group is down: leave without finalizing the interpreter, where
        # torch's C++ threads now and then abort the process (SIGABRT, "terminate called
        # without an active exception") after the demo has finished and reported.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    started = time.perf_counter()
    what = (
        "fully_shard on each block and the root, as HSDP"
        if hsdp
        else "replicate on the model, checkpoint on each block"
    )
    print(
        f"training a small GPT on {arguments.nproc} gloo processes for {settings.steps} steps: "
        f"{what}",
        flush=True,
    )
    run_distributed(_run, arguments.nproc, timeout=600.0, args=(settings,))
    print(f"\ndone in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
