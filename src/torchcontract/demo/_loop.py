"""The training loop both phases share: steps, checkpoints, resume, and the final line.

Each rank draws its dropout masks from its own generator, seeded once with its rank
and saved in every checkpoint with the rest of the run's state; batch ``i`` is a
function of the rank and ``i``. So a run that resumes from a checkpoint computes
what the uninterrupted run computed after that step, bit for bit, and ends with the
same final line: ``final (PHASE): step N loss X parameters SHA``, SHA the first 16 hex
digits of a SHA-256 of the full parameters in FQN order. Every rank computes it (the loss
is averaged over ranks, the parameters gathered); rank 0 prints it once, after checking
that every rank's line is the same.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

import attrs
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn import functional

from torchcontract.apis._objects import all_gather_objects
from torchcontract.apis._torch import all_reduce_blocking, manual_seed, optimizer_step, to_ints

from ._checkpoints import Checkpoints, Progress
from ._model import GPTConfig, synthetic_batch

__all__ = [
    "FirstStep",
    "Run",
    "Settings",
    "comparison_line",
    "loss_of",
    "parameter_digest",
    "same_randomness",
    "train_loop",
]

_T = TypeVar("_T")
_U = TypeVar("_U")

#: How long ``pause_after_checkpoint`` holds the ranks: far longer than a drill needs.
PAUSE_SECONDS: Final = 600.0


@attrs.frozen
class Settings:
    """What one demo run does."""

    steps: int = 40
    batch: int = 16
    learning_rate: float = 3e-3
    config: GPTConfig = attrs.field(factory=GPTConfig)
    #: Train only the fully_shard phase, as HSDP: a (replicas, 2) mesh, sharded over 2.
    hsdp: bool = False
    #: Where each phase keeps its checkpoints (a subdirectory per phase); None: none.
    checkpoint_dir: str | None = None
    #: Save a checkpoint every this many steps, and after the last.
    checkpoint_every: int = 10
    #: A fault drill: after publishing this step's checkpoint, on a first attempt (not a
    #: restart by torchrun), every rank waits ``PAUSE_SECONDS`` for a worker to be killed.
    pause_after_checkpoint: int | None = None


def loss_of(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """The next-token cross-entropy of ``model`` on one batch."""
    logits: Tensor = model(tokens)
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


#: The first step's forward and backward on its batch, compared with a reference
#: implementation: the loss and the largest difference found (over all ranks).
FirstStep = Callable[[Tensor, Tensor], tuple[Tensor, float]]


@attrs.frozen
class Run:
    """What one phase's training did on this rank."""

    #: The phase's name: ``replicate``, ``fully_shard`` or ``hsdp``.
    phase: str
    #: The step it resumed from; None when it started from scratch.
    resumed_from: int | None
    #: The first step's difference to the reference; NaN when that step was not run here.
    gap: float
    #: The loss averaged over ranks, of each step trained in this run.
    losses: tuple[float, ...]
    final: Progress
    digest: str

    @property
    def final_line(self) -> str:
        """``final (PHASE): step N loss X parameters SHA``, the same on every rank."""
        return (
            f"final ({self.phase}): step {self.final.step} loss {self.final.loss:.6f} "
            f"parameters {self.digest}"
        )


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: Settings,
    rank: int,
    world_size: int,
    *,
    phase: str,
    first_step: FirstStep,
) -> Run:
    """Train ``model`` up to ``settings.steps``, from the newest checkpoint of ``phase`` if any.

    Saves a checkpoint every ``settings.checkpoint_every`` steps and after the last.
    Rank 0 draws the progress bar and prints the final line once, or every rank's line
    if they differ. Collective.
    """
    manual_seed(rank)  # this rank's dropout: the same stream whether or not it resumes
    checkpoints = (
        None
        if settings.checkpoint_dir is None
        else Checkpoints(Path(settings.checkpoint_dir) / phase, rank, world_size)
    )
    progress, resumed_from = Progress(0, math.nan), None
    if checkpoints is not None:
        checkpoints.prepare()
        newest = checkpoints.newest()
        if newest is not None:
            progress = checkpoints.load(newest, model, optimizer)
            resumed_from = progress.step
            if rank == 0:
                print(f"{phase}: resuming from {newest}", flush=True)
    bar = _ProgressBar(settings.steps) if rank == 0 else None
    losses: list[float] = []
    gap = math.nan
    for step in range(progress.step, settings.steps):
        tokens, targets = synthetic_batch(settings.config, settings.batch, rank, step)
        if step == 0:
            loss, gap = first_step(tokens, targets)
        else:
            loss = loss_of(model, tokens, targets)
            torch.autograd.backward(loss)
        optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        all_reduce_blocking(mean)
        losses.append(float(mean) / world_size)
        progress = Progress(step + 1, losses[-1])
        if bar is not None:
            bar.show(progress.step, progress.loss)
        if checkpoints is not None and (
            progress.step % settings.checkpoint_every == 0 or progress.step == settings.steps
        ):
            checkpoints.save(model, optimizer, progress)
            _pause_if_drilled(settings, progress.step)
    run = Run(phase, resumed_from, gap, tuple(losses), progress, parameter_digest(model))
    lines = [str(line) for line in all_gather_objects(run.final_line)]
    if rank == 0:
        if len(set(lines)) == 1:
            print(run.final_line, flush=True)
        else:  # never expected: the loss is averaged and the digest gathered
            print(f"{phase}: the ranks disagree on the final line", flush=True)
            for index, line in enumerate(lines):
                print(f"  rank {index}: {line}", flush=True)
    return run


def parameter_digest(model: nn.Module) -> str:
    """16 hex digits of a SHA-256 of the full parameters and buffers in FQN order; collective.

    Sharded entries are gathered first, so every rank computes the same digest.
    """
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        digest.update(name.encode())
        digest.update(bytes(to_ints(full.detach().contiguous().view(torch.uint8).flatten())))
    return digest.hexdigest()[:16]


def _pause_if_drilled(settings: Settings, step: int) -> None:
    """Hold the ranks after ``settings.pause_after_checkpoint``'s save, on a first attempt."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if settings.pause_after_checkpoint == step and first_attempt:
        print(f"step {step} saved: pausing for a fault drill", flush=True)
        time.sleep(PAUSE_SECONDS)


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


def same_randomness(ours: Callable[[], _T], theirs: Callable[[], _U]) -> tuple[_T, _U]:
    """Run ``ours``, then ``theirs`` from the same RNG state; leave the state as ``ours`` did.

    The reference implementation draws the same dropout masks, and training goes on
    as if it had not run.
    """
    before = torch.get_rng_state()
    mine = ours()
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    try:
        return mine, theirs()
    finally:
        torch.set_rng_state(after)


def comparison_line(claim: str, run: Run) -> str:
    """``claim: yes (largest difference ...)``, or why the first step was not compared."""
    if run.resumed_from is not None:
        return f"{claim}: not compared (resumed from step {run.resumed_from})"
    verdict = "yes" if run.gap <= 1e-6 else "NO"
    return f"{claim}: {verdict} (largest difference {run.gap:.1e} over all ranks, tolerance 1e-6)"
