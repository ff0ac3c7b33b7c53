"""How a contract reads and writes its records, and the handle its hooks read them through.

``Contract.state`` and ``Contract.update`` are closures made once per contract
(``state_reader``, ``updater``): a hook reads a record in one dictionary lookup and
updates it under the write lock, journaled so a failed apply can undo it. Every record
written is checked (``record_checker``). ``Application`` is the handle an API's hooks
hold, so that they act for that one application only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
from torch import nn

from ._errors import InvalidRecordError, NotAppliedError
from ._labels import module_label
from ._store import Cell, check_holds_no_module
from ._transaction import WRITE_LOCK, open_journal

__all__ = [
    "Application",
    "RecordCheck",
    "Updater",
    "not_applied",
    "record_checker",
    "state_reader",
    "updater",
]

# Application only hands records out: covariant.
_S_co = TypeVar("_S_co", covariant=True)


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


def not_applied(name: str, module: nn.Module) -> NotAppliedError:
    return NotAppliedError(
        f"{name} is not applied to {module_label(module)}; apply it first, "
        "or use get_state() to get None instead"
    )


def state_reader(cells: Mapping[int, Cell[Any]], name: str) -> Callable[[nn.Module], Any]:
    """``Contract.state`` of the API called ``name``, as a closure over its cells."""

    key = id  # a closure variable: no global and builtins lookup per call

    def state(module: nn.Module) -> Any:
        """The record of ``module``; ``NotAppliedError`` if the API is not applied to it."""
        try:
            return cells[key(module)].record
        except KeyError:
            raise not_applied(name, module) from None

    state.__qualname__ = f"{name}.state"
    return state


#: Checks a record given to ``method`` for ``module``: ``InvalidRecordError`` if wrong.
RecordCheck = Callable[[object, str, nn.Module], None]


class Updater(Protocol):
    """``update(module, transition, method="update")``, as ``updater`` builds it per contract."""

    def __call__(
        self, module: nn.Module, transition: Callable[[Any], Any], method: str = ..., /
    ) -> Any: ...


def updater(
    cells: Mapping[int, Cell[Any]],
    name: str,
    state_cls: type[Any],
    holds_atoms_only: Callable[[object], bool],
    check: RecordCheck,
) -> Updater:
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
                raise not_applied(name, module)
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


def record_checker(
    name: str,
    state_cls: type[Any],
    fields: tuple[str, ...],
    holds_atoms_only: Callable[[object], bool],
) -> RecordCheck:
    """The record check of the API called ``name``: its class, then no module held.

    A closure, not a method, so that ``updater`` can hold it without holding the
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
