"""StateStore: weak identity keys, isolation, odd modules, records that would leak."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples
from torch import nn

from torchcontract import (
    Contract,
    EmptyState,
    InvalidRecordError,
    StateStore,
    contract,
    describe,
    registry,
)


@attrs.frozen
class RefState:
    target: object = None
    fqn: str = ""


def _api(store: StateStore | None = None) -> Contract[[nn.Module], nn.Module, RefState]:
    @contract(RefState, store=store)
    def feature(module: nn.Module) -> None:
        pass

    return feature


def _plain(store: StateStore | None = None) -> Contract[[nn.Module], nn.Module, EmptyState]:
    @contract(store=store)
    def feature(module: nn.Module) -> None:
        pass

    return feature


# ------------------------------------------------------------------- weak keys


def test_store_drops_a_module_once_it_dies() -> None:
    store = StateStore()
    feature = _api(store)
    layer = nn.Linear(2, 2)
    feature(layer)
    assert len(store) == 1
    del layer
    gc.collect()
    assert len(store) == 0


def test_store_never_keeps_a_module_alive() -> None:
    feature = _api(StateStore())
    layer = nn.Linear(2, 2)
    feature(layer)
    feature.update(layer, lambda record: attrs.evolve(record, fqn="l1"))
    alive = weakref.ref(layer)
    del layer
    gc.collect()
    assert alive() is None


def test_len_counts_modules_not_records() -> None:
    store = StateStore()
    first, second = _api(store), _plain(store)
    layer = nn.Linear(2, 2)
    first(layer)
    second(layer)
    assert len(store) == 1


@settings(max_examples=examples(20))  # each example runs a full gc.collect()
@given(alive=st.lists(st.booleans(), max_size=12))
def test_len_is_the_number_of_live_modules_holding_records(alive: list[bool]) -> None:
    store = StateStore()
    feature = _plain(store)
    modules = [feature(nn.Identity()) for _ in alive]
    kept = [module for module, keep in zip(modules, alive, strict=True) if keep]
    del modules
    gc.collect()
    assert len(store) == len(kept)


def test_store_contains_exactly_the_modules_it_holds_records_for() -> None:
    store = StateStore()
    feature = _plain(store)
    applied, other = nn.Linear(2, 2), nn.Linear(2, 2)
    feature(applied)
    assert applied in store
    assert other not in store
    assert "applied" not in store


def test_records_lists_a_modules_records_by_api_in_install_order() -> None:
    store = StateStore()
    first, second = _api(store), _plain(store)
    layer = nn.Linear(2, 2)
    first(layer)
    second(layer)
    found: Any = store.records(layer)  # Any: the write below is what the types forbid
    assert list(found.items()) == [(first, RefState()), (second, EmptyState())]
    with pytest.raises(TypeError):
        found[first] = RefState()


def test_repr_gives_the_number_of_live_modules() -> None:
    store = StateStore()
    _plain(store)(nn.Linear(2, 2))
    gc.collect()
    assert repr(store) == "<StateStore holding records for 0 modules>"


# ------------------------------------------------------------------- default and isolated


def test_contracts_without_a_store_share_the_default_store() -> None:
    assert _plain().store is _api().store


def test_contract_given_its_own_store_keeps_records_only_there() -> None:
    store = StateStore()
    shared, isolated = _plain(), _plain(store)
    layer = nn.Linear(2, 2)
    isolated(layer)
    assert isolated.store is store
    assert layer in store
    assert layer not in shared.store
    shared(layer)
    assert list(store.records(layer)) == [isolated]


# ------------------------------------------------------------------- odd modules


class EqualToAll(nn.Module):
    """Compares equal to every module and hashes alike: only identity tells them apart."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


class Unhashable(nn.Module):  # noqa: PLW1641 (unhashable is the point)
    """Defines ``__eq__`` without ``__hash__``, so Python sets ``__hash__`` to None."""

    def __eq__(self, other: object) -> bool:
        return other is self


# `__hash__ = None` in a class body is what mypy refuses to type; type() says the same thing.
HashIsNone: type[nn.Module] = type("HashIsNone", (nn.Module,), {"__hash__": None})


class Refuses(nn.Module):
    """Any comparison or hash is a bug in code that keys modules."""

    def __eq__(self, other: object) -> bool:
        raise AssertionError("compared a module")

    def __hash__(self) -> int:
        raise AssertionError("hashed a module")


def _outer(child: nn.Module) -> nn.Module:
    outer = nn.Module()
    outer.add_module("child", child)
    return outer


@pytest.mark.parametrize("cls", [EqualToAll, Unhashable, HashIsNone, Refuses])
def test_modules_with_odd_equality_or_hashing_get_their_own_records(
    cls: type[nn.Module],
) -> None:
    feature = _api(StateStore())
    first, second = cls(), cls()
    feature(first)
    feature(second)
    feature.update(first, lambda record: attrs.evolve(record, fqn="first"))
    assert feature.state(first).fqn == "first"
    assert feature.state(second).fqn == ""
    assert list(registry(first)) == [feature]


@pytest.mark.parametrize("cls", [EqualToAll, Unhashable, HashIsNone, Refuses])
def test_describe_works_for_modules_with_odd_equality_or_hashing(
    cls: type[nn.Module],
) -> None:
    feature = _plain()
    outer = _outer(cls())
    feature(outer)
    feature(outer.get_submodule("child"))
    assert describe(outer) == f"Module  [feature]\n  child: {cls.__name__}  [feature]"


def test_applying_adds_nothing_to_the_modules_dict() -> None:
    feature = _api()
    layer = nn.Linear(2, 2)
    before = dict(vars(layer))
    feature(layer)
    feature.update(layer, lambda record: attrs.evolve(record, fqn="x"))
    assert vars(layer).keys() == before.keys()
    assert all(vars(layer)[key] is value for key, value in before.items())


# ------------------------------------------------------------------- records holding modules


@attrs.frozen
class InnerState:
    held: object = None


@pytest.mark.parametrize(
    "value",
    [
        nn.Linear(1, 1),
        (1, nn.Linear(1, 1)),
        [nn.Linear(1, 1)],
        {"a": nn.Linear(1, 1)},
        InnerState(held=[nn.Linear(1, 1)]),
    ],
    ids=["module", "in-tuple", "in-list", "dict-value", "in-nested-record"],
)
def test_set_state_rejects_a_record_holding_a_module_and_says_why(value: object) -> None:
    feature = _api()
    layer = nn.Linear(2, 2)
    feature(layer)
    with pytest.raises(InvalidRecordError) as info:
        feature.set_state(layer, RefState(target=value))
    message = str(info.value)
    assert f"{feature.name}.set_state: field 'target' of RefState holds an nn.Module" in message
    assert "keep the module alive forever" in message
    assert "store its FQN or a weakref.ref to it instead" in message
    assert feature.state(layer) == RefState()


def test_set_state_rejects_a_module_used_as_a_dict_key() -> None:
    feature = _api()
    layer = nn.Linear(2, 2)
    feature(layer)
    with pytest.raises(InvalidRecordError, match=r"holds an nn\.Module"):
        feature.set_state(layer, RefState(target={layer: 1}))


def test_update_rejects_a_record_holding_its_own_module_and_keeps_the_old_one() -> None:
    feature = _api()
    layer = nn.Linear(2, 2)
    feature(layer)
    with pytest.raises(InvalidRecordError) as info:
        feature.update(layer, lambda record: attrs.evolve(record, target=layer))
    assert f"{feature.name}.update: field 'target'" in str(info.value)
    assert feature.state(layer) == RefState()


def test_record_holding_a_weak_reference_or_fqn_is_accepted() -> None:
    feature = _api(StateStore())
    model = nn.Sequential(nn.Linear(2, 2))
    feature(model)
    feature.set_state(model, RefState(target=weakref.ref(model[0]), fqn="0"))
    target = feature.state(model).target
    assert isinstance(target, weakref.ref)
    assert target() is model[0]
