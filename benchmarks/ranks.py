"""Serving ranks for training-step benchmarks: two gloo ranks driven through a TCP store.

Each rank runs a ``serve(rank, world_size, port)`` loop: it builds its models, then
runs the step the store names (``go/<round>``), reports its own time
(``done/<round>/<rank>``) and stops when asked. The driver here times every round
trip with pytest-benchmark and keeps each rank's in-rank time, so a table can show
both; ``alternate`` runs the libraries' steps in turn, so a change of machine load
weighs on both alike.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Final

from pytest_benchmark.fixture import BenchmarkFixture
from torch._C._distributed_c10d import TCPStore  # torch.distributed does not re-export it for mypy

from torchcontract.testing import free_port, run_distributed

__all__ = [
    "TIMEOUT",
    "WORLD_SIZE",
    "ServingRanks",
    "connect",
    "serve_steps",
    "serving",
    "time_steps",
]

WORLD_SIZE: Final = 2
ROUNDS: Final = 40
WARMUP_ROUNDS: Final = 5
# Enough steps that the medians of two libraries within a few percent of each other
# come out in the same order run after run.
ALTERNATING_ROUNDS: Final = 120
TIMEOUT: Final = timedelta(seconds=120)

Serve = Callable[[int, int, int], int]


def connect(port: int) -> TCPStore:
    """A rank's client of the driver's store."""
    return TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def serve_steps(store: TCPStore, rank: int, run: Callable[[str], None]) -> int:
    """A rank's loop: ``run`` the step the store names, report its time; rounds served."""
    served = 0
    while True:
        command = store.get(f"go/{served}").decode()
        if command == "stop":
            return served
        started = time.perf_counter()
        run(command)
        store.set(f"done/{served}/{rank}", repr(time.perf_counter() - started))
        served += 1


class ServingRanks:
    """``WORLD_SIZE`` ranks running ``serve`` in a thread, driven through a TCP store."""

    def __init__(self, serve: Serve, keys: Sequence[str]) -> None:
        port = free_port()
        self.store = TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=TIMEOUT
        )
        self.keys = tuple(keys)
        self.round = 0
        self.in_rank: dict[str, list[float]] = {key: [] for key in self.keys}
        self.alternating: dict[str, float] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(serve, port), daemon=True)
        self.thread.start()

    def _run(self, serve: Serve, port: int) -> None:
        try:
            run_distributed(serve, WORLD_SIZE, timeout=600.0, args=(port,), threads_per_rank=1)
        except BaseException as error:
            self.error = error

    def step(self, key: str) -> None:
        """One training step of ``key``'s model on every rank; returns when all are done."""
        done = [f"done/{self.round}/{rank}" for rank in range(WORLD_SIZE)]
        self.store.set(f"go/{self.round}", key)
        self.round += 1
        self.store.wait(done, TIMEOUT)
        self.in_rank[key].append(max(float(self.store.get(name)) for name in done))

    def alternate(self, rounds: int) -> dict[str, float]:
        """Median in-rank step time of every key over ``rounds`` steps each, taken in turn.

        Every other round takes the keys in reverse, so that no key always follows
        the same one (whose step leaves the caches and the allocator in its state).
        """
        first = {key: len(steps) for key, steps in self.in_rank.items()}
        for index in range(WARMUP_ROUNDS + rounds):
            for key in self.keys if index % 2 == 0 else self.keys[::-1]:
                self.step(key)
        return {
            key: statistics.median(self.in_rank[key][first[key] + WARMUP_ROUNDS :])
            for key in self.keys
        }

    def stop(self) -> None:
        self.store.set(f"go/{self.round}", "stop")
        self.thread.join(60.0)
        if self.error is not None:
            raise self.error


@contextmanager
def serving(serve: Serve, keys: Sequence[str]) -> Iterator[ServingRanks]:
    """Ranks serving ``keys``, their alternating medians taken first; stopped on exit."""
    ranks = ServingRanks(serve, keys)
    try:
        ranks.alternating = ranks.alternate(ALTERNATING_ROUNDS)
        yield ranks
    finally:
        ranks.stop()


def time_steps(benchmark: BenchmarkFixture, ranks: ServingRanks, key: str, torch_key: str) -> None:
    """Time ``key``'s steps; record in-rank and alternating medians and the ratio to torch's."""
    first = len(ranks.in_rank[key])
    benchmark.pedantic(
        ranks.step, args=(key,), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1
    )
    timed = ranks.in_rank[key][first + WARMUP_ROUNDS :]
    benchmark.extra_info["in_rank_median_ms"] = round(statistics.median(timed) * 1e3, 3)
    benchmark.extra_info["alternating_median_ms"] = round(ranks.alternating[key] * 1e3, 3)
    benchmark.extra_info["alternating_ratio_to_torch"] = round(
        ranks.alternating[key] / ranks.alternating[torch_key], 3
    )
