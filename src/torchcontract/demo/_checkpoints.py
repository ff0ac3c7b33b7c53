"""Checkpoints of a training run with ``torch.distributed.checkpoint``: complete or absent.

A checkpoint holds the model, the optimizer, the step (which is also the data
position: batch ``i`` is a function of the rank and ``i``), the last step's loss,
and each rank's RNG states (torch's and Python's), in ``DIRECTORY/step-NNNNNN``.
Every rank writes its part into ``step-NNNNNN.partial``; once all have written and
rank 0 has written the metadata, rank 0 renames the directory to its final name,
an atomic step on a POSIX file system. A worker killed while saving leaves a
``.partial`` directory, which no load reads and the next run removes: the newest
``step-NNNNNN`` is always whole. Every rank must see the same directory (on several
machines, a shared file system).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, cast

import attrs
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from torchcontract.apis._objects import all_gather_objects
from torchcontract.apis._torch import barrier

__all__ = ["Checkpoints", "Progress"]

#: ``save(state, checkpoint_id=...)`` and ``load(state, checkpoint_id=...)``; collective.
save_checkpoint: Final = cast(Callable[..., object], state_dict_saver.save)
load_checkpoint: Final = cast(Callable[..., None], state_dict_loader.load)

_COMPLETE: Final = re.compile(r"step-(\d{6})")
_PARTIAL_SUFFIX: Final = ".partial"


@attrs.frozen
class Progress:
    """How far a run is: steps done (the next batch's index) and the last step's mean loss."""

    step: int
    loss: float


@attrs.frozen
class Checkpoints:
    """The checkpoints of one training phase in ``directory``, as seen by rank ``rank``."""

    directory: Path
    rank: int
    world_size: int

    def prepare(self) -> None:
        """Create the directory and remove what a killed save left; collective."""
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for partial in self.directory.glob(f"*{_PARTIAL_SUFFIX}"):
                shutil.rmtree(partial)
        barrier()

    def newest(self) -> Path | None:
        """The newest complete checkpoint, as rank 0 sees it, on every rank; collective."""
        found = _newest_complete(self.directory) if self.rank == 0 else None
        chosen = all_gather_objects(None if found is None else str(found))[0]
        return None if chosen is None else Path(str(chosen))

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress) -> Path:
        """Write a checkpoint of ``progress``, then publish it by renaming; collective.

        Returns the published directory. Until the rename, a load sees the previous one.
        """
        final = self.directory / f"step-{progress.step:06d}"
        partial = final.with_name(final.name + _PARTIAL_SUFFIX)
        state = _state(model, optimizer, progress, self.rank, self.world_size)
        save_checkpoint(state, checkpoint_id=partial)
        # It returns on every rank once rank 0 has written the metadata: all is on disk.
        if self.rank == 0:
            partial.rename(final)
            _sync_directory(self.directory)
        barrier()
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Progress:
        """Load the checkpoint at ``path`` into ``model``, ``optimizer`` and this rank's RNGs.

        Raises ``ValueError`` if another number of ranks saved it: each rank resumes the
        RNG states and the batches of the rank with its number, so the count must match.
        """
        saved = {"world_size": torch.tensor(0)}
        load_checkpoint({"progress": saved}, checkpoint_id=path)
        if int(saved["world_size"]) != self.world_size:
            raise ValueError(
                f"torchcontract.demo: {path} was saved by {int(saved['world_size'])} ranks, "
                f"this run has {self.world_size}; resume with as many, or pass another "
                "--checkpoint-dir"
            )
        state = _state(model, optimizer, Progress(0, 0.0), self.rank, self.world_size)
        load_checkpoint(state, checkpoint_id=path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        generators = state["rng"][str(self.rank)]
        torch.set_rng_state(generators["torch"])
        random.setstate(generators["python"])
        progress = state["progress"]
        return Progress(int(progress["step"]), float(progress["loss"]))


def _state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    rank: int,
    world_size: int,
) -> dict[str, Any]:
    """What a checkpoint holds; the RNG states under each rank's own key, the rest shared."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "progress": {
            "step": torch.tensor(progress.step),
            "loss": torch.tensor(progress.loss, dtype=torch.float64),
            "world_size": torch.tensor(world_size),
        },
        "rng": {str(rank): {"torch": torch.get_rng_state(), "python": random.getstate()}},
    }


def _newest_complete(directory: Path) -> Path | None:
    """The complete checkpoint with the highest step in ``directory``, if any."""
    if not directory.is_dir():
        return None
    steps = [
        (int(match.group(1)), path)
        for path in directory.iterdir()
        if (match := _COMPLETE.fullmatch(path.name)) and (path / ".metadata").is_file()
    ]
    return max(steps)[1] if steps else None


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
