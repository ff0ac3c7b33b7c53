"""One training step of the demo GPT on 2 gloo ranks: fully_shard against torch's fully_shard.

Each rank holds the model twice, one under ``torchcontract.apis.fully_shard`` and one
under ``torch.distributed.fsdp.fully_shard``, each applied to every block and then to
the root; ``benchmarks/ranks.py`` drives the steps and records round-trip, in-rank and
alternating times. Target: at most 1.2x torch's step. ``parameter_bytes_per_rank`` is
the larger rank's share of the parameters, for both libraries.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchcontract.demo import GPT, GPTConfig, local_parameter_bytes, synthetic_batch

from .harness import label
from .ranks import WORLD_SIZE, ServingRanks, connect, serve_steps, serving, time_steps
from .sharded_gpt import sharded_gpt, train_step

BATCH = 16
CONFIG = GPTConfig(dropout=0.0)
NAMES = ("torchcontract", "torch")


def _serve(rank: int, world_size: int, port: int) -> int:
    """A rank: shard both models, then run the steps the driver asks for; rounds served."""
    store = connect(port)
    mesh = init_device_mesh("cpu", (world_size,))
    models: dict[str, nn.Module] = {name: sharded_gpt(CONFIG, name, mesh) for name in NAMES}
    for name, model in models.items():
        store.set(f"bytes/{name}/{rank}", repr(local_parameter_bytes(model)))
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    tokens, targets = synthetic_batch(CONFIG, BATCH, rank, 0)
    return serve_steps(
        store, rank, lambda name: train_step(models[name], optimizers[name], tokens, targets)
    )


@pytest.fixture(scope="module")
def ranks() -> Iterator[ServingRanks]:
    with serving(_serve, NAMES) as serving_ranks:
        yield serving_ranks


@pytest.mark.parametrize("name", NAMES)
def test_training_step(benchmark: BenchmarkFixture, ranks: ServingRanks, name: str) -> None:
    """Forward and backward sharded over 2 gloo ranks, and an SGD step."""
    label(
        benchmark,
        workload="training step, demo GPT on 2 gloo ranks, fully_shard",
        library=name,
        api="fully_shard",
        parameters=sum(p.numel() for p in GPT(CONFIG).parameters()),
        batch=BATCH,
    )
    time_steps(benchmark, ranks, name, "torch")
    benchmark.extra_info["parameter_bytes_per_rank"] = max(
        int(ranks.store.get(f"bytes/{name}/{rank}")) for rank in range(WORLD_SIZE)
    )
