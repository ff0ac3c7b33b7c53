"""Contract and contract(): apply an API atomically, check it kept every FQN, give typed state.

Apply reads top to bottom in ``Contract.__call__``: find the targets, snapshot
their FQNs, check compatibility and install the default record and registry entry
(one step, under the write lock), run the API function, snapshot again and
compare. All of it runs in a ``Transaction``: any exception, ``BaseException``
included, removes what this call (and any API it applied in turn) installed.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Final,
    Generic,
    Protocol,
    Self,
    TypeVar,
    overload,
)

import attrs
from torch import nn
from typing_extensions import ParamSpec, TypeIs

from ._arguments import bind_arguments
from ._errors import (
    AlreadyAppliedError,
    InvalidRecordError,
    InvalidResultError,
    InvalidStateClassError,
    InvalidTargetError,
    NotAppliedError,
)
from ._fqn import FQNSnapshot, check_strict, check_unchanged, take_snapshot
from ._labels import module_label
from ._registry import REGISTRY, Incompatible, RegistryEntry, check_compatible
from ._store import (
    DEFAULT_STORE,
    Cell,
    StateStore,
    atoms_only_test,
    check_holds_no_module,
)
from ._transaction import WRITE_LOCK, Transaction, open_journal
from ._tree import root_modules

__all__ = [
    "AnyContract",
    "Application",
    "Contract",
    "EmptyState",
    "ModuleContract",
    "ModuleListContract",
    "ModuleSequenceContract",
    "contract",
]

_P = ParamSpec("_P")
# What a call returns: only ever returned, so a contract returning ``nn.Linear`` is
# also a contract returning ``nn.Module`` (or ``object``).
_R_co = TypeVar("_R_co", covariant=True)
# The record class: invariant, since it is both returned (``state``, ``update``) and
# accepted (``set_state``'s record, ``update``'s transition): a contract with records
# ``S`` cannot stand in for one with records ``object``, or ``set_state`` could store any
# object as its record.
_S = TypeVar("_S")
# Application only hands records out: covariant.
_S_co = TypeVar("_S_co", covariant=True)
_Target = TypeVar("_Target", bound="nn.Module | Sequence[nn.Module]")
_Result = TypeVar("_Result", bound="nn.Module | Sequence[nn.Module]")
# The module a call is given, as the caller typed it.
_M = TypeVar("_M", bound=nn.Module)
# The items of the lists an API function declares it takes (``list[nn.Linear]``).
_Item = TypeVar("_Item", bound=nn.Module)


@attrs.frozen
class EmptyState:
    """The record of an API that keeps no state of its own: ``contract()``'s default."""


class Application(Generic[_S_co]):
    """One application of an API: what its hooks hold, so they act for that application only.

    ``record(module)`` is the API's record of ``module`` while that record belongs to
    this application, and None otherwise: on a copy of the module (torch copies
    hooks along with the module) even once the API is applied to the copy, after the
    application was rolled back, and after the module died. Copying or pickling a
    handle gives a detached one, whose ``record`` is always None. Holds no module.

    Taken with ``api.application(module)`` inside the API function; generic in the
    record class, and covariant (it only hands records out).
    """

    __slots__ = ("_cell", "_cells")

    def __init__(self, cells: Mapping[int, Cell[Any]], cell: Cell[Any] | None) -> None:
        self._cells = cells
        self._cell = cell

    def record(self, module: nn.Module) -> _S_co | None:
        """The record of ``module`` if this application installed it, else None.

        Args:
            module: The module the hook was called for.

        Returns:
            The record, while it belongs to this application; None on a copy of the
            module, after a rollback, after the module died, and for a detached handle.
        """
        cell = self._cells.get(id(module))
        if cell is None or cell is not self._cell:
            return None
        record: _S_co = cell.record
        return record

    def __copy__(self) -> Application[_S_co]:
        return Application({}, None)

    def __deepcopy__(self, memo: object) -> Application[_S_co]:
        return Application({}, None)

    def __reduce__(self) -> tuple[type[Application[Any]], tuple[dict[int, Cell[Any]], None]]:
        return Application, ({}, None)

    def __repr__(self) -> str:
        return f"<Application {'detached' if self._cell is None else 'attached'}>"


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
        check = _record_checker(self.name, state_cls, fields, holds_atoms_only)
        self._table = store._table
        # id(module) -> Cell of this API, kept by the store: state() is one dict lookup.
        self._cells = store._table.column(self)
        # state() runs in forward hooks on every step. This closure, put in the
        # instance dict where it takes precedence over the method below, reads the
        # cells directly: no bound method, no attribute read (a third of a lookup's
        # cost). It holds the cells and the name, not the contract: no cycle.
        self.__dict__["state"] = _state_reader(self._cells, self.name)
        self.__dict__["update"] = _updater(
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
        if not args:
            raise InvalidTargetError(
                f"{self.name}: pass the module (or a list of modules) as the first "
                "positional argument"
            )
        given: Any = args[0]
        first: object = given  # narrowed below; ``given`` stays what was passed
        if isinstance(first, nn.Module):
            items = targets = [first]
        else:
            # The items as given, kept apart from ``given``: the function may change that list.
            items = self._items(given)
            targets = root_modules(items)
        entry = RegistryEntry(self, args[1:], kwargs)
        with Transaction():
            before = list(map(self._snapshot, targets))
            self._install(targets, before, entry)
            result: Any = self._func(*args, **kwargs)
            updated = self._updated(given, items, targets, result)
            for old, module in zip(before, updated, strict=True):
                self._verify(old, self._snapshot(module))
        returned: _R_co = given if result is None else result
        return returned

    def _items(self, given: object) -> list[nn.Module]:
        """The modules given: the module, or the items of the list, in order."""
        if isinstance(given, nn.Module):
            return [given]
        if not _is_sequence(given):
            raise InvalidTargetError(
                f"{self.name}: expected an nn.Module or a non-empty list of them as the first "
                f"argument, got {type(given).__qualname__}"
            )
        if not given:
            raise InvalidTargetError(
                f"{self.name}: got an empty list of modules; pass at least one"
            )
        modules: list[nn.Module] = []
        seen: set[int] = set()
        for item in given:
            if not isinstance(item, nn.Module):
                raise InvalidTargetError(
                    f"{self.name}: every item of the module list must be an nn.Module, "
                    f"got {type(item).__qualname__}"
                )
            if id(item) in seen:
                raise InvalidTargetError(
                    f"{self.name}: {module_label(item)} appears twice in the module list; "
                    "pass each module once"
                )
            seen.add(id(item))
            modules.append(item)
        return modules

    def _install(
        self, targets: Sequence[nn.Module], before: Sequence[FQNSnapshot], entry: RegistryEntry
    ) -> None:
        """Check rules, then install one shared default record and the entry on every target."""
        cell = Cell(self.state_cls())
        with WRITE_LOCK:
            check_compatible(entry, targets, before, module_label)
            # Refuse before writing anything: lock-free readers on other threads must
            # never see a list apply installed on some targets and then taken back.
            for target in targets:
                if REGISTRY.get(target, self) is not None:
                    raise AlreadyAppliedError(
                        f"{self.name} is already applied to {module_label(target)}; "
                        "an API applies once per module: read or update its state instead"
                    )
            for target in targets:
                REGISTRY.insert(target, self, entry)
                self._table.insert(target, self, cell)

    def _updated(
        self,
        given: object,
        items: Sequence[nn.Module],
        targets: Sequence[nn.Module],
        result: object,
    ) -> Sequence[nn.Module]:
        """The modules to compare with ``targets``: what ``func`` returned, in input order.

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
            f"{self.name} returned {type(result).__qualname__}; an API function returns the "
            "module (or list of modules) it was given, a replacement with the same FQNs, or None "
            f"(applied to {module_label(targets[0])}"
            f"{f' and {len(targets) - 1} more' if len(targets) > 1 else ''})"
        )

    def _snapshot(self, module: nn.Module) -> FQNSnapshot:
        """``module``'s FQN snapshot; a cyclic or too deep tree is an error naming this API."""
        return take_snapshot(module, api_name=self.name, label=module_label)

    def _verify(self, before: FQNSnapshot, after: FQNSnapshot) -> None:
        check_unchanged(self.name, module_label, before, after)
        if self.strict:
            check_strict(self.name, before, after)

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
            raise _not_applied(self.name, module)
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
        updater: _Updater = self.__dict__["update"]
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
        updater: _Updater = self.__dict__["update"]
        record: _S = updater(module, transition)
        return record

    def _cell(self, module: nn.Module) -> Cell[Any]:
        cell = self._cells.get(id(module))
        if cell is None:
            raise _not_applied(self.name, module)
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


AnyContract = Contract[..., Any, Any]
"""Any contract, whatever its signature, result and record class: what the registry keys by."""

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


class _KeepsModule(Protocol[_P]):
    """An API function ``(module: M, ...) -> M``, generic in the module's class."""

    def __call__(self, module: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _M: ...


def _not_applied(name: str, module: nn.Module) -> NotAppliedError:
    return NotAppliedError(
        f"{name} is not applied to {module_label(module)}; apply it first, "
        "or use get_state() to get None instead"
    )


def _state_reader(cells: Mapping[int, Cell[Any]], name: str) -> Callable[[nn.Module], Any]:
    """``Contract.state`` of the API called ``name``, as a closure over its cells."""

    key = id  # a closure variable: no global and builtins lookup per call

    def state(module: nn.Module) -> Any:
        """The record of ``module``; ``NotAppliedError`` if the API is not applied to it."""
        try:
            return cells[key(module)].record
        except KeyError:
            raise _not_applied(name, module) from None

    state.__qualname__ = f"{name}.state"
    return state


#: Checks a record given to ``method`` for ``module``: ``InvalidRecordError`` if wrong.
_RecordCheck = Callable[[object, str, nn.Module], None]


class _Updater(Protocol):
    """``update(module, transition, method="update")``, as ``_updater`` builds it per contract."""

    def __call__(
        self, module: nn.Module, transition: Callable[[Any], Any], method: str = ..., /
    ) -> Any: ...


def _updater(
    cells: Mapping[int, Cell[Any]],
    name: str,
    state_cls: type[Any],
    holds_atoms_only: Callable[[object], bool],
    check: _RecordCheck,
) -> _Updater:
    """``Contract.update`` of the API called ``name``, as a closure over its cells.

    Hooks may update a record on every step, so the critical section is kept lean:
    the lock's own methods rather than a ``with`` block (half the cost on CPython
    3.11), no attribute reads on the contract, and ``check`` called only for a
    record that is not of exactly the state class with atoms in every field.
    """
    acquire = WRITE_LOCK.acquire
    release = WRITE_LOCK.release
    key, current_journal = id, open_journal  # closure variables: no global lookups

    def update(module: nn.Module, transition: Callable[[Any], Any], method: str = "update") -> Any:
        """Atomically replace ``module``'s record with ``transition(record)``; return it.

        ``method`` names the public method in errors (``set_state`` goes through here).
        """
        acquire()
        try:
            cell = cells.get(key(module))
            if cell is None:
                raise _not_applied(name, module)
            old = cell.record
            record = transition(old)
            if type(record) is not state_cls or not holds_atoms_only(record):
                check(record, method, module)  # the fast test failed: explain, or pass
            cell.record = record
            journal = current_journal()
            if journal is not None:  # outside an apply there is nothing to undo
                journal.append(functools.partial(_undo_write, cell, record, old))
            return record
        finally:
            release()

    update.__qualname__ = f"{name}.update"
    return update


def _undo_write(cell: Cell[Any], record: object, old: object) -> None:
    """The undo step of one write: ``old`` back in ``cell``, unless ``record`` was replaced."""
    if cell.record is record:
        cell.record = old


def _record_checker(
    name: str,
    state_cls: type[Any],
    fields: tuple[str, ...],
    holds_atoms_only: Callable[[object], bool],
) -> _RecordCheck:
    """The record check of the API called ``name``: its class, then no module held.

    A closure, not a method, so that ``_updater`` can hold it without holding the
    contract (no cycle through the contract's ``__dict__``).
    """

    def check(record: object, method: str, module: nn.Module) -> None:
        if type(record) is not state_cls and not isinstance(record, state_cls):
            raise InvalidRecordError(
                f"{name}.{method}: expected a record of class "
                f"{state_cls.__qualname__}, got {type(record).__qualname__} for "
                f"{module_label(module)}; "
                "build one with attrs.evolve(record, ...)"
            )
        if type(record) is not state_cls and attrs.has(subclass := type(record)):
            # A subclass may add fields of its own, and any of them may hold a module.
            names = tuple(field.name for field in attrs.fields(subclass))
            check_holds_no_module(
                record, names, f"{name}.{method}", owner=module, label=module_label
            )
        elif not holds_atoms_only(record):
            check_holds_no_module(
                record, fields, f"{name}.{method}", owner=module, label=module_label
            )

    return check


def _is_sequence(value: object) -> TypeIs[Sequence[object]]:
    """Whether ``value`` is a sequence other than a string, as a list of modules would be."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


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
            if isinstance(rule.other, Contract):
                rule.other.ruled_by.add(api)
        return api


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
