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
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn import functional

from torchcontract.apis import fully_shard
from torchcontract.demo import GPT, GPTConfig, local_parameter_bytes, synthetic_batch

from .harness import label
from .ranks import WORLD_SIZE, ServingRanks, connect, serve_steps, serving, time_steps

BATCH = 16
CONFIG = GPTConfig(dropout=0.0)
NAMES = ("torchcontract", "torch")


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor, targets: Tensor
) -> None:
    logits: Tensor = model(tokens)
    loss = functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    torch.autograd.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _serve(rank: int, world_size: int, port: int) -> int:
    """A rank: shard both models, then run the steps the driver asks for; rounds served."""
    store = connect(port)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ours = GPT(CONFIG)
    torch.manual_seed(0)
    theirs = GPT(CONFIG)
    for block in ours.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    for block in theirs.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    models: dict[str, nn.Module] = {"torchcontract": ours, "torch": theirs}
    for name, model in models.items():
        store.set(f"bytes/{name}/{rank}", repr(local_parameter_bytes(model)))
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    tokens, targets = synthetic_batch(CONFIG, BATCH, rank, 0)
    return serve_steps(
        store, rank, lambda name: _step(models[name], optimizers[name], tokens, targets)
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
