"""FullyShardModule: what a module becomes under ``fully_shard``, an ``FSDPModule`` of its class.

As FSDP2 does (``torch/distributed/fsdp/_fully_shard/_fsdp_init.py``), each module
``fully_shard`` is applied to gets a class made once per original class and
cached: ``FSDP<Name>(FullyShardModule, <Name>)``, where ``FullyShardModule``
subclasses ``torch.distributed.fsdp.FSDPModule``. ``isinstance(m, FSDPModule)``
holds, as does ``isinstance(m, <Name>)``; the contract's strict check accepts
the swap (a subclass). The methods are ours and act on the application's record
and group. A rolled-back apply puts the original class back. The class's
``__name__`` is FSDP2's, ``FSDP<Name>`` (the module's repr shows it); its
``__qualname__`` stays the original's, so that errors, which label modules by
qualified name, keep naming the user's class.

The class is made, cached and restored by ``apis._swapped_class``, which
``replicate`` shares. ``copy.deepcopy`` of such a module is refused, as FSDP2
refuses it (with ``ContractError``, where FSDP2 raises ``AssertionError``: the
differences table lists it): a copy would hold the shards with no group to gather them (its
forward would fail inside torch), and giving it one would carry the application
to the copy, which copies never do (docs/semantics.md, Copies). A state dict
moves a sharded model instead. A pickle is of the original class: its hooks
stand aside (no process group pickles), so it holds the shards for their state
dict and is not sharded by ``fully_shard``, and must not claim to be.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, NoReturn, cast

import attrs
import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from torchcontract import ContractError, NotAppliedError, module_label

from .. import _compat
from .._swapped_class import original_class, reduce_as_original, restore_class, swapped_class
from ._comms import AllGatherComm, ReduceScatterComm
from ._group import ParamGroup
from ._managed import MANAGED
from ._prefetch import set_modules_to_backward_prefetch, set_modules_to_forward_prefetch
from ._state import FullyShardState
from ._torch_state import torch_state_of, without_torch_state

__all__ = ["FullyShardModule", "fully_shard_class", "restore_class", "unshard_group"]

_Transition = Callable[[FullyShardState], FullyShardState]


class FullyShardModule(FSDPModule):
    """The ``FSDPModule`` base of every class ``fully_shard`` swaps in; FSDP2's methods, ours.

    Every method raises ``NotAppliedError`` on a module whose application is gone
    (a rolled-back apply restores the class, so that happens only for a module
    whose class was set by hand). Methods named in FSDP2 as ``recurse=True`` act
    on every module with ``fully_shard`` applied inside this one, as FSDP2's.
    """

    # FSDPModule.__new__ builds the original class (a container indexed by a slice):
    # in [FSDP<Name>, FullyShardModule, FSDPModule, <Name>] the original is at 3. Releases
    # before 2.7 read index 2 whatever the class says, so __new__ below is ours.
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Build the original class, not ``FSDP<Name>``, as FSDP2's ``FSDPModule.__new__``.

        A container indexed by a slice (``model[0:1]``) or copied with
        ``type(model)(...)`` is a new, unsharded module of the user's class. It runs
        ``__init__`` itself (Python does not: the object is not an instance of ``cls``)
        unless torch has turned that off (``disable_fsdp_module_new_init``).
        """
        original = original_class(cast("type[nn.Module]", cls))
        module = original.__new__(original, *args, **kwargs)
        if _compat.fsdp_module_new_runs_init():
            original.__init__(module, *args, **kwargs)
        return module

    # ----------------------------------------------------------------- gathering

    def reshard(self) -> None:
        """Free the unsharded parameters, register the shards again. Not recursive."""
        _group(self).reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters and register them until the next reshard. Not recursive.

        ``async_op=True`` starts the all-gather (on gloo's threads) and returns an
        ``UnshardHandle`` whose ``wait()`` waits for it and registers the parameters,
        as FSDP2's; the module's next forward or backward waits for it too.
        """
        return unshard_group(_group(self), async_op)

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: reshard every group and forget the iteration.

        Call it on the root (the module whose forward ran first). Raises
        ``ContractError`` on any other module, as FSDP2 raises ``RuntimeError``.
        """
        group = _group(self)
        root = group.root
        if root is None or not group.is_root:
            raise ContractError(
                f"fully_shard on {_label(self)}: reset_iter_state must be called on the "
                "root (the module whose forward ran first); call it on that module"
            )
        root.callback_queued = True  # start_iteration then resets every group
        root.start_iteration()
        for member in root.groups:
            member.reshard()
            member.deferred.clear()  # FSDP2 drops a partial HSDP reduction too

    # ----------------------------------------------------------------- settings

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of a step (recorded on this application).

        FSDP2 then waits for pending reductions and drops prefetch state; here each
        reduction is done when its backward step returns, so nothing is pending.
        """
        _update(self, False, lambda record: attrs.evolve(record, is_last_backward=is_last_backward))

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduce-scatters gradients (False: they accumulate locally).

        Sets ``requires_all_reduce`` to the same value, as FSDP2 does.
        """
        value = requires_gradient_sync
        _update(
            self,
            recurse,
            lambda record: attrs.evolve(record, sync_gradients=value, requires_all_reduce=value),
        )

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Whether gradients are all-reduced over the replicate dim (HSDP).

        False, as FSDP2's: each backward reduce-scatters, and keeps the result for
        the first backward with it True, which adds it to its own and all-reduces
        once (gradient accumulation with one all-reduce per step); ``.grad`` is
        left as it is until then. A 1-D mesh has no replicate dim: nothing changes.
        """
        value = requires_all_reduce
        _update(self, recurse, lambda record: attrs.evolve(record, requires_all_reduce=value))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the parameters after it; the root's too once set (as FSDP2).

        Either replaces an int given to ``fully_shard``: ``True`` frees them to the
        full mesh's shards, not to the int's post-forward mesh, as FSDP2's.

        Raises ``ValueError`` for a value that is not a bool, as FSDP2 does.
        """
        given = cast(object, reshard_after_forward)  # checked: callers are not all typed
        if not isinstance(given, bool):
            raise ValueError(
                f"fully_shard on {_label(self)}: set_reshard_after_forward takes a bool, "
                f"got {type(reshard_after_forward).__qualname__}; pass True or False"
            )
        for module in _applied(self, recurse):
            group = _group(module)
            if group.post_forward:  # kept on the post-forward mesh: free it before replacing it
                group.reshard()
            group.reshard_after_forward = reshard_after_forward
            group.post_forward_group = None  # a bool replaces an int's post-forward mesh
        _update(
            self,
            recurse,
            lambda record: attrs.evolve(record, reshard_after_forward=reshard_after_forward),
        )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward frees the parameters after reducing their gradients.

        False keeps them gathered for the next forward (gradient accumulation): as
        in FSDP2, that forward then uses them as they are, not the optimizer's update.
        """
        _update(
            self,
            recurse,
            lambda record: attrs.evolve(record, reshard_after_backward=reshard_after_backward),
        )

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers the parameters again (False: backward never reads them)."""
        value = unshard_in_backward
        _update(self, False, lambda record: attrs.evolve(record, unshard_in_backward=value))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the mesh's size."""
        _update(self, False, lambda record: attrs.evolve(record, gradient_divide_factor=factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 for ``set_gradient_divide_factor``; warns and sets that."""
        warnings.warn("Use `set_gradient_divide_factor` instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Whether the collectives only sum, the division coming after the all-reduce hook.

        As FSDP2's: ``True`` reduce-scatters (and under HSDP all-reduces) with a sum,
        calls the all-reduce hook on the sum, then divides by the gradient divide
        factor (the mesh's size by default). Not recursive.
        """
        _update(self, False, lambda record: attrs.evolve(record, force_sum_reduction=enable))

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters without a gradient take part in the reduce-scatter, as zeros."""
        _update(
            self,
            recurse,
            lambda record: attrs.evolve(
                record, reduce_scatter_unused_params=reduce_scatter_unused_params
            ),
        )

    def set_all_reduce_hook(
        self, hook: Callable[[Tensor], None], *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """Call ``hook(reduce_output)`` on each reduce-scatter's output, in place, as FSDP2.

        On a 1-D mesh (no all-reduce) FSDP2 calls it on the reduce-scatter's output;
        so does this. ``stream``: the hook runs on it (in its device module's
        ``stream`` context), after the reduce-scatter; as in FSDP2, only without
        HSDP: with a 2-D mesh it raises ``ValueError``.
        """
        if stream is not None and _group(self).replicate_group is not None:
            raise ValueError(
                f"fully_shard on {_label(self)}: set_all_reduce_hook(stream=...) with a 2-D "
                "mesh (HSDP), whose hook runs after the all-reduce (FSDP2: stream cannot be set "
                "when using native HSDP); leave stream=None"
            )
        group = _group(self)
        group.all_reduce_hook, group.all_reduce_hook_stream = hook, stream

    # ----------------------------------------------------------------- accelerator only

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers wait for ``event`` (the optimizer step's), not the stream.

        On an accelerator, as FSDP2's: the root's next forward makes the all-gather
        streams wait for ``event`` instead of for everything queued on the compute
        stream. Refused (``NotImplementedError``) on a CPU mesh, whose collectives
        use no stream.
        """
        group = _group(self)
        if group.streams is None and group.device_type in {"cpu", "meta"}:
            _refused(
                self,
                "set_post_optim_event",
                "it configures an event on the all-gather streams, which a CPU mesh does not have",
            )
        group.post_optim_event = event

    def set_custom_all_gather(self, comm: AllGatherComm) -> None:
        """Run this module's parameter all-gathers through ``comm`` (FSDP2's ``AllGather``).

        ``comm.allocate((numel,), dtype=..., device=...)`` gives each all-gather's
        output buffer and ``comm(output_tensor=..., input_tensor=..., group=...,
        async_op=...)`` runs it, returning its ``Work`` when ``async_op`` (a
        prefetch). This module's application only, as FSDP2's.
        """
        _group(self).all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm) -> None:
        """Run this module's gradient reduce-scatters through ``comm`` (FSDP2's ``ReduceScatter``).

        ``comm.allocate`` gives the input and output buffers and ``comm(output_tensor=...,
        input_tensor=..., group=..., op=...)`` runs it with FSDP2's op (``AVG``, or
        ``SUM`` with the gradient divide factor applied before). This module's
        application only, as FSDP2's.
        """
        _group(self).reduce_scatter_comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> NoReturn:
        """Refused: staging buffers from the process group's allocator (NCCL zero-copy)."""
        _refused(
            self,
            "set_allocate_memory_from_process_group_for_comm",
            "fully_shard does not implement staging buffers from the process group's allocator",
        )

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> NoReturn:
        """Refused: symmetric-memory staging buffers for NCCL all-gathers."""
        _refused(
            self, "set_symm_mem_for_comm", "fully_shard does not implement NCCL symmetric memory"
        )

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatter inputs may be in flight at once on an accelerator (1).

        As FSDP2's: before a reduction's input is allocated, the compute stream waits
        for the oldest reduce-scatter while this many are in flight. More trades peak
        memory for not stalling the compute stream behind a slow reduce-scatter. The
        largest value set under a root counts for all its groups, read at the root's
        first forward, as FSDP2's lazy init reads it. No effect on a CPU mesh, whose
        reductions are done when they return.

        Raises:
            TypeError: ``max_input_buffers`` is not an int (a bool included).
            ValueError: It is less than 1.
        """
        given = cast(object, max_input_buffers)  # checked: callers are not all typed
        if isinstance(given, bool) or not isinstance(given, int):
            raise TypeError(
                f"fully_shard on {_label(self)}: set_reduce_scatter_max_input_buffers takes an "
                f"int, got {type(max_input_buffers).__qualname__}; pass a count such as 2"
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"fully_shard on {_label(self)}: set_reduce_scatter_max_input_buffers takes a "
                f"count of at least 1, got {max_input_buffers}; 1 is the default"
            )
        _update(
            self,
            recurse,
            lambda record: attrs.evolve(record, reduce_scatter_max_input_buffers=max_input_buffers),
        )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> NoReturn:
        """Refused: a second communicator to overlap reduce-scatter with all-gather."""
        _refused(
            self,
            "set_separate_reduce_scatter_group",
            "fully_shard does not implement a second communicator for the reduce-scatter",
        )

    # ----------------------------------------------------------------- prefetching

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In forward, after this module's all-gather, start those of ``modules``, in order.

        ``torchcontract.apis.fully_shard.set_modules_to_forward_prefetch``, which
        says what it raises; an empty list restores the implicit prefetch.
        """
        set_modules_to_forward_prefetch(cast(nn.Module, self), cast(list[nn.Module], modules))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In backward, after this module's all-gather, start those of ``modules``, in order.

        ``torchcontract.apis.fully_shard.set_modules_to_backward_prefetch``; an empty
        list restores the implicit prefetch (the group whose forward ran before this one).
        """
        set_modules_to_backward_prefetch(cast(nn.Module, self), cast(list[nn.Module], modules))

    # ----------------------------------------------------------------- torch's plumbing

    def _get_fsdp_state(self) -> Any:  # FSDPState in torch: ours is TorchFullyShardState
        """The state torch's code reads as FSDP2's (``_torch_state``).

        ``register_fsdp_forward_method`` and ``share_comm_ctx`` call this.
        """
        state = torch_state_of(_group(self))
        if state is None:
            raise NotAppliedError(
                f"fully_shard on {_label(self)}: the state torch's code reads is gone "
                "(its class was set by hand); apply fully_shard to it"
            )
        return state

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Resharded first, as FSDP2's: a cast or move reaches the shards, and parameters()
        # lists them after it (an optimizer built next must hold the shards). Then
        # nn.Module's (or the original class's), not FSDPModule's, which reads FSDP2's state.
        group = MANAGED.group_of(cast(nn.Module, self))
        if group is not None and group.record() is not None:
            group.reshard()
        return cast(Any, super(FSDPModule, self))._apply(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, object]) -> NoReturn:
        """Refused with ``ContractError``: move the state dict instead.

        FSDP2 refuses too, with ``AssertionError``; the differences table lists the other type.
        """
        raise ContractError(
            f"fully_shard on {_label(self)}: a sharded module cannot be deep-copied (its "
            "parameters are shards of tensors spread over the mesh's ranks, gathered by its "
            "process group); copy the model before fully_shard, or save its state dict "
            "(model.state_dict(), or get_model_state_dict for full tensors) and load it into a "
            "new model sharded the same way"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickles are of the original class (their hooks stand aside), without torch's state."""
        return without_torch_state(
            reduce_as_original(cast(nn.Module, self), super().__reduce_ex__(protocol))
        )


def unshard_group(group: ParamGroup, async_op: bool) -> UnshardHandle | None:
    """Gather ``group``'s parameters now, or start to (``async_op``) and return the handle.

    What both ``FullyShardModule.unshard`` and the function ``unshard`` do. Before
    the first forward it takes the parameters assigned since apply as shards first,
    as FSDP2's ``unshard`` runs its group's lazy init (``ParamGroup.adopt_replaced``).
    """
    if group.root is None or not group.root.materialized:
        group.adopt_replaced()
    group.drop_prefetch()  # gathered before any optimizer step since: gather afresh
    if not async_op:
        group.unshard()
        return None
    group.check_materialized()
    group.prefetch(requested=True)
    return _PendingUnshard(group)


class _PendingUnshard(UnshardHandle):
    """The handle of ``unshard(async_op=True)``: ``wait()`` finishes the group's all-gather."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    def wait(self) -> None:
        self._group.unshard()


def fully_shard_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``FSDP<Name>(FullyShardModule, cls)``, made once per class (thread-safe)."""
    return swapped_class(FullyShardModule, "FSDP", cls)


# --------------------------------------------------------------------------- helpers


def _group(module: object) -> ParamGroup:
    """The group of ``module``'s application; ``NotAppliedError`` if there is none."""
    target = cast(nn.Module, module)
    group = MANAGED.group_of(target)
    if group is None or group.record() is None:
        raise NotAppliedError(
            f"fully_shard is not applied to {module_label(target)} (its class says it was, but "
            "its application is gone); apply fully_shard to it first"
        )
    return group


def _applied(module: object, recurse: bool) -> Iterator[nn.Module]:
    """``module``, or with ``recurse`` every module inside it that is a ``FullyShardModule``."""
    _group(module)  # NotAppliedError if not applied
    root = cast(nn.Module, module)
    if not recurse:
        yield root
        return
    for inner in root.modules():
        if isinstance(inner, FullyShardModule):
            yield inner


def _update(module: object, recurse: bool, transition: _Transition) -> None:
    """Apply ``transition`` to the record of each application ``_applied`` finds, once each."""
    seen: set[int] = set()
    for inner in _applied(module, recurse):
        group = MANAGED.group_of(inner)
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            group.update(transition)


def _label(module: object) -> str:
    return module_label(cast(nn.Module, module))


def _refused(module: object, method: str, why: str) -> NoReturn:
    raise NotImplementedError(
        f"fully_shard on {_label(module)}: {method} is not supported: {why}; remove the call"
    )
