"""The registry: which APIs were applied to a module, with what arguments; and the rules
that say which APIs cannot be combined.

The registry is one process-wide, weak, identity-keyed table, whatever store an
API keeps its records in, so rules see every application. Entries keep the
arguments of each application; a rule may look at them (``when=``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs
from torch import nn

from ._errors import IncompatibleAPIError
from ._fqn import FQNSnapshot
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
    them to the API function's signature, defaults included.
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
    from torch.distributed._composable.contract import _get_registry

    found = _get_registry(module)
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


def _rules_between(new: RegistryEntry, old: RegistryEntry) -> Iterator[Incompatible]:
    """The rules, declared by either side, that forbid ``new`` next to ``old``."""
    for rule in new.api.rules:
        if rule.other is old.api and (rule.when is None or rule.when(old)):
            yield rule
    for rule in old.api.rules:
        if rule.other is new.api and (rule.when is None or rule.when(new)):
            yield rule


def check_compatible(
    entry: RegistryEntry,
    targets: Sequence[nn.Module],
    snapshots: Sequence[FQNSnapshot],
    label: Callable[[nn.Module], str],
) -> None:
    """Raise ``IncompatibleAPIError`` if ``entry`` may not be applied to ``targets``.

    ``snapshots[i]`` is the FQN snapshot of ``targets[i]``; it names what is inside.
    """
    api = entry.api
    if not api.rules and not api.ruled_by:
        return
    for target, snapshot in zip(targets, snapshots, strict=True):
        for module, relation in _neighbours(target, snapshot.modules):
            for old in REGISTRY.row(module).values():
                for rule in _rules_between(entry, old):
                    if relation == "same" or rule.scope == "tree":
                        raise _conflict(
                            api.name,
                            old.api.name,
                            label(target),
                            _name_in(module, relation, snapshot, label),
                            relation,
                        )
            for rule in api.rules:
                if (
                    isinstance(rule.other, str)
                    and (relation == "same" or rule.scope == "tree")
                    and rule.other in torch_registry(module)
                ):
                    raise _conflict(
                        api.name,
                        f"torch's {rule.other}",
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


def _neighbours(target: nn.Module, subtree: Sequence[nn.Module]) -> Iterator[tuple[nn.Module, str]]:
    """The target, its descendants, and the registered modules that contain it."""
    yield target, "same"
    seen = {id(target)}
    for module in subtree:
        if id(module) not in seen:
            seen.add(id(module))
            yield module, "inside"
    for module in REGISTRY.modules():
        if id(module) not in seen and _contains(module, target):
            seen.add(id(module))
            yield module, "around"


def _contains(ancestor: nn.Module, module: nn.Module) -> bool:
    return any(candidate is module for candidate in _iter_tree(ancestor))


def _iter_tree(root: nn.Module) -> Iterable[nn.Module]:
    stack = [root]
    while stack:
        module = stack.pop()
        yield module
        stack.extend(child for child in module._modules.values() if child is not None)


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
