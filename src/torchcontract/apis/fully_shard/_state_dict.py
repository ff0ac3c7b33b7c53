"""State-dict hooks: ``state_dict()`` and ``load_state_dict()`` always see the shards.

Between a root's forward and its backward, or after ``unshard``, the module holds
the unsharded parameters; saving them would save full plain tensors, and loading
into them would be lost at the next reshard. As FSDP2 does, the group reshards
first; before a save, an all-gather in flight (a prefetch, ``unshard(async_op=True)``)
is kept, as FSDP2 keeps it, so a save on one rank changes no rank's collectives;
before a load it is dropped (it gathered the old values). After a load that
replaced the parameter objects (``assign=True``), the group adopts the new shards.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _torch
from ._group import ParamGroup

__all__ = ["register_state_dict_hooks"]


class _StateDictHooks:
    """The hooks of one application; like the forward hooks, they hold only its group.

    A deep copy or pickle of the model gets hooks without a group, which do nothing.
    """

    __slots__ = ("group",)

    def __init__(self, group: ParamGroup | None) -> None:
        self.group = group

    def __reduce__(self) -> tuple[type[_StateDictHooks], tuple[None]]:
        return _StateDictHooks, (None,)

    def _group_for(self, module: nn.Module) -> ParamGroup | None:
        group = self.group
        if group is None or id(module) not in group.module_ids or group.record() is None:
            return None
        return group

    def reshard(self, module: nn.Module, *args: object) -> None:
        """Before a load: the shards are about to change, so a gather in flight is dropped."""
        if (group := self._group_for(module)) is not None:
            group.reshard()

    def register_shards(self, module: nn.Module, *args: object) -> None:
        """Before a save: the shards stay as they are, and so does a gather in flight."""
        if (group := self._group_for(module)) is not None:
            group.register_shards()

    def adopt(self, module: nn.Module, *args: object) -> None:
        if (group := self._group_for(module)) is not None:
            for parameter in group.parameters:
                parameter.adopt_registered()


def register_state_dict_hooks(
    group: ParamGroup, targets: Sequence[nn.Module]
) -> list[RemovableHandle]:
    """Install the hooks on every target; return their handles."""
    hooks = _StateDictHooks(group)
    handles: list[RemovableHandle] = []
    for target in targets:
        handles.append(_torch.register_state_dict_pre_hook(target, hooks.register_shards))
        handles.append(_torch.register_load_state_dict_pre_hook(target, hooks.reshard))
        handles.append(_torch.register_load_state_dict_post_hook(target, hooks.adopt))
    return handles
