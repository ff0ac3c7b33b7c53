"""Journaled writes: what an apply installs is undone if the apply fails.

Every write to a module table, and every record written to a ``Cell``, made
while a transaction is open in the current context appends its undo step to
that transaction's journal. A transaction that
fails runs its journal backwards; one that succeeds hands its journal to the
enclosing transaction, so a nested apply is undone with the apply around it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Final

__all__ = ["WRITE_LOCK", "Transaction", "on_rollback", "open_journal"]

#: Serializes every write to every table; reads take no lock.
WRITE_LOCK: Final = threading.RLock()

_Undo = Callable[[], None]
_JOURNAL: Final[ContextVar[list[_Undo] | None]] = ContextVar("torchcontract_journal", default=None)


#: The journal of the transaction open in this context, or None outside any. The
#: context variable's own method: ``Contract.update`` calls it on every write.
open_journal: Final[Callable[[], list[_Undo] | None]] = _JOURNAL.get


def on_rollback(undo: Callable[[], None]) -> None:
    """Call ``undo()`` if the apply running in this context fails, after the API function ran.

    For what an API function does outside the state store (hooks it registers,
    parameters it swaps, groups it adds to a global set): the contract undoes its own
    records and registry entries, and ``undo`` puts the rest back. Undo steps run in
    reverse order of registration, under the store's write lock, on any exception,
    ``BaseException`` included; an apply that succeeds inside another one hands its
    steps to the enclosing apply, so they run if that one fails. ``undo`` must not
    raise. Outside an apply there is nothing to roll back, and ``undo`` is dropped.

    Args:
        undo: Called without arguments if the apply fails; puts back what the API
            function changed just before registering it.
    """
    journal = _JOURNAL.get()
    if journal is not None:
        journal.append(undo)


class Transaction:
    """Context manager: undo every journaled write on any exception, ``BaseException`` included."""

    __slots__ = ("_journal", "_parent", "_token")

    def __enter__(self) -> None:
        self._parent = _JOURNAL.get()
        self._journal: list[_Undo] = []
        self._token = _JOURNAL.set(self._journal)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _JOURNAL.reset(self._token)
        if exc_type is None:
            if self._parent is not None:
                self._parent.extend(self._journal)
            return
        with WRITE_LOCK:
            for undo in reversed(self._journal):
                undo()
