"""TorchFullyShardState: what torch's own code finds where it looks up FSDP2's state.

Some of torch's code reaches past ``FSDPModule``'s methods into FSDP2's per-module
state (``FSDPState``), found with ``fully_shard.state(module)`` (torch's contract
reads ``module.__dict__[STATE_KEY][fully_shard]``),
``torch.distributed._composable_state._get_module_state(module)`` or
``module._get_fsdp_state()``. The pipeline schedules do, at the end of each step
(``PipelineStage.perform_reduce_grad``): they run every group's
``post_backward()`` through ``_state_ctx.all_states`` and then
``_root_post_backward_final_callback()``; so do ``register_fsdp_forward_method``
(``_pre_forward``, ``_post_forward``), ``share_comm_ctx`` (``_comm_ctx``) and
``FSDPModule._set_unshard_async_op``. For a module sharded by our ``fully_shard``
those lookups would find ``None`` and fail far from the cause.

So ``fully_shard`` puts one ``TorchFullyShardState`` per application in both
places, on each module it is applied to (``install_torch_state``), and a
rolled-back apply takes it out again. It holds the application's ``ParamGroup``,
as the hooks do, and no module: module -> state -> group, which refers to its
modules weakly, so it goes with the module (torch's map of states holds it
weakly too). It keeps nothing of its own: every answer is read from the group,
its ``Root`` and the application's record.

What it supports, as FSDP2's state: ``_fsdp_param_groups`` and
``_fsdp_param_group`` (a ``TorchParamGroup``: ``post_backward``, ``unshard``,
``wait_for_unshard``, ``reshard``, ``is_unsharded``, ``modules``), ``_is_root``,
``_lazy_init()``, ``_state_ctx`` (``all_states``, ``is_last_backward``,
``post_backward_final_callback_queued``), ``_root_post_backward_final_callback()``,
``_pre_forward``/``_post_forward``, ``_modules``, ``_mp_policy``, and ``_comm_ctx``
and the groups' ``comm_ctx``/``unshard_async_op`` (held, unused: these collectives
run on the caller's stream). Any other attribute raises
``UnsupportedTorchStateError`` naming it, never a silent ``None``: FSDP2's
``FSDPParam`` objects, streams and buffers have no counterpart here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import torch
from torch import nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed._composable_state import _insert_module_state, _module_state_mapping
from torch.distributed._composable_state import _State as TorchState
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from torchcontract import ContractError, IncompatibleAPIError, module_label, on_rollback

from ._group import ParamGroup, Phase, Root, finish_backward
from ._hooks import ForwardHooks, become_root, in_backward

__all__ = [
    "TorchFullyShardState",
    "TorchParamGroup",
    "TorchStateContext",
    "UnsupportedTorchStateError",
    "install_torch_state",
    "remove_torch_state",
    "torch_state_of",
    "without_torch_state",
]


class UnsupportedTorchStateError(ContractError, AttributeError):
    """Code read a part of FSDP2's internal state that ``fully_shard`` has no counterpart for.

    Where torch looks up FSDP2's per-module state (``FSDPState``: ``fully_shard.state(module)``,
    ``module._get_fsdp_state()``), a module sharded by this ``fully_shard`` carries a stand-in
    that serves what torch's own code reads (``FSDPModule``'s methods, the pipeline schedules'
    end-of-step reduction, ``register_fsdp_forward_method``, ``share_comm_ctx``); any other
    attribute raises this, naming it. An ``AttributeError`` too, so ``getattr`` with a
    default and ``hasattr`` answer as for a missing attribute. Tools that walk FSDP2's
    internals (its ``FSDPParam`` objects, streams, buffers; FSDP2's memory tracker) need
    torch's own ``fully_shard``.
    """


def _unsupported(owner: object, name: str) -> NoReturn:
    """Raise for ``name``, read on ``owner`` (a view whose ``_group`` says where)."""
    if name.startswith("__") or name == "_group":  # Python's protocols; a view being built
        raise AttributeError(name)
    group: ParamGroup = object.__getattribute__(owner, "_group")
    modules = group.modules()
    where = module_label(modules[0]) if modules else "a freed module"
    if isinstance(owner, TorchParamGroup):
        name = f"_fsdp_param_group.{name}"
    elif isinstance(owner, TorchStateContext):
        name = f"_state_ctx.{name}"
    raise UnsupportedTorchStateError(
        f"fully_shard on {where}: {name} of FSDP2's state (torch.distributed.fsdp's "
        "FSDPState) is not supported: this module is sharded by torchcontract's "
        "fully_shard, whose state torch reads only through FSDPModule's methods, "
        "pipelining's end-of-step reduction, register_fsdp_forward_method and "
        "share_comm_ctx; use those, or torch's fully_shard for this code"
    )


@functools.cache
def _torch_state_key() -> object:
    """The key torch's contract files ``fully_shard``'s state under in ``module.__dict__``.

    The undecorated function (``fully_shard.__wrapped__``); checked against
    ``fully_shard.state`` at the first apply, so that a release keying it otherwise
    fails there, loudly, rather than leaving every lookup ``None``.
    """
    key: object = getattr(torch_fully_shard, "__wrapped__", None)
    probe, marker = nn.Module(), TorchState()
    probe.__dict__[STATE_KEY] = {key: marker}
    state = cast(Any, torch_fully_shard).state
    if state(probe) is not marker:
        raise ContractError(
            f"fully_shard: torch {torch.__version__} files fully_shard's state under a key "
            "this release of torchcontract does not know; torch's code that reads FSDP2's "
            "state cannot find fully_shard's. Use a torch release torchcontract supports"
        )
    return key


class TorchParamGroup:
    """One application's ``ParamGroup`` as FSDP2's ``FSDPParamGroup`` (its calls torch makes)."""

    __slots__ = ("_group", "comm_ctx", "unshard_async_op")

    def __init__(self, group: ParamGroup) -> None:
        self._group = group
        # Set by share_comm_ctx and _set_unshard_async_op; held, unused (no streams here).
        self.comm_ctx: object = None
        self.unshard_async_op = False

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        return tuple(self._group.modules())

    @property
    def is_unsharded(self) -> bool:
        return self._group.unsharded

    def post_backward(self, *unused: object) -> None:
        """Reduce-scatter the gradients kept so far (or keep them, without sync), reshard.

        As FSDP2's: safe to call when the group took no part in the backward.
        """
        self._group.post_backward()

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the parameters; with ``async_op`` start it, ``wait_for_unshard`` ends it."""
        if async_op:
            self._group.check_materialized()
            self._group.prefetch(requested=True)
        else:
            self._group.unshard()

    def wait_for_unshard(self) -> None:
        """Finish the all-gather and register the unsharded parameters."""
        self._group.unshard()

    def reshard(self) -> None:
        self._group.reshard()

    def __getattr__(self, name: str) -> NoReturn:
        _unsupported(self, name)


class TorchStateContext:
    """FSDP2's ``FSDPStateContext``, shared by the states under one root, read from our root."""

    __slots__ = ("_group",)

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    @property
    def all_states(self) -> list[TorchFullyShardState]:
        """The states of every application under the root, the root's first (none before it)."""
        root = self._group.root
        if root is None:
            return []  # FSDP2's too, before its lazy init
        found = (torch_state_of(group) for group in root.groups)
        return [state for state in found if state is not None]

    @property
    def is_last_backward(self) -> bool:
        group = _root_group(self._group.root) or self._group
        record = group.record()
        return True if record is None else record.is_last_backward

    @property
    def post_backward_final_callback_queued(self) -> bool:
        root = self._group.root
        return root is not None and root.callback_queued

    def __getattr__(self, name: str) -> NoReturn:
        _unsupported(self, name)


class TorchFullyShardState(TorchState):
    """FSDP2's ``FSDPState`` of one ``fully_shard`` application, backed by its group and record.

    Found by ``fully_shard.state(module)``, ``_get_module_state(module)`` and
    ``module._get_fsdp_state()`` for each module the application targets. Reading
    an attribute it does not support raises ``UnsupportedTorchStateError``.
    """

    __slots__ = ("_comm_ctx", "_group", "_param_group")

    def __init__(self, group: ParamGroup) -> None:
        self._group = group
        self._param_group = TorchParamGroup(group)
        self._comm_ctx: object = None  # share_comm_ctx sets it; these collectives use no streams

    @property
    def group(self) -> ParamGroup:
        return self._group

    @property
    def _fsdp_param_groups(self) -> list[TorchParamGroup]:
        return [self._param_group] if self._group.parameters else []

    @property
    def _fsdp_param_group(self) -> TorchParamGroup | None:
        return self._param_group if self._group.parameters else None

    @property
    def _is_root(self) -> bool | None:
        """None until the first forward (or ``_lazy_init``) found the root, then whether it is."""
        return None if self._group.root is None else self._group.is_root

    @property
    def _state_ctx(self) -> TorchStateContext:
        return TorchStateContext(self._group)

    @property
    def _modules(self) -> tuple[nn.Module, ...]:
        return tuple(self._group.modules())

    @property
    def _mp_policy(self) -> MixedPrecisionPolicy:
        record = self._group.record()
        return MixedPrecisionPolicy() if record is None else record.mp_policy

    def _lazy_init(self) -> None:
        """Make this application the root of those inside it, unless a root was found already."""
        if self._group.root is None:
            become_root(self._group)

    def _root_post_backward_final_callback(self) -> None:
        """End the backward: run the post-backwards not yet run, reset the iteration's state."""
        root = self._group.root
        if root is not None:
            finish_backward(root)

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """What ``register_fsdp_forward_method`` runs before the method: our forward pre-hook."""
        result = self._hooks().before(module, args, kwargs)
        return (args, kwargs) if result is None else result

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: object) -> object:
        """What ``register_fsdp_forward_method`` runs after the method: our forward hook.

        A registered method (``generate``) that runs the module's forward inside it
        ends with the parameters resharded, the root's too, as FSDP2's: its
        post-forward then finds the group idle (the inner forward ended it) and
        frees the parameters in full. Kept registered, they would be what
        ``parameters()`` lists, so an optimizer built next would hold plain tensors.
        """
        hooks = self._hooks()
        group = hooks.group_for(module)
        nested = group is not None and group.phase is Phase.IDLE  # a forward ran inside
        result = hooks.after(module, args, output)
        if nested and group is not None and not in_backward():
            group.reshard()
        return output if result is None else result

    def _hooks(self) -> ForwardHooks:
        return ForwardHooks(self._group, self._mp_policy)

    def __getattr__(self, name: str) -> NoReturn:
        _unsupported(self, name)


def install_torch_state(group: ParamGroup, targets: Sequence[nn.Module]) -> None:
    """Put ``group``'s ``TorchFullyShardState`` where torch's lookups find it, on each target.

    Call it inside the apply: a rollback takes it out again. Raises
    ``IncompatibleAPIError``, changing nothing, if torch's map of states already
    holds a state for a target (one of torch's APIs was applied to it).
    """
    for target in targets:
        if target in _module_state_mapping:
            raise IncompatibleAPIError(
                f"torchcontract.apis.fully_shard.fully_shard cannot be applied to "
                f"{module_label(target)}: one of torch's composable APIs (its fully_shard or "
                "replicate) holds state on it already; apply only one of them to this module"
            )
    key = _torch_state_key()
    state = TorchFullyShardState(group)
    for target in targets:
        target.__dict__.setdefault(STATE_KEY, {})[key] = state
        _insert_module_state(target, state)
    on_rollback(lambda: remove_torch_state(targets))


def remove_torch_state(targets: Sequence[nn.Module]) -> None:
    """Take the state ``install_torch_state`` put on ``targets`` out of both places."""
    key = _torch_state_key()
    for target in targets:
        states = _states(target.__dict__)
        if states is not None and isinstance(states.get(key), TorchFullyShardState):
            del states[key]
            if not states:
                del target.__dict__[STATE_KEY]
            _module_state_mapping.pop(target, None)


def _states(namespace: dict[str, object]) -> dict[object, object] | None:
    """torch's composable states in a module's ``__dict__`` (or its pickled copy), if any."""
    states = namespace.get(STATE_KEY)
    return cast("dict[object, object]", states) if isinstance(states, dict) else None


def without_torch_state(reduced: object) -> object:
    """A sharded module's ``__reduce_ex__`` result, its state left without ours.

    A pickle is of the original class, not under ``fully_shard`` (its hooks stand
    aside): torch's lookups must find nothing on it, not a state whose group is gone.
    """
    if not isinstance(reduced, tuple):
        return reduced
    parts = cast("tuple[object, ...]", reduced)
    if len(parts) < 3 or not isinstance(parts[2], dict):
        return parts
    # nn.Module's __getstate__ copies __dict__, not what it holds.
    state = dict(cast("dict[str, object]", parts[2]))
    states = _states(state)
    ours = _torch_state_key()
    if states is not None and ours in states:
        kept = {key: value for key, value in states.items() if key is not ours}
        if kept:
            state[STATE_KEY] = kept
        else:
            del state[STATE_KEY]
    return (*parts[:2], state, *parts[3:])


def torch_state_of(group: ParamGroup) -> TorchFullyShardState | None:
    """The state installed for ``group``'s application, read from its first live module."""
    for module in group.modules():
        states = _states(module.__dict__)
        if states is not None:
            state = states.get(_torch_state_key())
            if isinstance(state, TorchFullyShardState) and state.group is group:
                return state
    return None


def _root_group(root: Root | None) -> ParamGroup | None:
    if root is None:
        return None
    return next((group for group in root.groups if group.is_root), None)
