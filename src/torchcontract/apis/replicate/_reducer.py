"""The reducer: which backward synchronizes, and the averaging of gradients in buckets.

Semantics are those of ``DistributedDataParallel``, keyword for keyword:

* Whether a backward synchronizes is decided by the forward that built its
  graph: a forward of the replicated module with grad enabled and
  ``sync_gradients`` on (outside ``rank_local``) arms the tensors of its output
  that require grad, wherever DDP would find them, and the first backward that
  reaches one of them synchronizes, once. Any other backward (inside ``no_sync``, a
  second one through a retained graph, one that never went through the module's
  forward) only accumulates locally and issues no collective, so it cannot hang.
* With ``find_unused_parameters`` (or ``static_graph``), a parameter counts as
  used if its gradient was accumulated in any backward since the last
  synchronization (``no_sync`` steps included). At the end of a synchronizing
  backward, every parameter used on some rank gets the mean over ranks of
  ``.grad``: what it holds now, earlier accumulation included, or zeros where it
  has none. A parameter no rank used keeps its ``.grad`` untouched. Without
  either, every parameter must get a gradient in every synchronizing backward:
  where one did not, no gradient is averaged and the next forward raises DDP's
  error (``UnusedParameterError``).
* Buckets are all-reduced asynchronously, strictly in order, each as soon as all
  of its parameters' gradients arrived in this backward; the rest at the end.
  They are DDP's in every backward, hook or not: first assigned by DDP's rule
  (``assign_buckets_as_ddp`` over the parameters in definition order, launched
  last first; one bucket per kind with ``find_unused_parameters=False`` or
  ``static_graph``), then, with either of those only, rebuilt once in the order
  gradients arrived on the first rank: after the first synchronizing backward,
  or the second with ``static_graph``, as DDP's.
* Without a hook, each bucket also carries the used-flags of its parameters
  (with ``find_unused_parameters``), so whether a parameter was used travels
  with its gradients. With a communication hook (``register_comm_hook``) each
  bucket's buffer holds the gradients alone, undivided, and the hook reduces
  it; whether a parameter was used is then all-reduced once per backward, after
  the buckets, as DDP does.
* Under ``torch.distributed.algorithms.Join`` (``join.py``), a rank whose inputs
  ran out shadows the others' collectives (``shadow``) with zeros.

The reducer holds the module and its parameters weakly: the hooks and the
module's class methods (through ``reducer_of``) hold the reducer, and dropping
the model frees it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Final, cast

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.join import Join, Joinable, _JoinConfig

from torchcontract import (
    Application,
    ContractError,
    IncompatibleAPIError,
    UnusedParameterError,
    module_label,
    named_tree,
    torch_registry,
)

from .. import _torch
from ._buckets import FIRST_BUCKET_BYTES, assign_buckets_as_ddp, broadcast_from
from ._comm_hook import Bucket, CommHook
from ._outputs import find_tensors
from ._state import ReplicateState

__all__ = ["Reducer", "reducer_of"]

#: Called at the end of each synchronized backward, with the new buckets once rebuilt.
OnSynchronized = Callable[[nn.Module, tuple[tuple[str, ...], ...] | None], None]
#: ``replicate.update``: apply a transition to the module's record.
Update = Callable[[nn.Module, Callable[[ReplicateState], ReplicateState]], ReplicateState]

#: A launched bucket: an all-reduce in place, or the future a communication hook returned.
_Pending = tuple[int, "dist.Work | torch.futures.Future[Tensor]"]

_REDUCERS: weakref.WeakKeyDictionary[nn.Module, Reducer] = weakref.WeakKeyDictionary()


def reducer_of(module: nn.Module) -> Reducer | None:
    """The reducer of ``module``'s live ``replicate`` application, or None."""
    reducer = _REDUCERS.get(module)
    if reducer is None or reducer.record(module) is None:
        return None
    return reducer


class Reducer:
    """Runtime bookkeeping of one ``replicate`` application; held only by its hooks."""

    def __init__(
        self,
        module: nn.Module,
        application: Application[ReplicateState],
        *,
        group: dist.ProcessGroup,
        named: Sequence[tuple[str, nn.Parameter]],
        cap_bytes: int,
        default_cap: bool,
        find_unused: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        cap_list: Sequence[int] = (),
        on_synchronized: OnSynchronized,
        update: Update,
    ) -> None:
        self._module = weakref.ref(module)
        self._application = application
        self._group = group
        self._names = tuple(name for name, _ in named)
        self._parameters = tuple(weakref.ref(parameter) for _, parameter in named)
        self._cap_bytes = cap_bytes
        self._default_cap = default_cap
        self._cap_list = tuple(cap_list)  # DDP's bucket_cap_mb_list, in bytes
        # Whether parameters may go unused: DDP's find_unused_parameters, or a static
        # graph (whose unused parameters DDP finds in its first iteration). Without
        # either no used-flags are kept, and every parameter must take part in every
        # synchronized backward.
        self._tracks_used = find_unused or static_graph
        #: DDP's gradient_as_bucket_view: ``.grad`` left as a view into the bucket buffer.
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # DDP's should_rebuild_buckets: once, and only with a static graph or without
        # unused parameters found; then from the arrival order of the first
        # synchronized backward, or of the second with a static graph (whose first
        # DDP reduces all at once, at its end).
        self._static_graph = static_graph
        self._rebuilds = static_graph or not find_unused
        self._backwards_before_rebuild = 1 if static_graph else 0
        self.update: Final = update
        self._comm_hook: tuple[object, CommHook] | None = None
        # Join (see join.py): the config torch's Join sets on the module, whether
        # to divide by the group's size or by the ranks not joined, and this
        # forward's count of those (an all-reduce Join started).
        self.join_config: _JoinConfig = _torch.disabled_join_config()
        self.divide_by_initial_world_size = True
        self._active_ranks: dist.Work | None = None
        parameters = [parameter for _, parameter in named]
        self._on_synchronized = on_synchronized
        count = len(named)
        self._used = [False] * count  # accumulated into since the last synchronization
        # The arrival order of this synchronized backward, while the buckets are still to
        # be rebuilt; None once rebuilt, or where DDP never rebuilds them.
        self._arrival: list[int] | None = [] if self._rebuilds else None
        # Set by a synchronized backward in which some parameters got no gradient (without
        # unused parameters found): the error the next forward raises, as DDP's.
        self._unfinished: UnusedParameterError | None = None
        self._task = -1  # the autograd graph task that synchronizes, or -1
        # DDP's require_forward_param_sync: buffers are broadcast before a forward
        # that follows a synchronizing one (and before the first).
        self.sync_buffers_next_forward = True
        # As DDP: a module without buffers at apply never broadcasts any, and skips the
        # walk over its tree that finds them on every forward.
        self._has_buffers = next(module.buffers(), None) is not None
        self._checked_torch_apis = False
        self._launched: list[_Pending] = []  # in order, not yet waited for
        # DDP's first assignment: in the parameters' order, launched last first.
        buckets = assign_buckets_as_ddp(parameters, range(count), self._first_limits())
        buckets.sort(key=min, reverse=True)
        self._set_buckets(buckets)
        _REDUCERS[module] = self

    @property
    def group(self) -> dist.ProcessGroup:
        """The group gradients are averaged over."""
        return self._group

    def _where(self) -> str:
        """How errors name this application: ``replicate on <class> '<fqn>'``."""
        module = self._module()
        return "replicate" if module is None else f"replicate on {module_label(module)}"

    def record(self, module: nn.Module) -> ReplicateState | None:
        """``module``'s record if this reducer's application installed it, else None."""
        return self._application.record(module)

    def forget(self, module: nn.Module) -> None:
        """``reducer_of(module)`` answers None from now on (a rolled-back apply)."""
        if _REDUCERS.get(module) is self:
            del _REDUCERS[module]

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
        if self.gradient_as_bucket_view:
            self._move_gradients_into_buckets()

    def _move_gradients_into_buckets(self) -> None:
        """``gradient_as_bucket_view``: each ``.grad`` present becomes a view of its new bucket.

        As DDP's, when buckets are made or remade (a rebuild, a hook): the gradients
        are copied into the new buffers, so the old ones are freed now rather than
        held, beside the new, until the next synchronized backward ends.
        """
        for position, bucket in enumerate(self._buckets):
            grads = [self._parameter(index).grad for index in bucket]
            if all(grad is None or grad.is_sparse for grad in grads):
                continue
            views = self._allocate(position)
            for index, grad, view in zip(bucket, grads, views, strict=False):
                if grad is not None and not grad.is_sparse:
                    view.copy_(grad)
                    self._parameter(index).grad = view

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
        self._arrived = [False] * len(self._names)  # in the synchronized backward running
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
        if self._unfinished is not None and torch.is_grad_enabled():
            # DDP's check, at the same moment: before any forward with grad enabled.
            raise self._unfinished
        # Under Join, tell the joined ranks this one has not joined (the sum is the
        # count of ranks not joined); None outside Join.
        self._active_ranks = Join.notify_join_context(cast(Joinable, module))
        if self._will_broadcast_buffers(record):
            # Under Join rank 0 may have joined, its buffers stale: as DDP, the last
            # rank not joined is the source.
            source = self._common_rank(True) if self.join_config.enable else 0
            self._broadcast_buffers(module, source)

    def _will_broadcast_buffers(self, record: ReplicateState) -> bool:
        return (
            self._has_buffers
            and self.sync_buffers_next_forward
            and self._group.size() > 1
            and record.broadcast_buffers
        )

    def _broadcast_buffers(self, module: nn.Module, source: int) -> None:
        # Read the buffers anew each time, as DDP does: a forward may have replaced one.
        broadcast_from(list(module.buffers()), self._group, self._cap_bytes, source)

    def _common_rank(self, candidate: bool) -> int:
        """The largest group rank of those for which ``candidate`` holds (a collective)."""
        rank = torch.tensor([self._group.rank() if candidate else -1], dtype=torch.int64)
        _torch.all_reduce_max(rank, self._group)
        found = int(rank.item())
        if found < 0:
            raise ContractError(
                f"{self._where()}: no rank of the group offered itself as the source of the "
                "broadcast; every rank must enter Join with the model"
            )
        return found

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
        tensors = (
            [tensor for tensor in find_tensors(output) if tensor.requires_grad]
            if synchronizing
            else []
        )
        if self.join_config.enable:
            # Tell the joined ranks whether buffers are broadcast before the next
            # forward, and whether a synchronizing backward follows (see shadow).
            _torch.all_reduce(
                torch.tensor([float(synchronizing), float(bool(tensors))]), self._group
            ).wait()
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
        self._arrived[index] = True
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
        flat = self._flats[position]
        grads = [self._parameter(index).grad for index in bucket]
        if not self._flags_in_buckets:
            # Without flags; with a hook, undivided (it reduces and divides, as with DDP).
            if self._comm_hook is None:
                self._copy_in(bucket, grads, views, 1.0 / self._divisor())
                self._launched.append((position, _torch.all_reduce(flat, self._group)))
                return
            self._copy_in(bucket, grads, views, 1.0)
            self._launched.append((position, self._run_comm_hook(position, flat, views[:-1])))
            return
        # As DDP: multiply by the reciprocal (bit-equal averages). A small bucket whose
        # gradients are all present and dense takes one copy of them all and one
        # in-place multiply, both in C (a Python call per parameter would cost more
        # than the second pass); a large one is scaled while copied in, in one pass,
        # parameter by parameter.
        scale = 1.0 / self._divisor()
        flags = torch.tensor(
            [1.0 if self._used[index] else 0.0 for index in bucket], dtype=flat.dtype
        )
        dense = [grad for grad in grads if grad is not None and not grad.is_sparse]
        small = flat.numel() * flat.element_size() <= FIRST_BUCKET_BYTES
        if small and len(dense) == len(grads):
            _torch.copy_each(views, [*dense, flags])
            flat.mul_(scale)
        else:
            self._copy_in(bucket, grads, views, scale)
            views[-1].copy_(flags.mul_(scale))
        self._launched.append((position, _torch.all_reduce(flat, self._group)))

    def _divisor(self) -> int:
        """What the sums are divided by: the group's size, or (Join) the ranks not joined."""
        work = self._active_ranks
        if work is None or self.divide_by_initial_world_size:
            return self._group.size()
        work.wait()
        return int(_torch.work_tensor(work).item())

    def _run_comm_hook(
        self, position: int, flat: Tensor, gradients: Sequence[Tensor]
    ) -> torch.futures.Future[Tensor]:
        assert self._comm_hook is not None
        state, hook = self._comm_hook
        parameters = [self._parameter(index) for index in self._buckets[position]]
        index, last = position, position == len(self._buckets) - 1
        if self._static_graph and self._backwards_before_rebuild > 0:
            # DDP reduces a static graph's first synchronized backward all at its end
            # (delay_all_reduce), handing its hook every bucket as index 0, and as the
            # last only where it is the only one; a hook that counts steps by is_last
            # (PowerSGD) counts as DDP's.
            index, last = 0, len(self._buckets) == 1
        given = Bucket(index, flat, gradients, parameters, is_last=last)
        return hook(state, cast(GradBucket, given))  # it answers GradBucket's methods

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
                    f"{self._where()}: parameter {self._names[index]!r} has a sparse gradient, "
                    "which replicate does not average; use dense gradients (e.g. "
                    "nn.Embedding(sparse=False)) or DistributedDataParallel"
                )
            else:
                torch.mul(grad, scale, out=view)

    def _allocate(self, position: int) -> list[Tensor]:
        """Make a bucket's flat buffer, kept across backwards, and its views per parameter.

        Each parameter's view has the parameter's shape, made once here rather than
        on every copy in and out.
        """
        bucket = self._buckets[position]
        first = self._parameter(bucket[0])
        size = sum(self._parameter(index).numel() for index in bucket)
        flags = len(bucket) if self._flags_in_buckets else 0
        flat = torch.empty(size + flags, dtype=first.dtype, device=first.device)
        self._flats[position] = flat
        views = self._split(position, flat)
        self._views[position] = views
        return views

    def _split(self, position: int, flat: Tensor) -> list[Tensor]:
        """Views of a bucket-sized ``flat``, one per parameter in its shape, then the rest.

        The rest is the used-flags, empty with a communication hook.
        """
        parameters = [self._parameter(index) for index in self._buckets[position]]
        sizes = [parameter.numel() for parameter in parameters]
        pieces = torch.split(flat, [*sizes, flat.numel() - sum(sizes)])
        views = [
            piece.view(parameter.shape)
            for piece, parameter in zip(pieces[:-1], parameters, strict=True)
        ]
        views.append(pieces[-1])
        return views

    def _parameter(self, index: int) -> Tensor:
        parameter = self._parameters[index]()
        if parameter is None:
            raise ContractError(
                f"{self._where()}: parameter {self._names[index]!r} was freed; keep the model's "
                "parameters in it while it is replicated"
            )
        return parameter

    def _finish(self) -> None:
        """Run by the autograd engine at the end of a synchronizing backward."""
        rebuilt: tuple[tuple[str, ...], ...] | None = None
        try:
            self._unfinished = self._unused_error()
            if self._unfinished is not None:
                # As DDP's: the buckets from the first incomplete one on are never
                # launched, no gradient is averaged, and the next forward raises.
                self._wait_launched()
                return
            while self._next < len(self._buckets):
                self._launch(self._next)
                self._next += 1
            results = self._wait_launched()
            used = self._used_everywhere(results)
            for position, averages in results:
                self._write_back(position, averages, used)
            if self._arrival is not None and self._rebuild_after(self._arrival):
                rebuilt = self.bucket_names
        finally:
            self._used = [False] * len(self._names)
            self._reset_backward()
        module = self._module()
        if module is not None:
            self._on_synchronized(module, rebuilt)

    def _wait_launched(self) -> list[tuple[int, Tensor]]:
        """Wait for every launched bucket, in order; each one's reduced flat buffer."""
        results: list[tuple[int, Tensor]] = []
        while self._launched:
            position, pending = self._launched.pop(0)
            if isinstance(pending, dist.Work):
                pending.wait()
                results.append((position, self._flats[position]))
            else:
                results.append((position, self._hook_result(position, pending.wait())))
        return results

    def _hook_result(self, position: int, result: object) -> Tensor:
        flat = self._flats[position]
        if not isinstance(result, Tensor) or result.numel() != flat.numel():
            given = (
                f"a tensor of {result.numel()} elements"
                if isinstance(result, Tensor)
                else type(result).__qualname__
            )
            raise ContractError(
                f"{self._where()}: the communication hook's future for bucket {position} gave "
                f"{given}, not a tensor of the bucket buffer's {flat.numel()} elements; return "
                "a future of the reduced bucket.buffer()"
            )
        return result

    @property
    def _flags_in_buckets(self) -> bool:
        """Whether each bucket ends with the used-flags of its parameters."""
        return self._tracks_used and self._comm_hook is None

    def _unused_error(self) -> UnusedParameterError | None:
        """Without unused parameters found: DDP's error if a parameter got no gradient.

        DDP's text first (code that matches it keeps matching), then the parameters
        by name and what to do; raised by the next forward with grad enabled.
        """
        if self._tracks_used:
            return None
        missing = [
            name for name, arrived in zip(self._names, self._arrived, strict=True) if not arrived
        ]
        if not missing:
            return None
        ddp = (
            "Expected to have finished reduction in the prior iteration before starting a "
            "new one. This error indicates that your module has parameters that were not "
            "used in producing loss: "
        )
        if len(missing) == len(self._names):
            # Not one gradient accumulated: the backward computed them without accumulating
            # (torch.autograd.grad, backward(inputs=...), a pipeline schedule that splits
            # the backward into its input and weight parts).
            return UnusedParameterError(
                f"{ddp}{self._where()} got no gradient at all in the last synchronizing "
                "backward through its outputs: gradients that torch.autograd.grad, "
                "backward(inputs=...) or a zero-bubble pipeline schedule compute are not "
                "accumulated, so replicate cannot average them; run such forwards under "
                "no_sync(module) or rank_local(module), or call loss.backward()"
            )
        shown = ", ".join(repr(name) for name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        return UnusedParameterError(
            f"{ddp}{self._where()} got no gradient for {shown}{more} in the last "
            "synchronizing backward; pass find_unused_parameters=True to replicate, or make "
            "every parameter take part in the loss"
        )

    def _used_everywhere(self, results: list[tuple[int, Tensor]]) -> list[bool]:
        """By parameter, whether some rank used it since the last synchronization.

        Without a hook the flags travelled in the buckets; with one, they are
        all-reduced now, once, as DDP's map of locally used parameters.
        """
        if not self._tracks_used:
            return [True] * len(self._names)
        used = [False] * len(self._names)
        if self._flags_in_buckets:
            for position, flat in results:
                bucket = self._buckets[position]
                flags = _torch.to_bools(flat[flat.numel() - len(bucket) :] > 0)
                for index, flag in zip(bucket, flags, strict=True):
                    used[index] = flag
            return used
        local = torch.tensor([1 if was else 0 for was in self._used], dtype=torch.int32)
        if self._group.size() > 1:
            _torch.all_reduce(local, self._group).wait()
        return _torch.to_bools(local > 0)

    def _write_back(self, position: int, reduced: Tensor, used: Sequence[bool]) -> None:
        bucket = self._buckets[position]
        views = self._views[position]
        if self.gradient_as_bucket_view and views is not None:
            self._point_into_bucket(position, reduced, views, used)
            return
        if views is None or reduced is not self._flats[position]:
            views = self._split(position, reduced)  # a hook's own tensor
        grads: list[Tensor] = []
        averages: list[Tensor] = []
        for index, average in zip(bucket, views, strict=False):
            if not used[index]:
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

    def _point_into_bucket(
        self, position: int, reduced: Tensor, views: Sequence[Tensor], used: Sequence[bool]
    ) -> None:
        """``gradient_as_bucket_view``: each used parameter's ``.grad`` becomes its bucket view.

        As DDP's: the averages stay in the bucket buffer (a hook's own tensor is
        copied in first) and ``.grad`` is a view of it, so no gradient-sized
        tensor is kept besides the buckets; the next backward accumulates into
        the view in place, and the next launch scales it where it lies.
        """
        flat = self._flats[position]
        if reduced is not flat:
            flat[: reduced.numel()].copy_(reduced)
        for index, view in zip(self._buckets[position], views, strict=False):
            if not used[index]:
                continue
            parameter = self._parameter(index)
            if parameter.grad is not view:
                parameter.grad = view

    # ------------------------------------------------------------ hooks and Join

    def _first_limits(self) -> tuple[int, ...]:
        """DDP's caps for the first assignment (``compute_bucket_size_limits``).

        The list given; else one bucket per kind where DDP rebuilds them later (it
        cannot know the order gradients arrive in); else the rebuild's caps.
        """
        if self._cap_list:
            return self._cap_list
        if self._rebuilds:
            return (sys.maxsize,)
        return self._limits()

    def _limits(self) -> tuple[int, ...]:
        """DDP's bucket caps: the list given, or 1 MiB then the cap (the default cap only)."""
        if self._cap_list:
            return self._cap_list
        if self._default_cap:
            return (FIRST_BUCKET_BYTES, self._cap_bytes)
        return (self._cap_bytes,)

    def register_comm_hook(self, module: nn.Module, state: object, hook: CommHook) -> None:
        """From the next backward, ``hook(state, bucket)`` reduces each bucket (checked first).

        The buckets are DDP's already and stay as they are, as DDP's do; their
        buffers are made anew, without the used-flags, which a hook never sees.
        """
        if self._comm_hook is not None:
            raise ContractError(
                f"replicate on {module_label(module)}: register_comm_hook can only be called "
                "once (as DistributedDataParallel's); register one hook that does both"
            )
        if self._task != -1:
            raise ContractError(
                f"replicate on {module_label(module)}: register_comm_hook during a backward; "
                "register it between backwards (before training, or after a step)"
            )
        self._comm_hook = (state, hook)
        self._set_buckets(self._buckets)

    def shadow(self, module: nn.Module) -> None:
        """On a rank whose inputs ran out, meet one forward and backward of the others.

        Called by the Join hook once per iteration of the ranks not joined: the
        buffer broadcast (from the last rank not joined), whether a synchronizing
        backward follows, and then its all-reduces with zeros, in the buckets' order,
        through the communication hook if one is registered.
        """
        record = self.record(module)
        if record is None:
            return
        if self._will_broadcast_buffers(record):
            self._broadcast_buffers(module, self._common_rank(False))
        flags = torch.zeros(2)
        _torch.all_reduce(flags, self._group).wait()
        self.sync_buffers_next_forward = bool(flags[0] > 0)
        if not bool(flags[1] > 0):
            return
        for position in range(len(self._buckets)):
            if self._views[position] is None:
                self._allocate(position)
            # Zeros of their own, as DDP's: with gradient_as_bucket_view this rank's
            # gradients live in the bucket buffers, and stay as they are.
            flat = torch.zeros_like(self._flats[position])
            pending: dist.Work | torch.futures.Future[Tensor]
            if self._comm_hook is not None:
                pending = self._run_comm_hook(position, flat, self._split(position, flat)[:-1])
            else:
                pending = _torch.all_reduce(flat, self._group)
            self._launched.append((position, pending))
        try:
            results = self._wait_launched()
            if self._comm_hook is not None and self._tracks_used:
                saved, self._used = self._used, [False] * len(self._names)
                try:
                    self._used_everywhere(results)
                finally:
                    self._used = saved
            # As DDP's joined rank, which counts every parameter as arrived in definition
            # order: where it is the first rank, the rebuild takes that.
            if self._arrival is not None and self._rebuild_after(list(range(len(self._names)))):
                self.update(module, lambda record: attrs.evolve(record, buckets=self.bucket_names))
        finally:
            self._reset_backward()

    def sync_final_model(self, module: nn.Module, is_last_joiner: bool) -> None:
        """After Join: every rank takes the parameters (and buffers) of the last rank to join."""
        record = self.record(module)
        if record is None:
            return
        source = self._common_rank(is_last_joiner)
        tensors: list[Tensor] = [*module.parameters()]
        if record.broadcast_buffers:
            tensors.extend(module.buffers())
        broadcast_from(tensors, self._group, self._cap_bytes, source)

    def _rebuild_after(self, arrival: list[int]) -> bool:
        """End of a synchronized backward, buckets still to rebuild: rebuild now, or not yet.

        True if rebuilt. A static graph's first synchronized backward only counts.
        """
        if self._backwards_before_rebuild > 0:
            self._backwards_before_rebuild -= 1
            self._arrival = []
            return False
        self._rebuild(arrival)
        self._arrival = None
        return True

    def _rebuild(self, arrival: list[int]) -> None:
        """DDP's rebuild: bucket anew in the first rank's arrival order, with DDP's caps.

        Parameters that did not arrive (a static graph's unused ones) come last, the
        last defined first.
        """
        arrived = set(arrival)
        order = arrival + [i for i in reversed(range(len(self._names))) if i not in arrived]
        shared = torch.tensor(order, dtype=torch.int64)  # the first rank's, on every rank
        if self._group.size() > 1:
            _torch.broadcast(shared, 0, self._group)
        parameters = [self._parameter(index) for index in range(len(self._names))]
        self._set_buckets(assign_buckets_as_ddp(parameters, _torch.to_ints(shared), self._limits()))


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
