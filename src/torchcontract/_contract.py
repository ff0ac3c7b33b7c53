"""Contract: the typed handle of a composable API: its records, entries and signatures.

Calling a contract applies it (the steps are in ``_apply``); the rest of the class
reads and replaces records (through the closures of ``_state_access``), hands out
registry entries, and gives the API function's signature. ``ModuleContract`` and its
kin are the types ``contract()`` gives functions that return the module given.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Final, Generic, Self, TypeVar, overload

import attrs
from torch import nn
from typing_extensions import ParamSpec

from ._api_types import Incompatible, RegistryEntry
from ._apply import apply
from ._arguments import bind_arguments
from ._registry import REGISTRY
from ._state_access import (
    Application,
    Updater,
    not_applied,
    record_checker,
    state_reader,
    updater,
)
from ._store import Cell, StateStore, atoms_only_test

__all__ = [
    "Contract",
    "EmptyState",
    "ModuleContract",
    "ModuleListContract",
    "ModuleSequenceContract",
]


@attrs.frozen
class EmptyState:
    """The record of an API that keeps no state of its own: ``contract()``'s default.

    Defined here, beside ``Contract``, so that pickles naming
    ``torchcontract._contract.EmptyState`` keep loading.
    """


_P = ParamSpec("_P")
# What a call returns: only ever returned, so a contract returning ``nn.Linear`` is
# also a contract returning ``nn.Module`` (or ``object``).
_R_co = TypeVar("_R_co", covariant=True)
# The record class: invariant, since it is both returned (``state``, ``update``) and
# accepted (``set_state``'s record, ``update``'s transition): a contract with records
# ``S`` cannot stand in for one with records ``object``, or ``set_state`` could store any
# object as its record.
_S = TypeVar("_S")
# The module a call is given, as the caller typed it.
_M = TypeVar("_M", bound=nn.Module)


class _CallSignature:
    """``Contract.__signature__``: a contract's call signature, and None on the class.

    None on the class lets ``inspect.signature(Contract)`` describe the class as usual;
    a property would hand it the property object.
    """

    def __get__(
        self, instance: Contract[Any, Any, Any] | None, owner: type[object] | None = None
    ) -> inspect.Signature | None:
        return None if instance is None else instance._call_signature()


class Contract(Generic[_P, _R_co, _S]):
    """A composable API: calling it applies ``func`` to a module; ``state`` reads its record.

    Made by ``@contract(StateClass)``. Generic over the API function's signature
    ``_P``, what a call returns ``_R_co`` (covariant) and the record class ``_S``
    (invariant: records go in as well as out). Contracts are
    compared and hashed by identity and pickle by reference.

    Type checkers see the shape the API function has: ``ModuleContract``,
    ``ModuleListContract`` or ``ModuleSequenceContract`` for functions that return
    the module given (at run time all are a ``Contract``).

    Attributes:
        name: ``module.qualname`` of the API function (``mylib.shard``), as every error
            names the API.
        state_cls: The record class.
        store: The ``StateStore`` the records live in.
        rules: The ``Incompatible`` rules this API declared.
        strict: Whether class changes to a non-subclass and instance ``forward``
            assignments are refused during an apply.
    """

    if TYPE_CHECKING:

        @property
        def __wrapped__(self) -> Callable[_P, object]:
            """The API function, as ``functools.update_wrapper`` sets it (read-only)."""
            ...

    def __init__(
        self,
        func: Callable[_P, object],
        state_cls: type[_S],
        *,
        fields: tuple[str, ...],
        store: StateStore,
        rules: tuple[Incompatible, ...],
        strict: bool,
    ) -> None:
        # updated=() keeps this instance's attribute dict compact, which keeps the
        # attribute reads in state() on CPython's fast path (about 20 ns a call);
        # the function's own __dict__ is copied only when it has something in it.
        functools.update_wrapper(self, func, updated=())
        if extra := getattr(func, "__dict__", None):
            self.__dict__.update(extra)
        # help() shows the function's documentation, then what the contract adds.
        self.__doc__ = _documentation(func, state_cls)
        self.__name__: str = func.__name__
        self.__qualname__: str = func.__qualname__
        self._func = func
        self.state_cls = state_cls
        self.store = store
        self.rules = rules
        # The contracts whose rules name this one, so that rules hold in both orders.
        # Weak: a contract made in a function and dropped must not stay around here.
        self.ruled_by: weakref.WeakSet[Contract[..., Any, Any]] = weakref.WeakSet()
        self.strict = strict
        self.name = f"{func.__module__}.{func.__qualname__}"
        # Records are checked on every update: whether every field holds an atom is
        # one test built once, and only a record failing it is explained or walked.
        holds_atoms_only = atoms_only_test(fields)
        check = record_checker(self.name, state_cls, fields, holds_atoms_only)
        self._table = store._table
        # id(module) -> Cell of this API, kept by the store: state() is one dict lookup.
        self._cells = store._table.column(self)
        # state() runs in forward hooks on every step. This closure, put in the
        # instance dict where it takes precedence over the method below, reads the
        # cells directly: no bound method, no attribute read (a third of a lookup's
        # cost). It holds the cells and the name, not the contract: no cycle.
        self.__dict__["state"] = state_reader(self._cells, self.name)
        self.__dict__["update"] = updater(
            self._cells, self.name, state_cls, holds_atoms_only, check
        )
        self._signature: inspect.Signature | None = None

    def __repr__(self) -> str:
        return f"<contract {self.name} with state {self.state_cls.__qualname__}>"

    __signature__ = _CallSignature()

    def _call_signature(self) -> inspect.Signature:
        """The API function's signature, returning what a call returns.

        What ``inspect.signature`` and ``help`` show (through ``__signature__``): a
        function returning None gives back the module (or list) it was given, so the
        result is annotated as the first parameter is.
        """
        signature = self._api_signature
        parameters = list(signature.parameters.values())
        if parameters and signature.return_annotation in (None, "None"):
            return signature.replace(return_annotation=parameters[0].annotation)
        return signature

    def __get__(self, instance: object, owner: type[object] | None = None) -> Self:
        """A contract held by a class is the contract itself, as a ``staticmethod`` is.

        It makes ``help()`` show a contract as the function it is: its signature
        and documentation, not the repr of an object.
        """
        return self

    def __reduce__(self) -> str:
        # Pickle (and copy) by reference, as functions do.
        return self.__qualname__

    # ----------------------------------------------------------------- apply

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co:
        """Apply the API to the module (or list of modules) given first, atomically.

        Installs the default record and a registry entry, runs the API function, then
        checks that every FQN is unchanged; on any exception all of it is undone. See
        ``contract`` for the errors each step raises.

        Args:
            *args: The module (or a non-empty list of distinct modules), then the API
                function's other positional arguments.
            **kwargs: The API function's keyword arguments.

        Returns:
            What the API function returned, or what it was given when it returned None.
        """
        # The steps, top to bottom, are in ``_apply``.
        returned: _R_co = apply(self, self._func, self._table, args, kwargs)
        return returned

    # ----------------------------------------------------------------- state

    def state(self, module: nn.Module) -> _S:
        """The record of ``module``: one dictionary lookup, safe in hooks and under compile.

        Each contract answers through a closure made for it when the contract is made,
        held in its ``__dict__`` under this name; this method only defers to it.

        Args:
            module: A module the API is applied to (each root of a list apply).

        Returns:
            The record, typed as the state class.

        Raises:
            NotAppliedError: The API is not applied to ``module``.
        """
        reader: Callable[[nn.Module], _S] = self.__dict__["state"]
        return reader(module)

    def application(self, module: nn.Module) -> Application[_S]:
        """The handle of the application that gave ``module`` its record, for its hooks.

        Call it inside the API function and let the hooks it installs hold the handle:
        ``handle.record(m)`` answers None on a copy of the module, so hooks a copy
        inherits stay inert even after the API is applied to the copy.

        Args:
            module: The module the API is being applied to.

        Returns:
            The handle; ``handle.record(m)`` gives the record while it belongs to this
                application.

        Raises:
            NotAppliedError: The API is not applied to ``module``.
        """
        return Application(self._cells, self._cell(module))

    def get_state(self, module: nn.Module) -> _S | None:
        """The record of ``module``, or None if the API is not applied to it.

        Args:
            module: Any module.

        Returns:
            The record, or None.
        """
        cell = self._cells.get(id(module))
        if cell is None:
            return None
        record: _S = cell.record
        return record

    def entry(self, module: nn.Module) -> RegistryEntry[Self]:
        """The registry entry of this API's application to ``module``, typed by this contract.

        Args:
            module: The module the API was applied to.

        Returns:
            The entry, whose ``api`` is this contract with its signature and record
                class, and whose ``args``, ``kwargs`` and ``arguments`` are the call's.

        Raises:
            NotAppliedError: The API is not applied to exactly ``module``.
        """
        entry = REGISTRY.get(module, self)
        if entry is None:
            raise not_applied(self.name, module)
        return entry

    def is_applied(self, module: nn.Module) -> bool:
        """Whether this API is applied to exactly ``module`` (not around it).

        Args:
            module: Any module.

        Returns:
            True while ``module`` has this API's record.
        """
        return id(module) in self._cells

    def set_state(self, module: nn.Module, record: _S) -> None:
        """Replace ``module``'s record with ``record``, under the store's write lock.

        Args:
            module: A module the API is applied to.
            record: The new record: an instance of the state class that holds no
                module (store an FQN or a weak reference instead).

        Raises:
            NotAppliedError: The API is not applied to ``module``.
            InvalidRecordError: ``record`` is not of the state class, or reaches a
                module; the message names the field.
        """
        updater: Updater = self.__dict__["update"]
        updater(module, lambda _: record, "set_state")  # checked once, under the lock

    def update(self, module: nn.Module, transition: Callable[[_S], _S]) -> _S:
        """Atomically replace ``module``'s record with ``transition(record)``; return the new one.

        ``transition`` runs exactly once, under the store's write lock, so concurrent
        updates never lose one another; it should be quick and must not wait on other
        threads. If it raises, or returns something other than a record of the state
        class, the record is unchanged. Like ``state``, each contract answers through a
        closure made for it, held in its ``__dict__``; this method only defers to it.

        Args:
            module: A module the API is applied to.
            transition: Takes the current record and returns the new one, typically
                ``lambda s: attrs.evolve(s, calls=s.calls + 1)``.

        Returns:
            The new record.

        Raises:
            NotAppliedError: The API is not applied to ``module``.
            InvalidRecordError: ``transition`` returned something other than a record
                of the state class, or a record that reaches a module.
        """
        updater: Updater = self.__dict__["update"]
        record: _S = updater(module, transition)
        return record

    def _cell(self, module: nn.Module) -> Cell[Any]:
        cell = self._cells.get(id(module))
        if cell is None:
            raise not_applied(self.name, module)
        return cell

    # ----------------------------------------------------------------- arguments

    def bind_arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Bind a call's arguments (without the module) to the API function, defaults filled in.

        What ``RegistryEntry.arguments`` answers.

        Args:
            args: Positional arguments after the module.
            kwargs: Keyword arguments.

        Returns:
            Every parameter but the module, by name.

        Raises:
            ArgumentBindingError: The arguments do not fit the signature; the message
                names the offending keyword and the closest parameter.
        """
        return bind_arguments(self._api_signature, self.name, args, kwargs)

    @property
    def _api_signature(self) -> inspect.Signature:
        """The API function's signature, computed once."""
        if self._signature is None:
            self._signature = inspect.signature(self._func)
        return self._signature


#: The methods every contract adds to its function, listed by ``help()``.
_METHODS: Final = (
    "state(module)",
    "get_state(module)",
    "update(module, transition)",
    "set_state(module, record)",
    "is_applied(module)",
    "application(module)",
    "entry(module)",
    "bind_arguments(args, kwargs)",
)


def _documentation(func: Callable[..., object], state_cls: type[Any]) -> str:
    """``func``'s docstring, then the contract's methods and record class."""
    own = inspect.cleandoc(func.__doc__) + "\n\n" if func.__doc__ else ""
    added = (
        f"A composable API (torchcontract.Contract) keeping records of class "
        f"{state_cls.__qualname__}. Methods: {', '.join(_METHODS)}; "
        "see help(torchcontract.Contract)."
    )
    return own + textwrap.fill(added, width=80)


if TYPE_CHECKING:

    class ModuleContract(Contract[Concatenate[nn.Module, _P], nn.Module, _S]):
        """The type ``contract`` gives an API function ``(module: nn.Module, ...) -> None``.

        Also for a generic ``(module: M, ...) -> M``. A call returns the module it was
        given, typed as the caller typed it: ``api(TinyNet())`` is a ``TinyNet``.
        Static only: at run time every contract is a ``Contract``, and
        ``ModuleContract`` a generic alias of it (test with ``isinstance(x, Contract)``).
        """

        def __call__(self, module: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _M: ...

    class ModuleListContract(ModuleContract[_P, _S]):
        """The type ``contract`` gives ``(module: nn.Module | list[nn.Module], ...) -> None``.

        A call returns what it was given, typed as given: a module as its class, a
        list as the list (``list[nn.Linear]``). Static only, like ``ModuleContract``.
        Also for ``list[M]`` in place of ``list[nn.Module]`` in a generic function.
        """

        @overload
        def __call__(self, module: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _M: ...
        @overload
        def __call__(
            self, module: list[_M], /, *args: _P.args, **kwargs: _P.kwargs
        ) -> list[_M]: ...
        def __call__(
            self, module: nn.Module | list[Any], /, *args: _P.args, **kwargs: _P.kwargs
        ) -> Any: ...

    class ModuleSequenceContract(ModuleListContract[_P, _S]):
        """The type ``contract`` gives ``(module: nn.Module | Sequence[nn.Module], ...) -> None``.

        As ``ModuleListContract``, and any other sequence of modules (a tuple, a
        ``ModuleList``) comes back typed as the sequence of its items. Static only.
        """

        @overload
        def __call__(self, module: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _M: ...
        @overload
        def __call__(
            self, module: list[_M], /, *args: _P.args, **kwargs: _P.kwargs
        ) -> list[_M]: ...
        @overload
        def __call__(
            self, module: Sequence[_M], /, *args: _P.args, **kwargs: _P.kwargs
        ) -> Sequence[_M]: ...
        def __call__(
            self, module: nn.Module | Sequence[Any], /, *args: _P.args, **kwargs: _P.kwargs
        ) -> Any: ...

else:
    # At run time every contract is a Contract; these names are generic aliases of it, so
    # they subscript as the classes above do, and refuse isinstance as any alias does.
    ModuleContract = Contract[Concatenate[nn.Module, _P], nn.Module, _S]
    ModuleListContract = Contract[
        Concatenate[nn.Module | list[nn.Module], _P], nn.Module | list[nn.Module], _S
    ]
    ModuleSequenceContract = Contract[
        Concatenate[nn.Module | Sequence[nn.Module], _P], nn.Module | Sequence[nn.Module], _S
    ]
