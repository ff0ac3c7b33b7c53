"""fully_shard set up on 2 gloo ranks, against FSDP2: meta init, default mesh, resharding.

A model built on the meta device and sharded with ``mesh=None`` is materialized
with ``to_empty`` and trains; ``reshard_after_forward`` keeps FSDP2's meaning for
True, False, None and an int. One job runs every scenario (starting ranks is the
slow part) and returns what each rank measured.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fully_shard_models import (
    GPT,
    batch,
    full_gradients,
    full_parameters,
    gpt,
    largest_gap,
    needs_reference_fully_shard,
)
from fully_shard_models import loss_on as _loss_on
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from torchcontract.apis import fully_shard
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import run_distributed

needs_reference = needs_reference_fully_shard

Results = dict[str, Any]
Shard = Callable[..., object]


def _shard_each(apply: Shard, model: GPT, **options: Any) -> GPT:
    for block in model.blocks:
        apply(block, **options)
    apply(model, **options)
    return model


def _load_full(model: nn.Module, full: dict[str, Tensor]) -> None:
    """Fill every sharded parameter with this rank's rows of ``full`` (after ``to_empty``)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            assert isinstance(parameter, DTensor)
            rows = distribute_tensor(full[name], parameter.device_mesh, parameter.placements)
            parameter.to_local().copy_(rows.to_local())


def _on_meta(apply: Shard, full: dict[str, Tensor]) -> tuple[GPT, list[str]]:
    """A GPT built on meta, sharded with the default mesh, materialized on CPU, then loaded."""
    with torch.device("meta"):
        model = GPT()
    _shard_each(apply, model)
    mesh_devices = sorted(
        {p.device_mesh.device_type for p in model.parameters() if isinstance(p, DTensor)}
    )
    model.to_empty(device="cpu")
    assert model.head.weight is model.embed.weight
    _load_full(model, full)
    return model, mesh_devices


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses: list[float] = []
    for step in range(steps):
        loss = _loss_on(model, *batch(rank, step))
        torch.autograd.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _meta_init(rank: int) -> Results:
    """Ours and FSDP2's, both meta-built with mesh=None, against ours built on CPU."""
    full = {name: value.detach().clone() for name, value in gpt().named_parameters()}
    ours, ours_devices = _on_meta(fully_shard, full)
    results: Results = {"mesh_devices": ours_devices}
    results["record_mesh"] = _mesh_device(fully_shard.state(ours).mesh)
    mesh = init_device_mesh("cpu", (2,))
    results["cpu_built"] = _train(_shard_each(fully_shard, gpt(), mesh=mesh), rank)
    results["ours"] = _train(ours, rank)
    if REFERENCE_FULLY_SHARD_ON_CPU:
        theirs, theirs_devices = _on_meta(torch_fully_shard, full)
        results["torch_mesh_devices"] = theirs_devices
        results["torch"] = _train(theirs, rank)
    return results


def _mesh_device(mesh: DeviceMesh | None) -> str | None:
    return None if mesh is None else mesh.device_type


def _registered_after_forward(model: nn.Module) -> dict[str, bool]:
    """Which parameters are sharded DTensors, by name, right after a forward with grad."""
    return {name: isinstance(p, DTensor) for name, p in model.named_parameters()}


def _resharding(rank: int, value: bool | int | None) -> Results:
    """Ours and FSDP2's with ``reshard_after_forward=value``: what forward leaves, and numbers."""
    mesh = init_device_mesh("cpu", (2,))
    found: Results = {}
    models: dict[str, tuple[GPT, Shard]] = {"ours": (gpt(), fully_shard)}
    if REFERENCE_FULLY_SHARD_ON_CPU:
        models["torch"] = (gpt(), torch_fully_shard)
    for name, (model, apply) in models.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _shard_each(apply, model, mesh=mesh, reshard_after_forward=value)
        found[f"{name}_warned"] = any("reshard_after_forward=1" in str(w.message) for w in caught)
        loss = _loss_on(model, *batch(rank, 0))
        found[f"{name}_layout"] = _registered_after_forward(model)
        torch.autograd.backward(loss)
        found[f"{name}_sharded_after_backward"] = all(
            isinstance(p, DTensor) for p in model.parameters()
        )
        found[f"{name}_loss"] = loss.item()
    found["ours_record"] = fully_shard.state(models["ours"][0]).reshard_after_forward
    if REFERENCE_FULLY_SHARD_ON_CPU:
        ours, theirs = models["ours"][0], models["torch"][0]
        assert isinstance(theirs, FSDPModule)
        found["gradient_gap"] = largest_gap(full_gradients(ours), full_gradients(theirs))
        found["parameter_gap"] = largest_gap(full_parameters(ours), full_parameters(theirs))
    return found


RESHARD_VALUES: list[bool | int | None] = [None, True, False, 1, 2]


def _job(rank: int, world_size: int) -> Results:
    results: Results = {"meta": _meta_init(rank)}
    for value in RESHARD_VALUES:
        results[f"reshard={value!r}"] = _resharding(rank, value)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[Results]:
    return run_distributed(_job, 2, timeout=120.0)


def _each(ranks: list[Results], key: str) -> list[Any]:
    return [rank[key] for rank in ranks]


# ----------------------------------------------------------------- meta init, default mesh


def test_default_mesh_of_a_meta_model_is_on_cpu_not_meta(ranks: list[Results]) -> None:
    """No accelerator here: the default mesh is on CPU, as FSDP2's, not on the parameters'
    device."""
    for meta in _each(ranks, "meta"):
        assert meta["mesh_devices"] == ["cpu"]
        assert meta["record_mesh"] == "cpu"


@needs_reference
def test_default_mesh_matches_torch_fully_shard(ranks: list[Results]) -> None:
    for meta in _each(ranks, "meta"):
        assert meta["mesh_devices"] == meta["torch_mesh_devices"]


def test_a_meta_built_model_with_the_default_mesh_trains_after_to_empty(
    ranks: list[Results],
) -> None:
    """Materialized with to_empty and loaded, it trains as the model built on CPU does."""
    for meta in _each(ranks, "meta"):
        assert len(meta["ours"]) == 3
        assert meta["ours"] == meta["cpu_built"]


@needs_reference
def test_a_meta_built_model_with_the_default_mesh_matches_torch_losses(
    ranks: list[Results],
) -> None:
    for meta in _each(ranks, "meta"):
        assert meta["ours"] == meta["torch"]


# ----------------------------------------------------------------- reshard_after_forward


def _sharded_names(layout: dict[str, bool]) -> set[str]:
    return {name for name, sharded in layout.items() if sharded}


@pytest.mark.parametrize(
    ("value", "root_sharded", "blocks_sharded"),
    [
        (None, False, True),
        (True, True, True),
        (False, False, False),
        (1, False, False),
        (2, True, True),
    ],
)
def test_reshard_after_forward_frees_what_fsdp2_frees(
    ranks: list[Results], value: bool | int | None, root_sharded: bool, blocks_sharded: bool
) -> None:
    """None: every group but the root; True (or the world size): every group, the root too;
    False (or 1): none. Backward leaves every parameter sharded."""
    for found in _each(ranks, f"reshard={value!r}"):
        layout: dict[str, bool] = found["ours_layout"]
        root = {name for name in layout if not name.startswith("blocks.")}
        blocks = set(layout) - root
        assert all(layout[name] == root_sharded for name in root)
        assert all(layout[name] == blocks_sharded for name in blocks)
        assert found["ours_sharded_after_backward"]


@pytest.mark.parametrize(("value", "recorded"), [(None, None), (True, True), (1, False), (2, True)])
def test_the_record_holds_what_reshard_after_forward_means(
    ranks: list[Results], value: bool | int | None, recorded: bool | None
) -> None:
    for found in _each(ranks, f"reshard={value!r}"):
        assert found["ours_record"] is recorded


def test_reshard_after_forward_one_warns_as_fsdp2_does(ranks: list[Results]) -> None:
    for found in _each(ranks, "reshard=1"):
        assert found["ours_warned"]
    for found in _each(ranks, "reshard=False"):
        assert not found["ours_warned"]


@needs_reference
@pytest.mark.parametrize("value", RESHARD_VALUES)
def test_reshard_after_forward_matches_torch_fully_shard(
    ranks: list[Results], value: bool | int | None
) -> None:
    """The same parameters registered sharded after forward, the same loss and gradients."""
    for found in _each(ranks, f"reshard={value!r}"):
        assert _sharded_names(found["ours_layout"]) == _sharded_names(found["torch_layout"])
        assert found["ours_loss"] == found["torch_loss"]
        assert found["gradient_gap"] == 0.0
        assert found["parameter_gap"] == 0.0
        assert found["torch_sharded_after_backward"]
