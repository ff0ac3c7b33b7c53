"""The demo's command line: start the ranks (or be one of torchrun's), run the phases."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import torch.distributed as dist

from torchcontract.apis._torch import barrier
from torchcontract.testing import run_distributed

from ._loop import Settings
from ._replicated import Outcome, train
from ._sharded import ShardedOutcome, train_sharded

__all__ = ["main"]


def _run_both(rank: int, world_size: int, settings: Settings) -> tuple[Outcome, ShardedOutcome]:
    """Both phases on this rank: replicated, then sharded; rank 0 says if they agree."""
    replicated = train(rank, world_size, settings)
    if rank == 0:
        print(
            f"\nnow fully_shard on each block and the root, for {settings.steps} steps",
            flush=True,
        )
    sharded = train_sharded(rank, world_size, settings)
    if rank == 0:
        print("\n" + agreement_line(replicated.digest, sharded.digest, world_size), flush=True)
    return replicated, sharded


def agreement_line(replicated: str, sharded: str, world_size: int) -> str:
    """Whether both phases ended with the same parameters, and why."""
    if replicated == sharded:
        order = (
            "a sum of two ranks' gradients is the same in either order"
            if world_size <= 2
            else f"here both APIs' sums of {world_size} ranks' gradients gave the same bits"
        )
        return (
            f"both phases end with the same parameters ({sharded}): the same initial weights, "
            "batches, dropout masks and optimizer, and each step averages the gradients over "
            f"the ranks; {order}"
        )
    return (
        f"the phases' parameters differ in the last bits ({replicated}, {sharded}): "
        f"replicate's all-reduce and fully_shard's reduce-scatter add {world_size} ranks' "
        "gradients in different orders, and a floating-point sum depends on its order "
        "(on 2 ranks they agree)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchcontract.demo",
        description="Train a small GPT with replicate and checkpoint, then with fully_shard, "
        "on local gloo processes, or as one of torchrun's workers.",
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
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help="save checkpoints (model, optimizer, step, RNG states, data position) under "
        "DIR, one subdirectory per phase, and resume from the newest complete one found there",
    )
    parser.add_argument(
        "--checkpoint-every",
        metavar="K",
        type=int,
        default=10,
        help="with --checkpoint-dir: save every K steps and after the last (default 10)",
    )
    parser.add_argument(
        "--pause-after-checkpoint",
        metavar="STEP",
        type=int,
        default=None,
        help="a fault drill: after saving the checkpoint of STEP, on a first attempt (not a "
        "torchrun restart), every rank waits 600 s for a worker to be killed",
    )
    return parser


def _settings(argv: Sequence[str] | None) -> tuple[Settings, int]:
    """The run's settings and the processes to start, from the command line; exits on misuse."""
    parser = _parser()
    arguments = parser.parse_args(argv)
    hsdp: bool = arguments.hsdp
    nproc: int = arguments.nproc if arguments.nproc is not None else 4 if hsdp else 2
    if nproc < 1 or arguments.steps < 1 or arguments.checkpoint_every < 1:
        parser.error("--nproc, --steps and --checkpoint-every must be at least 1")
    pause: int | None = arguments.pause_after_checkpoint
    if pause is not None and arguments.checkpoint_dir is None:
        parser.error("--pause-after-checkpoint needs --checkpoint-dir: without it nothing is saved")
    if arguments.checkpoint_dir is not None and importlib.util.find_spec("numpy") is None:
        # torch.distributed.checkpoint reads the objects the ranks exchange through
        # Tensor.numpy(), and torch does not install numpy.
        parser.error(
            "--checkpoint-dir saves with torch.distributed.checkpoint, which needs numpy "
            "(torch does not install it): pip install numpy"
        )
    every: int = arguments.checkpoint_every
    if pause is not None and pause % every and pause != arguments.steps:
        parser.error(
            f"--pause-after-checkpoint {pause}: no checkpoint is saved at step {pause}; "
            f"pass a multiple of --checkpoint-every ({every}) or --steps ({arguments.steps})"
        )
    world_size = int(os.environ.get("WORLD_SIZE") or nproc)
    if hsdp and world_size % 2:
        parser.error(
            f"--hsdp shards over pairs of processes: needs an even count, got {world_size}"
        )
    settings = Settings(
        steps=arguments.steps,
        hsdp=hsdp,
        checkpoint_dir=arguments.checkpoint_dir,
        checkpoint_every=every,
        pause_after_checkpoint=pause,
    )
    return settings, nproc


def _run(rank: int, world_size: int, settings: Settings) -> object:
    """This rank's demo: both phases, or with ``hsdp`` the sharded one alone."""
    if settings.hsdp:
        return train_sharded(rank, world_size, settings)
    return _run_both(rank, world_size, settings)


def _check_restartable() -> None:
    """Refuse a restarted attempt in the store torchrun's agents share, before it hangs.

    That store outlives the attempt: the previous workers' addresses are still in it,
    and gloo connects to them instead of the new workers' (pytorch/pytorch#135712).
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise SystemExit(
            "torchcontract.demo: torchrun restarted the workers in the store its agents "
            "share, which still holds the previous workers' addresses; run torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that each attempt gets a store of its own"
        )


def _run_as_torchrun_worker(settings: Settings) -> NoReturn:
    """Join the ``env://`` group torchrun describes, run, and leave without finalizing."""
    _check_restartable()
    dist.init_process_group("gloo")
    try:
        _run(dist.get_rank(), dist.get_world_size(), settings)
        # Leave together: a rank whose sockets close while another still talks to
        # it can abort that one.
        barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done: leave without taking the groups down, and without finalizing the
    # interpreter. Torch 2.6's gloo group, destroyed while one of its threads still
    # frees a finished collective's tensors, joins that thread holding the GIL the
    # thread waits for (a hang, now and then); and at finalization torch's C++
    # threads now and then abort the process (SIGABRT, "terminate called without an
    # active exception"). Exiting closes the sockets all the same.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the demo: under torchrun as one of its ranks, otherwise by starting ``--nproc``."""
    settings, nproc = _settings(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _run_as_torchrun_worker(settings)
    started = time.perf_counter()
    what = (
        "fully_shard on each block and the root, as HSDP"
        if settings.hsdp
        else "replicate on the model, checkpoint on each block"
    )
    print(
        f"training a small GPT on {nproc} gloo processes for {settings.steps} steps: {what}",
        flush=True,
    )
    run_distributed(_run, nproc, timeout=600.0, args=(settings,))
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
