"""fully_shard on every layer, then the root, of meta-device Llama-7B stacks, at world size 64.

The process group is PyTorch's fake backend (64 ranks, this process rank 0: nothing
is communicated) and the models live on the meta device (nothing is allocated), so
what is timed is the apply itself: ours against ``torch.distributed.fsdp.fully_shard``,
from 8 to 1,024 layers, and 4,096 once. The two run in alternating rounds: torch's
round runs in the setup of ours on even rounds and in its teardown on odd ones, timed
by the same rules as every apply benchmark (CPU time, a fresh model built untimed,
caches evicted, garbage collector frozen; see ``harness.time_once_per_model``);
``interleaved_torch_seconds`` holds torch's rounds, which the report shows as torch's
row. Targets: at most torch's time at every size, and growth from 128 to 1,024
layers within 10% of linear; for the growth, both libraries' 128-layer rounds also
run between the 1,024-layer rounds (``paired_base_seconds``), so that the two ends
are measured under the same load.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from pytest_benchmark.fixture import BenchmarkFixture
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchcontract.apis import fully_shard

from .harness import evict_caches, label
from .models import LlamaStack, llama_modules, llama_on_meta, module_count
from .report import SCALE_GROWTH_FROM, SCALE_GROWTH_TO, SCALE_WORKLOAD

pytestmark = pytest.mark.benchmark(timer=time.process_time)

WORLD = 64
#: Layers, and rounds of each library: fewer for the large models, whose rounds are long.
ROUNDS: dict[int, int] = {8: 11, 32: 11, 128: 11, 512: 5, 1024: 5, 4096: 1}

Apply = Callable[..., object]


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D mesh over 64 fake ranks; both libraries warmed up once on a one-layer model."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for apply in (fully_shard, torch_fully_shard):
            _shard(apply, llama_on_meta(1), mesh)
        yield mesh
    finally:
        dist.destroy_process_group()


def _shard(apply: Apply, model: LlamaStack, mesh: DeviceMesh) -> None:
    for layer in model.layers:
        apply(layer, mesh=mesh)
    apply(model, mesh=mesh)


def _prepared(layers: int) -> LlamaStack:
    """A fresh model, the caches then evicted and every live object frozen (untimed)."""
    gc.collect()  # the last round's model, held in cycles by FSDP2's state
    model = llama_on_meta(layers)
    evict_caches()
    gc.freeze()
    return model


def _time_round(apply: Apply, layers: int, mesh: DeviceMesh) -> float:
    """One round timed by hand, by the rules pytest-benchmark's rounds follow here."""
    model = _prepared(layers)
    try:
        started = time.process_time()
        _shard(apply, model, mesh)
        return time.process_time() - started
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("layers", list(ROUNDS))
def test_fully_shard_at_scale(benchmark: BenchmarkFixture, mesh: DeviceMesh, layers: int) -> None:
    """Ours timed by pytest-benchmark, torch's rounds in between, by hand, alike."""
    label(
        benchmark,
        workload=SCALE_WORKLOAD,
        library="torchcontract",
        blocks=layers,
        modules=llama_modules(layers),
        world_size=WORLD,
    )
    theirs: list[float] = []
    # At the large end of the growth target, both libraries' rounds at the small end run
    # in between too: a growth measured across minutes would measure the machine's load.
    base: dict[str, list[float]] = {"torchcontract": [], "torch": []}
    paired = layers == SCALE_GROWTH_TO
    rounds = ROUNDS[layers]
    done = 0  # rounds of ours finished

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if paired:
            order: list[tuple[str, Apply]] = [
                ("torchcontract", fully_shard),
                ("torch", torch_fully_shard),
            ]
            for name, apply in order if done % 2 == 0 else order[::-1]:
                base[name].append(_time_round(apply, SCALE_GROWTH_FROM, mesh))
        if done % 2 == 0:  # even rounds: torch first
            theirs.append(_time_round(torch_fully_shard, layers, mesh))
        return (fully_shard, _prepared(layers), mesh), {}

    def teardown(*arguments: object) -> None:
        nonlocal done
        gc.unfreeze()
        if done % 2 == 1:  # odd rounds: torch after
            theirs.append(_time_round(torch_fully_shard, layers, mesh))
        done += 1

    benchmark.pedantic(
        _shard, setup=setup, teardown=teardown, rounds=rounds, iterations=1, warmup_rounds=0
    )
    assert len(theirs) == rounds
    benchmark.extra_info["interleaved_torch_seconds"] = theirs
    if paired:
        benchmark.extra_info["paired_base_layers"] = SCALE_GROWTH_FROM
        benchmark.extra_info["paired_base_seconds"] = base


def test_the_stacks_have_the_modules_the_table_says() -> None:
    """12 modules and 9 parameters a layer, on meta."""
    for layers in (1, 3):
        model = llama_on_meta(layers)
        assert module_count(model) == llama_modules(layers)
        assert len(list(model.parameters())) == 3 + 9 * layers
        assert all(p.is_meta for p in model.parameters())
