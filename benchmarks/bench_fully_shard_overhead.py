"""fully_shard's CPU work per training step against torch's, on a fake group: what a GPU waits on.

On a GPU, a step of a small model lasts as long as the CPU takes to launch it: hooks,
dispatched ops, copies. Here the process group is PyTorch's fake backend (2 ranks, this
process rank 0: collectives cost nothing) and the model is the demo GPT with 8 blocks on
the CPU, whose tensors are small, so a step's time is mostly that work. Both libraries
shard the same model (each block, then the root), in fp32 and with bf16 mixed precision,
and take the same training step (forward, backward, SGD); torch's rounds are interleaved
with ours (``harness.time_interleaved``), CPU time. Target: at most torch's time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from pytest_benchmark.fixture import BenchmarkFixture
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchcontract.demo import GPTConfig, synthetic_batch

from .harness import Side, label, time_interleaved
from .report import OURS, OVERHEAD_BLOCKS, OVERHEAD_WORKLOAD, TORCH
from .sharded_gpt import sharded_gpt, train_step

pytestmark = pytest.mark.benchmark(timer=time.process_time)

CONFIG = GPTConfig(dropout=0.0, layers=OVERHEAD_BLOCKS)
BATCH = 2
ROUNDS = 41
POLICIES = {
    "fp32": None,
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh over 2 fake ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _side(library: str, precision: str, mesh: DeviceMesh) -> Side:
    """``library``'s sharded GPT and its step, warmed up: every round steps the same model."""
    model = sharded_gpt(CONFIG, library, mesh, POLICIES[precision])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens, targets = synthetic_batch(CONFIG, BATCH, 0, 0)
    for _ in range(3):
        train_step(model, optimizer, tokens, targets)
    return Side(train_step, lambda: (model, optimizer, tokens, targets))


@pytest.mark.parametrize("precision", POLICIES)
def test_step_overhead(benchmark: BenchmarkFixture, mesh: DeviceMesh, precision: str) -> None:
    """One training step of the demo GPT on a fake 2-rank group: CPU work only."""
    label(benchmark, workload=OVERHEAD_WORKLOAD.format(precision), library=OURS, blocks=8)
    ours, theirs = _side(OURS, precision, mesh), _side(TORCH, precision, mesh)
    time_interleaved(benchmark, ours, theirs, rounds=ROUNDS)
