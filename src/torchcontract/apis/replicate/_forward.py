"""The forward of a replicated module, as DDP's: buffers broadcast before, outputs armed after.

Before a forward (``before_forward``): DDP's error for a backward that left a
parameter without gradient or raised midway, the buckets' rebuild once it is due, then rank 0's
buffers broadcast where DDP would. After it
(``after_forward``): the tensors of a synchronizing forward's output that require grad
are armed, so the first backward through them synchronizes. Under Join the joined
ranks are told what follows (``_join`` meets these collectives).
"""

from __future__ import annotations

import contextlib
from typing import cast

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.algorithms.join import Join, Joinable

from torchcontract import ContractError

from .. import _torch
from ._autograd_hooks import Armed
from ._buckets import broadcast_from
from ._ignored import kept_buffers
from ._outputs import find_tensors
from ._reducer import Reducer
from ._state import ReplicateState
from ._torch_apis import check_no_torch_api

__all__ = [
    "after_forward",
    "before_forward",
    "broadcast_buffers",
    "common_rank",
    "will_broadcast_buffers",
]


def before_forward(reducer: Reducer, module: nn.Module) -> None:
    """Forward pre-hook body: DDP's checks, rebuild and buffer broadcast, where DDP's run."""
    record = reducer.record(module)
    if record is None:
        return
    if not reducer.checked_torch_apis:
        check_no_torch_api(module)
        reducer.checked_torch_apis = True
    if record.rank_local:
        return
    if not reducer.took_over_in_backward:
        # DDP's lazy init, at the first forward: optimizers applied in backward by then
        # step on the averaged gradients (``_in_backward``).
        reducer.take_over_in_backward()
    if torch.is_grad_enabled():
        # DDP's check, at the same moment: before any forward with grad enabled.
        reducer.check_finished()
    # Under Join, tell the joined ranks this one has not joined (the sum is the
    # count of ranks not joined); None outside Join.
    reducer.active_ranks = Join.notify_join_context(cast(Joinable, module))
    if torch.is_grad_enabled():
        reducer.rebuild_if_due(module)  # DDP's _rebuild_buckets, at the same moment
    if will_broadcast_buffers(reducer, record):
        # Under Join rank 0 may have joined, its buffers stale: as DDP, the last
        # rank not joined is the source.
        source = common_rank(reducer, True) if reducer.join_config.enable else 0
        broadcast_buffers(reducer, module, source)


def will_broadcast_buffers(reducer: Reducer, record: ReplicateState) -> bool:
    """Whether buffers are broadcast before this forward, as DDP's."""
    return (
        reducer.has_buffers
        and reducer.sync_buffers_next_forward
        and reducer.group.size() > 1
        and record.broadcast_buffers
    )


def broadcast_buffers(reducer: Reducer, module: nn.Module, source: int) -> None:
    """Overwrite ``module``'s buffers with group rank ``source``'s (a collective).

    Their version counters are kept, as DDP's: a graph of an earlier forward not yet
    run backward (two views through BatchNorm, then one loss) saved them, and still
    holds, as under DDP, where the broadcast wrote rank ``source``'s same statistics.
    """
    # Read the buffers anew each time, as DDP does: a forward may have replaced one.
    buffers = kept_buffers(module, reducer.ignored)
    with contextlib.ExitStack() as versions:
        for buffer in buffers:
            versions.enter_context(_unsafe_preserve_version_counter(buffer))
        broadcast_from(buffers, reducer.group, source)


def common_rank(reducer: Reducer, candidate: bool) -> int:
    """The largest group rank of those for which ``candidate`` holds (a collective)."""
    group = reducer.group
    rank = torch.tensor(
        [group.rank() if candidate else -1], dtype=torch.int64, device=reducer.device
    )
    _torch.all_reduce_max(rank, group)
    found = int(rank.item())
    if found < 0:
        raise ContractError(
            f"{reducer.where()}: no rank of the group offered itself as the source of the "
            "broadcast; every rank must enter Join with the model"
        )
    return found


def after_forward(reducer: Reducer, module: nn.Module, output: object) -> None:
    """Forward hook body: arm the outputs of a synchronizing forward.

    As DDP, a synchronizing forward whose output holds no tensor that requires
    grad arms nothing (DDP finds no parameter to wait for), yet buffers are
    broadcast before the next forward.
    """
    record = reducer.record(module)
    if record is None:
        return
    if record.rank_local:
        if torch.is_grad_enabled():
            reducer.forget_expected_backward()  # its backward must send nothing
        return
    synchronizing = torch.is_grad_enabled() and record.sync_gradients
    forward = reducer.expect_backward(synchronizing)
    reducer.sync_buffers_next_forward = synchronizing
    found = find_tensors(output) if synchronizing else []
    tensors = [tensor for tensor in found if tensor.requires_grad]
    if reducer.join_config.enable:
        # Tell the joined ranks whether buffers are broadcast before the next
        # forward, and whether a synchronizing backward follows (see _join): one is
        # expected unless the output's tensors were found and none needs a gradient.
        follows = synchronizing and (bool(tensors) or not found)
        if not follows:
            reducer.forget_expected_backward()  # the joined ranks will not meet one
        flags = [float(synchronizing), float(follows)]
        on_device = _torch.host_values_on(flags, torch.float32, reducer.device)
        _torch.all_reduce(on_device, reducer.group).wait()
    if tensors:
        armed = Armed(reducer, forward)
        for tensor in tensors:
            _torch.register_tensor_hook(tensor, armed)
