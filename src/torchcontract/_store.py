"""StateStore: a weak, identity-keyed map from module to records by API.

``ModuleTable`` is the core of both the store and the registry: one row per
module, keyed by ``id(module)``, the row itself a weak reference whose callback
drops it, so a table never keeps a module alive, never calls a module's
``__eq__``/``__hash__`` and never writes into a module's ``__dict__``. A key may
ask for a column, ``id(module) -> value``, which the table keeps in step; that
is what ``Contract.state`` reads, in one lookup. The store's values are ``Cell``
objects holding the current record, so roots of one list apply can share one.
Reads take no lock; writes hold ``WRITE_LOCK`` and are journaled (see
``_transaction``) so a failed apply can undo them.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Final, Generic, TypeVar, cast

import attrs
from torch import nn

from ._api_types import AnyContract
from ._errors import InvalidRecordError
from ._transaction import WRITE_LOCK, on_rollback

__all__ = [
    "Cell",
    "ModuleTable",
    "StateStore",
    "atoms_only_test",
    "check_holds_no_module",
]

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class _Slot(weakref.ref[nn.Module], Generic[_K, _V]):
    """One module's row: a weak reference to it, its id, and its items in insertion order.

    The row is itself the weak reference, and one callback per table serves every
    row, so a module costs its table one object and one dict, not a closure each.
    Made by ``_new_slot``: weakref.ref's own initializer, in C, and two slot writes.
    """

    __slots__ = ("items", "key")
    key: int
    items: dict[_K, _V]


def _new_slot(module: nn.Module, forget: Callable[[_Slot[_K, _V]], None]) -> _Slot[_K, _V]:
    slot: _Slot[_K, _V] = _Slot(module, forget)
    slot.key = id(module)
    slot.items = {}
    return slot


class Cell(Generic[_V]):
    """Holds one API's current record for a module; shared by the roots of one list apply."""

    __slots__ = ("record",)

    def __init__(self, record: _V) -> None:
        self.record = record


class ModuleTable(Generic[_K, _V]):
    """Weak, identity-keyed map ``module -> {key: value}``: the core of store and registry."""

    __slots__ = ("__weakref__", "_column_keys", "_columns", "_drop_column", "_forget", "_slots")

    def __init__(self) -> None:
        self._slots: dict[int, _Slot[_K, _V]] = {}
        # Per key that asked for one (see column), id(module) -> value: one dict lookup
        # for readers of a single key (Contract.state); kept in step with the rows by
        # every write below. Keyed by id(key), read on every insert; weak in the key
        # through _column_keys, whose callbacks drop a dead key's column, so a table
        # never keeps alive an API that no live module holds.
        self._columns: dict[int, dict[int, _V]] = {}
        self._column_keys: dict[int, _KeyRef] = {}
        # One callback per table for every row, and one for every column's key.
        self._forget = _forgetter(weakref.ref(self))
        self._drop_column = _column_dropper(weakref.ref(self))

    def __len__(self) -> int:
        return len(self._slots)

    def row(self, module: nn.Module) -> Mapping[_K, _V]:
        """The live items of ``module`` (empty when it has none); callers must not keep it."""
        slot = self._slots.get(id(module))
        return slot.items if slot is not None else {}

    def get(self, module: nn.Module, key: _K) -> _V | None:
        slot = self._slots.get(id(module))
        return slot.items.get(key) if slot is not None else None

    def column(self, key: _K) -> Mapping[int, _V]:
        """The live map ``id(module) -> value`` of ``key``, for lock-free reads.

        The same object for as long as ``key`` lives, so a reader may keep it; ids of
        dead modules are never in it. Callers must not write to it. Only keys asked
        for get a column, which the table then keeps up to date.
        """
        with WRITE_LOCK:
            column = self._columns.get(id(key))
            if column is None:
                # A copy: a module dying mid-walk drops its row from _slots. dict.copy()
                # allocates no object per row, so no garbage collection (and no weak
                # reference callback dropping a row) can run inside it, as one can
                # inside list(items()), which makes a tuple per row.
                column = self._columns[id(key)] = {
                    module_id: slot.items[key]
                    for module_id, slot in self._slots.copy().items()
                    if key in slot.items
                }
                self._column_keys[id(key)] = _new_key_ref(key, self._drop_column)
            return column

    def modules_with(self, key: _K) -> list[nn.Module]:
        """The live modules that hold ``key``; a copy, safe while others write."""
        column = self.column(key)
        modules: list[nn.Module] = []
        for module_id in list(column):
            slot = self._slots.get(module_id)
            module = slot() if slot is not None else None
            if module is not None:
                modules.append(module)
        return modules

    def modules(self) -> Iterator[nn.Module]:
        """The live modules with at least one item; a copy, safe while others write."""
        for slot in list(self._slots.values()):
            module = slot()
            if module is not None:
                yield module

    def insert(self, module: nn.Module, key: _K, value: _V) -> None:
        """Add ``key`` for ``module``, which must not hold it yet (callers check first)."""
        with WRITE_LOCK:
            slot = self._slots.get(id(module))
            if slot is None:
                slot = self._slots[id(module)] = _new_slot(module, self._forget)
            slot.items[key] = value
            column = self._columns.get(id(key))
            if column is not None:
                column[id(module)] = value
            on_rollback(lambda: self._discard(module, key))

    def _discard(self, module: nn.Module, key: _K) -> None:
        slot = self._slots.get(id(module))
        if slot is not None and key in slot.items:
            del slot.items[key]
            column = self._columns.get(id(key))
            if column is not None:
                del column[id(module)]
            if not slot.items:
                del self._slots[id(module)]


def _forgetter(
    table: weakref.ref[ModuleTable[_K, _V]],
) -> Callable[[_Slot[_K, _V]], None]:
    """The weak-reference callback of every row of ``table``: drop a dead module's row."""

    def forget(slot: _Slot[_K, _V]) -> None:
        # Runs when the module dies, before its id can be reused. The table is held
        # weakly so that a StateStore nobody uses any more can be freed.
        this = table()
        if this is not None and this._slots.get(slot.key) is slot:
            del this._slots[slot.key]
            for key in slot.items:
                column = this._columns.get(id(key))
                if column is not None:
                    column.pop(slot.key, None)

    return forget


class _KeyRef(weakref.ref[Any]):
    """A weak reference to a key with a column, and that key's id."""

    __slots__ = ("key",)
    key: int


def _new_key_ref(key: object, drop: Callable[[_KeyRef], None]) -> _KeyRef:
    ref = _KeyRef(key, drop)
    ref.key = id(key)
    return ref


def _column_dropper(table: weakref.ref[ModuleTable[Any, Any]]) -> Callable[[_KeyRef], None]:
    """The callback dropping a dead key's column from ``table`` (held weakly)."""

    def drop(ref: _KeyRef) -> None:
        # Runs when the key dies, before its id can be reused.
        this = table()
        if this is not None and this._column_keys.get(ref.key) is ref:
            del this._column_keys[ref.key]
            this._columns.pop(ref.key, None)

    return drop


def _class_name(module: nn.Module) -> str:
    return type(module).__qualname__


def check_holds_no_module(
    record: object,
    field_names: tuple[str, ...],
    api_name: str,
    error: type[TypeError] = InvalidRecordError,
    *,
    owner: nn.Module | None = None,
    label: Callable[[nn.Module], str] = _class_name,
) -> None:
    """Raise ``error`` if ``record`` keeps an ``nn.Module`` alive through one of its fields.

    A value that references its own key keeps it alive forever in a weak-keyed
    store, so modules are refused in fields and in whatever ``_holds_module`` walks.
    ``error`` is ``InvalidRecordError`` for a record being stored, and
    ``InvalidStateClassError`` for the default record checked at decoration.
    ``owner`` is the module the record is for, when there is one; the message names it
    with ``label`` (the contract passes ``module_label``, which sits above this module).
    """
    for name in field_names:
        if _holds_module(getattr(record, name)):
            raise error(
                f"{api_name}: field {name!r} of {type(record).__qualname__} holds an "
                "nn.Module (itself, in a container, or through a bound method, a closure or "
                "a functools.partial), which would keep the module alive forever; store its "
                "FQN or a weakref.ref to it instead"
                + (f" (record for {label(owner)})" if owner is not None else "")
            )


def atoms_only_test(field_names: tuple[str, ...]) -> Callable[[object], bool]:
    """A test, built once per record class, of whether every field holds an atom.

    An atom holds nothing (see ``_ATOMS``), so a record passing the test needs no
    walk for modules. Fields are read in C (``attrgetter``).
    """
    atoms = _ATOMS
    if not field_names:
        return lambda record: True
    if len(field_names) == 1:
        read_one = operator.attrgetter(field_names[0])  # one name: the value, not a tuple
        return lambda record: type(read_one(record)) in atoms
    read = operator.attrgetter(*field_names)
    covers = atoms.issuperset
    return lambda record: covers(map(type, read(record)))


#: Values that cannot hold anything: most record fields, answered without a walk.
#: Weak references and proxies hold nothing either (a proxy of a module passes
#: ``isinstance(proxy, nn.Module)``, so it must be answered before that test).
_ATOMS: Final = frozenset(
    {
        int,
        float,
        complex,
        bool,
        str,
        bytes,
        type(None),
        weakref.ProxyType,
        weakref.CallableProxyType,
    }
)

#: Methods bound to an object, which they keep alive through ``__self__``.
_BOUND: Final = (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)


def _holds_module(value: object) -> bool:
    """Whether ``value`` is a module or keeps one alive through what it holds.

    Walked: built-in containers (dict keys included), nested attrs records, bound
    methods (their ``__self__``), functions (the contents of their closure cells and
    their defaults) and ``functools.partial`` objects (function, arguments). Without
    recursion, each object once, so a deep or self-referencing value gets an answer
    rather than a ``RecursionError``. Not walked: weak references and proxies, which
    keep nothing alive, and a function's globals, which live as long as its module
    does anyway.
    """
    if type(value) in _ATOMS:
        return False
    pending = [value]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if type(item) in _ATOMS:
            continue
        if isinstance(item, nn.Module):
            return True
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            mapping = cast("dict[object, object]", item)
            pending.extend(mapping.keys())
            pending.extend(mapping.values())
        elif isinstance(item, (tuple, list, set, frozenset)):
            pending.extend(cast("Iterable[object]", item))
        elif attrs.has(cls := type(item)):
            pending.extend(getattr(item, field.name) for field in attrs.fields(cls))
        else:
            pending.extend(_references(item))
    return False


def _references(item: object) -> list[object]:
    """What a callable keeps alive that may be a module: see ``_holds_module``."""
    if isinstance(item, _BOUND):
        return [item.__self__]
    if isinstance(item, types.FunctionType):
        held: list[object] = [*(item.__defaults__ or ()), *(item.__kwdefaults__ or {}).values()]
        for cell in item.__closure__ or ():
            with contextlib.suppress(ValueError):  # a cell not filled yet
                held.append(cell.cell_contents)
        return held
    if isinstance(item, functools.partial):
        partial = cast("functools.partial[object]", item)
        return [partial.func, *partial.args, *partial.keywords.values()]
    return []


class StateStore:
    """Per module, the records of the APIs applied to it, keyed by API identity.

    Weakly keyed by module identity: it never keeps a module alive, works for
    modules that define ``__eq__``/``__hash__`` or are unhashable, and adds nothing
    to a module's ``__dict__``. ``len(store)`` is the number of live modules it
    holds records for, and ``module in store`` whether it holds any for ``module``.
    Thread-safe: reads take no lock, writes are serialized.

    Every contract keeps its records in the shared default store unless made with
    ``contract(..., store=StateStore())``, which isolates them (a test, a library
    that wants its own). Records are read and written through the contract
    (``api.state``, ``api.update``); the store itself is read-only.
    """

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: ModuleTable[AnyContract, Cell[Any]] = ModuleTable()

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, module: object) -> bool:
        return isinstance(module, nn.Module) and bool(self._table.row(module))

    def records(self, module: nn.Module) -> Mapping[AnyContract, object]:
        """A read-only copy of ``module``'s records, by API, in the order they were installed.

        Args:
            module: The module to look up.

        Returns:
            Each contract keeping a record of ``module`` in this store, mapped to that
                record; empty when there is none.
        """
        # dict() copies the row in one step; iterating the live row in Python would
        # fail if another thread installed or removed a record meanwhile.
        row = dict(self._table.row(module))
        return MappingProxyType({api: cell.record for api, cell in row.items()})

    def __repr__(self) -> str:
        return f"<StateStore holding records for {len(self)} modules>"


DEFAULT_STORE: StateStore = StateStore()
