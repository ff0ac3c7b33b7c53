"""HSDP with tensor parallelism on 8 gloo ranks, a 2 x 2 x 2 mesh (replicate, shard, tp).

``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` on
``mesh["replicate", "shard"]``, ours and FSDP2's side by side: placements and bytes,
AdamW steps, ``clip_grad_norm_``, the sharded state dict and a DCP round trip. Eight processes on a
shared machine take a while: marked ``slow`` (``-m "not slow"`` leaves it out).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fully_shard_models import full_parameters, largest_gap
from tensor_parallel_models import (
    mlp_batch,
    mlp_loss,
    placements,
    sharded_mlp,
    train_side_by_side,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from torchcontract.apis import fully_shard
from torchcontract.apis._compat import REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import run_distributed

Results = dict[str, Any]
STEPS = 2
TOLERANCE = 1e-6

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not REFERENCE_FULLY_SHARD_ON_CPU,
        reason=f"compares with PyTorch's fully_shard, which fails on CPU with torch "
        f"{torch.__version__}",
    ),
]


def _layout(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    found = []
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        mesh = tuple(parameter.device_mesh.shape)
        found.append((name, str(parameter.placements), mesh, tuple(parameter.to_local().shape)))
    return found


def _job(rank: int, world_size: int, directory: str) -> Results:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_rank = rank // 2  # tp is the innermost dim
    models = [
        sharded_mlp(shard, mesh["replicate", "shard"], mesh["tp"])
        for shard in (fully_shard, torch_fully_shard)
    ]
    layout = [_layout(model) for model in models]
    results: Results = train_side_by_side(models, mlp_loss, mlp_batch, dp_rank, STEPS)
    results["layout"] = layout
    mine, theirs = (get_model_state_dict(model) for model in models)
    results["state_dict"] = (placements(mine), placements(theirs))
    saved = full_parameters(models[0])
    dcp_save(mine, checkpoint_id=directory)
    with torch.no_grad():
        for parameter in models[0].parameters():
            parameter.add_(1.0)
    loaded = get_model_state_dict(models[0])
    dcp_load(loaded, checkpoint_id=directory)
    set_model_state_dict(models[0], loaded)
    results["dcp_gap"] = largest_gap(full_parameters(models[0]), saved)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Results]:
    directory = str(tmp_path_factory.mktemp("hsdp_tp_checkpoint"))
    return run_distributed(_job, 8, timeout=300.0, args=(directory,))


def test_hsdp_tp_parameters_get_torch_fully_shard_placements(ranks: list[Results]) -> None:
    for results in ranks:
        mine, theirs = results["layout"]
        assert mine == theirs
        assert {entry[2] for entry in mine} == {(2, 2, 2)}
        assert "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))" in {
            entry[1] for entry in mine
        }


def test_hsdp_tp_trains_as_torch_fully_shard_with_adamw(ranks: list[Results]) -> None:
    for results in ranks:
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["losses"])
        assert results["gradient_gap"] <= TOLERANCE
        assert results["parameter_gap"] <= TOLERANCE
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["norms"])


def test_hsdp_tp_sharded_state_dict_has_torch_fully_shard_placements(
    ranks: list[Results],
) -> None:
    for results in ranks:
        mine, theirs = results["state_dict"]
        assert mine == theirs


def test_hsdp_tp_checkpoint_round_trips_through_dcp(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["dcp_gap"] == 0.0
