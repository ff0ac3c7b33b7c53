"""Explicit prefetching, as FSDP2's ``FSDPModule.set_modules_to_*_prefetch``.

By default a group prefetches implicitly: in forward, the group that followed it
in the previous iteration's forward; in backward, the group whose forward ran
just before it. These functions name the groups instead: the all-gathers of
``modules`` start, on gloo's own threads, right after ``module``'s own all-gather,
so they overlap ``module``'s compute. An empty list restores the implicit
prefetch. Prefetching changes when parameters are gathered, never their values.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from torch import nn

from torchcontract import NotAppliedError, module_label, named_tree

from ._group import ParamGroup
from ._managed import MANAGED

__all__ = [
    "set_implicit_prefetch",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
]


def set_modules_to_forward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """In forward, after ``module``'s all-gather, start those of ``modules``, in order.

    FSDP2's ``FSDPModule.set_modules_to_forward_prefetch``: one module, the next,
    overlaps as the implicit prefetch does; more gather further ahead and hold
    more memory. An empty list restores the implicit prefetch. Raises
    ``NotAppliedError`` if ``module`` or one of ``modules`` is not sharded by
    ``fully_shard`` (applied to it, not to a module around it), ``TypeError`` if
    ``modules`` is not a list of modules; nothing is changed then.
    """
    name = "set_modules_to_forward_prefetch"
    group = _group(name, module, "module")
    targets = _targets(name, module, modules)
    group.forward_prefetch = targets


def set_modules_to_backward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """In backward, after ``module``'s all-gather, start those of ``modules``, in order.

    FSDP2's ``FSDPModule.set_modules_to_backward_prefetch``: it replaces the
    implicit prefetch of the group whose forward ran before ``module``'s (passing
    that one module does the same); an empty list restores it. Raises as
    ``set_modules_to_forward_prefetch``.
    """
    name = "set_modules_to_backward_prefetch"
    group = _group(name, module, "module")
    targets = _targets(name, module, modules)
    group.backward_prefetch = targets


def set_implicit_prefetch(module: nn.Module, enabled: bool) -> None:
    """Turn the implicit prefetch on or off for every ``fully_shard`` application in ``module``.

    On by default. Off, each all-gather starts when its group's forward or
    backward needs it (explicit lists still apply): for measuring what the
    overlap gains, or to hold at most one group unsharded besides the root's.
    Raises ``NotAppliedError`` if no application is on ``module`` or inside it,
    ``TypeError`` if ``enabled`` is not a bool.
    """
    _check_bool(module, enabled)
    groups = [
        group for _, inner in named_tree(module) if (group := MANAGED.group_of(inner)) is not None
    ]
    if not groups:
        raise NotAppliedError(
            f"set_implicit_prefetch on {module_label(module)}: fully_shard is applied neither to "
            "it nor inside it; apply fully_shard first"
        )
    for group in groups:
        group.implicit_prefetch = enabled


def _check_bool(module: nn.Module, enabled: object) -> None:
    """Checked at run time: callers need not be type-checked."""
    if not isinstance(enabled, bool):
        raise TypeError(
            f"set_implicit_prefetch on {module_label(module)}: enabled must be a bool, got "
            f"{type(enabled).__qualname__}; pass True or False"
        )


def _group(name: str, module: object, role: str) -> ParamGroup:
    """The group of the ``fully_shard`` application on ``module``; ``NotAppliedError`` if none."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{name}: {role} must be an nn.Module sharded by fully_shard, got "
            f"{type(module).__qualname__}"
        )
    group = MANAGED.group_of(module)
    if group is None:
        raise NotAppliedError(
            f"{name}: {role} {module_label(module)} is not sharded by fully_shard; apply "
            "fully_shard to it first (to the module itself: a module inside a sharded one "
            "has no all-gather of its own)"
        )
    return group


def _targets(
    name: str, module: nn.Module, modules: Sequence[object]
) -> tuple[weakref.ref[ParamGroup], ...]:
    """The groups of ``modules``, all validated before any is used."""
    if not isinstance(modules, list | tuple):
        raise TypeError(
            f"{name} on {module_label(module)}: modules must be a list of modules sharded by "
            f"fully_shard, got {type(modules).__qualname__}"
        )
    return tuple(
        weakref.ref(_group(name, target, f"modules[{index}]"))
        for index, target in enumerate(modules)
    )
