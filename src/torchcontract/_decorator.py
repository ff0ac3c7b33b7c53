"""contract(): check the record class, then make an API function a typed ``Contract``.

``contract(StateClass)`` returns a ``ContractDecorator``, whose overloads give the
``Contract`` the type that fits the function's shape (``ModuleContract`` and so on).
``EmptyState`` is the record of an API that keeps none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Concatenate, Generic, Protocol, TypeVar, overload

import attrs
from torch import nn
from typing_extensions import ParamSpec, TypeIs

from ._api_types import Incompatible
from ._contract import (
    Contract,
    EmptyState,
    ModuleContract,
    ModuleListContract,
    ModuleSequenceContract,
)
from ._errors import InvalidStateClassError
from ._store import DEFAULT_STORE, StateStore, check_holds_no_module

__all__ = ["ContractDecorator", "EmptyState", "contract"]

_P = ParamSpec("_P")
# The record class: invariant, as in ``Contract``.
_S = TypeVar("_S")
_Target = TypeVar("_Target", bound="nn.Module | Sequence[nn.Module]")
_Result = TypeVar("_Result", bound="nn.Module | Sequence[nn.Module]")
# The module a call is given, as the caller typed it.
_M = TypeVar("_M", bound=nn.Module)
# The items of the lists an API function declares it takes (``list[nn.Linear]``).
_Item = TypeVar("_Item", bound=nn.Module)


class _KeepsModule(Protocol[_P]):
    """An API function ``(module: M, ...) -> M``, generic in the module's class."""

    def __call__(self, module: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _M: ...


def _check_state_class(state_cls: object) -> tuple[str, ...]:
    """Return the field names of ``state_cls``, a frozen attrs class whose fields have defaults.

    Raise ``InvalidStateClassError`` naming the class and what is wrong otherwise.
    """
    name = getattr(state_cls, "__qualname__", repr(state_cls))
    if not isinstance(state_cls, type) or not attrs.has(state_cls):
        raise InvalidStateClassError(
            f"contract({name}): the state class must be an attrs class; "
            "decorate it with @attrs.frozen"
        )
    missing = [field.name for field in attrs.fields(state_cls) if field.default is attrs.NOTHING]
    if missing:
        raise InvalidStateClassError(
            f"contract({name}): fields {missing} have no default; every field needs one, "
            "since apply installs the default record"
        )
    record = state_cls()
    try:
        type(record).__setattr__(record, "_probe", None)
        frozen = False
    except attrs.exceptions.FrozenInstanceError:
        frozen = True
    except AttributeError:  # slotted but not frozen
        frozen = False
    if not frozen:
        raise InvalidStateClassError(
            f"contract({name}): the state class must be frozen; "
            "use @attrs.frozen, not @attrs.define"
        )
    fields = tuple(field.name for field in attrs.fields(state_cls))
    check_holds_no_module(record, fields, f"contract({name})", InvalidStateClassError)
    return fields


class ContractDecorator(Generic[_S]):
    """What ``contract(...)`` returns: called on an API function, it makes its ``Contract``.

    Never constructed directly. Its overloads type the result by the function's shape:
    a function of ``(module: nn.Module, ...)`` returning ``None`` gives a
    ``ModuleContract``, of ``nn.Module | list[nn.Module]`` a ``ModuleListContract``, of
    ``nn.Module | Sequence[nn.Module]`` a ``ModuleSequenceContract``; any other function a
    ``Contract`` over its own signature and return type.
    """

    def __init__(
        self,
        state_cls: type[_S],
        fields: tuple[str, ...],
        store: StateStore,
        rules: tuple[Incompatible, ...],
        strict: bool,
    ) -> None:
        self._state_cls = state_cls
        self._fields = fields
        self._store = store
        self._rules = rules
        self._strict = strict

    @overload
    def __call__(
        self, func: Callable[Concatenate[nn.Module | Sequence[nn.Module], _P], None]
    ) -> ModuleSequenceContract[_P, _S]: ...
    @overload
    def __call__(
        self, func: Callable[Concatenate[nn.Module | list[_Item], _P], None]
    ) -> ModuleListContract[_P, _S]: ...
    @overload
    def __call__(
        self, func: Callable[Concatenate[nn.Module, _P], None]
    ) -> ModuleContract[_P, _S]: ...
    @overload
    def __call__(self, func: _KeepsModule[_P]) -> ModuleContract[_P, _S]: ...
    @overload
    def __call__(
        self, func: Callable[Concatenate[_Target, _P], None]
    ) -> Contract[Concatenate[_Target, _P], _Target, _S]: ...
    @overload
    def __call__(
        self, func: Callable[Concatenate[_Target, _P], _Result]
    ) -> Contract[Concatenate[_Target, _P], _Result, _S]: ...
    @overload
    def __call__(
        self, func: Callable[Concatenate[_Target, _P], _Result | None]
    ) -> Contract[Concatenate[_Target, _P], _Target | _Result, _S]: ...
    def __call__(self, func: Callable[..., object]) -> Contract[..., Any, _S]:
        api: Contract[..., Any, _S] = Contract(
            func,
            self._state_cls,
            fields=self._fields,
            store=self._store,
            rules=self._rules,
            strict=self._strict,
        )
        for rule in self._rules:
            if _is_contract(rule.other):
                rule.other.ruled_by.add(api)
        return api


def _is_contract(value: object) -> TypeIs[Contract[..., Any, Any]]:
    """Whether a rule names a contract (rather than a torch API by its name)."""
    return isinstance(value, Contract)


@overload
def contract(
    *,
    store: StateStore | None = ...,
    incompatible_with: Iterable[Incompatible] = ...,
    strict: bool = ...,
) -> ContractDecorator[EmptyState]: ...
@overload
def contract(
    state_cls: type[_S],
    *,
    store: StateStore | None = ...,
    incompatible_with: Iterable[Incompatible] = ...,
    strict: bool = ...,
) -> ContractDecorator[_S]: ...
def contract(
    state_cls: type[Any] = EmptyState,
    *,
    store: StateStore | None = None,
    incompatible_with: Iterable[Incompatible] = (),
    strict: bool = True,
) -> ContractDecorator[Any]:
    """Make a composable API of ``func(module, *args, **kwargs) -> module | None``.

    Used as a decorator, ``@contract(StateClass)`` on the API function. Calling the
    API it makes raises, before ``func`` runs: ``InvalidTargetError`` for a bad
    first argument, ``CyclicModuleTreeError`` for a tree holding a module inside
    itself, ``IncompatibleAPIError`` when a rule forbids the combination,
    ``AlreadyAppliedError`` on a second application; after it: ``InvalidResultError``
    for a result that is not the module(s) given or a replacement,
    ``FQNChangedError`` when a parameter, buffer or module FQN changed,
    ``ContractError`` for a strict check. On any exception every record and
    registry entry the call installed is removed, and every ``on_rollback`` step
    runs; the module itself keeps whatever ``func`` did to it otherwise.

    Args:
        state_cls: The record class: a frozen attrs class whose fields all have
            defaults. ``EmptyState`` if the API keeps no state.
        store: Where the records live; the shared default store if None.
        incompatible_with: ``Incompatible`` rules naming the APIs this one cannot be
            combined with.
        strict: Also refuse, during an apply, a class change to anything but a
            subclass (or what ``cls_to_become`` names) and assigning or deleting an
            instance's ``forward``.

    Returns:
        A decorator turning ``func`` into a ``Contract``, typed by ``func``'s shape
            (``ModuleContract`` for a function returning None, and so on).

    Raises:
        InvalidStateClassError: ``state_cls`` is not a frozen attrs class whose fields
            all have defaults, or its default record holds a module.
    """
    return ContractDecorator(
        state_cls,
        _check_state_class(state_cls),
        DEFAULT_STORE if store is None else store,
        tuple(incompatible_with),
        strict,
    )
