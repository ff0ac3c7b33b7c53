"""fully_shard(): shard a module's parameters over a 1-D mesh, as PyTorch's FSDP2 does.

Apply validates everything first (mesh, every parameter), then shards: each
managed parameter is replaced, under each of its names, by an ``nn.Parameter``
holding a ``DTensor`` sharded on dim 0; the hooks of ``_hooks`` gather and free
the parameters around forward and backward. If the enclosing apply rolls back,
an undo step puts the original parameters back and removes the hooks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, overload

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

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

from ..replicate import replicate
from ._group import ALL_GROUPS, ParamGroup
from ._hooks import ForwardHooks
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


def _default_mesh(module: nn.Module) -> DeviceMesh:
    if not dist.is_initialized():
        raise ContractError(
            f"fully_shard on {module_label(module)}: no default process group and no mesh; call "
            "torch.distributed.init_process_group() first, or pass mesh="
        )
    device_type = next((p.device.type for p in module.parameters()), "cpu")
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _managers() -> dict[int, tuple[ParamGroup, bool]]:
    """Every parameter object a live group manages, by id: the group, and whether it is the
    original parameter (left in place only where the group's modules do not reach)."""
    found: dict[int, tuple[ParamGroup, bool]] = {}
    for group in list(ALL_GROUPS):
        for parameter in group.parameters:
            found[id(parameter.sharded)] = (group, False)
            if parameter.unsharded is not None:
                found[id(parameter.unsharded)] = (group, False)
            if (original := parameter.original()) is not None:
                found[id(original)] = (group, True)
    return found


def _owner(group: ParamGroup) -> str:
    modules = group.modules()
    return module_label(modules[0]) if modules else "a freed module"


def _find_parameters(targets: Sequence[nn.Module]) -> list[_Found]:
    """The parameters under ``targets`` that no nested application manages, validated.

    Raises ``AlreadyManagedError`` for a parameter another application manages
    (one not nested in the targets, or a nested one that does not reach every
    module sharing the parameter) or that is already a DTensor; ``ContractError``
    for a 0-d one. Reads only: nothing is changed.
    """
    managers = _managers()
    inside = {id(module) for target in targets for module in target.modules()}
    found: dict[int, _Found] = {}
    for target in targets:
        for prefix, module in named_tree(target):
            for name, parameter in module._parameters.items():
                if parameter is None:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                where = f"fully_shard on {module_label(target)}: parameter {fqn!r}"
                manager, original = managers.get(id(parameter), (None, False))
                if manager is not None:
                    if original:
                        raise AlreadyManagedError(
                            f"{where} is shared with a module of fully_shard on "
                            f"{_owner(manager)}, which manages it but does not contain this "
                            "module; apply fully_shard to a module containing every module "
                            "that shares the parameter"
                        )
                    if not any(id(other) in inside for other in manager.modules()):
                        raise AlreadyManagedError(
                            f"{where} is already managed by fully_shard on {_owner(manager)}; "
                            "apply fully_shard to the inner modules first, then to the outer"
                        )
                    continue  # a nested application manages it
                if isinstance(parameter, DTensor):
                    raise AlreadyManagedError(
                        f"{where} is already a DTensor; fully_shard shards plain tensors only "
                        "(no tensor parallelism yet): pass a module with regular parameters"
                    )
                if parameter.dim() == 0:
                    raise ContractError(
                        f"{where} is a scalar (0-d), which cannot be sharded on dim 0; "
                        "reshape it to one element"
                    )
                entry = found.setdefault(id(parameter), _Found(fqn, parameter, []))
                entry.locations.append((weakref.ref(module), name))
    return list(found.values())


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
            reshard_after_forward: bool = ...,
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
            reshard_after_forward: bool = ...,
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
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """Shard the parameters of ``module`` (or of a list of modules, as one group) over ``mesh``.

    Every parameter under the module(s) that no earlier, nested ``fully_shard``
    manages becomes an ``nn.Parameter`` holding a ``DTensor`` sharded on dim 0
    (``Shard(0)``, padded where dim 0 does not divide), under the same FQNs. Its
    forward all-gathers them first; after forward they are freed
    (``reshard_after_forward``; the root, the first application to run forward,
    keeps its own until backward); backward gathers them again and
    reduce-scatters the gradients, averaged over the mesh, into the sharded
    parameters' ``.grad``. ``param_dtype`` is the dtype of the gathered
    parameters and of floating inputs; ``reduce_dtype`` the dtype gradients are
    reduced in (default: their own), as ``MixedPrecisionPolicy``.

    ``mesh`` defaults to a 1-D mesh over the default process group. Raises
    ``InvalidMeshError`` for a mesh that is not 1-D, ``AlreadyManagedError`` for
    a parameter another application manages or that is already a DTensor,
    ``ContractError`` without a process group; nothing is changed then.
    """
    # A list's modules nested in one another: the outer ones hold the group, as the
    # contract's targets (hooks on an inner one would reshard in the outer's forward).
    targets = [module] if isinstance(module, nn.Module) else root_modules(module)
    mesh = _default_mesh(targets[0]) if mesh is None else mesh
    if mesh.ndim != 1:
        raise InvalidMeshError(
            f"fully_shard on {module_label(targets[0])}: expected a 1-D device mesh, got one of "
            f"shape {tuple(mesh.shape)}; pass mesh=init_device_mesh(device, (world_size,)) "
            "(HSDP and 2-D meshes are not supported)"
        )
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
        reshard_after_forward=reshard_after_forward,
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
    on_rollback(_Undo(group, [item.parameter for item in found], handles))
    fully_shard.update(
        targets[0],
        lambda record: attrs.evolve(
            record,
            mesh=mesh,
            managed=tuple(item.fqn for item in found),
            reshard_after_forward=reshard_after_forward,
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
        for parameter, original in zip(self._group.parameters, self._originals, strict=True):
            parameter.install(original)


def _group_of(module: nn.Module) -> ParamGroup:
    fully_shard.state(module)  # NotAppliedError if not applied
    for group in list(ALL_GROUPS):
        if id(module) in group.module_ids:
            return group
    raise ContractError(f"fully_shard on {module_label(module)}: its hooks are gone")


def unshard(module: nn.Module) -> None:
    """All-gather the parameters ``fully_shard`` manages on ``module`` and register them.

    They stay unsharded until ``reshard(module)`` (or the end of the next
    backward). Every rank must call it. Raises ``NotAppliedError`` if
    ``fully_shard`` is not applied to ``module``.
    """
    _group_of(module).unshard()


def reshard(module: nn.Module) -> None:
    """Free the unsharded parameters of ``module``'s application and register the shards again."""
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
