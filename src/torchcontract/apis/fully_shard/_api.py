"""fully_shard(): shard a module's parameters over a data-parallel mesh, as PyTorch's FSDP2 does.

Apply validates everything first (mesh, every parameter), then shards: each
managed parameter is replaced, under each of its names, by an ``nn.Parameter``
holding a ``DTensor`` sharded on one dim (its ``Layout``, tensor parallelism's
DTensors included); the hooks of ``_hooks`` gather and free
the parameters around forward and backward. If the enclosing apply rolls back,
an undo step puts the original parameters back and removes the hooks.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Callable, Generator, Sequence, Set
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeVar, cast, overload

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)
from torch.distributed.tensor import Shard
from torch.utils.hooks import RemovableHandle

import torchcontract
from torchcontract import (
    AlreadyManagedError,
    Contract,
    ContractError,
    Incompatible,
    InvalidMeshError,
    ModuleListContract,
    ScalarParameterError,
    UnnamedMeshError,
    contract,
    exported_from,
    module_label,
    named_tree,
    on_rollback,
    root_modules,
)

from .. import _torch
from ..replicate import replicate
from ._group import ALL_GROUPS, ParamGroup
from ._hooks import ForwardHooks
from ._layout import Layout, check_post_forward, layout_of
from ._managed import MANAGED
from ._module import fully_shard_class, restore_class, unshard_group
from ._placement import shard_dim
from ._sharding import Location, ManagedParameter, new_origin
from ._spmd import DataParallelDims, data_parallel_dims, spmd_layout
from ._state import FullyShardState
from ._state_dict import register_state_dict_hooks
from ._torch_state import install_torch_state

if TYPE_CHECKING:
    from torch.distributed.fsdp import DataParallelMeshDims

__all__ = [
    "FullyShardAPI",
    "FullyShardFunction",
    "fully_shard",
    "fully_shard_no_sync",
    "reshard",
    "unshard",
]


@attrs.frozen
class _Found:
    """A parameter to manage: its first FQN, the object, and every place it is registered."""

    fqn: str
    parameter: nn.Parameter
    locations: list[Location]
    origin: int


def _default_mesh(target: nn.Module) -> DeviceMesh:
    """A 1-D mesh over the default process group on the accelerator, else CPU (as FSDP2).

    Never on the parameters' device: a model built on ``meta`` would get a ``meta``
    mesh and fail at its first backward after ``to_empty``.
    """
    if not dist.is_initialized():
        raise ContractError(
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


def _check_arguments(
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


def _check_offload(target: nn.Module, policy: OffloadPolicy, mesh: DeviceMesh) -> None:
    """Accept ``CPUOffloadPolicy`` on a CPU mesh (the shards are on CPU already), refuse it else."""
    if isinstance(policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError(
            f"fully_shard on {module_label(target)}: offload_policy=CPUOffloadPolicy() on a "
            f"{mesh.device_type!r} mesh is not supported (keeping the shards, their gradients and "
            "the optimizer step on CPU between uses); pass offload_policy=OffloadPolicy(), or a "
            "CPU mesh"
        )


def _layouts(
    target: nn.Module,
    found: Sequence[_Found],
    mesh: DeviceMesh,
    placement_fn: Callable[[nn.Parameter], object] | None,
    spmd: DataParallelDims | None,
) -> list[Layout]:
    """Each parameter's layout: its dim from ``placement_fn``, TP's DTensor if it is one.

    With ``spmd`` (``dp_mesh_dims``), each a DTensor on the full mesh.
    """
    world = mesh.size(mesh.ndim - 1)
    layouts: list[Layout] = []
    for item in found:
        _check_contiguous(target, item)
        dim = shard_dim(target, item.fqn, item.parameter, placement_fn, world)
        if spmd is None:
            layouts.append(layout_of(target, item.fqn, item.parameter, mesh, dim))
        else:
            layouts.append(spmd_layout(target, item.fqn, item.parameter, spmd, dim))
    return layouts


def _check_contiguous(target: nn.Module, item: _Found) -> None:
    """Refuse a non-contiguous parameter (``channels_last``), as FSDP2 does."""
    parameter = item.parameter
    if not parameter.is_contiguous():
        raise NotImplementedError(
            f"{_where(target, '', item.fqn)} is not contiguous (strides {parameter.stride()}, "
            "e.g. channels_last), which fully_shard, as FSDP2, does not shard (FSDP2: FSDP does "
            f"not support non-contiguous parameters yet: param.shape={parameter.shape} "
            f"param.stride()={parameter.stride()}); make it contiguous first "
            "(module.to(memory_format=torch.contiguous_format))"
        )


def _check_spmd_resharding(target: nn.Module, value: bool | int | None) -> None:
    """As FSDP2: an int ``reshard_after_forward`` is refused with ``dp_mesh_dims``."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise NotImplementedError(
            f"fully_shard on {module_label(target)}: reshard_after_forward={value} (an int) "
            "with dp_mesh_dims is not supported, as in FSDP2; pass True or False"
        )


def _check_mesh(target: nn.Module, mesh: DeviceMesh) -> None:
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


def _resharding(target: nn.Module, value: bool | int | None, mesh: DeviceMesh) -> bool | None:
    """``reshard_after_forward`` as FSDP2 reads it: None, True or False; an int checked.

    An int is the world size to reshard to after forward, a divisor of the shard
    dim's size: 1 means False (FSDP2 warns as well), the size True, and a divisor in
    between True on a smaller post-forward mesh (``_post_forward_mesh``). Raises
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


def _post_forward_size(value: bool | int | None, mesh: DeviceMesh) -> int | None:
    """``value`` if it is an int strictly between 1 and the shard dim's size, else None."""
    if value is None or isinstance(value, bool) or value in (1, mesh.size(mesh.ndim - 1)):
        return None
    return value


def _post_forward_mesh(size: int, mesh: DeviceMesh) -> DeviceMesh:
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


def _find_parameters(
    targets: Sequence[nn.Module], ignored: Set[int], skipped: list[str]
) -> list[_Found]:
    """The parameters under ``targets`` that no nested application manages, validated.

    Raises ``AlreadyManagedError`` for a parameter another application that is
    not nested in the targets manages; ``ScalarParameterError`` for a 0-d one. A
    parameter registered where another application's modules do not reach (shared
    with them) is sharded again, as FSDP2 does, under the same origin: the first
    forward refuses it (``check_shared``). Parameters whose ids are in ``ignored``
    are left out, their first FQNs appended to ``skipped``. Reads only: nothing is
    changed. One index lookup per parameter, and error text only for an error: the
    cost is linear in the targets' modules and parameters, whatever else is sharded.
    """
    inside: set[int] | None = None  # ids of the targets' modules, once a managed one is found
    shared: dict[int, ParamGroup] = {}  # originals another application also shards, by id
    nested: dict[int, bool] = {}  # by group id: whether one of its modules is inside
    found: dict[int, _Found] = {}
    seen_ignored: set[int] = set()
    for target in targets:
        for prefix, module in named_tree(target):
            for name, parameter in module._parameters.items():
                if parameter is None:
                    continue
                if ignored and id(parameter) in ignored:
                    if id(parameter) not in seen_ignored:
                        seen_ignored.add(id(parameter))
                        skipped.append(_fqn(prefix, name))
                    continue
                manager = MANAGED.manager(module, name, parameter)
                if manager is not None and manager.original:
                    # Shared with another application's modules: sharded here again, as
                    # FSDP2 does; the first forward refuses the two groups (``check_shared``).
                    shared[id(parameter)] = manager.group
                elif manager is not None:
                    verdict = nested.get(id(manager.group))
                    if verdict is None:
                        if inside is None:
                            inside = _module_ids(targets)
                        modules = manager.group.modules()
                        verdict = nested[id(manager.group)] = any(id(m) in inside for m in modules)
                    if not verdict:
                        raise AlreadyManagedError(
                            f"{_where(target, prefix, name)} is already managed by fully_shard "
                            f"on {_owner(manager.group)}; apply fully_shard to the inner modules "
                            "first, then to the outer"
                        )
                    continue  # a nested application manages it
                if parameter.dim() == 0:
                    raise ScalarParameterError(
                        f"{_where(target, prefix, name)} is a scalar (0-d), which cannot be "
                        "sharded on dim 0; reshape it to one element (FSDP2: fully_shard "
                        "doesn't support scalar parameters. Change "
                        f"{name} to a 1D tensor with numel equal to 1.)"
                    )
                entry = found.get(id(parameter))
                if entry is None:
                    entry = found[id(parameter)] = _Found(
                        _fqn(prefix, name), parameter, [], _origin(parameter, shared)
                    )
                entry.locations.append((weakref.ref(module), name))
    return list(found.values())


def _origin(parameter: nn.Parameter, shared: dict[int, ParamGroup]) -> int:
    """The origin of ``parameter``'s shards: the other application's if it shards it too."""
    group = shared.get(id(parameter))
    if group is not None:
        for managed in group.parameters:
            if managed.original() is parameter:
                return managed.origin
    return new_origin()


def _module_ids(targets: Sequence[nn.Module]) -> set[int]:
    """The ids of every module under ``targets``, themselves included."""
    seen: set[int] = set()
    stack = list(targets)
    while stack:
        module = stack.pop()
        if id(module) not in seen:
            seen.add(id(module))
            stack.extend(child for child in module._modules.values() if child is not None)
    return seen


def _fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _where(target: nn.Module, prefix: str, name: str) -> str:
    """How an error names a parameter; built only when there is an error to report."""
    return f"fully_shard on {module_label(target)}: parameter {_fqn(prefix, name)!r}"


def _owner(group: ParamGroup) -> str:
    modules = group.modules()
    return module_label(modules[0]) if modules else "a freed module"


_M = TypeVar("_M", bound=nn.Module)

#: FSDP2's defaults (frozen dataclasses: one shared instance is safe).
_NO_MIXED_PRECISION: Final = MixedPrecisionPolicy()
_NO_OFFLOAD: Final = OffloadPolicy()


class FullyShardFunction(Protocol):
    """The signature of the function behind ``fully_shard``: ``fully_shard.__wrapped__``."""

    def __call__(
        self,
        module: nn.Module | list[nn.Module],
        /,
        *,
        mesh: DeviceMesh | None = ...,
        reshard_after_forward: bool | int | None = ...,
        shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
        mp_policy: MixedPrecisionPolicy = ...,
        offload_policy: OffloadPolicy = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        dp_mesh_dims: DataParallelMeshDims | None = ...,
    ) -> None: ...


if TYPE_CHECKING:

    class FullyShardAPI(ModuleListContract[..., FullyShardState]):
        """The static type of ``fully_shard``: a call returns exactly what it was given.

        ``ModuleListContract`` with the options spelled out, so that a variable or a
        parameter can be annotated with it. Static only: at run time ``fully_shard`` is
        a ``Contract``, and ``FullyShardAPI`` an alias of ``Contract[..., Any, FullyShardState]``.
        """

        @property
        def __wrapped__(self) -> FullyShardFunction: ...

        @overload
        def __call__(
            self,
            module: _M,
            /,
            *,
            mesh: DeviceMesh | None = ...,
            reshard_after_forward: bool | int | None = ...,
            shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
            mp_policy: MixedPrecisionPolicy = ...,
            offload_policy: OffloadPolicy = ...,
            ignored_params: set[nn.Parameter] | None = ...,
            dp_mesh_dims: DataParallelMeshDims | None = ...,
        ) -> _M: ...
        @overload
        def __call__(
            self,
            module: list[_M],
            /,
            *,
            mesh: DeviceMesh | None = ...,
            reshard_after_forward: bool | int | None = ...,
            shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
            mp_policy: MixedPrecisionPolicy = ...,
            offload_policy: OffloadPolicy = ...,
            ignored_params: set[nn.Parameter] | None = ...,
            dp_mesh_dims: DataParallelMeshDims | None = ...,
        ) -> list[_M]: ...
        def __call__(self, module: nn.Module | list[Any], /, **kwargs: Any) -> Any: ...

else:
    FullyShardAPI = Contract[..., Any, FullyShardState]  # what fully_shard is at run time


def _typed(api: Contract[..., Any, FullyShardState]) -> FullyShardAPI:
    """``api`` as the ``FullyShardAPI`` it is (a cast: the object is the contract itself)."""
    return cast("FullyShardAPI", api)


@_typed
@contract(
    FullyShardState,
    incompatible_with=(
        Incompatible(replicate),
        Incompatible("fully_shard"),
        Incompatible("replicate"),
    ),
)
@exported_from("torchcontract.apis.fully_shard")
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> None:
    """Shard the parameters of ``module`` (or of a list of modules, as one group) over ``mesh``.

    FSDP2's ``fully_shard``, with its keywords, defaults and meanings. Every
    parameter under the module(s) that no earlier, nested ``fully_shard`` manages
    and that is not in ``ignored_params`` becomes an ``nn.Parameter`` holding a
    ``DTensor`` sharded on dim 0 (``Shard(0)``, padded where dim 0 does not
    divide; another dim with ``shard_placement_fn``), under the same FQNs. A
    parameter that tensor parallelism made a ``DTensor`` is sharded on its local
    tensor, its shard a ``DTensor`` on the data-parallel and TP meshes together,
    as FSDP2's. Each module (each outer one of a list) becomes
    an instance of ``FSDP<Class>``, a subclass of ``torch.distributed.fsdp.FSDPModule``
    and of its class, whose ``FSDPModule`` methods act on this application. Its
    forward all-gathers the parameters first; backward gathers them again if
    freed and reduce-scatters the gradients, averaged over the mesh, into the
    sharded parameters' ``.grad``. If anything is refused, nothing is changed, the
    modules' classes included. The cost is linear in the modules and parameters
    of ``module``, whatever else is sharded and whatever the world size.

    Args:
        module: The module to shard, or a list of modules sharded as one group.
        mesh: The devices to shard over. Default: a 1-D mesh over the default
            process group on the accelerator if there is one, else on CPU. A 2-D
            mesh ``(replicate, shard)`` is HSDP, as in FSDP2: parameters are sharded
            over the inner dim (placements ``(Replicate(), Shard(0))``) and
            gradients averaged over both. With tensor parallelism, the data-parallel
            sub-mesh (``mesh["dp"]``); with ``dp_mesh_dims``, the full mesh.
        reshard_after_forward: As in FSDP2: ``None`` frees the parameters after
            forward except on the root (the first application to run forward),
            ``True`` always, ``False`` never; an int is the world size to reshard
            to (1 means False, the shard size True; in between, each rank keeps its
            share of a smaller group's shards after forward and backward gathers
            over that group, FSDP2's post-forward mesh).
        shard_placement_fn: Called with each parameter; may return ``None``
            (dim 0) or ``Shard(d)``: shard on dim ``d``, which must divide evenly
            over the shard ranks unless it is 0.
        mp_policy: FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` for the
            gathered parameters (and the floating inputs, if
            ``cast_forward_inputs``), ``reduce_dtype`` for gradient reduction,
            ``output_dtype`` for the floating outputs.
        offload_policy: ``CPUOffloadPolicy`` on a CPU mesh changes nothing (the
            shards are on CPU already).
        ignored_params: Parameters left as they are, neither sharded nor managed.
        dp_mesh_dims: torch's ``DataParallelMeshDims``: ``mesh`` is the full
            mesh, every parameter a DTensor on it, ``Replicate()`` on the named
            data-parallel dims (several names of a field flattened into one dim;
            ``shard`` required, its dims adjacent).

    Returns:
        ``module`` itself (the contract returns what it was given), typed as given.

    Raises:
        TypeError: An argument is of the wrong type (the message names it), or
            ``dp_mesh_dims`` where torch has no ``DataParallelMeshDims``.
        ValueError: An int ``reshard_after_forward`` does not divide the mesh's
            size, a dtype is not floating point, or ``dp_mesh_dims`` does not fit
            the mesh or a parameter.
        InvalidShardDimError: A placement's dim is out of a parameter's range (a
            ``ValueError`` and, as FSDP2's, an ``AssertionError``).
        NotImplementedError: A non-contiguous parameter (``channels_last``), an
            uneven placement on another dim than 0, an int
            ``reshard_after_forward`` for tensor-parallel parameters, another dim
            than 0 or with ``dp_mesh_dims``, a tensor-parallel parameter with a
            ``Partial`` placement or on a mesh of more than 2 dims, ``dp_mesh_dims``
            without ``shard``
            or with shard dims apart, or ``CPUOffloadPolicy`` on an accelerator mesh.
        InvalidMeshError: The mesh is neither 1-D nor 2-D (a ``ValueError``), or
            a tensor-parallel mesh cannot stand beside it; ``UnnamedMeshError`` (also
            an ``AssertionError``, as FSDP2's) for a 2-D mesh without dim names.
        AlreadyManagedError: A parameter another application that is not nested
            in ``module`` manages, or a DTensor on the data-parallel mesh. A
            parameter shared with another application's modules is sharded again,
            as FSDP2 does, and the root's first forward raises it (a ``ValueError``).
        ScalarParameterError: A 0-d parameter (a ``ValueError``, as FSDP2's).
        ContractError: No process group.

    The first forward, as FSDP2's lazy init, takes as a shard a ``DTensor``
    parameter registered since in place of one (``ReplacedParameterError`` for
    one it cannot take), then raises ``UnmaterializedParameterError`` for shards
    still on the meta device.
    """
    # A list's modules nested in one another: the outer ones hold the group, as the
    # contract's targets (hooks on an inner one would reshard in the outer's forward).
    targets = [module] if isinstance(module, nn.Module) else root_modules(module)
    _check_arguments(
        targets[0],
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        shard_placement_fn=shard_placement_fn,
        ignored_params=ignored_params,
    )
    mesh = _default_mesh(targets[0]) if mesh is None else mesh
    spmd = None
    if dp_mesh_dims is None:
        _check_mesh(targets[0], mesh)
    else:  # mesh is the full SPMD mesh: shard over the data-parallel dims it names
        spmd = data_parallel_dims(targets[0], mesh, dp_mesh_dims)
        _check_spmd_resharding(targets[0], reshard_after_forward)
        mesh = spmd.mesh
    _check_offload(targets[0], offload_policy, mesh)
    resharding = _resharding(targets[0], reshard_after_forward, mesh)
    ignored: list[str] = []
    found = _find_parameters(targets, {id(p) for p in ignored_params or ()}, ignored)
    layouts = _layouts(targets[0], found, mesh, shard_placement_fn, spmd)
    post_forward_size = _post_forward_size(reshard_after_forward, mesh)
    post_forward = None
    if post_forward_size is not None:  # checked before making its groups
        check_post_forward(targets[0], zip(found, layouts, strict=True), post_forward_size)
        post_forward = _post_forward_mesh(post_forward_size, mesh)
    parameters = [
        ManagedParameter(
            item.fqn,
            item.parameter,
            item.locations,
            mesh,
            mp_policy.param_dtype,
            origin=item.origin,
            post_forward_mesh=post_forward,
            layout=layout,
        )
        for item, layout in zip(found, layouts, strict=True)
    ]
    group = ParamGroup(
        fully_shard,
        targets,
        parameters,
        mesh.get_group(mesh.ndim - 1),
        reshard_after_forward=resharding,
        reduce_dtype=mp_policy.reduce_dtype,
        replicate_group=mesh.get_group(0) if mesh.ndim == 2 else None,
        post_forward_group=None if post_forward is None else post_forward.get_group(1),
    )
    # Validated: from here on nothing raises before the parameters are all swapped.
    for parameter in parameters:
        parameter.install(parameter.sharded)
    hooks = ForwardHooks(group, mp_policy)
    handles: list[RemovableHandle] = []
    for target in targets:
        handles.append(target.register_forward_pre_hook(hooks.before, with_kwargs=True))
        handles.append(target.register_forward_hook(hooks.after))
    handles.extend(register_state_dict_hooks(group, targets))
    ALL_GROUPS.add(group)
    MANAGED.add(group)
    on_rollback(_Undo(group, [item.parameter for item in found], handles, targets))
    install_torch_state(group, targets)  # where torch's code finds FSDP2's state
    for target in targets:
        target.__class__ = fully_shard_class(type(target))
    fully_shard.update(
        targets[0],
        lambda record: attrs.evolve(
            record,
            mesh=mesh,
            managed=tuple(item.fqn for item in found),
            reshard_after_forward=resharding,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored=tuple(ignored),
        ),
    )


class _Undo:
    """Put the original parameters and classes back and remove the hooks, if the apply rolls back.

    The journal holds it only while the transaction is open, so it may hold the
    group and the original parameters strongly.
    """

    def __init__(
        self,
        group: ParamGroup,
        originals: list[nn.Parameter],
        handles: list[RemovableHandle],
        targets: list[nn.Module],
    ) -> None:
        self._group = group
        self._originals = originals
        self._handles = handles
        self._targets = targets

    def __call__(self) -> None:
        for target in self._targets:
            restore_class(target)
        for handle in self._handles:
            handle.remove()
        ALL_GROUPS.discard(self._group)
        MANAGED.remove(self._group)
        for parameter, original in zip(self._group.parameters, self._originals, strict=True):
            parameter.install(original)


def _group_of(module: nn.Module) -> ParamGroup:
    fully_shard.state(module)  # NotAppliedError if not applied
    group = MANAGED.group_of(module)
    if group is not None:
        return group
    raise ContractError(f"fully_shard on {module_label(module)}: its hooks are gone")


@overload
def unshard(module: nn.Module, async_op: Literal[False] = ...) -> None: ...
@overload
def unshard(module: nn.Module, async_op: Literal[True]) -> UnshardHandle: ...
@overload
def unshard(module: nn.Module, async_op: bool) -> UnshardHandle | None: ...
def unshard(module: nn.Module, async_op: bool = False) -> UnshardHandle | None:
    """All-gather the parameters ``fully_shard`` manages on ``module`` and register them.

    They stay unsharded until ``reshard(module)`` (or the end of the next
    backward). A collective: every rank of the mesh must call it. The same as the
    method ``FSDPModule.unshard`` of the module.

    Args:
        module: A module ``fully_shard`` was applied to.
        async_op: Start the all-gather and return at once (on gloo's own threads);
            the handle's ``wait()`` finishes it and registers the parameters, and so
            does the module's next forward or backward.

    Returns:
        ``None``, or with ``async_op`` an ``UnshardHandle``, as FSDP2's.

    Raises:
        NotAppliedError: ``fully_shard`` is not applied to ``module``.
        UnmaterializedParameterError: A shard is still on the meta device.
    """
    return unshard_group(_group_of(module), async_op)


def reshard(module: nn.Module) -> None:
    """Free the unsharded parameters of ``module``'s application and register the shards again.

    Args:
        module: A module ``fully_shard`` was applied to.

    Raises:
        NotAppliedError: ``fully_shard`` is not applied to ``module``.
    """
    _group_of(module).reshard()


@contextlib.contextmanager
def fully_shard_no_sync(module: nn.Module) -> Generator[None]:
    """Within the block, backward passes only accumulate gradients locally, unsharded.

    Applies to every ``fully_shard`` application on ``module`` and inside it. The
    first backward after the block reduce-scatters the accumulated gradients, as
    FSDP2's ``set_requires_gradient_sync(False)`` does. Restores the previous
    settings on exit, so blocks nest. Raises ``NotAppliedError`` if
    ``fully_shard`` is not applied to ``module``.
    """
    fully_shard.state(module)
    applied = [inner for inner in module.modules() if fully_shard.is_applied(inner)]
    previous = [fully_shard.state(inner).sync_gradients for inner in applied]
    for inner in applied:
        fully_shard.update(inner, _sync_gradients(False))
    try:
        yield
    finally:
        for inner, value in zip(applied, previous, strict=True):
            fully_shard.update(inner, _sync_gradients(value))


def _sync_gradients(value: bool) -> Callable[[FullyShardState], FullyShardState]:
    def transition(record: FullyShardState) -> FullyShardState:
        return attrs.evolve(record, sync_gradients=value)

    return transition
