"""fully_shard on DTensor parameters (tensor parallel, dp_mesh_dims): placements and refusals.

Over PyTorch's fake process group of 4 ranks: what needs no numbers. Each refusal
leaves the module as it was. The numbers, against FSDP2 on gloo ranks, are in
``tests/distributed/test_fully_shard_tp_gloo.py``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fake_world import fake_mesh
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from torchcontract import AlreadyManagedError, ContractError, InvalidMeshError
from torchcontract.apis import _compat, fully_shard

_REPLICATED = [Replicate(), Replicate()]

#: torch's DataParallelMeshDims (2.13 has it), or None.
DataParallelMeshDims: Any = _compat.DATA_PARALLEL_MESH_DIMS
needs_dp_mesh_dims = pytest.mark.skipif(
    DataParallelMeshDims is None,
    reason=f"dp_mesh_dims takes DataParallelMeshDims, which torch {torch.__version__} lacks",
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A (dp, tp) mesh of 4 x 1: room for an int ``reshard_after_forward`` between 1 and 4."""
    with fake_mesh((4, 1), ("dp", "tp")) as mesh:
        yield mesh


def _column_parallel(mesh: DeviceMesh) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    return model


def _unchanged(model: nn.Sequential, mesh: DeviceMesh) -> bool:
    weight = model[0].weight
    return (
        type(model) is nn.Sequential
        and isinstance(weight, DTensor)
        and weight.device_mesh == mesh["tp"]
        and not fully_shard.is_applied(model)
    )


def test_tp_parameters_live_on_the_dp_and_tp_dims(mesh: DeviceMesh) -> None:
    model = fully_shard(_column_parallel(mesh), mesh=mesh["dp"])
    weight = model[0].weight
    assert isinstance(weight, DTensor)
    assert weight.device_mesh.mesh_dim_names == ("dp", "tp")
    assert weight.placements == (Shard(0), Shard(0))  # TP's split of 1: no _StridedShard
    assert weight.to_local().shape == (2, 4)


def test_an_int_reshard_after_forward_with_tp_parameters_is_refused(mesh: DeviceMesh) -> None:
    model = _column_parallel(mesh)
    with pytest.raises(NotImplementedError, match=r"parameter '0.weight', a tensor-parallel"):
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=2)
    assert _unchanged(model, mesh)


def test_an_int_reshard_after_forward_with_dim_1_shards_is_refused(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(NotImplementedError, match=r"parameter '0.weight', split on dim 1"):
        fully_shard(
            model,
            mesh=mesh["dp"],
            reshard_after_forward=2,
            shard_placement_fn=lambda parameter: Shard(1) if parameter.dim() == 2 else None,
        )
    assert not any(isinstance(parameter, DTensor) for parameter in model.parameters())


def test_a_dtensor_on_the_data_parallel_mesh_is_refused(mesh: DeviceMesh) -> None:
    linear = nn.Linear(4, 8)
    model = nn.Sequential(linear)
    linear.weight = nn.Parameter(
        distribute_tensor(linear.weight.detach(), mesh["dp"], [Replicate()])
    )
    with pytest.raises(AlreadyManagedError, match=r"'0.weight' is already a DTensor on fully"):
        fully_shard(model, mesh=mesh["dp"])
    assert type(model) is nn.Sequential
    weight = model[0].weight
    assert isinstance(weight, DTensor)
    assert weight.device_mesh == mesh["dp"]


def test_a_partial_dtensor_is_refused(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(4, 8))
    partial = DTensor.from_local(torch.ones(8, 4), mesh["tp"], [Partial()], run_check=False)
    model[0].weight = nn.Parameter(partial)
    with pytest.raises(NotImplementedError, match=r"'0.weight' is a DTensor with a Partial"):
        fully_shard(model, mesh=mesh["dp"])
    assert type(model) is nn.Sequential


def test_a_tp_placement_out_of_range_is_refused_naming_the_parameter(mesh: DeviceMesh) -> None:
    model = _column_parallel(mesh)
    with pytest.raises(ValueError, match=r"Shard\(-3\) for parameter '0.weight' of 2 dims"):
        fully_shard(model, mesh=mesh["dp"], shard_placement_fn=lambda parameter: Shard(-3))
    assert _unchanged(model, mesh)


# ----------------------------------------------------------------- dp_mesh_dims


@needs_dp_mesh_dims
def test_dp_mesh_dims_shards_dtensors_of_the_full_mesh(mesh: DeviceMesh) -> None:
    linear = nn.Linear(4, 8)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, _REPLICATED))
    linear.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, _REPLICATED))
    model = fully_shard(nn.Sequential(linear), mesh=mesh, dp_mesh_dims=DataParallelMeshDims("dp"))
    weight = model[0].weight
    assert isinstance(weight, DTensor)
    assert weight.device_mesh == mesh
    assert weight.placements == (Shard(0), Replicate())
    assert weight.to_local().shape == (2, 4)


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_a_plain_parameter_naming_it(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is a plain tensor"):
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims("dp"))
    assert type(model) is nn.Sequential


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_a_name_the_mesh_lacks(mesh: DeviceMesh) -> None:
    with pytest.raises(ValueError, match=r"names 'fsdp', which is not a dim of the mesh"):
        fully_shard(nn.Linear(4, 8), mesh=mesh, dp_mesh_dims=DataParallelMeshDims("fsdp"))


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_an_int_reshard_after_forward(mesh: DeviceMesh) -> None:
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2 \(an int\) with dp"):
        fully_shard(
            nn.Linear(4, 8),
            mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims("dp"),
            reshard_after_forward=2,
        )


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_a_parameter_sharded_on_a_data_parallel_dim(
    mesh: DeviceMesh,
) -> None:
    linear = nn.Linear(4, 8)
    sharded = distribute_tensor(linear.weight.detach(), mesh, [Shard(0), Replicate()])
    linear.weight = nn.Parameter(sharded)
    with pytest.raises(ValueError, match=r"'0.weight' is Shard\(dim=0\) on data-parallel mesh"):
        fully_shard(nn.Sequential(linear), mesh=mesh, dp_mesh_dims=DataParallelMeshDims("dp"))


def test_dp_mesh_dims_where_torch_has_none_is_a_type_error(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a torch without ``DataParallelMeshDims``, whatever is passed; here made so."""
    monkeypatch.setattr(_compat, "DATA_PARALLEL_MESH_DIMS", None)
    dims: Any = object() if DataParallelMeshDims is None else DataParallelMeshDims("dp")
    with pytest.raises(TypeError, match=r"dp_mesh_dims needs torch.distributed.fsdp.DataPar"):
        fully_shard(nn.Linear(4, 8), mesh=mesh, dp_mesh_dims=dims)


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_shard_dims_apart_and_replicate_alone(mesh: DeviceMesh) -> None:
    """Flattening takes adjacent dims; replicate alone is FSDP2's DDP mode, not taken."""
    cube = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "tp", "b"))
    with pytest.raises(NotImplementedError, match=r"shard=\('a', 'b'\) is not supported"):
        fully_shard(nn.Linear(4, 8), mesh=cube, dp_mesh_dims=DataParallelMeshDims(("a", "b")))
    with pytest.raises(NotImplementedError, match=r"shard=\(\) is not supported"):
        fully_shard(nn.Linear(4, 8), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))


# ----------------------------------------------------------------- meshes refused


def _exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def _replicated_on(tp_mesh: DeviceMesh) -> nn.Sequential:
    linear = nn.Linear(4, 8)
    replicated = [Replicate()] * tp_mesh.ndim
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), tp_mesh, replicated))
    return nn.Sequential(linear)


def test_a_tp_parameter_on_a_3d_mesh_is_refused(mesh: DeviceMesh) -> None:
    hyper = init_device_mesh("cpu", (4, 1, 1, 1), mesh_dim_names=("dp", "a", "b", "c"))
    model = _replicated_on(hyper["a", "b", "c"])
    refused = (
        "fully_shard on Sequential: parameter '0.weight' is a DTensor on a 3-D mesh; "
        "fully_shard, as FSDP2, takes tensor-parallel parameters on a 1-D or 2-D mesh"
    )
    with pytest.raises(NotImplementedError, match=_exactly(refused)):
        fully_shard(model, mesh=hyper["dp"])
    assert type(model) is nn.Sequential


def test_a_tp_parameter_on_a_mesh_of_another_root_is_refused(mesh: DeviceMesh) -> None:
    model = _replicated_on(init_device_mesh("cpu", (4,), mesh_dim_names=("other",)))
    with pytest.raises(
        InvalidMeshError,
        match=r"^fully_shard on Sequential: parameter '0.weight' is a DTensor on a mesh that "
        r"cannot stand beside fully_shard's mesh \((RuntimeError|ValueError): .*\); slice both "
        r"from one "
        r"named mesh, e.g. mesh\['tp'\] for parallelize_module and mesh\['dp'\] for fully_shard$",
    ):
        fully_shard(model, mesh=mesh["dp"])
    assert type(model) is nn.Sequential


def test_where_torch_cannot_concatenate_meshes_the_root_is_sliced_by_name(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.6 has no ``DeviceMesh._concatenate``: the same placements, as its FSDP2's."""
    expected = fully_shard(_column_parallel(mesh), mesh=mesh["dp"])[0].weight
    monkeypatch.setattr(_compat, "_concatenate", None)
    weight = fully_shard(_column_parallel(mesh), mesh=mesh["dp"])[0].weight
    assert isinstance(weight, DTensor)
    assert isinstance(expected, DTensor)
    assert weight.device_mesh == expected.device_mesh
    assert weight.device_mesh.mesh_dim_names == ("dp", "tp")
    assert weight.placements == expected.placements


def test_without_concatenation_meshes_of_two_roots_are_refused(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_compat, "_concatenate", None)
    model = _column_parallel(mesh)
    other = init_device_mesh("cpu", (4, 1), mesh_dim_names=("data", "model"))
    with pytest.raises(InvalidMeshError, match=r"\(ValueError: the meshes are not named slices"):
        fully_shard(model, mesh=other["data"])
    assert _unchanged(model, mesh)


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_a_field_that_is_not_names(mesh: DeviceMesh) -> None:
    dims = DataParallelMeshDims(shard=["dp"])
    refused = (
        "fully_shard on Linear: dp_mesh_dims.shard must be a mesh dim name, a tuple of them or "
        "None, got a list; pass e.g. DataParallelMeshDims(shard='dp')"
    )
    with pytest.raises(TypeError, match=_exactly(refused)):
        fully_shard(nn.Linear(4, 8), mesh=mesh, dp_mesh_dims=dims)


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_a_mesh_without_names(mesh: DeviceMesh) -> None:
    refused = (
        "fully_shard on Linear: dp_mesh_dims names mesh dims, and the mesh has no "
        "mesh_dim_names; build it with init_device_mesh(..., mesh_dim_names=...)"
    )
    with pytest.raises(ValueError, match=_exactly(refused)):
        fully_shard(
            nn.Linear(4, 8),
            mesh=init_device_mesh("cpu", (4,)),
            dp_mesh_dims=DataParallelMeshDims("dp"),
        )


@needs_dp_mesh_dims
def test_dp_mesh_dims_refuses_a_dtensor_on_another_mesh(mesh: DeviceMesh) -> None:
    model = _replicated_on(init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "other")))
    refused = (
        "fully_shard on Sequential: parameter '0.weight' is a DTensor on another mesh than the "
        "one passed as mesh=; with dp_mesh_dims, distribute every parameter on that mesh, or "
        "pass the mesh it is on"
    )
    with pytest.raises(ValueError, match=_exactly(refused)):
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims("dp"))
    assert type(model) is nn.Sequential


def test_a_deep_copy_of_a_tp_sharded_module_is_refused(mesh: DeviceMesh) -> None:
    """As FSDP2: the DTensor shards on (dp, tp) would have no group to gather them."""
    model = fully_shard(_column_parallel(mesh), mesh=mesh["dp"])
    refused = (
        "fully_shard on Sequential: a sharded module cannot be deep-copied (its parameters are "
        "shards of tensors spread over the mesh's ranks, gathered by its process group); copy "
        "the model before fully_shard, or save its state dict (model.state_dict(), or "
        "get_model_state_dict for full tensors) and load it into a new model sharded the same way"
    )
    with pytest.raises(ContractError, match=_exactly(refused)):
        copy.deepcopy(model)
    assert fully_shard.is_applied(model)
    weight = model[0].weight
    assert isinstance(weight, DTensor)
    assert weight.device_mesh.mesh_dim_names == ("dp", "tp")
