"""``dp_mesh_dims``: ``mesh`` is the full SPMD mesh and parameters are DTensors on it.

As FSDP2's ``_get_mesh_info_from_named_dims`` and ``_init_sharding_spec_spmd``:
``dp_mesh_dims.shard`` names the mesh dim parameters are sharded over and
``dp_mesh_dims.replicate`` (HSDP) the one gradients are also averaged over; every
parameter is a DTensor on ``mesh`` itself, ``Replicate()`` on those dims. Its local
tensor is split on the shard dim's ranks; the shard keeps the parameter's
placements with the shard dim's ``Replicate()`` replaced by ``Shard(d)``
(``_StridedShard`` where later mesh dims split dim ``d`` too); the unsharded
parameter is the original DTensor again. Gradients keep what their data-parallel
dims hold (FSDP2 leaves a ``Partial`` there for the reduce-scatter).

Several names in a field are flattened into one dim (new process groups), as
FSDP2 does; shard names must be adjacent mesh dims, and ``shard`` must be given
(``replicate`` alone is FSDP2's DDP mode, not taken).
"""

from __future__ import annotations

from typing import Any, cast

import attrs
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from .. import _compat
from ._layout import Layout, TensorParallel, Where, data_parallel_shard

__all__ = ["DataParallelDims", "data_parallel_dims", "spmd_layout"]


@attrs.frozen
class DataParallelDims:
    """The data-parallel dims of an SPMD mesh: the mesh collectives run on, and their indices.

    ``mesh`` is 1-D (the shard dim) or 2-D ``(replicate, shard)``, as the mesh
    ``fully_shard`` takes without ``dp_mesh_dims``; several names of one field are
    flattened into one of its dims, as FSDP2 does.
    """

    spmd_mesh: DeviceMesh
    mesh: DeviceMesh
    shard: tuple[int, ...]
    replicate: tuple[int, ...]


def _names(value: object, field: str, where: Where) -> tuple[str, ...]:
    """A ``DataParallelMeshDims`` field as a tuple of names; ``TypeError`` for anything else."""
    shown = type(value).__qualname__
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple) and all(isinstance(name, str) for name in cast(Any, value)):
        return cast(tuple[str, ...], value)
    raise TypeError(
        f"{where}: dp_mesh_dims.{field} must be a mesh dim name, a tuple of them or None, got "
        f"a {shown}; pass e.g. DataParallelMeshDims(shard='dp')"
    )


def data_parallel_dims(target: nn.Module, mesh: DeviceMesh, dims: object) -> DataParallelDims:
    """Check ``dims`` against ``mesh``; the data-parallel mesh it names (``target`` for errors).

    Raises ``TypeError`` if ``dims`` is not a ``DataParallelMeshDims`` (or this torch
    has none), ``ValueError`` for a name ``mesh`` lacks or an unnamed mesh, and
    ``NotImplementedError`` for shard dims that are not adjacent, or no ``shard``.
    """
    where = Where(target)
    kind = _compat.DATA_PARALLEL_MESH_DIMS
    if kind is None:
        raise TypeError(
            f"{where}: dp_mesh_dims needs torch.distributed.fsdp.DataParallelMeshDims, which "
            "this torch lacks; pass mesh= the data-parallel mesh and leave dp_mesh_dims None"
        )
    if not isinstance(dims, kind):
        raise TypeError(
            f"{where}: dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims or "
            f"None, got a {type(dims).__qualname__}; pass e.g. DataParallelMeshDims(shard='dp')"
        )
    shard = _names(getattr(dims, "shard", None), "shard", where)
    replicate = _names(getattr(dims, "replicate", None), "replicate", where)
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"{where}: dp_mesh_dims names mesh dims, and the mesh has no mesh_dim_names; "
            "build it with init_device_mesh(..., mesh_dim_names=...)"
        )
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(
                f"{where}: dp_mesh_dims names {name!r}, which is not a dim of the mesh {names}"
            )
    indices = [names.index(name) for name in shard]
    if not shard or indices != list(range(indices[0], indices[0] + len(indices))):
        raise NotImplementedError(
            f"{where}: dp_mesh_dims with shard={shard} is not supported: name the shard dim(s), "
            "adjacent in the mesh (replicate alone, FSDP2's DDP mode, is not supported)"
        )
    shard_mesh = _flat(mesh, shard)
    spmd_shard = tuple(indices)
    spmd_replicate = tuple(names.index(name) for name in replicate)
    if not replicate:
        return DataParallelDims(mesh, shard_mesh, spmd_shard, ())
    both = _compat.concatenate_meshes([_flat(mesh, replicate), shard_mesh])
    return DataParallelDims(mesh, both, spmd_shard, spmd_replicate)


def _flat(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh of ``names``: one dim as it is, several flattened (new process groups)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def spmd_layout(
    target: nn.Module, fqn: str, parameter: nn.Parameter, dims: DataParallelDims, dim: int
) -> Layout:
    """The layout of ``parameter``, a DTensor on the SPMD mesh, split on ``dim``.

    Raises ``ValueError`` naming ``fqn`` for a plain parameter, one on another mesh,
    or one not ``Replicate()`` on a data-parallel dim (as FSDP2).
    """
    where = Where(target, fqn)
    if not isinstance(parameter, DTensor):
        raise ValueError(
            f"{where} is a plain tensor; with dp_mesh_dims every parameter must be a DTensor "
            "on the mesh passed (e.g. through distribute_module)"
        )
    dtensor = cast(DTensor, parameter)
    if dtensor.device_mesh != dims.spmd_mesh:
        raise ValueError(
            f"{where} is a DTensor on another mesh than the one passed as mesh=; with "
            "dp_mesh_dims, distribute every parameter on that mesh, or pass the mesh it is on"
        )
    placements = list(dtensor.placements)
    data_parallel = [*dims.replicate, *dims.shard]
    for index in data_parallel:
        if not isinstance(placements[index], Replicate):
            raise ValueError(
                f"{where} is {placements[index]!r} on data-parallel mesh dim {index}; with "
                "dp_mesh_dims it must be Replicate() there"
            )
    sharded: list[Placement] = list(placements)
    for shard in dims.shard:
        later = [(index, placements[index]) for index in range(shard + 1, dims.spmd_mesh.ndim)]
        sharded[shard] = data_parallel_shard(dim, dims.spmd_mesh, later)
    mesh, sharded = _flattened(where, dims, sharded)
    return Layout(
        dim=dim,
        mesh=mesh,
        placements=tuple(sharded),
        local_shape=dtensor.to_local().shape,
        shape=dtensor.shape,
        stride=dtensor.stride(),
        tensor_parallel=TensorParallel(
            dims.spmd_mesh, tuple(placements), keep=frozenset(data_parallel)
        ),
    )


def _flattened(
    where: Where, dims: DataParallelDims, placements: list[Placement]
) -> tuple[DeviceMesh, list[Placement]]:
    """The sharded DTensor's mesh and placements, as FSDP2's ``_build_spmd_sharding_spec``.

    One shard dim: the SPMD mesh itself. Several: they become one dim, the
    data-parallel mesh (with its replicate dim before it, for HSDP) where the first
    of them was; the replicate dims move there too; the other dims stay.
    """
    if len(dims.shard) == 1:
        return dims.spmd_mesh, placements
    meshes: list[DeviceMesh] = []
    found: list[Placement] = []
    names = dims.spmd_mesh.mesh_dim_names or ()
    for index, name in enumerate(names):
        if index == dims.shard[0]:
            meshes.append(dims.mesh)
            if dims.replicate:
                found.append(Replicate())
            found.append(placements[index])
        elif index not in dims.shard and index not in dims.replicate:
            meshes.append(dims.spmd_mesh[name])
            found.append(placements[index])
    return _compat.concatenate_meshes(meshes), found
