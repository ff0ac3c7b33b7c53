"""StateStore: a weak, identity-keyed map from module to records by API.

A module is keyed by ``id(module)`` and held through a weak reference whose
callback drops its entry, so the store never keeps a module alive, never calls
a module's ``__eq__``/``__hash__`` and never writes into a module's ``__dict__``.
Reads take no lock; writes hold ``WRITE_LOCK`` and are journaled (see
``_transaction``) so a failed apply can undo them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from torch import nn

from ._errors import InvalidRecordError
from ._transaction import WRITE_LOCK, journal_undo

if TYPE_CHECKING:
    from ._contract import AnyContract

__all__ = ["Cell", "ModuleTable", "StateStore", "check_holds_no_module"]

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class _Slot(Generic[_K, _V]):
    """One module's row: a weak reference to it and its items in insertion order."""

    __slots__ = ("items", "ref")

    def __init__(self, ref: weakref.ref[nn.Module]) -> None:
        self.ref = ref
        self.items: dict[_K, _V] = {}


class Cell(Generic[_V]):
    """Holds one API's current record for a module; shared by the roots of one list apply."""

    __slots__ = ("record",)

    def __init__(self, record: _V) -> None:
        self.record = record


class ModuleTable(Generic[_K, _V]):
    """Weak, identity-keyed map ``module -> {key: value}``: the core of store and registry."""

    __slots__ = ("__weakref__", "_slots")

    def __init__(self) -> None:
        self._slots: dict[int, _Slot[_K, _V]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def row(self, module: nn.Module) -> Mapping[_K, _V]:
        """The live items of ``module`` (empty when it has none); callers must not keep it."""
        slot = self._slots.get(id(module))
        return slot.items if slot is not None else {}

    def get(self, module: nn.Module, key: _K) -> _V | None:
        slot = self._slots.get(id(module))
        return slot.items.get(key) if slot is not None else None

    def modules(self) -> Iterator[nn.Module]:
        """The live modules with at least one item; a copy, safe while others write."""
        for slot in list(self._slots.values()):
            module = slot.ref()
            if module is not None:
                yield module

    def insert(self, module: nn.Module, key: _K, value: _V) -> bool:
        """Add ``key`` for ``module``; False, and nothing written, when it is there already."""
        with WRITE_LOCK:
            slot = self._slots.get(id(module))
            if slot is None:
                slot = self._slots[id(module)] = _Slot(
                    weakref.ref(module, self._forgetter(id(module)))
                )
            elif key in slot.items:
                return False
            slot.items[key] = value
            journal_undo(lambda: self._discard(module, key))
            return True

    def replace(self, module: nn.Module, key: _K, value: _V) -> _V | None:
        """Set ``key`` of ``module`` to ``value`` if present; return the old value, or None."""
        with WRITE_LOCK:
            slot = self._slots.get(id(module))
            if slot is None or key not in slot.items:
                return None
            old = slot.items[key]
            slot.items[key] = value
            journal_undo(lambda: self._restore(module, key, value, old))
            return old

    def _discard(self, module: nn.Module, key: _K) -> None:
        slot = self._slots.get(id(module))
        if slot is not None:
            slot.items.pop(key, None)
            if not slot.items:
                del self._slots[id(module)]

    def _restore(self, module: nn.Module, key: _K, written: _V, old: _V) -> None:
        # Put back the old value only if nobody wrote over ours since.
        slot = self._slots.get(id(module))
        if slot is not None and slot.items.get(key) is written:
            slot.items[key] = old

    def _forgetter(self, key: int) -> Callable[[weakref.ref[nn.Module]], None]:
        table = weakref.ref(self)

        def forget(ref: weakref.ref[nn.Module]) -> None:
            # Runs when the module dies, before its id can be reused.
            this = table()
            if this is not None and (slot := this._slots.get(key)) is not None and slot.ref is ref:
                del this._slots[key]

        return forget


def check_holds_no_module(record: object, field_names: tuple[str, ...], api_name: str) -> None:
    """Raise ``InvalidRecordError`` if ``record`` holds an ``nn.Module`` in one of its fields.

    A value that references its own key keeps it alive forever in a weak-keyed
    store, so modules are refused in fields and in built-in containers inside them.
    """
    for name in field_names:
        if _holds_module(getattr(record, name)):
            raise InvalidRecordError(
                f"{api_name}: field {name!r} of {type(record).__qualname__} holds an "
                "nn.Module, which would keep the module alive forever; store its FQN "
                "or a weakref.ref to it instead"
            )


def _holds_module(value: object) -> bool:
    if isinstance(value, nn.Module):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(_holds_module(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_module(item) for item in value.values()) or any(
            isinstance(key, nn.Module) for key in value
        )
    return False


class StateStore:
    """Per module, the records of the APIs applied to it, keyed by API identity.

    Weakly keyed by module identity: it never keeps a module alive, works for
    modules that define ``__eq__``/``__hash__`` or are unhashable, and adds nothing
    to a module's ``__dict__``. ``len(store)`` is the number of live modules it
    holds records for. Thread-safe: reads take no lock, writes are serialized.
    """

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: ModuleTable[AnyContract, Cell[Any]] = ModuleTable()

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, module: object) -> bool:
        return isinstance(module, nn.Module) and bool(self._table.row(module))

    def records(self, module: nn.Module) -> Mapping[AnyContract, object]:
        """A read-only copy of ``module``'s records, by API, in the order they were installed."""
        return MappingProxyType({api: cell.record for api, cell in self._table.row(module).items()})

    def __repr__(self) -> str:
        return f"<StateStore holding records for {len(self)} modules>"


DEFAULT_STORE: StateStore = StateStore()
