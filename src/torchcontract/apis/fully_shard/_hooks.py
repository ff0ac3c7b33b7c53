"""The hooks ``fully_shard`` installs: gather before forward, free after, and the backward pair.

Before a module's forward: find the root (first forward only), cast floating
inputs to ``param_dtype``, all-gather, and pass the inputs that need a gradient
through ``_PostBackward``, whose backward runs once every gradient with respect
to them, and so the module's parameter gradients, is computed (PyTorch's
``RegisterPostBackwardFunction``). After forward: reshard (not the root), and
hook the outputs so that their gradient gathers the parameters again first.
A forward run inside backward (a checkpoint recomputing it) only makes sure the
parameters are gathered. Each forward prefetches the groups expected next, and
backward's pre-hook those expected next in backward (``ParamGroup.prefetch_*``).

Under ``torch.compile`` both forward hooks run eagerly (``torch.compiler.disable``,
as FSDP2's hooks): dynamo compiles each module's ``forward`` frame with the
gathered parameters in place and never traces a swap, a collective or a record
update, so it neither breaks its graph on them nor specialises on a parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

import attrs
import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils import _pytree as pytree

from torchcontract import (
    AlreadyManagedError,
    ContractError,
    IncompatibleAPIError,
    module_label,
    named_tree,
    torch_registry,
)

from .. import _torch
from ._group import ALL_GROUPS, ParamGroup, Phase, Root, root_names
from ._state import FullyShardState
from ._streams import streams_for

__all__ = ["ForwardHooks", "become_root", "grad_tensors", "in_backward"]

_Inputs = tuple[tuple[Any, ...], dict[str, Any]]


class ForwardHooks:
    """The forward pre-hook and forward hook of one application; they hold only its group.

    A pickle of the model gets hooks without a group, which do nothing: its
    parameters are its own, and a process group does not pickle. (A deep copy of a
    sharded module is refused, ``FullyShardModule.__deepcopy__``.)
    """

    __slots__ = ("group", "mp_policy")

    def __init__(self, group: ParamGroup | None, mp_policy: MixedPrecisionPolicy | None) -> None:
        self.group = group
        self.mp_policy = mp_policy

    def __reduce__(self) -> tuple[type[ForwardHooks], tuple[None, None]]:
        return ForwardHooks, (None, None)

    def group_for(self, module: nn.Module) -> ParamGroup | None:
        """The group, if these hooks act for ``module``: only the modules applied to, live."""
        group = self.group
        if group is None or id(module) not in group.module_ids or group.record() is None:
            return None
        return group

    @_torch.outside_compile
    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Inputs | None:
        """Forward pre-hook: gather the parameters; wrap the inputs for the post-backward.

        Both hooks run outside ``torch.compile``, as FSDP2's: parameter swaps and
        collectives are not traced, only the module's compute.
        """
        group = self.group_for(module)
        if group is None:
            return None
        policy = self.mp_policy
        if policy is not None and policy.cast_forward_inputs:
            args, kwargs = _cast((args, kwargs), policy.param_dtype)
        if len(group.module_ids) > 1 and not group.to_run_forward:  # a list's pass begins
            group.to_run_forward = set(group.module_ids)
        if in_backward():  # a checkpoint recomputing the forward: gathered by pre-backward
            group.unshard()
            return args, kwargs
        if group.root is None:
            become_root(group)
        root = group.root
        if group.is_root and root is not None:
            root.start_iteration()
            if not root.materialized:  # every group, before any of the model's compute
                for member in root.groups:  # FSDP2's lazy init of each group, in its order
                    member.adopt_replaced()
                    member.check_materialized(module)
                root.materialized = True
        # Still in FORWARD: another module of a list's application ran first in this pass
        # and already hooked the pass's inputs for the post-backward (FSDP2's).
        entering = group.phase is not Phase.FORWARD
        group.phase = Phase.FORWARD
        group.unshard()
        group.prefetch_forward(root)
        group.update(_count_forward)
        if torch.is_grad_enabled() and entering:
            args, kwargs = _with_post_backward(group, args, kwargs)
        return args, kwargs

    @_torch.outside_compile
    def after(self, module: nn.Module, args: tuple[Any, ...], output: object) -> object:
        """Forward hook: reshard (unless root), hook the outputs for the pre-backward.

        Floating outputs are cast to the policy's ``output_dtype``, if set (FSDP2's).
        An application to a list of modules ends its forward, as FSDP2's, only when
        the last of its modules to run in this pass returns; until then (and for a
        module run again, as a chunked loss runs a head), the output is only cast.
        The root's forward ends the lists whose other modules did not run (a model
        whose forward skips the head a chunked loss runs): their pre-backward hooks
        go on the root's outputs.
        """
        group = self.group_for(module)
        if group is None:
            return None
        completes = group.completes_forward(id(module))
        if in_backward():
            return None
        policy = self.mp_policy
        if policy is not None and policy.output_dtype is not None:
            output = _cast(output, policy.output_dtype)
        if completes:
            _end_forward(group, output)
            root = group.root
            if group.is_root and root is not None:
                for member in reversed(root.groups):
                    if member is not group and member.to_run_forward:
                        member.to_run_forward.clear()
                        _end_forward(member, output)
                if root.streams is not None:  # FSDP2's root post-forward frees the last gather
                    root.streams.release_kept_gather()
        return output if policy is not None and policy.output_dtype is not None else None


def _end_forward(group: ParamGroup, output: object) -> None:
    """A group's post-forward: reshard (unless kept), hook ``output`` for its pre-backward."""
    if group.reshards_after_forward:
        group.reshard_after_forward_pass()
    if group.root is not None:
        group.root.record_post_forward(group)
    group.phase = Phase.IDLE
    if torch.is_grad_enabled():
        for tensor in grad_tensors(output):
            _torch.register_tensor_hook(tensor, group.pre_backward)


_Tree = TypeVar("_Tree")


def _cast(tree: _Tree, dtype: torch.dtype | None) -> _Tree:
    """Cast the floating tensors in ``tree`` to ``dtype`` (None: unchanged), as FSDP2 does.

    Through the containers FSDP2's casts reach (``_torch.map_tensors``): dataclasses
    and list, tuple or dict subclasses too, where ``pytree`` stops.
    """
    if dtype is None:
        return tree

    def cast_floating(tensor: Tensor) -> Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    return _torch.map_tensors(cast_floating, tree)


def grad_tensors(tree: object) -> list[Tensor]:
    """The tensors requiring grad in ``tree``, found as FSDP2 finds them in a module's output.

    FSDP2 (``collect_grad_tensors``) looks inside dicts, lists, tuples (subclasses and
    named tuples too) and dataclasses, where ``pytree`` sees an unregistered subclass
    or dataclass as one leaf; a tensor it missed would get no pre-backward hook, and
    backward would run on freed parameters.
    """
    found: list[Tensor] = []
    stack: list[tuple[object, int]] = [(tree, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Tensor):
            if item.requires_grad:
                found.append(item)
            continue
        if depth >= _MAX_DEPTH:
            continue
        children: list[object]
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            children = [getattr(item, field.name) for field in dataclasses.fields(item)]
        elif isinstance(item, dict):
            children = list(cast(dict[object, object], item).values())
        elif isinstance(item, list | tuple):
            children = list(cast(list[object] | tuple[object, ...], item))
        else:
            continue
        stack.extend((child, depth + 1) for child in reversed(children))
    return found


#: How deep ``grad_tensors`` looks into nested containers (FSDP2's limit).
_MAX_DEPTH: Final = 128


def in_backward() -> bool:
    """Whether the autograd engine is running a backward in this thread (as FSDP2's ``is_bw``)."""
    return torch._C._current_graph_task_id() != -1


def _count_forward(record: FullyShardState) -> FullyShardState:
    return attrs.evolve(record, forwards=record.forwards + 1)


def become_root(group: ParamGroup) -> None:
    """Lazy init: ``group`` runs forward first, so it is the root of the groups inside it.

    Refuses, as FSDP2's lazy init, with ``ContractError`` (a ``RuntimeError``): a
    root of several modules (a list's application), and a root whose inner
    applications ran forward before it (each became a root of its own).
    """
    _check_single_root(group)
    by_module: dict[int, ParamGroup] = {}
    for candidate in list(ALL_GROUPS):
        for module in candidate.modules():
            by_module[id(module)] = candidate
    found: list[ParamGroup] = [group]
    seen = {id(group)}
    for top in group.modules():
        for module in top.modules():
            other = by_module.get(id(module))
            if other is not None and id(other) not in seen:
                seen.add(id(other))
                found.append(other)
    _check_not_initialized(group, found)
    _check_no_torch_api(group)
    _check_shared(group, found)
    root = Root(found)
    root.streams = streams_for(group.device_type)
    for member in found:
        member.root = root
        member.is_root = member is group


def _check_single_root(group: ParamGroup) -> None:
    """Refuse a list's application as the root: FSDP2 requires a single root module."""
    modules = group.modules()
    if len(modules) > 1:
        labels = ", ".join(module_label(module) for module in modules[:3])
        more = f" and {len(modules) - 3} more" if len(modules) > 3 else ""
        raise ContractError(
            f"fully_shard on {labels}{more}: the first forward ran through modules sharded as "
            "one list, which would make them the root (FSDP2: FSDP requires a single root "
            f"module but got ({labels}{more})); apply fully_shard to a module containing them "
            "too, and run its forward"
        )


def _check_not_initialized(group: ParamGroup, found: list[ParamGroup]) -> None:
    """Refuse a root whose inner applications already ran forward as roots of their own."""
    if all(member.root is None for member in found[1:]):
        return
    top = group.modules()[0]
    for fqn, module in named_tree(top):
        member = next((each for each in found[1:] if id(module) in each.module_ids), None)
        if member is not None and member.root is not None:
            raise ContractError(
                f"fully_shard on {module_label(top)}: the application on {fqn!r} ran forward "
                "before this one, its root (FSDP state has already been lazily initialized for "
                f"{fqn}\nFSDP requires running forward through the root module first); run the "
                "root's forward first, or apply fully_shard to the inner module only"
            )


def _check_no_torch_api(group: ParamGroup) -> None:
    """Refuse torch's ``fully_shard``/``replicate`` applied inside after ours.

    Torch's contract cannot see our rules, so it allowed them; the first forward
    is the first moment to say so.
    """
    for top in group.modules():
        for fqn, module in named_tree(top):
            for name in ("fully_shard", "replicate"):
                if name in torch_registry(module):
                    raise IncompatibleAPIError(
                        f"torchcontract.apis.fully_shard.fully_shard cannot be combined with "
                        f"torch's {name}, applied after it on {type(module).__qualname__} "
                        f"{fqn!r} inside {module_label(top)} (found at the first forward); "
                        "apply only one of them to this part of the model"
                    )


def _check_shared(group: ParamGroup, found: list[ParamGroup]) -> None:
    """Refuse a parameter two applications under the root shard (FSDP2's duplicate check).

    Apply shards a parameter shared with another application's modules again, as
    FSDP2 does; both are one user parameter, of one origin. As FSDP2, the root's
    first forward refuses them with ``AlreadyManagedError`` (a ``ValueError``),
    naming the second by its FQN in the root.
    """
    seen: set[int] = set()
    for member in found:
        for parameter in member.parameters:
            if parameter.origin not in seen:
                seen.add(parameter.origin)
                continue
            modules = group.modules()
            names = root_names(modules[0]) if modules else {}
            fqn = ParamGroup.root_fqn(parameter, names)
            raise AlreadyManagedError(
                f"fully_shard on {module_label(modules[0]) if modules else 'a freed module'}: "
                f"parameter {fqn!r} is sharded by two applications of fully_shard, where the "
                f"modules sharing it are split between them (found at the first forward); "
                f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP "
                "group. For shared/tied parameters, use fully_shard([module_a, module_b]) to "
                "place them in the same FSDP group."
            )


class _PostBackward(torch.autograd.Function):
    """Identity on the inputs; its backward runs the group's post-backward."""

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        group: ParamGroup = ctx.group
        group.post_backward()
        return (None, *grads)


_post_backward_apply: Final = cast(Callable[..., tuple[Tensor, ...]], _PostBackward.apply)


def _with_post_backward(
    group: ParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [
        index
        for index, leaf in enumerate(leaves)
        if isinstance(leaf, Tensor) and leaf.requires_grad
    ]
    if not positions:
        return args, kwargs
    outputs = _post_backward_apply(group, *(leaves[index] for index in positions))
    for index, tensor in zip(positions, outputs, strict=True):
        leaves[index] = tensor
    new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
    return cast(tuple[Any, ...], new_args), cast(dict[str, Any], new_kwargs)
