"""One training step on 2 gloo ranks: replicate against DistributedDataParallel.

Two models: the demo GPT, and a 50-layer MLP (many parameters of one size, where
bucketing and overlap decide). Two ranks start once, each holding every model
twice: one under ``torchcontract.apis.replicate``, one wrapped in
``DistributedDataParallel``.
Every benchmark round asks both ranks, through a TCP store, for one training
step (forward, backward with gradient averaging, SGD step) of one of them, and
times the round trip here. Each rank also times its own step; the slower
rank's median is recorded as ``in_rank_median_ms`` in extra_info, which leaves
out the store's round trip (some 0.1 ms on loopback).

pytest-benchmark times one library's rounds after the other's, so a change in
machine load between the two shows up as a difference. The fixture therefore
also runs ``ALTERNATING_ROUNDS`` steps of each, alternating, before the timed
rounds; their in-rank medians and ratio are in extra_info as
``alternating_median_ms`` and ``alternating_ratio_to_torch``. Target: replicate's
step at most DDP's (alternating, in-rank ratio at most 1.0).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from torch import Tensor, nn
from torch._C._distributed_c10d import TCPStore  # torch.distributed does not re-export it for mypy
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from torchcontract.apis import replicate
from torchcontract.demo import GPT, GPTConfig, synthetic_batch
from torchcontract.testing import free_port, run_distributed

from .harness import label

WORLD_SIZE = 2
ROUNDS = 40
WARMUP_ROUNDS = 5
ALTERNATING_ROUNDS = 30
BATCH = 16
CONFIG = GPTConfig(dropout=0.0)
NAMES = ("torchcontract", "torch")
MODELS = ("demo GPT", "50-layer MLP")
MLP_WIDTH = 256
_TIMEOUT = timedelta(seconds=120)


def _mlp() -> nn.Module:
    return nn.Sequential(
        *(layer for _ in range(50) for layer in (nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()))
    )


def _make(model: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG) if model == "demo GPT" else _mlp()


@functools.cache
def _batch(model_name: str, rank: int) -> tuple[Tensor, Tensor]:
    """The rank's batch for ``model_name``, made once: inputs and targets."""
    if model_name == "demo GPT":
        return synthetic_batch(CONFIG, BATCH, rank, 0)
    inputs = torch.randn(4 * BATCH, MLP_WIDTH, generator=torch.Generator().manual_seed(rank))
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
    """A rank's loop: run the step the store asks for, until it asks to stop; rounds served."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
    models: dict[str, nn.Module] = {}
    for model in MODELS:
        ours = _make(model)
        replicate(ours)
        models[f"torchcontract/{model}"] = ours
        models[f"torch/{model}"] = DistributedDataParallel(_make(model))
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    served = 0
    while True:
        command = store.get(f"go/{served}").decode()
        if command == "stop":
            return served
        model_name = command.split("/", maxsplit=1)[1]
        started = time.perf_counter()
        _step(model_name, models[command], optimizers[command], rank)
        store.set(f"done/{served}/{rank}", repr(time.perf_counter() - started))
        served += 1


class _Ranks:
    """Two serving ranks, run by ``run_distributed`` in a thread, driven through a TCP store."""

    def __init__(self) -> None:
        port = free_port()
        self.store = TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=_TIMEOUT
        )
        self.round = 0
        self.in_rank: dict[str, list[float]] = {
            f"{name}/{model}": [] for name in NAMES for model in MODELS
        }
        self.error: BaseException | None = None
        self.alternating: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, args=(port,), daemon=True)
        self.thread.start()

    def _run(self, port: int) -> None:
        try:
            run_distributed(_serve, WORLD_SIZE, timeout=600.0, args=(port,), threads_per_rank=1)
        except BaseException as error:
            self.error = error

    def step(self, name: str) -> None:
        """One training step of ``name``'s model on every rank; returns when all are done."""
        keys = [f"done/{self.round}/{rank}" for rank in range(WORLD_SIZE)]
        self.store.set(f"go/{self.round}", name)
        self.round += 1
        self.store.wait(keys, _TIMEOUT)
        self.in_rank[name].append(max(float(self.store.get(key)) for key in keys))

    def alternate(self, rounds: int) -> dict[str, float]:
        """Median in-rank step time of each library and model over ``rounds`` alternating steps."""
        first = {key: len(steps) for key, steps in self.in_rank.items()}
        for _ in range(WARMUP_ROUNDS + rounds):
            for model in MODELS:
                for name in NAMES:
                    self.step(f"{name}/{model}")
        return {
            key: statistics.median(self.in_rank[key][first[key] + WARMUP_ROUNDS :])
            for key in self.in_rank
        }

    def stop(self) -> None:
        self.store.set(f"go/{self.round}", "stop")
        self.thread.join(60.0)
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def ranks() -> Iterator[_Ranks]:
    serving = _Ranks()
    try:
        serving.alternating = serving.alternate(ALTERNATING_ROUNDS)
        yield serving
    finally:
        serving.stop()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", NAMES)
def test_training_step(benchmark: BenchmarkFixture, ranks: _Ranks, name: str, model: str) -> None:
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
    first = len(ranks.in_rank[key])
    benchmark.pedantic(
        ranks.step, args=(key,), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1
    )
    timed = ranks.in_rank[key][first + WARMUP_ROUNDS :]
    benchmark.extra_info["in_rank_median_ms"] = round(statistics.median(timed) * 1e3, 3)
    benchmark.extra_info["alternating_median_ms"] = round(ranks.alternating[key] * 1e3, 3)
    benchmark.extra_info["alternating_ratio_to_torch"] = round(
        ranks.alternating[key] / ranks.alternating[f"torch/{model}"], 3
    )
