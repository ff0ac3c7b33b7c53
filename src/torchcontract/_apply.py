"""Applying a contract: the transaction behind every call of an API, one named step at a time.

``apply`` reads top to bottom: find the targets, snapshot their FQNs, check the rules
and install the default record and registry entry (one step, under the write lock),
run the API function, then compare each tree with its snapshot (a second snapshot and
the checks only where it may differ). All of it runs in a
``Transaction``: any exception, ``BaseException`` included, removes what this call
(and any API it applied in turn) installed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from typing_extensions import TypeIs

from ._api_types import AnyContract, RegistryEntry
from ._errors import AlreadyAppliedError, InvalidResultError, InvalidTargetError
from ._fqn import FQNSnapshot, take_snapshot, unchanged_since
from ._fqn_checks import check_strict, check_unchanged
from ._labels import module_label
from ._registry import REGISTRY, check_compatible
from ._store import Cell, ModuleTable
from ._transaction import WRITE_LOCK, Transaction
from ._tree import root_modules

__all__ = ["apply"]


def apply(
    api: AnyContract,
    func: Callable[..., object],
    table: ModuleTable[AnyContract, Cell[Any]],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    """Apply ``api`` (whose function is ``func``, whose records live in ``table``) atomically.

    Installs the default record and a registry entry, runs the API function, then
    checks that every FQN is unchanged; on any exception all of it is undone. See
    ``contract`` for the errors each step raises.

    Args:
        api: The contract being applied.
        func: Its API function.
        table: The store's table its records go into.
        args: The module (or a non-empty list of distinct modules), then the API
            function's other positional arguments.
        kwargs: The API function's keyword arguments.

    Returns:
        What the API function returned, or what it was given when it returned None.
    """
    if not args:
        raise InvalidTargetError(
            f"{api.name}: pass the module (or a list of modules) as the first positional argument"
        )
    given: Any = args[0]
    first: object = given  # narrowed below; ``given`` stays what was passed
    if isinstance(first, nn.Module):
        items = targets = [first]
    else:
        # The items as given, kept apart from ``given``: the function may change that list.
        items = _items(api.name, given)
        targets = root_modules(items)
    entry = RegistryEntry(api, args[1:], kwargs)
    with Transaction():
        before = [_snapshot(api.name, target) for target in targets]
        _install(api, table, targets, before, entry)
        result: Any = func(*args, **kwargs)
        updated = _updated(api.name, given, items, targets, result)
        for old, module in zip(before, updated, strict=True):
            if not unchanged_since(old, module):  # else every check passes: nothing to take
                _verify(api, old, _snapshot(api.name, module))
    return given if result is None else result


def _items(name: str, given: object) -> list[nn.Module]:
    """The modules given: the module, or the items of the list, in order."""
    if isinstance(given, nn.Module):
        return [given]
    if not _is_sequence(given):
        raise InvalidTargetError(
            f"{name}: expected an nn.Module or a non-empty list of them as the first "
            f"argument, got {type(given).__qualname__}"
        )
    if not given:
        raise InvalidTargetError(f"{name}: got an empty list of modules; pass at least one")
    modules: list[nn.Module] = []
    seen: set[int] = set()
    for item in given:
        if not isinstance(item, nn.Module):
            raise InvalidTargetError(
                f"{name}: every item of the module list must be an nn.Module, "
                f"got {type(item).__qualname__}"
            )
        if id(item) in seen:
            raise InvalidTargetError(
                f"{name}: {module_label(item)} appears twice in the module list; "
                "pass each module once"
            )
        seen.add(id(item))
        modules.append(item)
    return modules


def _snapshot(name: str, module: nn.Module) -> FQNSnapshot:
    """``module``'s FQN snapshot; a cyclic or too deep tree is an error naming the API."""
    return take_snapshot(module, api_name=name, label=module_label)


def _install(
    api: AnyContract,
    table: ModuleTable[AnyContract, Cell[Any]],
    targets: Sequence[nn.Module],
    before: Sequence[FQNSnapshot],
    entry: RegistryEntry,
) -> None:
    """Check rules, then install one shared default record and the entry on every target."""
    cell = Cell(api.state_cls())
    with WRITE_LOCK:
        check_compatible(entry, targets, before, module_label)
        # Refuse before writing anything: lock-free readers on other threads must
        # never see a list apply installed on some targets and then taken back.
        for target in targets:
            if REGISTRY.get(target, api) is not None:
                raise AlreadyAppliedError(
                    f"{api.name} is already applied to {module_label(target)}; "
                    "an API applies once per module: read or update its state instead"
                )
        for target in targets:
            REGISTRY.insert(target, api, entry)
            table.insert(target, api, cell)


def _updated(
    name: str,
    given: object,
    items: Sequence[nn.Module],
    targets: Sequence[nn.Module],
    result: object,
) -> Sequence[nn.Module]:
    """The modules to compare with ``targets``: what the function returned, in input order.

    A returned list is matched to ``items``, the modules given, by position: the
    function may have replaced items of the very list it was given and returned it.
    """
    if result is None:
        return targets
    if isinstance(given, nn.Module):
        if isinstance(result, nn.Module):
            return [result]
    elif _is_sequence(result):
        modules = [item for item in result if isinstance(item, nn.Module)]
        if len(modules) == len(result) == len(items):
            position = {id(module): index for index, module in enumerate(items)}
            return [modules[position[id(target)]] for target in targets]
    raise InvalidResultError(
        f"{name} returned {type(result).__qualname__}; an API function returns the "
        "module (or list of modules) it was given, a replacement with the same FQNs, or None "
        f"(applied to {module_label(targets[0])}"
        f"{f' and {len(targets) - 1} more' if len(targets) > 1 else ''})"
    )


def _verify(api: AnyContract, before: FQNSnapshot, after: FQNSnapshot) -> None:
    """Raise unless ``after`` keeps every FQN of ``before`` (and, if strict, class and forward)."""
    if not before.same_as(after):  # else nothing changed: check_unchanged would return
        check_unchanged(api.name, module_label, before, after)
    if api.strict:
        check_strict(api.name, before, after)


def _is_sequence(value: object) -> TypeIs[Sequence[object]]:
    """Whether ``value`` is a sequence other than a string, as a list of modules would be."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
