"""``benchmarks/bench_gpu.py`` (``make bench-gpu``) runs: every row, tiny, on the CPU.

The GPU machine runs it with a bare ``python3`` and ``PYTHONPATH=src``; so does this
(the interpreter of this run), in a process of its own, with ``--smoke``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"


@pytest.mark.skipif(
    not REFERENCE_FULLY_SHARD_ON_CPU,
    reason=f"PyTorch's fully_shard fails on CPU with torch {torch.__version__}",
)
def test_bench_gpu_smoke_writes_every_row(tmp_path: Path) -> None:
    output = tmp_path / "gpu.md"
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--runs", "1", "--output", str(output)],
        check=True,
        cwd=tmp_path,
        env=environment,
        timeout=300,
        capture_output=True,
    )
    lines = output.read_text().splitlines()
    assert f"torch {torch.__version__}" in lines[0]
    rows = [line for line in lines if line.startswith("| 2 blocks")]
    assert len(rows) == 4
    assert sum("blocks compiled" in row for row in rows) == 1
    assert sum("8 (fake group" in row for row in rows) == 1
    for row in rows:
        ratio = float(row.split("|")[5])
        assert ratio > 0
