"""fully_shard(): shard a module's parameters over a data-parallel mesh, as PyTorch's FSDP2 does.

Apply validates everything first (the arguments, in ``_arguments``; every parameter,
in ``_parameters``), then shards: each managed parameter is replaced, under each of
its names, by an ``nn.Parameter`` holding a ``DTensor`` sharded on one dim (its
``Layout``, tensor parallelism's DTensors included); the hooks of ``_hooks`` gather
and free the parameters around forward and backward. If the enclosing apply rolls
back, an undo step puts the original parameters back and removes the hooks. Also
``unshard``, ``reshard`` and ``fully_shard_no_sync``, which act on an application.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeVar, cast, overload

import attrs
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
)
from torch.distributed.tensor import Shard
from torch.utils.hooks import RemovableHandle

from torchcontract import (
    Contract,
    ContractError,
    Incompatible,
    ModuleListContract,
    contract,
    exported_from,
    module_label,
    on_rollback,
    root_modules,
)

from ..replicate import replicate
from ._arguments import (
    check_arguments,
    check_mesh,
    check_offload,
    check_spmd_resharding,
    default_mesh,
    post_forward_mesh,
    post_forward_size_of,
    read_resharding,
)
from ._device import mesh_device, move_to
from ._group import ALL_GROUPS, ParamGroup
from ._hooks import ForwardHooks
from ._layout import check_post_forward
from ._managed import MANAGED
from ._module import fully_shard_class, restore_class, unshard_group
from ._parameters import find_parameters, layouts_of
from ._sharding import ManagedParameter
from ._spmd import data_parallel_dims
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
    and of its class, whose ``FSDPModule`` methods act on this application. The
    parameters it shards and its managed modules' buffers are moved to the mesh's
    device first, in place, as FSDP2 moves them (the meta device's stay). Its
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
        NoProcessGroupError: No ``mesh`` was given and no default process group is
            initialized (a ``ValueError`` too).

    The first forward, as FSDP2's lazy init, takes as a shard a ``DTensor``
    parameter registered since in place of one (``ReplacedParameterError`` for
    one it cannot take), then raises ``UnmaterializedParameterError`` for shards
    still on the meta device.
    """
    # A list's modules nested in one another: the outer ones hold the group, as the
    # contract's targets (hooks on an inner one would reshard in the outer's forward).
    targets = [module] if isinstance(module, nn.Module) else root_modules(module)
    check_arguments(
        targets[0],
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        shard_placement_fn=shard_placement_fn,
        ignored_params=ignored_params,
    )
    mesh = default_mesh(targets[0]) if mesh is None else mesh
    spmd = None
    if dp_mesh_dims is None:
        check_mesh(targets[0], mesh)
    else:  # mesh is the full SPMD mesh: shard over the data-parallel dims it names
        spmd = data_parallel_dims(targets[0], mesh, dp_mesh_dims)
        check_spmd_resharding(targets[0], reshard_after_forward)
        mesh = spmd.mesh
    check_offload(targets[0], offload_policy, mesh)
    resharding = read_resharding(targets[0], reshard_after_forward, mesh)
    ignored: list[str] = []
    buffers: list[Tensor] = []
    found = find_parameters(targets, {id(p) for p in ignored_params or ()}, ignored, buffers)
    layouts = layouts_of(targets[0], found, mesh, shard_placement_fn, spmd)
    post_forward_size = post_forward_size_of(reshard_after_forward, mesh)
    post_forward = None
    if post_forward_size is not None:  # checked before making its groups
        check_post_forward(targets[0], zip(found, layouts, strict=True), post_forward_size)
        post_forward = post_forward_mesh(post_forward_size, mesh)
    # FSDP2's move onto the mesh's device, before sharding; undone on rollback.
    moved = move_to(mesh_device(mesh), (item.parameter for item in found), buffers)
    if moved:
        on_rollback(moved)
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
        # First, as FSDP2's: pre-hooks registered before see the gathered parameters.
        handles.append(
            target.register_forward_pre_hook(hooks.before, prepend=True, with_kwargs=True)
        )
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
