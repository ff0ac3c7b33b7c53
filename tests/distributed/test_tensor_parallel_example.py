"""The tensor-parallel example docs/fully-shard.md shows runs as the page shows it.

``examples/tensor_parallel.py`` under ``torchrun``, 4 gloo processes on 127.0.0.1: the
placements it asserts hold on every rank and its loss goes down.
"""

from __future__ import annotations

import os
import sys

import pytest
from commands import run_command
from pages import DOCS, ROOT, code_blocks


@pytest.mark.slow
def test_the_pages_tensor_parallel_example_trains() -> None:
    shown = [
        block
        for block in code_blocks(DOCS / "fully-shard.md", "bash")
        if "examples/tensor_parallel.py" in block
    ]
    assert len(shown) == 1
    program, *arguments = shown[0].split()
    assert program == "torchrun"
    done = run_command(
        [sys.executable, "-m", "torch.distributed.run", *arguments],
        timeout=240.0,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if "loss" in line]
    assert len(losses) == 3
    assert losses[-1] < losses[0]
