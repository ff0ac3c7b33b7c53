"""Error messages in full, and the edge cases around them: what a user reads is part of the API.

Each test pins a whole message, or the part a branch adds, where the other tests
match only a fragment; ``make mutate`` found these branches unpinned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import pytest
import torch
from strategies import Holder
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint as torch_checkpoint

from torchcontract import (
    AnyContract,
    ArgumentBindingError,
    ContractError,
    CyclicModuleTreeError,
    Incompatible,
    IncompatibleAPIError,
    InvalidRecordError,
    InvalidResultError,
    InvalidStateClassError,
    InvalidTargetError,
    RegistryEntry,
    RulePredicateError,
    StateStore,
    UnknownTorchAPIError,
    contract,
    take_snapshot,
)
from torchcontract._fqn import check_strict

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
