"""The checks after an API function ran: every FQN kept, and (strict) no foreign class or forward.

Compares two ``FQNSnapshot``s of one module, before and after; an error names the
first kind of FQN that differs and explains the difference (which names went, which
came, or where the order changed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import is_
from typing import Final

from torch import nn

from ._errors import ContractError, FQNChangedError
from ._fqn import FQNSnapshot, quote_fqn

__all__ = ["check_strict", "check_unchanged"]

_SHOWN: Final = 8  # names listed per side in an error before "... and N more"


def check_unchanged(
    api_name: str, label: Callable[[nn.Module], str], before: FQNSnapshot, after: FQNSnapshot
) -> None:
    """Raise ``FQNChangedError`` naming the first kind of FQN that differs.

    Parameters are compared as ``named_parameters()`` lists them and then at every
    path, as ``state_dict()`` does: replacing one path of a shared module keeps the
    first list and the module FQNs but loses that path's entries in a state dict.
    """
    if before.same_as(after):
        return
    for kind, old, new in (
        ("parameter", before.parameters, after.parameters),
        ("buffer", before.buffers, after.buffers),
        ("module", before.module_fqns, after.module_fqns),
        ("state_dict parameter", before.state_dict_parameters, after.state_dict_parameters),
    ):
        if old != new:
            raise FQNChangedError(
                f"{api_name} changed the {kind} FQNs of {label(before._modules[0])}: "
                f"{_explain(old, new)}. Composable APIs must keep every FQN and its order; "
                "keep new state in the API's record, not in the module tree"
            )


def check_strict(api_name: str, before: FQNSnapshot, after: FQNSnapshot) -> None:
    """Raise ``ContractError`` if a class changed to a non-subclass or ``forward`` was patched.

    Call only once ``check_unchanged`` passed, so both snapshots list the same FQNs.
    The first offending module in pre-order is reported.
    """
    if (
        not before._forwards
        and not after._forwards
        and all(map(is_, before.classes, after.classes))
    ):
        return  # the common case, answered in C: the same classes, no instance forward
    first_class = _first_foreign_class(before, after)
    first_forward = _first_new_forward(before, after)
    if first_class is not None and (first_forward is None or first_class <= first_forward):
        old_cls, new_cls = before.classes[first_class], after.classes[first_class]
        raise ContractError(
            f"{api_name} changed the class of {old_cls.__qualname__} at "
            f"{quote_fqn(before.module_fqns[first_class])} to {new_cls.__qualname__}, which is "
            "not a subclass of it; an API may only swap in a subclass (as fully_shard does), "
            "or pass strict=False to contract() to allow it"
        )
    if first_forward is not None:
        old_cls = before.classes[first_forward]
        fqn = quote_fqn(before.module_fqns[first_forward])
        where = f"the instance of {old_cls.__qualname__} at {fqn}"
        if first_forward in after._forwards:
            done = f"assigned forward on {where}"
        else:
            done = f"deleted the forward assigned on {where}, so its class's forward runs again"
        raise ContractError(
            f"{api_name} {done}; register a forward pre-hook or hook instead, "
            "or pass strict=False to contract() to allow it"
        )


def _first_foreign_class(before: FQNSnapshot, after: FQNSnapshot) -> int | None:
    """The first position whose module is no longer an instance of its old class.

    A lazy module that materialized (``nn.LazyLinear`` becomes ``nn.Linear`` when it
    first runs) became what its old class's ``cls_to_become`` names: that is PyTorch's
    own doing, not a foreign class.
    """
    if all(map(is_, before.classes, after.classes)):
        return None
    for index, (old_cls, new_module) in enumerate(zip(before.classes, after._modules, strict=True)):
        if not isinstance(new_module, old_cls):
            becomes: object = getattr(old_cls, "cls_to_become", None)
            if not (isinstance(becomes, type) and isinstance(new_module, becomes)):
                return index
    return None


def _first_new_forward(before: FQNSnapshot, after: FQNSnapshot) -> int | None:
    """The first position whose instance-level ``forward`` is not the one it had."""
    old, new = before._forwards, after._forwards
    if not old and not new:
        return None
    changed = [index for index in old.keys() | new.keys() if old.get(index) is not new.get(index)]
    return min(changed, default=None)


def _explain(old: Sequence[str], new: Sequence[str]) -> str:
    old_set, new_set = set(old), set(new)
    only_old = [name for name in old if name not in new_set]
    only_new = [name for name in new if name not in old_set]
    if only_old or only_new:
        return f"only before: {_listing(only_old)}; only after: {_listing(only_new)}"
    if len(old) != len(new):
        return f"{len(old)} names before, {len(new)} after (some name repeats more or less often)"
    index = next(i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
    return f"same names, new order: position {index} was {old[index]!r}, is now {new[index]!r}"


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:_SHOWN])
    more = len(names) - _SHOWN
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"
