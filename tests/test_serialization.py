"""Copies of a model carry no contract state; contracts themselves copy by reference.

Documented: ``pickle``, ``copy.deepcopy`` and ``torch.save``/``torch.load`` copy a
model's modules, parameters and hooks but none of its records or registry entries,
which live in the store, not in the module. The copy starts with no API applied;
the original keeps exactly what it had.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import pickle
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from strategies import Count, bump, contents
from torch import nn

from torchcontract import Contract, NotAppliedError, StateStore, contract, registry

STORE = StateStore()


def _count_forward(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    """A hook at module level, so the models it is registered on can be pickled."""
    counted.update(module, bump)


@contract(Count, store=STORE)
def counted(module: nn.Module) -> None:
    module.register_forward_pre_hook(_count_forward)


@contract(Count, store=STORE)
def tagged(module: nn.Module, *, tag: str) -> None:
    tagged.update(module, bump)


@contract(Count, store=STORE)
def shared(modules: list[nn.Module]) -> None:
    pass


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    counted(model)
    tagged(model[0], tag="first")
    shared([model[0], model[2]])
    model(torch.zeros(1, 2))
    return model


def _pickled(model: nn.Module) -> nn.Module:
    copied: nn.Module = pickle.loads(pickle.dumps(model))
    return copied


def _deep_copied(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


Copier = Callable[[nn.Module], nn.Module]
COPIES: list[Copier] = [_pickled, _deep_copied, _saved_and_loaded]
IDS = ["pickle", "deepcopy", "torch.save"]


@pytest.mark.parametrize("copier", COPIES, ids=IDS)
def test_copy_of_a_model_carries_no_state(copier: Copier) -> None:
    model = _model()
    copied = copier(model)
    assert isinstance(copied, nn.Sequential)
    for module in copied.modules():
        assert list(registry(module)) == []
        assert dict(STORE.records(module)) == {}
        assert not counted.is_applied(module)
    for original, twin in zip(model.parameters(), copied.parameters(), strict=True):
        assert torch.equal(original, twin)


@pytest.mark.parametrize("copier", COPIES, ids=IDS)
def test_copying_a_model_leaves_the_original_state_untouched(copier: Copier) -> None:
    model = _model()
    before = contents(model, [STORE])
    copier(model)
    assert contents(model, [STORE]) == before
    assert counted.state(model) == Count(1)


@pytest.mark.parametrize("copier", COPIES, ids=IDS)
def test_copy_of_a_model_takes_the_apis_again_independently(copier: Copier) -> None:
    model = _model()
    copied = copier(model)
    assert isinstance(copied, nn.Sequential)
    tagged(copied[0], tag="copy")
    tagged.update(copied[0], bump)
    assert tagged.state(copied[0]) == Count(2)
    assert tagged.state(model[0]) == Count(1)
    assert registry(copied[0])[tagged].kwargs == {"tag": "copy"}
    assert registry(model[0])[tagged].kwargs == {"tag": "first"}


def test_state_dict_round_trips_with_weights_only_and_holds_no_state() -> None:
    model = _model()
    before = contents(model, [STORE])
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert list(loaded) == list(
        nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)).state_dict()
    )
    fresh = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    fresh.load_state_dict(loaded)
    for original, twin in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(original, twin)
    assert all(list(registry(module)) == [] for module in fresh.modules())
    assert contents(model, [STORE]) == before


def test_applying_an_api_adds_nothing_a_copy_could_carry() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    plain = {name: dict(vars(module)) for name, module in model.named_modules()}
    keys = list(model.state_dict())
    tagged(model, tag="root")
    shared([model[0], model[2]])
    assert {name: dict(vars(module)) for name, module in model.named_modules()} == plain
    assert list(model.state_dict()) == keys


# ----------------------------------------------------------------- contracts


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_contract_pickles_by_reference(protocol: int) -> None:
    assert pickle.loads(pickle.dumps(counted, protocol=protocol)) is counted


def test_contract_copies_by_reference() -> None:
    assert copy.copy(counted) is counted
    assert copy.deepcopy(counted) is counted
    holder = {"apis": [counted, tagged]}
    assert copy.deepcopy(holder)["apis"][0] is counted


@pytest.mark.parametrize("copier", COPIES, ids=IDS)
def test_hooks_copied_with_a_model_find_no_state_there(copier: Copier) -> None:
    # The copy keeps the hook the API registered, but not the API's record: a hook
    # that needs the record fails until the API is applied to the copy.
    copied = copier(_model())
    with pytest.raises(NotAppliedError, match="counted is not applied to Sequential"):
        copied(torch.zeros(1, 2))


MODULE_SOURCE = """
from __future__ import annotations

import attrs
from torch import nn

from torchcontract import contract


@attrs.frozen
class Flag:
    on: bool = False


@contract(Flag)
def flagged(module: nn.Module) -> None:
    flagged.set_state(module, Flag(True))
"""


def _import_as(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def aliased(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A module written to ``tmp_path`` and imported under an alias, not its file name."""
    path = tmp_path / "contract_source.py"
    path.write_text(textwrap.dedent(MODULE_SOURCE))
    monkeypatch.setitem(sys.modules, "aliased_apis", ModuleType("placeholder"))
    return _import_as(path, "aliased_apis")


def test_contract_from_a_module_imported_under_an_alias_round_trips(aliased: ModuleType) -> None:
    api = aliased.flagged
    assert isinstance(api, Contract)
    assert api.name == "aliased_apis.flagged"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(api, protocol=protocol)) is api
    assert copy.deepcopy(api) is api
    module = nn.Linear(1, 1)
    api(module)
    assert pickle.loads(pickle.dumps(api)).state(module) == aliased.Flag(True)


def test_contract_whose_module_no_longer_holds_it_does_not_pickle(
    aliased: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # By reference, as for functions: a contract replaced in its module (as a reload
    # does) cannot be pickled, rather than silently loading as the other object.
    api = aliased.flagged
    monkeypatch.setattr(aliased, "flagged", object())
    with pytest.raises(pickle.PicklingError, match="flagged"):
        pickle.dumps(api)
