"""The registry: which APIs were applied to a module, with what arguments; and the rules
that say which APIs cannot be combined.

The registry is one process-wide, weak, identity-keyed table, whatever store an
API keeps its records in, so rules see every application. Entries keep the
arguments of each application; a rule may look at them (``when=``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, get_args, overload

import attrs
from torch import nn
from typing_extensions import TypeVar

from ._arguments import FIX_THE_CALL, close_name, parameter_names
from ._errors import (
    ArgumentBindingError,
    IncompatibleAPIError,
    RulePredicateError,
    UnknownTorchAPIError,
)
from ._fqn import FQNSnapshot, descendants
from ._store import ModuleTable

if TYPE_CHECKING:
    from ._contract import AnyContract

__all__ = [
    "REGISTRY",
    "Incompatible",
    "RegistryEntry",
    "RuleScope",
    "TorchAPIName",
    "check_compatible",
    "registry",
]


_NO_KWARGS: Mapping[str, Any] = MappingProxyType({})


def _read_only(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    # Most applications pass no keyword arguments: they share one empty mapping,
    # which saves two objects per entry, kept as long as the module lives.
    return MappingProxyType(dict(kwargs)) if kwargs else _NO_KWARGS


# The contract an entry records: only read, so an entry of a contract returning
# nn.Linear is an entry of one returning nn.Module; any contract by default.
_C_co = TypeVar("_C_co", bound="AnyContract", covariant=True, default="AnyContract")


@attrs.frozen(eq=False)
class RegistryEntry(Generic[_C_co]):
    """One application of an API to a module: the API and the arguments it was called with.

    Generic in the contract: ``api.entry(module).api`` is typed as ``api`` itself.
    ``args`` and ``kwargs`` are as passed, without the module; ``arguments`` binds
    them to the API function's signature, defaults included. They are kept as given,
    for as long as the module lives, and not walked: an argument that reaches the
    module (itself, a bound method of it, a closure over it) keeps it alive.
    Entries are made by applying an API; read them with ``registry(module)`` or
    ``api.entry(module)``. Compared by identity.

    Attributes:
        api: The contract that was applied.
        args: The positional arguments of the call, without the module.
        kwargs: The keyword arguments of the call (a read-only mapping).
    """

    api: _C_co
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = attrs.field(converter=_read_only)

    @property
    def arguments(self) -> Mapping[str, object]:
        """Every parameter but the module, by name, as bound at the call, defaults filled in.

        Values are ``object``: narrow them (``isinstance``, ``is True``) before use.

        Raises:
            ArgumentBindingError: The call's arguments do not fit the API function's
                signature (an untyped caller's misspelt keyword); the message names the
                keyword and the closest parameter.
        """
        return self.api.bind_arguments(self.args, self.kwargs)


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
    from torch.distributed._composable.contract import REGISTRY_KEY

    # Read __dict__ directly: a missing attribute costs nn.Module.__getattr__ a raise.
    found = module.__dict__.get(REGISTRY_KEY)
    return MappingProxyType(dict(found) if found is not None else {})


#: Where a rule forbids the other API: the same module only, or also around and inside it.
RuleScope = Literal["module", "tree"]
"""Where a rule forbids the other API: ``"module"``, the same module only; ``"tree"``, also
modules nested inside or around it."""


#: The names under which torch's composable APIs register in this torch (its ``@contract``
#: keys an API by its function's name): ``torch.distributed._composable``'s ``checkpoint``
#: and ``replicate``, and FSDP2's ``fully_shard``.
TorchAPIName = Literal["checkpoint", "fully_shard", "replicate"]
"""The names torch's composable APIs register under (its ``@contract`` keys an API by its
function's name), which an ``Incompatible`` rule may name instead of a contract."""
TORCH_API_NAMES: Final[tuple[str, ...]] = get_args(TorchAPIName)


def _check_torch_name(other: object) -> None:
    # Checked at run time too: callers that are not type-checked would otherwise get a
    # rule that silently never fires.
    if isinstance(other, str) and other not in TORCH_API_NAMES:
        names = ", ".join(repr(name) for name in TORCH_API_NAMES)
        raise UnknownTorchAPIError(
            f"Incompatible({other!r}): torch registers no composable API under that name"
            f"{close_name(other, list(TORCH_API_NAMES))}; name one of {names}, "
            "or pass the contract itself"
        )


_C = TypeVar("_C", bound="AnyContract")


@attrs.frozen(init=False)
class Incompatible:
    """A rule: the declaring API cannot be combined with ``other``.

    ``other`` is a contract, or the name under which a torch composable API registers
    (``TorchAPIName``: ``"checkpoint"``, ``"replicate"``, ``"fully_shard"``; any other
    name raises ``UnknownTorchAPIError`` here, at decoration).
    ``scope="module"`` forbids both on the same module; ``"tree"`` (default) also on
    a module nested inside or around it. ``when`` narrows the rule to applications
    of ``other`` whose entry it accepts, e.g. ``lambda e: e.arguments["use_reentrant"]``.
    The rule holds in both application orders; it is checked before the API function runs.
    ``when`` is checked against ``other``: it receives ``RegistryEntry[type of other]``,
    so ``entry.api`` is typed as ``other``. A predicate that raises is reported as
    ``RulePredicateError`` naming the rule, or ``ArgumentBindingError`` when the call it
    reads has arguments the API does not take.

    Args:
        other: The API the declaring one cannot be combined with: a contract, or a
            ``TorchAPIName``.
        scope: ``"tree"`` (default) forbids ``other`` on the same module and on modules
            nested inside or around it; ``"module"`` on the same module only.
        when: A predicate on ``other``'s registry entry; the rule applies only where it
            answers True. Not for a torch API, whose registry records no arguments.

    Raises:
        UnknownTorchAPIError: ``other`` is a string torch registers no API under; the
            message lists the known names and the closest one.
        TypeError: ``when`` was given for a torch API.
    """

    other: AnyContract | TorchAPIName
    scope: RuleScope
    when: Callable[[RegistryEntry], bool] | None

    # A hand-written __init__, generic in the other contract, so that ``when`` is checked
    # against (and a lambda's parameter inferred as) that contract's entry, while the
    # rule itself stays one type: lists of rules of different contracts need no Any.
    @overload
    def __init__(self, other: TorchAPIName, scope: RuleScope = "tree") -> None: ...
    @overload
    def __init__(
        self,
        other: _C,
        scope: RuleScope = "tree",
        when: Callable[[RegistryEntry[_C]], bool] | None = None,
    ) -> None: ...
    def __init__(
        self,
        other: AnyContract | TorchAPIName,
        scope: RuleScope = "tree",
        when: Callable[[RegistryEntry[Any]], bool] | None = None,
    ) -> None:
        _check_torch_name(other)
        if when is not None and isinstance(other, str):
            raise TypeError(
                f"Incompatible({other!r}, when=...): torch's registry records no arguments, "
                "so a rule on a torch API cannot be narrowed; drop when="
            )
        # Frozen: the fields are set once, here, as attrs' own __init__ would.
        object.__setattr__(self, "other", other)
        object.__setattr__(self, "scope", scope)
        object.__setattr__(self, "when", when)

    def describe(self) -> str:
        """The rule as written, for messages: ``Incompatible(mylib.shard, when=reshards)``."""
        other = repr(self.other) if isinstance(self.other, str) else self.other.name
        when = "" if self.when is None else f", when={_callable_name(self.when)}"
        return f"Incompatible({other}{when})"


def _callable_name(function: Callable[..., object]) -> str:
    return str(getattr(function, "__qualname__", type(function).__qualname__))


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
