"""replicate() and no_sync(): the contract-decorated API and its gradient-sync switch."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import attrs
import torch.distributed as dist
from torch import nn

from torchcontract import ContractError, Incompatible, RegistryEntry, contract, exported_from

from .. import _torch
from ..checkpoint import checkpoint, require_one_module
from ._buckets import broadcast_from_first_rank
from ._reducer import ParameterHook, Reducer
from ._state import ReplicateState

__all__ = ["replicate", "replicate_no_sync"]

_MEGABYTE = 1024 * 1024


def _is_reentrant(entry: RegistryEntry) -> bool:
    return bool(entry.arguments["use_reentrant"])


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

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._reducer is not None:
            self._reducer.before_forward(module)

    def after(self, module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        if self._reducer is not None:
            self._reducer.after_forward(module, output)


def _count_synchronization(module: nn.Module, buckets: tuple[tuple[str, ...], ...] | None) -> None:
    replicate.update(
        module,
        lambda record: attrs.evolve(
            record, step=record.step + 1, buckets=record.buckets if buckets is None else buckets
        ),
    )


def _default_group(module: nn.Module) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise ContractError(
            f"replicate on {type(module).__qualname__}: no default process group; call "
            "torch.distributed.init_process_group() first, or pass process_group="
        )
    group = dist.group.WORLD
    if group is None:
        raise ContractError("replicate: torch.distributed has no world group")
    return group


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
    *,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    broadcast_buffers: bool = True,
) -> None:
    """Average ``module``'s gradients over ``process_group`` (default: the world) in backward.

    What ``DistributedDataParallel(module, find_unused_parameters=True)`` computes,
    through hooks instead of a wrapper: at apply, rank 0's parameters and buffers
    are copied to every rank; a backward through the outputs of a forward run with
    grad enabled outside ``no_sync`` leaves in ``.grad`` the mean over ranks, for
    every parameter some rank used since the last such backward; with
    ``broadcast_buffers`` rank 0's buffers are copied to every rank before each
    forward that follows such a forward. Every rank must run the same
    synchronizing forwards and backwards. ``bucket_cap_mb`` bounds the bytes
    reduced in one collective.

    Cannot be combined with ``checkpoint(use_reentrant=True)`` on the same or
    nested modules, nor with torch's own ``replicate`` or ``fully_shard`` on the
    module or inside it (gradients would be averaged twice). Raises
    ``ContractError`` if no process group is initialized, ``ValueError`` for a
    non-positive ``bucket_cap_mb``.
    """
    require_one_module("replicate", module)
    if not bucket_cap_mb > 0:
        raise ValueError(f"replicate: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    group = _default_group(module) if process_group is None else process_group
    cap_bytes = max(1, int(bucket_cap_mb * _MEGABYTE))
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if group.size() > 1:
        broadcast_from_first_rank([*module.parameters(), *module.buffers()], group, cap_bytes)
    reducer = Reducer(
        module,
        replicate.application(module),
        group=group,
        named=named,
        cap_bytes=cap_bytes,
        on_synchronized=_count_synchronization,
    )
    for index, (_, parameter) in enumerate(named):
        _torch.register_post_accumulate_grad_hook(parameter, ParameterHook(reducer, index))
    hooks = _ForwardHooks(reducer)
    module.register_forward_pre_hook(hooks.before)
    module.register_forward_hook(hooks.after)
    replicate.update(
        module,
        lambda record: attrs.evolve(
            record,
            process_group=group,
            buckets=reducer.bucket_names,
            broadcast_buffers=broadcast_buffers,
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
    previous = replicate.state(module).sync_gradients
    replicate.update(module, lambda record: attrs.evolve(record, sync_gradients=False))
    try:
        yield
    finally:
        replicate.update(module, lambda record: attrs.evolve(record, sync_gradients=previous))
