"""Memory: what applying APIs keeps, and that dropping the models gives all of it back.

Three APIs (one in the shared default store, two in a store of their own, one of
them applied to a list) go on a thousand fresh transformer-style models, which
are then dropped. The store and the registry end as they started, and the memory
Python traces stays flat after a warm-up round: a fixed slack, not one that grows
with the number of models, so a leak of even a few bytes a model fails the test.
"""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import attrs
import pytest
import torch
from torch import nn

from torchcontract import FQNChangedError, StateStore, contract
from torchcontract._registry import REGISTRY
from torchcontract._store import DEFAULT_STORE

MODELS = 1_000
#: Traced bytes a round of MODELS models may add: interpreter free lists and caches
#: move by up to 17 KiB here within the whole suite. One leaked record (48 bytes) per
#: model adds 47 KiB, one leaked module 1 MiB; the smallest leaks, a list slot per
#: apply, are test_leaks.py's to catch (2,000 rounds, 16 KiB of slack).
SLACK = 32 * 1024
#: Bytes the store and registry may keep per applied module while the model lives
#: (about 1.3 KiB measured); a kept FQN snapshot would add hundreds per module.
BYTES_PER_MODULE = 2048

STORE = StateStore()


@attrs.frozen
class Steps:
    count: int = 0


def _step(record: Steps) -> Steps:
    return attrs.evolve(record, count=record.count + 1)


@contract(Steps)
def on_root(module: nn.Module) -> None:
    on_root.update(module, _step)


@contract(Steps, store=STORE)
def on_blocks(module: nn.Module) -> None:
    on_blocks.update(module, _step)


@contract(Steps, store=STORE)
def on_norms(modules: list[nn.Module]) -> None:
    on_norms.update(modules[0], _step)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(2)
        self.attn = nn.ModuleDict({name: nn.Linear(2, 2) for name in ("q", "k", "v", "o")})
        self.norm2 = nn.LayerNorm(2)
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.GELU(), nn.Linear(8, 2), nn.Dropout(0.0))


class Model(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.layers = [Block() for _ in range(blocks)]  # typed access to the blocks
        self.blocks = nn.ModuleList(self.layers)


def _with_three_apis() -> nn.Module:
    model = Model(blocks=1)
    for block in model.layers:
        on_blocks(block)
        on_norms([block.norm1, block.norm2])
    on_root(model)
    return model


def _round() -> None:
    for _ in range(MODELS):
        _with_three_apis()


def test_dropped_models_leave_the_store_and_the_registry_as_they_were() -> None:
    gc.collect()
    registered, shared = len(REGISTRY), len(DEFAULT_STORE)
    models = [weakref.ref(_with_three_apis()) for _ in range(MODELS)]
    alive = sum(ref() is not None for ref in models)
    held = len(STORE)
    assert (alive, held) == (0, 0)
    assert len(REGISTRY) == registered
    assert len(DEFAULT_STORE) == shared


def test_traced_memory_is_flat_over_a_thousand_models() -> None:
    _round()  # warm-up, untraced (tracing is slow): caches and free lists reach their size
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        _round()
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - start < SLACK, f"{end - start} bytes more after {MODELS} more models"


def test_the_store_keeps_a_bounded_number_of_bytes_per_applied_module() -> None:
    models = [Model(blocks=8) for _ in range(20)]
    applied = 0
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for model in models:
            for block in model.layers:
                on_blocks(block)
            on_root(model)
            applied += len(model.layers) + 1
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (end - start) / applied < BYTES_PER_MODULE
    assert len(STORE) == 20 * 8


def test_a_model_dies_at_once_after_an_apply_that_changed_its_fqns() -> None:
    @contract(Steps, store=STORE, strict=False)
    def grows(module: nn.Module) -> None:
        module.register_buffer("extra", torch.zeros(1))

    gc.disable()
    try:
        model = Model(blocks=2)
        with pytest.raises(FQNChangedError) as info:
            grows(model)
        assert "only after: ['extra']" in str(info.value)
        del info  # its traceback holds the apply's frames, and so the model
        ref = weakref.ref(model)
        del model
        dead = ref() is None
    finally:
        gc.enable()
    assert dead
    assert len(STORE) == 0
