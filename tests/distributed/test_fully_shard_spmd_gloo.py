"""``dp_mesh_dims`` on 4 gloo ranks: DTensor parameters of a full (dp, tp) mesh, against FSDP2.

Every parameter is distributed on the whole mesh (``Replicate()`` on ``dp``, split
on ``tp``) and the inputs are DTensors sharded on ``dp``; ``fully_shard`` with
``dp_mesh_dims=DataParallelMeshDims(shard="dp")``, ours and FSDP2's side by side:
placements and bytes, losses and parameters after AdamW steps, and a DCP round trip.
The same job runs HSDP through ``dp_mesh_dims=DataParallelMeshDims(shard="dp",
replicate="rep")`` on a mesh in each dim order, ``(rep, dp)`` and ``(dp, rep)``: the
data-parallel mesh must be ``(replicate, shard)`` either way, as FSDP2 builds it, so
swapping the shard and replicate dims fails one order or the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from fully_shard_models import full_parameters, largest_gap
from tensor_parallel_models import mlp_batch, mlp_stack
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from torchcontract.apis import fully_shard
from torchcontract.apis._compat import DATA_PARALLEL_MESH_DIMS, REFERENCE_FULLY_SHARD_ON_CPU
from torchcontract.testing import run_distributed

Results = dict[str, Any]
FEATURES, HIDDEN = 8, 12
STEPS = 3
TOLERANCE = 1e-6
#: How each block parameter is split on ``tp``: column-wise ``up``, row-wise ``down``.
ON_TP: dict[str, Placement] = {
    "up.weight": Shard(0),
    "up.bias": Shard(0),
    "down.weight": Shard(1),
    "down.bias": Replicate(),
}

pytestmark = pytest.mark.skipif(
    not REFERENCE_FULLY_SHARD_ON_CPU or DATA_PARALLEL_MESH_DIMS is None,
    reason=f"compares with PyTorch's fully_shard and dp_mesh_dims, which torch "
    f"{torch.__version__} lacks on CPU",
)


def _model(torch_api: bool, mesh: DeviceMesh, flat: bool = False, hsdp: bool = False) -> nn.Module:
    """The MLP stack on ``mesh``: split on ``tp``, or (``flat``, ``hsdp``) replicated on both dims.

    ``hsdp``: on a mesh of dims ``dp`` and ``rep``, sharded over ``dp``, replicated over ``rep``.
    """
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard: Any = torch_fully_shard if torch_api else fully_shard
    if hsdp:
        dims = DataParallelMeshDims(shard="dp", replicate="rep")
    else:
        dims = DataParallelMeshDims(shard=("dp", "tp") if flat else "dp")
    model = mlp_stack(FEATURES, HIDDEN)
    for block in model:
        for name, placement in ON_TP.items():
            owner, attribute = name.split(".")
            tensor = block.get_submodule(owner).get_parameter(attribute).detach()
            second = Replicate() if flat or hsdp else placement
            distributed = distribute_tensor(tensor, mesh, [Replicate(), second])
            setattr(block.get_submodule(owner), attribute, nn.Parameter(distributed))
        shard(block, mesh=mesh, dp_mesh_dims=dims)
    shard(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def _loss(model: nn.Module, x: Tensor) -> DTensor:
    out: Tensor = model(x)
    loss = out.pow(2).mean()
    assert isinstance(loss, DTensor)
    return loss


def _flattened(mesh: DeviceMesh) -> Results:
    """``shard=("dp", "tp")``: both dims flattened into one of 4 ranks, as FSDP2 does."""
    models = [_model(False, mesh, flat=True), _model(True, mesh, flat=True)]
    results = _train(models, mesh)
    results["meshes"] = [
        {(p.device_mesh.mesh_dim_names, str(p.placements)) for p in _dtensors(model)}
        for model in models
    ]
    return results


#: The HSDP meshes' dim orders: the replicate dim first, as FSDP2's own HSDP mesh, and last.
HSDP_ORDERS = (("rep", "dp"), ("dp", "rep"))


def _hsdp(order: tuple[str, str]) -> Results:
    """HSDP through ``dp_mesh_dims`` on a 2 x 2 mesh whose dims are named ``order``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=order)
    models = [_model(False, mesh, hsdp=True), _model(True, mesh, hsdp=True)]
    return _train(models, mesh, hsdp=True)


def _train(models: Sequence[nn.Module], mesh: DeviceMesh, hsdp: bool = False) -> Results:
    """Placements, local shapes, AdamW steps on inputs sharded on ``dp``: both models.

    With ``hsdp`` both mesh dims are data parallel: each rank has a batch of its own.
    """
    results: Results = {
        "layout": [
            [(str(p.placements), tuple(p.to_local().shape)) for p in _dtensors(model)]
            for model in models
        ],
        "losses": [],
    }
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for step in range(STEPS):
        if hsdp:
            x = DTensor.from_local(mlp_batch(mesh.get_rank(), step, FEATURES), mesh, [Shard(0)] * 2)
        else:
            local = mlp_batch(mesh.get_local_rank("dp"), step, FEATURES)
            x = DTensor.from_local(local, mesh, [Shard(0), Replicate()])
        losses = [_loss(model, x) for model in models]
        for loss in losses:
            torch.autograd.backward(loss)
        results["losses"].append(tuple(float(loss.full_tensor().detach()) for loss in losses))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    results["parameter_gap"] = largest_gap(full_parameters(models[0]), full_parameters(models[1]))
    return results


def _dtensors(model: nn.Module) -> list[DTensor]:
    found: list[DTensor] = []
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        found.append(parameter)
    return found


def _job(rank: int, world_size: int, directory: str) -> Results:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    models = [_model(False, mesh), _model(True, mesh)]
    results = _train(models, mesh)
    ours = models[0]
    saved = full_parameters(ours)
    dcp_save(get_model_state_dict(ours), checkpoint_id=directory)
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.add_(1.0)
    state = get_model_state_dict(ours)
    dcp_load(state, checkpoint_id=directory)
    set_model_state_dict(ours, state)
    results["dcp_gap"] = largest_gap(full_parameters(ours), saved)
    results["flattened"] = _flattened(mesh)
    results["hsdp"] = {order: _hsdp(order) for order in HSDP_ORDERS}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Results]:
    directory = str(tmp_path_factory.mktemp("spmd_checkpoint"))
    return run_distributed(_job, 4, timeout=150.0, args=(directory,))


def test_dp_mesh_dims_gives_torch_fully_shard_placements_and_bytes(ranks: list[Results]) -> None:
    for results in ranks:
        mine, theirs = results["layout"]
        assert mine == theirs
        assert {placements for placements, _ in mine} == {
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
            "(Shard(dim=0), Shard(dim=1))",
            "(Shard(dim=0), Replicate())",
        }


def test_dp_mesh_dims_trains_as_torch_fully_shard_with_adamw(ranks: list[Results]) -> None:
    for results in ranks:
        assert all(abs(mine - theirs) <= TOLERANCE for mine, theirs in results["losses"])
        assert results["parameter_gap"] <= TOLERANCE


def test_dp_mesh_dims_checkpoint_round_trips_through_dcp(ranks: list[Results]) -> None:
    for results in ranks:
        assert results["dcp_gap"] == 0.0


def test_dp_mesh_dims_flattens_several_shard_dims_as_torch_fully_shard(
    ranks: list[Results],
) -> None:
    for results in ranks:
        flattened = results["flattened"]
        mine, theirs = flattened["layout"]
        assert mine == theirs
        assert {placements for placements, _ in mine} == {"(Shard(dim=0),)"}
        assert flattened["meshes"][0] == flattened["meshes"][1]
        assert all(abs(a - b) <= TOLERANCE for a, b in flattened["losses"])
        assert flattened["parameter_gap"] <= TOLERANCE


@pytest.mark.parametrize("order", HSDP_ORDERS, ids=lambda order: f"({order[0]}, {order[1]})")
def test_dp_mesh_dims_hsdp_on_a_mesh_in_either_order_trains_as_torch_fully_shard(
    ranks: list[Results], order: tuple[str, str]
) -> None:
    """Sharded over ``dp`` and replicated over ``rep`` whichever comes first, as FSDP2."""
    expected = "(Replicate(), Shard(dim=0))" if order[0] == "rep" else "(Shard(dim=0), Replicate())"
    for results in ranks:
        hsdp = results["hsdp"][order]
        mine, theirs = hsdp["layout"]
        assert mine == theirs
        assert {placements for placements, _ in mine} == {expected}
        assert all(abs(a - b) <= TOLERANCE for a, b in hsdp["losses"])
        assert hsdp["parameter_gap"] <= TOLERANCE
