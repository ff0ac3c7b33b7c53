"""One training step on 2 gloo ranks: replicate against DistributedDataParallel.

Three models: the demo GPT, a 50-layer MLP (many parameters of one size, where
bucketing and overlap decide), and an 8-layer MLP of 8 MiB of gradients in 1 MiB
buckets (``bucket_cap_mb=1`` on both sides: 8 buckets, so launching them in order
and overlapping them with the backward decide), each side with DDP's defaults,
and the bucketed MLP also with ``find_unused_parameters=True`` on both sides.
Each rank holds every model twice, one under ``torchcontract.apis.replicate``
and one wrapped in ``DistributedDataParallel`` (the bucketed MLP four times);
``benchmarks/ranks.py`` drives the steps and records round-trip, in-rank and
alternating times. Target: replicate's step at most DDP's (alternating, in-rank
ratio at most 1.0).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from torch import Tensor, nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.demo import GPT, GPTConfig, synthetic_batch

from .harness import label
from .ranks import ServingRanks, connect, serve_steps, serving, time_steps

BATCH = 16
CONFIG = GPTConfig(dropout=0.0)
NAMES = ("torchcontract", "torch")
BUCKETED = "8-layer MLP, 1 MiB buckets"
MODELS = ("demo GPT", "50-layer MLP", BUCKETED)
#: Each MLP's (layers, width): 50 layers of 256 (13 MB of gradients), 8 of 512 (8 MB).
MLPS = {"50-layer MLP": (50, 256), BUCKETED: (8, 512)}
#: The bucket cap both sides take, per model (None: their defaults).
CAP_MB: dict[str, float | None] = {BUCKETED: 1.0}
#: BUCKETED with find_unused_parameters=True, on each side.
UNUSED = "torch, find_unused_parameters=True"
OURS_UNUSED = "torchcontract, find_unused_parameters=True"


def _mlp(model: str) -> nn.Module:
    layers, width = MLPS[model]
    return nn.Sequential(
        *(layer for _ in range(layers) for layer in (nn.Linear(width, width), nn.ReLU()))
    )


def _make(model: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG) if model == "demo GPT" else _mlp(model)


@functools.cache
def _batch(model_name: str, rank: int) -> tuple[Tensor, Tensor]:
    """The rank's batch for ``model_name``, made once: inputs and targets."""
    if model_name == "demo GPT":
        return synthetic_batch(CONFIG, BATCH, rank, 0)
    width = MLPS[model_name][1]
    inputs = torch.randn(4 * BATCH, width, generator=torch.Generator().manual_seed(rank))
    return inputs, torch.zeros(())


def _loss(model_name: str, model: nn.Module, rank: int) -> Tensor:
    inputs, targets = _batch(model_name, rank)
    out: Tensor = model(inputs)
    if model_name == "demo GPT":
        return functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    return out.pow(2).mean()


def _step(model_name: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    torch.autograd.backward(_loss(model_name, model, rank))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _serve(rank: int, world_size: int, port: int) -> int:
    """A rank: build every model twice, then run the steps the driver asks for; rounds served."""
    store = connect(port)
    models: dict[str, nn.Module] = {}
    for model in MODELS:
        cap = CAP_MB.get(model)
        ours = _make(model)
        replicate(ours, bucket_cap_mb=cap)
        models[f"torchcontract/{model}"] = ours
        models[f"torch/{model}"] = DistributedDataParallel(_make(model), bucket_cap_mb=cap)
    models[f"{UNUSED}/{BUCKETED}"] = DistributedDataParallel(
        _make(BUCKETED), bucket_cap_mb=CAP_MB[BUCKETED], find_unused_parameters=True
    )
    models[f"{OURS_UNUSED}/{BUCKETED}"] = replicate(
        _make(BUCKETED), bucket_cap_mb=CAP_MB[BUCKETED], find_unused_parameters=True
    )
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}

    def run(command: str) -> None:
        _step(command.split("/", maxsplit=1)[1], models[command], optimizers[command], rank)

    return serve_steps(store, rank, run)


@pytest.fixture(scope="module")
def ranks() -> Iterator[ServingRanks]:
    keys = [f"{name}/{model}" for model in MODELS for name in NAMES]
    keys.extend((f"{UNUSED}/{BUCKETED}", f"{OURS_UNUSED}/{BUCKETED}"))
    with serving(_serve, keys) as serving_ranks:
        yield serving_ranks


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", NAMES)
def test_training_step(
    benchmark: BenchmarkFixture, ranks: ServingRanks, name: str, model: str
) -> None:
    """Forward, backward with gradient averaging over 2 gloo ranks, and an SGD step."""
    key = f"{name}/{model}"
    label(
        benchmark,
        workload=f"training step, {model} on 2 gloo ranks",
        library=name,
        api="replicate" if name == "torchcontract" else "DistributedDataParallel",
        parameters=sum(p.numel() for p in _make(model).parameters()),
        batch=BATCH,
    )
    time_steps(benchmark, ranks, key, f"torch/{model}")


@pytest.mark.parametrize("name", [OURS_UNUSED, UNUSED])
def test_training_step_against_find_unused_parameters(
    benchmark: BenchmarkFixture, ranks: ServingRanks, name: str
) -> None:
    """The bucketed MLP's step, both sides with ``find_unused_parameters=True``."""
    label(
        benchmark,
        workload=f"training step, {BUCKETED} on 2 gloo ranks, vs find_unused_parameters=True",
        library="torchcontract" if name == OURS_UNUSED else "torch",
        api="replicate" if name == OURS_UNUSED else "DistributedDataParallel",
        parameters=sum(p.numel() for p in _make(BUCKETED).parameters()),
        batch=BATCH,
    )
    time_steps(benchmark, ranks, f"{name}/{BUCKETED}", f"{UNUSED}/{BUCKETED}")
