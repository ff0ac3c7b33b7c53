"""``shard_placement_fn`` returning ``Shard(1)`` on 2 gloo ranks, against FSDP2's.

Matrices sharded on dim 1, vectors on dim 0, ours and FSDP2's side by side:
placements and bytes, AdamW steps, state dicts (full and sharded) and DCP, which
also loads the dim-1 checkpoint into a model sharded on dim 0 (the default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fully_shard_models import (
    full_gradients,
    full_parameters,
    largest_gap,
    needs_reference_fully_shard,
)
from tensor_parallel_models import (
    dim_1_of_matrices,
    local_tensors,
    mlp_batch,
    mlp_loss,
    mlp_stack,
    placements,
    tensors,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from torchcontract.apis import fully_shard
from torchcontract.testing import run_distributed

Results = dict[str, Any]
FEATURES, HIDDEN = 8, 12  # dim 1 of every matrix splits evenly over 2 (FSDP2 requires it)
STEPS = 3
TOLERANCE = 1e-6
FULL = StateDictOptions(full_state_dict=True)

pytestmark = needs_reference_fully_shard


def _from_the_end(parameter: nn.Parameter) -> Shard | None:
    return Shard(-1) if parameter.dim() == 2 else None


def _model(shard: Any, mesh: DeviceMesh, placement_fn: Any = dim_1_of_matrices) -> nn.Module:
    model = mlp_stack(FEATURES, HIDDEN)
    for block in model:
        shard(block, mesh=mesh, shard_placement_fn=placement_fn)
    shard(model, mesh=mesh)
    return model


def _layout(model: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    found = []
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        found.append((name, str(parameter.placements), tuple(parameter.to_local().shape)))
    return found


def _job(rank: int, world_size: int, directory: str) -> Results:
    mesh = init_device_mesh("cpu", (2,))
    ours, theirs = _model(fully_shard, mesh), _model(torch_fully_shard, mesh)
    results: Results = {
        "layout": (_layout(ours), _layout(theirs)),
        "from_the_end": _layout(_model(fully_shard, mesh, _from_the_end)),
        "losses": [],
        "gradient_gap": 0.0,
    }
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(STEPS):
        losses = [mlp_loss(model, mlp_batch(rank, step, FEATURES)) for model in (ours, theirs)]
        for loss in losses:
            torch.autograd.backward(loss)
        results["losses"].append((losses[0].item(), losses[1].item()))
        gap = largest_gap(full_gradients(ours), full_gradients(theirs))
        results["gradient_gap"] = max(results["gradient_gap"], gap)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    results["parameter_gap"] = largest_gap(full_parameters(ours), full_parameters(theirs))
    mine_full = get_model_state_dict(ours, options=FULL)
    theirs_full = get_model_state_dict(theirs, options=FULL)
    results["full_gap"] = largest_gap(tensors(mine_full), tensors(theirs_full))
    mine, reference = get_model_state_dict(ours), get_model_state_dict(theirs)
    results["sharded"] = (placements(mine), placements(reference))
    results["sharded_gap"] = largest_gap(local_tensors(mine), local_tensors(reference))
    saved = full_parameters(ours)
    dcp_save(mine, checkpoint_id=directory)
    torch.autograd.backward(mlp_loss(ours, mlp_batch(rank, STEPS, FEATURES)))
    optimizers[0].step()
    optimizers[0].zero_grad()
    results["changed"] = largest_gap(full_parameters(ours), saved) > 0
    loaded = get_model_state_dict(ours)
    dcp_load(loaded, checkpoint_id=directory)
    set_model_state_dict(ours, loaded)
    results["dcp_gap"] = largest_gap(full_parameters(ours), saved)
    set_model_state_dict(ours, mine_full, options=FULL)
    results["full_load_gap"] = largest_gap(full_parameters(ours), saved)
    on_dim_0 = _model(fully_shard, mesh, None)
    state = get_model_state_dict(on_dim_0)
    dcp_load(state, checkpoint_id=directory)
    set_model_state_dict(on_dim_0, state)
    results["dim_0_gap"] = largest_gap(full_parameters(on_dim_0), saved)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Results]:
    directory = tmp_path_factory.mktemp("dim_1_checkpoint")
    return run_distributed(_job, 2, timeout=120.0, args=(str(Path(directory)),))


def test_shard_1_places_matrices_on_dim_1_as_torch_fully_shard(ranks: list[Results]) -> None:
    for results in ranks:
        mine, theirs = results["layout"]
        assert mine == theirs
        assert ("0.up.weight", "(Shard(dim=1),)", (HIDDEN, FEATURES // 2)) in mine
        assert ("0.up.bias", "(Shard(dim=0),)", (HIDDEN // 2,)) in mine


def test_shard_minus_1_is_dim_1(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["from_the_end"] == results["layout"][0]


def test_shard_1_trains_as_torch_fully_shard_with_adamw(ranks: list[Results]) -> None:
    for results in ranks:
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["losses"])
        assert results["gradient_gap"] <= TOLERANCE
        assert results["parameter_gap"] <= TOLERANCE


def test_shard_1_state_dicts_equal_torch_fully_shard(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["full_gap"] <= TOLERANCE
        mine, theirs = results["sharded"]
        assert mine == theirs
        assert results["sharded_gap"] <= TOLERANCE


def test_shard_1_checkpoint_round_trips_and_loads_on_dim_0(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["changed"]
        assert results["dcp_gap"] == 0.0
        assert results["full_load_gap"] == 0.0
        assert results["dim_0_gap"] == 0.0
