"""replicate(), its gradient-sync switch (for ``no_sync``) and ``rank_local``."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Generator, Sequence
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchcontract import (
    ContractError,
    Incompatible,
    InvalidMeshError,
    InvalidTargetError,
    NoProcessGroupError,
    RegistryEntry,
    contract,
    exported_from,
    module_label,
    named_tree,
    on_rollback,
)

from .. import _torch
from .._swapped_class import restore_class
from ..checkpoint import checkpoint, describe_value, require_bool, require_one_module
from ._autograd_hooks import ParameterHook
from ._buckets import broadcast_from_first_rank
from ._devices import InvalidKeywordError, MoveInputs, devices
from ._forward import after_forward, before_forward
from ._ignored import ignored_names, kept_buffers, kept_parameters
from ._keywords import (
    buffer_sync,
    refuse_unsupported,
    require_ddp_keyword,
    warn_check_reduction,
)
from ._module import replicate_class, sync_switch
from ._reducer import Reducer
from ._same_model import check_same_model
from ._state import ReplicateState

__all__ = ["rank_local", "replicate", "replicate_no_sync"]

_MEGABYTE = 1024 * 1024
#: DDP's ``bucket_cap_mb`` when it is None.
_DEFAULT_CAP_MEGABYTES = 25


def _is_reentrant(entry: RegistryEntry) -> bool:
    # ``is True``: checkpoint refuses any other value itself, with a TypeError naming it.
    return entry.arguments["use_reentrant"] is True


class _ForwardHooks:
    """The module's forward pre-hook and hook; they hold the reducer, never the module.

    Copies and pickles of the module get inert hooks (without a reducer): the
    reducer holds a process group, which neither copies nor pickles, and the
    copy gets hooks of its own when replicate is applied to it.
    """

    __slots__ = ("_reducer",)

    def __init__(self, reducer: Reducer | None) -> None:
        self._reducer = reducer

    def __reduce__(self) -> tuple[type[_ForwardHooks], tuple[None]]:
        return _ForwardHooks, (None,)

    # Eager under torch.compile, as FSDP2's hooks: its broadcasts and rebuild are
    # collectives on the group, which dynamo cannot trace.
    @_torch.outside_compile
    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._reducer is not None:
            before_forward(self._reducer, module)

    def after(self, module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        if self._reducer is not None:
            after_forward(self._reducer, module, output)


def _count_synchronization(module: nn.Module) -> None:
    replicate.update(module, lambda record: attrs.evolve(record, step=record.step + 1))


def _group(module: nn.Module, process_group: object) -> dist.ProcessGroup:
    """The group to average over: ``process_group``, checked, or the default group."""
    if process_group is None:
        if not dist.is_initialized():
            raise NoProcessGroupError(
                f"replicate on {module_label(module)}: no default process group; call "
                "torch.distributed.init_process_group() first, or pass process_group="
            )
        group = dist.group.WORLD
        if group is None:
            raise ContractError("replicate: torch.distributed has no world group")
        return group
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"replicate on {module_label(module)}: process_group is a group this rank is not "
            "in (new_group() returns this placeholder on the ranks it leaves out); call "
            "replicate only on the group's ranks"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"replicate on {module_label(module)}: process_group takes a "
            f"torch.distributed.ProcessGroup or None (the default group), got "
            f"{describe_value(process_group)}; pass e.g. torch.distributed.new_group(ranks)"
        )
    if _was_destroyed(process_group):
        raise ValueError(
            f"replicate on {module_label(module)}: process_group is not a group "
            "torch.distributed knows any more: it was destroyed (destroy_process_group); "
            "pass a live group, e.g. from torch.distributed.new_group(ranks)"
        )
    return process_group


def _is_registered(group: dist.ProcessGroup) -> bool:
    """Whether torch.distributed knows ``group`` (made by init_process_group or new_group)."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_rank(group)
    except ValueError:  # torch's "Group <...> is not registered"
        return False
    return True


def _was_destroyed(group: dist.ProcessGroup) -> bool:
    """Whether torch.distributed registered ``group`` and then destroyed (shut down) it.

    As DDP, replicate takes a group torch.distributed never registered (torchft's
    ``ProcessGroupDummy`` and reconfigurable groups, a group built from a store): it
    calls the group's own methods. Such a group has no name; one that torch
    registered keeps its name after ``destroy_process_group``, which shuts it down.
    """
    if _is_registered(group):
        return False
    try:
        name = group.group_name
    except (ValueError, RuntimeError):  # torchft's groups raise until registered
        return False
    return bool(name)


def _refuse_sync_batch_norm_on_cpu(module: nn.Module) -> None:
    """As DDP at construction: SyncBatchNorm needs a GPU module (its forward would fail)."""
    first = next(module.parameters(), None)
    if first is None or first.device.type != "cpu":
        return
    for fqn, inner in named_tree(module):
        if isinstance(inner, nn.SyncBatchNorm):
            where = "itself" if not fqn else f"{fqn!r}"
            raise ValueError(
                f"replicate on {module_label(module)}: SyncBatchNorm layers only work with GPU "
                f"modules (DistributedDataParallel refuses them on CPU too); {where} is one on "
                "CPU: use an nn.BatchNorm layer on CPU, or move the model to a GPU"
            )


def _mesh_group(module: nn.Module, process_group: object, device_mesh: object) -> object:
    """The group named by ``device_mesh`` (1-D), or ``process_group``; not both, as DDP."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise InvalidMeshError(
            f"replicate on {module_label(module)}: pass process_group or device_mesh, not both "
            "(DistributedDataParallel refuses both too)"
        )
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"replicate on {module_label(module)}: device_mesh takes a DeviceMesh or None, "
            f"got {describe_value(device_mesh)}"
        )
    if device_mesh.ndim != 1:
        raise InvalidMeshError(
            f"replicate on {module_label(module)}: device_mesh must be 1-D (as "
            f"DistributedDataParallel's), got {device_mesh.ndim} dims; pass "
            'mesh["dp"], a 1-D slice'
        )
    return device_mesh.get_group(0)


def _bucket_cap_bytes(module: nn.Module, bucket_cap_mb: object) -> int:
    if bucket_cap_mb is None:
        return _DEFAULT_CAP_MEGABYTES * _MEGABYTE
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real):
        raise TypeError(
            f"replicate on {module_label(module)}: bucket_cap_mb takes a number of megabytes "
            f"(int or float) or None, got {describe_value(bucket_cap_mb)}"
        )
    megabytes = float(bucket_cap_mb)
    if not (megabytes > 0 and math.isfinite(megabytes)):
        raise ValueError(
            f"replicate on {module_label(module)}: bucket_cap_mb must be positive and finite, "
            f"got {bucket_cap_mb}; DistributedDataParallel's default is 25"
        )
    return max(1, int(megabytes * _MEGABYTE))


def _cap_list_bytes(module: nn.Module, bucket_cap_mb_list: object) -> tuple[int, ...]:
    """``bucket_cap_mb_list`` in bytes, each cap checked as ``bucket_cap_mb``; () for None."""
    if bucket_cap_mb_list is None:
        return ()
    described = describe_value(bucket_cap_mb_list)
    if not isinstance(bucket_cap_mb_list, (list, tuple)) or not bucket_cap_mb_list:
        raise TypeError(
            f"replicate on {module_label(module)}: bucket_cap_mb_list takes a non-empty list of "
            f"megabytes, one per bucket, got {described}"
        )
    caps = cast("list[object] | tuple[object, ...]", bucket_cap_mb_list)
    return tuple(_bucket_cap_bytes(module, cap) for cap in caps)


def _refuse_unimplemented(
    module: nn.Module, delayed: object, hook_parameter: object, mixed_precision: object
) -> None:
    """DDP's keywords replicate does not implement, refused where given (their pair first,
    checked as DDP checks it)."""
    if (delayed is None) != (hook_parameter is None):
        raise InvalidKeywordError(
            f"replicate on {module_label(module)}: delay_all_reduce_named_params and "
            "param_to_hook_all_reduce go together (DistributedDataParallel refuses one "
            "alone too); leave both None"
        )
    refuse_unsupported(
        module,
        "delay_all_reduce_named_params",
        delayed is not None,
        "param_to_hook_all_reduce= neither: leave both None (every gradient is averaged "
        "in backward)",
    )
    refuse_unsupported(
        module,
        "mixed_precision",
        mixed_precision is not None,
        "leave it None, and cast the model (or use torch.autocast) yourself",
    )


def _require_trainable(module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> None:
    if not named:
        raise InvalidTargetError(
            f"replicate on {module_label(module)}: no parameter requires a gradient, so there "
            "is nothing to average (DistributedDataParallel refuses such a module too); "
            "apply replicate to a module with trainable parameters"
        )
    distributed = [
        name for name, parameter in module.named_parameters() if isinstance(parameter, DTensor)
    ]
    if distributed:
        raise InvalidTargetError(
            f"replicate on {module_label(module)}: parameter {distributed[0]!r} is a DTensor "
            "(tensor parallelism), which replicate does not average; shard over the "
            "data-parallel mesh with fully_shard(module, mesh=mesh['dp']) instead, which takes "
            "tensor-parallel parameters"
        )


@contract(
    ReplicateState,
    incompatible_with=(
        Incompatible(checkpoint, when=_is_reentrant),
        Incompatible("replicate"),
        Incompatible("fully_shard"),
    ),
)
@exported_from("torchcontract.apis.replicate")
def replicate(
    module: nn.Module,
    device_ids: Sequence[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    dim: int = 0,
    broadcast_buffers: bool | None = None,
    *,
    init_sync: bool = True,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float | None = None,
    find_unused_parameters: bool = False,
    check_reduction: bool = False,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
    param_to_hook_all_reduce: nn.Parameter | None = None,
    mixed_precision: None = None,
    device_mesh: DeviceMesh | None = None,
    skip_all_reduce_unused_params: bool = False,
    bucket_cap_mb_list: Sequence[float] | None = None,
    batched_grad_copy: bool = False,
    forward_sync_buffers: bool | None = None,
) -> None:
    """Average ``module``'s gradients over ``process_group`` (default: the world) in backward.

    What ``DistributedDataParallel(module, **keywords)`` computes, with DDP's
    keywords, defaults and buckets, through hooks instead of a wrapper: at apply,
    rank 0's parameters and buffers are copied to every rank; a backward through
    the outputs of a forward run with grad enabled outside ``no_sync`` leaves in
    ``.grad`` the mean over ranks; with ``broadcast_buffers`` rank 0's buffers are
    copied to every rank before each forward that follows such a forward. Every
    rank must run the same synchronizing forwards and backwards.

    Cannot be combined with ``checkpoint(use_reentrant=True)`` on the same or
    nested modules, nor with torch's own ``replicate`` or ``fully_shard`` on the
    module or inside it (gradients would be averaged twice).

    As DDP at construction, every rank of the group first checks that all hold the
    same model (the name, shape, dtype and ``requires_grad`` of every parameter and
    buffer, in order): where they differ, every rank raises ``ModelMismatchError``
    naming the first difference; none is left waiting.

    The keywords are ``DistributedDataParallel.__init__``'s, in its order, with its
    defaults (the first four positional too, as DDP's; the rest keyword-only, as
    their positions differ between torch releases). One that the installed torch's
    DDP lacks is refused with a ``TypeError``, as DDP refuses it, where given another
    value than its default.

    Args:
        module: The model (one module; a list is refused).
        device_ids: As DDP's: None (or empty) for a CPU module or one on several
            devices; for a module on one accelerator device, a list of that one
            device (``[local_rank]``), where each forward's inputs are then copied
            first, as DDP's forward does. Nothing is moved at apply.
        output_device: As DDP's: checked as DDP checks it and kept (default
            ``device_ids[0]``); as in DDP's forward, no output is moved.
        dim: As DDP's; only DDP's multi-device scatter, which neither has any
            more, reads it.
        broadcast_buffers: Deprecated in DDP from torch 2.13 (a ``FutureWarning``
            there), in favour of ``forward_sync_buffers``. False: buffers are not
            copied from rank 0, neither at apply nor before forwards. None (the
            default) or True: they are, unless ``forward_sync_buffers`` says.
        init_sync: As DDP's: False skips the check that every rank holds the same
            model and the copy of rank 0's parameters and buffers (the ranks must
            then hold the same values already).
        process_group: The group gradients are averaged over; the default group if
            None.
        bucket_cap_mb: The MiB of gradients reduced in one collective, as DDP
            counts them (a bucket closes once it holds its cap); None is DDP's
            default, 25, under which the bucket of the parameters defined first
            (launched last; after a rebuild, the first launched) is capped at
            1 MiB, as DDP's; a cap given holds for every bucket. The buckets are
            DDP's in every backward, with a communication hook or without.
        find_unused_parameters: As DDP's. False (the default, as DDP's) expects
            every parameter to get a gradient in every synchronizing backward and
            keeps no bookkeeping of which were used; the buckets start as one per
            dtype and are rebuilt once, after the first synchronizing backward, in
            the order gradients arrived. A parameter that got no gradient leaves
            every gradient unaveraged, and the next forward raises
            ``UnusedParameterError`` (DDP's error, which names it). True averages
            every parameter some rank used since the last synchronization, leaves
            alone those no rank used, and never rebuilds the buckets.
        static_graph: As DDP's: the promise that every iteration uses the same
            parameters. The first synchronizing backward finds which take part (those
            unused there may stay unused) and which some rank used, once; the buckets
            are rebuilt once, at the forward after the second, in the order gradients
            arrived. The numbers do not change.
        gradient_as_bucket_view: As DDP's: after a synchronized backward each
            averaged ``.grad`` is a view into its bucket's buffer, so the model
            holds one copy of its gradients instead of two; the next backward
            accumulates into it in place (with ``zero_grad(set_to_none=False)``;
            ``set_to_none=True`` frees the views and the next backward allocates
            new gradients, copied in once more).
        delay_all_reduce_named_params: Not implemented: None only (one of it and
            ``param_to_hook_all_reduce`` without the other is DDP's ``ValueError``).
        param_to_hook_all_reduce: Not implemented: None only.
        mixed_precision: Not implemented: None only.
        device_mesh: A 1-D ``DeviceMesh`` whose group gradients are averaged
            over, instead of ``process_group`` (not both), as DDP's.
        bucket_cap_mb_list: As DDP's (torch 2.13 on; refused with a ``TypeError``
            where this torch's DDP lacks it): the cap of each bucket in turn, the
            last repeated; ``bucket_cap_mb`` is then ignored, and the caps are
            DDP's.
        skip_all_reduce_unused_params: Not implemented: False only.
        batched_grad_copy: As DDP's, a choice of how gradients are copied into
            the buckets: taken, and the numbers are the same either way.
        forward_sync_buffers: As DDP's (torch 2.13 on): whether rank 0's buffers
            are copied to every rank before each forward that follows a
            synchronizing one (and at the end of ``join``); None is True. Rank 0's
            buffers are copied at apply either way (``init_sync`` decides).

    The module becomes an instance of ``Replicate<Class>``, a subclass of its class
    and of ``ReplicateModule``, which carries ``DistributedDataParallel``'s methods
    (``no_sync()``, ``join()``, ``join_hook()``, ``join_device``,
    ``join_process_group``, ``register_comm_hook()``); a failed apply puts the
    class back.

    Returns:
        ``module`` itself (the contract returns what it was given), typed as given.

    Raises:
        NoProcessGroupError: No ``process_group`` was given and no default process group
            is initialized (a ``ValueError`` too, as DDP raises).
        UnusedParameterError: With ``find_unused_parameters=False``, at the forward
            after a synchronizing backward in which a parameter got no gradient; with
            ``static_graph``, one the first synchronizing backward gave a gradient.
        GraphChangedError: With ``static_graph``, in a synchronizing backward that
            gives a gradient to a parameter the first one left unused.
        LateGradientError: Without ``static_graph``, in a synchronizing backward that
            gives a parameter a second gradient after its bucket was sent.
        UnfinishedBackwardError: At every forward with grad enabled after a
            synchronizing backward that raised once gradients had begun to arrive.
        ModelMismatchError: The ranks hold different models (raised on every rank).
        InvalidTargetError: ``module`` has no parameter that requires a gradient, or
            is a list.
        InvalidKeywordError: A ``ValueError`` where DDP raises one: ``device_ids``
            or ``output_device`` names a device for a CPU module or one on several
            devices, ``device_ids`` holds more than one, the parameters are on
            several device types, or only one of ``delay_all_reduce_named_params``
            and ``param_to_hook_all_reduce`` is given.
        UnsupportedKeywordError: A ``NotImplementedError``: one of the keywords
            marked not implemented above is given.
        KeywordNotInThisTorchError: A ``TypeError``: the keyword is one of a newer
            DDP than the installed torch's.
        ValueError: ``bucket_cap_mb`` is not positive and finite; this rank is not
            in ``process_group``, or it was destroyed;
            the module holds a ``SyncBatchNorm`` on CPU (as DDP, which needs a GPU
            for it); ``process_group`` and ``device_mesh`` are both given, or the
            mesh is not 1-D.
        TypeError: An argument is of the wrong type.
        IncompatibleAPIError: A rule forbids the combination (see above).
    """
    require_one_module("replicate", module)
    _refuse_unimplemented(
        module, delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision
    )
    _refuse_sync_batch_norm_on_cpu(module)
    require_ddp_keyword(module, "bucket_cap_mb_list", bucket_cap_mb_list is not None)
    cap_list = _cap_list_bytes(module, bucket_cap_mb_list)
    cap_bytes = max(cap_list) if cap_list else _bucket_cap_bytes(module, bucket_cap_mb)
    for name, flag in (
        ("find_unused_parameters", find_unused_parameters),
        ("static_graph", static_graph),
        ("gradient_as_bucket_view", gradient_as_bucket_view),
        ("init_sync", init_sync),
        ("skip_all_reduce_unused_params", skip_all_reduce_unused_params),
        ("batched_grad_copy", batched_grad_copy),
    ):
        require_bool("replicate", module, name, flag)
    require_ddp_keyword(module, "init_sync", init_sync is not True)
    require_ddp_keyword(module, "device_mesh", device_mesh is not None)
    require_ddp_keyword(module, "batched_grad_copy", batched_grad_copy is not False)
    refuse_unsupported(
        module,
        "skip_all_reduce_unused_params",
        skip_all_reduce_unused_params is not False,
        "leave it False (unused parameters are then averaged, as DDP's default)",
    )
    buffers = buffer_sync(module, broadcast_buffers, forward_sync_buffers)
    group = _group(module, _mesh_group(module, process_group, device_mesh))
    ignored = ignored_names(module)
    kept = kept_parameters(module, ignored)
    named = [(name, p) for name, p in kept if p.requires_grad]
    _require_trainable(module, named)
    placed = devices(module, [p for _, p in module.named_parameters()], device_ids, output_device)
    warn_check_reduction(module, check_reduction)
    if group.size() > 1 and init_sync:
        check_same_model(module, group, named[0][1].device, ignored)
        synced = [
            *(p for _, p in kept),
            *(kept_buffers(module, ignored) if buffers.at_apply else ()),
        ]
        broadcast_from_first_rank(synced, group)
    reducer = Reducer(
        module,
        replicate.application(module),
        group=group,
        named=named,
        ignored=ignored,
        cap_bytes=cap_bytes,
        default_cap=bucket_cap_mb is None and not cap_list,
        find_unused=find_unused_parameters,
        static_graph=static_graph,
        gradient_as_bucket_view=gradient_as_bucket_view,
        cap_list=cap_list,
        on_synchronized=_count_synchronization,
        update=replicate.update,
    )
    for index, (_, parameter) in enumerate(named):
        reducer.accumulators.append(
            _torch.register_accumulator_hook(parameter, ParameterHook(reducer, index))
        )
    hooks = _ForwardHooks(reducer)
    # Before the module's own pre-hooks, as DDP's forward runs before its module's: first
    # what DDP's _pre_forward does, then the inputs moved (each prepended, so in reverse).
    if placed.input_device is not None:
        module.register_forward_pre_hook(
            MoveInputs(reducer, placed.input_device), with_kwargs=True, prepend=True
        )
    module.register_forward_pre_hook(hooks.before, prepend=True)
    module.register_forward_hook(hooks.after)
    on_rollback(_Undo(module, reducer))
    module.__class__ = replicate_class(type(module))
    replicate.update(
        module,
        lambda record: attrs.evolve(
            record,
            process_group=group,
            buckets=reducer.bucket_names,
            broadcast_buffers=buffers.forward,
        ),
    )


@contextlib.contextmanager
def replicate_no_sync(module: nn.Module) -> Generator[None]:
    """Forwards run within the block build graphs whose backward only accumulates locally.

    As ``DistributedDataParallel.no_sync()``: the decision is made at forward
    time, and the first synchronizing backward after the block averages what was
    accumulated. Raises ``NotAppliedError`` if ``replicate`` is not applied to
    ``module``. Restores the previous setting on exit, so blocks nest.
    """
    replicate.state(module)  # NotAppliedError if not applied
    with sync_switch(module, sync_gradients=False):
        yield


@contextlib.contextmanager
def rank_local(module: nn.Module) -> Generator[None]:
    """Forwards of ``module`` within the block run on this rank alone, without any collective.

    What ``ddp.module`` is to a user of ``DistributedDataParallel``: a way to
    evaluate or generate on one rank while the others do something else (such as
    waiting at a barrier). The forwards inside the block broadcast no buffers and
    arm nothing: a backward through their outputs only accumulates locally (the
    next synchronizing backward averages what it accumulated, as after a forward
    of ``ddp.module``), and the next forward outside the block broadcasts buffers
    exactly when it would have without the block. Restores the previous setting on
    exit, so blocks nest.

    Args:
        module: The module ``replicate`` was applied to.

    Yields:
        Nothing; the forwards of ``module`` inside the block are rank-local.

    Raises:
        NotAppliedError: ``replicate`` is not applied to ``module``.
    """
    replicate.state(module)  # NotAppliedError if not applied
    with sync_switch(module, rank_local=True):
        yield


class _Undo:
    """Put the module's class back and forget its reducer, if the apply rolls back."""

    def __init__(self, module: nn.Module, reducer: Reducer) -> None:
        self._module = module
        self._reducer = reducer

    def __call__(self) -> None:
        restore_class(self._module)
        self._reducer.forget(self._module)
