"""``benchmarks/bench_gpu.py`` (``make bench-gpu``) runs: every row, tiny, on the CPU.

The GPU machine runs it with a bare ``python3`` and ``PYTHONPATH=src``; so does this
(the interpreter of this run), in a process of its own, with ``--smoke``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def test_a_failing_row_is_reported_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    bench_gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench_gpu)  # dataclasses look it up
    spec.loader.exec_module(bench_gpu)

    def measure(row: Any, device: str, runs: int) -> Any:
        if row.compiled:
            raise RuntimeError("no C compiler\nfor triton")
        seconds = {"torchcontract": 0.9, "torch": 1.0}
        return bench_gpu.Result(row, seconds, dict.fromkeys(seconds))

    monkeypatch.setattr(bench_gpu, "measure", measure)
    output = tmp_path / "gpu.md"
    assert bench_gpu.main(["--smoke", "--output", str(output)]) == 1
    rows = [line for line in output.read_text().splitlines() if line.startswith("| 2 blocks")]
    assert [row.split("|")[3].strip() for row in rows] == [
        "1000.0 ms",
        "1000.0 ms",
        "1000.0 ms",
        "failed: RuntimeError: no C compiler",
    ]
    assert "blocks compiled" in rows[-1]
