"""contract() and applying a Contract: decoration, targets, install, result, FQN and strict
checks, and atomic apply."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from torchcontract import (
    AlreadyAppliedError,
    Contract,
    ContractError,
    EmptyState,
    FQNChangedError,
    InvalidResultError,
    InvalidStateClassError,
    InvalidTargetError,
    NotAppliedError,
    contract,
    registry,
)


@attrs.frozen
class CountState:
    calls: int = 0


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2, 2)
        self.l2 = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.l2(self.l1(x))
        return out


class Traced(nn.Linear):
    """A subclass swapped in during apply, as fully_shard does."""


class Unrelated(nn.Module):
    """A class that is not a subclass of the module's original class."""


@contract(CountState)
def counted(module: nn.Module | Sequence[nn.Module]) -> None:
    """Applies to a module or a list of modules and changes nothing."""


def bump(record: CountState) -> CountState:
    return attrs.evolve(record, calls=record.calls + 1)


def untyped(function: Callable[..., object]) -> Callable[..., object]:
    """``function`` with its signature erased, to pass arguments its types forbid."""
    return function


# ------------------------------------------------------------------- decoration


class PlainState:
    calls: int = 0


@dataclasses.dataclass(frozen=True)
class DataclassState:
    calls: int = 0


@pytest.mark.parametrize(
    ("state_cls", "shown"),
    [(PlainState, "PlainState"), (DataclassState, "DataclassState"), (CountState(), "CountState")],
)
def test_state_class_that_is_not_an_attrs_class_is_rejected(state_cls: object, shown: str) -> None:
    with pytest.raises(InvalidStateClassError) as info:
        untyped(contract)(state_cls)
    message = str(info.value)
    assert shown in message
    assert "must be an attrs class" in message
    assert "@attrs.frozen" in message


@attrs.define
class SlottedMutableState:
    calls: int = 0


@attrs.define(slots=False)
class DictMutableState:
    calls: int = 0


@pytest.mark.parametrize("state_cls", [SlottedMutableState, DictMutableState])
def test_state_class_that_is_not_frozen_is_rejected(state_cls: type[object]) -> None:
    with pytest.raises(InvalidStateClassError) as info:
        contract(state_cls)
    message = str(info.value)
    assert state_cls.__qualname__ in message
    assert "must be frozen" in message
    assert "@attrs.frozen" in message


@attrs.frozen
class NoDefaultState:
    calls: int
    name: str
    kept: int = 0


def test_state_class_with_a_field_without_default_is_rejected_naming_the_fields() -> None:
    with pytest.raises(InvalidStateClassError) as info:
        contract(NoDefaultState)
    message = str(info.value)
    assert "NoDefaultState" in message
    assert "['calls', 'name']" in message
    assert "no default" in message
    assert "kept" not in message


@attrs.frozen
class HoldsModuleState:
    layer: nn.Module = attrs.field(factory=lambda: nn.Linear(1, 1))


def test_state_class_whose_default_record_holds_a_module_is_rejected() -> None:
    with pytest.raises(InvalidStateClassError) as info:
        contract(HoldsModuleState)
    message = str(info.value)
    assert "HoldsModuleState" in message
    assert "'layer'" in message
    assert "nn.Module" in message
    assert "FQN" in message
    assert "weakref" in message


def test_invalid_state_class_error_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        contract(PlainState)


def test_contract_without_state_class_records_an_empty_state() -> None:
    @contract()
    def feature(module: nn.Module) -> None:
        pass

    module = nn.Linear(2, 2)
    feature(module)
    assert feature.state(module) == EmptyState()
    assert feature.state_cls is EmptyState


def test_decorated_function_becomes_a_contract_with_the_function_identity() -> None:
    assert isinstance(counted, Contract)
    assert counted.__name__ == "counted"
    assert counted.__doc__ is not None
    assert counted.__doc__.startswith(
        "Applies to a module or a list of modules and changes nothing.\n\n"
    )
    assert counted.name == f"{__name__}.counted"
    assert counted.state_cls is CountState


# ------------------------------------------------------------------- targets


@pytest.mark.parametrize(
    ("target", "shown"),
    [(3, "got int"), ("l1", "got str"), (None, "got NoneType"), ({"a": nn.Linear(1, 1)}, "dict")],
)
def test_first_argument_that_is_not_a_module_or_list_is_rejected(
    target: object, shown: str
) -> None:
    with pytest.raises(InvalidTargetError) as info:
        untyped(counted)(target)
    message = str(info.value)
    assert counted.name in message
    assert "expected an nn.Module or a non-empty list" in message
    assert shown in message


def test_invalid_target_error_is_both_a_type_error_and_a_value_error() -> None:
    with pytest.raises(TypeError):
        untyped(counted)(3)
    with pytest.raises(ValueError, match="non-empty list"):
        untyped(counted)(3)


def test_call_without_a_module_is_rejected() -> None:
    with pytest.raises(InvalidTargetError, match="pass the module"):
        untyped(counted)()


def test_module_passed_by_keyword_is_rejected() -> None:
    with pytest.raises(InvalidTargetError, match="as the first positional argument"):
        untyped(counted)(module=nn.Linear(2, 2))


def test_empty_list_is_rejected() -> None:
    with pytest.raises(InvalidTargetError) as info:
        counted([])
    assert counted.name in str(info.value)
    assert "empty list" in str(info.value)


def test_list_with_an_item_that_is_not_a_module_is_rejected_and_installs_nothing() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(InvalidTargetError) as info:
        untyped(counted)([layer, "l2"])
    assert "every item of the module list must be an nn.Module, got str" in str(info.value)
    assert not counted.is_applied(layer)


def test_list_naming_a_module_twice_is_rejected() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(InvalidTargetError) as info:
        counted([layer, nn.ReLU(), layer])
    message = str(info.value)
    assert "Linear appears twice" in message
    assert "pass each module once" in message
    assert not counted.is_applied(layer)


def test_list_roots_share_one_record_so_an_update_through_one_is_seen_through_all() -> None:
    model = TwoLayer()
    counted([model.l1, model.l2])
    counted.update(model.l1, bump)
    assert counted.state(model.l2) == CountState(calls=1)
    assert counted.state(model.l1) is counted.state(model.l2)


def test_module_listed_with_its_ancestor_is_not_a_root_and_gets_no_record() -> None:
    model = TwoLayer()
    counted([model.l1, model])
    assert counted.is_applied(model)
    assert not counted.is_applied(model.l1)
    assert counted.get_state(model.l1) is None
    assert counted not in registry(model.l1)


def test_tuple_of_modules_is_a_list_target() -> None:
    model = TwoLayer()
    counted((model.l1, model.l2))
    assert counted.is_applied(model.l1)
    assert counted.is_applied(model.l2)


def test_module_list_container_is_one_module_not_a_list() -> None:
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    counted(layers)
    assert counted.is_applied(layers)
    assert not counted.is_applied(layers[0])


def _tree(spec: object) -> nn.Module:
    if isinstance(spec, list):
        return nn.Sequential(*[_tree(child) for child in spec])
    return nn.Linear(1, 1)


# Nested lists describe a tree: a list is a Sequential of its items, a leaf a Linear.
trees = st.recursive(
    st.just("leaf"), lambda children: st.lists(children, min_size=1, max_size=4), max_leaves=12
)


def _is_inside(fqn: str, other: str) -> bool:
    return fqn != other and (other == "" or fqn.startswith(other + "."))


@given(spec=trees, data=st.data())
def test_list_apply_records_exactly_the_roots_and_shares_their_record(
    spec: object, data: st.DataObject
) -> None:
    model = nn.Sequential(_tree(spec))
    named = list(model.named_modules())
    chosen = data.draw(
        st.lists(st.sampled_from(range(len(named))), min_size=1, unique=True), label="chosen"
    )
    fqns = [named[index][0] for index in chosen]
    roots = [
        named[index][1]
        for index, fqn in zip(chosen, fqns, strict=True)
        if not any(_is_inside(fqn, other) for other in fqns)
    ]

    counted([named[index][1] for index in chosen])

    assert {id(m) for _, m in named if counted.is_applied(m)} == {id(m) for m in roots}
    counted.update(roots[0], bump)
    assert all(counted.state(root).calls == 1 for root in roots)


# ------------------------------------------------------------------- install


def test_default_record_and_entry_are_installed_before_the_function_runs() -> None:
    seen: list[object] = []

    @contract(CountState)
    def feature(module: nn.Module, depth: int) -> None:
        seen.append(feature.state(module))
        seen.append(registry(module)[feature].args)

    feature(nn.Linear(2, 2), 3)
    assert seen == [CountState(), (3,)]


def test_applying_twice_raises_already_applied_naming_api_and_module() -> None:
    layer = nn.Linear(2, 2)
    counted(layer)
    with pytest.raises(AlreadyAppliedError) as info:
        counted(layer)
    message = str(info.value)
    assert message.startswith(f"{counted.name} is already applied to Linear;")
    assert "read or update its state instead" in message
    assert "in_features" not in message


def test_already_applied_message_gives_the_fqn_inside_an_applied_ancestor() -> None:
    @contract()
    def outer(module: nn.Module) -> None:
        pass

    model = TwoLayer()
    outer(model)
    counted(model.l2)
    with pytest.raises(AlreadyAppliedError) as info:
        counted(model.l2)
    assert f"{counted.name} is already applied to Linear 'l2' of TwoLayer;" in str(info.value)


def test_list_apply_over_an_applied_module_raises_and_installs_nothing() -> None:
    model = TwoLayer()
    counted(model.l2)
    counted.update(model.l2, bump)
    with pytest.raises(AlreadyAppliedError):
        counted([model.l1, model.l2])
    assert not counted.is_applied(model.l1)
    assert counted.state(model.l2) == CountState(calls=1)


def test_same_api_applies_separately_to_a_module_and_to_its_descendant() -> None:
    model = TwoLayer()
    counted(model.l1)
    counted(model)
    counted.update(model, bump)
    assert counted.state(model) == CountState(calls=1)
    assert counted.state(model.l1) == CountState(calls=0)


def _make_feature() -> Contract[[nn.Module], nn.Module, CountState]:
    @contract(CountState)
    def feature(module: nn.Module) -> None:
        feature.update(module, bump)

    return feature


def test_contract_keeps_the_attributes_set_on_its_function() -> None:
    def tagged(module: nn.Module) -> None:
        """Tagged."""

    tagged.__dict__["owner"] = "team-a"
    api = contract()(tagged)
    assert api.__dict__["owner"] == "team-a"
    assert api.__doc__ is not None
    assert api.__doc__.startswith("Tagged.")
    assert api.__dict__["__wrapped__"] is tagged


def test_state_of_a_contract_made_at_run_time_names_it_and_the_module_when_not_applied() -> None:
    def made_late(module: nn.Module) -> None:
        pass

    api = contract()(made_late)
    with pytest.raises(NotAppliedError) as info:
        api.state(nn.Linear(1, 1))
    assert str(info.value) == (
        f"{api.name} is not applied to Linear; apply it first, "
        "or use get_state() to get None instead"
    )
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_arguments_of_a_contract_made_at_run_time_are_bound_by_name() -> None:
    def made_late(module: nn.Module, size: int, *, mode: str = "fast") -> None:
        pass

    api = contract()(made_late)
    module = nn.Linear(1, 1)
    api(module, 3)
    assert dict(registry(module)[api].arguments) == {"size": 3, "mode": "fast"}


def test_contracts_whose_functions_share_a_name_are_independent() -> None:
    first, second = _make_feature(), _make_feature()
    assert first.__qualname__ == second.__qualname__
    layer = nn.Linear(2, 2)
    first(layer)
    second(layer)
    second.update(layer, bump)
    assert first.state(layer) == CountState(calls=1)
    assert second.state(layer) == CountState(calls=2)
    assert list(registry(layer)) == [first, second]


# ------------------------------------------------------------------- result


def test_function_returning_none_gives_back_the_input_module() -> None:
    layer = nn.Linear(2, 2)
    assert counted(layer) is layer


def test_function_returning_none_gives_back_the_input_list() -> None:
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert counted(layers) is layers


def test_function_returning_its_module_gives_it_back() -> None:
    @contract()
    def feature(module: nn.Linear) -> nn.Linear:
        return module

    layer = nn.Linear(2, 2)
    assert feature(layer) is layer


def test_function_may_return_another_module_with_the_same_fqns() -> None:
    replacement = TwoLayer()

    @contract()
    def feature(module: TwoLayer) -> TwoLayer:
        return replacement

    model = TwoLayer()
    assert feature(model) is replacement
    assert feature.is_applied(model)


def test_returned_module_with_other_fqns_raises_fqn_changed() -> None:
    @contract()
    def feature(module: nn.Module) -> nn.Module:
        return nn.Linear(2, 2)

    model = TwoLayer()
    with pytest.raises(FQNChangedError, match="parameter FQNs"):
        feature(model)
    assert not feature.is_applied(model)


@pytest.mark.parametrize(("result", "shown"), [(1, "int"), ("model", "str"), ((), "tuple")])
def test_function_returning_a_non_module_raises_invalid_result(result: object, shown: str) -> None:
    @contract()
    def feature(module: nn.Module) -> Any:
        return result

    layer = nn.Linear(2, 2)
    with pytest.raises(InvalidResultError) as info:
        feature(layer)
    message = str(info.value)
    assert f"{feature.name} returned {shown};" in message
    assert "a replacement with the same FQNs, or None" in message
    assert not feature.is_applied(layer)


def test_invalid_result_error_is_a_type_error() -> None:
    @contract()
    def feature(module: nn.Module) -> Any:
        return 1

    with pytest.raises(TypeError):
        feature(nn.Linear(2, 2))


def test_list_apply_may_return_a_list_of_replacements() -> None:
    replacements = [nn.Linear(2, 2), nn.Linear(2, 2)]

    @contract()
    def feature(modules: list[nn.Linear]) -> list[nn.Linear]:
        return replacements

    assert feature([nn.Linear(2, 2), nn.Linear(2, 2)]) is replacements


def test_list_apply_returning_a_list_of_another_length_raises_invalid_result() -> None:
    @contract()
    def feature(modules: list[nn.Linear]) -> list[nn.Linear]:
        return modules[:1]

    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(InvalidResultError, match="returned list") as info:
        feature(layers)
    assert str(info.value).endswith("(applied to Linear and 1 more)")
    assert not feature.is_applied(layers[0])


def test_list_apply_returning_a_single_module_raises_invalid_result() -> None:
    @contract()
    def feature(modules: list[nn.Linear]) -> nn.Linear:
        return modules[0]

    with pytest.raises(InvalidResultError, match="returned Linear"):
        feature([nn.Linear(2, 2), nn.Linear(2, 2)])


# ------------------------------------------------------------------- FQN check


Change = Callable[[nn.Module], object]


def _mutating(change: Change) -> Contract[[nn.Module], nn.Module, EmptyState]:
    """An API whose function calls ``change(module)``."""

    @contract()
    def feature(module: nn.Module) -> None:
        change(module)

    return feature


def _fqn_error(change: Change, module: nn.Module) -> str:
    feature = _mutating(change)
    with pytest.raises(FQNChangedError) as info:
        feature(module)
    assert not feature.is_applied(module)
    message = str(info.value)
    assert message.startswith(f"{feature.name} changed the ")
    assert "Composable APIs must keep every FQN and its order" in message
    assert "keep new state in the API's record" in message
    return message


def test_fqn_changed_error_is_a_contract_error_and_a_runtime_error() -> None:
    assert issubclass(FQNChangedError, ContractError)
    assert issubclass(FQNChangedError, RuntimeError)


def test_added_parameter_raises_naming_it_only_after() -> None:
    message = _fqn_error(
        lambda m: m.register_parameter("extra", nn.Parameter(torch.zeros(1))), nn.Linear(2, 2)
    )
    assert "changed the parameter FQNs of Linear: only before: []; only after: ['extra']" in message


def test_removed_parameter_raises_naming_it_only_before() -> None:
    def remove_bias(module: nn.Module) -> None:
        del module.bias

    message = _fqn_error(remove_bias, nn.Linear(2, 2))
    assert "parameter FQNs of Linear: only before: ['bias']; only after: []" in message


def test_renamed_submodule_raises_with_both_lists() -> None:
    def rename(module: nn.Module) -> None:
        module.add_module("first", module._modules.pop("l1"))

    message = _fqn_error(rename, TwoLayer())
    assert (
        "parameter FQNs of TwoLayer: only before: ['l1.weight', 'l1.bias']; "
        "only after: ['first.weight', 'first.bias']"
    ) in message


def test_added_buffer_raises_with_kind_buffer() -> None:
    message = _fqn_error(lambda m: m.register_buffer("steps", torch.zeros(1)), nn.Linear(2, 2))
    assert "changed the buffer FQNs of Linear: only before: []; only after: ['steps']" in message


def test_added_submodule_without_parameters_raises_with_kind_module() -> None:
    message = _fqn_error(lambda m: m.add_module("hook", nn.Identity()), TwoLayer())
    assert "changed the module FQNs of TwoLayer: only before: []; only after: ['hook']" in message


def test_aliasing_a_submodule_changes_module_fqns_since_duplicates_count() -> None:
    message = _fqn_error(lambda m: m.add_module("alias", m.get_submodule("l1")), TwoLayer())
    assert "module FQNs of TwoLayer: only before: []; only after: ['alias']" in message


def test_reordered_parameters_raise_showing_the_first_differing_position() -> None:
    def swap(module: nn.Module) -> None:
        weight = module._parameters.pop("weight")
        module._parameters["weight"] = weight

    message = _fqn_error(swap, nn.Linear(2, 2))
    assert (
        "parameter FQNs of Linear: same names, new order: position 0 was 'weight', is now 'bias'"
    ) in message


@given(order=st.permutations(range(6)))
def test_reordered_submodules_raise_showing_the_first_differing_position(
    order: list[int],
) -> None:
    model = nn.Sequential(*[nn.Identity() for _ in range(6)])
    names = [str(index) for index in order]

    def reorder(module: nn.Module) -> None:
        children = [(name, module._modules[name]) for name in names]
        module._modules.clear()
        module._modules.update(children)

    feature = _mutating(reorder)
    moved = [index for index, name in enumerate(names) if name != str(index)]
    if not moved:
        assert feature(model) is model
        return
    with pytest.raises(FQNChangedError) as info:
        feature(model)
    position = moved[0]
    assert (
        f"module FQNs of Sequential: same names, new order: position {position + 1} "
        f"was '{position}', is now '{names[position]}'"
    ) in str(info.value)


def test_replacing_a_parameter_under_the_same_name_keeps_the_fqns() -> None:
    def replace(module: nn.Module) -> None:
        module.weight = nn.Parameter(torch.zeros(2, 2))

    feature = _mutating(replace)
    layer = nn.Linear(2, 2)
    assert feature(layer) is layer


def test_fqn_check_runs_for_every_list_target() -> None:
    @contract()
    def feature(modules: list[nn.Module]) -> None:
        modules[1].register_buffer("steps", torch.zeros(1))

    layers: list[nn.Module] = [nn.Linear(2, 2), nn.Conv1d(1, 1, 1)]
    with pytest.raises(FQNChangedError, match="buffer FQNs of Conv1d"):
        feature(layers)
    assert not feature.is_applied(layers[0])


# ------------------------------------------------------------------- strict checks


def _retype(cls: type[nn.Module], fqn: str = "") -> Change:
    def change(module: nn.Module) -> None:
        module.get_submodule(fqn).__class__ = cls

    return change


def test_class_change_to_a_subclass_is_allowed() -> None:
    layer = nn.Linear(2, 2)
    assert _mutating(_retype(Traced))(layer) is layer
    assert type(layer) is Traced


def test_class_change_to_an_unrelated_class_raises_contract_error() -> None:
    feature = _mutating(_retype(Unrelated))
    layer = nn.Linear(2, 2)
    with pytest.raises(ContractError) as info:
        feature(layer)
    assert type(info.value) is ContractError
    message = str(info.value)
    assert (
        f"{feature.name} changed the class of Linear at the root to Unrelated, "
        "which is not a subclass of it"
    ) in message
    assert "only swap in a subclass" in message
    assert "strict=False" in message
    assert not feature.is_applied(layer)


def test_class_change_of_a_submodule_names_its_fqn() -> None:
    with pytest.raises(ContractError, match="changed the class of Linear at 'l2' to Unrelated"):
        _mutating(_retype(Unrelated, "l2"))(TwoLayer())


def _assign_forward(fqn: str = "") -> Change:
    def change(module: nn.Module) -> None:
        # The same as `module.forward = ...`, which mypy rejects as a method assignment.
        vars(module.get_submodule(fqn))["forward"] = lambda x: x

    return change


def test_instance_level_forward_assignment_raises_contract_error() -> None:
    feature = _mutating(_assign_forward("l1"))
    model = TwoLayer()
    with pytest.raises(ContractError) as info:
        feature(model)
    assert type(info.value) is ContractError
    message = str(info.value)
    assert f"{feature.name} assigned forward on the instance of Linear at 'l1'" in message
    assert "register a forward pre-hook" in message
    assert "strict=False" in message
    assert not feature.is_applied(model)


def test_forward_assigned_before_apply_and_left_alone_passes() -> None:
    layer = nn.Linear(2, 2)
    vars(layer)["forward"] = lambda x: x
    assert counted(layer) is layer


def test_non_strict_contract_allows_class_change_and_forward_assignment() -> None:
    @contract(strict=False)
    def feature(module: nn.Module) -> None:
        module.get_submodule("l1").__class__ = Unrelated
        vars(module.get_submodule("l2"))["forward"] = lambda x: x

    model = TwoLayer()
    assert feature(model) is model
    assert isinstance(model.get_submodule("l1"), Unrelated)


def test_non_strict_contract_still_checks_fqns() -> None:
    @contract(strict=False)
    def feature(module: nn.Module) -> None:
        module.add_module("hook", nn.Identity())

    with pytest.raises(FQNChangedError):
        feature(TwoLayer())


# ------------------------------------------------------------------- atomic apply


class SimulatedError(Exception):
    pass


def _failing(fail: list[BaseException]) -> Contract[[nn.Module], nn.Module, CountState]:
    @contract(CountState)
    def feature(module: nn.Module) -> None:
        feature.update(module, bump)
        if fail:
            raise fail.pop()

    return feature


def test_failed_apply_reraises_and_leaves_no_record_and_no_entry() -> None:
    error = SimulatedError("in the API function")
    feature = _failing([error])
    layer = nn.Linear(2, 2)
    with pytest.raises(SimulatedError) as info:
        feature(layer)
    assert info.value is error
    assert not feature.is_applied(layer)
    assert feature.get_state(layer) is None
    assert feature not in registry(layer)


def test_apply_after_a_failed_apply_works() -> None:
    feature = _failing([SimulatedError()])
    layer = nn.Linear(2, 2)
    with pytest.raises(SimulatedError):
        feature(layer)
    assert feature(layer) is layer
    assert feature.state(layer) == CountState(calls=1)


def test_base_exception_in_the_function_rolls_back() -> None:
    feature = _failing([KeyboardInterrupt()])
    layer = nn.Linear(2, 2)
    with pytest.raises(KeyboardInterrupt):
        feature(layer)
    assert not feature.is_applied(layer)


def test_failed_list_apply_removes_the_record_of_every_target() -> None:
    @contract()
    def feature(modules: list[nn.Module]) -> None:
        raise SimulatedError

    layers: list[nn.Module] = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(SimulatedError):
        feature(layers)
    assert not any(feature.is_applied(layer) for layer in layers)
    assert all(len(registry(layer)) == 0 for layer in layers)


def test_api_applied_inside_a_failed_apply_is_undone() -> None:
    @contract()
    def outer(module: TwoLayer) -> None:
        counted(module.l1)
        raise SimulatedError

    model = TwoLayer()
    with pytest.raises(SimulatedError):
        outer(model)
    assert not counted.is_applied(model.l1)
    assert counted(model.l1) is model.l1


def test_state_written_to_another_api_during_a_failed_apply_is_undone() -> None:
    @contract()
    def outer(module: nn.Module) -> None:
        counted.update(module, bump)
        raise SimulatedError

    layer = nn.Linear(2, 2)
    counted(layer)
    before = counted.state(layer)
    with pytest.raises(SimulatedError):
        outer(layer)
    assert counted.state(layer) is before


def test_apply_that_fails_a_check_after_the_function_rolls_back() -> None:
    @contract(CountState)
    def feature(module: nn.Module) -> None:
        feature.update(module, bump)
        module.add_module("hook", nn.Identity())

    model = TwoLayer()
    with pytest.raises(FQNChangedError):
        feature(model)
    assert feature.get_state(model) is None
    assert len(registry(model)) == 0


def test_the_module_keeps_what_a_failed_function_did_to_it() -> None:
    model = TwoLayer()
    with pytest.raises(FQNChangedError):
        _mutating(lambda m: m.add_module("hook", nn.Identity()))(model)
    assert isinstance(model.get_submodule("hook"), nn.Identity)


# ----------------------------------------------------------------- introspection


def test_signature_is_the_functions_returning_what_a_call_returns() -> None:
    @contract()
    def api(module: nn.Module, *, depth: int = 0) -> None:
        """Does nothing."""

    signature = inspect.signature(api)
    assert list(signature.parameters) == ["module", "depth"]
    assert signature.return_annotation == "nn.Module"


def test_signature_of_a_function_returning_a_replacement_is_unchanged() -> None:
    def replacing(module: nn.Module) -> nn.Sequential:
        return nn.Sequential(module)

    assert inspect.signature(contract()(replacing)) == inspect.signature(replacing)


def test_help_shows_the_signature_the_documentation_and_the_contracts_methods() -> None:
    @contract(CountState)
    def api(module: nn.Module, *, depth: int = 0) -> None:
        """Does nothing, deeply."""

    text = pydoc.plain(pydoc.render_doc(api))
    assert "api(module: 'nn.Module', *, depth: 'int' = 0) -> 'nn.Module'" in text
    assert "Does nothing, deeply." in text
    assert "records of class CountState" in text
    for method in ("state(module)", "update(module, transition)", "is_applied(module)"):
        assert method in text


def test_a_contract_held_by_a_class_is_the_contract_itself() -> None:
    class Holder:
        api = counted

    assert Holder.api is counted
    assert Holder().api is counted


def test_the_contract_class_keeps_its_own_signature() -> None:
    assert "state_cls" in inspect.signature(Contract).parameters
