"""The reducer: which backward synchronizes, and the averaging of gradients in buckets.

Semantics are those of ``DistributedDataParallel(find_unused_parameters=True)``:

* Whether a backward synchronizes is decided by the forward that built its
  graph: a forward of the replicated module with grad enabled and
  ``sync_gradients`` on (outside ``rank_local``) arms the tensors of its output
  that require grad, wherever DDP would find them, and the first backward that
  reaches one of them synchronizes, once. Any other backward (inside ``no_sync``, a
  second one through a retained graph, one that never went through the module's
  forward) only accumulates locally and issues no collective, so it cannot hang.
* A parameter counts as used if its gradient was accumulated in any backward
  since the last synchronization (``no_sync`` steps included). At the end of a
  synchronizing backward, every parameter used on some rank gets the mean over
  ranks of ``.grad``: what it holds now, earlier accumulation included, or zeros
  where it has none. A parameter no rank used keeps its ``.grad`` untouched.
* Buckets are all-reduced asynchronously, strictly in order, each as soon as all
  of its parameters' gradients arrived in this backward; the rest at the end.
  After the first synchronizing backward the buckets are rebuilt in the order
  gradients arrived on the first rank, so later backwards launch them early.

The reducer holds the module and its parameters weakly: the hooks hold the
reducer, and dropping the model frees it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Final

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchcontract import (
    Application,
    ContractError,
    IncompatibleAPIError,
    module_label,
    named_tree,
    torch_registry,
)

from .. import _torch
from ._buckets import FIRST_BUCKET_BYTES, broadcast_from_first_rank, launch_buckets
from ._outputs import find_tensors
from ._state import ReplicateState

__all__ = ["Reducer"]

#: A model's gradients are reduced in this many buckets at least, where the caps allow.
#: More overlap less of the backward than each collective costs on its own: on 2 gloo
#: ranks sharing 2 cores, a 50-layer MLP's step took 1.06 to 1.12 times DDP's with 8,
#: 1.14 to 1.19 with 16, 0.98 to 1.05 with 2 to 4 (DDP's own sizes: 1.02 to 1.05).
_MIN_BUCKETS: Final = 4

#: Called at the end of each synchronized backward, with the new buckets once rebuilt.
OnSynchronized = Callable[[nn.Module, tuple[tuple[str, ...], ...] | None], None]


class Reducer:
    """Runtime bookkeeping of one ``replicate`` application; held only by its hooks."""

    def __init__(
        self,
        module: nn.Module,
        application: Application[ReplicateState],
        *,
        group: dist.ProcessGroup,
        named: Sequence[tuple[str, nn.Parameter]],
        last_cap_bytes: int,
        cap_bytes: int,
        on_synchronized: OnSynchronized,
    ) -> None:
        self._module = weakref.ref(module)
        self._application = application
        self._group = group
        self._names = tuple(name for name, _ in named)
        self._parameters = tuple(weakref.ref(parameter) for _, parameter in named)
        self._cap_bytes = cap_bytes
        parameters = [parameter for _, parameter in named]
        total = sum(parameter.numel() * parameter.element_size() for parameter in parameters)
        # At most the cap, and at most a quarter of the gradient bytes (but 1 MiB at
        # least), so that reductions overlap the backward on models of a few caps too.
        self._bucket_bytes = min(cap_bytes, max(FIRST_BUCKET_BYTES, total // _MIN_BUCKETS))
        # The bucket launched last is no larger than the others (DDP's is at most 1 MiB
        # under the default cap, and the cap given otherwise).
        self._last_cap = min(last_cap_bytes, self._bucket_bytes)
        self._on_synchronized = on_synchronized
        count = len(named)
        self._used = [False] * count  # accumulated into since the last synchronization
        self._arrival: list[int] | None = []  # arrival order until the buckets are rebuilt
        self._task = -1  # the autograd graph task that synchronizes, or -1
        # DDP's require_forward_param_sync: buffers are broadcast before a forward
        # that follows a synchronizing one (and before the first).
        self.sync_buffers_next_forward = True
        # As DDP: a module without buffers at apply never broadcasts any, and skips the
        # walk over its tree that finds them on every forward.
        self._has_buffers = next(module.buffers(), None) is not None
        self._checked_torch_apis = False
        self._launched: list[tuple[int, dist.Work]] = []  # in order, not yet waited for
        self._set_buckets(
            launch_buckets(parameters, range(count - 1, -1, -1), self._last_cap, self._bucket_bytes)
        )

    @property
    def bucket_names(self) -> tuple[tuple[str, ...], ...]:
        """The buckets as FQN tuples, in launch order."""
        return tuple(tuple(self._names[index] for index in bucket) for bucket in self._buckets)

    def _set_buckets(self, buckets: Sequence[Sequence[int]]) -> None:
        self._buckets = tuple(tuple(bucket) for bucket in buckets)
        # Per bucket, allocated at its first launch: a flat buffer (the gradients, then
        # one used-flag per parameter) and its views, one per parameter in the
        # parameter's shape and then the flags; kept across backwards, as DDP's.
        self._flats: list[Tensor] = [torch.empty(0)] * len(self._buckets)
        self._views: list[list[Tensor] | None] = [None] * len(self._buckets)
        self._bucket_of = [0] * len(self._names)
        for position, bucket in enumerate(self._buckets):
            for index in bucket:
                self._bucket_of[index] = position
        self._reset_backward()

    def _reset_backward(self) -> None:
        """Forget the backward in progress, once the collectives it started have ended.

        Collectives a failed backward launched are waited for first: every rank
        launched them, so they end; dropped, they would write into the bucket
        buffers while the next backward fills them.
        """
        for _, work in self._launched:
            # The failure that left it was already raised; one of a collective is not news.
            with contextlib.suppress(RuntimeError):
                work.wait()
        self._task = -1
        self._waiting = [len(bucket) for bucket in self._buckets]
        self._next = 0  # the next bucket to launch: buckets launch strictly in order
        self._launched = []

    # ------------------------------------------------------------ forward

    def before_forward(self, module: nn.Module) -> None:
        """Forward pre-hook body: broadcast rank 0's buffers when DDP would."""
        record = self._application.record(module)
        if record is None:
            return
        if not self._checked_torch_apis:
            _check_no_torch_api(module)
            self._checked_torch_apis = True
        if record.rank_local:
            return
        if (
            not self._has_buffers
            or not self.sync_buffers_next_forward
            or self._group.size() == 1
            or not record.broadcast_buffers
        ):
            return
        # Read the buffers anew each time, as DDP does: a forward may have replaced one.
        broadcast_from_first_rank(list(module.buffers()), self._group, self._cap_bytes)

    def after_forward(self, module: nn.Module, output: object) -> None:
        """Forward hook body: arm the outputs of a synchronizing forward.

        As DDP, a synchronizing forward whose output holds no tensor that requires
        grad arms nothing (DDP finds no parameter to wait for), yet buffers are
        broadcast before the next forward.
        """
        record = self._application.record(module)
        if record is None or record.rank_local:
            return
        synchronizing = torch.is_grad_enabled() and record.sync_gradients
        self.sync_buffers_next_forward = synchronizing
        if not synchronizing:
            return
        tensors = [tensor for tensor in find_tensors(output) if tensor.requires_grad]
        if tensors:
            armed = _Armed(self)
            for tensor in tensors:
                _torch.register_tensor_hook(tensor, armed)

    # ------------------------------------------------------------ backward

    def begin(self) -> None:
        """Synchronize the backward now running (called from an armed output's hook)."""
        task = _torch.current_graph_task_id()
        if self._task == task:
            return  # another armed output of the same backward
        if self._task != -1:
            # A synchronizing backward failed before its end: start afresh, once the
            # collectives it launched have ended.
            self._reset_backward()
        self._task = task
        _torch.queue_callback(self._finish)

    def ready(self, index: int) -> None:
        """A parameter's gradient was accumulated: mark it used; launch what is complete."""
        self._used[index] = True
        if self._task == -1 or self._task != _torch.current_graph_task_id():
            # A local backward, or a nested one (a reentrant checkpoint's): its
            # gradients are averaged with the rest at the end of the synchronizing one.
            return
        if self._arrival is not None:
            self._arrival.append(index)
        bucket = self._bucket_of[index]
        self._waiting[bucket] -= 1
        while self._next < len(self._buckets) and self._waiting[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, position: int) -> None:
        """Start averaging one bucket: every rank's ``.grad`` (or zeros) and whether it was used."""
        bucket = self._buckets[position]
        views = self._views[position]
        if views is None:
            views = self._allocate(position)
        # As DDP: multiply by the reciprocal (bit-equal averages). A small bucket whose
        # gradients are all present and dense takes one copy of them all and one
        # in-place multiply, both in C (a Python call per parameter would cost more
        # than the second pass); a large one is scaled while copied in, in one pass,
        # parameter by parameter.
        scale = 1.0 / self._group.size()
        flat = self._flats[position]
        flags = torch.tensor(
            [1.0 if self._used[index] else 0.0 for index in bucket], dtype=flat.dtype
        )
        grads = [self._parameter(index).grad for index in bucket]
        dense = [grad for grad in grads if grad is not None and not grad.is_sparse]
        small = flat.numel() * flat.element_size() <= FIRST_BUCKET_BYTES
        if small and len(dense) == len(grads):
            _torch.copy_each(views, [*dense, flags])
            flat.mul_(scale)
        else:
            self._copy_in(bucket, grads, views, scale)
            views[-1].copy_(flags.mul_(scale))
        self._launched.append((position, _torch.all_reduce(flat, self._group)))

    def _copy_in(
        self,
        bucket: Sequence[int],
        grads: Sequence[Tensor | None],
        views: Sequence[Tensor],
        scale: float,
    ) -> None:
        """Copy scaled gradients into the bucket one by one: zeros where there is none."""
        for index, grad, view in zip(bucket, grads, views, strict=False):
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                raise ContractError(
                    f"replicate: {self._names[index]!r} has a sparse gradient, which replicate "
                    "does not average; use dense gradients (e.g. nn.Embedding(sparse=False)) or "
                    "DistributedDataParallel"
                )
            else:
                torch.mul(grad, scale, out=view)

    def _allocate(self, position: int) -> list[Tensor]:
        """Make a bucket's flat buffer, kept across backwards, and its views per parameter.

        Each parameter's view has the parameter's shape, made once here rather than
        on every copy in and out.
        """
        bucket = self._buckets[position]
        parameters = [self._parameter(index) for index in bucket]
        sizes = [parameter.numel() for parameter in parameters]
        first = parameters[0]
        flat = torch.empty(sum(sizes) + len(bucket), dtype=first.dtype, device=first.device)
        self._flats[position] = flat
        pieces = torch.split(flat, [*sizes, len(bucket)])
        views = [
            piece.view(parameter.shape)
            for piece, parameter in zip(pieces[:-1], parameters, strict=True)
        ]
        views.append(pieces[-1])  # the used-flags
        self._views[position] = views
        return views

    def _parameter(self, index: int) -> Tensor:
        parameter = self._parameters[index]()
        if parameter is None:
            raise ContractError(f"replicate: parameter {self._names[index]!r} was freed")
        return parameter

    def _finish(self) -> None:
        """Run by the autograd engine at the end of a synchronizing backward."""
        rebuilt: tuple[tuple[str, ...], ...] | None = None
        try:
            while self._next < len(self._buckets):
                self._launch(self._next)
                self._next += 1
            while self._launched:
                position, work = self._launched.pop(0)
                work.wait()
                self._write_back(position)
            if self._arrival is not None:
                self._rebuild(self._arrival)
                self._arrival = None
                rebuilt = self.bucket_names
        finally:
            self._used = [False] * len(self._names)
            self._reset_backward()
        module = self._module()
        if module is not None:
            self._on_synchronized(module, rebuilt)

    def _write_back(self, position: int) -> None:
        bucket = self._buckets[position]
        views = self._views[position]
        assert views is not None
        used = _torch.to_bools(views[-1] > 0)
        grads: list[Tensor] = []
        averages: list[Tensor] = []
        for index, average, was_used in zip(bucket, views, used, strict=False):
            if not was_used:
                continue
            parameter = self._parameter(index)
            grad = parameter.grad
            if grad is None:
                parameter.grad = average.clone()
            else:
                grads.append(grad)
                averages.append(average)
        if grads:
            _torch.copy_each(grads, averages)  # one call for the whole bucket

    def _rebuild(self, arrival: list[int]) -> None:
        """Bucket anew in the first rank's arrival order (then the rest, last defined first)."""
        arrived = set(arrival)
        order = arrival + [i for i in reversed(range(len(self._names))) if i not in arrived]
        shared = torch.tensor(order, dtype=torch.int64)
        if self._group.size() > 1:
            _torch.broadcast(shared, dist.get_global_rank(self._group, 0), self._group)
        parameters = [self._parameter(index) for index in range(len(self._names))]
        self._set_buckets(
            launch_buckets(parameters, _torch.to_ints(shared), self._last_cap, self._bucket_bytes)
        )


def _check_no_torch_api(root: nn.Module) -> None:
    """Refuse torch's ``replicate``/``fully_shard`` applied on or inside ``root`` after ours.

    Torch's contract cannot see our rules, so it allowed them; the first forward is
    the first moment to say so (torch's ``fully_shard`` has replaced the parameters
    by then, and torch's ``replicate`` would average the gradients a second time).
    """
    for fqn, module in named_tree(root):
        for name in ("fully_shard", "replicate"):
            if name in torch_registry(module):
                where = "on it" if not fqn else f"on {type(module).__qualname__} {fqn!r} inside it"
                raise IncompatibleAPIError(
                    f"torchcontract.apis.replicate.replicate on {module_label(root)} cannot be "
                    f"combined with torch's {name}, applied after it {where} (found at the "
                    "first forward); apply only one of them to this part of the model"
                )


class _Armed:
    """Hook on the outputs of one synchronizing forward: the first backward through them syncs."""

    __slots__ = ("_reducer", "_used")

    def __init__(self, reducer: Reducer) -> None:
        self._reducer = reducer
        self._used = False

    def __call__(self, grad: Tensor) -> None:
        if not self._used:
            self._used = True
            self._reducer.begin()


class ParameterHook:
    """The post-accumulate-grad hook of one parameter: tells the reducer it is ready."""

    __slots__ = ("_index", "_reducer")

    def __init__(self, reducer: Reducer, index: int) -> None:
        self._reducer = reducer
        self._index = index

    def __call__(self, parameter: Tensor) -> None:
        self._reducer.ready(self._index)
