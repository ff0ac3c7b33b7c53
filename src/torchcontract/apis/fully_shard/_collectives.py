"""The two collectives of a parameter group: one all-gather, one reduce-scatter, flat.

Both move each parameter's padded shard (``chunk_rows`` rows), concatenated over
the group's parameters, so one collective serves the whole group; the layout
is PyTorch's ``foreach_all_gather`` / ``foreach_reduce``: rank ``r``'s slice of
the flat buffer holds every parameter's ``r``-th padded shard, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext

import attrs
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import _torch
from .._let_go import Waitable
from . import _comms, _copies
from ._comms import AllGatherComm, ReduceScatterComm
from ._division import Division, division
from ._sharding import ManagedParameter
from ._streams import CommStreams

__all__ = ["PendingGather", "all_gather", "on_stream", "reduce_scatter", "start_all_gather"]


class PendingGather:
    """An all-gather started ahead of use (a prefetch): ``finish()`` waits and unshards.

    It holds the flat input and output buffers until then, as the collective
    writes into them on gloo's own thread; ``discard()`` waits and drops them.
    ``requested``: the user's ``unshard(async_op=True)``, which the root's next
    forward uses (as FSDP2's), rather than a prefetch, which that forward drops.
    """

    __slots__ = ("_parts", "_works", "requested")

    def __init__(self, parts: list[_Part], works: list[Waitable]) -> None:
        self._parts = parts
        self._works = works
        self.requested = False

    def finish(self, *, keep: bool = False) -> None:
        """Wait for the collective(s) and register the unsharded parameters.

        On an accelerator, the buffers go as ``CommStreams.copied_out`` says; ``keep``:
        a forward's gather, whose buffers are kept until the next one's copy-out.
        """
        self.wait()
        parts, self._parts = self._parts, []
        for part in parts:
            part.finish()
        streams = next((part.streams for part in parts if part.event is not None), None)
        if streams is not None:
            streams.copied_out([buffer for part in parts for buffer in part.buffers()], keep=keep)

    def discard(self) -> None:
        """Wait for the collective(s) and drop their result (no rank may leave one behind).

        On an accelerator, the buffers go once the gather streams wait for the
        collective that writes them (``CommStreams.drop_gather``).
        """
        self.wait()
        parts, self._parts = self._parts, []
        for part in parts:
            if part.streams is not None and part.event is not None:
                part.streams.drop_gather(part.event)

    def wait(self) -> None:
        """Wait for the collectives that run on gloo's threads (none on an accelerator)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()


class _Part:
    """The all-gather of one dtype's parameters: its buffers, and how to unshard from them.

    ``gathered`` None: a world of one, whose shards are already in the unsharded
    parameters. ``batched``: the rows go out in one copy (``_copies``), else one by
    one (another shard dim, or what a post-forward reshard kept).
    """

    __slots__ = ("batched", "event", "flat", "gathered", "parameters", "streams", "world")

    def __init__(
        self,
        parameters: Sequence[ManagedParameter],
        flat: Tensor | None,
        gathered: Tensor | None,
        world: int,
        *,
        batched: bool,
        streams: CommStreams | None = None,
    ) -> None:
        self.parameters = parameters
        self.flat = flat
        self.gathered = gathered
        self.world = world
        self.batched = batched
        self.streams = streams
        # On an accelerator: the all-gather stream's event that the copy-out waits for.
        self.event = None if streams is None or gathered is None else streams.gathered()

    def buffers(self) -> tuple[Tensor, ...]:
        """The gather's buffers: its output, and its input where that is not a view of it."""
        if self.gathered is None:
            return ()
        if self.batched or self.flat is None:
            return (self.gathered,)
        return (self.gathered, self.flat)

    def finish(self) -> None:
        if self.streams is not None and self.event is not None:
            self.streams.copy_out_after(self.event)
        gathered = self.gathered
        if gathered is None:
            pass
        elif self.batched:
            _copies.copy_out(self.parameters, gathered, self.world)
        else:
            assert self.flat is not None
            _unshard_from(self.parameters, gathered, gathered.numel() // self.flat.numel())
            return
        for parameter in self.parameters:
            parameter.install_unsharded()


def start_all_gather(
    parameters: Sequence[ManagedParameter],
    group: dist.ProcessGroup,
    *,
    async_op: bool,
    post_forward: bool = False,
    comm: AllGatherComm | None = None,
    streams: CommStreams | None = None,
) -> PendingGather:
    """Start the all-gather of ``parameters``: one collective per dtype, in their order.

    With ``async_op`` the collectives run while the caller computes (gloo runs them
    on its own threads); without, they are done when this returns. With
    ``post_forward``, each rank sends what it kept after forward, over ``group`` (the
    post-forward mesh's shard group) instead of its shard. ``comm``
    (``set_custom_all_gather``) allocates the output and runs each collective.

    With ``streams`` (an accelerator), the copy-in runs on its stream and the
    collective on the all-gather stream, and ``finish`` orders the copy-out after it
    on the caller's stream (``_streams``); the collective is then issued in order on
    its stream, whatever ``async_op``.
    """
    parts: list[_Part] = []
    works: list[Waitable] = []
    world = group.size()
    for same_dtype in _by_dtype(parameters, [parameter.param_dtype for parameter in parameters]):
        chosen = [parameters[index] for index in same_dtype]
        dtype = chosen[0].param_dtype
        # A custom comm's buffer takes the batched copies too, and a world of one calls no
        # comm (the shards are copied straight in), as FSDP2's.
        batched = not post_forward and _copies.batched(chosen)
        if batched and world == 1:
            _copies.copy_shards(chosen, dtype)
            parts.append(_Part(chosen, None, None, world, batched=True))
            continue
        with on_stream(streams.copying_in() if streams is not None else None):
            if batched:
                flat, gathered = _copies.copy_in(chosen, dtype, world, group.rank(), comm)
            else:
                inputs = [
                    parameter.post_forward_input() if post_forward else parameter.gather_input()
                    for parameter in chosen
                ]
                if streams is not None and post_forward:
                    streams.hold_for_copy_in(inputs)
                flat = torch.cat(inputs)
                numel = world * flat.numel()
                if comm is not None:
                    gathered = _comms.allocate(comm, numel, flat.dtype, flat.device)
                else:
                    gathered = torch.empty(numel, dtype=flat.dtype, device=flat.device)
                    if world == 1:
                        gathered.copy_(flat)
        with on_stream(streams.gathering() if streams is not None else None):
            if comm is not None:
                work = _comms.all_gather(
                    comm, gathered, flat, group, async_op=async_op and streams is None
                )
                if work is not None:
                    works.append(work)
            elif world == 1:
                pass
            elif async_op and streams is None:
                works.append(_torch.all_gather_into_async(gathered, flat, group))
            else:
                _torch.all_gather_into(gathered, flat, group)
            parts.append(_Part(chosen, flat, gathered, world, batched=batched, streams=streams))
    return PendingGather(parts, works)


def all_gather(parameters: Sequence[ManagedParameter], group: dist.ProcessGroup) -> None:
    """All-gather ``parameters`` and register their unsharded forms: one collective per dtype."""
    start_all_gather(parameters, group, async_op=False).finish()


def on_stream(context: AbstractContextManager[object] | None) -> AbstractContextManager[object]:
    """``context``, or nothing (the CPU: no stream)."""
    return nullcontext() if context is None else context


def _by_dtype(items: Sequence[object], dtypes: Sequence[torch.dtype]) -> list[list[int]]:
    """Indices of ``items`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(index)
    return list(groups.values())


def _unshard_from(parameters: Sequence[ManagedParameter], gathered: Tensor, world: int) -> None:
    """Each parameter's columns of the ``world`` ranks' inputs, as ``(its world, padded)`` rows.

    A rank's input holds, per parameter, a run of whole padded shards (one, or after a
    post-forward reshard several), so the columns in rank order are the padded rows.
    """
    columns = gathered.view(world, -1)
    shards_per_rank = columns.shape[1] // sum(
        parameter.padded_shard_numel for parameter in parameters
    )
    offset = 0
    for parameter in parameters:
        width = shards_per_rank * parameter.padded_shard_numel
        rows = columns[:, offset : offset + width].reshape(
            parameter.world, parameter.padded_shard_numel
        )
        parameter.unshard_from(rows)
        offset += width


def reduce_scatter(
    parameters: Sequence[ManagedParameter],
    grads: Sequence[Tensor],
    group: dist.ProcessGroup,
    reduce_dtype: torch.dtype | None,
    replicate_group: dist.ProcessGroup | None = None,
    *,
    hook: Callable[[Tensor], None] | None = None,
    hook_stream: object | None = None,
    all_reduce: bool = True,
    deferred: dict[int, Tensor] | None = None,
    divide_factor: float | None = None,
    force_sum: bool = False,
    comm: ReduceScatterComm | None = None,
    streams: CommStreams | None = None,
) -> list[torch.Event]:
    """Average ``grads`` (unsharded, one per parameter) over ``group`` into the sharded ``.grad``.

    The reduction runs in ``reduce_dtype`` (the gradients' own dtype if None), one
    collective per dtype; each shard's gradient is cast back to its parameter's
    dtype and added to ``.grad`` (set if there was none). With ``replicate_group``
    (HSDP) the reduce-scattered shards are then averaged over the replicas, as FSDP2's
    ``foreach_reduce`` all-reduces them over the mesh's outer dim. ``hook`` (FSDP2's
    all-reduce hook) gets the reduced flat shards then, before they are stored.

    Under HSDP with ``all_reduce`` False (``set_requires_all_reduce(False)``), as
    FSDP2's: the reduce-scattered shards are added to ``deferred`` (by parameter id,
    in the reduction dtype) and nothing else happens, no all-reduce, no hook, no
    ``.grad``; the next reduction with ``all_reduce`` adds them to its own before
    its one all-reduce over the replicas, and empties ``deferred``.

    ``divide_factor`` (``set_gradient_divide_factor``) replaces the mesh's size as
    the divisor of the sum over both dims, with FSDP2's operations: a division on a
    shard group of one, an average where it is the shard group's size, else each
    rank's gradient times its inverse, summed; the all-reduce then sums. With
    ``force_sum`` (``set_force_sum_reduction_for_comms(True)``) the collectives only
    sum: ``hook`` sees the sum, divided by the factor (or the mesh's size) after it,
    as FSDP2 divides after its sums. In a reduce dtype other than float32 and
    bfloat16 the collectives sum too, between a division before and one after
    (``_division``), as FSDP2's, so a float16 sum does not overflow.

    ``comm`` (``set_custom_reduce_scatter``) allocates the input and output buffers
    and runs each reduce-scatter, with the op FSDP2 would pass (``AVG`` to average
    over the shard group, else ``SUM`` of the inputs, premultiplied by ``1 / factor``
    where FSDP2 sends ``PREMUL_SUM``).

    With ``streams`` (an accelerator) each reduction runs on the reduce-scatter
    stream (HSDP's all-reduce on its own), once it waits for the caller's; ``hook``
    and the store after it run on ``hook_stream`` (the all-reduce stream if None),
    once it waits for the reduction, as FSDP2's; returned: the events the end of
    backward waits for (none on the CPU, where ``hook_stream`` plays no part).
    """
    dtypes = [reduce_dtype or grad.dtype for grad in grads]
    reduction = _Reduction(
        group,
        replicate_group,
        hook,
        hook_stream,
        all_reduce,
        {} if deferred is None else deferred,
        divide_factor,
        force_sum,
        comm,
    )
    events: list[torch.Event] = []
    if streams is not None:
        streams.before_reduce_inputs()
    for same_dtype in _by_dtype(parameters, dtypes):
        event = _reduce_scatter_one_dtype(
            [parameters[index] for index in same_dtype],
            [grads[index] for index in same_dtype],
            dtypes[same_dtype[0]],
            reduction,
            streams,
        )
        if event is not None:
            events.append(event)
    return events


@attrs.frozen
class _Reduction:
    """How one ``reduce_scatter`` call reduces, the same for each of its dtypes."""

    group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    hook: Callable[[Tensor], None] | None
    hook_stream: object | None
    all_reduce: bool
    deferred: dict[int, Tensor]
    divide_factor: float | None
    force_sum: bool
    comm: ReduceScatterComm | None

    @property
    def replicas(self) -> int:
        """The replicas HSDP all-reduces over (1 without HSDP)."""
        return 1 if self.replicate_group is None else self.replicate_group.size()


def _reduce_scatter_one_dtype(
    parameters: Sequence[ManagedParameter],
    grads: Sequence[Tensor],
    dtype: torch.dtype,
    reduction: _Reduction,
    streams: CommStreams | None,
) -> torch.Event | None:
    world = reduction.group.size()
    # Whether ``flat`` came from the custom comm's allocator (the batched copy writes there).
    staged = _copies.batched(parameters) and not any(isinstance(grad, DTensor) for grad in grads)
    if staged:
        numel = sum(parameter.padded_shard_numel for parameter in parameters)
        flat = _copies.gradient_input(grads, dtype, world, numel, reduction.comm)
    else:
        flat = torch.cat(
            [
                parameter.scatter_input(grad, dtype)
                for parameter, grad in zip(parameters, grads, strict=True)
            ],
            dim=1,
        ).reshape(-1)
    numel = flat.numel() // world
    if streams is None:
        _reduce(parameters, flat, numel, dtype, reduction, staged=staged, streams=None)
        return None
    with streams.reducing():
        last = _reduce(parameters, flat, numel, dtype, reduction, staged=staged, streams=streams)
        assert last is not None  # with streams, it ends on one of them
        return streams.reduced(last)


def _reduce(
    parameters: Sequence[ManagedParameter],
    flat: Tensor,
    numel: int,
    dtype: torch.dtype,
    reduction: _Reduction,
    *,
    staged: bool,
    streams: CommStreams | None,
) -> torch.Stream | None:
    """Reduce-scatter ``flat``, all-reduce over replicas, store the shards' gradients.

    ``staged``: ``flat`` is a buffer of the custom comm's allocator, if there is one.

    On an accelerator (``streams``), called on the reduce-scatter stream; returned:
    the stream its last work ran on, whose event the end of backward waits for
    (None on the CPU).
    """
    group, divide_factor = reduction.group, reduction.divide_factor
    world, replicas, comm = group.size(), reduction.replicas, reduction.comm
    divided = division(dtype, world * replicas, divide_factor, force_sum=reduction.force_sum)
    if divided.before is not None:
        flat.div_(divided.before)
    if comm is not None:
        reduced = _custom_reduce_scatter(comm, flat, group, divide_factor, divided, staged=staged)
    elif world == 1:
        # On an accelerator, as FSDP2's: into a buffer of this stream, so the input (the
        # compute stream's) is done with once the event after this copy is reached.
        into = None if streams is None else torch.empty_like(flat)
        reduced = _alone(flat, divide_factor, divided, into)
    elif not divided.in_collectives:
        reduced = torch.empty(numel, dtype=dtype, device=flat.device)
        _torch.reduce_scatter_sum(reduced, flat, group)
    elif divide_factor is None or divide_factor == world:
        reduced = torch.empty(numel, dtype=dtype, device=flat.device)
        _torch.reduce_scatter_average(reduced, flat, group)
    else:  # FSDP2's PREMUL_SUM(1 / factor)
        reduced = torch.empty(numel, dtype=dtype, device=flat.device)
        _torch.reduce_scatter_sum(reduced, flat.mul_(1 / divide_factor), group)
    last = None
    if streams is not None:
        streams.reduce_scattered(flat)
        last = streams.reduce_scatter
    replicate_group, deferred = reduction.replicate_group, reduction.deferred
    if replicate_group is not None:
        if not reduction.all_reduce:
            _defer(parameters, reduced, deferred)
            return last
        if deferred:  # only after a backward with the all-reduce off
            _take_deferred(parameters, reduced, deferred)
    with ExitStack() as stack:
        if replicas > 1:  # the all-reduce over the replicas
            if streams is not None:
                stack.enter_context(streams.all_reducing(reduced))
                last = streams.all_reduce
            assert replicate_group is not None
            if divide_factor is None and divided.in_collectives:  # the all-reduce averages
                _torch.all_reduce_average(reduced, replicate_group)
            else:
                _torch.all_reduce(reduced, replicate_group).wait()
        if reduction.hook is not None and streams is not None:
            last = stack.enter_context(streams.hooking(reduced, reduction.hook_stream))
        _store(parameters, reduced, reduction.hook, divided.after)
    return last


def _store(
    parameters: Sequence[ManagedParameter],
    reduced: Tensor,
    hook: Callable[[Tensor], None] | None,
    after: float | None,
) -> None:
    """The reduced shards: to the all-reduce hook, divided by ``after``, to ``.grad``.

    The hook sees what FSDP2's sees: the average, or the sum divided only before.
    """
    if hook is not None:
        hook(reduced)
    if after is not None:
        reduced.div_(after)
    _copies.shard_gradients(parameters, reduced)


def _slices(parameters: Sequence[ManagedParameter], reduced: Tensor) -> list[Tensor]:
    """Each parameter's padded shard in the flat reduced buffer, in order."""
    slices: list[Tensor] = []
    offset = 0
    for parameter in parameters:
        slices.append(reduced[offset : offset + parameter.padded_shard_numel])
        offset += parameter.padded_shard_numel
    return slices


def _custom_reduce_scatter(
    comm: ReduceScatterComm,
    flat: Tensor,
    group: dist.ProcessGroup,
    divide_factor: float | None,
    divided: Division,
    *,
    staged: bool,
) -> Tensor:
    """Reduce-scatter ``flat`` through ``comm``, as FSDP2's ``foreach_reduce`` calls it.

    Its buffers come from ``comm.allocate``: ``flat`` already (``staged``), else it is
    copied into one; a shard group of one only copies (and divides by the factor where
    the collectives would), as FSDP2's.
    """
    world = group.size()
    if not staged:
        flat = _comms.allocate(comm, flat.numel(), flat.dtype, flat.device).copy_(flat)
    reduced = _comms.allocate(comm, flat.numel() // world, flat.dtype, flat.device)
    if world == 1:
        return _alone(flat, divide_factor, divided, reduced)
    op = dist.ReduceOp.SUM
    if divided.in_collectives:
        if divide_factor is None or divide_factor == world:
            op = dist.ReduceOp.AVG
        else:  # FSDP2's PREMUL_SUM(1 / factor), which gloo lacks: the same product, summed
            flat.mul_(1 / divide_factor)
    comm(output_tensor=reduced, input_tensor=flat, group=group, op=op)
    return reduced


def _alone(
    flat: Tensor, divide_factor: float | None, divided: Division, into: Tensor | None
) -> Tensor:
    """A shard group of one's reduction: ``flat`` itself, divided by the factor where the
    collectives would divide, in place, or copied ``into`` a buffer of its own."""
    factor = divide_factor if divided.in_collectives else None
    if into is None:
        return flat if factor is None else flat.div_(factor)
    return into.copy_(flat if factor is None else flat / factor)


def _defer(
    parameters: Sequence[ManagedParameter], reduced: Tensor, deferred: dict[int, Tensor]
) -> None:
    """Add the reduce-scattered shards to those kept for the next all-reduce (FSDP2's partial)."""
    for parameter, shard in zip(parameters, _slices(parameters, reduced), strict=True):
        kept = deferred.get(id(parameter))
        if kept is None:
            deferred[id(parameter)] = shard
        else:
            kept += shard


def _take_deferred(
    parameters: Sequence[ManagedParameter], reduced: Tensor, deferred: dict[int, Tensor]
) -> None:
    """Add the kept shards to this reduction's, before its all-reduce; forget them."""
    for parameter, shard in zip(parameters, _slices(parameters, reduced), strict=True):
        kept = deferred.pop(id(parameter), None)
        if kept is not None:
            shard.add_(kept)  # in place: a view of the flat buffer the all-reduce sends
