"""Error messages in full, and the edge cases around them: what a user reads is part of the API.

Each test pins a whole message, or the part a branch adds, where the other tests
match only a fragment; ``make mutate`` found these branches unpinned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import attrs
import pytest
import torch
from strategies import Holder, Mixed
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint as torch_checkpoint

from torchcontract import (
    AnyContract,
    ArgumentBindingError,
    Contract,
    ContractError,
    CyclicModuleTreeError,
    Incompatible,
    IncompatibleAPIError,
    InvalidRecordError,
    InvalidResultError,
    InvalidStateClassError,
    InvalidTargetError,
    NotAppliedError,
    RegistryEntry,
    RulePredicateError,
    StateStore,
    UnknownTorchAPIError,
    contract,
    take_snapshot,
)
from torchcontract._fqn_checks import check_strict

# ----------------------------------------------------------------- targets and results


@contract()  # type: ignore[arg-type]  # an API must return its module(s) or None
def returns_a_number(modules: nn.Module | list[nn.Module]) -> object:
    return 5


def test_a_module_twice_in_the_list_is_refused_in_full() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(InvalidTargetError) as info:
        returns_a_number([layer, layer])
    assert str(info.value) == (
        f"{returns_a_number.name}: Linear appears twice in the module list; pass each module once"
    )


def test_a_wrong_result_for_one_module_names_it_alone() -> None:
    with pytest.raises(InvalidResultError) as info:
        returns_a_number(nn.Linear(2, 2))
    assert str(info.value) == (
        f"{returns_a_number.name} returned int; an API function returns the module (or list of "
        "modules) it was given, a replacement with the same FQNs, or None (applied to Linear)"
    )


def test_a_wrong_result_for_a_list_counts_the_other_modules() -> None:
    with pytest.raises(InvalidResultError) as info:
        returns_a_number([nn.Linear(2, 2), nn.ReLU(), nn.Tanh()])
    assert str(info.value).endswith("or None (applied to Linear and 2 more)")


# ----------------------------------------------------------------- records


@contract(Holder, store=StateStore())
def holding(module: nn.Module) -> None:
    pass


@attrs.frozen
class Keeps:
    """A state class whose default record holds a module."""

    layers: list[nn.Module] = attrs.field(factory=lambda: [nn.Linear(1, 1)])


def test_a_state_class_whose_default_holds_a_module_is_refused_in_full() -> None:
    with pytest.raises(InvalidStateClassError) as info:
        contract(Keeps)
    assert str(info.value) == (
        "contract(Keeps): field 'layers' of Keeps holds an nn.Module (itself, in a container, or "
        "through a bound method, a closure or a functools.partial), which would keep the module "
        "alive forever; store its FQN or a weakref.ref to it instead"
    )


def test_a_record_for_a_module_names_it_at_the_end() -> None:
    layer = holding(nn.Linear(2, 2))
    with pytest.raises(InvalidRecordError) as info:
        holding.set_state(layer, Holder(value=[layer]))
    assert str(info.value).endswith(
        "store its FQN or a weakref.ref to it instead (record for Linear)"
    )


def test_a_module_found_after_a_container_seen_before_is_refused() -> None:
    # The walk pops the last item first: both copies of ``shared`` come off before the
    # module does, and the second one, already seen, must not end the walk.
    layer = holding(nn.Linear(2, 2))
    shared = [1, 2]
    with pytest.raises(InvalidRecordError):
        holding.set_state(layer, Holder(value=(nn.ReLU(), shared, shared)))
    assert holding.state(layer) == Holder()


def test_a_record_of_a_subclass_of_the_state_class_is_accepted() -> None:
    @attrs.frozen
    class Base:
        n: int = 0

    @attrs.frozen
    class Derived(Base):
        note: str = ""

    @contract(Base, store=StateStore())
    def based(module: nn.Module) -> None:
        pass

    layer = based(nn.Linear(2, 2))
    based.set_state(layer, Derived(n=1, note="kept"))
    assert based.update(layer, lambda record: attrs.evolve(record, n=2)) == Derived(2, "kept")


def test_records_of_an_api_without_state_can_be_set_and_updated() -> None:
    @contract(store=StateStore())
    def stateless(module: nn.Module) -> None:
        pass

    layer = stateless(nn.Linear(2, 2))
    record = type(stateless.state(layer))()
    stateless.set_state(layer, record)
    assert stateless.update(layer, lambda old: old) is record


def test_the_state_method_on_the_class_reads_the_same_record() -> None:
    layer = holding(nn.Linear(2, 2))
    holding.set_state(layer, Holder(value=3))
    assert type(holding).state(holding, layer) == Holder(value=3)


def test_the_update_method_on_the_class_updates_the_same_record() -> None:
    layer = holding(nn.Linear(2, 2))
    assert type(holding).update(holding, layer, lambda _: Holder(value=4)) == Holder(value=4)
    assert holding.state(layer) == Holder(value=4)


# ----------------------------------------------------------------- update and set_state
#
# ``state`` and ``update`` are closures each contract builds when it is made, so the
# tests below make their contracts inside the test: a contract made at import would
# keep the closures it was made with, whatever changed since.


@attrs.frozen
class _Noted(Mixed):
    note: object = None


def _fresh_contracts() -> tuple[
    Contract[[nn.Module], nn.Module, Holder], Contract[[nn.Module], nn.Module, Mixed]
]:
    @contract(Holder, store=StateStore())
    def one_field(module: nn.Module) -> None:
        pass

    @contract(Mixed, store=StateStore())
    def three_fields(module: nn.Module) -> None:
        pass

    return one_field, three_fields


_T = TypeVar("_T")


def _constant(record: _T) -> Callable[[object], _T]:
    """A transition to ``record``, whatever the record was."""
    return lambda _: record


_MODULE_HELD = (
    "holds an nn.Module (itself, in a container, or through a bound method, a closure or a "
    "functools.partial), which would keep the module alive forever"
)
_KEEP = "store its FQN or a weakref.ref to it instead (record for Linear)"


def test_update_refuses_a_record_holding_its_module_in_every_field_in_full() -> None:
    one_field, three_fields = _fresh_contracts()
    layer = nn.Linear(2, 2)
    one_field(layer)
    three_fields(layer)
    cases: list[tuple[AnyContract, object, str]] = [
        (one_field, Holder(value=layer), "field 'value' of Holder"),
        (one_field, Holder(value=(1, layer)), "field 'value' of Holder"),
        (three_fields, Mixed(items=(layer,)), "field 'items' of Mixed"),
        (three_fields, Mixed(1, (2,), layer), "field 'last' of Mixed"),
        (three_fields, _Noted(note=layer.forward), "field 'note' of _Noted"),
    ]
    for api, record, field in cases:
        old = api.state(layer)
        with pytest.raises(InvalidRecordError) as by_update:
            api.update(layer, _constant(record))
        with pytest.raises(InvalidRecordError) as by_set_state:
            api.set_state(layer, record)
        for method, info in (("update", by_update), ("set_state", by_set_state)):
            assert str(info.value) == f"{api.name}.{method}: {field} {_MODULE_HELD}; {_KEEP}"
        assert api.state(layer) is old


def test_update_takes_records_of_atoms_containers_and_subclasses() -> None:
    one_field, three_fields = _fresh_contracts()
    layer = nn.Linear(2, 2)
    one_field(layer)
    three_fields(layer)
    for record in (Holder(value=1), Holder(value=(1, "two")), Holder(value=None)):
        assert one_field.update(layer, _constant(record)) is record
    for three in (Mixed(1, (2, 3), "four"), _Noted(1, note="noted"), _Noted(note=(5,))):
        assert three_fields.update(layer, _constant(three)) is three
        assert three_fields.state(layer) is three


def test_update_refuses_a_record_of_another_class_in_full() -> None:
    one_field, three_fields = _fresh_contracts()
    layer = nn.Linear(2, 2)
    three_fields(layer)
    untyped: Callable[..., object] = three_fields.update
    with pytest.raises(InvalidRecordError) as info:
        untyped(layer, lambda _: Holder(value=1))
    assert str(info.value) == (
        f"{three_fields.name}.update: expected a record of class Mixed, got Holder for "
        "Linear; build one with attrs.evolve(record, ...)"
    )
    assert three_fields.state(layer) == Mixed()
    assert one_field.get_state(layer) is None


def test_update_of_a_module_without_the_api_names_both_in_full() -> None:
    one_field, _ = _fresh_contracts()
    with pytest.raises(NotAppliedError) as info:
        one_field.update(nn.Linear(2, 2), lambda record: record)
    assert str(info.value) == (
        f"{one_field.name} is not applied to Linear; apply it first, "
        "or use get_state() to get None instead"
    )


def test_updates_inside_a_failed_apply_are_undone_in_full() -> None:
    one_field, three_fields = _fresh_contracts()
    layer = nn.Linear(2, 2)
    one_field(layer)
    before = one_field.state(layer)

    @contract(store=StateStore())
    def failing(module: nn.Module) -> None:
        one_field.update(module, lambda _: Holder(value=1))
        one_field.update(module, lambda _: Holder(value=2))
        three_fields(module)
        three_fields.update(module, lambda record: attrs.evolve(record, n=3))
        raise ValueError("the API failed")

    with pytest.raises(ValueError, match=r"^the API failed$"):
        failing(layer)
    assert one_field.state(layer) is before
    assert not three_fields.is_applied(layer)


# ----------------------------------------------------------------- the strict check


class _Other(nn.Module):
    pass


def _strict_error(change: Callable[[nn.Module], None]) -> str:
    """The strict check's message after ``change`` to the Linear inside a Sequential."""
    model = nn.Sequential(nn.Linear(1, 1))
    before = take_snapshot(model)
    change(model[0])
    with pytest.raises(ContractError) as info:
        check_strict("api", before, take_snapshot(model))
    return str(info.value)


def _new_class_and_forward(layer: nn.Module) -> None:
    layer.__class__ = _Other
    layer.__dict__["forward"] = lambda x: x


def _new_forward(layer: nn.Module) -> None:
    layer.__dict__["forward"] = lambda x: x


def test_a_class_change_and_a_forward_on_the_same_module_report_the_class() -> None:
    assert _strict_error(_new_class_and_forward) == (
        "api changed the class of Linear at '0' to _Other, which is not a subclass of it; an API "
        "may only swap in a subclass (as fully_shard does), or pass strict=False to contract() to "
        "allow it"
    )


def test_a_forward_assigned_in_an_apply_is_refused_in_full() -> None:
    assert _strict_error(_new_forward) == (
        "api assigned forward on the instance of Linear at '0'; register a forward pre-hook or "
        "hook instead, or pass strict=False to contract() to allow it"
    )


@pytest.mark.timeout(30)
def test_take_snapshot_names_a_cyclic_tree_by_the_label_given() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    model.back = model
    with pytest.raises(CyclicModuleTreeError) as info:
        take_snapshot(model, api_name="mine", label=lambda module: "the model")
    assert str(info.value).startswith("mine: the module tree of the model has a cycle")


# ----------------------------------------------------------------- rules


@contract(store=StateStore())
def plain(module: nn.Module) -> None:
    pass


@contract(store=StateStore())
def other(module: nn.Module) -> None:
    pass


@contract(store=StateStore())
def with_options(module: nn.Module, *, mode: str = "fast", level: int = 0) -> None:
    pass


def fast(entry: RegistryEntry) -> bool:
    return True


def test_rules_describe_themselves_as_written() -> None:
    assert Incompatible("replicate").describe() == "Incompatible('replicate')"
    assert Incompatible(plain).describe() == f"Incompatible({plain.name})"
    assert Incompatible(plain, when=fast).describe() == f"Incompatible({plain.name}, when=fast)"
    # A callable without a __qualname__ is named by its type.
    partial = functools.partial(fast)
    assert Incompatible(plain, when=partial).describe() == (
        f"Incompatible({plain.name}, when=partial)"
    )


def test_an_unknown_torch_api_name_is_refused_in_full() -> None:
    with pytest.raises(UnknownTorchAPIError) as info:
        Incompatible("replicat")  # type: ignore[call-overload]
    assert str(info.value) == (
        "Incompatible('replicat'): torch registers no composable API under that name (did you "
        "mean 'replicate'?); name one of 'checkpoint', 'fully_shard', 'replicate', or pass the "
        "contract itself"
    )


def _reads_missing(entry: RegistryEntry) -> bool:
    return bool(entry.arguments["speed"])


@pytest.mark.parametrize(
    ("api", "parameters"),
    [(with_options, "'mode', 'level'"), (plain, "none but the module")],
)
def test_a_predicate_reading_a_missing_argument_lists_the_parameters_there_are(
    api: AnyContract, parameters: str
) -> None:
    @contract(store=StateStore(), incompatible_with=[Incompatible(api, when=_reads_missing)])
    def reader(module: nn.Module) -> None:
        pass

    layer = nn.Linear(2, 2)
    api(layer)
    with pytest.raises(RulePredicateError) as info:
        reader(layer)
    assert f"which {api.name} does not have; its parameters are {parameters} (reading" in str(
        info.value
    )


def _reads_mode(entry: RegistryEntry) -> bool:
    return entry.arguments["mode"] == "slow"


def test_a_rule_reading_a_call_that_does_not_bind_says_fix_the_call_once() -> None:
    @contract(store=StateStore(), incompatible_with=[Incompatible(with_options, when=_reads_mode)])
    def strict_reader(module: nn.Module) -> None:
        pass

    kept = strict_reader(nn.Linear(2, 2))  # applied somewhere, so its rule reads every call
    with pytest.raises(ArgumentBindingError) as info:
        with_options(nn.Linear(2, 2), mood="slow")  # type: ignore[call-arg]
    message = str(info.value)
    assert message.endswith("(on Linear); fix the call")
    assert message.count("fix the call") == 1
    assert strict_reader.is_applied(kept)


def test_a_module_scoped_ban_does_not_reach_inside_and_a_later_tree_ban_still_does() -> None:
    @contract(
        store=StateStore(),
        incompatible_with=[Incompatible(plain, scope="module"), Incompatible(other)],
    )
    def picky(module: nn.Module) -> None:
        pass

    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    plain(model[0])
    picky(model)  # plain inside is allowed: its ban is for the same module only
    fresh = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    plain(fresh[0])
    other(fresh[1])
    with pytest.raises(IncompatibleAPIError) as info:
        picky(fresh)
    assert str(info.value) == (
        f"{picky.name} cannot be combined with {other.name}, already applied on Linear '1', "
        "inside Sequential; apply only one of them to this part of the model"
    )


def test_every_banned_api_around_the_target_is_found() -> None:
    @contract(store=StateStore(), incompatible_with=[Incompatible(plain), Incompatible(other)])
    def inner(module: nn.Module) -> None:
        pass

    model = nn.Sequential(nn.Linear(1, 1))
    plain(model)  # around: the first of the two banned APIs
    with pytest.raises(IncompatibleAPIError) as info:
        inner(model[0])
    assert f"cannot be combined with {plain.name}, already applied on Sequential" in str(info.value)


def test_torch_registry_is_not_searched_around_the_target() -> None:
    # A torch API around the target is not a conflict of a torch-name rule (torch's
    # registry cannot be searched upwards): the module around is reported for ours.
    @contract(
        store=StateStore(),
        incompatible_with=[Incompatible("checkpoint"), Incompatible(plain)],
    )
    def careful(module: nn.Module) -> None:
        pass

    model = nn.Sequential(nn.Linear(1, 1))
    torch_checkpoint(model)
    plain(model)
    with pytest.raises(IncompatibleAPIError) as info:
        careful(model[0])
    assert str(info.value).startswith(
        f"{careful.name} cannot be combined with {plain.name}, already applied on Sequential"
    )
    assert torch.equal(model(torch.ones(1, 1)), model(torch.ones(1, 1)))
