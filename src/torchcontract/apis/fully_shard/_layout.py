"""A managed parameter's layout: which tensor is split on which dim, and the DTensors it makes.

``fully_shard`` splits one tensor of each parameter on one dim over the shard
dim of the data-parallel mesh. For a plain parameter that is the parameter
itself, and the shard is a ``DTensor`` on the data-parallel mesh:
``(Shard(d),)``, or ``(Replicate(), Shard(d))`` for HSDP.

For a parameter that tensor parallelism made a ``DTensor`` (``parallelize_module``
on a ``tp`` mesh), it is the parameter's TP-local tensor, as in FSDP2's
``FSDPParam._init_sharding_spec_tp``: the shard is a ``DTensor`` on the
data-parallel mesh and the TP mesh concatenated, ``(dp..., tp)``, whose
placements are the data-parallel one followed by the TP ones. The data-parallel
placement is ``_StridedShard(d, split_factor=k)`` where TP already splits dim
``d`` into ``k`` parts (ColwiseParallel's ``Shard(0)`` weight: rows are split on
``tp`` first, then on ``dp``), else ``Shard(d)``. Collectives run over the
data-parallel groups only, and the unsharded parameter is the TP ``DTensor``
again, its local tensor the gathered rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, cast

import attrs
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from torchcontract import AlreadyManagedError, InvalidMeshError, module_label

from .. import _compat

__all__ = [
    "Layout",
    "TensorParallel",
    "Where",
    "check_post_forward",
    "data_parallel_shard",
    "layout_of",
    "local_tensor",
    "placement_dim",
]


@attrs.frozen
class TensorParallel:
    """The ``DTensor`` a parameter was: its mesh and placements (the unsharded form).

    ``keep``: mesh dims whose gradient placement is left as autograd made it (the
    data-parallel dims of an SPMD mesh, which the reduce-scatter reduces).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    keep: frozenset[int] = frozenset()


@attrs.frozen
class Layout:
    """How one managed parameter is split and which ``DTensor`` its shard and gathered form are.

    ``local_shape`` is the shape of the tensor ``fully_shard`` splits (the TP-local
    tensor under tensor parallelism); ``shape`` and ``stride`` those of the
    parameter as a whole, which its ``DTensor`` forms report.
    """

    dim: int
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    local_shape: torch.Size
    shape: torch.Size
    stride: tuple[int, ...]
    tensor_parallel: TensorParallel | None = None

    def sharded(self, local: Tensor) -> DTensor:
        """``local``, this rank's shard, as the sharded ``DTensor`` (no autograd)."""
        return self._dtensor(local, self.mesh, self.placements)

    def unsharded(self, local: Tensor) -> Tensor:
        """``local``, the gathered tensor, as the parameter the module computes with.

        The TP ``DTensor`` under tensor parallelism (sharing ``local``'s storage),
        else ``local`` itself.
        """
        tensor_parallel = self.tensor_parallel
        if tensor_parallel is None:
            return local
        return self._dtensor(local, tensor_parallel.mesh, tensor_parallel.placements)

    def _dtensor(
        self, local: Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
    ) -> DTensor:
        """``local`` as this rank's part of a ``DTensor`` of the parameter's shape and stride."""
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def local_grad(self, grad: Tensor) -> Tensor:
        """The gradient of the unsharded parameter as a tensor of ``local_shape``.

        Under tensor parallelism autograd gives a ``DTensor``; one placed otherwise
        than the parameter (a ``Partial`` sum) is redistributed first, as FSDP2 does.
        """
        tensor_parallel = self.tensor_parallel
        if tensor_parallel is None or not isinstance(grad, DTensor):
            return grad
        target = tuple(
            placement if index in tensor_parallel.keep else tensor_parallel.placements[index]
            for index, placement in enumerate(grad.placements)
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return grad.to_local()


def data_parallel_shard(
    dim: int, mesh: DeviceMesh, placements: Iterable[tuple[int, Placement]]
) -> Placement:
    """The shard dim's placement: ``Shard(dim)``, strided where ``placements`` split ``dim`` too.

    ``placements`` are the later (tensor-parallel) ones, by their dim of ``mesh``:
    rows are split on those first, then on the shard dim (FSDP2's ``_StridedShard``).
    """
    split = 1
    for index, placement in placements:
        if isinstance(placement, Shard | _StridedShard) and placement_dim(placement) == dim:
            split *= mesh.size(index)
    return _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)


def _placement_of(dim: int, mesh: DeviceMesh, shard: Placement) -> tuple[Placement, ...]:
    """The data-parallel placements: ``shard``, after ``Replicate()`` for HSDP."""
    return (shard,) if mesh.ndim == 1 else (Replicate(), shard)


def layout_of(
    target: nn.Module, fqn: str, parameter: nn.Parameter, mesh: DeviceMesh, dim: int
) -> Layout:
    """The layout of ``parameter`` (named ``fqn``) sharded on ``dim`` over ``mesh``.

    ``dim`` is already normalized (non-negative, within the tensor's dims). ``target``
    is the module applied to, named in errors. Reads only.

    Raises:
        NotImplementedError: a DTensor parameter with a ``Partial`` placement, or more
            than two TP mesh dims (as FSDP2).
        AlreadyManagedError: a DTensor parameter on ``mesh`` or on some of its dims.
        InvalidMeshError: a DTensor parameter on a mesh that is not, with ``mesh``, a
            slice of one mesh.
    """
    if not isinstance(parameter, DTensor):
        return Layout(
            dim=dim,
            mesh=mesh,
            placements=_placement_of(dim, mesh, Shard(dim)),
            local_shape=parameter.shape,
            shape=parameter.shape,
            stride=parameter.stride(),
        )
    dtensor = cast(DTensor, parameter)
    tp_mesh = dtensor.device_mesh
    tp_placements = tuple(dtensor.placements)
    where = Where(target, fqn)
    if any(isinstance(placement, Partial) for placement in tp_placements):
        raise NotImplementedError(
            f"{where} is a DTensor with a Partial placement {tp_placements}; fully_shard shards "
            "Shard or Replicate tensor-parallel parameters: redistribute it first"
        )
    if len(tp_placements) > 2:
        raise NotImplementedError(
            f"{where} is a DTensor on a {len(tp_placements)}-D mesh; fully_shard, as FSDP2, "
            "takes tensor-parallel parameters on a 1-D or 2-D mesh"
        )
    shared = set(mesh.mesh_dim_names or ()).intersection(tp_mesh.mesh_dim_names or ())
    if tp_mesh == mesh or shared:
        raise AlreadyManagedError(
            f"{where} is already a DTensor on fully_shard's mesh or on some of its dims; "
            "apply tensor parallelism on other mesh dims than the data-parallel ones and pass "
            "the data-parallel sub-mesh as mesh= (e.g. mesh['dp'] of a (dp, tp) mesh)"
        )
    combined = _combined(where, mesh, tp_mesh)
    shard = data_parallel_shard(dim, tp_mesh, enumerate(tp_placements))
    return Layout(
        dim=dim,
        mesh=combined,
        placements=(*_placement_of(dim, mesh, shard), *tp_placements),
        local_shape=dtensor.to_local().shape,
        shape=dtensor.shape,
        stride=dtensor.stride(),
        tensor_parallel=TensorParallel(tp_mesh, tp_placements),
    )


def _combined(where: Where, mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The ``(dp..., tp...)`` mesh; ``InvalidMeshError`` unless both are named slices of one.

    Torch's concatenation refuses meshes whose ranks overlap, or of other roots.
    """
    try:
        return _compat.concatenate_meshes([mesh, tp_mesh])
    except Exception as error:  # torch's own checks raise assorted types
        raise InvalidMeshError(
            f"{where} is a DTensor on a mesh that cannot stand beside fully_shard's mesh "
            f"({type(error).__name__}: {error}); slice both from one named mesh, e.g. "
            "mesh['tp'] for parallelize_module and mesh['dp'] for fully_shard"
        ) from error


def placement_dim(placement: Placement) -> int:
    """The tensor dim a ``Shard`` (or ``_StridedShard``) splits."""
    dim: int = cast(Any, placement).dim  # Shard.dim is untyped for pyright
    return dim


def local_tensor(parameter: nn.Parameter) -> Tensor:
    """The tensor ``fully_shard`` splits: a DTensor's local tensor, else the parameter."""
    if isinstance(parameter, DTensor):
        return cast(DTensor, parameter).to_local()
    return parameter


class Where:
    """How an error names the module applied to and a parameter: built only when formatted.

    A module's label walks its applied trees; built for every parameter, it made
    each apply cost as much as every application before it.
    """

    __slots__ = ("fqn", "target")

    def __init__(self, target: nn.Module, fqn: str | None = None) -> None:
        self.target, self.fqn = target, fqn

    def __str__(self) -> str:
        where = f"fully_shard on {module_label(self.target)}"
        return where if self.fqn is None else f"{where}: parameter {self.fqn!r}"


class _Named(Protocol):
    @property
    def fqn(self) -> str: ...


def check_post_forward(
    target: nn.Module, parameters: Iterable[tuple[_Named, Layout]], value: object
) -> None:
    """Refuse an int ``reshard_after_forward`` (a post-forward mesh) for a parameter it cannot take.

    Post-forward resharding keeps a rank's share of gathered dim-0 rows of plain
    parameters only. FSDP2 refuses DTensor parameters too, at their first forward
    (``to_sharded_post_forward``); here the refusal comes at apply, naming the
    first such parameter. Raises ``NotImplementedError``.
    """
    for item, layout in parameters:
        if layout.tensor_parallel is None and layout.dim == 0:
            continue
        what = f"split on dim {layout.dim}"
        if layout.tensor_parallel is not None:
            what = "a tensor-parallel DTensor"
        raise NotImplementedError(
            f"{Where(target)}: reshard_after_forward={value!r} (a post-forward mesh) "
            f"with parameter {item.fqn!r}, {what}, is not supported (only dim-0 shards of "
            "plain parameters are; FSDP2 refuses DTensor ones too): pass True or False"
        )
