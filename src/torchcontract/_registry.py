"""The registry: which APIs were applied to a module, with what arguments; and the check
that no rule forbids a new application.

The registry is one process-wide, weak, identity-keyed table, whatever store an
API keeps its records in, so rules see every application. Entries keep the
arguments of each application; a rule may look at them (``when=``). The entry and
rule types themselves are in ``_api_types``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import attrs
from torch import nn

from ._api_types import AnyContract, Incompatible, RegistryEntry, RuleScope, TorchAPIName
from ._arguments import FIX_THE_CALL, close_name, parameter_names
from ._errors import ArgumentBindingError, IncompatibleAPIError, RulePredicateError
from ._fqn import FQNSnapshot, descendants
from ._store import ModuleTable

__all__ = ["REGISTRY", "check_compatible", "registry", "torch_registry"]


#: Module -> {api: entry}, in application order. Every entry in ``api``'s column records
#: ``api``, which is what lets ``Contract.entry`` hand it out typed by the contract.
REGISTRY: Final[ModuleTable[AnyContract, RegistryEntry[Any]]] = ModuleTable()


def registry(module: nn.Module) -> Mapping[AnyContract, RegistryEntry]:
    """The APIs applied to exactly ``module`` (not its descendants), in application order.

    One process-wide table, whatever store each API keeps its records in.

    Args:
        module: The module to look up.

    Returns:
        A read-only copy mapping each contract applied to ``module`` to its entry;
            empty, never None, when nothing is applied.
    """
    return MappingProxyType(dict(REGISTRY.row(module)))


def torch_registry(module: nn.Module) -> Mapping[str, object]:
    """The composable APIs of ``torch.distributed._composable`` applied to ``module``, by name.

    Torch keeps its own registry on the module; torchcontract's rules can name these
    APIs (``TorchAPIName``), and ``describe`` shows them beside ours.

    Args:
        module: The module to look up.

    Returns:
        A read-only mapping from the name torch registers an API under
            (``"fully_shard"``, ``"replicate"``, ``"checkpoint"``) to torch's entry; empty
            when torch applied none.
    """
    # Read __dict__ directly: a missing attribute costs nn.Module.__getattr__ a raise.
    found = module.__dict__.get(_torch_registry_key())
    return MappingProxyType(dict(found) if found is not None else {})


@functools.cache
def _torch_registry_key() -> str:
    """The ``__dict__`` key of torch's registry, imported when first needed."""
    from torch.distributed._composable.contract import REGISTRY_KEY

    key: str = REGISTRY_KEY
    return key


def _torch_applied(module: nn.Module, name: str) -> bool:
    """Whether torch applied its API called ``name`` to ``module``: one lookup, no copy.

    What a rule naming a torch API asks of every module inside a target.
    """
    found: Mapping[str, object] | None = module.__dict__.get(_torch_registry_key())
    return found is not None and name in found


@attrs.frozen
class _Ban:
    """What one rule forbids next to a new application: ``other`` where ``rule.when`` accepts
    its entry (``rule`` is None when the rule was already decided)."""

    other: AnyContract | TorchAPIName
    scope: RuleScope
    rule: Incompatible | None


def _bans(entry: RegistryEntry, target: Callable[[], str]) -> list[_Ban]:
    """The rules that can fire for ``entry``: its API's own, and others' that name it.

    A rule declared by another API narrows on the new application's arguments, so it
    is decided here, once; only rules that still hold become bans. ``target()`` labels
    the module being applied to, for errors only.
    """
    api = entry.api
    bans = [_Ban(rule.other, rule.scope, rule) for rule in api.rules]
    for declarer in list(api.ruled_by):
        if not REGISTRY.column(declarer):
            continue  # applied to no live module: its rules cannot fire
        for rule in declarer.rules:
            if rule.other is api and _accepts(declarer, rule, entry, target):
                bans.append(_Ban(declarer, rule.scope, None))
    return bans


def _accepts(
    declarer: AnyContract, rule: Incompatible, entry: RegistryEntry, where: Callable[[], str]
) -> bool:
    """Whether ``rule`` (of ``declarer``) holds for ``entry``, the application on ``where()``.

    Errors of the predicate become the library's own, naming the rule: a call whose
    arguments do not bind (``ArgumentBindingError``), a predicate that raised
    (``RulePredicateError``; a ``KeyError`` names the parameters there are). Names are
    built only for an error: ``where`` is called only then.
    """
    if rule.when is None:
        return True
    context = f"the rule {rule.describe()} of {declarer.name}"
    try:
        return rule.when(entry)
    except ArgumentBindingError as error:
        message = str(error).removesuffix(FIX_THE_CALL)
        raise ArgumentBindingError(
            f"{message}; {context} reads them (on {where()}){FIX_THE_CALL}"
        ) from None
    except Exception as error:
        api = entry.api
        if isinstance(error, KeyError) and error.args:
            names = parameter_names(api._api_signature)
            key = error.args[0]
            problem = (
                f"reads argument {key!r}, which {api.name} does not have"
                f"{close_name(key, names)}; its parameters are "
                f"{', '.join(repr(name) for name in names) or 'none but the module'}"
            )
        else:
            problem = f"raised {type(error).__qualname__}: {error}"
        raise RulePredicateError(
            f"{context} {problem} (reading {api.name}'s arguments on {where()}); fix the predicate"
        ) from error


def check_compatible(
    entry: RegistryEntry,
    targets: Sequence[nn.Module],
    snapshots: Sequence[FQNSnapshot],
    label: Callable[[nn.Module], str],
) -> None:
    """Raise ``IncompatibleAPIError`` if ``entry`` may not be applied to ``targets``.

    ``snapshots[i]`` is the FQN snapshot of ``targets[i]``; it lists what is inside.
    Costs nothing for an API no rule concerns, one registry lookup per module inside
    for tree-wide rules, and a walk only of registered ancestors that hold a banned API.
    """
    api = entry.api
    if not api.rules and not api.ruled_by:
        return  # the common case: no rule names this API, nor does it name one
    bans = _bans(entry, functools.partial(label, targets[0]))
    if not bans:
        return
    tree_wide = any(ban.scope == "tree" for ban in bans)
    banned = list(
        {id(ban.other): ban.other for ban in bans if not isinstance(ban.other, str)}.values()
    )
    for target, snapshot in zip(targets, snapshots, strict=True):
        neighbours = _neighbours(target, snapshot._modules, banned) if tree_wide else ()
        for module, relation in ((target, "same"), *neighbours):
            for ban in bans:
                if relation != "same" and ban.scope == "module":
                    continue
                if isinstance(ban.other, str):
                    # torch's registry cannot be searched upwards: module and inside only.
                    found = relation != "around" and _torch_applied(module, ban.other)
                    other_name = f"torch's {ban.other}"
                else:
                    old = REGISTRY.get(module, ban.other)
                    found = old is not None and (
                        ban.rule is None
                        or _accepts(
                            api,
                            ban.rule,
                            old,
                            functools.partial(_name_in, module, relation, snapshot, label),
                        )
                    )
                    other_name = ban.other.name
                if found:
                    raise _conflict(
                        api.name,
                        other_name,
                        label(target),
                        _name_in(module, relation, snapshot, label),
                        relation,
                    )


def _name_in(
    module: nn.Module, relation: str, snapshot: FQNSnapshot, label: Callable[[nn.Module], str]
) -> str:
    """``Linear 'l1'`` for a module inside the target, by its FQN there; else its label.

    Names are built only here, for the error: checking rules builds none.
    """
    if relation == "inside":
        fqn = next(
            name
            for name, candidate in zip(snapshot.module_fqns, snapshot._modules, strict=True)
            if candidate is module
        )
        return f"{type(module).__qualname__} {fqn!r}"
    return label(module)


def _neighbours(
    target: nn.Module, subtree: Sequence[nn.Module], banned: Sequence[AnyContract]
) -> list[tuple[nn.Module, str]]:
    """The target's descendants, and the registered modules holding a banned API around it."""
    found: list[tuple[nn.Module, str]] = []
    seen = {id(target)}
    for module in subtree:
        if id(module) not in seen:
            seen.add(id(module))
            found.append((module, "inside"))
    for api in banned:
        for module in REGISTRY.modules_with(api):
            if id(module) not in seen and _contains(module, target):
                seen.add(id(module))
                found.append((module, "around"))
    return found


def _contains(ancestor: nn.Module, module: nn.Module) -> bool:
    return any(candidate is module for candidate in descendants(ancestor))


def _conflict(
    new_name: str, old_name: str, target: str, module: str, relation: str
) -> IncompatibleAPIError:
    """The error for ``new_name`` on ``target`` meeting ``old_name`` on ``module``."""
    where = {
        "same": f"on the same module, {target}",
        "inside": f"on {module}, inside {target}",
        "around": f"on {module}, which contains {target}",
    }[relation]
    return IncompatibleAPIError(
        f"{new_name} cannot be combined with {old_name}, already applied {where}; "
        f"apply only one of them to this part of the model"
    )
