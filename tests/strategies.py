"""Shared pieces of the reliability tests: hypothesis strategies, store contents, thread runs."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Generic, TypeVar

import attrs
from hypothesis import strategies as st
from torch import nn

from torchcontract import AnyContract, NotAppliedError, StateStore, registry

_T = TypeVar("_T")

#: The hypothesis profile of this run (registered in conftest.py): "fuzz" under
#: `make fuzz`, "mutate" under `make mutate`, empty for `make test` and CI.
PROFILE: Final = os.environ.get("TORCHCONTRACT_HYPOTHESIS_PROFILE", "")
_SCALE: Final = {"fuzz": 10.0, "mutate": 0.1}.get(PROFILE, 1.0)
_STEPS: Final = {"fuzz": 4.0, "mutate": 0.5}.get(PROFILE, 1.0)


def examples(usual: int) -> int:
    """Examples for a property test that sets its own count: ``usual`` in `make test` and CI.

    Ten times as many under `make fuzz`, a tenth under `make mutate` (at least one).
    """
    return max(1, round(usual * _SCALE))


def steps(usual: int) -> int:
    """Steps per run of a stateful test: ``usual``, four times as many under `make fuzz`."""
    return max(1, round(usual * _STEPS))


@attrs.frozen
class Count:
    """A record with one counter: what most reliability tests keep per module."""

    n: int = 0


def bump(record: Count) -> Count:
    """The transition ``n -> n + 1``."""
    return attrs.evolve(record, n=record.n + 1)


@attrs.frozen
class Holder:
    """A record whose one field may hold anything: for the tests of what a record may hold."""

    value: object = None


@attrs.frozen
class Mixed:
    """A record of three fields, for the record checks that look past the first field."""

    n: int = 0
    items: tuple[object, ...] = ()
    last: object = None


# ----------------------------------------------------------------- store contents


@attrs.frozen
class Contents:
    """Everything a user can observe of the store(s) and the registry for a model's modules.

    ``rows`` is ``(fqn, "record" | "entry", api name, id(value))`` in store order;
    ``reads`` is ``(fqn, api name, is_applied, id(get_state), id(state) or -1)`` per
    module and per API asked about, so a record the lock-free readers still see is
    caught even where ``records()`` no longer lists it; ``sizes`` is ``len(store)``
    per store. ``values`` keeps the values alive so the ids stay theirs. Two
    ``Contents`` are equal when the same objects sit under the same APIs in the
    same order and every read answers the same.
    """

    rows: tuple[tuple[str, str, str, int], ...]
    reads: tuple[tuple[str, str, bool, int, int], ...]
    sizes: tuple[int, ...]
    values: tuple[object, ...] = attrs.field(eq=False, repr=False)


def contents(
    model: nn.Module, stores: Iterable[StateStore], apis: Iterable[AnyContract] = ()
) -> Contents:
    """Snapshot the records in ``stores``, the registry and the reads of ``apis`` over ``model``.

    ``apis`` are the contracts whose ``is_applied``, ``get_state`` and ``state``
    are read on every module; the APIs that have records in ``stores`` are always
    read too.
    """
    # Garbage that an earlier test left (a traceback's frame holding a module, say)
    # still has rows until collected, and ``sizes`` counts them: collect it now, so
    # that no collection between two snapshots can change what they compare.
    gc.collect()
    rows: list[tuple[str, str, str, int]] = []
    reads: list[tuple[str, str, bool, int, int]] = []
    values: list[object] = []
    stores = tuple(stores)
    asked = list(apis)
    for fqn, module in model.named_modules(remove_duplicate=False):
        read = list(asked)
        for store in stores:
            for api, record in store.records(module).items():
                rows.append((fqn, "record", api.name, id(record)))
                values.append(record)
                if api not in read:
                    read.append(api)
        for api, entry in registry(module).items():
            rows.append((fqn, "entry", api.name, id(entry)))
            values.append(entry)
        for api in read:
            found = api.get_state(module)
            try:
                state: object = api.state(module)
            except NotAppliedError:
                state = None
            read_id = -1 if state is None else id(state)
            reads.append((fqn, api.name, api.is_applied(module), id(found), read_id))
            values += [found, state]
    return Contents(tuple(rows), tuple(reads), tuple(len(store) for store in stores), tuple(values))


# ----------------------------------------------------------------- threads


@attrs.frozen
class Outcome(Generic[_T]):
    """What one thread's task returned, or the exception it raised."""

    value: _T | None = None
    error: BaseException | None = None


class Crowd:
    """Runs tasks on a fixed set of threads that all start each round together.

    Every round hands one task to each thread; a ``threading.Barrier`` shared with
    the caller releases them at once, so the tasks really overlap. ``close`` joins
    every thread with a timeout and fails if one is stuck.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._start = threading.Barrier(size + 1)
        self._done = threading.Barrier(size + 1)
        self._tasks: list[Callable[[], object]] = []
        self._outcomes: list[Outcome[object]] = []
        self._closing = False
        self._threads = [
            threading.Thread(target=self._work, args=(index,), daemon=True) for index in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, index: int) -> None:
        try:
            while True:
                self._start.wait()
                if self._closing:
                    return
                try:
                    self._outcomes[index] = Outcome(value=self._tasks[index]())
                except BaseException as error:
                    self._outcomes[index] = Outcome(error=error)
                self._done.wait()
        except threading.BrokenBarrierError:
            return

    def run(self, tasks: Sequence[Callable[[], object]]) -> list[Outcome[object]]:
        """Run ``tasks[i]`` on thread ``i``, all released together; return their outcomes."""
        assert len(tasks) == self.size
        self._tasks = list(tasks)
        self._outcomes = [Outcome() for _ in range(self.size)]
        self._start.wait(timeout=60)
        self._done.wait(timeout=60)
        outcomes, self._outcomes, self._tasks = self._outcomes, [], []
        return outcomes

    def close(self) -> None:
        """Stop the threads; fail if one does not stop."""
        self._closing = True
        # A failed round breaks the barrier; its threads have returned already.
        with contextlib.suppress(threading.BrokenBarrierError):
            self._start.wait(timeout=60)
        for thread in self._threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in self._threads), "a thread is stuck"


def run_alone(task: Callable[[], object], timeout: float = 60.0) -> Outcome[object]:
    """Run ``task`` on a new thread and join it; fail if it has not finished by ``timeout``.

    Used to show a call cannot deadlock, and that the write lock is free afterwards.
    """
    box: list[Outcome[object]] = []

    def work() -> None:
        try:
            box.append(Outcome(value=task()))
        except BaseException as error:
            box.append(Outcome(error=error))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the call did not return: a lock is held or a wait never ends"
    return box[0]


# ----------------------------------------------------------------- strategies


def non_modules() -> st.SearchStrategy[object]:
    """First arguments that are neither a module nor a sequence of modules."""
    return st.one_of(
        st.none(),
        st.integers(),
        st.floats(allow_nan=False),
        st.text(),
        st.binary(),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
        st.sets(st.integers(), max_size=3),
        st.builds(object),
    )


@st.composite
def module_trees(draw: st.DrawFn, max_children: int = 3, max_depth: int = 3) -> nn.Module:
    """A small tree of containers with ``Linear`` leaves, drawn by shape."""

    def build(depth: int) -> nn.Module:
        width = draw(st.integers(0, max_children if depth < max_depth else 0))
        if width == 0:
            return nn.Linear(1, 1)
        return nn.Sequential(*[build(depth + 1) for _ in range(width)])

    return build(0)
