"""The GPU guide's script, run by the commands docs/running-on-gpus.md shows.

On the CPU (gloo), as ``make test`` runs it: CUDA is hidden from the workers, so the script
takes its CPU path even on a machine with GPUs. On CUDA (marker ``gpu``, ``make test-gpu``):
the same commands with one process per GPU, over NCCL. Either way both APIs train and print
the same losses, as the page says.
"""

from __future__ import annotations

import os
import sys
from typing import Final

import pytest
import torch
import torch.distributed as dist
from commands import run_command
from pages import DOCS, ROOT, code_blocks

PAGE: Final = DOCS / "running-on-gpus.md"
SCRIPT: Final = "examples/train_on_gpus.py"
#: Seconds for one torchrun command: 2 workers start and train 5 steps.
TIMEOUT: Final = 180.0


def _commands() -> list[list[str]]:
    """The page's torchrun commands running the script, one per API, as words."""
    lines = [
        line.split()
        for block in code_blocks(PAGE, "bash")
        for line in block.splitlines()
        if SCRIPT in line
    ]
    assert sorted(words[-1] for words in lines) == ["fully_shard", "replicate"]
    assert all(words[0] == "torchrun" for words in lines)
    return lines


def _losses(words: list[str], environment: dict[str, str]) -> list[float]:
    """Run one of the page's commands from the repository's root; the losses rank 0 printed."""
    done = run_command(
        [sys.executable, "-m", "torch.distributed.run", *words[1:]],
        timeout=TIMEOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **environment},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(line.split()[-1]) for line in done.stdout.splitlines() if " loss " in line]


def _both_apis_train_alike(environment: dict[str, str], nproc: str | None = None) -> None:
    runs = []
    for shown in _commands():
        words = [*shown]
        if nproc is not None:
            words[words.index("--nproc-per-node") + 1] = nproc
        runs.append(_losses(words, environment))
    sharded, replicated = runs
    assert len(sharded) == 5
    assert sharded[-1] < sharded[0]
    torch.testing.assert_close(sharded, replicated, rtol=1e-4, atol=1e-6)


def test_the_guides_commands_train_alike_on_the_cpu_over_gloo() -> None:
    _both_apis_train_alike({"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs a torch built with NCCL")
def test_the_guides_commands_train_alike_on_every_gpu_over_nccl() -> None:
    _both_apis_train_alike({}, nproc=str(torch.cuda.device_count()))
