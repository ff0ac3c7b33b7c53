"""fully_shard's arguments: checked before anything changes, and read as FSDP2 reads them.

Each check raises the exception type FSDP2 raises for the same argument, naming the
module and what to pass instead; ``read_resharding`` and ``post_forward_size_of`` read
``reshard_after_forward`` as FSDP2 does, and ``default_mesh`` is FSDP2's default mesh.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

import torchcontract
from torchcontract import (
    InvalidMeshError,
    NoProcessGroupError,
    UnnamedMeshError,
    module_label,
)

from .. import _torch

__all__ = [
    "check_arguments",
    "check_mesh",
    "check_offload",
    "check_spmd_resharding",
    "default_mesh",
    "post_forward_mesh",
    "post_forward_size_of",
    "read_resharding",
]


def default_mesh(target: nn.Module) -> DeviceMesh:
    """A 1-D mesh over the default process group on the accelerator, else CPU (as FSDP2).

    Never on the parameters' device: a model built on ``meta`` would get a ``meta``
    mesh and fail at its first backward after ``to_empty``.
    """
    if not dist.is_initialized():
        raise NoProcessGroupError(
            f"fully_shard on {module_label(target)}: no default process group and no mesh; call "
            "torch.distributed.init_process_group() first, or pass mesh="
        )
    return init_device_mesh(_torch.accelerator_type(), (dist.get_world_size(),))


def _shown(value: object) -> str:
    """``value`` in an error message: its repr if short and simple, else its type's name."""
    if isinstance(value, str | int | float | None):
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:37]}..."
    return f"a {type(value).__qualname__}"


def check_arguments(
    target: nn.Module,
    *,
    mesh: object,
    reshard_after_forward: object,
    mp_policy: object,
    offload_policy: object,
    shard_placement_fn: object,
    ignored_params: object,
) -> None:
    """Raise ``TypeError`` naming the argument for one of a wrong type, before anything else."""
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard on {module_label(target)}: mesh must be a DeviceMesh or None, got "
            f"{_shown(mesh)}; pass mesh=init_device_mesh(device_type, (world_size,)) "
            "(DeviceMesh.from_group(group, device_type) wraps a process group)"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"fully_shard on {module_label(target)}: reshard_after_forward must be a bool, an "
            f"int or None, got {_shown(reshard_after_forward)}; pass True to free the "
            "parameters after forward, False to keep them, None for FSDP2's default"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard on {_label(target)}: mp_policy must be a torch.distributed.fsdp."
            f"MixedPrecisionPolicy, got {_shown(mp_policy)}; pass e.g. "
            "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype: object = getattr(mp_policy, name)
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"fully_shard on {_label(target)}: mp_policy.{name} must be a torch.dtype or None, "
                f"got {_shown(dtype)}; pass e.g. {name}=torch.bfloat16"
            )
        if not dtype.is_floating_point:
            raise ValueError(
                f"fully_shard on {_label(target)}: mp_policy.{name} must be a floating-point "
                f"dtype, got {dtype}; pass e.g. {name}=torch.bfloat16, or None"
            )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard on {_label(target)}: offload_policy must be a torch.distributed.fsdp."
            f"OffloadPolicy, got {_shown(offload_policy)}; pass OffloadPolicy() or "
            "CPUOffloadPolicy()"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"fully_shard on {_label(target)}: shard_placement_fn must be callable or None, got "
            f"{_shown(shard_placement_fn)}; pass a function of a parameter returning Shard(dim) "
            "or None"
        )
    if ignored_params is not None and not _is_parameter_set(ignored_params):
        raise TypeError(
            f"fully_shard on {_label(target)}: ignored_params must be a set of nn.Parameter or "
            f"None, got {_shown(ignored_params)}; pass e.g. ignored_params={{model.head.weight}}"
        )


def _is_parameter_set(value: object) -> bool:
    if not isinstance(value, set | frozenset):
        return False
    items = cast("set[object] | frozenset[object]", value)
    return all(isinstance(item, nn.Parameter) for item in items)


def _label(target: nn.Module) -> str:
    return module_label(target)


def check_offload(target: nn.Module, policy: OffloadPolicy, mesh: DeviceMesh) -> None:
    """Accept ``CPUOffloadPolicy`` on a CPU mesh (the shards are on CPU already), refuse it else."""
    if isinstance(policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError(
            f"fully_shard on {module_label(target)}: offload_policy=CPUOffloadPolicy() on a "
            f"{mesh.device_type!r} mesh is not supported (keeping the shards, their gradients and "
            "the optimizer step on CPU between uses); pass offload_policy=OffloadPolicy(), or a "
            "CPU mesh"
        )


def check_spmd_resharding(target: nn.Module, value: bool | int | None) -> None:
    """As FSDP2: an int ``reshard_after_forward`` is refused with ``dp_mesh_dims``."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise NotImplementedError(
            f"fully_shard on {module_label(target)}: reshard_after_forward={value} (an int) "
            "with dp_mesh_dims is not supported, as in FSDP2; pass True or False"
        )


def check_mesh(target: nn.Module, mesh: DeviceMesh) -> None:
    """A 1-D mesh shards; a 2-D one ``(replicate, shard)`` is HSDP, as FSDP2 reads it.

    Each message holds FSDP2's own for the same mesh, after ours.
    """
    if mesh.ndim not in (1, 2):
        raise InvalidMeshError(
            f"fully_shard on {module_label(target)}: expected a 1-D mesh (sharding) or a 2-D "
            f"mesh (replicate, shard) for HSDP, got one of shape {tuple(mesh.shape)} "
            f"(FSDP2: fully_shard expects a 1D or 2D DeviceMesh but got {mesh}); pass "
            "mesh=init_device_mesh(device, (world_size,)), or (replicas, shard_size), or "
            "slice it (mesh['replicate', 'shard'])"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise UnnamedMeshError(
            f"fully_shard on {module_label(target)}: a 2-D mesh (HSDP) needs dim names "
            "(FSDP2: Please init the 2D mesh for HSDP with mesh_dim_names specified); pass "
            "init_device_mesh(device, (replicas, shard_size), mesh_dim_names=('replicate', "
            "'shard'))"
        )


def read_resharding(target: nn.Module, value: bool | int | None, mesh: DeviceMesh) -> bool | None:
    """``reshard_after_forward`` as FSDP2 reads it: None, True or False; an int checked.

    An int is the world size to reshard to after forward, a divisor of the shard
    dim's size: 1 means False (FSDP2 warns as well), the size True, and a divisor in
    between True on a smaller post-forward mesh (``post_forward_mesh``). Raises
    ``ValueError`` for any other int.
    """
    if value is None or isinstance(value, bool):
        return value
    size = mesh.size(mesh.ndim - 1)  # the shard dim's (HSDP replicates over the other)
    if value < 1 or value > size or size % value != 0:
        raise ValueError(
            f"fully_shard on {module_label(target)}: reshard_after_forward as an int is the "
            f"world size to reshard to after forward and must divide the mesh's size {size}, "
            f"got {value}; pass True, False or a divisor of {size}"
        )
    if value == 1:
        warnings.warn(
            f"fully_shard on {module_label(target)}: reshard_after_forward=1 (int) reshards to "
            "a world of 1, which keeps the parameters unsharded after forward (False); pass "
            "True to free them",
            UserWarning,
            stacklevel=_caller_level(),
        )
        return False
    return True


def post_forward_size_of(value: bool | int | None, mesh: DeviceMesh) -> int | None:
    """``value`` if it is an int strictly between 1 and the shard dim's size, else None."""
    if value is None or isinstance(value, bool) or value in (1, mesh.size(mesh.ndim - 1)):
        return None
    return value


def post_forward_mesh(size: int, mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's post-forward mesh for an int between 1 and the shard size: ranks in rows of it.

    Every rank builds it (new process groups), as every rank applies ``fully_shard``.
    """
    return DeviceMesh(mesh.device_type, mesh.mesh.view(-1, size))


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside this package."""
    package = str(Path(torchcontract.__file__).parent)
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        level, frame = level + 1, frame.f_back
    return level
