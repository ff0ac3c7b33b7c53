"""The per-rank memory formulas of docs/choosing.md, against the bytes a rank really holds.

The page's rows are written here, each with the function that evaluates it; the test
checks that the page shows each row as written, then measures. ``replicate`` runs on a
one-rank gloo group (what a rank holds does not depend on the rank count);
``fully_shard`` and HSDP on rank 0 of PyTorch's fake process group of 4 ranks, where
shapes and allocations are real and the collectives move nothing. Bytes are the
storages of every live CPU tensor, each counted once, after minus before.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import attrs
import pytest
import torch
import torch.distributed as dist
from fake_world import fake_ranks
from pages import DOCS
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard, replicate
from torchcontract.testing import free_port

PAGE: Final = DOCS / "choosing.md"
#: What the formulas leave out: AdamW's scalar step count per parameter tensor.
SLACK: Final = 1024
WORLD_SIZE: Final = 4


@attrs.frozen
class Sizes:
    """The symbols of the formulas: P, b, N, P_root and k."""

    P: int
    b: int
    N: int = 1
    P_root: int = 0
    k: int = 1


@attrs.frozen
class Formula:
    text: str
    bytes: Callable[[Sizes], float]


# At rest, after optimizer.step(): parameters, gradients, AdamW's state, the total.
AT_REST: Final[dict[str, tuple[Formula, Formula, Formula, Formula]]] = {
    "`replicate`": (
        Formula("P·b", lambda s: s.P * s.b),
        Formula("2·P·b", lambda s: 2 * s.P * s.b),
        Formula("2·P·b", lambda s: 2 * s.P * s.b),
        Formula("5·P·b", lambda s: 5 * s.P * s.b),
    ),
    "`replicate(gradient_as_bucket_view=True)`": (
        Formula("P·b", lambda s: s.P * s.b),
        Formula("P·b", lambda s: s.P * s.b),
        Formula("2·P·b", lambda s: 2 * s.P * s.b),
        Formula("4·P·b", lambda s: 4 * s.P * s.b),
    ),
    "`fully_shard`, HSDP": (
        Formula("P·b/N", lambda s: s.P * s.b / s.N),
        Formula("P·b/N", lambda s: s.P * s.b / s.N),
        Formula("2·P·b/N", lambda s: 2 * s.P * s.b / s.N),
        Formula("4·P·b/N", lambda s: 4 * s.P * s.b / s.N),
    ),
}

# Held from the end of forward to the start of backward, beyond the shards.
AFTER_FORWARD: Final[dict[str, Formula]] = {
    "`True`": Formula("0", lambda s: 0),
    "`None` (the default)": Formula("P_root·b", lambda s: s.P_root * s.b),
    "`False`": Formula("P·b", lambda s: s.P * s.b),
    "an int `k`": Formula("P·b/k", lambda s: s.P * s.b / s.k),
}


def _model() -> nn.Sequential:
    """Three layers whose rows every shard count here divides; the last is the root's own."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)
    )


P: Final = sum(parameter.numel() for parameter in _model().parameters())
P_ROOT: Final = sum(parameter.numel() for parameter in _model()[4].parameters())


def _live_bytes() -> int:
    """The bytes of every live CPU tensor storage, each storage once.

    Plain tensors and parameters only: a DTensor's local tensor is one of them, and
    subclasses without storage (fake tensors other tests' compilations left) are skipped.
    """
    gc.collect()
    storages: dict[int, int] = {}
    for item in gc.get_objects():
        if type(item) in (torch.Tensor, nn.Parameter):
            assert isinstance(item, torch.Tensor)
            if item.device.type != "cpu" or item.is_sparse:
                continue
            storage = item.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _train(model: nn.Module) -> torch.optim.Optimizer:
    """Two AdamW steps; the gradients stay, as after ``optimizer.step()``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
    return optimizer


def _at_rest(apply: Callable[[nn.Sequential], object]) -> int:
    """The bytes one rank holds after building, applying and training a model."""
    before = _live_bytes()
    model = _model()
    apply(model)
    optimizer = _train(model)
    held = _live_bytes() - before
    del model, optimizer
    return held


def _sharded(
    mesh: DeviceMesh, reshard_after_forward: bool | int | None = None
) -> Callable[[nn.Sequential], None]:
    def apply(model: nn.Sequential) -> None:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)

    return apply


@contextmanager
def _one_gloo_rank() -> Iterator[None]:
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _expect(formula: Formula, sizes: Sizes, measured: int) -> None:
    expected = formula.bytes(sizes)
    assert expected <= measured <= expected + SLACK, (formula.text, expected, measured)


def test_the_page_shows_the_formulas_this_test_checks() -> None:
    page = PAGE.read_text()
    for label, formulas in AT_REST.items():
        assert "| " + " | ".join([label, *(f.text for f in formulas)]) + " |" in page
    for label, formula in AFTER_FORWARD.items():
        assert f"| {label} | {formula.text} |" in page


@pytest.mark.parametrize("view", [False, True])
def test_replicate_holds_what_the_formula_says(view: bool) -> None:
    label = "`replicate(gradient_as_bucket_view=True)`" if view else "`replicate`"
    with _one_gloo_rank():
        measured = _at_rest(lambda model: replicate(model, gradient_as_bucket_view=view))
    _expect(AT_REST[label][3], Sizes(P=P, b=4), measured)


@pytest.mark.parametrize("shape", [(WORLD_SIZE,), (2, WORLD_SIZE // 2)], ids=["1-D", "HSDP"])
def test_fully_shard_holds_what_the_formula_says(shape: tuple[int, ...]) -> None:
    with fake_ranks(WORLD_SIZE):
        names = ("replicate", "shard") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        measured = _at_rest(_sharded(mesh))
    _expect(AT_REST["`fully_shard`, HSDP"][3], Sizes(P=P, b=4, N=shape[-1]), measured)


def _held_after_forward(mesh: DeviceMesh, reshard_after_forward: bool | int | None) -> int:
    """Bytes the registered parameters hold after forward beyond the shards themselves."""
    model = _model()
    _sharded(mesh, reshard_after_forward)(model)
    _train(model)
    shards = {
        parameter.to_local().untyped_storage().data_ptr()
        for parameter in model.parameters()
        if isinstance(parameter, DTensor)
    }
    output = model(torch.randn(8, 64))
    held: dict[int, int] = {}
    for parameter in model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        storage = local.untyped_storage()
        if storage.data_ptr() not in shards:
            held[storage.data_ptr()] = storage.nbytes()
    output.sum().backward()
    return sum(held.values())


@pytest.mark.parametrize(
    ("setting", "label"),
    [(True, "`True`"), (None, "`None` (the default)"), (False, "`False`"), (2, "an int `k`")],
)
def test_reshard_after_forward_holds_what_the_formula_says(
    setting: bool | int | None, label: str
) -> None:
    with fake_ranks(WORLD_SIZE):
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        measured = _held_after_forward(mesh, setting)
    k = setting if isinstance(setting, int) and not isinstance(setting, bool) else 1
    _expect(AFTER_FORWARD[label], Sizes(P=P, b=4, N=WORLD_SIZE, P_root=P_ROOT, k=k), measured)
