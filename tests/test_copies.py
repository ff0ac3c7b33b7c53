"""Copies of a module carry no contract state; Contract objects pickle by reference."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import attrs
import pytest
import torch
from torch import nn

from torchcontract import contract, describe, registry


@attrs.frozen
class TagState:
    tag: str = ""


@contract(TagState)
def tagged(module: nn.Module, *, tag: str) -> None:
    tagged.set_state(module, TagState(tag))


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    tagged(model, tag="root")
    tagged(model[0], tag="first")
    return model


def _torch_round_trip(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


@pytest.mark.parametrize(
    "duplicate",
    [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m)), _torch_round_trip],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_copy_of_a_module_carries_no_state_or_registry_entry(
    duplicate: Callable[[nn.Module], object],
) -> None:
    model = _model()
    twin = duplicate(model)
    assert isinstance(twin, nn.Sequential)
    assert twin is not model
    assert tagged.get_state(twin) is None
    assert len(registry(twin)) == 0
    assert describe(twin) == "Sequential  (3 modules below, no APIs)"


def test_deep_copies_of_submodules_carry_no_state() -> None:
    model = _model()
    twin = copy.deepcopy(model)
    assert tagged.get_state(twin[0]) is None


def test_shallow_copy_gets_no_record_but_shares_the_submodules_and_their_records() -> None:
    model = _model()
    twin = copy.copy(model)
    assert tagged.get_state(twin) is None
    assert twin[0] is model[0]
    assert tagged.state(twin[0]) == TagState("first")


def test_copying_leaves_the_originals_state_alone() -> None:
    model = _model()
    copy.deepcopy(model)
    pickle.dumps(model)
    assert tagged.state(model) == TagState("root")
    assert tagged.state(model[0]) == TagState("first")


def test_api_can_be_applied_to_a_copy_afresh() -> None:
    twin = copy.deepcopy(_model())
    tagged(twin, tag="copy")
    assert tagged.state(twin) == TagState("copy")


def test_state_dict_keys_are_those_of_a_module_without_apis() -> None:
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert list(_model().state_dict()) == list(plain.state_dict())


def test_contract_pickles_by_reference() -> None:
    assert pickle.loads(pickle.dumps(tagged)) is tagged


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_copying_a_contract_gives_the_same_contract(
    duplicate: Callable[[object], object],
) -> None:
    assert duplicate(tagged) is tagged


def test_pickled_object_holding_a_contract_and_a_module_restores_the_same_contract() -> None:
    holder = {"api": tagged, "model": _model()}
    restored = pickle.loads(pickle.dumps(holder))
    assert restored["api"] is tagged
    assert tagged.get_state(restored["model"]) is None


def test_deepcopy_taken_while_the_api_applies_carries_no_state() -> None:
    copies: list[nn.Module] = []

    @contract(TagState)
    def feature(module: nn.Module) -> None:
        copies.append(copy.deepcopy(module))

    layer = nn.Linear(2, 2)
    feature(layer)
    assert feature.is_applied(layer)
    assert feature.get_state(copies[0]) is None
