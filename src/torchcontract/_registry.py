"""The registry: which APIs were applied to a module, with what arguments; and the rules
that say which APIs cannot be combined.

The registry is one process-wide, weak, identity-keyed table, whatever store an
API keeps its records in, so rules see every application. Entries keep the
arguments of each application; a rule may look at them (``when=``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs
from torch import nn

from ._errors import IncompatibleAPIError
from ._fqn import FQNSnapshot, descendants
from ._store import ModuleTable

if TYPE_CHECKING:
    from ._contract import AnyContract

__all__ = ["REGISTRY", "Incompatible", "RegistryEntry", "check_compatible", "registry"]


_NO_KWARGS: Mapping[str, Any] = MappingProxyType({})


def _read_only(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    # Most applications pass no keyword arguments: they share one empty mapping,
    # which saves two objects per entry, kept as long as the module lives.
    return MappingProxyType(dict(kwargs)) if kwargs else _NO_KWARGS


@attrs.frozen(eq=False)
class RegistryEntry:
    """One application of an API to a module: the API and the arguments it was called with.

    ``args`` and ``kwargs`` are as passed, without the module; ``arguments`` binds
    them to the API function's signature, defaults included. They are kept as given,
    for as long as the module lives, and not walked: an argument that reaches the
    module (itself, a bound method of it, a closure over it) keeps it alive.
    """

    api: AnyContract
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = attrs.field(converter=_read_only)

    @property
    def arguments(self) -> Mapping[str, Any]:
        """Every parameter but the module, by name, as bound at the call, defaults filled in."""
        return self.api.bind_arguments(self.args, self.kwargs)


#: Module -> {api: entry}, in application order.
REGISTRY: Final[ModuleTable[AnyContract, RegistryEntry]] = ModuleTable()


def registry(module: nn.Module) -> Mapping[AnyContract, RegistryEntry]:
    """The APIs applied to exactly ``module`` (not its descendants), in application order.

    A read-only copy: empty, never None, when nothing is applied.
    """
    return MappingProxyType(dict(REGISTRY.row(module)))


def torch_registry(module: nn.Module) -> Mapping[str, object]:
    """The composable APIs of ``torch.distributed._composable`` applied to ``module``, by name."""
    from torch.distributed._composable.contract import REGISTRY_KEY

    # Read __dict__ directly: a missing attribute costs nn.Module.__getattr__ a raise.
    found = module.__dict__.get(REGISTRY_KEY)
    return MappingProxyType(dict(found) if found is not None else {})


Scope = Literal["module", "tree"]


def _no_torch_when(
    rule: Incompatible,
    attribute: attrs.Attribute[Callable[[RegistryEntry], bool] | None],
    value: Callable[[RegistryEntry], bool] | None,
) -> None:
    if value is not None and isinstance(rule.other, str):
        raise TypeError(
            f"Incompatible({rule.other!r}, when=...): torch's registry records no arguments, "
            "so a rule on a torch API cannot be narrowed; drop when="
        )


@attrs.frozen
class Incompatible:
    """A rule: the declaring API cannot be combined with ``other``.

    ``other`` is a contract, or the name under which a ``torch.distributed._composable``
    API registers (``"checkpoint"``, ``"replicate"``, ``"fully_shard"``).
    ``scope="module"`` forbids both on the same module; ``"tree"`` (default) also on
    a module nested inside or around it. ``when`` narrows the rule to applications
    of ``other`` whose entry it accepts, e.g. ``lambda e: e.arguments["use_reentrant"]``.
    The rule holds in both application orders; it is checked before the API function runs.
    """

    other: AnyContract | str
    scope: Scope = "tree"
    when: Callable[[RegistryEntry], bool] | None = attrs.field(
        default=None, validator=_no_torch_when
    )


@attrs.frozen
class _Ban:
    """What one rule forbids next to a new application: ``other`` where ``accepts`` its entry."""

    other: AnyContract | str
    scope: Scope
    accepts: Callable[[RegistryEntry], bool] | None


def _bans(entry: RegistryEntry) -> list[_Ban]:
    """The rules that can fire for ``entry``: its API's own, and others' that name it.

    A rule declared by another API narrows on the new application's arguments, so it
    is decided here, once; only rules that still hold become bans.
    """
    api = entry.api
    bans = [_Ban(rule.other, rule.scope, rule.when) for rule in api.rules]
    for declarer in list(api.ruled_by):
        if not REGISTRY.column(declarer):
            continue  # applied to no live module: its rules cannot fire
        for rule in declarer.rules:
            if rule.other is api and (rule.when is None or rule.when(entry)):
                bans.append(_Ban(declarer, rule.scope, None))
    return bans


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
    bans = _bans(entry)
    if not bans:
        return
    api = entry.api
    tree_wide = any(ban.scope == "tree" for ban in bans)
    banned = list(
        {id(ban.other): ban.other for ban in bans if not isinstance(ban.other, str)}.values()
    )
    for target, snapshot in zip(targets, snapshots, strict=True):
        neighbours = _neighbours(target, snapshot.modules, banned) if tree_wide else ()
        for module, relation in ((target, "same"), *neighbours):
            for ban in bans:
                if relation != "same" and ban.scope == "module":
                    continue
                if isinstance(ban.other, str):
                    # torch's registry cannot be searched upwards: module and inside only.
                    found = relation != "around" and ban.other in torch_registry(module)
                    other_name = f"torch's {ban.other}"
                else:
                    old = REGISTRY.get(module, ban.other)
                    found = old is not None and (ban.accepts is None or ban.accepts(old))
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
            for name, candidate in zip(snapshot.module_fqns, snapshot.modules, strict=True)
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
