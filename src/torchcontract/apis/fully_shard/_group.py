"""ParamGroup: the runtime of one ``fully_shard`` application, held only by its hooks.

It owns the application's ``ManagedParameter`` objects and moves them between
sharded and unsharded; it follows one forward and backward at a time through
``Phase``. It refers to its modules weakly, so dropping the model frees it: the
model holds the hooks, the hooks hold the group, nothing holds the model.

Groups under one root share a ``Root``, made when the root's first forward runs
(PyTorch's lazy init): the root is the first group whose forward runs. The root
keeps its own parameters unsharded after forward (they would be gathered again
at once for backward) and queues the callback that ends each backward.

Prefetching, as FSDP2's: a group's all-gather may be started ahead of its use
(``prefetch``) on gloo's own threads, while the caller computes; ``unshard``
then only waits for it. The ``Root`` records the order of one iteration's
forwards and post-forwards: in forward, a group prefetches the group that
followed it in the previous iteration's forward (implicit forward prefetch); in
backward, the group that ran its forward just before it in this iteration
(implicit backward prefetch, FSDP2's reverse post-forward order). Explicit lists
(``_prefetch``) replace either. A prefetch lives within the pass that issued it:
the end of backward and the root's next forward wait for and drop any unused,
so a gather never serves parameters an optimizer step has since changed. The
user's ``unshard(async_op=True)`` is not a prefetch: the root's next forward
uses it, as FSDP2's, rather than gathering the same parameters again.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchcontract import UnmaterializedParameterError, module_label

from .. import _torch
from ._collectives import PendingGather, reduce_scatter, start_all_gather
from ._comms import AllGatherComm, ReduceScatterComm
from ._extended_gather import detect, start_extended_gather
from ._sharding import ManagedParameter
from ._state import FullyShardState
from ._streams import CommStreams

if TYPE_CHECKING:
    from torchcontract import Contract

__all__ = ["ALL_GROUPS", "ParamGroup", "Phase", "Root", "finish_backward", "root_names"]


def root_names(root: nn.Module) -> dict[int, str]:
    """The FQN in ``root`` of every parameter registered under it, by the tensor's id.

    The first name of a tied parameter, as ``named_parameters`` gives it (and FSDP2's
    ``_init_fqns``).
    """
    return {id(parameter): name for name, parameter in root.named_parameters()}


class Phase(enum.Enum):
    """Where a group is in the current iteration."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


class Root:
    """What the groups under one root share across an iteration.

    It holds the groups weakly: each group holds its root, and no cycle may keep
    the groups' parameters alive once the model is dropped.
    """

    def __init__(self, groups: Sequence[ParamGroup]) -> None:
        self._groups = tuple(weakref.ref(group) for group in groups)
        self.callback_queued = False
        # Whether every group's shards were found off the meta device (checked until they are).
        self.materialized = False
        # Forward order of the last iteration and of this one (implicit forward prefetch),
        # post-forward order of this one (implicit backward prefetch); weak, as the groups.
        self.last_forward: list[weakref.ref[ParamGroup]] = []
        self.forward: list[weakref.ref[ParamGroup]] = []
        self.post_forward: list[weakref.ref[ParamGroup]] = []
        # On an accelerator: FSDP2's communication streams (``_streams``); None on the CPU.
        self.streams: CommStreams | None = None

    @property
    def groups(self) -> list[ParamGroup]:
        return [group for ref in self._groups if (group := ref()) is not None]

    def start_iteration(self) -> None:
        """At the root's forward: forget a backward that failed before its end callback ran.

        Also drops unused prefetches and starts recording this iteration's order; on
        an accelerator, the compute stream first waits for the failed backward's
        reductions (they may still be writing ``.grad``, as FSDP2's reset waits for
        them), and the copy-in stream waits for the optimizer step.
        """
        streams = self.streams
        if self.callback_queued:
            self.callback_queued = False
            if streams is not None:
                streams.finish_backward(
                    [event for group in self.groups for event in group.reduce_events]
                )
            for group in self.groups:
                group.reduce_events.clear()
                group.phase = Phase.IDLE
                group.reduced = False
        if streams is not None:
            for group in self.groups:  # set_post_optim_event on any module under the root
                if group.post_optim_event is not None:
                    streams.post_optim_event, group.post_optim_event = group.post_optim_event, None
            streams.release_kept_gather()  # a forward that raised before its end
            streams.start_iteration()
        if streams is not None and not self.materialized:  # FSDP2's lazy init resolves it once
            streams.max_reduce_inputs = max(
                (
                    (group.record() or FullyShardState()).reduce_scatter_max_input_buffers
                    for group in self.groups
                ),
                default=1,
            )
        for group in self.groups:
            if group.pending is None or not group.pending.requested:  # keep unshard(async_op)
                group.drop_prefetch()
            group.post_forward_indices.clear()
            if group.post_forward:  # kept from a forward without backward: maybe stale now
                group.reshard()
        if self.forward:
            self.last_forward = self.forward
        self.forward = []
        self.post_forward = []

    def record_forward(self, group: ParamGroup) -> ParamGroup | None:
        """Note ``group``'s forward; the group that followed it last iteration, if any."""
        position = len(self.forward)
        self.forward.append(weakref.ref(group))
        if position + 1 < len(self.last_forward) and self.last_forward[position]() is group:
            return self.last_forward[position + 1]()
        return None

    def record_post_forward(self, group: ParamGroup) -> None:
        """Note ``group``'s post-forward (once per forward call, as FSDP2's)."""
        group.post_forward_indices.append(len(self.post_forward))
        self.post_forward.append(weakref.ref(group))

    def previous_post_forward(self, group: ParamGroup) -> ParamGroup | None:
        """The group whose forward ran before ``group``'s latest one, for its backward."""
        if not group.post_forward_indices:
            return None  # several backwards through one forward, or none recorded
        index = group.post_forward_indices.pop()
        return self.post_forward[index - 1]() if index > 0 else None


class ParamGroup:
    """The parameters one ``fully_shard`` call manages, and their sharding over one iteration."""

    def __init__(
        self,
        api: Contract[..., Any, FullyShardState],
        modules: Sequence[nn.Module],
        parameters: Sequence[ManagedParameter],
        group: dist.ProcessGroup,
        *,
        reshard_after_forward: bool | None,
        reduce_dtype: torch.dtype | None,
        replicate_group: dist.ProcessGroup | None = None,
        post_forward_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.api = api
        self._modules = tuple(weakref.ref(module) for module in modules)
        self.module_ids = frozenset(id(module) for module in modules)
        self.parameters = tuple(parameters)
        self.process_group = group
        self.replicate_group = replicate_group  # HSDP: gradients are averaged over it too
        # An int reshard_after_forward: the shard group of FSDP2's post-forward mesh, over
        # which backward gathers what each rank kept after forward (``post_forward``).
        self.post_forward_group = post_forward_group
        self.post_forward = False
        # On an accelerator: the event after the post-forward reshard, which the gather of
        # what it kept waits for (FSDP2's ``_reshard_after_forward_event``).
        self.resharded_event: torch.Event | None = None
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype
        self.unsharded = False
        self.phase = Phase.IDLE
        self.root: Root | None = None
        self.is_root = False
        self.reduced = False  # whether this backward reduce-scattered gradients
        self.pending: PendingGather | None = None  # a prefetched all-gather not yet used
        self.implicit_prefetch = True
        # Explicit prefetch lists (``_prefetch``): empty means implicit, as FSDP2.
        self.forward_prefetch: tuple[weakref.ref[ParamGroup], ...] = ()
        self.backward_prefetch: tuple[weakref.ref[ParamGroup], ...] = ()
        self.post_forward_indices: list[int] = []
        # HSDP with requires_all_reduce off: reduce-scattered shards awaiting the all-reduce.
        self.deferred: dict[int, Tensor] = {}
        # On an accelerator: the reductions' events the end of backward waits for, and
        # the user's post-optimizer event for the next forward's copy-in.
        self.reduce_events: list[torch.Event] = []
        self.post_optim_event: torch.Event | None = None
        # What the user hands the setters: on the group, which the module's hooks hold,
        # not in the record. A hook that reaches the module (a bound method, a closure),
        # as FSDP2 takes, would keep a record's module alive for ever; here it is one
        # more reference cycle through the module, which the collector frees.
        self.all_reduce_hook: Callable[[Tensor], None] | None = None
        self.all_reduce_hook_stream: object | None = None
        self.all_gather_comm: AllGatherComm | None = None
        self.reduce_scatter_comm: ReduceScatterComm | None = None
        # A list's application: ids of its modules yet to run forward in this pass (FSDP2's
        # ``_modules_to_run_forward``); its post-forward waits for the last of them.
        self.to_run_forward: set[int] = set()
        # Whether a shard defines FSDP2's all-gather extension hooks (found at lazy init).
        self.extended = False

    @property
    def device_type(self) -> str:
        """The device type of the group's mesh (``cpu`` for an empty group)."""
        for parameter in self.parameters:
            return parameter.layout.mesh.device_type
        return "cpu"

    @property
    def streams(self) -> CommStreams | None:
        """The root's communication streams (None on the CPU, or before the first forward)."""
        root = self.root
        return None if root is None else root.streams

    def completes_forward(self, module_id: int) -> bool:
        """Note the forward of one of the group's modules: whether it ends the group's forward.

        A group of one module: always. A list's: when the module was the last of those
        yet to run in this pass; one run again (a head a chunked loss calls per chunk)
        ends nothing.
        """
        if len(self.module_ids) == 1:
            return True
        if module_id not in self.to_run_forward:
            return False
        self.to_run_forward.discard(module_id)
        return not self.to_run_forward

    def modules(self) -> list[nn.Module]:
        """The group's modules that are still alive."""
        return [module for ref in self._modules if (module := ref()) is not None]

    def record(self) -> FullyShardState | None:
        """The record of this application, or None once rolled back (the hooks then stand aside)."""
        for module in self.modules():
            return self.api.get_state(module)
        return None

    def update(self, transition: Callable[[FullyShardState], FullyShardState]) -> None:
        for module in self.modules():
            if self.api.is_applied(module):
                self.api.update(module, transition)
            return

    # ----------------------------------------------------------------- sharding

    def check_materialized(self, root: nn.Module | None = None) -> None:
        """Raise ``UnmaterializedParameterError`` if a shard is still on the meta device.

        The message holds FSDP2's, which names the parameters by their FQNs in the
        ``root`` module (the one whose forward ran first); without it, by their FQNs
        in this application's module.
        """
        if not any(parameter.is_meta for parameter in self.parameters):
            return
        names = None if root is None else root_names(root)
        ordered = _in_fsdp2_order(self.modules(), self.parameters)
        on_meta = [self.root_fqn(p, names) for p in ordered if p.is_meta]
        modules = self.modules()
        where = module_label(modules[0]) if modules else "a freed module"
        raise UnmaterializedParameterError(
            f"fully_shard on {where}: {len(on_meta)} parameter(s) still on the meta device "
            "(materialize them before the first forward: model.to_empty(device=...), then "
            "your init); FSDP parameters should be materialized from meta device before "
            f"training, but the following were still on meta device: {on_meta}\n"
            "For example, call module.to_empty(device) to materialize to device and call "
            "module.reset_parameters() on each module to initialize values."
        )

    @staticmethod
    def root_fqn(parameter: ManagedParameter, names: Mapping[int, str] | None) -> str:
        """``parameter``'s FQN in the root module (``names``), else in its application's."""
        if names is not None:
            for tensor in (parameter.sharded, parameter.unsharded):
                if tensor is not None and id(tensor) in names:
                    return names[id(tensor)]
        return parameter.fqn

    def adopt_replaced(self) -> None:
        """Take as shards the parameters registered in place of them since apply (lazy init).

        As FSDP2's lazy init (``reset_sharded_param``): a module's parameter set
        after ``fully_shard`` to a ``DTensor`` laid out as its shard is sharded by
        this application from now on. Raises ``ReplacedParameterError`` for
        anything else registered there.
        """
        modules = self.modules()
        where = module_label(modules[0]) if modules else "a freed module"
        for parameter in self.parameters:
            parameter.adopt_replaced(where)
        self.extended = detect(self.parameters, f"fully_shard on {where}")

    def unshard(self) -> None:
        """All-gather the parameters and register the unsharded ones (no-op if unsharded).

        Raises ``UnmaterializedParameterError``, before any collective, if a shard
        is still on the meta device.
        """
        pending, self.pending = self.pending, None
        # As FSDP2's: a forward gather's buffers outlive its copy-out (``copied_out``).
        keep = self.phase is Phase.FORWARD
        if pending is not None:
            pending.finish(keep=keep)
            self.unsharded = True
        elif not self.unsharded:
            self.check_materialized()
            in_pass = self.phase in {Phase.FORWARD, Phase.PRE_BACKWARD}
            self._start_gather(async_op=False, on_streams=in_pass).finish(keep=keep)
            self.unsharded = True
        else:
            self.follow_cast()

    def _start_gather(self, *, async_op: bool, on_streams: bool) -> PendingGather:
        """The all-gather of the shards, or after a post-forward reshard of what was kept.

        ``on_streams``: on an accelerator, on the communication streams; as FSDP2's
        ``get_all_gather_streams``, only a forward's or backward's gather (its own or a
        prefetch), whose copy-in streams waited for the optimizer; the user's
        ``unshard()`` runs on the caller's stream.
        """
        record = self.record() or FullyShardState()
        comm = self.all_gather_comm
        if self.post_forward and self.post_forward_group is not None:
            self.post_forward = False
            group, post_forward = self.post_forward_group, True
        else:
            group, post_forward = self.process_group, False
        streams = self.streams if on_streams else None
        resharded, self.resharded_event = self.resharded_event, None
        if streams is not None and post_forward and resharded is not None:
            streams.gather_after_reshard(resharded)
        if self.extended:  # a shard defines FSDP2's all-gather hooks
            return start_extended_gather(
                self.parameters,
                group,
                async_op=async_op,
                post_forward=post_forward,
                comm=comm,
                mp_policy=record.mp_policy,
                streams=streams,
            )
        if streams is not None or comm is not None:
            return start_all_gather(
                self.parameters,
                group,
                async_op=async_op,
                post_forward=post_forward,
                comm=comm,
                streams=streams,
            )
        # The plain call (a test records the gathers by replacing this function).
        if post_forward:
            return start_all_gather(self.parameters, group, async_op=async_op, post_forward=True)
        return start_all_gather(self.parameters, group, async_op=async_op)

    def prefetch(self, *, requested: bool = False) -> None:
        """Start the all-gather now, on gloo's threads; ``unshard`` waits for it.

        A no-op if the parameters are unsharded or already being gathered, or a
        shard is still on the meta device (``unshard`` raises then). ``requested``:
        the user's ``unshard(async_op=True)``, which the root's next forward keeps.
        """
        if self.unsharded or self.pending is not None:
            return
        if any(parameter.is_meta for parameter in self.parameters):
            return
        self.pending = self._start_gather(async_op=True, on_streams=not requested)
        self.pending.requested = requested

    def drop_prefetch(self) -> None:
        """Wait for a prefetched all-gather that was not used, and drop its result."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.discard()
            for parameter in self.parameters:  # a post-forward gather took what was kept
                parameter.reshard()

    def prefetch_forward(self, root: Root | None) -> None:
        """After this group's unshard in forward: prefetch the groups expected next."""
        following = None if root is None else root.record_forward(self)
        targets: list[ParamGroup | None]
        if self.forward_prefetch:
            targets = [ref() for ref in self.forward_prefetch]
        else:
            targets = [following] if self.implicit_prefetch else []
        for target in targets:
            if target is not None and target is not self:
                target.prefetch()

    def prefetch_backward(self) -> None:
        """After this group's unshard in backward: prefetch the groups expected next."""
        root = self.root
        previous = None if root is None else root.previous_post_forward(self)
        targets: list[ParamGroup | None]
        if self.backward_prefetch:
            targets = [ref() for ref in self.backward_prefetch]
        else:
            targets = [previous] if self.implicit_prefetch else []
        for target in targets:
            if target is not None and target is not self:
                target.prefetch()

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        self.drop_prefetch()
        self.register_shards()

    def register_shards(self) -> None:
        """``reshard``, but an all-gather in flight is kept, for ``unshard`` to finish.

        What FSDP2's state-dict hook does before a save (``_to_sharded``): saving
        reads the shards, which the gather reads too, so its result stays good. And
        every rank then sends the same collectives, whichever saved and from which
        thread (torchft's quorum thread saves while the step runs): dropping the
        gather would make this rank alone gather once more.
        """
        if self.unsharded or self.post_forward:
            self.follow_cast()
            for parameter in self.parameters:
                parameter.reshard()
            self.unsharded = self.post_forward = False

    def reshard_after_forward_pass(self) -> None:
        """After forward: free the parameters, or keep them on the post-forward mesh."""
        if self.post_forward_group is None or not self.unsharded:
            self.reshard()
            return
        self.drop_prefetch()
        self.follow_cast()
        for parameter in self.parameters:
            parameter.reshard_post_forward()
        self.unsharded, self.post_forward = False, True
        if self.streams is not None:
            self.resharded_event = self.streams.resharded_after_forward()

    def follow_cast(self) -> None:
        """Give the shards the dtype the model was cast to while unsharded, if it was."""
        for parameter in self.parameters:
            parameter.follow_cast()

    @property
    def reshards_after_forward(self) -> bool:
        """FSDP2's meaning: None frees the parameters after forward except on the root."""
        if self.reshard_after_forward is None:
            return not self.is_root
        return self.reshard_after_forward

    # ----------------------------------------------------------------- backward

    def pre_backward(self, grad: Tensor) -> Tensor:
        """Hook on the forward's outputs: gather the parameters before the module's backward."""
        if self.phase is not Phase.PRE_BACKWARD:
            self.phase = Phase.PRE_BACKWARD
            self.queue_finish()
            record = self.record()
            if record is None or record.unshard_in_backward:
                self.unshard()
            self.prefetch_backward()
        return grad

    def queue_finish(self) -> None:
        root = self.root
        if root is not None and not root.callback_queued:
            root.callback_queued = True
            _torch.queue_callback(_Finish(weakref.ref(root)))

    def post_backward(self) -> None:
        """Once the module's backward is done: reduce-scatter the gradients (or keep them), reshard.

        Safe to call when the group took no part in the backward: it reshards and
        reduces nothing.
        """
        self.phase = Phase.POST_BACKWARD
        record = self.record() or FullyShardState()
        if not record.sync_gradients:
            for parameter in self.parameters:
                parameter.keep_unsharded_grad(self.reduce_dtype)
            if record.reshard_after_backward:
                self.reshard()
            return
        pairs: list[tuple[ManagedParameter, Tensor]] = []
        for parameter in self.parameters:
            grad = parameter.take_unsharded_grad()
            # Unused now, but holding a deferred HSDP reduction: zeros carry it to the all-reduce
            # (else it would miss this step's .grad and land in a later one's).
            if grad is None and (
                record.reduce_scatter_unused_params or id(parameter) in self.deferred
            ):
                grad = parameter.unsharded_zero_grad()
            if grad is not None:
                pairs.append((parameter, grad))
        if record.reshard_after_backward:
            self.reshard()
        if pairs:
            grads = [grad for _, grad in pairs]
            self.reduce_events += reduce_scatter(
                [parameter for parameter, _ in pairs],
                grads,
                self.process_group,
                self.reduce_dtype,
                self.replicate_group,
                hook=self.all_reduce_hook,
                hook_stream=self.all_reduce_hook_stream,
                all_reduce=record.requires_all_reduce,
                deferred=self.deferred,
                divide_factor=record.gradient_divide_factor,
                force_sum=record.force_sum_reduction,
                comm=self.reduce_scatter_comm,
                streams=self.streams,
            )
            self.reduced = True


def _in_fsdp2_order(
    targets: Sequence[nn.Module], parameters: Sequence[ManagedParameter]
) -> list[ManagedParameter]:
    """``parameters`` in FSDP2's order: by module, children before their parent, as listed.

    FSDP2 collects a group's modules depth first, appending each after its children
    (``_get_managed_modules``); its messages list parameters in that order.
    """
    position: dict[int, int] = {}

    def visit(module: nn.Module) -> None:
        position[id(module)] = -1  # visited
        for child in module._modules.values():
            if child is not None and id(child) not in position:
                visit(child)
        position[id(module)] = len(position)

    for target in targets:
        if id(target) not in position:
            visit(target)

    def key(parameter: ManagedParameter) -> tuple[int, int]:
        module_ref, name = parameter.locations[0]
        module = module_ref()
        if module is None:
            return (len(position), 0)
        return (position.get(id(module), len(position)), list(module._parameters).index(name))

    return sorted(parameters, key=key)


def _count_backward(record: FullyShardState) -> FullyShardState:
    return attrs.evolve(record, backwards=record.backwards + 1)


class _Finish:
    """The callback that ends a backward: late post-backwards, phases reset, records counted."""

    __slots__ = ("_root",)

    def __init__(self, root: weakref.ref[Root]) -> None:
        self._root = root

    def __call__(self) -> None:
        root = self._root()
        if root is not None:
            finish_backward(root)


def finish_backward(root: Root) -> None:
    """End a backward of ``root``'s groups: late post-backwards, phases reset, records counted.

    What the callback queued at each backward's start runs when autograd's backward
    ends; pipelining's schedules call it again after their own last post-backward
    (FSDP2's ``_root_post_backward_final_callback``), when it finds nothing left to do
    but the counting.
    """
    try:
        for group in root.groups:  # root first, as FSDP2's states are gone through
            if group.phase is not Phase.POST_BACKWARD:
                # Inputs that need no gradient (token ids) never trigger it.
                group.post_backward()
    finally:
        streams = root.streams
        if streams is not None:
            events = [event for group in root.groups for event in group.reduce_events]
            streams.finish_backward(events)
        for group in root.groups:
            group.reduce_events.clear()
        root.callback_queued = False
        root.post_forward = []
        for group in root.groups:
            group.drop_prefetch()
            group.post_forward_indices.clear()
            group.to_run_forward.clear()
            group.phase = Phase.IDLE
            if group.reduced:
                group.reduced = False
                group.update(_count_backward)


#: Every live group, for the root to find the groups inside it and for apply to
#: find who manages a parameter. Weak: a group lives as long as its hooks.
ALL_GROUPS: weakref.WeakSet[ParamGroup] = weakref.WeakSet()
