"""fully_shard's prefetching: a training step with and without it, and torch's, on 2 gloo ranks.

A GPT wide enough (width 256, 4 blocks, 3.2 million parameters) that each block's
all-gather moves megabytes and takes a visible share of the step, on a small
batch. Each rank holds the model three times: ours with the implicit prefetch
(the default), ours without it (``set_implicit_prefetch(model, False)``) and under
``torch.distributed.fsdp.fully_shard``. ``benchmarks/ranks.py`` alternates their
steps. Target: ours at most torch's step; with prefetch faster than without where
the machine has a core free for gloo's thread to gather while the other computes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchcontract.apis.fully_shard import set_implicit_prefetch
from torchcontract.demo import GPT, GPTConfig, local_parameter_bytes, synthetic_batch

from .harness import label
from .ranks import WORLD_SIZE, ServingRanks, connect, serve_steps, serving, time_steps
from .sharded_gpt import TORCH, sharded_gpt, train_step

BATCH = 2
CONFIG = GPTConfig(vocabulary=64, context=32, width=256, heads=8, layers=4, dropout=0.0)
PREFETCH, NO_PREFETCH = "torchcontract", "torchcontract, no prefetch"
NAMES = (PREFETCH, NO_PREFETCH, TORCH)


def _serve(rank: int, world_size: int, port: int) -> int:
    """A rank: shard the three models, then run the steps the driver asks for."""
    store = connect(port)
    mesh = init_device_mesh("cpu", (world_size,))
    models: dict[str, nn.Module] = {name: sharded_gpt(CONFIG, name, mesh) for name in NAMES}
    set_implicit_prefetch(models[NO_PREFETCH], False)
    for name, sharded in models.items():
        store.set(f"bytes/{name}/{rank}", repr(local_parameter_bytes(sharded)))
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
def test_training_step_prefetch(
    benchmark: BenchmarkFixture, ranks: ServingRanks, name: str
) -> None:
    """Forward and backward sharded over 2 gloo ranks, and an SGD step."""
    label(
        benchmark,
        workload="training step, GPT width 256 on 2 gloo ranks, fully_shard prefetch",
        library=name,
        api="fully_shard",
        parameters=sum(p.numel() for p in GPT(CONFIG).parameters()),
        batch=BATCH,
    )
    time_steps(benchmark, ranks, name, TORCH)
    benchmark.extra_info["parameter_bytes_per_rank"] = max(
        int(ranks.store.get(f"bytes/{name}/{rank}")) for rank in range(WORLD_SIZE)
    )
