"""fully_shard(): shard a module's parameters over a 1-D mesh, as PyTorch's FSDP2 does.

Apply validates everything first (mesh, every parameter), then shards: each
managed parameter is replaced, under each of its names, by an ``nn.Parameter``
holding a ``DTensor`` sharded on dim 0; the hooks of ``_hooks`` gather and free
the parameters around forward and backward. If the enclosing apply rolls back,
an undo step puts the original parameters back and removes the hooks.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, overload

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

import torchcontract
from torchcontract import (
    AlreadyManagedError,
    Contract,
    ContractError,
    Incompatible,
    InvalidMeshError,
    ModuleListContract,
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
from ._managed import MANAGED
from ._sharding import Location, ManagedParameter
from ._state import FullyShardState
from ._state_dict import register_state_dict_hooks

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
    mesh: object,
    reshard_after_forward: object,
    param_dtype: object,
    reduce_dtype: object,
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
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"fully_shard on {module_label(target)}: {name} must be a torch.dtype or None, "
                f"got {_shown(dtype)}; pass e.g. {name}=torch.bfloat16"
            )
        if not dtype.is_floating_point:
            raise ValueError(
                f"fully_shard on {module_label(target)}: {name} must be a floating-point dtype, "
                f"got {dtype}; pass e.g. {name}=torch.bfloat16, or None"
            )


def _check_mesh(target: nn.Module, mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise InvalidMeshError(
            f"fully_shard on {module_label(target)}: expected a 1-D device mesh, got one of "
            f"shape {tuple(mesh.shape)}; pass mesh=init_device_mesh(device, (world_size,)) "
            "(HSDP and 2-D meshes are not supported)"
        )


def _resharding(target: nn.Module, value: bool | int | None, mesh: DeviceMesh) -> bool | None:
    """``reshard_after_forward`` as FSDP2 reads it: None, True or False; an int checked.

    An int is the world size to reshard to after forward, a divisor of the mesh's
    size: 1 means False (FSDP2 warns as well) and the mesh's size means True. Raises
    ``ValueError`` for any other int that is not a divisor, ``NotImplementedError``
    for a divisor in between (a smaller post-forward mesh is not supported yet).
    """
    if value is None or isinstance(value, bool):
        return value
    size = mesh.size()
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
    if value == size:
        return True
    raise NotImplementedError(
        f"fully_shard on {module_label(target)}: reshard_after_forward={value} (reshard to a "
        f"world of {value} of {size} after forward) is not supported yet; pass True to free "
        "the parameters after forward or False to keep them"
    )


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside this package."""
    package = str(Path(torchcontract.__file__).parent)
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        level, frame = level + 1, frame.f_back
    return level


def _find_parameters(targets: Sequence[nn.Module]) -> list[_Found]:
    """The parameters under ``targets`` that no nested application manages, validated.

    Raises ``AlreadyManagedError`` for a parameter another application manages
    (one not nested in the targets, or a nested one that does not reach every
    module sharing the parameter) or that is already a DTensor; ``ContractError``
    for a 0-d one. Reads only: nothing is changed. One index lookup per parameter,
    and error text only for an error: the cost is linear in the targets' modules
    and parameters, whatever else is sharded.
    """
    inside: set[int] | None = None  # ids of the targets' modules, once a managed one is found
    nested: dict[int, bool] = {}  # by group id: whether one of its modules is inside
    found: dict[int, _Found] = {}
    for target in targets:
        for prefix, module in named_tree(target):
            for name, parameter in module._parameters.items():
                if parameter is None:
                    continue
                manager = MANAGED.manager(module, name, parameter)
                if manager is not None:
                    if manager.original:
                        raise AlreadyManagedError(
                            f"{_where(target, prefix, name)} is shared with a module of "
                            f"fully_shard on {_owner(manager.group)}, which manages it but does "
                            "not contain this module; apply fully_shard to a module containing "
                            "every module that shares the parameter"
                        )
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
                if isinstance(parameter, DTensor):
                    raise AlreadyManagedError(
                        f"{_where(target, prefix, name)} is already a DTensor; fully_shard shards "
                        "plain tensors only (no tensor parallelism yet): pass a module with "
                        "regular parameters"
                    )
                if parameter.dim() == 0:
                    raise ContractError(
                        f"{_where(target, prefix, name)} is a scalar (0-d), which cannot be "
                        "sharded on dim 0; reshape it to one element"
                    )
                entry = found.get(id(parameter))
                if entry is None:
                    entry = found[id(parameter)] = _Found(_fqn(prefix, name), parameter, [])
                entry.locations.append((weakref.ref(module), name))
    return list(found.values())


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


class FullyShardFunction(Protocol):
    """The signature of the function behind ``fully_shard``: ``fully_shard.__wrapped__``."""

    def __call__(
        self,
        module: nn.Module | list[nn.Module],
        /,
        *,
        mesh: DeviceMesh | None = ...,
        reshard_after_forward: bool = ...,
        param_dtype: torch.dtype | None = ...,
        reduce_dtype: torch.dtype | None = ...,
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
            param_dtype: torch.dtype | None = ...,
            reduce_dtype: torch.dtype | None = ...,
        ) -> _M: ...
        @overload
        def __call__(
            self,
            module: list[_M],
            /,
            *,
            mesh: DeviceMesh | None = ...,
            reshard_after_forward: bool | int | None = ...,
            param_dtype: torch.dtype | None = ...,
            reduce_dtype: torch.dtype | None = ...,
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
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """Shard the parameters of ``module`` (or of a list of modules, as one group) over ``mesh``.

    Every parameter under the module(s) that no earlier, nested ``fully_shard``
    manages becomes an ``nn.Parameter`` holding a ``DTensor`` sharded on dim 0
    (``Shard(0)``, padded where dim 0 does not divide), under the same FQNs. Its
    forward all-gathers them first; backward gathers them again if freed and
    reduce-scatters the gradients, averaged over the mesh, into the sharded
    parameters' ``.grad``. ``reshard_after_forward`` as in FSDP2: ``None`` frees
    the parameters after forward except on the root (the first application to
    run forward), ``True`` always, ``False`` never; an int is the world size to
    reshard to (1 means False, the mesh's size True). ``param_dtype`` is the
    dtype of the gathered parameters and of floating inputs; ``reduce_dtype`` the
    dtype gradients are reduced in (default: their own), as ``MixedPrecisionPolicy``.

    ``mesh`` defaults to a 1-D mesh over the default process group on the
    accelerator if there is one, else on CPU. Raises ``TypeError`` naming the
    argument for one of a wrong type; ``ValueError`` for an int
    ``reshard_after_forward`` that does not divide the mesh's size or a dtype that
    is not floating point; ``NotImplementedError`` for a divisor between 1 and the
    mesh's size; ``InvalidMeshError`` (a ``ValueError``) for a mesh that is not
    1-D; ``AlreadyManagedError`` for a parameter another application manages or
    that is already a DTensor; ``ContractError`` without a process group or for
    a 0-d parameter. Nothing is changed then. The cost is linear in the modules
    and parameters of ``module``, whatever else is sharded and whatever the
    world size.

    Args:
        module: A module, or a list of modules sharded as one group with one record.
        mesh: A 1-D ``DeviceMesh`` to shard over; None for the default process group.
        reshard_after_forward: Whether to free the gathered parameters after forward:
            None (the root keeps them), True, False, or the world size to reshard to.
        param_dtype: The dtype of the gathered parameters and of floating inputs.
        reduce_dtype: The dtype gradients are reduced in.

    Returns:
        What it was given (the module, or the list), typed as given.

    Raises:
        TypeError: An argument is of the wrong type; the message names it.
        ValueError: An int ``reshard_after_forward`` that does not divide the mesh's
            size, or a dtype that is not floating point.
        NotImplementedError: A ``reshard_after_forward`` between 1 and the mesh's size.
        InvalidMeshError: The mesh is not 1-D.
        AlreadyManagedError: A parameter is already a DTensor or managed by another
            application.
        ContractError: No process group is initialized, or a parameter is 0-d.
    """
    # A list's modules nested in one another: the outer ones hold the group, as the
    # contract's targets (hooks on an inner one would reshard in the outer's forward).
    targets = [module] if isinstance(module, nn.Module) else root_modules(module)
    _check_arguments(targets[0], mesh, reshard_after_forward, param_dtype, reduce_dtype)
    mesh = _default_mesh(targets[0]) if mesh is None else mesh
    _check_mesh(targets[0], mesh)
    resharding = _resharding(targets[0], reshard_after_forward, mesh)
    found = _find_parameters(targets)
    parameters = [
        ManagedParameter(item.fqn, item.parameter, item.locations, mesh, param_dtype)
        for item in found
    ]
    group = ParamGroup(
        fully_shard,
        targets,
        parameters,
        mesh.get_group(),
        reshard_after_forward=resharding,
        reduce_dtype=reduce_dtype,
    )
    # Validated: from here on nothing raises before the parameters are all swapped.
    for parameter in parameters:
        parameter.install(parameter.sharded)
    hooks = ForwardHooks(group, param_dtype)
    handles: list[RemovableHandle] = []
    for target in targets:
        handles.append(target.register_forward_pre_hook(hooks.before, with_kwargs=True))
        handles.append(target.register_forward_hook(hooks.after))
    handles.extend(register_state_dict_hooks(group, targets))
    ALL_GROUPS.add(group)
    MANAGED.add(group)
    on_rollback(_Undo(group, [item.parameter for item in found], handles))
    fully_shard.update(
        targets[0],
        lambda record: attrs.evolve(
            record,
            mesh=mesh,
            managed=tuple(item.fqn for item in found),
            reshard_after_forward=resharding,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        ),
    )


class _Undo:
    """Put the original parameters back and remove the hooks, if the apply rolls back.

    The journal holds it only while the transaction is open, so it may hold the
    group and the original parameters strongly.
    """

    def __init__(
        self,
        group: ParamGroup,
        originals: list[nn.Parameter],
        handles: list[RemovableHandle],
    ) -> None:
        self._group = group
        self._originals = originals
        self._handles = handles

    def __call__(self) -> None:
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


def unshard(module: nn.Module) -> None:
    """All-gather the parameters ``fully_shard`` manages on ``module`` and register them.

    They stay unsharded until ``reshard(module)`` (or the end of the next
    backward). Every rank must call it.

    Args:
        module: A module ``fully_shard`` was applied to.

    Raises:
        NotAppliedError: ``fully_shard`` is not applied to ``module``.
        ContractError: The application's hooks are gone (a copy of a sharded model).
    """
    _group_of(module).unshard()


def reshard(module: nn.Module) -> None:
    """Free the unsharded parameters of ``module``'s application and register the shards again.

    Args:
        module: A module ``fully_shard`` was applied to.

    Raises:
        NotAppliedError: ``fully_shard`` is not applied to ``module``.
        ContractError: The application's hooks are gone (a copy of a sharded model).
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
