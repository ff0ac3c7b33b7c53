"""replicate(): data-parallel training by averaging gradients across a process group.

At apply, rank 0's parameters and buffers are broadcast to every rank and the
parameters are split into buckets. In backward, a post-accumulate-grad hook on
each parameter marks it ready; a bucket whose parameters are all ready is
flattened, divided by the world size and all-reduced asynchronously, in bucket
order, so every rank issues the same collectives in the same order. A callback
queued on the autograd engine waits for the reductions at the end of backward
and writes the averages back into ``.grad``. This is what
``torch.nn.parallel.DistributedDataParallel`` computes, through hooks instead of
a wrapper module.

The frozen record (``ReplicateState``) holds what is fixed or counted; the
bookkeeping of the backward in flight lives in a ``_Reducer`` that only the
parameters' hooks hold. It refers to the module and its parameters weakly, so
dropping the model frees it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator, Sequence

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchcontract import ContractError, Incompatible, RegistryEntry, contract

from . import _torch
from .checkpoint import checkpoint, require_one_module

__all__ = ["ReplicateState", "no_sync", "replicate"]

_MEGABYTE = 1024 * 1024


def _group_repr(group: dist.ProcessGroup | None) -> str:
    if group is None:
        return "None"
    return f"<ProcessGroup {group.name()} rank {group.rank()} of {group.size()}>"


@attrs.frozen
class ReplicateState:
    """The record of ``replicate`` on a module.

    ``process_group``: the group gradients are averaged over. ``buckets``: the
    FQNs of the parameters reduced together, in reduction order. ``step``: the
    number of backward passes whose gradients were synchronized.
    ``sync_gradients``: False while gradients only accumulate locally (see
    ``no_sync``).
    """

    process_group: dist.ProcessGroup | None = attrs.field(default=None, repr=_group_repr)
    buckets: tuple[tuple[str, ...], ...] = ()
    step: int = 0
    sync_gradients: bool = True


def _is_reentrant(entry: RegistryEntry) -> bool:
    return bool(entry.arguments["use_reentrant"])


class _Reducer:
    """Bookkeeping of one replicate application across one backward pass at a time."""

    def __init__(
        self,
        module: nn.Module,
        names: Sequence[str],
        parameters: Sequence[nn.Parameter],
        buckets: Sequence[Sequence[int]],
    ) -> None:
        self._module = weakref.ref(module)
        self._names = tuple(names)
        self._parameters = tuple(weakref.ref(parameter) for parameter in parameters)
        self._buckets = tuple(tuple(bucket) for bucket in buckets)
        self._group: dist.ProcessGroup | None = None
        self._in_backward = False
        self._waiting = [len(bucket) for bucket in self._buckets]
        self._arrived: list[list[Tensor | None]] = [[None] * len(b) for b in self._buckets]
        self._next = 0  # the next bucket to launch: buckets launch strictly in order
        self._launched: list[tuple[int, Tensor, dist.Work]] = []

    def hook(self, bucket: int, slot: int) -> _ParameterHook:
        return _ParameterHook(self, bucket, slot)

    def ready(self, bucket: int, slot: int, parameter: Tensor) -> None:
        """Mark a parameter's gradient final for this backward; launch what is complete."""
        if not self._in_backward and not self._begin():
            return
        arrived = self._arrived[bucket]
        if arrived[slot] is not None:
            raise ContractError(
                f"replicate: parameter {self._names[self._buckets[bucket][slot]]!r} got its "
                "gradient twice in one backward pass; a reentrant backward (e.g. "
                "checkpoint(use_reentrant=True)) or a failed earlier backward causes this"
            )
        arrived[slot] = parameter
        self._waiting[bucket] -= 1
        while self._next < len(self._buckets) and self._waiting[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _begin(self) -> bool:
        """Start synchronizing this backward, if the module is alive and not in no_sync."""
        module = self._module()
        record = None if module is None else replicate.get_state(module)
        if record is None or not record.sync_gradients or record.process_group is None:
            return False
        self._group = record.process_group
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return True

    def _launch(self, bucket: int) -> None:
        """Average one bucket's gradients: flatten, divide, start the all-reduce."""
        group = self._group
        if group is None:
            raise RuntimeError("replicate: bucket launched outside a backward pass")
        parts: list[Tensor] = []
        flags: list[float] = []
        for slot, parameter in enumerate(self._arrived[bucket]):
            if parameter is not None and parameter.grad is not None:
                if parameter.grad.is_sparse:
                    raise ContractError(
                        f"replicate: {self._names[self._buckets[bucket][slot]]!r} has a sparse "
                        "gradient, which replicate does not average; use dense gradients "
                        "(e.g. nn.Embedding(sparse=False)) or DistributedDataParallel"
                    )
                parts.append(parameter.grad.reshape(-1))
                flags.append(1.0)
            else:  # no gradient on this rank this time: it contributes zeros
                like = self._parameter(bucket, slot)
                parts.append(torch.zeros(like.numel(), dtype=like.dtype, device=like.device))
                flags.append(0.0)
        # One element per parameter says whether any rank had its gradient, so a
        # parameter unused on every rank keeps its .grad, as DDP leaves it.
        parts.append(torch.tensor(flags, dtype=parts[0].dtype, device=parts[0].device))
        flat = torch.cat(parts)
        flat.div_(group.size())
        self._launched.append((bucket, flat, _torch.all_reduce(flat, group)))

    def _parameter(self, bucket: int, slot: int) -> Tensor:
        parameter = self._parameters[self._buckets[bucket][slot]]()
        if parameter is None:
            raise RuntimeError("replicate: a parameter was freed during backward")
        return parameter

    def _finish(self) -> None:
        """Run by the autograd engine at the end of backward: write the averages back."""
        try:
            while self._next < len(self._buckets):
                self._launch(self._next)
                self._next += 1
            for bucket, flat, work in self._launched:
                work.wait()
                self._write_back(bucket, flat)
        finally:
            self._reset()
        module = self._module()
        if module is not None:
            replicate.update(module, lambda record: attrs.evolve(record, step=record.step + 1))

    def _write_back(self, bucket: int, flat: Tensor) -> None:
        slots = len(self._buckets[bucket])
        used = _torch.to_bools(flat[flat.numel() - slots :] > 0)
        offset = 0
        for slot in range(slots):
            parameter = self._parameter(bucket, slot)
            count = parameter.numel()
            if used[slot]:
                average = flat[offset : offset + count].view_as(parameter)
                if parameter.grad is None:
                    parameter.grad = average.clone()
                else:
                    parameter.grad.copy_(average)
            offset += count

    def _reset(self) -> None:
        self._in_backward = False
        self._group = None
        self._next = 0
        self._launched = []
        for bucket, arrived in zip(self._buckets, self._arrived, strict=True):
            arrived[:] = [None] * len(bucket)
        self._waiting = [len(bucket) for bucket in self._buckets]


class _ParameterHook:
    """The post-accumulate-grad hook of one parameter: tells the reducer it is ready."""

    __slots__ = ("_bucket", "_reducer", "_slot")

    def __init__(self, reducer: _Reducer, bucket: int, slot: int) -> None:
        self._reducer = reducer
        self._bucket = bucket
        self._slot = slot

    def __call__(self, parameter: Tensor) -> None:
        self._reducer.ready(self._bucket, self._slot, parameter)


def _bucket_indices(parameters: Sequence[nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """Split parameter indices into buckets of at most ``cap_bytes`` (one parameter at least).

    Gradients arrive roughly in reverse order of definition, so buckets are
    filled from the last parameter backwards; a bucket holds one device and dtype.
    """
    buckets: list[list[int]] = []
    open_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[int], int]] = {}
    for index in reversed(range(len(parameters))):
        parameter = parameters[index]
        key = (parameter.device, parameter.dtype)
        size = parameter.numel() * parameter.element_size()
        bucket, used = open_buckets.get(key, ([], 0))
        if bucket and used + size > cap_bytes:
            bucket, used = [], 0
        if not bucket:
            buckets.append(bucket)
        bucket.append(index)
        open_buckets[key] = (bucket, used + size)
    return buckets


def _broadcast_from_first_rank(
    tensors: Sequence[Tensor], group: dist.ProcessGroup, cap_bytes: int
) -> None:
    """Overwrite ``tensors`` with the first rank's values, in flat chunks per device and dtype."""
    source = dist.get_global_rank(group, 0)
    kinds: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    used: dict[tuple[torch.device, torch.dtype], int] = {}
    for tensor in tensors:
        kind = (tensor.device, tensor.dtype)
        chunks = kinds.setdefault(kind, [[]])
        size = tensor.numel() * tensor.element_size()
        if chunks[-1] and used[kind] + size > cap_bytes:
            chunks.append([])
            used[kind] = 0
        chunks[-1].append(tensor)
        used[kind] = used.get(kind, 0) + size
    with torch.no_grad():
        for chunks in kinds.values():
            for chunk in chunks:
                flat = torch.cat([tensor.reshape(-1) for tensor in chunk])
                _torch.broadcast(flat, source, group)
                offset = 0
                for tensor in chunk:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


@contract(
    ReplicateState,
    incompatible_with=(
        Incompatible(checkpoint, when=_is_reentrant),
        Incompatible("replicate"),
        Incompatible("fully_shard"),
    ),
)
def replicate(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
) -> None:
    """Average ``module``'s gradients over ``process_group`` (default: the world) in backward.

    Every rank must apply it to the same model, and run the same backward passes.
    At apply, rank 0's parameters and buffers are copied to all ranks. After each
    backward, ``.grad`` holds the mean over ranks of the local gradients, as with
    ``DistributedDataParallel``; a parameter without a gradient on a rank counts
    as zeros there, and gets the averaged gradient too. Buffers are not
    synchronized after apply. ``bucket_cap_mb`` bounds the bytes reduced in one
    collective.

    Cannot be combined with ``checkpoint(use_reentrant=True)`` on the same or
    nested modules (each reentrant region runs a nested backward pass that would
    synchronize gradients on its own), nor with torch's own ``replicate`` or
    ``fully_shard`` on the module or inside it (gradients would be averaged
    twice; torch's registry cannot be searched upwards). Raises
    ``ContractError`` if no process group is initialized, ``ValueError`` for a
    non-positive ``bucket_cap_mb``.
    """
    require_one_module("replicate", module)
    if not bucket_cap_mb > 0:
        raise ValueError(f"replicate: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    if process_group is None:
        if not dist.is_initialized():
            raise ContractError(
                f"replicate on {type(module).__qualname__}: no default process group; call "
                "torch.distributed.init_process_group() first, or pass process_group="
            )
        process_group = dist.group.WORLD
        if process_group is None:
            raise ContractError("replicate: torch.distributed has no world group")
    cap_bytes = max(1, int(bucket_cap_mb * _MEGABYTE))
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    names = [name for name, _ in named]
    parameters = [parameter for _, parameter in named]
    if process_group.size() > 1:
        _broadcast_from_first_rank(
            [*module.parameters(), *module.buffers()], process_group, cap_bytes
        )
    buckets = _bucket_indices(parameters, cap_bytes)
    reducer = _Reducer(module, names, parameters, buckets)
    for bucket_index, bucket in enumerate(buckets):
        for slot, parameter_index in enumerate(bucket):
            _torch.register_post_accumulate_grad_hook(
                parameters[parameter_index], reducer.hook(bucket_index, slot)
            )
    replicate.update(
        module,
        lambda record: attrs.evolve(
            record,
            process_group=process_group,
            buckets=tuple(tuple(names[index] for index in bucket) for bucket in buckets),
        ),
    )


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Generator[None]:
    """Within the block, backward passes only accumulate ``module``'s gradients locally.

    The first backward after the block averages the accumulated gradients, as
    ``DistributedDataParallel.no_sync()`` does. Raises ``NotAppliedError`` if
    ``replicate`` is not applied to ``module``. Restores the previous setting on
    exit, so blocks nest.
    """
    previous = replicate.state(module).sync_gradients
    replicate.update(module, lambda record: attrs.evolve(record, sync_gradients=False))
    try:
        yield
    finally:
        replicate.update(module, lambda record: attrs.evolve(record, sync_gradients=previous))
