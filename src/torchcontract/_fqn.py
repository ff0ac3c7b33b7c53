"""FQN snapshots as tuples, and the diff that explains a violation.

One walk of the module tree yields all three name tuples, with exactly the
semantics of ``named_parameters()``, ``named_buffers(remove_duplicate=False)``
and ``named_modules(remove_duplicate=False)``: modules and buffers at every
path, a parameter only at its first path (shared modules and tied parameters
appear once). Identity, not ``__eq__``/``__hash__``, decides what is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs
from torch import nn

from ._errors import ContractError, FQNChangedError

__all__ = ["FQNSnapshot", "check_unchanged", "take_snapshot"]

_SHOWN: Final = 8  # names listed per side in an error before "... and N more"


@attrs.frozen(eq=False)
class FQNSnapshot:
    """The parameter, buffer and module FQNs of a module tree, in ``named_*`` order.

    ``modules`` holds the module objects behind ``module_fqns`` with their class
    and instance-level ``forward`` at snapshot time, for the stricter checks.
    """

    parameters: tuple[str, ...]
    buffers: tuple[str, ...]
    module_fqns: tuple[str, ...]
    modules: tuple[nn.Module, ...] = attrs.field(repr=False)
    classes: tuple[type[nn.Module], ...] = attrs.field(repr=False)
    forwards: tuple[object, ...] = attrs.field(repr=False)


def take_snapshot(root: nn.Module) -> FQNSnapshot:
    """Walk ``root`` once, pre-order, and return its FQN snapshot."""
    params: list[str] = []
    buffers: list[str] = []
    fqns: list[str] = []
    modules: list[nn.Module] = []
    seen_modules: set[int] = set()
    seen_params: set[int] = set()
    add_fqn, add_module, add_param, add_buffer = (
        fqns.append,
        modules.append,
        params.append,
        buffers.append,
    )

    # Recursion with bound methods is the fastest pure-Python walk measured; the
    # depth limit is the one named_modules() already has.
    def visit(fqn: str, module: nn.Module, dot: str) -> None:
        add_fqn(fqn)
        add_module(module)
        own_params = module._parameters
        if own_params and id(module) not in seen_modules:
            seen_modules.add(id(module))
            for name, param in own_params.items():
                if param is not None and id(param) not in seen_params:
                    seen_params.add(id(param))
                    add_param(dot + name)
        own_buffers = module._buffers
        if own_buffers:
            for name, buffer in own_buffers.items():
                if buffer is not None:
                    add_buffer(dot + name)
        children = module._modules
        if children:
            for name, child in children.items():
                if child is not None:
                    child_fqn = dot + name
                    visit(child_fqn, child, child_fqn + ".")

    visit("", root, "")
    return FQNSnapshot(
        tuple(params),
        tuple(buffers),
        tuple(fqns),
        tuple(modules),
        tuple(map(type, modules)),
        tuple([module.__dict__.get("forward") for module in modules]),
    )


def check_unchanged(
    api_name: str, label: Callable[[nn.Module], str], before: FQNSnapshot, after: FQNSnapshot
) -> None:
    """Raise ``FQNChangedError`` naming the first kind of FQN that differs."""
    for kind, old, new in (
        ("parameter", before.parameters, after.parameters),
        ("buffer", before.buffers, after.buffers),
        ("module", before.module_fqns, after.module_fqns),
    ):
        if old != new:
            raise FQNChangedError(
                f"{api_name} changed the {kind} FQNs of {label(before.modules[0])}: "
                f"{_explain(old, new)}. Composable APIs must keep every FQN and its order; "
                "keep new state in the API's record, not in the module tree"
            )


def check_strict(
    api_name: str, label: Callable[[nn.Module], str], before: FQNSnapshot, after: FQNSnapshot
) -> None:
    """Raise ``ContractError`` if a class changed to a non-subclass or ``forward`` was patched.

    Call only once ``check_unchanged`` passed, so both snapshots list the same FQNs.
    """
    for fqn, old_cls, new_module, old_forward in zip(
        before.module_fqns, before.classes, after.modules, before.forwards, strict=True
    ):
        if not isinstance(new_module, old_cls):
            raise ContractError(
                f"{api_name} changed the class of {old_cls.__qualname__} at {_quote(fqn)} to "
                f"{type(new_module).__qualname__}, which is not a subclass of it; an API may "
                "only swap in a subclass (as fully_shard does)"
            )
        new_forward = new_module.__dict__.get("forward")
        if new_forward is not old_forward:
            raise ContractError(
                f"{api_name} assigned forward on the instance of {old_cls.__qualname__} at "
                f"{_quote(fqn)}; register a forward pre-hook or hook instead, or pass "
                "strict=False to contract() to allow it"
            )


def _quote(fqn: str) -> str:
    return repr(fqn) if fqn else "the root"


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
