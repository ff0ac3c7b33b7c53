"""The reducer: which backward synchronizes, and the averaging of gradients in buckets.

Semantics are those of ``DistributedDataParallel``, keyword for keyword:

* Which backward synchronizes is DDP's: after a forward of the replicated module
  with grad enabled and ``sync_gradients`` on, the first backward that accumulates a
  parameter's gradient, once. It begins where it reaches the tensors of that forward's
  output that require grad (armed, found wherever DDP finds them) or at its first
  gradient (``ready``); one through the outputs that accumulates nothing
  (``torch.autograd.grad``) turns out not to be it, and the forward still expects one.
  Any other backward (after that one until the next such forward, or of a
  ``rank_local`` forward) only accumulates locally and issues no collective, so it
  cannot hang. A ``no_sync`` forward leaves an earlier forward's backward expected,
  as DDP's does.
* With ``find_unused_parameters`` (or ``static_graph``), a parameter counts as
  used if its gradient was accumulated in any backward since the last
  synchronization (``no_sync`` steps included). At the end of a synchronizing
  backward, every parameter used on some rank gets the mean over ranks of
  ``.grad``: what it holds now, earlier accumulation included, or zeros where it
  has none. A parameter no rank used keeps its ``.grad`` untouched. Without
  either, every parameter must get a gradient in every synchronizing backward:
  where one did not, no gradient is averaged and the next forward raises DDP's
  error (``UnusedParameterError``).
* With ``find_unused_parameters``, the map of parameters used on this rank is
  all-reduced once per synchronizing backward, after the buckets, and read back
  only where this rank left one unused, as DDP's.
* With ``static_graph``, as DDP's: the first synchronizing backward is reduced all
  at its end, the map of used parameters all-reduced first, and what it found is
  fixed (``StaticGraph``): later ones send no map and read nothing back; the
  parameters it left unused on this rank are ready from their start, and one that
  gets a gradient raises DDP's error in that backward (``GraphChangedError``), one
  the first gave a gradient and this one did not at the next forward
  (``UnusedParameterError``).
* A synchronizing backward that raised after gradients began to arrive (a static
  graph's first aside, which sends nothing before its end) leaves this rank's
  collectives possibly out of step with the others': every later forward with grad
  enabled raises DDP's error (``UnfinishedBackwardError``), as DDP's. One that raised
  before any arrived leaves no trace.
* Buckets are all-reduced asynchronously, strictly in order, each as soon as all
  of its parameters' gradients arrived in this backward; the rest at the end.
  They are DDP's in every backward, hook or not: first assigned by DDP's rule
  (``assign_buckets_as_ddp`` over the parameters in definition order, launched
  last first; one bucket per kind with ``find_unused_parameters=False`` or
  ``static_graph``), then, with either of those only, rebuilt once in the order
  gradients arrived (after the first synchronizing backward, or the second with
  ``static_graph``) at the next forward with grad enabled, the first rank's
  buckets broadcast to the others (``rebuild_if_due``), as DDP's.
* A bucket's buffer holds its gradients alone, divided by the group's size, or
  undivided for a communication hook (``register_comm_hook``), which reduces it.
* Under ``torch.distributed.algorithms.Join`` (``_join``), a rank whose inputs
  ran out meets the others' collectives with zeros (``shadow_backward``).

Beside it: the forward's side, buffers and armed outputs (``_forward``), the bucket
buffers and their views (``_bucket_views``), DDP's caps and the rebuild
(``_rebuild``), unused-parameter tracking (``_unused``), a communication hook's
result (``_comm_hook``), and the autograd hooks that call the reducer
(``_autograd_hooks``). The reducer holds the module and its parameters weakly: the hooks and the
module's class methods (through ``reducer_of``) hold the reducer, and dropping
the model frees it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Final, cast

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.join import _JoinConfig
from torch.utils.hooks import RemovableHandle

from torchcontract import (
    Application,
    ContractError,
    UnusedParameterError,
    module_label,
)

from .. import _torch
from .._let_go import Collective
from ._bucket_views import copy_in, new_buffer, point_into_bucket, split, write_back
from ._buckets import assign_buckets_as_ddp
from ._comm_hook import Bucket, CommHook, hook_result
from ._ignored import kept_buffers
from ._in_backward import step as step_in_backward
from ._in_backward import take_over as take_over_in_backward
from ._rebuild import first_limits, first_ranks_buckets, limits
from ._state import ReplicateState
from ._unused import (
    StaticGraph,
    graph_changed_error,
    late_gradient_error,
    start_used_map,
    static_unused_error,
    unfinished_backward_error,
    unused_error,
    used_on_some_rank,
)

__all__ = ["Reducer", "reducer_of"]

#: Called at the end of each synchronized backward.
OnSynchronized = Callable[[nn.Module], None]
#: ``replicate.update``: apply a transition to the module's record.
Update = Callable[[nn.Module, Callable[[ReplicateState], ReplicateState]], ReplicateState]

#: A launched bucket: an all-reduce in place, or the future a communication hook returned.
_Pending = tuple[int, "Collective | torch.futures.Future[Tensor]"]

#: A bucket whose gradients average at most this many bytes is scaled in one pass over
#: the whole bucket: below it, a Python call per gradient costs more than the pass.
SMALL_GRADIENT_BYTES: Final = 16 * 1024

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
        ignored: frozenset[str] = frozenset(),
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
        #: Where its own tensors for collectives live: the first parameter's device, as
        #: DDP's ``device`` (an NCCL group takes tensors on the GPU only).
        self.device = named[0][1].device if named else torch.device("cpu")
        self._names = tuple(name for name, _ in named)
        self._parameters = tuple(weakref.ref(parameter) for _, parameter in named)
        self._cap_bytes = cap_bytes
        self._default_cap = default_cap
        self._cap_list = tuple(cap_list)  # DDP's bucket_cap_mb_list, in bytes
        # Whether parameters may go unused: DDP's find_unused_parameters, or a static
        # graph (whose unused parameters DDP finds in its first iteration). Without
        # either no map of used parameters is kept, and every parameter must take part
        # in every synchronized backward.
        self._tracks_used = find_unused or static_graph
        #: DDP's gradient_as_bucket_view: ``.grad`` left as a view into the bucket buffer.
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # DDP's should_rebuild_buckets: once, and only with a static graph or without
        # unused parameters found; then from the arrival order of the first
        # synchronized backward, or of the second with a static graph (whose first
        # DDP reduces all at once, at its end), at the next forward with grad enabled.
        self._static_graph = static_graph
        #: A static graph's, once its first synchronizing backward ended: which parameters
        #: arrive and which some rank used, from then on. None before, and without one.
        self._settled: StaticGraph | None = None
        self._rebuilds = static_graph or not find_unused
        self._backwards_before_rebuild = 1 if static_graph else 0
        self.update: Final = update
        self._comm_hook: tuple[object, CommHook] | None = None
        # Join (see _join): the config torch's Join sets on the module, whether
        # to divide by the group's size or by the ranks not joined, and this
        # forward's count of those (an all-reduce Join started).
        self.join_config: _JoinConfig = _torch.disabled_join_config()
        self.divide_by_initial_world_size = True
        self.active_ranks: dist.Work | None = None
        parameters = [parameter for _, parameter in named]
        self._on_synchronized = on_synchronized
        count = len(named)
        self._used = [False] * count  # accumulated into since the last synchronization
        self._sent_used = [False] * count  # the last map of used parameters all-reduced
        # The arrival order of this synchronized backward, while the buckets are still to
        # be rebuilt; None once known, or where DDP never rebuilds them.
        self._arrival: list[int] | None = [] if self._rebuilds else None
        # The arrival order the buckets are rebuilt from at the next forward with grad
        # enabled (``rebuild_if_due``); None until it is known, and once rebuilt.
        self._rebuild_from: list[int] | None = None
        # Set by a synchronized backward in which some parameters got no gradient (without
        # unused parameters found), or found to have raised midway: the error every
        # later forward with grad enabled raises, as DDP's.
        self.unfinished: ContractError | None = None
        self._task = -1  # the autograd graph task that synchronizes, or -1
        # Hooks on the nodes that ran a nested backward which began synchronizing: each
        # carries the synchronization on into the backward around it (``_finish``).
        self._resume_hooks: list[RemovableHandle] = []
        # The last synchronizing forward, by number, while no backward synchronized for it
        # (None once one began): as DDP's expect_autograd_hooks_, the next backward that
        # reaches its outputs or accumulates a gradient synchronizes.
        self._forwards = 0
        self._expecting: int | None = None
        # Forwards up to this number have had their synchronizing backward (a later one
        # of theirs is local); the one whose armed output began the backward running.
        self._synced_through = self._synced_before = 0
        self._begun_by: int | None = None
        # The last synchronizing backward through a forward's outputs accumulated nothing
        # (torch.autograd.grad): that forward's backward is still expected.
        self._empty_backward = False
        # DDP's require_forward_param_sync: buffers are broadcast before a forward
        # that follows a synchronizing one (and before the first).
        self.sync_buffers_next_forward = True
        #: Each parameter's gradient accumulator and the handle of its hook, kept: a hook
        #: on an accumulator nobody holds would be lost with it (DDP keeps them too).
        self.accumulators: list[tuple[object, RemovableHandle]] = []
        #: The positions of parameters with optimizers applied in backward (``_in_backward``),
        #: taken over at the first forward, as DDP's lazy init takes them.
        self.in_backward: tuple[int, ...] = ()
        self.took_over_in_backward = False
        #: DDP's parameters and buffers to ignore (``_ignored``): never broadcast.
        self.ignored = ignored
        # As DDP: a module without buffers at apply never broadcasts any, and skips the
        # walk over its tree that finds them on every forward.
        self.has_buffers = bool(kept_buffers(module, ignored))
        # Whether a forward checked that torch's own APIs came not after ours (_forward).
        self.checked_torch_apis = False
        self._launched: list[_Pending] = []  # in order, not yet waited for
        # DDP's first assignment: in the parameters' order, launched last first.
        buckets = assign_buckets_as_ddp(parameters, None, self._first_limits())
        buckets.sort(key=min, reverse=True)
        self._set_buckets(buckets)
        _REDUCERS[module] = self

    @property
    def group(self) -> dist.ProcessGroup:
        """The group gradients are averaged over."""
        return self._group

    def where(self) -> str:
        """How errors name this application: ``replicate on <class> '<fqn>'``."""
        module = self._module()
        return "replicate" if module is None else f"replicate on {module_label(module)}"

    def record(self, module: nn.Module) -> ReplicateState | None:
        """``module``'s record if this reducer's application installed it, else None."""
        return self._application.record(module)

    def forget(self, module: nn.Module) -> None:
        """``reducer_of(module)`` answers None from now on (a rolled-back apply); unhooked."""
        if _REDUCERS.get(module) is self:
            del _REDUCERS[module]
        for _, handle in self.accumulators:
            handle.remove()
        self.accumulators.clear()

    @property
    def bucket_names(self) -> tuple[tuple[str, ...], ...]:
        """The buckets as FQN tuples, in launch order."""
        return tuple(tuple(self._names[index] for index in bucket) for bucket in self._buckets)

    def _set_buckets(self, buckets: Sequence[Sequence[int]]) -> None:
        self._buckets = tuple(tuple(bucket) for bucket in buckets)
        self._count_due()
        # Per bucket, allocated at its first launch: a flat buffer of its gradients and
        # its views, one per parameter in the parameter's shape; kept across backwards,
        # as DDP's.
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
            for index, grad, view in zip(bucket, grads, views, strict=True):
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
        for hook in self._resume_hooks:
            hook.remove()
        self._resume_hooks = []
        self._waiting = list(self._due)
        # Per parameter, how often its gradient was accumulated in the synchronizing
        # backward running, nested backwards (a reentrant checkpoint's) included.
        self._hooks = [0] * len(self._names)
        if self._arrival is not None:
            self._arrival = []
        self._next = 0  # the next bucket to launch: buckets launch strictly in order
        self._launched = []
        self._active_count: int | None = None  # Join: the ranks not joined, once read

    def _count_due(self) -> None:
        """Per bucket, the gradients a synchronizing backward waits for before launching it.

        Every parameter's, or a settled static graph's arriving ones only: the others
        are ready from the start, as DDP marks them ready at a backward's first hook.
        (A parameter whose gradient arrives in a nested backward only, without a settled
        static graph, keeps its bucket waiting for the end of the backward.)
        """
        firings = self._settled.firings if self._settled is not None else None
        self._due = [
            len(bucket) if firings is None else sum(firings[index] > 0 for index in bucket)
            for bucket in self._buckets
        ]

    # ------------------------------------------------------------ backward

    def check_finished(self) -> None:
        """DDP's check before a forward with grad enabled: the last backward came to its end.

        Raises the error of one that left parameters without gradient, or of one that
        raised midway (``_failed_midway``), now and at every later call.
        """
        if self.unfinished is None and self._failed_midway():
            self.unfinished = unfinished_backward_error(self.where)
        if self.unfinished is not None:
            raise self.unfinished
        if self._task not in (-1, _torch.current_graph_task_id()):
            self._reset_backward()  # raised before any gradient arrived: no trace
        if self._empty_backward and self._expecting is not None and not self._tracks_used:
            # Only backwards that accumulate nothing went through the last forward's
            # outputs (torch.autograd.grad, a zero-bubble schedule): DDP's error, explained.
            self.unfinished = unused_error(self._names, [False] * len(self._names), self.where)
            if self.unfinished is not None:
                raise self.unfinished

    def _failed_midway(self) -> bool:
        """Whether a synchronizing backward raised after its gradients began to arrive.

        One still running is not over (a forward inside it, a checkpoint's recompute);
        one that raised before any arrived sent nothing, nor did a static graph's first,
        which sends all at its end: both start afresh, as DDP's.
        """
        return (
            self._task not in (-1, _torch.current_graph_task_id())
            and any(self._hooks)
            and not self._delays_reduction
        )

    def expect_backward(self, synchronizing: bool) -> int:
        """A forward ended: its number, which an armed output of it passes to ``begin``.

        A synchronizing one's backward is expected from now on; any other forward
        leaves an earlier one's expected, as DDP's ``no_sync`` forward does.
        """
        self._forwards += 1
        if synchronizing:
            self._expecting = self._forwards
        return self._forwards

    def forget_expected_backward(self) -> None:
        """A rank-local forward with grad: its backward, which accumulates, must not synchronize.

        An earlier forward's outputs still synchronize their own backward.
        """
        self._expecting = None

    def begin(self, forward: int | None = None) -> None:
        """Synchronize the backward now running, if one is expected.

        Called from an armed output's hook, with the number of the forward that armed
        it, or from ``ready`` (None) when a gradient accumulates first (a parameter used
        outside the forward, or an output no tensor of which was found).
        """
        task = _torch.current_graph_task_id()
        if self._task == task:
            return  # another armed output of the same backward
        if self._task != -1:
            # A synchronizing backward raised before its end: DDP's error if it raised
            # midway, or else start afresh, once the collectives it launched have ended.
            self.check_finished()
        if (self._expecting is None) if forward is None else (forward <= self._synced_through):
            return  # no forward expects one, or its backward already synchronized: local
        self._expecting = None
        self._begun_by = forward
        self._synced_before, self._synced_through = self._synced_through, self._forwards
        self._task = task
        _torch.queue_callback(self._finish)
        if self._settled is not None:
            self._launch_complete()  # buckets of parameters a static graph leaves unused

    def ready(self, index: int) -> None:
        """A parameter's gradient was accumulated: mark it used; launch what is complete."""
        self._used[index] = True
        if self._task == -1:
            if self._expecting is None:
                return  # a local backward: averaged with the next synchronizing one
            # DDP's: the first backward after a synchronizing forward that accumulates.
            self.begin()
            if self._task == -1:
                return
        self._hooks[index] += 1
        if self._hooks[index] == 1 and self._arrival is not None:
            self._arrival.append(index)
        firings = self._settled.firings if self._settled is not None else None
        if firings is not None:
            # A settled static graph's, as DDP's: ready once accumulated as often as in
            # the first synchronizing backward, nested backwards included.
            if self._hooks[index] > firings[index]:
                raise graph_changed_error(self._names[index], firings[index], self.where)
            if self._hooks[index] < firings[index]:
                return
        elif self._delays_reduction:
            return  # a static graph's first is reduced at its end
        elif self._hooks[index] > 1 and self._bucket_of[index] < self._next:
            # Its bucket went out without this gradient: DDP's error, not a wrong average.
            raise late_gradient_error(self._names[index], self.where)
        elif self._task != _torch.current_graph_task_id():
            # A nested backward (a reentrant checkpoint's) may accumulate into it
            # again: averaged at the end of the synchronizing one.
            return
        self._waiting[self._bucket_of[index]] -= 1
        self._launch_complete()

    @property
    def _delays_reduction(self) -> bool:
        """Whether buckets wait for the end of the backward: a static graph's first (DDP's)."""
        return self._static_graph and self._settled is None

    def _launch_complete(self) -> None:
        """Launch, in order, each bucket whose gradients all arrived, up to one that has not."""
        while self._next < len(self._buckets) and self._waiting[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch_rest(self) -> None:
        """Launch every bucket not launched yet, in order, complete or not (the backward ended)."""
        while self._next < len(self._buckets):
            self._launch(self._next)
            self._next += 1

    def _settle(self, used: Sequence[bool], *, joined: bool = False) -> None:
        """Fix what a static graph's first synchronizing backward found, for every later one.

        A rank that met it having joined (Join) knows which parameters some rank used,
        not which of its own arrive: its first own synchronizing backward tells
        (``_finish``).
        """
        self._settled = StaticGraph(None if joined else tuple(self._hooks), tuple(used))
        self._count_due()

    def _launch(self, position: int) -> None:
        """Start averaging one bucket: every rank's ``.grad``, or zeros where it has none.

        Divided by the group's size first; undivided for a communication hook, which
        reduces (and divides), as with DDP.
        """
        bucket = self._buckets[position]
        views = self._views[position]
        if views is None:
            views = self._allocate(position)
        flat = self._flats[position]
        grads = [self._parameter(index).grad for index in bucket]
        scale = 1.0 if self._comm_hook is not None else 1.0 / self._divisor()
        # As DDP: multiply by the reciprocal (bit-equal averages). A bucket of small
        # gradients, all present and dense, takes one copy of them all and one in-place
        # multiply, both in C (a Python call per parameter would cost more than the
        # second pass); one of larger gradients is scaled while copied in, in one pass,
        # parameter by parameter.
        dense = [grad for grad in grads if grad is not None and not grad.is_sparse]
        if (
            len(dense) == len(grads)
            and flat.numel() * flat.element_size() <= len(grads) * SMALL_GRADIENT_BYTES
        ):
            _torch.copy_each(views, dense)
            if scale != 1.0:
                flat.mul_(scale)
        else:
            self._copy_in(bucket, grads, views, scale)
        pending: Collective | torch.futures.Future[Tensor]
        if self._comm_hook is None:
            pending = _torch.all_reduce(flat, self._group)
        else:
            pending = self._run_comm_hook(position, flat, views)
        self._launched.append((position, pending))

    def _divisor(self) -> int:
        """What the sums are divided by: the group's size, or (Join) the ranks not joined.

        Read from the device once per backward, as DDP's ``div_factor_``.
        """
        work = self.active_ranks
        if work is None or self.divide_by_initial_world_size:
            return self._group.size()
        if self._active_count is None:
            work.wait()
            self._active_count = int(_torch.work_tensor(work).item())
        return self._active_count

    def _run_comm_hook(
        self, position: int, flat: Tensor, gradients: Sequence[Tensor]
    ) -> torch.futures.Future[Tensor]:
        assert self._comm_hook is not None
        state, hook = self._comm_hook
        parameters = [self._parameter(index) for index in self._buckets[position]]
        index, last = position, position == len(self._buckets) - 1
        if self._delays_reduction:
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
        copy_in(bucket, grads, views, scale, self._sparse_error)

    def _sparse_error(self, index: int) -> ContractError:
        return ContractError(
            f"{self.where()}: parameter {self._names[index]!r} has a sparse gradient, "
            "which replicate does not average; use dense gradients (e.g. "
            "nn.Embedding(sparse=False)) or DistributedDataParallel"
        )

    def _allocate(self, position: int) -> list[Tensor]:
        """Make a bucket's flat buffer, kept across backwards, and its views per parameter."""
        flat, views = new_buffer(self._buckets[position], self._parameter)
        self._flats[position] = flat
        self._views[position] = views
        return views

    def _split(self, position: int, flat: Tensor) -> list[Tensor]:
        """Views of a bucket-sized ``flat``, one per parameter in its shape."""
        return split(self._buckets[position], self._parameter, flat)

    def _parameter(self, index: int) -> Tensor:
        parameter = self._parameters[index]()
        if parameter is None:
            raise ContractError(
                f"{self.where()}: parameter {self._names[index]!r} was freed; keep the model's "
                "parameters in it while it is replicated"
            )
        return parameter

    def _finish(self) -> None:
        """Run by the autograd engine at the end of a synchronizing backward."""
        if self._begun_by is None:
            # Begun by a gradient, no output of the forward found: if that was in a
            # nested backward (a reentrant checkpoint's recompute), the backward around
            # it, whose gradients are still to come, is the one to synchronize. (One
            # begun by the outputs is theirs, whole, even nested: the module itself run
            # in a reentrant checkpoint.)
            hook = _torch.resume_in_enclosing_backward(self._resume)
            if hook is not None:
                self._resume_hooks.append(hook)
                return
        if self._begun_by is not None and not self._static_graph and not any(self._hooks):
            # Through the outputs, but nothing accumulated (torch.autograd.grad, a gradient
            # penalty's first half): not the synchronizing one, as DDP's reducer, which
            # gradients alone start, sees it. The forward's backward is still expected.
            self._expecting, self._synced_through = self._begun_by, self._synced_before
            self._empty_backward = True
            self._reset_backward()
            return
        self._empty_backward = False
        try:
            self.unfinished = self._unused_error()
            if self.unfinished is not None:
                # As DDP's: the buckets from the first incomplete one on are never
                # launched, no gradient is averaged, and the next forward raises.
                self._wait_launched()
                return
            # DDP's delay_all_reduce: a static graph's first synchronizing backward sends the
            # map of used parameters, then every bucket, all at its end.
            used_map = (
                start_used_map(self._used, self._group, self.device)
                if self._delays_reduction
                else None
            )
            self._launch_rest()
            results = self._wait_launched()
            if used_map is not None:
                self._settle(used_map.result())
            elif self._settled is not None and self._settled.firings is None:
                self._settled = attrs.evolve(self._settled, firings=tuple(self._hooks))
                self._count_due()
            used = self._used_everywhere()
            for position, averages in results:
                self._write_back(position, averages, used)
            if self.in_backward:
                self._step_in_backward()
            if self._arrival is not None:
                self._arrived_in_order(self._arrival)
        finally:
            self._used = [False] * len(self._names)
            self._reset_backward()
        module = self._module()
        if module is not None:
            self._on_synchronized(module)

    def _resume(self) -> None:
        """In the backward around a nested one that began synchronizing: go on to its end."""
        self._task = _torch.current_graph_task_id()
        _torch.queue_callback(self._finish)

    def take_over_in_backward(self) -> None:
        """DDP's ``_setup_in_backward_optimizers``: the in-backward optimizers are ours now."""
        self.took_over_in_backward = True
        parameters = [self._parameter(index) for index in range(len(self._names))]
        self.in_backward = take_over_in_backward(parameters)

    def _step_in_backward(self) -> None:
        """Step the optimizers applied in backward, as DDP's hook: a parameter no rank used
        steps on its bucket's zeros (unless its gradient is a bucket view, left None)."""
        parameters = [self._parameter(index) for index in self.in_backward]
        if not self.gradient_as_bucket_view:
            for parameter in parameters:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
        step_in_backward(parameters)

    def _wait_launched(self) -> list[tuple[int, Tensor]]:
        """Wait for every launched bucket, in order; each one's reduced flat buffer."""
        results: list[tuple[int, Tensor]] = []
        while self._launched:
            position, pending = self._launched.pop(0)
            if isinstance(pending, Collective):
                pending.wait()
                results.append((position, self._flats[position]))
            else:
                results.append((position, self._hook_result(position, pending.wait())))
        return results

    def _hook_result(self, position: int, result: object) -> Tensor:
        return hook_result(self.where, position, self._flats[position], result)

    def _unused_error(self) -> UnusedParameterError | None:
        """DDP's error if a parameter that had to get a gradient got none, else None.

        Every parameter without unused parameters found; a settled static graph's
        arriving ones with it.
        """
        firings = self._settled.firings if self._settled is not None else None
        if firings is not None:
            short = [got < due for got, due in zip(self._hooks, firings, strict=True)]
            return static_unused_error(self._names, short, self.where)
        if self._tracks_used:
            return None
        return unused_error(self._names, [got > 0 for got in self._hooks], self.where)

    def _used_everywhere(self) -> list[bool]:
        """By parameter, whether some rank used it since the last synchronization.

        The map of parameters used on this rank, all-reduced now, once, as DDP's; a
        settled static graph's is fixed: no collective, no read.
        """
        if not self._tracks_used:
            return [True] * len(self._names)
        if self._settled is not None:
            return list(self._settled.used)
        self._sent_used = used_on_some_rank(self._used, self._group, self.device)
        return list(self._sent_used)

    def _write_back(self, position: int, reduced: Tensor, used: Sequence[bool]) -> None:
        bucket = self._buckets[position]
        views = self._views[position]
        if self.gradient_as_bucket_view and views is not None:
            flat = self._flats[position]
            point_into_bucket(bucket, self._parameter, flat, reduced, views=views, used=used)
            return
        if views is None or reduced is not self._flats[position]:
            views = self._split(position, reduced)  # a hook's own tensor
        write_back(bucket, self._parameter, views, used)

    # ------------------------------------------------------------ hooks and Join

    def _first_limits(self) -> tuple[int, ...]:
        return first_limits(self._cap_list, self._rebuilds, self._default_cap, self._cap_bytes)

    def _limits(self) -> tuple[int, ...]:
        return limits(self._cap_list, self._default_cap, self._cap_bytes)

    def register_comm_hook(self, module: nn.Module, state: object, hook: CommHook) -> None:
        """From the next backward, ``hook(state, bucket)`` reduces each bucket (checked first).

        The buckets are DDP's already and stay as they are, as DDP's do; their
        buffers are made anew.
        """
        if self._comm_hook is not None:
            raise ContractError(
                f"replicate on {module_label(module)}: register_comm_hook can only be called "
                "once (as DistributedDataParallel's); register one hook that does both"
            )
        if self._task != -1 and self._task == _torch.current_graph_task_id():
            raise ContractError(
                f"replicate on {module_label(module)}: register_comm_hook during a backward; "
                "register it between backwards (before training, or after a step)"
            )
        if self.unfinished is None and self._failed_midway():
            # A backward that raised midway stays DDP's error at the next forward.
            self.unfinished = unfinished_backward_error(self.where)
        self._comm_hook = (state, hook)
        self._set_buckets(self._buckets)

    def shadow_backward(self, module: nn.Module) -> None:
        """On a rank whose inputs ran out, meet the others' synchronizing backward with zeros.

        Their all-reduces, in the buckets' order, through the communication hook if one
        is registered (``_join``'s hook calls this once the others said one follows).
        """
        nothing_used = [False] * len(self._names)
        # The others' static graph settles now: meet their map of used parameters first.
        used_map = (
            start_used_map(nothing_used, self._group, self.device)
            if self._delays_reduction
            else None
        )
        for position in range(len(self._buckets)):
            if self._views[position] is None:
                self._allocate(position)
            # Zeros of their own, as DDP's: with gradient_as_bucket_view this rank's
            # gradients live in the bucket buffers, and stay as they are.
            flat = torch.zeros_like(self._flats[position])
            pending: Collective | torch.futures.Future[Tensor]
            if self._comm_hook is not None:
                pending = self._run_comm_hook(position, flat, self._split(position, flat))
            else:
                pending = _torch.all_reduce(flat, self._group)
            self._launched.append((position, pending))
        try:
            self._wait_launched()
            if used_map is not None:
                self._settle(used_map.result(), joined=True)
            elif self._tracks_used and not self._static_graph:
                # The others' map: this rank sends the last map it all-reduced, as it came
                # back, as DDP's joined rank does (DDP all-reduces its map in place): what
                # any rank used then counts as used again, its zeros averaged.
                self._sent_used = used_on_some_rank(self._sent_used, self._group, self.device)
            # As DDP's joined rank, which counts every parameter as arrived in definition
            # order: where it is the first rank, the rebuild takes that.
            if self._arrival is not None:
                self._arrived_in_order(list(range(len(self._names))))
        finally:
            self._reset_backward()

    def _arrived_in_order(self, arrival: list[int]) -> None:
        """End of a synchronized backward, buckets still to rebuild: from this order, or not yet.

        A static graph's first synchronized backward only counts. The rebuild itself
        waits for the next forward with grad enabled (``rebuild_if_due``), as DDP's.
        """
        if self._backwards_before_rebuild > 0:
            self._backwards_before_rebuild -= 1
            self._arrival = []
            return
        self._rebuild_from = arrival
        self._arrival = None

    def rebuild_if_due(self, module: nn.Module) -> None:
        """DDP's ``_rebuild_buckets``, before a forward with grad enabled: rebuild, once.

        Each rank buckets its parameters anew in the order their gradients arrived
        (those that did not arrive last, in the order they are defined, as DDP's), with
        DDP's caps; every rank then takes the first rank's buckets (two broadcasts, as
        DDP's ``sync_bucket_indices``), and the record names them.
        """
        arrival = self._rebuild_from
        if arrival is None:
            return
        self._rebuild_from = None
        arrived = set(arrival)
        order = [*arrival, *(index for index in range(len(self._names)) if index not in arrived)]
        parameters = [self._parameter(index) for index in range(len(self._names))]
        buckets = assign_buckets_as_ddp(parameters, order, self._limits())
        self._set_buckets(first_ranks_buckets(buckets, self._group, self.device))
        self.update(module, lambda record: attrs.evolve(record, buckets=self.bucket_names))
