"""Prefetch lists and HSDP's layout, on a fake process group of 64 ranks (nothing is sent).

The all-gathers prefetching starts, its numerics and HSDP's against FSDP2 are in
tests/distributed/test_fully_shard_prefetch_gloo.py and test_fully_shard_hsdp_gloo.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_world import fake_mesh
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchcontract import NotAppliedError
from torchcontract.apis import fully_shard
from torchcontract.apis.fully_shard import (
    set_implicit_prefetch,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
)
from torchcontract.apis.fully_shard._managed import MANAGED

WORLD = 64


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D mesh of 64 ranks over the fake backend, this process being rank 0."""
    with fake_mesh((WORLD,)) as mesh:
        yield mesh


def _sharded(mesh: DeviceMesh) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


SETTERS = [set_modules_to_forward_prefetch, set_modules_to_backward_prefetch]


def _lists(model: nn.Sequential) -> list[tuple[list[nn.Module | None], list[nn.Module | None]]]:
    """Each layer's forward and backward prefetch lists, as the modules they name."""

    def modules(refs: tuple[Any, ...]) -> list[nn.Module | None]:
        return [group.modules()[0] if (group := ref()) is not None else None for ref in refs]

    found = []
    for layer in model:
        group = MANAGED.group_of(layer)
        assert group is not None
        found.append((modules(group.forward_prefetch), modules(group.backward_prefetch)))
    return found


@pytest.mark.parametrize("setter", SETTERS, ids=["forward", "backward"])
def test_prefetch_lists_name_the_modules_given_and_an_empty_list_clears_them(
    mesh: DeviceMesh, setter: Any
) -> None:
    model = _sharded(mesh)
    setter(model[0], [model[2], model[1]])
    side = 0 if setter is set_modules_to_forward_prefetch else 1
    assert _lists(model)[0][side] == [model[2], model[1]]
    assert _lists(model)[0][1 - side] == []
    setter(model[0], [])
    assert _lists(model)[0][side] == []


@pytest.mark.parametrize("setter", SETTERS, ids=["forward", "backward"])
def test_prefetch_of_a_module_not_sharded_is_refused_naming_it_and_changing_nothing(
    mesh: DeviceMesh, setter: Any
) -> None:
    model = _sharded(mesh)
    setter(model[0], [model[1]])
    before = _lists(model)
    name = setter.__name__
    plain = nn.Linear(2, 2)
    with pytest.raises(NotAppliedError, match=rf"{name}: modules\[1\] Linear is not sharded"):
        setter(model[0], [model[2], plain])
    with pytest.raises(NotAppliedError, match=rf"{name}: module Linear is not sharded"):
        setter(plain, [model[1]])
    assert _lists(model) == before


def test_prefetch_of_a_module_inside_a_sharded_one_is_refused(mesh: DeviceMesh) -> None:
    outer = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    fully_shard(outer, mesh=mesh)
    with pytest.raises(NotAppliedError, match="apply fully_shard to it first"):
        set_modules_to_forward_prefetch(outer, [outer[0]])


@pytest.mark.parametrize("setter", SETTERS, ids=["forward", "backward"])
def test_prefetch_of_a_non_list_or_non_module_is_a_type_error(
    mesh: DeviceMesh, setter: Any
) -> None:
    model = _sharded(mesh)
    with pytest.raises(TypeError, match="modules must be a list of modules sharded by fully_shard"):
        setter(model[0], model[1])
    with pytest.raises(TypeError, match=r"modules\[0\] must be an nn.Module .* got str"):
        setter(model[0], ["0"])
    with pytest.raises(TypeError, match=r"module must be an nn\.Module"):
        setter(None, [model[1]])


def test_implicit_prefetch_is_set_for_every_application_inside(mesh: DeviceMesh) -> None:
    model = _sharded(mesh)
    groups = [MANAGED.group_of(module) for module in (model, *model)]
    assert all(group is not None and group.implicit_prefetch for group in groups)
    set_implicit_prefetch(model, False)
    assert all(group is not None and not group.implicit_prefetch for group in groups)
    with pytest.raises(NotAppliedError, match="set_implicit_prefetch on Linear: fully_shard is"):
        set_implicit_prefetch(nn.Linear(2, 2), True)
    with pytest.raises(TypeError, match="enabled must be a bool, got int"):
        set_implicit_prefetch(model, 1)  # type: ignore[arg-type]


def test_a_2d_mesh_shards_on_the_inner_dim_as_torch_fully_shard(mesh: DeviceMesh) -> None:
    hsdp = init_device_mesh("cpu", (8, 8), mesh_dim_names=("replicate", "shard"))
    ours, theirs = nn.Linear(20, 3), nn.Linear(20, 3)
    fully_shard(ours, mesh=hsdp)
    torch_fully_shard(theirs, mesh=hsdp)
    for mine, reference in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert isinstance(mine, DTensor)
        assert isinstance(reference, DTensor)
        assert mine.placements == reference.placements == (Replicate(), Shard(0))
        assert mine.to_local().shape == reference.to_local().shape
        assert mine.device_mesh is hsdp
    assert fully_shard.state(ours).mesh is hsdp
