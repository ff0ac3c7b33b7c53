"""An API function that raises at any step, with any exception: nothing it wrote survives.

Every test compares everything a user can observe, for every module of the model,
before and after the failed apply: the records of every store and the registry
entries (the same objects, in the same order), what ``state``, ``get_state`` and
``is_applied`` answer for every API, and ``len(store)``; then shows that a retry
works and that the write lock is free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
from strategies import Count, bump, contents, run_alone
from torch import nn

from torchcontract import (
    Application,
    Contract,
    Incompatible,
    InvalidRecordError,
    NotAppliedError,
    RegistryEntry,
    StateStore,
    contract,
    registry,
)

STORE = StateStore()
ELSEWHERE = StateStore()
STORES = (STORE, ELSEWHERE)


class Abort(BaseException):
    """A BaseException of the user's own, like those some frameworks use to unwind."""


ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    KeyboardInterrupt,
    SystemExit,
    GeneratorExit,
    Abort,
)
STEPS = (
    "start",
    "one hook",
    "all hooks",
    "set_state",
    "update of another api",
    "set_state of another api in another store",
    "nested apply on a child",
    "nested apply on the same module",
    "two-level nested apply",
)


def _noop_hook(module: nn.Module, args: tuple[object, ...]) -> None:
    pass


@contract(Count, store=STORE)
def other(module: nn.Module) -> None:
    pass


@contract(Count, store=ELSEWHERE)
def elsewhere(module: nn.Module) -> None:
    pass


@contract(Count, store=STORE)
def nested(module: nn.Module) -> None:
    nested.update(module, bump)


@contract(Count, store=ELSEWHERE)
def deep(module: nn.Module) -> None:
    deep.update(module, bump)
    nested(module)


@contract(Count, store=STORE)
def faulty(module: nn.Module, *, fail_at: str | None, error: type[BaseException]) -> None:
    """Change things step by step; raise ``error`` right after step ``fail_at``."""
    steps = iter(STEPS)

    def done() -> None:
        step = next(steps)
        if step == fail_at:
            raise error(f"fault at {step}")

    handles.append(faulty.application(module))
    done()
    module.register_forward_pre_hook(_noop_hook)
    done()
    module.get_submodule("0").register_forward_pre_hook(_noop_hook)
    done()
    faulty.set_state(module, Count(5))
    done()
    other.update(module.get_submodule("0"), bump)
    done()
    elsewhere.set_state(module, Count(99))
    done()
    nested(module.get_submodule("1"))
    done()
    nested(module)
    done()
    deep(module.get_submodule("1.0"))
    done()


handles: list[Application[Count]] = []  # what faulty's hooks would hold, per call


def _prepared() -> nn.Sequential:
    """A model with records already in place for ``other`` and ``elsewhere``."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.Linear(1, 1)))
    other(model)
    other(model[0])
    other.set_state(model[0], Count(7))
    elsewhere(model)
    elsewhere.update(model, bump)
    return model


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: error.__name__)
@pytest.mark.parametrize("step", STEPS)
def test_fault_at_any_step_restores_every_store_and_the_registry(
    step: str, error: type[BaseException]
) -> None:
    model = _prepared()
    before = contents(model, STORES, APIS)
    with pytest.raises(error, match=f"^fault at {step}$"):
        faulty(model, fail_at=step, error=error)
    assert contents(model, STORES, APIS) == before


@pytest.mark.parametrize("step", STEPS)
def test_reads_after_a_fault_answer_as_if_the_apply_never_ran(step: str) -> None:
    model = _prepared()
    leaf = model.get_submodule("1.0")
    sizes = (len(STORE), len(ELSEWHERE))
    with pytest.raises(KeyboardInterrupt):
        faulty(model, fail_at=step, error=KeyboardInterrupt)
    assert not faulty.is_applied(model)
    assert faulty.get_state(model) is None
    with pytest.raises(NotAppliedError, match="faulty is not applied to Sequential"):
        faulty.state(model)
    for module in (model, model[1], leaf):
        assert not nested.is_applied(module)
        assert nested.get_state(module) is None
    assert not deep.is_applied(leaf)
    assert other.state(model[0]) == Count(7)
    assert elsewhere.state(model) == Count(1)
    assert (len(STORE), len(ELSEWHERE)) == sizes


@pytest.mark.parametrize("step", STEPS)
def test_handle_taken_in_a_failed_apply_answers_none(step: str) -> None:
    model = _prepared()
    handles.clear()
    with pytest.raises(KeyboardInterrupt):
        faulty(model, fail_at=step, error=KeyboardInterrupt)
    assert [handle.record(model) for handle in handles] == [None]


@pytest.mark.parametrize("step", STEPS)
def test_retry_after_a_fault_applies_everything(step: str) -> None:
    model = _prepared()
    with pytest.raises(KeyboardInterrupt):
        faulty(model, fail_at=step, error=KeyboardInterrupt)
    faulty(model, fail_at=None, error=KeyboardInterrupt)
    leaf = model.get_submodule("1.0")
    assert list(registry(model)) == [other, elsewhere, faulty, nested]
    assert list(registry(model[1])) == [nested]
    assert list(registry(leaf)) == [deep, nested]
    assert faulty.state(model) == Count(5)
    assert other.state(model[0]) == Count(8)
    assert elsewhere.state(model) == Count(99)
    assert nested.state(model[1]) == nested.state(model) == nested.state(leaf) == Count(1)
    assert deep.state(leaf) == Count(1)


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: error.__name__)
def test_write_lock_is_free_after_a_fault(error: type[BaseException]) -> None:
    model = _prepared()
    with pytest.raises(error):
        faulty(model, fail_at="two-level nested apply", error=error)
    outcome = run_alone(lambda: other.update(model, bump))
    assert outcome.error is None
    assert other.state(model) == Count(1)


@contract(Count, store=STORE)
def faulty_pair(modules: Sequence[nn.Module], *, fail: bool) -> None:
    """Write through both roots of a list apply, then fail if asked."""
    faulty_pair.update(modules[1], bump)
    for module in modules:
        other.update(module, bump)
        nested(module.get_submodule("1"))
    if fail:
        raise Abort("fault after both roots")


def test_fault_in_a_list_apply_restores_every_root() -> None:
    roots = [_prepared(), _prepared()]
    model = nn.ModuleList(roots)  # only to snapshot both trees at once
    before = contents(model, STORES, APIS)
    with pytest.raises(Abort, match="fault after both roots"):
        faulty_pair(roots, fail=True)
    assert contents(model, STORES, APIS) == before
    faulty_pair(roots, fail=False)
    assert faulty_pair.state(roots[0]) is faulty_pair.state(roots[1])
    assert [other.state(root) for root in roots] == [Count(1), Count(1)]


def test_fault_in_an_update_transition_keeps_the_record_and_frees_the_lock() -> None:
    model = _prepared()
    before = contents(model, STORES, APIS)

    def interrupted(record: Count) -> Count:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        other.update(model, interrupted)
    assert contents(model, STORES, APIS) == before
    assert run_alone(lambda: other.update(model, bump)).error is None


def test_write_lock_is_free_after_an_update_refused_its_record_or_its_module() -> None:
    model = _prepared()
    untyped_update: Callable[..., object] = other.update
    with pytest.raises(InvalidRecordError, match=r"other\.update: expected a record of class"):
        untyped_update(model, lambda record: None)
    assert run_alone(lambda: other.update(model, bump)).error is None
    with pytest.raises(NotAppliedError, match="other is not applied to Linear"):
        other.update(nn.Linear(1, 1), bump)
    assert run_alone(lambda: other.update(model, bump)).error is None
    assert other.state(model) == Count(2)


def _fails_when_asked(entry: RegistryEntry) -> bool:
    raise Abort("rule predicate failed")


@contract(Count, store=STORE, incompatible_with=[Incompatible(other, when=_fails_when_asked)])
def ruled(module: nn.Module) -> None:
    pass


def test_fault_in_a_rule_predicate_installs_nothing_and_frees_the_lock() -> None:
    model = _prepared()
    before = contents(model, STORES, APIS)
    with pytest.raises(Abort, match="rule predicate failed"):
        ruled(model)
    assert contents(model, STORES, APIS) == before
    assert run_alone(lambda: ruled(nn.Linear(1, 1))).error is None


_defaults_fail = threading.Event()


def _default_count() -> int:
    if _defaults_fail.is_set():
        raise Abort("default failed")
    return 0


@attrs.frozen
class Fragile:
    n: int = attrs.field(factory=_default_count)


@contract(Fragile, store=STORE)
def fragile(module: nn.Module) -> None:
    pass


#: Every API of this file: what each one reads is compared before and after a fault.
APIS: tuple[Contract[..., Any, Any], ...] = (
    other,
    elsewhere,
    nested,
    deep,
    faulty,
    faulty_pair,
    ruled,
    fragile,
)


def test_fault_building_the_default_record_installs_nothing() -> None:
    model = _prepared()
    before = contents(model, STORES, APIS)
    _defaults_fail.set()
    try:
        with pytest.raises(Abort, match="default failed"):
            fragile(model)
    finally:
        _defaults_fail.clear()
    assert contents(model, STORES, APIS) == before
    fragile(model)
    assert fragile.state(model) == Fragile(0)


def _racing_writer(
    module: nn.Module, ours_written: threading.Event, theirs: threading.Event
) -> Callable[[], None]:
    def write() -> None:
        assert ours_written.wait(timeout=60)
        other.set_state(module, Count(2))
        theirs.set()

    return write


def test_rollback_keeps_a_record_another_thread_wrote_meanwhile() -> None:
    module = nn.Linear(1, 1)
    other(module)
    ours_written, theirs = threading.Event(), threading.Event()

    @contract(store=STORE)
    def overwritten(target: nn.Module) -> None:
        other.set_state(target, Count(1))
        ours_written.set()
        assert theirs.wait(timeout=60)
        raise ValueError("failed after another thread wrote")

    writer = threading.Thread(target=_racing_writer(module, ours_written, theirs))
    writer.start()
    with pytest.raises(ValueError, match="failed after another thread wrote"):
        overwritten(module)
    writer.join(timeout=60)
    assert other.state(module) == Count(2)
