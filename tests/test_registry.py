"""registry(): the APIs applied to exactly one module, in order, with their arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from torchcontract import (
    Contract,
    EmptyState,
    NotAppliedError,
    RegistryEntry,
    StateStore,
    contract,
    registry,
)


@contract()
def first(module: nn.Module) -> None:
    pass


@contract()
def second(module: nn.Module) -> None:
    pass


@contract()
def third(module: nn.Module) -> None:
    pass


@contract()
def layered(
    module: nn.Module | list[nn.Linear], depth: int, *, mode: str = "full", tag: str | None = None
) -> None:
    pass


@contract(store=StateStore())
def isolated(module: nn.Module) -> None:
    pass


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2, 2)
        self.l2 = nn.Linear(2, 2)


def test_registry_of_a_module_without_apis_is_an_empty_mapping() -> None:
    found = registry(nn.Linear(2, 2))
    assert found is not None
    assert isinstance(found, Mapping)
    assert len(found) == 0
    assert dict(found) == {}


@given(order=st.permutations([first, second, third]))
def test_registry_lists_apis_in_application_order(
    order: list[Contract[[nn.Module], nn.Module, EmptyState]],
) -> None:
    layer = nn.Linear(2, 2)
    for api in order:
        api(layer)
    assert list(registry(layer)) == order


def test_registry_cannot_be_written_through() -> None:
    layer = nn.Linear(2, 2)
    first(layer)
    found: Any = registry(layer)  # Any: the writes below are what the types forbid
    with pytest.raises(TypeError):
        found[second] = found[first]
    with pytest.raises(TypeError):
        del found[first]
    assert list(registry(layer)) == [first]


def test_registry_is_a_copy_that_later_applications_do_not_change() -> None:
    layer = nn.Linear(2, 2)
    first(layer)
    taken = registry(layer)
    second(layer)
    assert list(taken) == [first]
    assert list(registry(layer)) == [first, second]


def test_registry_holds_only_apis_applied_to_exactly_that_module() -> None:
    model = TwoLayer()
    first(model)
    second(model.l1)
    assert list(registry(model)) == [first]
    assert list(registry(model.l1)) == [second]
    assert len(registry(model.l2)) == 0


def test_entry_exposes_the_api_and_the_arguments_of_the_application() -> None:
    layer = nn.Linear(2, 2)
    layered(layer, 3, tag="x")
    entry = registry(layer)[layered]
    assert isinstance(entry, RegistryEntry)
    assert entry.api is layered
    assert entry.args == (3,)
    assert dict(entry.kwargs) == {"tag": "x"}


def test_entry_arguments_bind_every_parameter_with_defaults_filled_in() -> None:
    layer = nn.Linear(2, 2)
    layered(layer, depth=2)
    entry = registry(layer)[layered]
    assert entry.args == ()
    assert dict(entry.arguments) == {"depth": 2, "mode": "full", "tag": None}


def test_entry_arguments_bind_positional_arguments_by_name() -> None:
    layer = nn.Linear(2, 2)
    layered(layer, 3, tag="x")
    entry = registry(layer)[layered]
    assert entry.args == (3,)
    assert dict(entry.arguments) == {"depth": 3, "mode": "full", "tag": "x"}


def test_entry_kwargs_cannot_be_written_through() -> None:
    layer = nn.Linear(2, 2)
    layered(layer, 1, mode="light")
    kwargs: Any = registry(layer)[layered].kwargs  # Any: the write below is what types forbid
    with pytest.raises(TypeError):
        kwargs["mode"] = "full"
    assert kwargs["mode"] == "light"


def test_entry_kwargs_do_not_follow_later_changes_to_the_callers_dict() -> None:
    layer = nn.Linear(2, 2)
    options: dict[str, str] = {"mode": "light"}
    layered(layer, 1, **options)
    options["mode"] = "full"
    assert registry(layer)[layered].kwargs["mode"] == "light"


def test_list_apply_registers_the_same_entry_on_every_root() -> None:
    model = TwoLayer()
    layered([model.l1, model.l2], 4)
    entry = registry(model.l1)[layered]
    assert registry(model.l2)[layered] is entry
    assert entry.args == (4,)
    assert len(registry(model)) == 0


def test_registry_sees_apis_whatever_store_keeps_their_records() -> None:
    layer = nn.Linear(2, 2)
    first(layer)
    isolated(layer)
    assert list(registry(layer)) == [first, isolated]
    assert isolated.store is not first.store


# ------------------------------------------------------------------- api.entry(module)


def test_entry_is_the_registry_entry_of_the_application() -> None:
    layer = nn.Linear(2, 2)
    layered(layer, 2, mode="half")
    entry = layered.entry(layer)
    assert entry is registry(layer)[layered]
    assert entry.api is layered
    assert entry.arguments == {"depth": 2, "mode": "half", "tag": None}


def test_entry_of_a_module_the_api_is_not_applied_to_raises_not_applied() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    first(model)
    with pytest.raises(NotAppliedError) as info:
        first.entry(model[0])
    message = str(info.value)
    assert f"{first.name} is not applied to Linear '0'" in message
    assert "apply it first" in message


def test_entry_of_a_rolled_back_application_raises_not_applied() -> None:
    @contract()
    def failing(module: nn.Module) -> None:
        raise ValueError("fails")

    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="fails"):
        failing(layer)
    with pytest.raises(NotAppliedError):
        failing.entry(layer)
