"""Applies, updates and reads from many threads at once: nothing lost, nothing half-done.

Each test runs hundreds of rounds on eight threads that a barrier releases together,
with the interpreter switching threads every microsecond, so a race has many chances
to show.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import attrs
import pytest
from strategies import Count, Crowd, Outcome, bump
from torch import nn

from torchcontract import (
    AlreadyAppliedError,
    Incompatible,
    IncompatibleAPIError,
    ModuleSequenceContract,
    StateStore,
    contract,
    describe,
    registry,
)

THREADS = 8
ROUNDS = 200
STORE = StateStore()

Targets = nn.Module | Sequence[nn.Module]
CountAPI = ModuleSequenceContract[[], Count]


def _api(name: str, *, fail: bool = False, rules: Sequence[Incompatible] = ()) -> CountAPI:
    """An API named ``name`` that counts its own applications in its record, or fails."""

    def apply(module: Targets) -> None:
        if fail:
            raise RuntimeError(f"{name} failed")

    apply.__name__ = apply.__qualname__ = name
    return contract(Count, store=STORE, incompatible_with=rules)(apply)


APIS = [_api(f"api{index}") for index in range(THREADS)]
ONCE = _api("once")
PAIRED = _api("paired")
GUARDED = _api("guarded")
COUNTER = _api("counter")
SHARD = _api("shard")
OFFLOAD = _api("offload", rules=[Incompatible(SHARD)])
READ_WRITE = [_api(f"rw{index}", fail=index % 2 == 1) for index in range(20)]
FAILING = set(READ_WRITE[1::2])


@attrs.frozen
class Pair:
    """A record whose writers always keep ``a == b``, and only ever add one to both."""

    a: int = 0
    b: int = 0


def _step_pair(record: Pair) -> Pair:
    return Pair(record.a + 1, record.b + 1)


@contract(Pair, store=STORE)
def pair(modules: Targets) -> None:
    pass


@pytest.fixture(autouse=True)
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond while a test runs, so races are likelier."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture
def crowd() -> Iterator[Crowd]:
    threads = Crowd(THREADS)
    yield threads
    threads.close()


def _errors(outcomes: Sequence[Outcome[object]]) -> list[BaseException]:
    return [outcome.error for outcome in outcomes if outcome.error is not None]


def _model() -> tuple[nn.Sequential, nn.Sequential, list[nn.Module]]:
    """A root, an inner container and three leaves: ``root(leaf0, inner(leaf1, leaf2))``."""
    leaves: list[nn.Module] = [nn.Linear(1, 1) for _ in range(3)]
    inner = nn.Sequential(leaves[1], leaves[2])
    return nn.Sequential(leaves[0], inner), inner, leaves


# ----------------------------------------------------------------- applies


def _apply_everywhere(
    index: int, model: nn.Module, inner: nn.Module, leaves: list[nn.Module]
) -> None:
    """Apply APIS[index] once to every module of ``model``; even ones share a cell over leaves."""
    api = APIS[index]
    modules = list(model.modules())
    if index % 2 == 0:
        api(model)
        api(inner)
        api(leaves)
    else:
        shift = index % len(modules)
        for module in modules[shift:] + modules[:shift]:
            api(module)
    for module in modules:
        api.update(module, bump)


def test_different_apis_on_overlapping_modules_all_apply(crowd: Crowd) -> None:
    for _ in range(ROUNDS):
        model, inner, leaves = _model()
        outcomes = crowd.run(
            [partial(_apply_everywhere, index, model, inner, leaves) for index in range(THREADS)]
        )
        assert _errors(outcomes) == []
        for module in model.modules():
            assert set(registry(module)) == set(APIS)
            assert list(registry(module)) == list(STORE.records(module))
            for index, api in enumerate(APIS):
                shared = index % 2 == 0 and module in leaves
                assert api.state(module) == Count(3 if shared else 1)
        for api in APIS[::2]:
            assert api.state(leaves[0]) is api.state(leaves[1]) is api.state(leaves[2])


def _apply_once(module: nn.Module, calls: list[int]) -> Targets:
    result = ONCE(module)
    calls.append(1)
    return result


def test_same_api_on_same_module_from_eight_threads_applies_exactly_once(crowd: Crowd) -> None:
    for _ in range(ROUNDS):
        module = nn.Linear(1, 1)
        calls: list[int] = []
        outcomes = crowd.run([partial(_apply_once, module, calls)] * THREADS)
        assert [outcome.value for outcome in outcomes if outcome.error is None] == [module]
        errors = _errors(outcomes)
        assert [type(error) for error in errors] == [AlreadyAppliedError] * (THREADS - 1)
        assert all("once is already applied to Linear" in str(error) for error in errors)
        assert calls == [1]
        assert list(registry(module)) == [ONCE]
        assert dict(STORE.records(module)) == {ONCE: Count()}


def test_same_api_on_overlapping_lists_fails_only_where_another_call_won(crowd: Crowd) -> None:
    # Thread i applies PAIRED to [m_i, m_i+1]. A call may fail only because a
    # neighbour that shares a module with it won; a call refused as already applied
    # must never have blocked a third one in passing.
    for _ in range(ROUNDS):
        modules = [nn.Linear(1, 1) for _ in range(THREADS + 1)]
        outcomes = crowd.run(
            [partial(PAIRED, [modules[i], modules[i + 1]]) for i in range(THREADS)]
        )
        won = {i for i, outcome in enumerate(outcomes) if outcome.error is None}
        assert all(type(error) is AlreadyAppliedError for error in _errors(outcomes))
        assert all(i + 1 not in won for i in won)
        assert all(i - 1 in won or i + 1 in won for i in range(THREADS) if i not in won)
        covered = {j for i in won for j in (i, i + 1)}
        for j, module in enumerate(modules):
            assert PAIRED.is_applied(module) == (j in covered)
            assert list(registry(module)) == ([PAIRED] if j in covered else [])
        for i in won:
            assert PAIRED.state(modules[i]) is PAIRED.state(modules[i + 1])


def _apply_either(api: CountAPI, module: nn.Module) -> None:
    api(module)


def test_incompatible_apis_racing_on_parent_and_child_never_both_apply(crowd: Crowd) -> None:
    for _ in range(ROUNDS):
        model = nn.Sequential(nn.Linear(1, 1))
        tasks: list[Callable[[], object]] = []
        for index in range(THREADS):
            api = SHARD if index % 2 else OFFLOAD
            target = model if index % 4 < 2 else model[0]
            tasks.append(partial(_apply_either, api, target))
        outcomes = crowd.run(tasks)
        applied = {api for module in model.modules() for api in registry(module)}
        assert applied in ({SHARD}, {OFFLOAD})
        for error in _errors(outcomes):
            assert type(error) in (AlreadyAppliedError, IncompatibleAPIError)
        wins = sum(outcome.error is None for outcome in outcomes)
        assert wins == sum(len(registry(module)) for module in model.modules())


# ----------------------------------------------------------------- updates


def _bump_many(api: CountAPI, module: nn.Module, times: int) -> None:
    for _ in range(times):
        api.update(module, bump)


def test_concurrent_updates_lose_no_increment(crowd: Crowd) -> None:
    increments = 50
    for _ in range(ROUNDS):
        module = nn.Linear(1, 1)
        COUNTER(module)
        outcomes = crowd.run([partial(_bump_many, COUNTER, module, increments)] * THREADS)
        assert _errors(outcomes) == []
        assert COUNTER.state(module) == Count(THREADS * increments)


def test_concurrent_updates_through_roots_sharing_a_record_lose_no_increment(
    crowd: Crowd,
) -> None:
    increments = 50
    for _ in range(ROUNDS):
        roots = [nn.Linear(1, 1), nn.Linear(1, 1)]
        COUNTER(roots)
        outcomes = crowd.run(
            [partial(_bump_many, COUNTER, roots[i % 2], increments) for i in range(THREADS)]
        )
        assert _errors(outcomes) == []
        assert COUNTER.state(roots[0]) == COUNTER.state(roots[1]) == Count(THREADS * increments)


# ----------------------------------------------------------------- readers during writes


def _write_pairs(roots: Sequence[nn.Module], times: int, finished: list[int]) -> None:
    for step in range(times):
        pair.update(roots[step % 2], _step_pair)
    finished.append(times)


def _read_pairs(roots: Sequence[nn.Module], writers: int, finished: list[int]) -> list[str]:
    """Read the shared record through one root, then the other, until the writers are done.

    Writers keep ``a == b`` and only count up, through either root: a record with
    ``a != b`` was written in two steps, and a count lower than one read before it
    means an update was lost or a write reached one root before the other. Returns
    what was wrong.
    """
    wrong: list[str] = []
    seen = 0
    done = False
    while not done:
        done = len(finished) == writers  # one more read once every writer is done
        first = pair.state(roots[0])
        second = STORE.records(roots[1])[pair]
        assert isinstance(second, Pair)
        wrong += [f"half-written {record}" for record in (first, second) if record.a != record.b]
        if not seen <= first.a <= second.a:
            wrong.append(f"went back: {seen}, then {first.a}, then {second.a}")
        seen = second.a
    if seen != sum(finished):
        wrong.append(f"saw {seen} updates of {sum(finished)} at the end")
    return wrong[:3]


def test_readers_never_see_a_half_written_or_older_record(crowd: Crowd) -> None:
    writers, times = THREADS // 2, 40
    for _ in range(ROUNDS):
        roots = [nn.Linear(1, 1), nn.Linear(1, 1)]
        pair(roots)
        finished: list[int] = []
        outcomes = crowd.run(
            [partial(_write_pairs, roots, times, finished) for _ in range(writers)]
            + [partial(_read_pairs, roots, writers, finished) for _ in range(THREADS - writers)]
        )
        assert _errors(outcomes) == []
        assert [outcome.value for outcome in outcomes] == [None] * writers + [[]] * writers
        assert pair.state(roots[1]) == Pair(writers * times, writers * times)


def _apply_group(group: Sequence[CountAPI], module: nn.Module) -> None:
    for api in group:
        if api in FAILING:
            with pytest.raises(RuntimeError, match=f"^{api.__name__} failed$"):
                api(module)
        else:
            api(module)


def _read_everything(module: nn.Module, times: int) -> None:
    known = set(READ_WRITE)
    for _ in range(times):
        records = STORE.records(module)
        assert set(records) <= known
        assert all(record == Count() for record in records.values())
        assert set(registry(module)) <= known
        assert describe(module).startswith("Linear")


def test_store_and_registry_readers_never_fail_during_applies_and_rollbacks(
    crowd: Crowd,
) -> None:
    groups = [READ_WRITE[i::4] for i in range(4)]
    for _ in range(ROUNDS):
        module = nn.Linear(1, 1)
        outcomes = crowd.run(
            [partial(_apply_group, group, module) for group in groups]
            + [partial(_read_everything, module, 10) for _ in range(THREADS - len(groups))]
        )
        assert _errors(outcomes) == []
        assert list(registry(module)) == list(STORE.records(module))
        assert set(registry(module)) == set(READ_WRITE[::2])


def _apply_refused(modules: list[nn.Module], times: int) -> int:
    refused = 0
    for _ in range(times):
        try:
            GUARDED(modules)
        except AlreadyAppliedError:
            refused += 1
    return refused


def _watch_unapplied(module: nn.Module, times: int) -> int:
    return sum(GUARDED.is_applied(module) or GUARDED in registry(module) for _ in range(times))


def test_list_apply_refused_as_already_applied_is_never_visible(crowd: Crowd) -> None:
    for _ in range(ROUNDS):
        free, taken = nn.Linear(1, 1), nn.Linear(1, 1)
        GUARDED(taken)
        outcomes = crowd.run(
            [partial(_apply_refused, [free, taken], 10) for _ in range(THREADS // 2)]
            + [partial(_watch_unapplied, free, 20) for _ in range(THREADS // 2)]
        )
        assert [outcome.value for outcome in outcomes] == [10] * (THREADS // 2) + [0] * (
            THREADS // 2
        )
        assert not GUARDED.is_applied(free)
        assert list(registry(free)) == []


CHURN_STORE = StateStore()


@contract(Count, store=CHURN_STORE)
def churned(module: nn.Module) -> None:
    churned.update(module, bump)


def _churn(times: int) -> int:
    """Build, apply, update and drop modules; return how many ended with a wrong record."""
    wrong = 0
    for step in range(times):
        module = nn.Linear(1, 1)
        if churned.get_state(module) is not None:
            wrong += 1  # a new module never inherits a dead one's record
        churned(module)
        churned.update(module, bump)
        wrong += churned.state(module) != Count(2)
        if step % 8 == 0:
            gc.collect(0)
    return wrong


def test_modules_dying_on_other_threads_during_writes_leave_the_store_empty(
    crowd: Crowd,
) -> None:
    for _ in range(ROUNDS // 4):
        outcomes = crowd.run([partial(_churn, 20) for _ in range(THREADS)])
        assert _errors(outcomes) == []
        assert [outcome.value for outcome in outcomes] == [0] * THREADS
    gc.collect()
    assert len(CHURN_STORE) == 0
