"""One training step of the demo GPT on 2 gloo ranks: fully_shard against torch's fully_shard.

Two ranks start once, each holding the same model twice: one under
``torchcontract.apis.fully_shard``, one under ``torch.distributed.fsdp.fully_shard``,
each applied to every block and then to the root.
Every benchmark round asks both ranks, through a TCP store, for one training
step (forward with all-gathers, backward with reduce-scatters, SGD step) of one of them, and
times the round trip here. Each rank also times its own step; the slower
rank's median is recorded as ``in_rank_median_ms`` in extra_info, which leaves
out the store's round trip (some 0.1 ms on loopback).

pytest-benchmark times one library's rounds after the other's, so a change in
machine load between the two shows up as a difference. The fixture therefore
also runs ``ALTERNATING_ROUNDS`` steps of each, alternating, before the timed
rounds; their in-rank medians and ratio are in extra_info as
``alternating_median_ms`` and ``alternating_ratio_to_torch``. Target: at most
1.2x torch's step. ``parameter_bytes_per_rank`` is the larger rank's share of the
parameters, for both libraries.
"""

from __future__ import annotations

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional

from torchcontract.apis import fully_shard
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
_TIMEOUT = timedelta(seconds=120)


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor, targets: Tensor
) -> None:
    logits: Tensor = model(tokens)
    loss = functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    torch.autograd.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _serve(rank: int, world_size: int, port: int) -> int:
    """A rank's loop: run the step the store asks for, until it asks to stop; rounds served."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
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
        store.set(f"bytes/{name}/{rank}", repr(_local_bytes(model)))
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    tokens, targets = synthetic_batch(CONFIG, BATCH, rank, 0)
    served = 0
    while True:
        command = store.get(f"go/{served}").decode()
        if command == "stop":
            return served
        started = time.perf_counter()
        _step(models[command], optimizers[command], tokens, targets)
        store.set(f"done/{served}/{rank}", repr(time.perf_counter() - started))
        served += 1


def _local_bytes(model: nn.Module) -> int:
    """The parameter bytes this rank stores."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )


class _Ranks:
    """Two serving ranks, run by ``run_distributed`` in a thread, driven through a TCP store."""

    def __init__(self) -> None:
        port = free_port()
        self.store = TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=_TIMEOUT
        )
        self.round = 0
        self.in_rank: dict[str, list[float]] = {name: [] for name in NAMES}
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
        """Median in-rank step time of each library over ``rounds`` alternating steps each."""
        first = {name: len(self.in_rank[name]) for name in NAMES}
        for _ in range(WARMUP_ROUNDS + rounds):
            for name in NAMES:
                self.step(name)
        return {
            name: statistics.median(self.in_rank[name][first[name] + WARMUP_ROUNDS :])
            for name in NAMES
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


@pytest.mark.parametrize("name", NAMES)
def test_training_step(benchmark: BenchmarkFixture, ranks: _Ranks, name: str) -> None:
    """Forward and backward sharded over 2 gloo ranks, and an SGD step."""
    label(
        benchmark,
        workload="training step, demo GPT on 2 gloo ranks, fully_shard",
        library=name,
        api="fully_shard",
        parameters=sum(p.numel() for p in GPT(CONFIG).parameters()),
        batch=BATCH,
    )
    first = len(ranks.in_rank[name])
    benchmark.pedantic(
        ranks.step, args=(name,), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1
    )
    timed = ranks.in_rank[name][first + WARMUP_ROUNDS :]
    benchmark.extra_info["in_rank_median_ms"] = round(statistics.median(timed) * 1e3, 3)
    benchmark.extra_info["alternating_median_ms"] = round(ranks.alternating[name] * 1e3, 3)
    benchmark.extra_info["alternating_ratio_to_torch"] = round(
        ranks.alternating[name] / ranks.alternating["torch"], 3
    )
    benchmark.extra_info["parameter_bytes_per_rank"] = max(
        int(ranks.store.get(f"bytes/{name}/{rank}")) for rank in range(WORLD_SIZE)
    )
