"""APIs whose function applies other APIs, or itself, as fully_shard applies hooks of its own."""

from __future__ import annotations

import contextlib

import pytest
import torch
from strategies import Count, bump, contents, run_alone
from torch import nn

from torchcontract import (
    AlreadyAppliedError,
    FQNChangedError,
    StateStore,
    contract,
    registry,
)

STORE = StateStore()
ELSEWHERE = StateStore()


@contract(Count, store=STORE)
def inner(module: nn.Module, *, grow: bool = False, fail: bool = False) -> None:
    inner.update(module, bump)
    if grow:
        module.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    if fail:
        raise ValueError("inner failed")


@contract(Count, store=STORE)
def outer(
    module: nn.Module,
    *,
    child: str = "",
    inner_grow: bool = False,
    inner_fail: bool = False,
    grow_after: bool = False,
    seen: list[Exception] | None = None,
    reraise: bool = True,
) -> None:
    """Apply ``inner`` to ``module.get_submodule(child)``, then maybe add a buffer of its own."""
    try:
        inner(module.get_submodule(child), grow=inner_grow, fail=inner_fail)
    except (FQNChangedError, ValueError) as error:
        if seen is not None:
            seen.append(error)
        if reraise:
            raise
    outer.update(module, bump)
    if grow_after:
        module.register_buffer("late", torch.zeros(1))


@contract(Count, store=STORE)
def everywhere(module: nn.Module) -> None:
    """Apply itself to every child first, as a recursive wrapper does."""
    for child in module.children():
        everywhere(child)
    everywhere.update(module, bump)


@contract(Count, store=STORE)
def selfish(module: nn.Module, *, catch: bool = False) -> None:
    """Apply itself to the same module again."""
    if catch:
        with contextlib.suppress(AlreadyAppliedError):
            selfish(module)
    else:
        selfish(module)


@contract(Count, store=ELSEWHERE)
def isolated(module: nn.Module) -> None:
    isolated.update(module, bump)


@contract(Count, store=STORE)
def wraps_isolated(module: nn.Module) -> None:
    isolated(module)
    raise KeyboardInterrupt


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.Linear(1, 1)))


def test_api_applying_another_api_to_the_same_module_installs_both_in_order() -> None:
    model = _model()
    outer(model)
    assert list(registry(model)) == [outer, inner]
    assert dict(STORE.records(model)) == {outer: Count(1), inner: Count(1)}


def test_api_applying_another_api_to_a_child_installs_each_on_its_own_module() -> None:
    model = _model()
    outer(model, child="1.0")
    leaf = model.get_submodule("1.0")
    assert list(registry(model)) == [outer]
    assert list(registry(leaf)) == [inner]
    assert [list(registry(module)) for module in (model[0], model[1])] == [[], []]
    assert inner.state(leaf) == outer.state(model) == Count(1)


def test_api_applying_itself_to_every_child_applies_once_per_module() -> None:
    model = _model()
    everywhere(model)
    for module in model.modules():
        assert list(registry(module)) == [everywhere]
        assert everywhere.state(module) == Count(1)


def test_inner_api_changing_fqns_raises_from_the_inner_call_and_installs_nothing() -> None:
    model = _model()
    before = contents(model, [STORE], [outer, inner])
    seen: list[Exception] = []
    with pytest.raises(FQNChangedError, match="inner changed the parameter FQNs") as caught:
        outer(model, child="0", inner_grow=True, seen=seen)
    assert seen == [caught.value]
    assert "only after: ['extra']" in str(caught.value)
    assert contents(model, [STORE], [outer, inner]) == before


def test_outer_api_sees_fqn_changes_of_an_inner_api_whose_error_it_swallowed() -> None:
    model = _model()
    before = contents(model, [STORE], [outer, inner])
    seen: list[Exception] = []
    with pytest.raises(FQNChangedError, match="outer changed the parameter FQNs") as caught:
        outer(model, child="0", inner_grow=True, seen=seen, reraise=False)
    assert [type(error) for error in seen] == [FQNChangedError]
    assert "only after: ['0.extra']" in str(caught.value)
    assert contents(model, [STORE], [outer, inner]) == before


def test_outer_api_changing_fqns_after_an_inner_apply_rolls_the_inner_one_back() -> None:
    model = _model()
    before = contents(model, [STORE], [outer, inner])
    with pytest.raises(FQNChangedError, match="outer changed the buffer FQNs") as caught:
        outer(model, child="0", grow_after=True)
    assert "only after: ['late']" in str(caught.value)
    assert not inner.is_applied(model[0])
    assert contents(model, [STORE], [outer, inner]) == before


def test_inner_failure_swallowed_by_outer_leaves_only_outer_applied() -> None:
    model = _model()
    seen: list[Exception] = []
    outer(model, child="0", inner_fail=True, seen=seen, reraise=False)
    assert [str(error) for error in seen] == ["inner failed"]
    assert list(registry(model)) == [outer]
    assert list(registry(model[0])) == []
    assert dict(STORE.records(model[0])) == {}


def test_nested_apply_in_another_store_is_rolled_back_with_the_outer_one() -> None:
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        wraps_isolated(model)
    assert len(ELSEWHERE) == 0
    assert list(registry(model)) == []
    assert not isolated.is_applied(model)
    assert isolated.get_state(model) is None
    assert not wraps_isolated.is_applied(model)


def test_api_applying_itself_to_the_same_module_raises_already_applied_without_deadlock() -> None:
    module = nn.Linear(1, 1)
    outcome = run_alone(lambda: selfish(module))
    assert type(outcome.error) is AlreadyAppliedError
    assert "selfish is already applied to Linear" in str(outcome.error)
    assert list(registry(module)) == []
    assert run_alone(lambda: selfish.is_applied(module)).value is False
    assert run_alone(lambda: everywhere(module)).error is None


def test_api_swallowing_its_own_already_applied_error_is_applied_once() -> None:
    module = nn.Linear(1, 1)
    selfish(module, catch=True)
    assert list(registry(module)) == [selfish]
    assert selfish.state(module) == Count()


def test_update_may_update_another_api_inside_its_transition_without_deadlock() -> None:
    module = nn.Linear(1, 1)
    inner(module)
    everywhere(module)

    def transition(record: Count) -> Count:
        everywhere.update(module, bump)
        return bump(record)

    outcome = run_alone(lambda: inner.update(module, transition))
    assert outcome.error is None
    assert inner.state(module) == Count(2)
    assert everywhere.state(module) == Count(2)
