"""ReplicateModule: what a module becomes under ``replicate``, with DDP's methods.

As ``fully_shard`` makes its modules ``FSDPModule``s, ``replicate`` makes the
module an instance of ``Replicate<Name>(ReplicateModule, <Name>)``, made once per
class by ``apis._swapped_class`` (shared with ``fully_shard``) and put back by a
rolled-back apply. ``ReplicateModule`` carries what users of
``DistributedDataParallel`` call on the wrapper: ``no_sync()``, ``join()``,
``join_hook()``, ``join_device``, ``join_process_group`` (it is a
``torch.distributed.algorithms.Joinable``, so ``Join([model, optimizer])``
works) and ``register_comm_hook()``, each acting on this application's reducer.
A deep copy or a pickle of the module is of its original class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from torchcontract import NotAppliedError, module_label

from .._swapped_class import original_class, reduce_as_original, swapped_class
from ._comm_hook import CommHook, check_comm_hook
from ._join import ReplicateJoinHook
from ._reducer import Reducer, reducer_of

__all__ = ["ReplicateModule", "replicate_class", "sync_switch"]

if TYPE_CHECKING:
    _Joinable = Joinable
else:
    _Joinable = object  # registered below: Joinable's ABC layout cannot be swapped in


class ReplicateModule(_Joinable):
    """The base of every class ``replicate`` swaps in: ``DistributedDataParallel``'s methods.

    A ``Joinable`` (registered as one: a base with ``Joinable``'s ABC layout could
    not be swapped in under a module). Every method raises ``NotAppliedError`` on
    a module whose application is gone.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Build the original class, not this one (as ``FSDPModule.__new__`` does).

        A container indexed by a slice calls its own class: the new container is
        not replicated and must not claim to be.
        """
        original = original_class(cast("type[nn.Module]", cls))
        module = original.__new__(original)
        original.__init__(module, *args, **kwargs)
        return module

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Forwards within the block build graphs whose backward only accumulates locally.

        ``DistributedDataParallel.no_sync()``; ``torchcontract.apis.no_sync(module)``.
        """
        return sync_switch(cast(nn.Module, self), sync_gradients=False)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """``Join([self], ...)``: training with uneven inputs across ranks, as DDP's ``join()``.

        Ranks whose inputs ran out meet the others' collectives with zeros until
        all have joined; then every rank takes the model of the last to join.
        With ``divide_by_initial_world_size`` (the default) averages divide by the
        group's size, else by the number of ranks not joined. With
        ``throw_on_early_termination`` every rank raises ``RuntimeError`` as soon
        as one runs out.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on this rank once its inputs ran out.

        Takes ``divide_by_initial_world_size`` (default True) from ``kwargs``, as DDP's.
        """
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        return ReplicateJoinHook(
            _reducer(self), cast(nn.Module, self), divide_by_initial_world_size=divide
        )

    @property
    def join_device(self) -> torch.device:
        """The device of the module's first parameter (DDP's ``device``)."""
        _reducer(self)
        return next(cast(nn.Module, self).parameters()).device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group gradients are averaged over."""
        return _reducer(self).group

    @property
    def _join_config(self) -> _JoinConfig:
        # What Join reads and sets; kept on the reducer, not in the module's __dict__.
        config: _JoinConfig = _reducer(self).join_config
        return config

    @_join_config.setter
    def _join_config(self, config: _JoinConfig) -> None:
        _reducer(self).join_config = config

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """From the next backward, ``hook(state, bucket)`` reduces each bucket of gradients.

        ``DistributedDataParallel.register_comm_hook``: ``hook`` returns a
        ``torch.futures.Future[Tensor]`` of the reduced ``bucket.buffer()`` (this
        rank's gradients, not divided), which is copied back into ``.grad``; the
        bucket answers ``index()``, ``buffer()``, ``gradients()``,
        ``parameters()``, ``is_last()`` and ``set_buffer()``. torch's hooks in
        ``torch.distributed.algorithms.ddp_comm_hooks`` run unchanged. Call it
        once, before training: the buckets then take DDP's sizes and order.

        Raises:
            TypeError: ``hook`` is not callable, or is a bf16 hook and this build
                has neither NCCL nor XCCL (DDP's message).
            ValueError: ``hook``'s annotations are not DDP's.
            ContractError: A hook is registered already.
            NotAppliedError: The module's application is gone.
        """
        module = cast(nn.Module, self)
        reducer = _reducer(self)
        check_comm_hook(module, hook)
        reducer.register_comm_hook(module, state, hook)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copies and pickles are of the original class (their hooks stand aside)."""
        return reduce_as_original(cast(nn.Module, self), super().__reduce_ex__(protocol))


Joinable.register(cast(type, ReplicateModule))


def replicate_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``Replicate<Name>(ReplicateModule, cls)``, made once per class (thread-safe)."""
    return swapped_class(ReplicateModule, "Replicate", cls)


@contextlib.contextmanager
def sync_switch(
    module: nn.Module, *, sync_gradients: bool | None = None, rank_local: bool | None = None
) -> Generator[None]:
    """Within the block, the record's ``sync_gradients``/``rank_local`` take the values given.

    Restores the previous values on exit, so blocks nest. ``NotAppliedError`` if
    ``replicate`` is not applied to ``module``.
    """
    reducer = _reducer(module)
    record = reducer.record(module)
    assert record is not None  # _reducer checked it
    previous = record
    reducer.update(
        module,
        lambda current: attrs.evolve(
            current,
            sync_gradients=current.sync_gradients if sync_gradients is None else sync_gradients,
            rank_local=current.rank_local if rank_local is None else rank_local,
        ),
    )
    try:
        yield
    finally:
        reducer.update(
            module,
            lambda current: attrs.evolve(
                current,
                sync_gradients=previous.sync_gradients
                if sync_gradients is not None
                else current.sync_gradients,
                rank_local=previous.rank_local if rank_local is not None else current.rank_local,
            ),
        )


def _reducer(module: object) -> Reducer:
    """The reducer of ``module``'s application; ``NotAppliedError`` if there is none."""
    target = cast(nn.Module, module)
    reducer = reducer_of(target)
    if reducer is None:
        raise NotAppliedError(
            f"replicate is not applied to {module_label(target)}; apply "
            "torchcontract.apis.replicate.replicate to it first"
        )
    return reducer
