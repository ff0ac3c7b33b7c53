"""State access: state, get_state, set_state, update, is_applied and name."""

from __future__ import annotations

import threading
from collections.abc import Callable

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from torchcontract import (
    ContractError,
    InvalidRecordError,
    NotAppliedError,
    contract,
)


@attrs.frozen
class ScaleState:
    factor: float = 1.0
    calls: int = 0


@attrs.frozen
class OtherState:
    name: str = ""


@contract(ScaleState)
def scale(module: nn.Module, *, factor: float = 1.0) -> None:
    scale.update(module, lambda record: attrs.evolve(record, factor=factor))


@contract(OtherState)
def other(module: nn.Module) -> None:
    pass


def bump(record: ScaleState) -> ScaleState:
    return attrs.evolve(record, calls=record.calls + 1)


def untyped(function: Callable[..., object]) -> Callable[..., object]:
    """``function`` with its signature erased, to pass arguments its types forbid."""
    return function


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2, 2)
        self.l2 = nn.Linear(2, 2)


# ------------------------------------------------------------------- state / get_state


def test_state_returns_the_record_the_apply_left() -> None:
    layer = nn.Linear(2, 2)
    scale(layer, factor=2.0)
    assert scale.state(layer) == ScaleState(factor=2.0)


def test_state_of_a_module_not_applied_raises_not_applied_naming_the_api() -> None:
    with pytest.raises(NotAppliedError) as info:
        scale.state(nn.Linear(2, 2))
    message = str(info.value)
    assert message.startswith(f"{scale.name} is not applied to Linear;")
    assert "apply it first, or use get_state()" in message


def test_not_applied_error_is_a_lookup_error_and_a_contract_error() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(LookupError):
        scale.state(layer)
    with pytest.raises(ContractError):
        scale.state(layer)


def test_not_applied_error_gives_the_fqn_inside_an_applied_ancestor() -> None:
    model = TwoLayer()
    other(model)
    with pytest.raises(NotAppliedError, match="not applied to Linear 'l2' of TwoLayer;"):
        scale.state(model.l2)


def test_state_of_a_descendant_of_an_applied_module_raises_not_applied() -> None:
    model = TwoLayer()
    scale(model)
    with pytest.raises(NotAppliedError):
        scale.state(model.l1)


def test_get_state_returns_the_record_where_applied() -> None:
    layer = nn.Linear(2, 2)
    scale(layer, factor=3.0)
    assert scale.get_state(layer) == ScaleState(factor=3.0)


def test_get_state_returns_none_where_not_applied() -> None:
    assert scale.get_state(nn.Linear(2, 2)) is None


def test_records_of_two_apis_on_one_module_are_independent() -> None:
    layer = nn.Linear(2, 2)
    scale(layer, factor=2.0)
    other(layer)
    other.set_state(layer, OtherState("x"))
    assert scale.state(layer) == ScaleState(factor=2.0)
    assert other.state(layer) == OtherState("x")


def test_records_of_one_api_on_two_modules_are_independent() -> None:
    model = TwoLayer()
    scale(model.l1, factor=2.0)
    scale(model.l2, factor=3.0)
    scale.update(model.l1, bump)
    assert scale.state(model.l1) == ScaleState(factor=2.0, calls=1)
    assert scale.state(model.l2) == ScaleState(factor=3.0)


# ------------------------------------------------------------------- set_state


def test_set_state_replaces_the_record() -> None:
    layer = nn.Linear(2, 2)
    scale(layer)
    record = ScaleState(factor=5.0, calls=7)
    scale.set_state(layer, record)
    assert scale.state(layer) is record


def test_set_state_with_another_record_class_raises_invalid_record() -> None:
    layer = nn.Linear(2, 2)
    scale(layer)
    before = scale.state(layer)
    with pytest.raises(InvalidRecordError) as info:
        untyped(scale.set_state)(layer, OtherState())
    message = str(info.value)
    assert (
        f"{scale.name}.set_state: expected a record of class ScaleState, got OtherState" in message
    )
    assert "for Linear;" in message
    assert "attrs.evolve" in message
    assert scale.state(layer) is before


def test_set_state_with_a_non_record_raises_a_type_error() -> None:
    layer = nn.Linear(2, 2)
    scale(layer)
    with pytest.raises(TypeError, match="expected a record of class ScaleState, got dict"):
        untyped(scale.set_state)(layer, {"factor": 2.0})


def test_set_state_where_not_applied_raises_not_applied() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(NotAppliedError, match=f"{scale.name} is not applied to Linear"):
        scale.set_state(layer, ScaleState())
    assert scale.get_state(layer) is None


# ------------------------------------------------------------------- update


def test_update_stores_and_returns_the_new_record() -> None:
    layer = nn.Linear(2, 2)
    scale(layer, factor=2.0)
    new = scale.update(layer, bump)
    assert new == ScaleState(factor=2.0, calls=1)
    assert scale.state(layer) is new


def test_update_calls_the_transition_once_with_the_current_record() -> None:
    layer = nn.Linear(2, 2)
    scale(layer)
    current = scale.state(layer)
    seen: list[ScaleState] = []

    def transition(record: ScaleState) -> ScaleState:
        seen.append(record)
        return bump(record)

    scale.update(layer, transition)
    assert len(seen) == 1
    assert seen[0] is current


def test_update_whose_transition_raises_keeps_the_record() -> None:
    layer = nn.Linear(2, 2)
    scale(layer)
    before = scale.state(layer)

    def transition(record: ScaleState) -> ScaleState:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        scale.update(layer, transition)
    assert scale.state(layer) is before


def test_update_returning_another_record_class_raises_and_keeps_the_record() -> None:
    layer = nn.Linear(2, 2)
    scale(layer)
    before = scale.state(layer)
    with pytest.raises(InvalidRecordError) as info:
        untyped(scale.update)(layer, lambda record: OtherState())
    assert str(info.value) == (
        f"{scale.name}.update: expected a record of class ScaleState, got OtherState for Linear; "
        "build one with attrs.evolve(record, ...)"
    )
    assert scale.state(layer) is before


def test_update_where_not_applied_raises_without_calling_the_transition() -> None:
    calls: list[ScaleState] = []

    def transition(record: ScaleState) -> ScaleState:
        calls.append(record)
        return record

    with pytest.raises(NotAppliedError, match=scale.name):
        scale.update(nn.Linear(2, 2), transition)
    assert calls == []


@given(steps=st.lists(st.sampled_from(["bump", "double", "reset"]), max_size=20))
def test_updates_apply_in_order_like_folding_the_transitions(steps: list[str]) -> None:
    transitions: dict[str, Callable[[ScaleState], ScaleState]] = {
        "bump": bump,
        "double": lambda record: attrs.evolve(record, factor=record.factor * 2),
        "reset": lambda record: ScaleState(),
    }
    layer = nn.Linear(2, 2)
    scale(layer)
    expected = ScaleState()
    for step in steps:
        expected = transitions[step](expected)
        assert scale.update(layer, transitions[step]) == expected
    assert scale.state(layer) == expected


def test_concurrent_updates_lose_no_increment() -> None:
    layer = nn.Linear(2, 2)
    scale(layer)
    threads_count, increments = 8, 10_000
    start = threading.Barrier(threads_count)

    def work() -> None:
        start.wait()
        for _ in range(increments):
            scale.update(layer, bump)

    threads = [threading.Thread(target=work) for _ in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert scale.state(layer).calls == threads_count * increments


# ------------------------------------------------------------------- is_applied / name


def test_is_applied_holds_for_exactly_the_applied_module() -> None:
    model = TwoLayer()
    scale(model.l1)
    assert scale.is_applied(model.l1)
    assert not scale.is_applied(model)
    assert not scale.is_applied(model.l2)
    assert not other.is_applied(model.l1)


def test_name_is_the_qualified_name_of_the_function() -> None:
    @contract()
    def feature(module: nn.Module) -> None:
        pass

    assert scale.name == f"{__name__}.scale"
    assert feature.name == (
        f"{__name__}.test_name_is_the_qualified_name_of_the_function.<locals>.feature"
    )


def test_repr_names_the_api_and_its_state_class() -> None:
    assert repr(scale) == f"<contract {__name__}.scale with state ScaleState>"
