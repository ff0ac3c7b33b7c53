"""The one place that knows which torch release has what.

Features are detected, not inferred from version numbers, wherever torch lets
us look: a backport or a private-API change then needs no edit here. The
oldest release tested is ``OLDEST_TESTED``; ``make compat`` runs the suite
against it and the newest one these machines hold.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any, Final, cast

import torch
import torch.distributed as dist
import torch.distributed.fsdp
from torch.distributed.device_mesh import DeviceMesh, _mesh_resources
from torch.distributed.fsdp._fully_shard import _fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils import checkpoint as torch_checkpoint

__all__ = [
    "DATA_PARALLEL_MESH_DIMS",
    "DDP_KEYWORDS",
    "GLOO_AVERAGES",
    "OLDEST_TESTED",
    "REFERENCE_FULLY_SHARD_ON_CPU",
    "TORCH_VERSION",
    "all_gather_single",
    "checkpoint_generator",
    "concatenate_meshes",
    "fsdp_module_new_runs_init",
    "reduce_scatter_single",
    "root_mesh",
]

#: ``(major, minor)`` of the running torch.
TORCH_VERSION: Final = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
OLDEST_TESTED: Final = (2, 6)

#: Whether PyTorch's own ``fully_shard`` (the reference ours is compared with) runs on
#: CPU with gloo: torch 2.6's fails there (its CPU stream has no ``record_event``);
#: 2.13 and 2.14 run; the releases between are not tested, so not assumed.
REFERENCE_FULLY_SHARD_ON_CPU: Final = TORCH_VERSION >= (2, 13)

#: Whether gloo takes ``ReduceOp.AVG``: torch 2.6's sums where a reduce-scatter asks it
#: to average, and refuses it in an all-reduce; 2.13 and 2.14 average (a sum, then a
#: division); the releases between are not tested, so not assumed.
GLOO_AVERAGES: Final = TORCH_VERSION >= (2, 13)

#: The keywords this torch's ``DistributedDataParallel`` takes: ``replicate`` refuses one
#: of DDP's keywords this torch's DDP lacks (newer releases add some).
DDP_KEYWORDS: Final = frozenset(
    inspect.signature(
        cast(Callable[..., None], vars(DistributedDataParallel)["__init__"])
    ).parameters
)

_generator: Final = cast(
    Callable[..., Generator[None, None, None]],
    torch_checkpoint._checkpoint_without_reentrant_generator,
)
# torch 2.7 added ``early_stop`` between ``debug`` and the function's arguments.
_HAS_EARLY_STOP: Final = "early_stop" in inspect.signature(_generator).parameters


def checkpoint_generator(
    fn: Callable[..., object],
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
    determinism_check: str,
    *args: object,
    **kwargs: object,
) -> Generator[None, None, None]:
    """torch's non-reentrant checkpoint generator for ``fn(*args, **kwargs)``; yields once.

    Without debug output, stopping recomputation early where this torch can.
    """
    if _HAS_EARLY_STOP:
        return _generator(
            fn, preserve_rng_state, context_fn, determinism_check, False, True, *args, **kwargs
        )
    return _generator(fn, preserve_rng_state, context_fn, determinism_check, False, *args, **kwargs)


def _first_of(*names: str) -> Callable[..., dist.Work | None]:
    """The first function of ``names`` that this torch's ``torch.distributed`` has."""
    for name in names:
        found: Callable[..., dist.Work | None] | None = getattr(dist, name, None)
        if found is not None:
            return found
    raise ImportError(f"torchcontract: torch {torch.__version__} has none of {names}")


# Newer torch renamed all_gather_into_tensor and reduce_scatter_tensor to *_single and
# deprecated the old names: take the new ones where they exist.
#: ``(output, input, group=...)``: every rank's ``input`` concatenated into ``output``.
all_gather_single: Final = _first_of("all_gather_single", "all_gather_into_tensor")
#: ``(output, input, op=..., group=...)``: ``input`` reduced, this rank's slice in ``output``.
reduce_scatter_single: Final = _first_of("reduce_scatter_single", "reduce_scatter_tensor")


def fsdp_module_new_runs_init() -> bool:
    """Whether ``FSDPModule.__new__`` runs ``__init__`` on the module it builds.

    It always does on releases without ``disable_fsdp_module_new_init``; on those with
    it, not inside that context. Read at each call, as torch's own ``__new__`` does.
    """
    enabled: object = getattr(_fully_shard, "_enable_fsdp_module_new_init", True)
    return enabled is not False


# DeviceMesh._concatenate (2.13 has it; detected, not assumed), with which FSDP2 puts a
# data-parallel mesh and a tensor-parallel one side by side. Releases without it (2.6)
# slice the root mesh by the dims' names instead, as their FSDP2 does.
_concatenate: Final = cast(
    Callable[[list[DeviceMesh]], DeviceMesh] | None, getattr(DeviceMesh, "_concatenate", None)
)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it is a root).

    ``DeviceMesh._get_root_mesh`` where this torch has it (its module-level
    ``_mesh_resources.get_root_mesh`` warns there that it will be deprecated);
    the latter on releases without the method (2.6).
    """
    method = cast(Callable[[], DeviceMesh] | None, getattr(mesh, "_get_root_mesh", None))
    if method is not None:
        return method()
    legacy = cast(Callable[[DeviceMesh], DeviceMesh], _mesh_resources.get_root_mesh)
    return legacy(mesh)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """The mesh whose dims are those of ``meshes`` in order, slices of one root mesh.

    Raises ``ValueError`` (or whatever torch's own checks raise) if they are not;
    callers say which API and module asked.
    """
    if _concatenate is not None:
        return _concatenate(meshes)
    names = [name for mesh in meshes for name in (mesh.mesh_dim_names or ())]
    roots = {id(root_mesh(mesh)) for mesh in meshes}
    if len(roots) != 1 or len(names) != sum(mesh.ndim for mesh in meshes):
        raise ValueError("the meshes are not named slices of one device mesh")
    return root_mesh(meshes[0])[tuple(names)]


#: torch's ``DataParallelMeshDims`` (``fully_shard``'s ``dp_mesh_dims``), or None where this
#: torch's FSDP2 has none.
DATA_PARALLEL_MESH_DIMS: Final = cast(
    type | None, getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
)
