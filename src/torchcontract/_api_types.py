"""AnyContract, the protocol every contract satisfies, and what names one: its entries and rules.

The lowest place a contract is named. The store and the registry key by ``AnyContract``;
``RegistryEntry`` records one application of a contract, ``Incompatible`` one rule about
it. ``Contract`` (in ``_contract``) satisfies the protocol; nothing here imports it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import Any, Final, Generic, Literal, Protocol, get_args, overload

import attrs
from torch import nn
from typing_extensions import TypeVar

from ._arguments import close_name
from ._errors import UnknownRuleScopeError, UnknownTorchAPIError

__all__ = [
    "TORCH_API_NAMES",
    "AnyContract",
    "Incompatible",
    "RegistryEntry",
    "RuleScope",
    "TorchAPIName",
]


class AnyContract(Protocol):
    """Any contract, whatever its signature, result and record class: what the registry keys by.

    Every ``Contract`` satisfies it. Records go in and out as ``Any``: narrow them, or
    keep the contract's own type (``Contract[P, R, S]``) where the record class matters.
    """

    def __hash__(self) -> int:
        """Contracts hash by identity: they are the keys of the store and the registry."""
        ...

    @property
    def name(self) -> str:
        """``module.qualname`` of the API function, as every error names the API."""
        ...

    @property
    def __name__(self) -> str:
        """The API function's name."""
        ...

    @property
    def state_cls(self) -> type[Any]:
        """The record class."""
        ...

    @property
    def rules(self) -> tuple[Incompatible, ...]:
        """The ``Incompatible`` rules this API declared."""
        ...

    @property
    def ruled_by(self) -> AbstractSet[AnyContract]:
        """The contracts whose rules name this one."""
        ...

    @property
    def strict(self) -> bool:
        """Whether the strict checks run during an apply."""
        ...

    @property
    def _api_signature(self) -> inspect.Signature:
        """The API function's signature."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Apply the API."""
        ...

    def state(self, module: nn.Module) -> Any:
        """The record of ``module``."""
        ...

    def get_state(self, module: nn.Module) -> Any:
        """The record of ``module``, or None."""
        ...

    def is_applied(self, module: nn.Module) -> bool:
        """Whether this API is applied to exactly ``module``."""
        ...

    def set_state(self, module: nn.Module, record: Any) -> None:
        """Replace ``module``'s record."""
        ...

    def update(self, module: nn.Module, transition: Callable[[Any], Any]) -> Any:
        """Atomically replace ``module``'s record with ``transition(record)``."""
        ...

    def bind_arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Bind a call's arguments to the API function."""
        ...


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
        UnknownRuleScopeError: ``scope`` is neither ``"tree"`` nor ``"module"``.
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
        if scope not in get_args(RuleScope):
            raise UnknownRuleScopeError(
                f"Incompatible({_rule_target(other)}, scope={scope!r}): scope is 'tree' (the "
                "module and those nested inside or around it) or 'module' (the same module only)"
            )
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
        when = "" if self.when is None else f", when={_callable_name(self.when)}"
        return f"Incompatible({_rule_target(self.other)}{when})"


def _rule_target(other: AnyContract | str) -> str:
    """How a rule's ``other`` is written in messages: a torch name quoted, a contract's name."""
    return repr(other) if isinstance(other, str) else other.name


def _callable_name(function: Callable[..., object]) -> str:
    return str(getattr(function, "__qualname__", type(function).__qualname__))
